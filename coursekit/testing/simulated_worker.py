"""A simulated Ray Train worker: ``ray.train``'s calls answered as one worker of a group would, without Ray.

Exercise tests use this to check rank logic in milliseconds: inside
``simulated_worker(rank, world_size)`` the calls ``ray.train.get_context()`` and
``ray.train.report(...)`` answer as worker ``rank`` of ``world_size`` would,
``ray.train.torch.get_device()`` is the CPU, and every report (metrics and a
copy of the checkpoint's files) is recorded. Combined with
``coursekit.distributed.run_distributed`` (a real gloo process group) a whole
training function runs as N real DDP ranks without starting Ray.
Code must call them as ``ray.train.get_context()`` / ``ray.train.report()``,
the way the course writes them. :func:`simulated_restart` adds the checkpoint that
``ray.train.get_checkpoint()`` hands a restarted worker group.
"""
from __future__ import annotations

import dataclasses
import io
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple
from unittest import mock


@dataclasses.dataclass
class SimulatedReport:
    metrics: dict
    files: dict[str, bytes] | None  # relative path -> content; None when no checkpoint

    @property
    def has_checkpoint(self) -> bool:
        return self.files is not None

    def torch_load(self, name: str = "model.pt"):
        """Load one file of the reported checkpoint with torch.load (on the CPU)."""
        import torch

        if not self.files or name not in self.files:
            raise AssertionError(f"the reported checkpoint has no {name!r} (files: {sorted(self.files or {})})")
        return torch.load(io.BytesIO(self.files[name]), map_location="cpu", weights_only=True)


@contextmanager
def simulated_worker(rank: int = 0, world_size: int = 1, local_world_size: int | None = None):
    """Within this block, ray.train behaves as seen from worker ``rank`` of ``world_size``.

    ``local_world_size`` workers share a node (default: all of them, one node). With
    ``simulated_worker(3, 4, local_world_size=2)`` the worker is local rank 1 on node 1 of
    2 nodes x 2 workers, so code that confuses local and global ranks gives itself away.
    Yields the list of :class:`SimulatedReport` that ``ray.train.report`` receives."""
    import ray.train

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    local = world_size if local_world_size is None else local_world_size
    if local < 1 or world_size % local:
        raise ValueError(f"{world_size} workers do not fill nodes of {local}")
    reports: list[SimulatedReport] = []
    ctx = SimpleNamespace(
        get_world_rank=lambda: rank, get_world_size=lambda: world_size,
        get_local_rank=lambda: rank % local, get_local_world_size=lambda: local,
        get_node_rank=lambda: rank // local, get_experiment_name=lambda: "simulated",
        get_trial_name=lambda: "simulated", get_storage=lambda: None,
    )

    def report(metrics, checkpoint=None, **_):
        from coursekit.ray_internals import contains_tensor

        if contains_tensor(metrics):   # what the real ray.train.report does (Train V2's context)
            raise ValueError("Passing objects containing Torch tensors as metrics is not supported: "
                             "report Python numbers (.item()) and put tensors in the checkpoint")
        files = None
        if checkpoint is not None:
            with checkpoint.as_directory() as d:  # copy now: the student's temp dir vanishes
                files = {str(p.relative_to(d)): p.read_bytes() for p in Path(d).rglob("*") if p.is_file()}
        reports.append(SimulatedReport(metrics=dict(metrics), files=files))

    import ray.train.torch
    import torch

    from coursekit.ray_internals import train_loop_utils as loop_utils

    # prepare_model/prepare_data_loader send a usage tag to the Ray cluster; a simulated
    # worker has no cluster (and in a forked process that call would hang).
    with mock.patch.object(ray.train, "get_context", lambda: ctx), \
            mock.patch.object(ray.train, "report", report), \
            mock.patch.object(loop_utils, "record_extra_usage_tag", lambda *a, **k: None), \
            mock.patch.object(ray.train.torch, "get_device", lambda: torch.device("cpu")):
        yield reports


@contextmanager
def simulated_restart(rank: int = 0, world_size: int = 1, checkpoint=None):
    """A simulated Ray Train worker (:func:`simulated_worker`) whose ``ray.train.get_checkpoint()`` returns
    ``checkpoint``.

    ``checkpoint=None`` is a first start; a ``ray.train.Checkpoint`` is what every worker of a
    restarted (or resumed) worker group receives. Yields the list of reports."""
    import ray.train

    with simulated_worker(rank, world_size) as reports, \
            mock.patch.object(ray.train, "get_checkpoint", lambda: checkpoint):
        yield reports


class RankReport(NamedTuple):
    """One ``ray.train.report`` of a simulated rank, as module 04's checks keep it (importable, so that it travels
    back from forked or spawned ranks): the report's epoch, its checkpoint's files (``{name: bytes}``, None without
    a checkpoint), and the rank's torch RNG state at that moment (``torch.get_rng_state()``)."""
    epoch: int
    files: dict | None
    rng: Any
