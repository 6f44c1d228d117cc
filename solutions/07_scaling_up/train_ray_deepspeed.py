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
from ray.train import Checkpoint, RunConfig
from ray.train.torch import TorchConfig, TorchTrainer

from coursekit import detect

os.environ.setdefault("DS_ACCELERATOR", detect().device)   # cuda on GPU nodes, cpu here
import deepspeed  # noqa: E402

from coursekit.data import load_digits
from coursekit.distributed import deepspeed_pytorch_ops_only
from coursekit.models import ViT, accuracy
from coursekit.planner import StepMeter
from coursekit.raysetup import init_ray, storage_path
from coursekit.runtime import SIZES
from coursekit.scaling import make_scaling_config


def parse_args(argv=None) -> dict:
    rt = detect()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--smoke-test", action="store_true", help="the smallest sizes (CI)")
    p.add_argument("--metrics-out", default=None, help="write losses, accuracy, throughput and memory here")
    p.add_argument("--num-workers", type=int, default=rt.default_workers)
    p.add_argument("--use-gpu", action=argparse.BooleanOptionalAction, default=rt.use_gpu,
                   help="one GPU per worker (default: yes where this machine or cluster has GPUs)")
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


def build_model(config: dict) -> ViT:
    torch.manual_seed(config["seed"])
    return ViT(**config["vit"])


def ds_config(config: dict, world_size: int) -> dict:
    return {"train_batch_size": config["global_batch_size"],
            "train_micro_batch_size_per_gpu": config["global_batch_size"] // world_size,
            "optimizer": {"type": "AdamW", "params": {"lr": config["lr"], "torch_adam": True}},
            "zero_optimization": {"stage": config["stage"], "stage3_param_persistence_threshold": 0},
            "gradient_clipping": 0.0, "bf16": {"enabled": config["bf16"]}, "steps_per_print": 10**9}


def train_func(config: dict) -> None:
    deepspeed_pytorch_ops_only()   # no C++ op builds (module 06)
    rank, world_size = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    device = ray.train.torch.get_device()
    model = build_model(config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(config, world_size))
    data = load_digits(train=True, limit=config["train_samples"], quiet=True).dataset()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=config["seed"])
    loader = DataLoader(data, batch_size=config["global_batch_size"] // world_size, sampler=sampler,
                        drop_last=True)
    dtype = torch.bfloat16 if config["bf16"] else torch.float32
    meter = StepMeter(warmup=2, steps=config.get("measure_steps", 8))
    losses = []
    for epoch in range(config["epochs"]):
        sampler.set_epoch(epoch)
        engine.train()
        total = torch.zeros(2, device=device)
        for images, labels in loader:
            images, labels = images.to(device, dtype), labels.to(device)
            loss = F.cross_entropy(engine(images).float(), labels)
            engine.backward(loss)
            meter.tick(engine, None, len(labels))
            engine.step()
            total += torch.tensor([loss.item() * len(labels), len(labels)], device=device)
        dist.all_reduce(total)
        losses.append((total[0] / total[1]).item())
        metrics = {"epoch": epoch, "loss": losses[-1]}
        if epoch == config["epochs"] - 1:
            results = meter.results()
            memory_by_rank = [None] * world_size
            dist.all_gather_object(memory_by_rank, results.pop("memory"))
            test = load_digits(train=False, limit=config["test_samples"], quiet=True)
            images = test.tensors.to(dtype)                # every rank: a ZeRO-3 forward is a collective
            metrics.update(losses=losses, test_accuracy=accuracy(engine, images, test.labels, device=device),
                           **results, memory_by_rank=memory_by_rank)
        with tempfile.TemporaryDirectory() as tmp:
            engine.save_checkpoint(tmp, tag="checkpoint", client_state={"epoch": epoch})
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))


def main(argv=None) -> dict:
    rt = detect()
    config = parse_args(argv)
    init_ray(rt)
    scaling_config = make_scaling_config(config["num_workers"], config["use_gpu"],
                                         global_batch_size=config["global_batch_size"])
    name = time.strftime(f"07-ray-zero{config['stage']}-%Y%m%d-%H%M%S")
    run_config = RunConfig(storage_path=storage_path(rt), name=name)
    trainer = TorchTrainer(train_func, train_loop_config=config, scaling_config=scaling_config,
                           run_config=run_config, torch_config=TorchConfig(backend=rt.backend))
    results = trainer.fit().metrics
    print({k: v for k, v in results.items() if k != "memory_by_rank"})
    if config["metrics_out"]:
        with open(config["metrics_out"], "w") as f:
            json.dump(results, f)
    return results


if __name__ == "__main__":
    main()
