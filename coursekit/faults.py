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
worker of a restarted group sees, without starting Ray. :func:`bucket_checkpoint`
makes that checkpoint live on storage that is not a local folder (an in-memory
bucket, as S3 or GCS would be), and :func:`checkpoints_ray_keeps` asks Ray Train's
own checkpoint manager which checkpoints a ``CheckpointConfig`` keeps.
"""
from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

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


class RankReport(NamedTuple):
    """One ``ray.train.report`` of a simulated rank, as module 04's checks keep it (importable, so that it travels
    back from forked or spawned ranks): the report's epoch, its checkpoint's files (``{name: bytes}``, None without
    a checkpoint), and the rank's torch RNG state at that moment (``torch.get_rng_state()``)."""
    epoch: int
    files: dict | None
    rng: Any


def bucket_checkpoint(files: dict[str, bytes], name: str | None = None):
    """A ``ray.train.Checkpoint`` holding ``files`` ({file name: bytes}) on storage that is not a local folder.

    The files go into an in-memory bucket: a pyarrow filesystem (fsspec's ``MemoryFileSystem`` behind
    ``pyarrow.fs.PyFileSystem``, seen through a ``SubTreeFileSystem``), the way ``RunConfig(storage_path="s3://...")``
    or ``RunConfig(storage_filesystem=...)`` gives Ray Train a checkpoint in cloud storage. Its ``.path`` is then a
    path inside the bucket (``course-bucket/<name>``, as an S3 checkpoint's is ``bucket/path``), which no local
    ``open()`` or ``os`` function finds; ``checkpoint.as_directory()`` (or ``to_directory()``) downloads it into a
    local temporary folder, and removes that folder when the ``with`` block ends. The bucket lives in this process
    only."""
    import pyarrow.fs
    from fsspec.implementations.memory import MemoryFileSystem
    from ray.train import Checkpoint

    fs = pyarrow.fs.SubTreeFileSystem("/", pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(MemoryFileSystem())))
    path = f"course-bucket/{name or 'checkpoint-' + uuid.uuid4().hex[:8]}"
    fs.create_dir(path)
    for file_name, content in files.items():
        parent = os.path.dirname(file_name)
        if parent:
            fs.create_dir(f"{path}/{parent}")
        with fs.open_output_stream(f"{path}/{file_name}") as f:
            f.write(content)
    return Checkpoint(path, filesystem=fs)


def checkpoints_ray_keeps(reports: list[dict], checkpoint_config, storage_path: str | os.PathLike | None = None,
                          name: str = "keep-demo") -> dict:
    """What ``checkpoint_config`` leaves in storage after one checkpoint per report, decided by Ray Train itself.

    Each report (a metrics dict with an ``"epoch"``) gets a small checkpoint, persisted and registered as the
    controller does at a ``ray.train.report(..., checkpoint=...)``: Ray Train's ``StorageContext`` and
    ``CheckpointManager`` (ray/train/v2/_internal/execution/checkpoint/checkpoint_manager.py), which prunes with
    ``num_to_keep`` and the score after every registration. Returns ``{"in_storage": [epochs of the checkpoint
    folders left in storage], "latest": epoch of the checkpoint that ray.train.get_checkpoint() hands a restarted
    worker group or a rerun under the same name (``result.checkpoint``), "rows": [epochs of the checkpoints that
    ``result.best_checkpoints`` and ``result.metrics_dataframe`` list, worst first]}``."""
    from ray.train import Checkpoint
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.storage import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    from coursekit.localmode import _in_thread, _quiet

    with tempfile.TemporaryDirectory() as scratch, _quiet("ray.train"):
        storage = StorageContext(storage_path=str(storage_path or scratch), experiment_dir_name=name)
        manager = _in_thread(lambda: CheckpointManager(checkpoint_config=checkpoint_config, storage_context=storage))
        for metrics in reports:
            with tempfile.TemporaryDirectory() as tmp:
                Path(tmp, "metrics.json").write_text(json.dumps(metrics))
                persisted = storage.persist_current_checkpoint(Checkpoint.from_directory(tmp),
                                                               f"epoch_{metrics['epoch']:04d}")
            _in_thread(manager.register_checkpoint,
                       _TrainingReport(checkpoint=persisted, metrics=dict(metrics), validation=False))
        run = Path(storage.experiment_fs_path)
        in_storage = sorted(int(p.name.split("_")[1]) for p in run.glob("epoch_*"))
        rerun = _in_thread(lambda: CheckpointManager(checkpoint_config=checkpoint_config, storage_context=storage))
        latest = rerun.latest_checkpoint_result
        rows = [r.metrics["epoch"] for r in rerun.best_checkpoint_results]
        return {"in_storage": in_storage, "latest": latest.metrics["epoch"] if latest else None, "rows": rows}


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
    >>> controls.run_config_args()   # max_retries, keep, metric, mode: the arguments of make_run_config
    """

    # the score metrics the live run reports, and which end of each is best (None: no score, the most recent)
    MODES = {"loss": "min", "accuracy": "max", None: "max"}

    def __init__(self, epochs: int, num_workers: int, kill_epoch: int | None = 1, raise_epoch: int | None = 2,
                 max_failures: int | None = 2, keep: int | None = None, metric: str | None = "loss"):
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
        self.metric = w.Dropdown(options=[("loss", "loss"), ("accuracy", "accuracy"), ("none: the most recent", None)],
                                 value=metric, description="checkpoint score", style=STYLE, layout=layout())
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
        """``max_retries`` (None: no limit), ``keep``, ``metric`` (None: no score) and ``mode`` (which end of the
        metric is best): what ``make_run_config`` takes."""
        return {"max_retries": None if self.unlimited.value else self.max_failures.value,
                "keep": self.keep.value, "metric": self.metric.value, "mode": self.MODES[self.metric.value]}

    def in_storage(self) -> tuple[int, int]:
        """How many checkpoint folders storage holds when the run ends: (at least, at most).

        Ray Train 2.60 (``CheckpointManager._save_state_and_delete_old_checkpoints``) keeps the ``num_to_keep``
        best by the score, or the most recent without one, and never deletes the **latest** checkpoint, the one a
        restart resumes from. With a score the latest may rank below the K best: then it is kept as well, K + 1
        in all. Without a score the latest is one of the K most recent."""
        k = min(self.keep.value, self.epochs)
        extra = 1 if self.metric.value is not None and self.keep.value < self.epochs else 0
        return k, k + extra

    def expected(self) -> dict:
        """What the run should do: how many failures, whether it finishes, the epochs each worker group starts at
        (a restart resumes from the checkpoint of the epoch before the fault), and ``kept``: the checkpoints the
        ``Result`` lists (``best_checkpoints``, one ``metrics_dataframe`` row each), the K best or most recent;
        storage may hold one more (:meth:`in_storage`)."""
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
        low, high = self.in_storage()
        if args["metric"] is None:
            which = f"the {e['kept']} most recent (the latest among them)"
        else:
            order = "lowest" if args["mode"] == "min" else "highest"
            which = f"the {e['kept']} with the {order} <code>{args['metric']}</code>"
            if high > low:
                which += (", and the latest too when it is not one of them (a restart resumes from it): "
                          f"{low} or {high} in storage")
        self.summary.value = (f"The run {outcome}.<br>Kept checkpoints: {which}; <code>metrics_dataframe</code> has "
                              f"{e['kept']} row(s), one per checkpoint the <code>Result</code> lists.")

    def __repr__(self) -> str:
        return (f"FaultToleranceControls(faults={self.faults() if not self.problem() else '?'}, "
                f"{self.run_config_args()})")
