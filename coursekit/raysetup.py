"""Starting or joining Ray for the course, with the student's output in front.

* On Anyscale (or wherever ``RAY_ADDRESS`` is set) we join the existing cluster
  and ship ``coursekit`` to its workers with ``runtime_env={"py_modules": ...}``:
  Ray workers do not inherit the notebook's ``sys.path``.
* Elsewhere we start a local Ray sized for this machine, without the dashboard
  unless asked (``init_ray(dashboard=True)``), and on small machines (Binder,
  CI) with a capped object store.
* Ray Train's internal chatter (controller status lines, placement-group
  polling warnings, "Reporting training result ...") is filtered out of what
  the driver prints. Your own ``print`` calls on the workers, and every error
  or traceback, still show. ``COURSE_RAY_VERBOSE=1`` turns the filter off.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

from coursekit.runtime import Runtime, detect, settings

# Lines from Ray Train's own loggers that say nothing a student can act on.
_NOISE = re.compile(
    r"Failed to query Ray Train Controller actor state"
    r"|Reporting training result \d+"
    r"|Checkpoint successfully created at"
    r"|Setting up process group for"
    r"|Moving model to device"
    r"|Wrapping provided model in"
    r"|Requesting resources:"
    r"|Attempting to start training worker group"
    r"|Started training worker group of size"
    r"|- \(ip=\S+, pid=\d+\) world_rank="
    r"|has constructor arguments in the object store and max_restarts"
    r"|Running in local mode\. The training function will run in the same process"
    r"|Reported metrics: \{"
    r"|Progress bars disabled\. To enable"  # Ray Data, when its progress bars are turned off
    r"|Dataset \S+ execution finished in [\d.]+ seconds"  # Ray Data's per-run info line
    r"|PYTHON worker processes have been started on node"  # the raylet, when many actors start on 2 cores
)
_NOISY_ACTORS = {"PlacementGroupCleaner"}
# A warning (with its traceback) that the controller logs when a helper actor is
# slow to start on an overloaded machine; Ray itself calls it safe to ignore.
_NOISY_BATCH = re.compile(r"Failed to send resource request for train-")
_KEEP = re.compile(r"Traceback|Error|error|fail|Fail|Exception|retry|Retry|restart|Restart")

# Environment for every Ray process we start: fewer helper actors and faster
# polling, which matters on a 2-core machine.
RAY_ENV = {
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    # How often Ray Train's controller polls its workers (default 2 s): a fit() ends at the first poll
    # after the train function has returned, so every fit() waits for up to two intervals after its last
    # report. A poll is one small actor call per worker; a worker that answers late is polled again, and
    # is declared dead only after RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S (10 min), whatever the interval.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
    "RAY_DEDUP_LOGS": "0",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    # Ray Train gives a new worker group 60 s to get its resources. On 2 busy cores (two Tune
    # trials each starting a controller and a worker that import torch) that is not enough, and
    # a timed-out start could leave its placement group behind and starve the retry.
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300",
    # How long Ray Tune waits for a trial it stopped (ASHA's decision) to end before killing its actor (default
    # 600 s; read by the driver's Tuner.fit). A stopped trial's fit() can block: its Train controller hands each
    # report to the trial through a queue of one item that nobody reads any more. Its CPUs are free only when the
    # trial's actor is gone, so the trials still waiting wait that long.
    "TUNE_FORCE_TRIAL_CLEANUP_S": "30",
}


# Every Ray Train fit() starts 6 new Python processes (controller, placement-group cleaner, dataset
# manager, synchronization actor, 2 workers; the first fit of a session a 7th, the autoscaling coordinator),
# and the raylet starts at most num_cpus of them at once: on a small machine the workers' processes wait
# behind the helpers'. Letting them start together costs no idle memory.
# By default Ray also starts one idle worker process per CPU when it starts (about 100 MiB each), and again
# for the first driver. Only work with no runtime_env at all may run in them, and the course's job always has
# one (the env_vars below; Ray Train gives its controller and workers their own as well), so no task or actor
# of the course ever used them: they only took memory, and CPU while the first fit() started.
START_SYSTEM_CONFIG = {"worker_maximum_startup_concurrency": 8,
                       "enable_worker_prestart": False, "prestart_worker_first_driver": False}


# The name under which Ray's driver prints its workers' log lines (a handler of its stdstream dispatcher).
_LOG_PRINTER = "ray_print_logs"


def _is_noise(actor: str, line: str) -> bool:
    if actor in _NOISY_ACTORS:
        return True
    if _KEEP.search(line) and "Failed to query Ray Train Controller" not in line:
        return False
    return bool(_NOISE.search(line))


def set_log_printer(select_lines: Callable[[dict], list[str]]) -> Callable | None:
    """Make Ray's driver print only ``select_lines(batch)`` of each batch of worker log lines
    (a batch is Ray's dict with ``lines`` and ``actor_name``). Returns the printer it replaced
    (the course's filter or Ray's own; None if there was none), for :func:`restore_log_printer`.
    Raises if this Ray has no such printer (its internals changed)."""
    from coursekit.ray_internals import print_to_stdstream, ray_worker, should_ignore_worker_log_prefix

    dispatcher = ray_worker.global_worker_stdstream_dispatcher
    ignore_prefix = should_ignore_worker_log_prefix(ray_worker.global_worker)

    def printer(data):
        lines = select_lines(data)
        if lines:
            print_to_stdstream({**data, "lines": lines}, ignore_prefix=ignore_prefix)

    previous = dict(getattr(dispatcher, "handlers", ())).get(_LOG_PRINTER)
    dispatcher.remove_handler(_LOG_PRINTER)
    dispatcher.add_handler(_LOG_PRINTER, printer)
    return previous


def restore_log_printer(previous: Callable | None) -> None:
    """Put back the printer :func:`set_log_printer` replaced."""
    from coursekit.ray_internals import ray_worker

    dispatcher = ray_worker.global_worker_stdstream_dispatcher
    dispatcher.remove_handler(_LOG_PRINTER)
    if previous is not None:
        dispatcher.add_handler(_LOG_PRINTER, previous)


def _without_noise(data: dict) -> list[str]:
    actor = data.get("actor_name") or ""
    lines = data.get("lines", [])
    if any(_NOISY_BATCH.search(ln) for ln in lines):
        return []
    return [ln for ln in lines if not _is_noise(actor, ln)]


def _install_log_filter() -> bool:
    """Wrap Ray's driver-side log printer with the noise filter. False if Ray changed."""
    try:
        set_log_printer(_without_noise)
        return True
    except Exception:
        return False


def _use_cluster_token() -> None:
    """Clusters started with `ray start` (Ray >= 2.5x) require a token, kept in ~/.ray/auth_token.

    A driver that joins by address does not switch to token mode by itself and then
    fails with a bare "Failed to connect"; do what Ray does for local clusters."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    from coursekit.ray_internals import maybe_enable_token_auth_if_token_available

    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    except Exception:  # a token Ray cannot read: connect as before, and let Ray say what is wrong
        pass


def _course_env(runtime: Runtime | None = None) -> dict[str, str]:
    """COURSE_* settings travel to the workers, so detect() there agrees with the driver. A local Ray's workers
    (``runtime`` without a cluster to join) also get the driver's data folder, which their own working
    directory would not tell them (coursekit.runtime: where files go)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("COURSE_")}
    if runtime is not None and not runtime.ray_address:
        env.setdefault("COURSE_DATA", runtime.data_dir)
    env.update(RAY_ENV)
    return env


