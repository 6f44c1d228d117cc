"""Elastic training for real on one machine: a Ray cluster of several nodes whose worker node leaves and joins.

Module 04 shows Ray Train 2.60's elasticity, ``ScalingConfig(num_workers=(min, max))``: the run trains on as
many workers as the cluster holds, between ``min`` and ``max``, shrinks when a node is lost and grows when one
joins, each time restarting the worker group from the latest checkpoint. Seeing that needs nodes that come and go.

* :class:`LocalCluster` starts a head node and worker nodes on this machine with Ray's own test utility
  (``ray.cluster_utils.Cluster``: each node a raylet with its own CPUs and object store, as on separate
  machines), connects this process to it, and removes or adds a worker node while a run trains
  (:meth:`LocalCluster.fit`), as a lost machine or after a preemption notice. On exit it stops every node it started and disconnects: the Ray this process
  used before (``coursekit.raysetup.init_ray``) has to be started again.
* :func:`reporting_world_size` wraps a training function so that each of its ``ray.train.report`` calls also
  carries the worker group's size (``world_size``) and the per-worker batch (``global_batch_size //
  world_size``): ``result.metrics_dataframe`` then shows which group trained which epoch.

How Ray 2.60 decides the size (``ray/train/v2/_internal/execution/scaling_policy/elastic.py``): Ray Train asks
Ray's autoscaling coordinator (an actor, ``ray/data/_internal/cluster_autoscaler/
default_autoscaling_coordinator.py``) how many workers of ``resources_per_worker`` the cluster's *alive nodes*
hold; the coordinator refreshes its view of the nodes every 20 s (``TICK_INTERVAL_S``). A lost node kills the
workers on it (a worker-group failure: ``FailureConfig.max_failures`` counts it, or
``max_preemption_failures`` if the node was drained as a preemption); the restart then asks for the size. Up to
20 s after the loss the answer is still the old size: that placement group cannot be placed, times out after
``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` and is retried (not counted as a failure). A joined node is noticed at
the coordinator's next refresh by the healthy group's monitor, every ``elastic_resize_monitor_interval_s``; the
group is then stopped and started again at the new size (no failure). Expect a resize to take up to about 20 s
plus the start of new worker processes.

Clean-up: the nodes' processes are children of this process, in a private temp dir (also where the cluster's
address file goes, so that no other ``ray.init()`` on the machine finds this cluster). ``ray stop`` would kill
every Ray on the machine and is never used.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


from coursekit.distributed import free_port
from coursekit.faults.injection import registered_epochs
from coursekit.proctree import kill_named
from coursekit.runtime import detect, settings

# How long a new worker group may wait for its placement group before Ray Train tries another size. Ray's default
# is 60 s and the course's local Ray uses 300 s (coursekit.raysetup.RAY_ENV: trials that wait for each other's
# CPUs); here a wait can only mean a size decided from a view of the cluster that is up to 20 s old.
GROUP_START_TIMEOUT_S = 5
NODE_START_TIMEOUT_S = 120       # a raylet on a busy 2-core machine can take a minute to come up
# No idle worker processes started ahead of need (about 100 MiB each); start the run's processes together.
SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False,
                 "worker_maximum_startup_concurrency": 8}
OBJECT_STORE_BYTES = 128 * 2**20
PREEMPTION_NOTICE_S = 2          # LocalCluster.remove_node(preempt=True): the drain's deadline, from now

# Ray Train's lines about sizes and failures that a student should see while the cluster changes, each cut to its
# first sentence and shown once; the rest of its chatter (actor ids, the tracebacks of ranks whose peer vanished) is
# left out unless COURSE_RAY_VERBOSE=1.
_ELASTIC = re.compile(
    r"Detected ready resources for \d+ workers in the cluster\. Deciding to start/restart training[^.]*\."
    r"|Detected changes in the cluster resources\. Deciding to resize the worker group from \d+ -> \d+ workers\."
    r"|\[FailurePolicy\] \w+|Source: .*|Error count: .*"
    r"|The actor died because its node has died\."
    r"|The worker group startup timed out after [\d.]+ seconds waiting for \d+ workers\."
    r"|resuming from .*|\[fault\].*")
_EXCEPTION = re.compile(r"\s*[\w.]*(Error|Exception): ")


def _elastic_lines() -> Callable[[dict], list[str]]:
    """A line selector for ``coursekit.raysetup.set_log_printer``: the matches of ``_ELASTIC``. A failure's reason
    (a lost node, a worker group that found no room) is shown once, under the failure policy's decision; Ray
    Train logs it several times."""
    previous: dict[str, str] = {}

    def select(data: dict) -> list[str]:
        out = []
        key = str(data.get("actor_name") or data.get("pid") or "")
        for line in data.get("lines", []):
            m = _ELASTIC.search(line)
            if not m:
                if "RayTrainWorker" in key and _EXCEPTION.match(line):   # an error in the training function
                    out.append(line if len(line) <= 160 else line[:157] + "...")
                continue
            short = m.group(0)
            if short.startswith(("Source:", "Error count:")):
                short = "  " + short
            reason = short.startswith(("The actor died", "The worker group startup"))
            if not reason or previous.get(key, "").startswith("  Error count:"):
                out.append("  " + short if reason else short)
            previous[key] = short
        return out

    return select


def reporting_world_size(train_fn: Callable, hold_after: dict[int, int] | None = None,
                         hold_s: float = 120.0) -> Callable:
    """``train_fn`` with two more metrics in every ``ray.train.report(metrics, ...)`` it makes.

    ``world_size`` is ``ray.train.get_context().get_world_size()`` of the worker group that trained the
    epoch, and, if the config has ``global_batch_size``, ``per_worker_batch`` is ``global_batch_size //
    world_size`` (what a function that keeps the global batch fixed gives each worker).

    ``hold_after={epoch: world_size}``: a group of that size, after reporting that epoch, waits (up to ``hold_s``
    seconds) to be replaced instead of training on. A demonstration removes or adds a node when that epoch's
    checkpoint is registered (``LocalCluster.fit(changes=...)``); the hold makes the next epoch the first one of the
    resized group on any machine, however fast the epochs are. Without a resize the group trains on after
    ``hold_s``.

    Nothing is patched: the worker's reporting function is handed to Ray Train while ``train_fn`` runs, through
    the hook Ray Train's own ``ray.train.report`` calls (its ``TrainFnUtils``, which Ray documents as the place for
    new reporting behaviour): every report of ``train_fn``, however it calls ``ray.train.report``, goes through
    it, and Ray Train's reporting is restored when ``train_fn`` returns."""
    hold_after = dict(hold_after or {})

    takes_config = bool(inspect.signature(train_fn).parameters)

    def train_reporting_world_size(config: dict) -> Any:
        import ray.train

        world = ray.train.get_context().get_world_size()
        extra = {"world_size": world}
        if "global_batch_size" in (config or {}):
            extra["per_worker_batch"] = config["global_batch_size"] // world

        def report_with_world_size(report: Callable, metrics: dict, *args, **kwargs):
            result = report({**metrics, **extra}, *args, **kwargs)
            if hold_after.get(metrics.get("epoch")) == world:
                deadline = time.monotonic() + hold_s
                while time.monotonic() < deadline:   # Ray Train stops this group when it resizes
                    time.sleep(0.2)
            return result

        with reporting_through(report_with_world_size):
            return train_fn(config) if takes_config else train_fn()

    train_reporting_world_size.__doc__ = f"{getattr(train_fn, '__name__', 'train_fn')}, reporting world_size"
    return train_reporting_world_size


