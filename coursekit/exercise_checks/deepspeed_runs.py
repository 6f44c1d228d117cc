"""Module 06's check runs: your functions, handed in as arguments, run on forked CPU ranks the way Ray Train's
workers would run them, beside the plain PyTorch runs they must reproduce. Each returns plain data (numbers,
strings, state dicts of tensors) for the test cells to show, check (``coursekit.exercise_checks.deepspeed``) and
hand in (``coursekit.evidence``); the grader computes its own references and verdicts outside your kernel.

The data and the model: ``TINY`` (a one-block ViT), 96 fixed images (``check_batches``) for Exercises 1 and 2, and
64 more (``known_batch``) for the known-good engine of Exercises 3 and 4 (``tiny_engine``), which does not depend on
your Exercise 1.
"""
from __future__ import annotations

import gc
import logging
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from coursekit.distributed import run_distributed
from coursekit.exercise_checks import deepspeed as checks
from coursekit.exercise_checks.fsdp import build_vit   # the notebook's build_vit_from
from coursekit.testing import simulated_worker
from coursekit.testing.devices import ACCELERATOR, mark_on_accelerator, tracking_devices

TINY = dict(depth=1, width=32, heads=4, patch=7, lr=1e-2, seed=0)     # small and fast: for checks and grading
_g = torch.Generator().manual_seed(1)
CHECK_IMAGES, CHECK_LABELS = torch.randn(96, 1, 28, 28, generator=_g), torch.randint(0, 10, (96,), generator=_g)
KNOWN_MICRO = 4                # the known engine's micro-batch
_g = torch.Generator().manual_seed(1)
KNOWN_DATA = (torch.randn(64, 1, 28, 28, generator=_g), torch.randint(0, 10, (64,), generator=_g))


def quiet_rank() -> None:
    """Forked ranks write to the notebook's output: keep DeepSpeed's and torch's warnings out of it."""
    import deepspeed

    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    sys.stderr = open(os.devnull, "w")
    deepspeed.utils.logger.setLevel(logging.ERROR)


def on_ranks(fn, world_size, *args, hint: str, local_world_size=None, timeout_s=30):
    """run_distributed for the checks: a failure or a hang becomes an AssertionError that says what was expected."""
    gc.freeze()    # the forked ranks' gc.collect() (DeepSpeed calls it) then skips the kernel's objects: ZeRO-3 starts faster
    try:
        return run_distributed(fn, world_size, *args, local_world_size=local_world_size, timeout_s=timeout_s)
    except (RuntimeError, TimeoutError) as error:
        raise AssertionError(f"{hint}\n{error}") from None
    finally:
        gc.unfreeze()


def check_batches(rank: int, world_size: int, micro: int, count: int) -> list:
    """This rank's first `count` micro-batches of `micro` samples (micro-batch i of rank r: slice i * world_size + r)."""
    slices = [slice((i * world_size + rank) * micro, (i * world_size + rank + 1) * micro) for i in range(count)]
    return [(CHECK_IMAGES[s], CHECK_LABELS[s]) for s in slices]


def known_batch(step, micro, rank, world_size):
    """The same micro-batch for every engine: step, micro-step (of 2) and rank pick a slice of KNOWN_DATA."""
    start = ((step * 2 + micro) * world_size + rank) * KNOWN_MICRO
    return KNOWN_DATA[0][start:start + KNOWN_MICRO], KNOWN_DATA[1][start:start + KNOWN_MICRO]


def ddp_run(rank, world_size, micro, accumulation, steps, make_optimizer, clip=1.0):
    """DDP from TINY's seed: `steps` optimizer steps of `accumulation` micro-batches per rank.
    Returns the weights and this rank's micro-batch losses."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(build_vit(TINY))
    optimizer = make_optimizer(model.parameters())
    losses = []
    for i, (images, labels) in enumerate(check_batches(rank, world_size, micro, steps * accumulation)):
        logits = model(images)
        loss = F.cross_entropy(logits, labels)
        (loss / accumulation).backward()
        losses.append(loss.item())
        if (i + 1) % accumulation == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}, losses


def full_weights(engine) -> dict:
    """The engine's full weights on this rank (ZeRO-3's partitions gathered first)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()),
                                           enabled=engine.zero_optimization_stage() == 3):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


