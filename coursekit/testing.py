"""Test support: pretend to be one Ray Train worker, without starting Ray.

Exercise tests use this to check rank logic in milliseconds: inside
``simulated_worker(rank, world_size)`` the calls ``ray.train.get_context()`` and
``ray.train.report(...)`` answer as worker ``rank`` of ``world_size`` would,
``ray.train.torch.get_device()`` is the CPU, and every report (metrics and a
copy of the checkpoint's files) is recorded. Combined with
``coursekit.distributed.run_distributed`` (a real gloo process group) a whole
training function runs as N real DDP ranks without starting Ray.
Code must call them as ``ray.train.get_context()`` / ``ray.train.report()``,
the way the course writes them.
"""
from __future__ import annotations

import dataclasses
import io
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
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
        from ray.air._internal.torch_utils import contains_tensor

        if contains_tensor(metrics):   # what the real ray.train.report does (Train V2's context)
            raise ValueError("Passing objects containing Torch tensors as metrics is not supported: "
                             "report Python numbers (.item()) and put tensors in the checkpoint")
        files = None
        if checkpoint is not None:
            with checkpoint.as_directory() as d:  # copy now: the student's temp dir vanishes
                files = {str(p.relative_to(d)): p.read_bytes() for p in Path(d).rglob("*") if p.is_file()}
        reports.append(SimulatedReport(metrics=dict(metrics), files=files))

    import ray.train.torch
    import ray.train.v2.torch.train_loop_utils as loop_utils
    import torch

    # prepare_model/prepare_data_loader send a usage tag to the Ray cluster; a simulated
    # worker has no cluster (and in a forked process that call would hang).
    with mock.patch.object(ray.train, "get_context", lambda: ctx), \
            mock.patch.object(ray.train, "report", report), \
            mock.patch.object(loop_utils, "record_extra_usage_tag", lambda *a, **k: None), \
            mock.patch.object(ray.train.torch, "get_device", lambda: torch.device("cpu")):
        yield reports


def check_concept(answer, expected, why: str) -> None:
    """Grade a concept question: ``answer`` (a letter, or a set/list of letters) against ``expected``.

    A wrong answer fails with the expected answer's explanation; a right one prints it (stdout
    only: nbgrader scores a test cell that writes to stderr as failed)."""
    def norm(a):
        if isinstance(a, str):
            return frozenset(x for x in a.replace(",", " ").lower().split())
        if isinstance(a, (set, frozenset, list, tuple)):
            return frozenset(str(x).strip().lower() for x in a)
        return frozenset({str(a).strip().lower()})

    if norm(answer) != norm(expected):
        raise AssertionError(f"not quite ({answer!r}). Why: {why}")
    print(f"Right. {why}")