class _Reporting:
    """Ray Train's reporting of this worker (its ``TrainFnUtils``), with ``report`` going through ``report_with``."""

    def __init__(self, inner, report_with: Callable):
        self._inner, self._report_with = inner, report_with

    def report(self, metrics: dict, *args, **kwargs):
        return self._report_with(self._inner.report, metrics, *args, **kwargs)

    def __getattr__(self, name: str):   # everything else as Ray Train does it
        return getattr(self._inner, name)


@contextlib.contextmanager
def reporting_through(report_with: Callable):
    """Within this block, on a Ray Train worker, every ``ray.train.report(metrics, ...)`` calls
    ``report_with(report, metrics, ...)``, where ``report`` is Ray Train's own reporting function."""
    from coursekit.ray_internals import get_train_fn_utils, set_train_fn_utils

    inner = get_train_fn_utils()
    set_train_fn_utils(_Reporting(inner, report_with))
    try:
        yield
    finally:
        set_train_fn_utils(inner)


class LocalCluster:
    """A Ray cluster of ``1 + worker_nodes`` nodes on this machine, each with ``cpus_per_node`` CPUs.

    Use it as a context manager, from the main thread (Ray registers signal handlers for the nodes it starts)::

        with LocalCluster(worker_nodes=1, cpus_per_node=1) as cluster:   # this process joins it
            result = cluster.fit(trainer, changes={1: "remove"})   # the worker node goes after epoch 1

    Entering disconnects this process from any Ray it is connected to (a local Ray started by ``init_ray``
    stops), starts the nodes and connects. Exiting disconnects and stops them all. With one CPU per node and one
    CPU per Ray Train worker, each node holds exactly one worker: the workers spread over the nodes, and a
    lost node takes its worker with it.

    ``env``: environment variables for the run's processes (added to the course's, ``coursekit.raysetup``).
    """

    def __init__(self, worker_nodes: int = 1, cpus_per_node: int = 1, env: dict[str, str] | None = None,
                 quiet: bool | None = None):
        self.cpus_per_node = cpus_per_node
        self.initial_worker_nodes = worker_nodes
        self.env = dict(env or {})
        self.quiet = not settings().ray_verbose if quiet is None else quiet
        self.events: list[tuple[float, str]] = []   # (unix time, what happened), in order
        self._cluster = None
        self._temp_dir: str | None = None
        self._saved_env: dict[str, str | None] = {}
        self._sigterm = None
        self._printer = None
        self._nodes: list = []    # worker nodes, oldest first

    # --- nodes ----------------------------------------------------------------------------------------------

    def _node_args(self) -> dict:
        return dict(num_cpus=self.cpus_per_node, num_gpus=0, object_store_memory=OBJECT_STORE_BYTES,
                    temp_dir=os.path.join(self._temp_dir, "ray"))

    def _log(self, what: str) -> None:
        self.events.append((time.time(), what))
        print(f"[elastic] {what}", flush=True)

    @property
    def address(self) -> str:
        return self._cluster.address

    def alive_nodes(self) -> int:
        import ray

        return sum(1 for n in ray.nodes() if n["Alive"])

    def _start_node(self, **extra):
        """A new node (the head first), listed by the cluster; tried twice: on a busy 2-core machine a raylet can
        die at start-up (its dashboard agent gets a hard-coded 15 s, ray-project/ray#65983)."""
        from coursekit.ray_internals import services

        for attempt in (1, 2):
            node = None
            try:
                node = self._cluster.add_node(wait=False, **self._node_args(), **extra)
                services.wait_for_node(node.gcs_address, node.plasma_store_socket_name,
                                                    NODE_START_TIMEOUT_S)
                return node
            except Exception:
                if attempt == 2:
                    raise
                if node is not None:
                    with contextlib.suppress(Exception):
                        self._cluster.remove_node(node, allow_graceful=False)
                print("[elastic] a Ray node did not start (the machine is busy); trying again", flush=True)

    def add_node(self) -> None:
        """Start one more worker node (a machine that joins); returns when the cluster lists it."""
        self._require_main_thread()
        self._nodes.append(self._start_node())
        self._log(f"node joined: the cluster has {1 + len(self._nodes)} nodes")

    def remove_node(self, preempt: bool = False) -> None:
        """Stop the newest worker node and every process on it (a machine that is lost). Ray notices at once:
        the node's raylet is gone, and so are the workers on it.

        ``preempt=True`` first drains the node as a preemption, as a cloud provider's notice or Kubernetes
        does (``ray drain-node --reason=DRAIN_NODE_REASON_PREEMPTION``): Ray Train then counts the lost workers
        against ``FailureConfig(max_preemption_failures)`` (unlimited by default), not ``max_failures``."""
        self._require_main_thread()
        node = self._nodes[-1]
        if preempt:
            from coursekit.ray_internals import drain_node_as_preemption

            deadline = time.time() + PREEMPTION_NOTICE_S
            accepted, why = drain_node_as_preemption(node.node_id, "preempted (coursekit.elastic)",
                                                     int(deadline * 1000))
            if not accepted:
                raise RuntimeError(f"Ray refused to drain the node: {why}")
            time.sleep(max(0.0, deadline - time.time()) + 0.5)   # the notice runs out, then the node goes
        self._nodes.pop()
        self._cluster.remove_node(node, allow_graceful=True)
        self._log(f"node {'preempted' if preempt else 'removed'}: the cluster has {1 + len(self._nodes)} nodes")

    @staticmethod
    def _require_main_thread() -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("LocalCluster: add and remove nodes from the main thread (Ray's node start-up "
                               "registers signal handlers)")

    # --- a run while the cluster changes ----------------------------------------------------------------------

    def fit(self, trainer, changes: dict[int, str] | None = None, timeout_s: float = 600):
        """``trainer.fit()``, while this cluster changes as ``changes`` says: ``{epoch: what}``, where ``what``
        happens once the run has registered the checkpoint of ``epoch``. ``"remove"``: the newest worker node is
        lost (:meth:`remove_node`); ``"preempt"``: the same after a preemption notice (``remove_node(preempt=True)``);
        ``"add"``: a worker node joins (:meth:`add_node`).

        ``fit()`` runs in a thread; this (main) thread watches the run's checkpoint snapshot and changes the
        cluster. Returns the ``Result``; raises what ``fit()`` raised."""
        actions = {"remove": self.remove_node, "preempt": lambda: self.remove_node(preempt=True),
                   "add": self.add_node}
        plan = sorted((changes or {}).items())
        unknown = [what for _, what in plan if what not in actions]
        if unknown:
            raise ValueError(f"unknown cluster change(s) {unknown}: use {', '.join(actions)}")
        run_dir = Path(trainer.run_config.storage_path, trainer.run_config.name)
        outcome: dict[str, Any] = {}

        def run():
            try:
                outcome["result"] = trainer.fit()
            except BaseException as e:   # handed to the main thread
                outcome["error"] = e

        saved = {k: os.environ.get(k) for k in self._fit_env()}
        os.environ.update(self._fit_env())   # Ray Train hands these from the driver to its controller
        thread = threading.Thread(target=run, name="elastic-fit", daemon=True)
        try:
            self._log("fit started")
            thread.start()
            deadline = time.monotonic() + timeout_s
            while thread.is_alive():
                if plan and plan[0][0] in registered_epochs(run_dir):
                    epoch, what = plan.pop(0)
                    self._log(f"epoch {epoch}'s checkpoint is registered")
                    actions[what]()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the run did not finish in {timeout_s} s")
                thread.join(0.2)
        finally:
            _restore_env(saved)
        self._log("fit finished")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    def _fit_env(self) -> dict[str, str]:
        return {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(GROUP_START_TIMEOUT_S), **self.env}

    # --- start and stop -------------------------------------------------------------------------------------

    def __enter__(self) -> "LocalCluster":
        import ray

        from coursekit.ray_internals import Cluster
        from coursekit.raysetup import RAY_ENV, _course_env, set_log_printer

        if ray.is_initialized():
            ray.shutdown()
        # Short and private: Ray's unix sockets live under it (107-character limit), its path names our
        # processes at clean-up, and the cluster's address file goes there (RAY_TMPDIR) instead of
        # /tmp/ray/ray_current_cluster, which every other ray.init() on this machine would read and join.
        self._temp_dir = tempfile.mkdtemp(prefix="ela", dir="/tmp")
        os.makedirs(os.path.join(self._temp_dir, "ray"))
        if threading.current_thread() is threading.main_thread():
            self._sigterm = signal.getsignal(signal.SIGTERM)   # each node's start-up replaces the handler
        self._saved_env = {k: os.environ.get(k) for k in ("RAY_TMPDIR", *RAY_ENV)}
        os.environ["RAY_TMPDIR"] = self._temp_dir
        for key, value in RAY_ENV.items():
            os.environ.setdefault(key, value)
        try:
            started = time.time()
            self._cluster = Cluster()
            self._start_node(include_dashboard=False, dashboard_port=free_port(), _system_config=SYSTEM_CONFIG)
            for _ in range(self.initial_worker_nodes):
                self._nodes.append(self._start_node())
            ray.init(address=self._cluster.address, logging_level="ERROR", log_to_driver=True,
                     runtime_env={"env_vars": {**_course_env(detect()), **self._fit_env()}})
            nodes = self.alive_nodes()
            self._log(f"cluster up in {time.time() - started:.0f} s: {nodes} nodes with "
                      f"{self.cpus_per_node} CPU each")
            if self.quiet:
                with contextlib.suppress(Exception):
                    self._printer = set_log_printer(_elastic_lines())
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self._cluster is not None:
            for node in [*reversed(self._nodes), self._cluster.head_node]:
                if node is not None:
                    with contextlib.suppress(Exception):
                        self._cluster.remove_node(node, allow_graceful=False)
            self._nodes = []
            with contextlib.suppress(Exception):
                from coursekit.ray_internals import forget_cluster

                forget_cluster()
            self._cluster = None
        if self._temp_dir:
            kill_named([self._temp_dir])
            shutil.rmtree(self._temp_dir, ignore_errors=True)
        _restore_env(self._saved_env)
        self._saved_env = {}
        if self._sigterm is not None:
            with contextlib.suppress(Exception):
                signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None
        if self._printer is not None:
            from coursekit.raysetup import restore_log_printer

            with contextlib.suppress(Exception):
                restore_log_printer(None)   # the next ray.init installs Ray's printer again
            self._printer = None


def _restore_env(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
