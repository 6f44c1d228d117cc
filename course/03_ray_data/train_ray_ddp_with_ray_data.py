"""Data-parallel training fed by Ray Data, streaming: module 03's script.

    python train_ray_ddp_with_ray_data.py --smoke-test                         # small and quick
    python train_ray_ddp_with_ray_data.py --data-size-gb 1 --epochs 2 --num-workers 2
    python train_ray_ddp_with_ray_data.py --data-size-gb 50 --num-workers 8 --use-gpu   # a GPU cluster

The data are synthetic "raw" images (coursekit.synthetic): the course digits at 224x224 with noise, as
many rows as make ``--data-size-gb``. Ray Data generates them block by block,
preprocesses them on CPU tasks (8x8 average pooling down to 28x28, then
normalisation) and streams the small tensors into the training workers; nothing
holds the whole data set, so it may be many times larger than the object store.
Compare it with ../02_ray_train/train_ray_ddp.py: the DataLoader and
DistributedSampler are gone, ``datasets=`` and ``get_dataset_shard`` replace them.

Finishing this script is part of module 03: the two places marked ``# YOUR CODE HERE`` (they
raise NotImplementedError until you fill them in) are the notebook's exercises 3 and 4 for this
data: the body of ``train_func`` (its docstring says what it does) and the trainer, fed
``train_ds`` under the name "train", with Ray Data's tasks capped at ``data_plan.data_cpus`` CPUs
through the trainer's own data config.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

import ray.data
import ray.train
import ray.train.torch
from ray.data import ExecutionOptions, ExecutionResources
from ray.train import Checkpoint, DataConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from coursekit import detect
from coursekit.data import load_digits
from coursekit.localmode import fit_trainer
from coursekit.models import accuracy, build_model
from coursekit.objectstore import ObjectStoreMonitor
from coursekit.raydata import configure_ray_data, local_ray_options, plan_resources
from coursekit.raysetup import init_ray, storage_path
from coursekit.runtime import SIZES
from coursekit.scaling import ScalingError, check_scaling, cluster_resources, worker_resources
from coursekit.synthetic import preprocess_synthetic, synthetic_dataset, synthetic_rows


def train_func(config: dict) -> None:
    """The training loop each Ray Train worker runs: its shard of the stream, its share of the batch.

    The notebook's exercise 4, for this data. Seed torch with ``config.get("seed", 0)``, prepare the model
    ``build_model(config["model"])``, train it with Adam (``lr=config["lr"]``) and cross-entropy. Every epoch,
    train on every batch of this worker's shard of "train" at the per-worker batch size, keep each batch's
    "id" column (as a NumPy array) in a list, and sum the loss per example and the rows over all workers in a
    tensor on the worker's device; then hand it all to ``end_epoch``.
    """
    # YOUR CODE HERE (the notebook's exercise: finish it there, then copy it here)
    raise NotImplementedError()


def end_epoch(model: torch.nn.Module, epoch: int, total: torch.Tensor, ids: list, seconds: float) -> None:
    """After an epoch, on every worker: ``total`` holds (sum of loss x rows, rows) over all workers, ``ids`` the
    row ids of this worker's batches. Gathers which rows each worker trained on, prints the epoch (rank 0) and
    reports it; rank 0 attaches a checkpoint with the model and the rows seen (for the exactly-once check)."""
    ctx = ray.train.get_context()
    world_size, rank = ctx.get_world_size(), ctx.get_world_rank()
    ids = np.concatenate(ids) if len(ids) else np.zeros(0, dtype=np.int64)
    all_ids = [ids]
    if dist.is_available() and dist.is_initialized():
        all_ids = [None] * world_size
        dist.all_gather_object(all_ids, ids)
    rows_by_rank = [len(x) for x in all_ids]
    metrics = {"epoch": epoch, "loss": (total[0] / total[1]).item(), "rows_by_rank": rows_by_rank,
               "rows_per_s": sum(rows_by_rank) / max(seconds, 1e-9)}
    if rank == 0:
        print(f"epoch {epoch}: loss {metrics['loss']:.3f}, rows per worker {rows_by_rank}, "
              f"{metrics['rows_per_s']:.0f} rows/s")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:
            torch.save(getattr(model, "module", model).state_dict(), os.path.join(tmp, "model.pt"))
            # which rows each worker trained on this epoch (for the exactly-once check)
            np.savez_compressed(os.path.join(tmp, "rows_seen.npz"), *all_ids)
            checkpoint = Checkpoint.from_directory(tmp)
        ray.train.report(metrics, checkpoint=checkpoint)


def main(argv: list[str] | None = None) -> int:
    rt = detect()
    workers = worker_resources(rt)   # the cluster's workers (joined first), or this machine
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-workers", type=int, default=workers.default_workers,
                   help="default: one per GPU of the cluster's workers, else 2")
    p.add_argument("--epochs", "--num-epochs", type=int, default=None)
    p.add_argument("--use-gpu", action=argparse.BooleanOptionalAction, default=workers.use_gpu,
                   help="one GPU per worker (default: yes where the cluster's workers have GPUs)")
    p.add_argument("--data-size-gb", type=float, default=None,
                   help="size of the synthetic raw data set, streamed (default: 0.05 with --smoke-test, else 0.5)")
    p.add_argument("--cpus-per-worker", type=float, default=None,
                   help="CPUs each training worker reserves (default: 1 with GPUs, else half the CPUs shared)")
    p.add_argument("--data-cpus-per-task", type=float, default=0.5, help="CPUs of each preprocessing task")
    p.add_argument("--object-store-mib", type=float, default=None,
                   help="object store of the local Ray this script starts (ignored on a cluster)")
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--smoke-test", action="store_true", help="small data, 1 epoch")
    p.add_argument("--name", default=None, help="run name under the storage path")
    p.add_argument("--metrics-out", default=None, help="write the run's figures as JSON here")
    args = p.parse_args(argv)
    size_gb = args.data_size_gb if args.data_size_gb is not None else (0.05 if args.smoke_test else 0.5)
    epochs = args.epochs or (1 if args.smoke_test else 2)
    sizes = SIZES["smoke"] if args.smoke_test else rt.sizes  # --smoke-test: the small sizes on any machine
    global_batch = args.global_batch_size or sizes["global_batch_size"]
    if size_gb <= 0:
        print(f"error: --data-size-gb must be positive (got {size_gb})", file=sys.stderr)
        return 2

    def plan(resources):
        cpus = resources["CPU"]
        per_worker = args.cpus_per_worker or (1.0 if args.use_gpu else cpus / 2 / args.num_workers)
        check_scaling(args.num_workers, args.use_gpu, per_worker, global_batch, resources)
        return plan_resources(args.num_workers, per_worker, args.use_gpu, args.data_cpus_per_task,
                              resources=resources)

    try:
        if rt.ray_address is None:  # a local machine: refuse an impossible choice before starting Ray
            plan({"CPU": rt.num_cpus, "GPU": rt.num_gpus})
        init_ray(rt, **({} if rt.ray_address else local_ray_options(args.object_store_mib)))
        data_plan = plan(cluster_resources())
    except ScalingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(data_plan.describe())
    configure_ray_data(data_plan)
    scaling_config = ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu,
                                   resources_per_worker={"CPU": data_plan.cpus_per_worker})

    # Generated and preprocessed on Ray Data's CPU tasks, as the training workers ask for data.
    # The generating ("reading") tasks reserve half the CPU of the preprocessing tasks, so Ray Data keeps them
    # as two operators (equal resources would fuse them into one task) and every raw block passes through the
    # object store: the data streamed through the store is --data-size-gb.
    raw_ds = synthetic_dataset(size_bytes=size_gb * 1e9, num_cpus=data_plan.map_num_cpus / 2,
                               concurrency=data_plan.map_concurrency)
    # the preprocessing step: preprocess_synthetic on Ray Data's CPU tasks, with the plan's resources
    tasks = ray.data.TaskPoolStrategy(size=data_plan.map_concurrency)
    train_ds = raw_ds.map_batches(preprocess_synthetic, batch_format="numpy", num_cpus=data_plan.map_num_cpus,
                                  compute=tasks)
    num_rows = synthetic_rows(size_gb * 1e9)  # known without running the pipeline (count() would run it)
    print(f"data: {num_rows} synthetic rows = {size_gb:g} GB raw, streamed")
    config = {"epochs": epochs, "global_batch_size": global_batch, "lr": args.lr, "model": "small_cnn"}
    name = args.name or f"train-ray-data-{time.strftime('%Y%m%d-%H%M%S')}"
    run_config = RunConfig(storage_path=storage_path(rt), name=name)
    # the trainer (name it `trainer`): train_func with config, scaling_config and run_config, fed train_ds as
    # "train", Ray Data's tasks capped at data_plan.data_cpus CPUs through its own data config (exercise 3)
    # YOUR CODE HERE (the notebook's exercise: finish it there, then copy it here)
    raise NotImplementedError()
    start = time.perf_counter()
    with ObjectStoreMonitor() as store:
        # trainer.fit(); where a Ray worker group does not fit (Binder), Ray Train's local mode: one rank in this
        # process reads the whole stream (Ray stays up for Ray Data's tasks)
        result = fit_trainer(trainer, rt)
    wall = time.perf_counter() - start
    df = result.metrics_dataframe
    print(df[["epoch", "loss", "rows_per_s"]].to_string(index=False))
    with result.checkpoint.as_directory() as d:
        model = build_model("small_cnn")
        model.load_state_dict(torch.load(os.path.join(d, "model.pt"), map_location="cpu", weights_only=True))
        seen = np.load(os.path.join(d, "rows_seen.npz"))
        ids_by_rank = [seen[k] for k in sorted(seen.files, key=lambda k: int(k.split("_")[1]))]
    counts = np.bincount(np.concatenate(ids_by_rank), minlength=num_rows)
    test = load_digits(train=False, limit=sizes["test_samples"], quiet=True)
    acc = accuracy(model, test.tensors, test.labels)
    print(f"last epoch: {int((counts == 1).sum())} of {num_rows} rows seen exactly once, "
          f"{int((counts == 0).sum())} never, {int((counts > 1).sum())} more than once")
    if store.available:
        print(f"object store: at most {store.peak / 2**20:.0f} MiB of {store.capacity / 2**20:.0f} MiB used for "
              f"{size_gb * 1e9 / 2**20:.0f} MiB of data; spilled {store.spilled / 2**20:.0f} MiB; Ray's processes "
              f"on this node peaked at {store.peak_pss / 2**30:.2f} GiB")
    print(f"test accuracy {acc:.3f} ({test.source}); fit took {wall:.1f} s; results in {result.path}")
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump({"losses": df["loss"].tolist(), "test_accuracy": acc, "fit_seconds": wall,
                       "num_workers": args.num_workers, "num_rows": num_rows, "data_bytes": size_gb * 1e9,
                       "ids_by_rank": [x.tolist() for x in ids_by_rank],
                       **store.as_dict(),
                       "plan": data_plan.describe(), "path": result.path}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
