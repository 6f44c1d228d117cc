"""One DDP training loop for the throughput comparison, run by Ray Train and by torchrun.

Both launchers build the same model (module 02's ResNet18, ``coursekit.models.build_model``),
the same digits, the same per-worker batch (global batch // 2), the same sampler (shuffled
``DistributedSampler``, seed 0) and Adam; the loop below is shared, so the only difference is
who starts the processes and wraps the model. ``coursekit.stepmeter.StepMeter`` (module 07's meter)
times ``steps`` optimizer steps after ``warmup`` steps, inside the worker: start-up is excluded.

    torchrun --standalone --nproc_per_node 2 -m bench.ddp_loop --steps 20 --out result.json
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F


def config_for(steps: int, warmup: int, global_batch_size: int = 64) -> dict:
    return {"steps": steps, "warmup": warmup, "global_batch_size": global_batch_size,
            # enough samples for every step in one epoch (drop_last), plus a margin
            "train_samples": global_batch_size * (warmup + steps + 2), "lr": 1e-3, "seed": 0}


def train_steps(model, loader, sampler, config: dict, device) -> dict:
    """Train until the meter has its steps; return samples/s of the job and what ran."""
    from coursekit.stepmeter import StepMeter

    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    meter = StepMeter(warmup=config["warmup"], steps=config["steps"])
    epoch = 0
    while not meter.done:
        sampler.set_epoch(epoch)
        model.train()
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            meter.tick(model, optimizer, len(labels))
            optimizer.step()
            if meter.done:
                break
        epoch += 1
    results = meter.results()
    results.pop("memory")
    return {**results, "steps": config["steps"], "warmup": config["warmup"],
            "global_batch_size": config["global_batch_size"], "torch_threads": torch.get_num_threads(),
            "last_loss": loss.item()}


def _data(config: dict):
    from coursekit.data import load_digits

    return load_digits(train=True, limit=config["train_samples"], quiet=True).dataset()


def ray_train_func(config: dict) -> None:
    """Ray Train's worker: prepare_model (DDP) and prepare_data_loader (DistributedSampler)."""
    import ray.train
    import ray.train.torch
    from torch.utils.data import DataLoader

    from coursekit.models import build_model

    t_start = time.time()
    world_size = ray.train.get_context().get_world_size()
    torch.manual_seed(config["seed"])
    model = ray.train.torch.prepare_model(build_model("resnet18"))
    loader = DataLoader(_data(config), batch_size=config["global_batch_size"] // world_size, shuffle=True,
                        drop_last=True, generator=torch.Generator().manual_seed(config["seed"]))
    loader = ray.train.torch.prepare_data_loader(loader)
    results = train_steps(model, loader, loader.sampler, config, ray.train.torch.get_device())
    rank = ray.train.get_context().get_world_rank()
    results = {**results, "t_train_func_start": t_start, "t_done": time.time(), "launcher": "ray_train", "rank": rank,
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    ray.train.report({k: v for k, v in results.items() if k != "rank"})
    # Ray Train V2 keeps metrics in Result only with a checkpoint: the figures go to a file (same machine)
    with open(os.path.join(config["stamps"], f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def torchrun_main(argv=None) -> None:
    """torchrun's worker: the same by hand (init_process_group, DDP, DistributedSampler)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from coursekit.models import build_model

    t_start = time.time()
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    config = config_for(args.steps, args.warmup, args.global_batch_size)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config["seed"])
    model = DDP(build_model("resnet18"))
    data = _data(config)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=config["seed"])
    loader = DataLoader(data, batch_size=config["global_batch_size"] // world_size, sampler=sampler, drop_last=True)
    results = train_steps(model, loader, sampler, config, torch.device("cpu"))
    dist.destroy_process_group()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({**results, "t_train_func_start": t_start, "t_done": time.time(), "launcher": "torchrun",
                       "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}, f)


if __name__ == "__main__":
    torchrun_main()
