"""Module 07's baseline made distributed by hand: vanilla DDP, launched by torchrun.

    torchrun --standalone --nproc_per_node=2 train_ddp_torchrun.py --smoke-test

Everything module 01 wrote by hand: process group, DistributedSampler + set_epoch, the per-worker
batch, DDP, the loss all-reduced for logging, output from rank 0 only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from coursekit import detect
from coursekit.data import load_digits
from coursekit.models import ViT, accuracy
from coursekit.stepmeter import StepMeter
from coursekit.runtime import SIZES


def parse_args(argv=None) -> dict:
    rt = detect()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--smoke-test", action="store_true", help="the smallest sizes (CI)")
    p.add_argument("--metrics-out", default=None, help="write losses, accuracy, throughput and memory here")
    p.add_argument("--checkpoint-dir", default=os.path.join(rt.storage_path, "07_scaling_up", "checkpoints"))
    args = p.parse_args(argv)
    sizes = SIZES["smoke"] if args.smoke_test else rt.sizes
    return {"epochs": args.epochs or sizes["epochs"], "lr": args.lr,
            "global_batch_size": args.global_batch_size or sizes["global_batch_size"],
            "train_samples": sizes["train_samples"], "test_samples": sizes["test_samples"],
            "vit": {k: sizes[f"vit_{k}"] for k in ("depth", "width", "heads", "patch")},
            "metrics_out": args.metrics_out, "checkpoint_dir": args.checkpoint_dir, "seed": 0}


def build_model(cfg: dict) -> ViT:
    torch.manual_seed(cfg["seed"])
    return ViT(**cfg["vit"])


def train(cfg: dict) -> dict:
    rt = detect()
    if "RANK" not in os.environ:
        sys.exit("train_ddp_torchrun.py is started by torchrun, which sets RANK, LOCAL_RANK and WORLD_SIZE:\n"
                 "  torchrun --standalone --nproc_per_node=2 train_ddp_torchrun.py --smoke-test")
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device = torch.device("cuda", local_rank) if rt.use_gpu else torch.device("cpu")   # a GPU per local rank
    if rt.use_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(backend=rt.backend)             # torchrun's env:// rendezvous
    model = DDP(build_model(cfg).to(device), device_ids=[local_rank] if rt.use_gpu else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    digits = load_digits(train=True, limit=cfg["train_samples"], quiet=True).dataset()
    order = DistributedSampler(digits, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg["seed"])
    batches = DataLoader(digits, batch_size=cfg["global_batch_size"] // world_size, sampler=order, drop_last=True)
    meter = StepMeter(warmup=2, steps=cfg.get("measure_steps", 8))
    losses = []
    for epoch in range(cfg["epochs"]):
        order.set_epoch(epoch)
        model.train()
        epoch_sums = torch.zeros(2, device=device)           # loss x samples, samples
        for inputs, targets in batches:
            inputs, targets = inputs.to(device), targets.to(device)
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            meter.tick(model, optimizer, len(targets))
            optimizer.step()
            epoch_sums += torch.tensor([loss.item() * len(targets), len(targets)], device=device)
        dist.all_reduce(epoch_sums)
        losses.append((epoch_sums[0] / epoch_sums[1]).item())
        if rank == 0:
            print(f"epoch {epoch}: loss {losses[-1]:.4f}", flush=True)
            os.makedirs(cfg["checkpoint_dir"], exist_ok=True)   # on several nodes: shared storage
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(cfg["checkpoint_dir"], "checkpoint.pt"))
        dist.barrier()                                       # nobody reads it before it is written
    results = meter.results()
    memory_by_rank = [None] * world_size
    dist.all_gather_object(memory_by_rank, results.pop("memory"))
    held_out = load_digits(train=False, limit=cfg["test_samples"], quiet=True)
    results = {"losses": losses,
               "test_accuracy": accuracy(model.module, held_out.tensors, held_out.labels, device=device),
               **results, "memory_by_rank": memory_by_rank}
    dist.destroy_process_group()                             # every rank leaves the group
    return results if rank == 0 else {}


if __name__ == "__main__":
    config = parse_args()
    results = train(config)
    if results:
        print({k: v for k, v in results.items() if k != "memory_by_rank"})
    if results and config["metrics_out"]:
        with open(config["metrics_out"], "w") as f:
            json.dump(results, f)
