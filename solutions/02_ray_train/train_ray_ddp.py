"""Data-parallel training with Ray Train: module 02's script.

    python train_ray_ddp.py --num-workers 2 --epochs 3            # CPU workers (gloo)
    python train_ray_ddp.py --num-workers 8 --epochs 3 --use-gpu  # one GPU each (nccl)
    python train_ray_ddp.py --smoke-test                          # small and quick
    python train_ray_ddp.py --placement-strategy STRICT_SPREAD    # one worker per node (a cluster)

The same file runs on a laptop and on a Ray cluster: on a cluster (Anyscale,
or RAY_ADDRESS set) it joins the cluster and writes results to shared storage.
Compare it with ../01_ddp_pytorch/train_ddp.py: no process-group code, no
DistributedSampler by hand, no torchrun, no rank-0 launch logic.

The training function, the driver's trainer and the loading of its checkpoint are
the notebook's exercises (``train_func``, ``scaling_config_for``, ``build_trainer``,
``load_model``): finish them in the notebook, then copy your answers here where the
script raises NotImplementedError.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import ray.train
import ray.train.torch
from ray.train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from coursekit import detect
from coursekit.data import load_digits
from coursekit.localmode import fit_trainer
from coursekit.models import accuracy, build_model
from coursekit.raysetup import init_ray, storage_path
from coursekit.scaling import (PLACEMENT_STRATEGIES, ScalingError, check_placement, check_scaling,
                               worker_resources)


def worker_node_ids() -> list[str]:
    """The Ray node each worker runs on, in rank order: where the placement strategy put them. In Ray Train's
    local mode (Binder) there is no Ray to ask (asking would start one): the ranks are on this machine."""
    mine = ray.get_runtime_context().get_node_id() if ray.is_initialized() else f"local:{socket.gethostname()}"
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # every rank sends its node id to every rank
    return everyone


def train_func(config: dict) -> None:
    """The training loop each Ray Train worker runs: the notebook's Exercise 2.

    As in the notebook, with one addition: every worker calls ``worker_node_ids()`` once, before
    the first epoch (it is a collective), and each report's metrics carry ``"node_ids"`` (that
    list) next to ``"epoch"`` and ``"loss"``, so the driver can say where the workers ran."""
    ### BEGIN SOLUTION
    torch.manual_seed(config["seed"])
    net = ray.train.torch.prepare_model(build_model(config["model"]))  # device + DDP (2+ workers)
    make_optimizer = torch.optim.SGD if config["optimizer"] == "sgd" else torch.optim.Adam
    optimizer = make_optimizer(net.parameters(), lr=config["lr"])
    criterion = torch.nn.CrossEntropyLoss()

    n_workers = ray.train.get_context().get_world_size()
    per_worker, remainder = divmod(config["global_batch_size"], n_workers)
    if remainder:
        raise ValueError(f"global batch {config['global_batch_size']} does not split over {n_workers} workers")
    digits = load_digits(train=True, limit=config["train_samples"], quiet=True)
    batches = DataLoader(digits.dataset(), batch_size=per_worker, shuffle=True, drop_last=True)
    batches = ray.train.torch.prepare_data_loader(batches)  # DistributedSampler + device moves
    node_ids = worker_node_ids()

    for epoch in range(config["epochs"]):
        if isinstance(batches.sampler, DistributedSampler):
            batches.sampler.set_epoch(epoch)  # prepare_data_loader does not do this for you
        net.train()
        # [loss sum, examples] on this rank; NCCL reduces GPU tensors only
        sums = torch.zeros(2, device=ray.train.torch.get_device())
        for images, labels in batches:
            loss = criterion(net(images), labels)
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients across workers here
            optimizer.step()
            sums[0] += loss.detach() * len(labels)
            sums[1] += len(labels)
        if dist.is_initialized():  # Ray Train makes a process group, even for one worker
            dist.all_reduce(sums)  # the epoch's loss over all workers, not just this one
        report = {"epoch": epoch, "loss": float(sums[0] / sums[1]), "node_ids": node_ids}
        with tempfile.TemporaryDirectory() as ckpt_dir:
            if ray.train.get_context().get_world_rank() == 0:  # DDP replicas are equal: one writer
                unwrapped = net.module if isinstance(net, torch.nn.parallel.DistributedDataParallel) else net
                torch.save(unwrapped.state_dict(), os.path.join(ckpt_dir, "model.pt"))
                ray.train.report(report, checkpoint=Checkpoint.from_directory(ckpt_dir))
            else:
                ray.train.report(report)  # every worker reports: it is a barrier
    ### END SOLUTION


def scaling_config_for(choice: dict) -> ScalingConfig:
    """The ScalingConfig for {"num_workers": int, "use_gpu": bool, "cpus_per_worker": float}:
    the notebook's Exercise 1."""
    ### BEGIN SOLUTION
    reserved = {"CPU": choice["cpus_per_worker"]}
    if choice["use_gpu"]:
        reserved["GPU"] = 1  # use_gpu=True would add it too
    return ScalingConfig(num_workers=choice["num_workers"], use_gpu=choice["use_gpu"],
                         resources_per_worker=reserved)
    ### END SOLUTION


