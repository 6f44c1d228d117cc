"""Failures on purpose: kill or crash a training worker once, at a chosen epoch and rank.

Module 04 shows that Ray Train survives a worker that dies. To make that
repeatable a training function calls :func:`inject_faults` at the start of
every epoch with a *fault plan* such as::

    {"kill": {"epoch": 2, "rank": 1}, "raise": {"epoch": 3, "rank": 0}}

* ``kill``: the worker of that rank sends itself ``SIGKILL`` (a real process
  death: no Python exception, no clean-up, exactly what an out-of-memory kill
  or a lost node looks like to the others);
* ``raise``: the worker raises :class:`InjectedFailure` (a bug, a bad batch).

Each fault fires **once**: before it fires, the worker writes a marker file
(with the time) into ``marker_dir``, a folder every worker and every restart
sees (under the run's storage). A restarted worker group finds the marker and
trains on. :func:`seconds_since` reads the time back, so the restarted
workers can measure how long recovery took. :func:`registered_epochs` reads which
checkpoints Ray Train's controller has registered (from the run's snapshot).
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

KINDS = ("kill", "raise")


class InjectedFailure(RuntimeError):
    """The exception a ``raise`` fault throws (a stand-in for a bug in the training code)."""


def check_plan(plan: dict | None) -> dict:
    """Validate a fault plan; return it (``{}`` for None). Raises ValueError with the reason."""
    plan = dict(plan or {})
    for kind, spec in plan.items():
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}: use one of {', '.join(KINDS)}")
        if not isinstance(spec, dict) or not {"epoch", "rank"} <= set(spec):
            raise ValueError(f"fault {kind!r} needs an epoch and a rank, e.g. {{'epoch': 2, 'rank': 1}}")
        if spec["epoch"] < 0 or spec["rank"] < 0:
            raise ValueError(f"fault {kind!r}: epoch and rank must be >= 0, got {spec}")
    return plan


def marker(marker_dir: str | os.PathLike, kind: str) -> Path:
    return Path(marker_dir) / f"{kind}.done"


def inject_faults(plan: dict | None, epoch: int, rank: int, marker_dir: str | os.PathLike | None) -> None:
    """Fire the plan's faults that are due at (epoch, rank) and have not fired yet."""
    plan = check_plan(plan)
    if not plan:
        return
    if marker_dir is None:
        raise ValueError("a fault plan needs a marker_dir shared by all workers (under the run's storage)")
    for kind, spec in plan.items():
        if spec["epoch"] != epoch or spec["rank"] != rank:
            continue
        m = marker(marker_dir, kind)
        if m.exists():
            continue  # fired in an earlier attempt: this is the restarted group
        if epoch > 0:  # let the controller register the previous epoch's checkpoint first
            wait_until_registered(Path(marker_dir).parent, epoch - 1)
        m.parent.mkdir(parents=True, exist_ok=True)
        m.write_text(repr(time.time()))  # written (and closed) before the fault fires
        if kind == "kill":
            print(f"[fault] rank {rank}: SIGKILL to my own process (pid {os.getpid()}) at epoch {epoch}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # not reached: SIGKILL cannot be caught
        print(f"[fault] rank {rank}: raising InjectedFailure at epoch {epoch}", flush=True)
        raise InjectedFailure(f"injected failure at epoch {epoch} on rank {rank}")


def registered_epochs(run_dir: str | os.PathLike) -> list[int]:
    """Epochs whose checkpoints the Ray Train controller has registered (from the run's snapshot)."""
    snapshot = Path(run_dir) / "checkpoint_manager_snapshot.json"
    try:
        results = json.loads(snapshot.read_text())["checkpoint_results"]
    except (OSError, ValueError, KeyError):
        return []
    return sorted(r["metrics"]["epoch"] for r in results if "epoch" in r.get("metrics", {}))


def wait_until_registered(run_dir: str | os.PathLike, epoch: int, timeout_s: float = 60.0) -> bool:
    """Wait until the checkpoint of ``epoch`` is registered. A report is registered when the
    controller collects it (it polls the workers); a worker that dies right after reporting can
    take its last checkpoint with it, and the run then resumes from the one before."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if epoch in registered_epochs(run_dir):
            return True
        time.sleep(0.2)
    return False


def fired(marker_dir: str | os.PathLike | None) -> dict[str, float]:
    """The faults that have fired so far: {kind: unix time}."""
    if marker_dir is None:
        return {}
    out = {}
    for kind in KINDS:
        m = marker(marker_dir, kind)
        if m.exists():
            out[kind] = float(m.read_text())
    return out


def seconds_since(marker_dir: str | os.PathLike | None, kind: str) -> float | None:
    """Seconds since the fault ``kind`` fired, or None if it has not."""
    t = fired(marker_dir).get(kind)
    return None if t is None else time.time() - t
