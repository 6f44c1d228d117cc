"""Failures on purpose: kill or crash a training worker once, and test resume logic without Ray.

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
workers can measure how long recovery took.

:func:`simulated_restart` is :func:`coursekit.testing.simulated_worker` plus a
``ray.train.get_checkpoint()`` that returns the checkpoint you give it: what a
worker of a restarted group sees, without starting Ray.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from contextlib import contextmanager
from pathlib import Path

from coursekit.widgets import STYLE, Controls, layout, warning

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


@contextmanager
def simulated_restart(rank: int = 0, world_size: int = 1, checkpoint=None):
    """A simulated Ray Train worker (see coursekit.testing) whose get_checkpoint() returns ``checkpoint``.

    ``checkpoint=None`` is a first start; a ``ray.train.Checkpoint`` is what every worker of a
    restarted (or resumed) worker group receives. Yields the list of reports."""
    from unittest import mock

    import ray.train

    from coursekit.testing import simulated_worker

    with simulated_worker(rank, world_size) as reports, \
            mock.patch.object(ray.train, "get_checkpoint", lambda: checkpoint):
        yield reports


# What a student needs to see while a run fails and recovers; the rest is Ray's internals
# (actor ids, worker metadata, tracebacks of the *other* ranks' broken connections).
_FAILURE_KEEP = re.compile(
    r"\[fault\]|\[driver\]|\[FailurePolicy\]|Error count:|Source: |Rank \d+ Error Snippet"
    r"|InjectedFailure:|health check failed|resuming from|epoch \d+ loss")


@contextmanager
def quiet_failure_logs():
    """While a deliberate failure runs, show the fault, Ray Train's retry decisions and the
    workers' own progress lines, not the walls of tracebacks. COURSE_RAY_VERBOSE=1 shows all."""
    if os.environ.get("COURSE_RAY_VERBOSE") == "1":
        yield
        return
    from coursekit.raysetup import restore_log_printer, set_log_printer

    try:
        previous = set_log_printer(lambda data: [ln for ln in data.get("lines", []) if _FAILURE_KEEP.search(ln)])
    except Exception:  # another Ray: show everything rather than fail
        yield
        return
    try:
        yield
    finally:
        restore_log_printer(previous)


# --- the widget: the faults of the live run, and the configuration that must survive them -------------

class FaultToleranceControls(Controls):
    """Module 04's live run, chosen with controls: which faults to inject, and the ``FailureConfig`` /
    ``CheckpointConfig`` values (``max_failures``, ``num_to_keep``, the score metric) the run gets.

    >>> controls = FaultToleranceControls(epochs=4, num_workers=2)
    >>> controls                 # the controls, and what the run will do with them
    >>> controls.faults()        # the fault plan for inject_faults
    >>> controls.run_config_args()   # max_retries, keep, metric: the arguments of make_run_config
    """

    def __init__(self, epochs: int, num_workers: int, kill_epoch: int | None = 1, raise_epoch: int | None = 2,
                 max_failures: int | None = 2, keep: int | None = None, metric: str = "loss"):
        import ipywidgets as w

        self.epochs, self.num_workers = int(epochs), int(num_workers)
        when = [("never", None)] + [(f"epoch {e}", e) for e in range(self.epochs)]
        self.kill_epoch = w.Dropdown(options=when, value=kill_epoch, description="SIGKILL rank "
                                     f"{self.kill_rank} at", style=STYLE, layout=layout())
        self.raise_epoch = w.Dropdown(options=when, value=raise_epoch, description="exception on rank 0 at",
                                      style=STYLE, layout=layout())
        self.max_failures = w.IntSlider(value=2 if max_failures is None else int(max_failures), min=0, max=5,
                                        description="max_failures", style=STYLE, layout=layout())
        self.unlimited = w.Checkbox(value=max_failures is None, description="no limit (max_failures=-1)",
                                    style=STYLE, layout=layout())
        self.keep = w.IntSlider(value=self.epochs if keep is None else int(keep), min=1, max=self.epochs,
                                description="num_to_keep", style=STYLE, layout=layout())
        self.metric = w.Dropdown(options=["loss", "accuracy"], value=metric, description="checkpoint score",
                                 style=STYLE, layout=layout())
        self.summary, self.error = w.HTML(), w.HTML()
        self._watch(self.kill_epoch, self.raise_epoch, self.max_failures, self.unlimited, self.keep, self.metric)
        self.widget = w.VBox([w.HTML(f"<b>Fault tolerance</b> &nbsp; {self.epochs} epochs on "
                                     f"{self.num_workers} workers"), self.kill_epoch, self.raise_epoch,
                              self.max_failures, self.unlimited, self.keep, self.metric, self.summary, self.error])
        self._refresh()

    @property
    def kill_rank(self) -> int:
        return min(1, self.num_workers - 1)

    def problem(self) -> str | None:
        k, r = self.kill_epoch.value, self.raise_epoch.value
        if k is not None and k == r:
            return (f"Both faults at epoch {k}: the two ranks would fail together, which is one failure of the "
                    "worker group, not two. Pick different epochs.")
        return None

    def faults(self) -> dict:
        """The fault plan (for :func:`inject_faults`); raises ValueError when the choice cannot be run."""
        why = self.problem()
        if why:
            raise ValueError(why)
        plan = {}
        if self.kill_epoch.value is not None:
            plan["kill"] = {"epoch": self.kill_epoch.value, "rank": self.kill_rank}
        if self.raise_epoch.value is not None:
            plan["raise"] = {"epoch": self.raise_epoch.value, "rank": 0}
        return plan

    def run_config_args(self) -> dict:
        """``max_retries`` (None: no limit), ``keep`` and ``metric``: what ``make_run_config`` takes."""
        return {"max_retries": None if self.unlimited.value else self.max_failures.value,
                "keep": self.keep.value, "metric": self.metric.value}

    def expected(self) -> dict:
        """What the run should do: how many failures, whether it finishes, and the epochs each worker group
        starts at (a restart resumes from the checkpoint of the epoch before the fault)."""
        failures = sorted(e for e in (self.kill_epoch.value, self.raise_epoch.value) if e is not None)
        limit = self.run_config_args()["max_retries"]
        finishes = limit is None or len(failures) <= limit
        starts = [0] + (failures if finishes else failures[:limit])
        return {"failures": len(failures), "finishes": finishes, "group_starts": starts,
                "kept": min(self.keep.value, self.epochs)}

    def _refresh(self, _change=None) -> None:
        self.max_failures.disabled = self.unlimited.value
        why = self.problem()
        self.error.value = warning(why)
        if why:
            self.summary.value = ""
            return
        e, args = self.expected(), self.run_config_args()
        limit = "no limit" if args["max_retries"] is None else f"max_failures={args['max_retries']}"
        if e["finishes"]:
            outcome = (f"<span style='color:#1b7a1b'>finishes</span>: {e['failures']} failure(s), {limit}; worker "
                       f"groups start at epochs {e['group_starts']}")
        else:
            outcome = (f"<span style='color:#b00020'>fails</span> at failure {args['max_retries'] + 1} of "
                       f"{e['failures']} ({limit}): <code>result.error</code> says why")
        order = "lowest" if args["metric"].endswith("loss") else "highest"
        self.summary.value = (f"The run {outcome}.<br>Storage keeps {e['kept']} checkpoint(s): the {order} "
                              f"<code>{args['metric']}</code>; <code>metrics_dataframe</code> has {e['kept']} row(s).")

    def __repr__(self) -> str:
        return (f"FaultToleranceControls(faults={self.faults() if not self.problem() else '?'}, "
                f"{self.run_config_args()})")