def build_trainer(train_func, scaling_config: ScalingConfig, storage_path: str, name: str,
                  train_loop_config: dict, num_to_keep: int | None, score_attribute: str,
                  score_order: str) -> TorchTrainer:
    """A TorchTrainer for train_func (not started): the notebook's Exercise 3."""
    ### BEGIN SOLUTION
    run_config = RunConfig(
        name=name, storage_path=storage_path,
        checkpoint_config=CheckpointConfig(checkpoint_score_attribute=score_attribute,
                                           checkpoint_score_order=score_order, num_to_keep=num_to_keep))
    return TorchTrainer(train_loop_per_worker=train_func, train_loop_config=train_loop_config,
                        scaling_config=scaling_config, run_config=run_config)
    ### END SOLUTION


def load_model(checkpoint: Checkpoint, model_name: str = "resnet18") -> torch.nn.Module:
    """A plain (unwrapped) model from a checkpoint, on the CPU, in eval mode: the notebook's Exercise 4.
    The checkpoint may be in storage that is not a local folder (``s3://...``), and its model.pt may come
    from a GPU worker."""
    ### BEGIN SOLUTION
    with checkpoint.as_directory() as ckpt_dir:  # a local folder, downloaded first if the storage is remote
        state = torch.load(os.path.join(ckpt_dir, "model.pt"), map_location="cpu", weights_only=True)
    model = build_model(model_name)
    model.load_state_dict(state)
    return model.eval()
    ### END SOLUTION


def main(argv: list[str] | None = None) -> int:
    rt = detect()
    workers = worker_resources(rt)   # the cluster's workers (joined first), or this machine
    sizes = rt.sizes
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-workers", type=int, default=workers.default_workers,
                   help="default: one per GPU of the cluster's workers, else 2")
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--use-gpu", action=argparse.BooleanOptionalAction, default=workers.use_gpu,
                   help="one GPU per worker (default: yes where the cluster's workers have GPUs)")
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--smoke-test", action="store_true", help="tiny data, 2 epochs")
    p.add_argument("--placement-strategy", default="PACK", choices=PLACEMENT_STRATEGIES,
                   help="how workers spread over a cluster's nodes (STRICT_SPREAD: one per node)")
    p.add_argument("--keep", type=int, default=None, help="checkpoints to keep, lowest loss first (default: all)")
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
        "optimizer": "adam",
        "seed": 0,
    }
    choice = dict(num_workers=args.num_workers, use_gpu=args.use_gpu, cpus_per_worker=args.cpus_per_worker)

    def check() -> None:  # raises ScalingError, with the reason, for a choice the cluster cannot run
        check_scaling(args.num_workers, args.use_gpu, args.cpus_per_worker, config["global_batch_size"])
        check_placement(args.num_workers, args.placement_strategy)

    try:
        if rt.ray_address is None:  # a local machine: refuse an impossible choice before starting Ray
            check()
        if not rt.local_mode:  # a small machine (Binder) runs Ray Train's local mode on forked ranks: no Ray
            init_ray(rt)
            check()  # against the cluster's resources
    except ScalingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    scaling_config = dataclasses.replace(scaling_config_for(choice), placement_strategy=args.placement_strategy)
    load_digits(train=True, download=True)  # the driver downloads MNIST once, if it can
    name = args.name or f"train-ray-ddp-{time.strftime('%Y%m%d-%H%M%S')}"
    trainer = build_trainer(train_func, scaling_config, storage_path(rt), name, config,
                            num_to_keep=args.keep, score_attribute="loss", score_order="min")
    start = time.perf_counter()
    result = fit_trainer(trainer, rt)  # trainer.fit(), or local mode where a Ray worker group does not fit
    wall = time.perf_counter() - start
    df = result.metrics_dataframe.sort_values("epoch")
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
