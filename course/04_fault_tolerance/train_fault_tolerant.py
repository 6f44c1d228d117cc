"""Fault-tolerant data-parallel training with Ray Train: module 04's script.

    python train_fault_tolerant.py --name my-run                     # train; rerun the same line to resume
    python train_fault_tolerant.py --name my-run --kill-at-epoch 2   # rank 1 SIGKILLs itself once at epoch 2
    python train_fault_tolerant.py --name my-run --raise-at-epoch 3  # rank 0 raises once at epoch 3
    python train_fault_tolerant.py --name my-run --stop-driver-after-epoch 1   # this driver dies; rerun to resume
    python train_fault_tolerant.py --smoke-test ...                  # small and quick
    python train_fault_tolerant.py --answers my_answers.py ...       # with your checkpoint functions

After every epoch each worker writes its share of a complete checkpoint: rank 0 the
model, the optimizer and the epoch counter, every rank its own RNG state. A restarted
worker group, or a rerun with the same ``--name`` and storage, continues from the
latest one without repeating or skipping an epoch. ``FailureConfig(max_failures=...)``
says how many worker-group failures one run survives. On a cluster (Anyscale, or
RAY_ADDRESS set) the script joins it and writes to the shared storage that coursekit
detects.

The checkpoint functions and the run configuration are module 04's exercises 1 to 3: in the
student's copy they are stubs, and the notebook runs this script with ``--answers``, a file it
writes from the student's exercise cells.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import ray.train
import ray.train.torch
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from coursekit import detect
from coursekit.data import load_digits
from coursekit.faults import fired, inject_faults
from coursekit.localmode import fit_trainer
from coursekit.models import accuracy, build_model
from coursekit.raysetup import init_ray, storage_path
from coursekit.scaling import ScalingError, check_scaling, worker_resources

STATE_FILE = "state.pt"          # rank 0: the model, the optimizer and the finished epoch


def rng_file(rank: int) -> str:  # every rank: its own random-number generator state
    return f"rng_rank_{rank}.pt"


# The three checkpoint functions are module 04's Exercises 1 and 2 (make_run_config below is Exercise 3). The
# notebook passes your answers with --answers (a file it writes from your exercise cells); without it, finish them
# here.
def save_training_state(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        epoch: int) -> None:
    """Called by every rank: rank 0 writes STATE_FILE (unwrapped model, optimizer, finished epoch),
    each rank writes its own RNG state to rng_file(its global rank)."""
    # YOUR CODE HERE (the notebook's exercise: finish it there, then copy it here)
    raise NotImplementedError()


def load_training_state(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore the model, the optimizer and this rank's RNG state (tensors onto the CPU whatever device
    wrote them); return the epoch the checkpoint finished."""
    # YOUR CODE HERE (the notebook's exercise: finish it there, then copy it here)
    raise NotImplementedError()


