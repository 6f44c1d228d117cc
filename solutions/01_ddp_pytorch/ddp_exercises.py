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
    ### BEGIN SOLUTION
    sampler = DistributedSampler(dataset, seed=seed)   # rank and world size: from the process group
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    for epoch in range(epochs):   # one loader, reshuffled at the start of each epoch
        sampler.set_epoch(epoch)   # a new permutation every epoch, the same on every rank
        yield epoch, loader
    ### END SOLUTION


def train_step(ddp_model, optimizer, images, labels):
    """One DDP step on this rank's images/labels; returns the step's loss averaged over all ranks (a float)."""
    ### BEGIN SOLUTION
    optimizer.zero_grad()
    loss = F.cross_entropy(ddp_model(images), labels)   # the mean over this rank's examples
    loss.backward()                                     # DDP averages the gradients over the ranks here
    optimizer.step()
    reported = loss.detach().clone()                    # a copy outside the autograd graph
    dist.all_reduce(reported, op=dist.ReduceOp.SUM)     # the sum of every rank's mean ...
    return reported.item() / dist.get_world_size()      # ... divided by the number of ranks
    ### END SOLUTION


def save_checkpoint(ddp_model, optimizer, epoch, path):
    """Global rank 0 writes {"model", "optimizer", "epoch"} to path; every rank returns once it is on disk."""
    ### BEGIN SOLUTION
    if dist.get_rank() == 0:   # the GLOBAL rank: there is a LOCAL_RANK 0 on every node
        state = {"model": ddp_model.module.state_dict(),   # unwrapped: keys without "module."
                 "optimizer": optimizer.state_dict(), "epoch": epoch}
        torch.save(state, path)
    dist.barrier()   # every rank waits here until rank 0 has written the whole file
    ### END SOLUTION