class _EngineOnAccelerator:
    """The engine as your function sees it on a GPU node: engine.device is the worker's GPU (the stand-in here)."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return ACCELERATOR if name == "device" else getattr(self._engine, name)

    def __call__(self, *args, **kwargs):
        return self._engine(*args, **kwargs)


def track_devices(fn, engine, batches):
    """fn(engine, batches) as on a GPU worker (engine.device and get_device() the stand-in device, the batches on
    it): (its result, the problems a GPU would show)."""
    with tracking_devices(device_in_your_code_only=True, follow_data=False) as tracker:
        result = fn(_EngineOnAccelerator(engine), mark_on_accelerator(batches))
    return result, tracker.problems


# ------------------------------------------------------------------------------- Exercise 1: build_engine
def engines_took(rank, world_size, build_engine, cases):
    """As in a Ray Train worker: what the engine took from your config for each case (attempted one by one)."""
    from coursekit.evidence import attempt

    quiet_rank()

    def took(case):
        return checks.what_the_engine_took(build_engine(build_vit(TINY), world_size, **case))

    with simulated_worker(rank, world_size):
        return {"took": [attempt(took, case) for case in cases]}


def engines_trained(rank, world_size, build_engine, train_micro_batches, trainings):
    """For each [case, steps]: your engine of that case trained `steps` optimizer steps by your train_micro_batches
    (its full weights); what the engine of the first case took; DDP's run of the first case and its start."""
    from coursekit.evidence import attempt

    quiet_rank()

    def trained(case, steps):
        engine = build_engine(build_vit(TINY), world_size, **case)
        accumulation = case["global_batch_size"] // (case["micro_batch_size"] * world_size)
        train_micro_batches(engine, check_batches(rank, world_size, case["micro_batch_size"], steps * accumulation))
        return full_weights(engine)

    def like_ddp(case, steps):
        accumulation = case["global_batch_size"] // (case["micro_batch_size"] * world_size)
        reference, _ = ddp_run(rank, world_size, case["micro_batch_size"], accumulation, steps,
                               lambda params: torch.optim.AdamW(params, lr=case["lr"]), clip=checks.CLIPPING)
        return reference, build_vit(TINY).state_dict()

    with simulated_worker(rank, world_size):
        took = attempt(lambda: checks.what_the_engine_took(
            build_engine(build_vit(TINY), world_size, **trainings[0][0])))
        return {"trained": [attempt(trained, case, steps) for case, steps in trainings], "took": took,
                "ddp": like_ddp(*trainings[0])}


