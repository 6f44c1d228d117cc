"""Module 07's baseline under Ray Train: DDP, launched as one Python command.

    python train_ray_ddp.py --smoke-test                     # 2 CPU workers here
    python train_ray_ddp.py --num-workers 8 --use-gpu        # on a GPU cluster (RAY_ADDRESS or Anyscale)

Ray Train starts the workers and the process group; prepare_model wraps DDP and picks the device,
prepare_data_loader adds the DistributedSampler; checkpoints go to the run's storage.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ray.train
import ray.train.torch
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_data_loader, prepare_model

from coursekit import detect
from coursekit.data import load_digits
from coursekit.localmode import fit_trainer
from coursekit.models import ViT, accuracy
from coursekit.stepmeter import StepMeter
from coursekit.raysetup import init_ray, storage_path
from coursekit.runtime import SIZES
from coursekit.scaling import check_scaling, worker_resources


def parse_args(argv=None) -> dict:
    rt = detect()
    workers = worker_resources(rt)   # the cluster's workers (joined first), or this machine
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--smoke-test", action="store_true", help="the smallest sizes (CI)")
    p.add_argument("--metrics-out", default=None, help="write losses, accuracy, throughput and memory here")
    p.add_argument("--num-workers", type=int, default=workers.default_workers,
                   help="default: one per GPU of the cluster's workers, else 2")
    p.add_argument("--use-gpu", action=argparse.BooleanOptionalAction, default=workers.use_gpu,
                   help="one GPU per worker (default: yes where the cluster's workers have GPUs)")
    args = p.parse_args(argv)
    sizes = SIZES["smoke"] if args.smoke_test else rt.sizes
    return {"epochs": args.epochs or sizes["epochs"], "lr": args.lr,
            "global_batch_size": args.global_batch_size or sizes["global_batch_size"],
            "train_samples": sizes["train_samples"], "test_samples": sizes["test_samples"],
            "vit": {k: sizes[f"vit_{k}"] for k in ("depth", "width", "heads", "patch")},
            "metrics_out": args.metrics_out, "seed": 0,
            "num_workers": args.num_workers, "use_gpu": args.use_gpu}


def build_model(cfg: dict) -> ViT:
    torch.manual_seed(cfg["seed"])
    return ViT(**cfg["vit"])


def train_func(cfg: dict) -> None:
    worker = ray.train.get_context()
    rank, world_size, device = worker.get_world_rank(), worker.get_world_size(), ray.train.torch.get_device()
    model = prepare_model(build_model(cfg))
    plain = getattr(model, "module", model)                  # DDP's wrapped model (one worker: no DDP)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    digits = load_digits(train=True, limit=cfg["train_samples"], quiet=True).dataset()
    batches = prepare_data_loader(DataLoader(digits, batch_size=cfg["global_batch_size"] // world_size, shuffle=True,
                                             drop_last=True, generator=torch.Generator().manual_seed(cfg["seed"])))
    meter = StepMeter(warmup=2, steps=cfg.get("measure_steps", 8))
    losses = []
    for epoch in range(cfg["epochs"]):
        if world_size > 1:                                   # the DistributedSampler prepare_data_loader added
            batches.sampler.set_epoch(epoch)
        model.train()
        epoch_sums = torch.zeros(2, device=device)           # loss x samples, samples
        for inputs, targets in batches:
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            meter.tick(model, optimizer, len(targets))
            optimizer.step()
            epoch_sums += torch.tensor([loss.item() * len(targets), len(targets)], device=device)
        dist.all_reduce(epoch_sums)
        losses.append((epoch_sums[0] / epoch_sums[1]).item())
        metrics = dict(epoch=epoch, loss=losses[-1])
        if epoch == cfg["epochs"] - 1:
            results = meter.results()
            memory_by_rank = [None] * world_size
            dist.all_gather_object(memory_by_rank, results.pop("memory"))
            held_out = load_digits(train=False, limit=cfg["test_samples"], quiet=True)
            metrics.update(losses=losses, test_accuracy=accuracy(plain, held_out.tensors, held_out.labels,
                                                                 device=device), **results,
                           memory_by_rank=memory_by_rank)
        with tempfile.TemporaryDirectory() as staging:       # ray.train.report copies it to the run's storage
            if rank == 0:
                torch.save({"model": plain.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                           os.path.join(staging, "checkpoint.pt"))
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(staging) if rank == 0 else None)


def main(argv=None) -> dict:
    rt = detect()
    cfg = parse_args(argv)
    if not rt.local_mode:   # a small machine (Binder) runs Ray Train's local mode on forked ranks: no Ray
        init_ray(rt)
    check_scaling(cfg["num_workers"], cfg["use_gpu"], global_batch_size=cfg["global_batch_size"])
    scaling = ScalingConfig(num_workers=cfg["num_workers"], use_gpu=cfg["use_gpu"],
                            resources_per_worker={"CPU": 1})   # a GPU worker gets its GPU too
    run = RunConfig(storage_path=storage_path(rt), name=time.strftime("07-ray-ddp-%Y%m%d-%H%M%S"))
    # no TorchConfig(backend=...): Ray Train picks NCCL when each worker has a GPU, else gloo
    trainer = TorchTrainer(train_func, train_loop_config=cfg, scaling_config=scaling, run_config=run)
    results = fit_trainer(trainer, rt).metrics   # trainer.fit(), or local mode where Ray does not fit
    print({k: v for k, v in results.items() if k != "memory_by_rank"})
    if cfg["metrics_out"]:
        with open(cfg["metrics_out"], "w") as f:
            json.dump(results, f)
    return results


if __name__ == "__main__":
    main()
