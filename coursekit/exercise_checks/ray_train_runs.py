"""Module 02's check runs: your ``train_func``, handed in as an argument, run as Ray Train workers without Ray
(forked CPU ranks, Ray Train's context simulated by ``coursekit.testing.simulated_worker``), while
``coursekit.testing.devices`` follows where each tensor would be on a GPU worker. Each run returns plain data for the
test cells to show, check (``coursekit.exercise_checks.ray_train``) and hand in (``coursekit.evidence``); the grader
trains the single-process reference itself and decides outside your kernel.
"""
from __future__ import annotations

import logging
import warnings

import torch

from coursekit.distributed import run_distributed
from coursekit.evidence import attempt, hand_in
from coursekit.testing import simulated_worker
from coursekit.testing.devices import tracking_devices   # where each tensor would be on a GPU worker

WHY = (", not on ray.train.torch.get_device(); on GPUs Ray Train's process group is NCCL, which reduces GPU "
       "tensors only, so there it raises 'No backend type associated with device type cpu'")
_runs: dict = {}
_references: dict = {}


def as_ray_worker(rank: int, world_size: int, train_func, config: dict, local_world_size: int) -> dict:
    """train_func as worker `rank` of `world_size` (Ray Train's context simulated): {"reports": [(metrics,
    model.pt's state or None), ...]} or {"raised": "ValueError: ..."}, and "device_problems": what would fail on a GPU."""
    logging.getLogger("ray.train").setLevel(logging.WARNING)  # also in spawned ranks (GPU machines)
    with warnings.catch_warnings(), simulated_worker(rank, world_size, local_world_size) as reports:
        warnings.simplefilter("ignore")  # a harmless library warning must not cost points (stderr)
        try:
            with tracking_devices(WHY) as tracker:   # get_device() is ACCELERATOR; collectives and tensors followed
                train_func(config)
        except ValueError as e:
            return {"raised": f"ValueError: {e}", "device_problems": tracker.problems}
    return {"reports": [(r.metrics, r.torch_load("model.pt") if r.has_checkpoint else None) for r in reports],
            "device_problems": tracker.problems}


def _answer(train_func) -> tuple:
    """train_func and the notebook's functions it calls by name: a new definition of any runs again."""
    names = getattr(train_func, "__globals__", {})
    own = [names.get(name) for name in train_func.__code__.co_names]
    return (train_func, *(f for f in own if callable(f) and getattr(f, "__module__", None) == "__main__"))


def run_ranks(train_func, world_size: int, config: dict, local_world_size: int | None = None) -> list:
    """Every rank's result of as_ray_worker; `local_world_size` workers per node (default: one node).
    Each layout runs once per answer: the checks of several test cells read the same run."""
    local = local_world_size or world_size
    key = (_answer(train_func), world_size, local, tuple(sorted(config.items())))
    if key not in _runs:
        try:
            _runs[key] = run_distributed(as_ray_worker, world_size, train_func, config, local, local_world_size=local,
                                         timeout_s=90)
        except (RuntimeError, TimeoutError) as e:
            _runs[key] = str(e)
    if isinstance(_runs[key], str):
        raise AssertionError(f"train_func on {world_size} worker(s), {local} per node, failed:\n{_runs[key]}")
    return _runs[key]


def reference_for(reference_train, config: dict) -> dict:
    """reference_train(config), once per config, on one thread (as each rank runs; faster for this small model)."""
    key = (reference_train, tuple(sorted(config.items())))
    if key not in _references:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _references[key] = reference_train(config)
        finally:
            torch.set_num_threads(threads)
    return _references[key]


def hand_in_runs(train_func, grade_id: str, layouts) -> None:
    """Every rank's reports and device problems for `layouts` ([world size, config, workers per node]): the
    notebook's and those the grader asks for. The grader trains the single-process reference itself."""
    hand_in(grade_id, runs=[{"layout": [ws, config, local], **attempt(run_ranks, train_func, ws, config, local)}
                            for ws, config, local in layouts])