# ------------------------------------------------------------------------------- Exercise 2: train_micro_batches
def _sgd_run(rank, world_size, train_micro_batches, stage):
    """DeepSpeed (a config of the check's own, plain SGD) trained by train_micro_batches, and DDP's run beside it."""
    import deepspeed

    make_sgd = lambda params: torch.optim.SGD(params, lr=0.5)          # noqa: E731
    start = build_vit(TINY).state_dict()
    reference, losses = ddp_run(rank, world_size, 6, 2, 2, make_sgd, clip=0)
    model = build_vit(TINY)
    engine, *_ = deepspeed.initialize(model=model, optimizer=make_sgd(model.parameters()), config={
        "train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0})
    with simulated_worker(rank, world_size):     # engine.device and get_device(): the stand-in ACCELERATOR
        mean_loss, problems = track_devices(train_micro_batches, engine, check_batches(rank, world_size, 6, 4))
    weights = full_weights(engine)
    return {"weights": weights, "mean_loss": float(mean_loss), "steps": engine.global_steps, "problems": problems,
            "difference": checks.relative_difference(weights, reference, start),     # to DDP's run here (shown)
            "expected_loss": sum(losses) / len(losses)}


def micro_batch_runs(rank, world_size, train_micro_batches):
    """Your train_micro_batches on a ZeRO-2 and a ZeRO-3 engine (plain SGD, 2 micro-batches a step), each beside
    DDP's run: {stage: {"weights", "mean_loss", "steps", "problems", "difference", "expected_loss"}}."""
    quiet_rank()
    return {stage: _sgd_run(rank, world_size, train_micro_batches, stage) for stage in (2, 3)}


def bf16_run(rank, world_size, train_micro_batches, spec):
    """Your train_micro_batches on the bf16 engine of `spec`, its images bf16 like its weights: the weights, the
    mean loss you return, the logits' dtype and those logits' loss in fp64."""
    import deepspeed

    quiet_rank()
    model = build_vit(TINY)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=spec["lr"]),
        config={"train_micro_batch_size_per_gpu": spec["micro"], "gradient_accumulation_steps": spec["accumulation"],
                "zero_optimization": {"stage": spec["stage"]}, "bf16": {"enabled": True}})
    batches = [(images.to(torch.bfloat16), labels)
               for images, labels in check_batches(rank, world_size, spec["micro"], spec["micro_batches"])]
    logits = []                                   # what the engine's forward returned, micro-batch after micro-batch

    class Recorded:
        """The engine, recording the logits its forward pass returns."""
        def __getattr__(self, name):
            return getattr(engine, name)

        def __call__(self, *args, **kwargs):
            out = engine(*args, **kwargs)
            logits.append(out.detach().clone())
            return out

    with simulated_worker(rank, world_size):
        mean_loss = train_micro_batches(Recorded(), (batch for batch in batches))
    exact = [F.cross_entropy(out.double(), labels).item() for out, (_, labels) in zip(logits, batches)]
    return {"weights": {k: v.float() for k, v in full_weights(engine).items()}, "mean_loss": float(mean_loss),
            "logits_dtype": str(logits[0].dtype) if logits else None,
            "exact_loss": sum(exact) / len(exact) if exact else None}   # the loss of those logits, in fp64


# ------------------------------------------------------------------------------- Exercises 3 and 4: checkpoints
def tiny_engine(world_size, seed=0, stage=2):
    """A known-good engine of the TINY ViT (a torch AdamW handed to DeepSpeed): micro-batches of 4, one per
    optimizer step, ZeRO-3 partitioning every parameter as the notebook's for_device(..., "cpu") does."""
    import deepspeed

    model = build_vit({**TINY, "seed": seed})
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=TINY["lr"]),
                                      config={"train_micro_batch_size_per_gpu": KNOWN_MICRO,
                                              "gradient_accumulation_steps": 1, "zero_force_ds_cpu_optimizer": False,
                                              "zero_optimization": {"stage": stage,
                                                                    "stage3_param_persistence_threshold": 0}})
    return engine


def train_step(train_micro_batches, engine, rank, world_size, step=0):
    """One optimizer step of a known engine (one micro-batch of 4 per step) through your train_micro_batches."""
    return train_micro_batches(engine, [known_batch(step, 0, rank, world_size)])


def engine_state(engine):
    """This rank's parameters and Adam moments (ZeRO-2: full parameters, moment partitions)."""
    params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    moments = {f"{i}.{k}": v.clone() for i, s in enumerate(engine.optimizer.optimizer.state.values())
               for k, v in s.items() if torch.is_tensor(v)}
    return params, moments


def merge_reported(reports_by_rank, destination):
    """What Ray Train does in storage: every rank's reported files land in one checkpoint directory."""
    for reports in reports_by_rank:
        for report in reports:
            for name, content in (report.files or {}).items():
                (Path(destination) / name).parent.mkdir(parents=True, exist_ok=True)
                (Path(destination) / name).write_bytes(content)
    return destination


