"""Vanilla PyTorch DDP: ResNet18 on handwritten digits, launched by ``torchrun``.

Every line of distributed plumbing is written out by hand here, on purpose:
process group, per-worker batch size, device per local rank, DDP wrapping,
rank-0 evaluation. Three pieces come from the notebook's exercises, imported
from ``ddp_exercises.py`` (or the file given with ``--exercises``; the notebook
writes your answers there): the sharded data with ``set_epoch``
(``sharded_epochs``), the training step with the loss all-reduced for logging
(``train_step``) and the rank-0 checkpoint with a barrier (``save_checkpoint``).
Module 02 migrates this script to Ray Train and deletes most of it.

Single node (2 CPU processes, or one process per GPU)::

    torchrun --standalone --nproc_per_node=2 train_ddp.py --epochs 3
    torchrun --standalone --nproc_per_node=2 train_ddp.py --smoke-test

Several nodes: see ``launch_multinode_ddp.sh``.

``torchrun`` starts ``nproc_per_node`` copies of this script and gives each one
``RANK`` (global id), ``LOCAL_RANK`` (id on this node, picks the GPU),
``WORLD_SIZE`` (number of processes in total) and ``MASTER_ADDR``/``MASTER_PORT``
(where rank 0 listens for the others). Device, backend (``nccl`` on GPUs,
``gloo`` on CPUs) and default sizes come from ``coursekit.detect()``, so the
same command runs on a laptop and on a GPU cluster.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import coursekit
from coursekit.data import load_digits
from coursekit.models import accuracy, build_resnet18, build_small_cnn
from coursekit.runtime import SIZES

# --model: the workshop's ResNet18, or the notebook's small CNN (what the two-node run trains on a machine of
# Binder's size: two torchrun agents and two ranks beside the notebook's kernel, in 2 GiB)
MODELS = {"resnet18": build_resnet18, "small_cnn": build_small_cnn}


def parse_args(rt: coursekit.Runtime, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=None,
                   help=f"epochs (default from the runtime: {rt.sizes['epochs']})")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="examples per optimizer step summed over ALL workers "
                        f"(default: {rt.sizes['global_batch_size']}); each worker gets global // world_size")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default: 1e-3)")
    p.add_argument("--model", choices=sorted(MODELS), default="resnet18",
                   help="resnet18 (default), or the small CNN of the notebook's exercises (less memory per rank)")
    p.add_argument("--train-samples", type=int, default=None,
                   help=f"training examples to use (default: {rt.sizes['train_samples']})")
    p.add_argument("--test-samples", type=int, default=None,
                   help=f"test examples for the final accuracy (default: {rt.sizes['test_samples']})")
    default_ckpt = Path(rt.storage_path) / "01_ddp_pytorch" / "checkpoints"
    p.add_argument("--checkpoint-dir", default=str(default_ckpt),
                   help=f"where rank 0 writes checkpoint.pt; on several nodes this must be shared storage "
                        f"(default: {default_ckpt})")
    p.add_argument("--metrics-out", default=None,
                   help="rank 0 writes {losses, test_accuracy, world_size, ...} as JSON here")
    p.add_argument("--data-dir", default=rt.data_dir, help=f"dataset cache (default: {rt.data_dir})")
    default_exercises = Path(__file__).with_name("ddp_exercises.py")
    p.add_argument("--exercises", default=str(default_exercises),
                   help="the Python file with sharded_epochs, train_step and save_checkpoint "
                        f"(default: {default_exercises.name} next to this script)")
    p.add_argument("--smoke-test", action="store_true",
                   help="tiny sizes (coursekit's 'smoke' profile) for CI and quick checks")
    args = p.parse_args(argv)
    sizes = SIZES["smoke"] if args.smoke_test else rt.sizes
    for name in ("epochs", "global_batch_size", "train_samples", "test_samples"):
        if getattr(args, name) is None:
            setattr(args, name, sizes[name])
    return args


def _nearest_multiples(n: int, k: int) -> str:
    lower, upper = n // k * k, (n // k + 1) * k
    return f"{lower} or {upper}" if lower > 0 else str(upper)


def per_worker_batch_size(global_batch_size: int, world_size: int) -> int:
    """The batch each DDP process loads: the global batch split evenly over the processes."""
    per_worker, left_over = divmod(global_batch_size, world_size)
    if left_over:
        raise ValueError(
            f"--global-batch-size {global_batch_size} is not divisible by the world size "
            f"{world_size}: every worker must process the same number of examples per step. "
            f"Use a multiple of {world_size}, e.g. {_nearest_multiples(global_batch_size, world_size)}.")
    return per_worker


def load_exercises(path: str):
    """The module holding the notebook's three exercises (sharded_epochs, train_step, save_checkpoint)."""
    if not Path(path).is_file():
        sys.exit(f"--exercises {path}: no such file")
    spec = importlib.util.spec_from_file_location("ddp_exercises", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def log0(rank: int, *msg) -> None:
    """Print from rank 0 only: N processes printing the same line is just noise."""
    if rank == 0:
        print(*msg, flush=True)


def main(argv: list[str] | None = None) -> None:
    rt = coursekit.detect()
    args = parse_args(rt, argv)

    # 1. Who am I? torchrun puts these in the environment of every process it starts.
    if "RANK" not in os.environ:
        sys.exit("train_ddp.py is started by torchrun, which sets RANK, LOCAL_RANK and WORLD_SIZE; e.g.\n"
                 "  torchrun --standalone --nproc_per_node=2 train_ddp.py --smoke-test")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])

    # Check the arguments before joining the group: a bad value fails fast on every rank.
    try:
        batch_size = per_worker_batch_size(args.global_batch_size, world_size)
    except ValueError as e:
        sys.exit(f"[rank {rank}] error: {e}")
    ex = load_exercises(args.exercises)   # ex.sharded_epochs, ex.train_step, ex.save_checkpoint

    # 2. One device per process: GPU number LOCAL_RANK on this node, or the CPU.
    if rt.use_gpu:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    # 3. Join the process group: blocks until all WORLD_SIZE processes have arrived
    #    at MASTER_ADDR:MASTER_PORT. nccl between GPUs, gloo between CPU processes.
    dist.init_process_group(backend=rt.backend, device_id=device if rt.use_gpu else None)
    log0(rank, f"world_size={world_size} backend={rt.backend} device={device.type} "
               f"global_batch={args.global_batch_size} per_worker_batch={batch_size} "
               f"epochs={args.epochs} train_samples={args.train_samples}")

    # 4. Data. Only rank 0 may download (N processes writing one cache = corrupt files);
    #    the others wait at the barrier, then read what rank 0 left on disk.
    if rank == 0:
        train = load_digits(train=True, limit=args.train_samples, data_dir=args.data_dir, download=True)
    dist.barrier()
    if rank != 0:
        train = load_digits(train=True, limit=args.train_samples, data_dir=args.data_dir, quiet=True)
    log0(rank, f"data: {train.source}, {len(train)} training images")

    # 5. Model: a fixed seed, so that every run of the job starts from the same weights.
    torch.manual_seed(0)
    model = MODELS[args.model]().to(device)
    model = DDP(model, device_ids=[local_rank] if rt.use_gpu else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    ckpt_dir = Path(args.checkpoint_dir)
    ckpt_path = ckpt_dir / "checkpoint.pt"
    ckpt_dir.mkdir(parents=True, exist_ok=True)   # on several nodes: shared storage, seen by every rank
    losses: list[float] = []
    start = time.perf_counter()
    # Exercise 1: each epoch, this rank's shard of the data (DistributedSampler), in a new order (set_epoch).
    for epoch, loader in ex.sharded_epochs(train.dataset(), batch_size, args.epochs, seed=0):
        model.train()
        seen, loss_sum = 0, 0.0
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            # Exercise 2: forward, backward (DDP averages the gradients), step; the loss of the
            # step averaged over ALL ranks (each rank only saw its shard), the same on every rank.
            step_loss = ex.train_step(model, optimizer, images, labels)
            loss_sum += step_loss * len(labels)   # every rank's batch has this size in this step
            seen += len(labels)
        epoch_loss = loss_sum / seen
        losses.append(epoch_loss)
        log0(rank, f"epoch {epoch + 1}/{args.epochs}  loss {epoch_loss:.4f}  "
                   f"({time.perf_counter() - start:.1f} s)")

        # 6. Exercise 3: the checkpoint from global rank 0 only (the replicas are identical, and N
        #    processes writing one file would corrupt it), the unwrapped model's state so that a plain
        #    model (no DDP) loads it; every rank waits until it is on disk.
        ex.save_checkpoint(model, optimizer, epoch, ckpt_path)

    # 7. Evaluate on rank 0 (every replica holds the same weights).
    if rank == 0:
        test = load_digits(train=False, limit=args.test_samples, data_dir=args.data_dir, quiet=True)
        acc = accuracy(model.module, test.tensors, test.labels, device=device)
        print(f"test accuracy: {acc:.3f} on {len(test)} images; checkpoint: {ckpt_path}", flush=True)
        if args.metrics_out:
            out = Path(args.metrics_out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({
                "losses": losses, "test_accuracy": acc, "world_size": world_size,
                "global_batch_size": args.global_batch_size, "per_worker_batch_size": batch_size,
                "epochs": args.epochs, "model": args.model, "train_samples": len(train), "test_samples": len(test),
                "data_source": train.source,
                "backend": rt.backend, "train_seconds": round(time.perf_counter() - start, 2),
                "checkpoint": str(ckpt_path)}, indent=1))

    # 8. Leave the group cleanly.
    #    Together: a rank that tore its gloo connections down while rank 0 still evaluated once aborted at exit
    #    ("terminate called without an active exception"), and rank 0's torchrun agent waited for it.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
