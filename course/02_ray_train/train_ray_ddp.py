"""Data-parallel training with Ray Train: module 02's script.

    python train_ray_ddp.py --num-workers 2 --epochs 3            # CPU workers (gloo)
    python train_ray_ddp.py --num-workers 8 --epochs 3 --use-gpu  # one GPU each (nccl)
    python train_ray_ddp.py --smoke-test                          # small and quick
    python train_ray_ddp.py --placement-strategy STRICT_SPREAD    # one worker per node (a cluster)

The same file runs on a laptop and on a Ray cluster: on a cluster (Anyscale,
or RAY_ADDRESS set) it joins the cluster and writes results to shared storage.
Compare it with ../01_ddp_pytorch/train_ddp.py: no process-group code, no
DistributedSampler by hand, no torchrun, no rank-0 launch logic.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import ray.train
import ray.train.torch
from ray.train import Checkpoint, RunConfig
from ray.train.torch import TorchTrainer

from coursekit import detect
from coursekit.data import load_digits
from coursekit.models import accuracy, build_model
from coursekit.raysetup import init_ray, storage_path
from coursekit.scaling import PLACEMENT_STRATEGIES, ScalingError, make_scaling_config


def worker_batch_size(global_batch_size: int) -> int:
    """Each worker's share of the global batch (global = per-worker x workers)."""
    world_size = ray.train.get_context().get_world_size()
    if global_batch_size % world_size:
        raise ValueError(f"global batch {global_batch_size} does not split over {world_size} workers")
    return global_batch_size // world_size


def worker_node_ids() -> list[str]:
    """The Ray node each worker runs on, in rank order: where the placement strategy put them."""
    mine = ray.get_runtime_context().get_node_id()
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # every rank sends its node id to every rank
    return everyone


def save_checkpoint_and_report(model: torch.nn.Module, metrics: dict) -> None:
    """Every rank reports (the call is a synchronisation point); only rank 0 writes the model."""
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            plain = getattr(model, "module", model)  # unwrap DistributedDataParallel
            torch.save(plain.state_dict(), os.path.join(tmp, "model.pt"))
            checkpoint = Checkpoint.from_directory(tmp)
        ray.train.report(metrics, checkpoint=checkpoint)


def train_func(config: dict) -> None:
    """The training loop each Ray Train worker runs."""
    torch.manual_seed(config.get("seed", 0))
    model = ray.train.torch.prepare_model(build_model(config.get("model", "resnet18")))  # device + DDP
    if config.get("optimizer", "adam") == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    criterion = torch.nn.CrossEntropyLoss()

    data = load_digits(train=True, limit=config["train_samples"], quiet=True)
    loader = DataLoader(data.dataset(), batch_size=worker_batch_size(config["global_batch_size"]),
                        shuffle=True, drop_last=True)
    loader = ray.train.torch.prepare_data_loader(loader)  # DistributedSampler + device moves
    node_ids = worker_node_ids()

    for epoch in range(config["epochs"]):
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)  # prepare_data_loader does not do this for you
        model.train()
        total = torch.zeros(2, device=ray.train.torch.get_device())  # [loss sum, examples] on this rank; NCCL reduces GPU tensors only
        for images, labels in loader:
            loss = criterion(model(images), labels)
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients across workers here
            optimizer.step()
            total += torch.tensor([loss.item() * len(labels), len(labels)], device=total.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)  # the epoch's loss over all workers, not just this one
        save_checkpoint_and_report(model, {"epoch": epoch, "loss": (total[0] / total[1]).item(),
                                           "node_ids": node_ids})


def load_model(checkpoint: Checkpoint, model_name: str = "resnet18") -> torch.nn.Module:
    """A plain (unwrapped) model from a checkpoint, on the CPU, in eval mode."""
    with checkpoint.as_directory() as ckpt_dir:
        state = torch.load(os.path.join(ckpt_dir, "model.pt"), map_location="cpu", weights_only=True)
    model = build_model(model_name)
    model.load_state_dict(state)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    rt = detect()
    sizes = rt.sizes
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-workers", type=int, default=rt.default_workers)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--use-gpu", action=argparse.BooleanOptionalAction, default=rt.use_gpu,
                   help="one GPU per worker (default: yes where this machine or cluster has GPUs)")
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--smoke-test", action="store_true", help="tiny data, 2 epochs")
    p.add_argument("--placement-strategy", default="PACK", choices=PLACEMENT_STRATEGIES,
                   help="how workers spread over a cluster's nodes (STRICT_SPREAD: one per node)")
    p.add_argument("--name", default=None, help="run name under the storage path")
    p.add_argument("--metrics-out", default=None, help="write the run's figures as JSON here")
    args = p.parse_args(argv)
    if args.smoke_test:
        from coursekit.runtime import SIZES

        sizes = SIZES["smoke"]
    config = {
        "epochs": args.epochs or sizes["epochs"],
        "global_batch_size": args.global_batch_size or sizes["global_batch_size"],
        "train_samples": sizes["train_samples"],
        "lr": args.lr,
        "model": "resnet18",
    }
    try:
        if rt.ray_address is None:  # a local machine: refuse an impossible choice before starting Ray
            make_scaling_config(args.num_workers, args.use_gpu, global_batch_size=config["global_batch_size"],
                                placement_strategy=args.placement_strategy)
        init_ray(rt)
        scaling_config = make_scaling_config(args.num_workers, args.use_gpu,  # the cluster's resources
                                             global_batch_size=config["global_batch_size"],
                                             placement_strategy=args.placement_strategy)
    except ScalingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    load_digits(train=True, download=True)  # the driver downloads MNIST once, if it can
    name = args.name or f"train-ray-ddp-{time.strftime('%Y%m%d-%H%M%S')}"
    trainer = TorchTrainer(train_func, train_loop_config=config, scaling_config=scaling_config,
                           run_config=RunConfig(storage_path=storage_path(rt), name=name))
    start = time.perf_counter()
    result = trainer.fit()
    wall = time.perf_counter() - start
    df = result.metrics_dataframe
    print(df[["epoch", "loss"]].to_string(index=False))
    test = load_digits(train=False, limit=sizes["test_samples"], quiet=True)
    acc = accuracy(load_model(result.checkpoint), test.tensors, test.labels)
    node_ids = result.metrics["node_ids"]
    print(f"test accuracy {acc:.3f} ({test.source}); fit took {wall:.1f} s; results in {result.path}")
    print(f"{len(node_ids)} workers ran on {len(set(node_ids))} node(s) ({args.placement_strategy})")
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump({"losses": df["loss"].tolist(), "test_accuracy": acc, "fit_seconds": wall,
                       "num_workers": args.num_workers, "path": result.path,
                       "placement_strategy": args.placement_strategy, "worker_node_ids": node_ids}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