def described(reports) -> list:
    """A rank's reports as plain data: the metrics, whether a checkpoint came with them, its files' names."""
    return [{"metrics": r.metrics, "has_checkpoint": bool(r.has_checkpoint), "files": sorted(r.files or {})}
            for r in reports]


def saved_on_rank(rank, world_size, save_and_report, train_micro_batches, root):
    """One step of the known ZeRO-2 engine, then your save_and_report into this rank's own folder, as a worker of
    2 per node: (the rank's reports, its parameters and Adam moments)."""
    quiet_rank()
    engine = tiny_engine(world_size)
    train_step(train_micro_batches, engine, rank, world_size)
    directory = os.path.join(root, f"rank{rank}")          # this rank's own local directory
    os.makedirs(directory)
    with simulated_worker(rank, world_size, local_world_size=2) as reports:
        save_and_report(engine, dict(checks.REPORT_METRICS), directory)
    return reports, engine_state(engine)


def loaded_on_rank(rank, world_size, train_micro_batches, directory, seed):
    """A new known engine from `seed` (other weights) loads the merged checkpoint with DeepSpeed's own
    load_checkpoint: (its parameters and Adam moments, the epoch in what save_checkpoint wrote beside the model)."""
    quiet_rank()
    engine = tiny_engine(world_size, seed)                     # other weights
    train_step(train_micro_batches, engine, rank, world_size)
    engine.load_checkpoint(directory)                          # the weights and this rank's optimizer partition
    tag = (Path(directory) / "latest").read_text().strip()
    saved = torch.load(Path(directory) / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return engine_state(engine), {"epoch": saved.get("epoch")}


def _restore_once(rank, world_size, yours, directory, epoch, cloud):
    from ray.train import Checkpoint

    from coursekit.faults import bucket_checkpoint   # a checkpoint in an in-memory bucket (cloud storage)

    save_and_report, restore_checkpoint, train_micro_batches = yours
    engine = tiny_engine(world_size)                           # the run that saved
    train_step(train_micro_batches, engine, rank, world_size)
    with simulated_worker(rank, world_size):                   # your Exercise 3 writes the checkpoint
        save_and_report(engine, {"epoch": epoch, "loss": 0.0}, directory)
    # what ray.train.get_checkpoint() hands the new run: the folder, or with `cloud` a copy in cloud storage (an
    # in-memory bucket, as S3 would be: its path, 'course-bucket/...', is no folder on this machine)
    checkpoint = Checkpoint.from_directory(directory) if not cloud else bucket_checkpoint(
        {str(p.relative_to(directory)): p.read_bytes() for p in Path(directory).rglob("*") if p.is_file()})
    fresh = tiny_engine(world_size, seed=checks.RESUME_SEED)   # a new run, other weights
    with simulated_worker(rank, world_size):
        next_epoch = restore_checkpoint(fresh, checkpoint)
    (params, moments), (fresh_params, fresh_moments) = engine_state(engine), engine_state(fresh)
    # one more step from the restored state must equal one more step of the original run
    loss = train_step(train_micro_batches, engine, rank, world_size, 1)
    fresh_loss = train_step(train_micro_batches, fresh, rank, world_size, 1)
    return {"epoch": epoch, "cloud": cloud, "next_epoch": next_epoch, "params": params, "moments": moments,
            "fresh_params": fresh_params, "fresh_moments": fresh_moments, "loss": loss, "fresh_loss": fresh_loss,
            "after": engine_state(engine)[0], "fresh_after": engine_state(fresh)[0]}


def restored_on_rank(rank, world_size, save_and_report, restore_checkpoint, train_micro_batches, saves: list):
    """For each (saved epoch, directory, in cloud storage?), one after the other on the same ranks: a known engine
    steps once and saves with your save_and_report; a fresh engine (other weights) restores with your
    restore_checkpoint; both step once more. Their parameters, moments and losses, before and after."""
    quiet_rank()
    yours = (save_and_report, restore_checkpoint, train_micro_batches)
    return [_restore_once(rank, world_size, yours, directory, epoch, cloud) for epoch, directory, cloud in saves]
