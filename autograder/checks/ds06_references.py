"""Module 06's references, computed by the grader itself (never taken from a kernel): the runs that the DeepSpeed
engines of the test cells must reproduce.

* ``one_process``: plain PyTorch, ONE process standing in for DDP on ``world_size`` ranks (each step's gradient is
  the mean over every rank's micro-batches, as DDP's all-reduce makes it), the check's data made here from the
  notebook's seeds. Exercise 1 (AdamW, clipping 1.0), Exercise 2 (SGD, no clipping) and the one step of the known
  engine that Exercises 3 and 4 save (AdamW, DeepSpeed's default clipping 1.0).
* ``bf16_reference``: a bf16 DeepSpeed engine on 2 gloo ranks forked from the grader's process, its loss computed
  in fp32 (the run the bf16 check compares with: bf16 rounding cannot be reproduced in fp32 PyTorch). Nothing of a
  submission runs in it.

Each is computed once per grading process (they do not depend on the submission) on one thread, as each rank runs;
the warm worker computes them all once before it forks the jobs (``PREPARE`` in ds06.py).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

TINY = dict(depth=1, width=32, heads=4, patch=7, lr=1e-2, seed=0)   # the notebook's TINY


def tiny_vit(seed: int = 0):
    from coursekit.models import ViT

    torch.manual_seed(seed)
    return ViT(depth=TINY["depth"], width=TINY["width"], heads=TINY["heads"], patch=TINY["patch"])


@functools.lru_cache(maxsize=None)
def check_data():
    """The notebook's CHECK_IMAGES, CHECK_LABELS (Exercises 1 and 2): 96 examples from generator seed 1."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(96, 1, 28, 28, generator=g), torch.randint(0, 10, (96,), generator=g)


@functools.lru_cache(maxsize=None)
def known_data():
    """The notebook's DATA (the known engine's micro-batches, Exercises 3 and 4): 64 examples from seed 1."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)


def check_batch(i: int, rank: int, world_size: int, micro: int):
    """Micro-batch i of `rank` in the notebook's check_batches: slice i * world_size + rank."""
    images, labels = check_data()
    s = slice((i * world_size + rank) * micro, (i * world_size + rank + 1) * micro)
    return images[s], labels[s]


def known_batch(step: int, rank: int, world_size: int, micro: int = 4):
    """The notebook's micro_batch(step, 0, rank, world_size) (MICRO = 4)."""
    images, labels = known_data()
    start = ((step * 2) * world_size + rank) * micro
    return images[start:start + micro], labels[start:start + micro]


def one_thread(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return wrapper


@one_thread
def one_process(world_size: int, steps: int, accumulation: int, batch, optimizer: str, lr: float, clip: float,
                seed: int = 0):
    """`steps` optimizer steps of one process on every rank's micro-batches: ``batch(i, rank)`` is rank's
    micro-batch i (i = step * accumulation + a). Returns (start weights, final weights, losses[rank] = that rank's
    micro-batch losses in order)."""
    model = tiny_vit(seed)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    make = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
    opt = make(model.parameters(), lr=lr)
    losses = [[] for _ in range(world_size)]
    for step in range(steps):
        for a in range(accumulation):
            for rank in range(world_size):
                images, labels = batch(step * accumulation + a, rank)
                loss = F.cross_entropy(model(images), labels)
                (loss / (accumulation * world_size)).backward()   # DDP's mean over ranks, DeepSpeed's over micro-batches
                losses[rank].append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return start, {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


@functools.lru_cache(maxsize=None)
def engine_training(global_batch_size: int, micro_batch_size: int, lr: float, steps: int, world_size: int = 2):
    """Exercise 1: the engine of the case trained `steps` optimizer steps like DDP (AdamW at lr, clipping 1.0)."""
    accumulation = global_batch_size // (micro_batch_size * world_size)
    return one_process(world_size, steps, accumulation, lambda i, r: check_batch(i, r, world_size, micro_batch_size),
                       "adamw", lr, 1.0)


@functools.lru_cache(maxsize=None)
def micro_batches_sgd(world_size: int = 2, micro: int = 6, accumulation: int = 2, steps: int = 2):
    """Exercise 2: DDP with SGD (lr 0.5, no clipping), 2 micro-batches per step (the check's DeepSpeed config)."""
    return one_process(world_size, steps, accumulation, lambda i, r: check_batch(i, r, world_size, micro), "sgd", 0.5,
                       0.0)


@functools.lru_cache(maxsize=None)
def known_steps(world_size: int, steps: int = 1):
    """Exercises 3 and 4: the weights of the known engine (ZeRO-2, AdamW at TINY's lr, DeepSpeed's default clipping
    1.0, one micro-batch of 4 per step) after `steps` steps on `world_size` ranks."""
    return one_process(world_size, steps, 1, lambda i, r: known_batch(i, r, world_size), "adamw", TINY["lr"], 1.0)


def _bf16_rank(rank, world_size, spec):
    """One rank of the bf16 reference: the check's bf16 engine, the loss in fp32 from its bf16 logits."""
    import logging

    import deepspeed

    from coursekit.distributed import deepspeed_pytorch_ops_only

    deepspeed_pytorch_ops_only()
    deepspeed.utils.logger.setLevel(logging.ERROR)
    model = tiny_vit()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=spec["lr"]),
        config={"train_micro_batch_size_per_gpu": spec["micro"], "gradient_accumulation_steps": spec["accumulation"],
                "zero_optimization": {"stage": spec["stage"]}, "bf16": {"enabled": True}, "steps_per_print": 10**9})
    losses = []
    for i in range(spec["micro_batches"]):
        images, labels = check_batch(i, rank, world_size, spec["micro"])
        loss = F.cross_entropy(engine(images.to(torch.bfloat16)).float(), labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}, losses


_bf16: dict = {}


def bf16_reference(spec: dict, world_size: int = 2):
    """Per rank: (weights as fp32, micro-batch losses) of the bf16 engine of `spec` trained with fp32 losses.
    Computed once per process (DeepSpeed's import and 2 ranks take about 5 s): by the warm worker before it forks the
    jobs (``PREPARE``). Never kept on disk, where code a grading job ran without the jail could change it."""

    key = tuple(sorted(spec.items()))
    if key in _bf16:
        return _bf16[key]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from coursekit.distributed import run_distributed

    _bf16[key] = run_distributed(_bf16_rank, world_size, spec, timeout_s=120)
    return _bf16[key]