# How often init_ray tries to start a local Ray before giving up (see the loop below).
START_ATTEMPTS = 3


def init_ray(runtime: Runtime | None = None, quiet: bool | None = None, dashboard: bool = False, **overrides):
    """Start Ray for this machine, or join the cluster the runtime points at. Idempotent.

    ``dashboard=True`` starts a local Ray with its dashboard (about 10 s more start-up and a
    few hundred MB): its State API is how Ray Train's placement-group cleaner learns that a
    run's controller died, so a Tune trial stopped early frees its workers' CPUs (module 04,
    ray-project/ray#54305). A cluster you join has its own dashboard."""
    import ray

    rt = runtime or detect()
    if ray.is_initialized():
        return ray.get_runtime_context()
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    quiet = not settings().ray_verbose if quiet is None else quiet
    runtime_env = {"env_vars": _course_env(rt)}
    kwargs: dict = dict(logging_level=logging.ERROR, log_to_driver=True)
    if rt.ray_address:
        import coursekit

        _use_cluster_token()
        runtime_env["py_modules"] = [str(Path(coursekit.__file__).parent)]
        kwargs.update(address=rt.ray_address)
    else:
        kwargs.update(num_cpus=rt.num_cpus, num_gpus=rt.num_gpus, include_dashboard=dashboard,
                      _system_config=dict(START_SYSTEM_CONFIG))
        if rt.lean:
            kwargs.update(object_store_memory=256 * 2**20)
    kwargs["runtime_env"] = runtime_env
    system_config = {**kwargs.get("_system_config", {}), **overrides.pop("_system_config", {})}
    kwargs.update(overrides)
    if system_config:
        kwargs["_system_config"] = system_config
    # On a busy 2-core machine the raylet can die at start-up: it gives Ray's dashboard agent
    # a hard-coded 15 s to write its port file (ray-project/ray#65983), and Ray then reports
    # "timed out during startup" after 30 s. Starting again usually succeeds.
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            ctx = ray.init(**kwargs)
            break
        except Exception as e:
            if "timed out during startup" not in str(e) or rt.ray_address or attempt == START_ATTEMPTS:
                raise
            print(f"Ray did not start (the machine is busy); trying again ({attempt + 1}/{START_ATTEMPTS}) ...")
            ray.shutdown()
    if quiet:
        _install_log_filter()
    return ctx


def storage_path(runtime: Runtime | None = None) -> str:
    """Where Ray Train keeps results: created if missing (local paths)."""
    rt = runtime or detect()
    if "://" not in rt.storage_path:
        Path(rt.storage_path).mkdir(parents=True, exist_ok=True)
    return rt.storage_path