def resume(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The first epoch to train: 0 on a fresh start, the epoch after the checkpoint's on a restart."""
    # YOUR CODE HERE (the notebook's exercise: finish it there, then copy it here)
    raise NotImplementedError()


def make_run_config(name: str, storage_path: str, max_retries: int | None, keep: int | None, metric: str | None,
                    mode: str) -> RunConfig:
    """Exercise 3: results under storage_path/name; up to ``max_retries`` worker-group failures survived (None: any
    number); ``keep`` checkpoints kept (None: all), the most recent ones, or with ``metric`` the best by it
    (``mode``: "min" or "max")."""
    # YOUR CODE HERE (the notebook's exercise: finish it there, then copy it here)
    raise NotImplementedError()


CHECKPOINT_FUNCTIONS = ("save_training_state", "load_training_state", "resume", "make_run_config")


def use_answers(path: str) -> None:
    """Replace the exercise functions above by the ones in ``path`` (the notebook writes your
    exercise cells there). They become this script's own, so Ray ships them to the workers with
    train_func."""
    exec(compile(Path(path).read_text(encoding="utf-8"), str(path), "exec"), globals())
    missing = [f for f in CHECKPOINT_FUNCTIONS if not callable(globals().get(f))]
    if missing:
        raise SystemExit(f"error: {path} does not define {', '.join(missing)}")


def unfinished() -> list[str]:
    """The checkpoint functions that are still the exercise's stub (they raise NotImplementedError)."""
    return [f for f in CHECKPOINT_FUNCTIONS if "NotImplementedError" in globals()[f].__code__.co_names]


def augment(images: torch.Tensor) -> torch.Tensor:
    """Random noise on every image (a stand-in for random crops and flips), drawn on the CPU from
    torch's global generator: each rank's own random stream."""
    return images + 0.1 * torch.randn(images.shape).to(images.device)


def train_func(config: dict) -> None:
    """The loop every Ray Train worker runs: resume, train, checkpoint (every rank its share), report."""
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    torch.manual_seed(config.get("seed", 0))
    model = ray.train.torch.prepare_model(build_model(config.get("model", "small_cnn")))
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    criterion = torch.nn.CrossEntropyLoss()
    data = load_digits(train=True, limit=config["train_samples"], quiet=True)
    loader = DataLoader(data.dataset(), batch_size=config["global_batch_size"] // ctx.get_world_size(),
                        shuffle=True, drop_last=True)
    loader = ray.train.torch.prepare_data_loader(loader)
    test = load_digits(train=False, limit=config["test_samples"], quiet=True)

    torch.manual_seed(config.get("seed", 0) + 1 + rank)   # from here on each rank draws its own numbers
    start_epoch = resume(model, optimizer)                  # and gets its own RNG state back on a restart
    markers = config.get("marker_dir")
    last_fault = max(fired(markers).values(), default=None)  # when the latest injected fault fired
    first_step_at = None
    if start_epoch > 0 and rank == 0:
        print(f"resuming from the checkpoint of epoch {start_epoch - 1}: starting at epoch {start_epoch}",
              flush=True)
    for epoch in range(start_epoch, config["epochs"]):
        inject_faults(config.get("faults"), epoch, rank, markers)
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        model.train()
        total = torch.zeros(2, device=ray.train.torch.get_device())  # NCCL reduces GPU tensors only
        for images, labels in loader:
            loss = criterion(model(augment(images)), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(labels), len(labels)], device=total.device)
            first_step_at = first_step_at or time.time()
        if dist.is_available() and dist.is_initialized():   # several workers: add up their totals
            dist.all_reduce(total)
        metrics = {"epoch": epoch, "loss": (total[0] / total[1]).item(),
                   "accuracy": accuracy(getattr(model, "module", model), test.tensors, test.labels),
                   "started_at_epoch": start_epoch,
                   # seconds from the latest fault to this worker group's first training step (-1: none)
                   "recovery_s": first_step_at - last_fault if (last_fault and epoch == start_epoch) else -1.0}
        with tempfile.TemporaryDirectory() as tmp:
            save_training_state(tmp, model, optimizer, epoch)       # every rank writes its share
            checkpoint = Checkpoint.from_directory(tmp) if os.listdir(tmp) else None
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=f"epoch_{epoch:04d}")


def load_model(checkpoint: Checkpoint, model_name: str = "small_cnn") -> torch.nn.Module:
    """A plain model from a checkpoint written by train_func, on the CPU, in eval mode."""
    with checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, STATE_FILE), map_location="cpu", weights_only=True)
    model = build_model(model_name)
    model.load_state_dict(state["model"])
    return model.eval()


