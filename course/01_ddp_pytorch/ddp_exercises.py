"""The three pieces of DDP that ``train_ddp.py`` imports: your answers to the notebook's exercises.

    sharded_epochs(dataset, batch_size, epochs, seed=0)   exercise 1: DistributedSampler + set_epoch
    train_step(ddp_model, optimizer, images, labels)      exercise 2: one DDP step, loss averaged over all ranks
    save_checkpoint(ddp_model, optimizer, epoch, path)    exercise 3: global rank 0 saves, every rank waits

The notebook writes the functions of YOUR notebook cells into a copy of this file next to its run's outputs and
starts ``train_ddp.py --exercises <that copy>``. Run from a terminal without ``--exercises``, the script imports
this file: finish it with your answers first (each function below raises NotImplementedError until you do).
"""
from __future__ import annotations

import os  # noqa: F401  (for answers that read torchrun's RANK / WORLD_SIZE)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def sharded_epochs(dataset, batch_size, epochs, seed=0):
    """Yield (epoch, loader) for epoch = 0 .. epochs-1; loader iterates this rank's shard in that epoch's order."""
    # YOUR CODE HERE (the notebook's exercise: finish it there, then copy it here)
    raise NotImplementedError()


def train_step(ddp_model, optimizer, images, labels):
    """One DDP step on this rank's images/labels; returns the step's loss averaged over all ranks (a float)."""
    # YOUR CODE HERE (the notebook's exercise: finish it there, then copy it here)
    raise NotImplementedError()


def save_checkpoint(ddp_model, optimizer, epoch, path):
    """Global rank 0 writes {"model", "optimizer", "epoch"} to path; every rank returns once it is on disk."""
    # YOUR CODE HERE (the notebook's exercise: finish it there, then copy it here)
    raise NotImplementedError()
