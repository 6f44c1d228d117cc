"""Module 07's baseline with DeepSpeed ZeRO (module 06) under Ray Train.

    python train_ray_deepspeed.py --smoke-test --stage 2     # 2 CPU workers here
    python train_ray_deepspeed.py --num-workers 8 --use-gpu --stage 3 --bf16   # on a GPU cluster

deepspeed.initialize with a config dict (global batch = micro batch x workers), engine.backward and
engine.step; every rank saves its partition with engine.save_checkpoint and reports it.
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
from torch.utils.data.distributed import DistributedSampler

import ray.train
import ray.train.torch
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from coursekit import detect

os.environ.setdefault("DS_ACCELERATOR", detect().device)   # cuda on GPU nodes, cpu here
import deepspeed  # noqa: E402

from coursekit.data import load_digits
from coursekit.distributed import deepspeed_pytorch_ops_only
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
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3), help="the ZeRO stage")
    p.add_argument("--bf16", action="store_true", help="bf16 model and gradients (GPUs that support it)")
    args = p.parse_args(argv)
    sizes = SIZES["smoke"] if args.smoke_test else rt.sizes
    return {"epochs": args.epochs or sizes["epochs"], "lr": args.lr,
            "global_batch_size": args.global_batch_size or sizes["global_batch_size"],
            "train_samples": sizes["train_samples"], "test_samples": sizes["test_samples"],
            "vit": {k: sizes[f"vit_{k}"] for k in ("depth", "width", "heads", "patch")},
            "metrics_out": args.metrics_out, "seed": 0,
            "num_workers": args.num_workers, "use_gpu": args.use_gpu, "stage": args.stage, "bf16": args.bf16}


def build_model(cfg: dict) -> ViT:
    torch.manual_seed(cfg["seed"])
    return ViT(**cfg["vit"])


def ds_config(cfg: dict, world_size: int) -> dict:
    """DeepSpeed's configuration: the global batch is the micro-batch of every worker, no accumulation."""
    return {"train_batch_size": cfg["global_batch_size"],
            "train_micro_batch_size_per_gpu": cfg["global_batch_size"] // world_size,
            "optimizer": {"type": "AdamW", "params": {"lr": cfg["lr"], "torch_adam": True}},
            "zero_optimization": {"stage": cfg["stage"], "stage3_param_persistence_threshold": 0},
            "gradient_clipping": 0.0, "bf16": {"enabled": cfg["bf16"]}, "steps_per_print": 10**9}


def train_func(cfg: dict) -> None:
    deepspeed_pytorch_ops_only()   # no C++ op builds (module 06)
    worker = ray.train.get_context()
    rank, world_size, device = worker.get_world_rank(), worker.get_world_size(), ray.train.torch.get_device()
    vit = build_model(cfg)
    engine, *_ = deepspeed.initialize(model=vit, model_parameters=vit.parameters(),
                                      config=ds_config(cfg, world_size))
    digits = load_digits(train=True, limit=cfg["train_samples"], quiet=True).dataset()
    order = DistributedSampler(digits, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg["seed"])
    batches = DataLoader(digits, batch_size=cfg["global_batch_size"] // world_size, sampler=order, drop_last=True)
    dtype = torch.bfloat16 if cfg["bf16"] else torch.float32
    meter = StepMeter(warmup=2, steps=cfg.get("measure_steps", 8))
    losses = []
    for epoch in range(cfg["epochs"]):
        order.set_epoch(epoch)
        engine.train()
        epoch_sums = torch.zeros(2, device=device)           # loss x samples, samples
        for inputs, targets in batches:
            inputs, targets = inputs.to(device, dtype), targets.to(device)
            loss = F.cross_entropy(engine(inputs).float(), targets)
            engine.backward(loss)                            # the engine scales, reduces and partitions
            meter.tick(engine, None, len(targets))
            engine.step()
            epoch_sums += torch.tensor([loss.item() * len(targets), len(targets)], device=device)
        dist.all_reduce(epoch_sums)
        losses.append((epoch_sums[0] / epoch_sums[1]).item())
        metrics = dict(epoch=epoch, loss=losses[-1])
        if epoch == cfg["epochs"] - 1:
            results = meter.results()
            memory_by_rank = [None] * world_size
            dist.all_gather_object(memory_by_rank, results.pop("memory"))
            held_out = load_digits(train=False, limit=cfg["test_samples"], quiet=True)
            pixels = held_out.tensors.to(dtype)             # every rank: a ZeRO-3 forward is a collective
            metrics.update(losses=losses, test_accuracy=accuracy(engine, pixels, held_out.labels, device=device),
                           **results, memory_by_rank=memory_by_rank)
        with tempfile.TemporaryDirectory() as staging:       # every rank writes its partition, then reports it
            engine.save_checkpoint(staging, tag="checkpoint", client_state={"epoch": epoch})
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(staging))


def main(argv=None) -> dict:
    rt = detect()
    cfg = parse_args(argv)
    if not rt.local_mode:   # a small machine (Binder) runs Ray Train's local mode on forked ranks: no Ray
        init_ray(rt)
    check_scaling(cfg["num_workers"], cfg["use_gpu"], global_batch_size=cfg["global_batch_size"])
    scaling = ScalingConfig(num_workers=cfg["num_workers"], use_gpu=cfg["use_gpu"],
                            resources_per_worker={"CPU": 1})   # a GPU worker gets its GPU too
    run = RunConfig(storage_path=storage_path(rt), name=time.strftime(f"07-ray-engine{cfg['stage']}-%Y%m%d-%H%M%S"))
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