def stop_driver_after(run_dir: Path, epoch: int) -> None:
    """Kill this driver process (as a crashed laptop or a restarted kernel would) once the run
    has registered the checkpoint of ``epoch``."""
    snapshot = run_dir / "checkpoint_manager_snapshot.json"

    def watch():
        while True:
            try:
                if f"epoch_{epoch:04d}" in snapshot.read_text():
                    print(f"[driver] checkpoint of epoch {epoch} is registered: killing the driver "
                          f"(pid {os.getpid()}) now", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            except OSError:
                pass
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    rt = detect()
    workers = worker_resources(rt)   # the cluster's workers (joined first), or this machine
    sizes = rt.sizes
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--name", default=None, help="run name under the storage path (rerun it to resume)")
    p.add_argument("--num-workers", type=int, default=workers.default_workers,
                   help="default: one per GPU of the cluster's workers, else 2")
    p.add_argument("--use-gpu", action=argparse.BooleanOptionalAction, default=workers.use_gpu,
                   help="one GPU per worker (default: yes where the cluster's workers have GPUs)")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max-failures", type=int, default=2, help="worker failures this run survives")
    p.add_argument("--kill-at-epoch", type=int, default=None, help="rank 1 SIGKILLs itself once at this epoch")
    p.add_argument("--raise-at-epoch", type=int, default=None, help="rank 0 raises once at this epoch")
    p.add_argument("--stop-driver-after-epoch", type=int, default=None,
                   help="kill this driver once that epoch's checkpoint is registered")
    p.add_argument("--smoke-test", action="store_true", help="tiny data, 4 epochs")
    p.add_argument("--metrics-out", default=None, help="write the run's figures as JSON here")
    p.add_argument("--answers", default=None,
                   help="a Python file defining save_training_state, load_training_state and resume "
                        "(the notebook writes yours); they replace this script's own")
    args = p.parse_args(argv)
    if args.answers:
        use_answers(args.answers)
    if unfinished():
        print(f"error: {', '.join(unfinished())} is still an exercise: pass --answers FILE (module 04's "
              "notebook writes it from your cells) or finish the functions in this script", file=sys.stderr)
        return 2
    if args.smoke_test:
        from coursekit.runtime import SIZES

        sizes = SIZES["smoke"]
    name = args.name or f"fault-tolerant-{time.strftime('%Y%m%d-%H%M%S')}"
    epochs = args.epochs or max(4, sizes["epochs"])
    faults = {}
    if args.kill_at_epoch is not None:
        faults["kill"] = {"epoch": args.kill_at_epoch, "rank": min(1, args.num_workers - 1)}
    if args.raise_at_epoch is not None:
        faults["raise"] = {"epoch": args.raise_at_epoch, "rank": 0}
    for what, e in [("--kill-at-epoch", args.kill_at_epoch), ("--raise-at-epoch", args.raise_at_epoch),
                    ("--stop-driver-after-epoch", args.stop_driver_after_epoch)]:
        if e is not None and not 0 <= e < epochs:
            print(f"error: {what} {e} is not one of the run's epochs 0..{epochs - 1}", file=sys.stderr)
            return 2
    try:
        if rt.ray_address is None:
            check_scaling(args.num_workers, args.use_gpu, global_batch_size=sizes["global_batch_size"])
        if not rt.local_mode:  # a small machine (Binder) runs Ray Train's local mode on forked ranks: no Ray
            init_ray(rt)
        check_scaling(args.num_workers, args.use_gpu, global_batch_size=sizes["global_batch_size"])
        scaling_config = ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu,
                                       resources_per_worker={"CPU": 1})   # a GPU worker gets its GPU too
    except ScalingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root = storage_path(rt)
    if "://" in root and faults:
        print("error: fault injection needs a storage path on a shared file system", file=sys.stderr)
        return 2
    run_dir = Path(root) / name
    config = {"epochs": epochs, "lr": args.lr, "global_batch_size": sizes["global_batch_size"],
              "train_samples": sizes["train_samples"], "test_samples": sizes["test_samples"],
              "model": "small_cnn", "seed": 0, "faults": faults, "marker_dir": str(run_dir / "fault_markers")}
    load_digits(train=True, download=True)
    if args.stop_driver_after_epoch is not None:
        stop_driver_after(run_dir, args.stop_driver_after_epoch)
    trainer = TorchTrainer(
        train_func, train_loop_config=config, scaling_config=scaling_config,
        run_config=make_run_config(name, root, max_retries=args.max_failures, keep=None, metric=None, mode="max"))
    start = time.perf_counter()
    # trainer.fit(), or local mode where a Ray worker group does not fit (FailureConfig restarts the ranks there too)
    result = fit_trainer(trainer, rt)
    wall = time.perf_counter() - start
    df = result.metrics_dataframe
    print(df[["epoch", "loss", "accuracy", "started_at_epoch", "recovery_s"]].to_string(index=False))
    test = load_digits(train=False, limit=sizes["test_samples"], quiet=True)
    acc = accuracy(load_model(result.checkpoint), test.tensors, test.labels)
    print(f"test accuracy {acc:.3f}; fit took {wall:.1f} s; results in {result.path}")
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump({"epochs": df["epoch"].tolist(), "losses": df["loss"].tolist(),
                       "started_at_epoch": df["started_at_epoch"].tolist(),
                       "recovery_s": df["recovery_s"].tolist(), "test_accuracy": acc,
                       "fit_seconds": wall, "path": result.path,
                       "checkpoint": result.checkpoint.path}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
