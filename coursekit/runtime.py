"""One description of where the course runs: hardware, platform, sizes, storage.

Every notebook, script, test and the grader asks this module instead of
hard-coding ``"cuda"``, ``"nccl"``, ``/mnt/cluster_storage`` or a dataset size.
Moving between a 2-core laptop, Binder, CI and an Anyscale GPU cluster changes
what :func:`detect` returns, never the notebook.

This module is the one reader of the course's environment variables (all optional). :func:`detect`
reads those about the machine and where files go:

``COURSE_SIZE``      force a size profile: ``smoke``, ``cpu`` or ``gpu``
``COURSE_PLATFORM``  force a platform: ``anyscale``, ``binder``, ``ci``, ``local``
``COURSE_STORAGE``   where Ray Train writes results and checkpoints
``COURSE_DATA``      where datasets are cached
``COURSE_GRADING``   set by the autograder: smallest sizes, no downloads
``COURSE_SCHEDULE``  ``short``: the size profile's models and batches with fewer samples, epochs and trials
                     (``SHORT_SCHEDULE``; ``make gpu-check`` runs the notebooks at the gpu size this way)
``COURSE_LOCAL_MODE`` ``1``/``0``: run Ray Train fits in local mode on forked ranks or in a Ray
                     worker group (default: local mode on Binder and below ``RAY_TRAIN_MIN_GIB``)

and :func:`settings` the switches of the course's tools:

``COURSE_RAY_VERBOSE``  ``1``: show all of Ray's log lines (``coursekit.raysetup``, ``faults``, ``elastic``)
``COURSE_START_METHOD`` ``fork`` or ``spawn``: how ``coursekit.distributed.run_distributed`` starts its ranks
                        (default: fork, spawn where torch sees a GPU)
``COURSE_RECORD``       a JSON file that ``coursekit.results.record`` adds a notebook's figures to
``COURSE_ASKED``        set by the grader: JSON {grade_id: [inputs]}, what test cells also run for the grader
                        (``coursekit.evidence.asked``); its hidden inputs are not in the notebooks

Where files go when neither ``COURSE_STORAGE`` nor ``COURSE_DATA`` says: inside the course's folder
(``build/ray_results``, ``data/``) when the work runs there (the working directory is in it: its
notebooks, scripts, tests and make targets), else in the user's cache (``~/.cache/ray-train-course``,
``$XDG_CACHE_HOME`` if set): a copy of a module's folder elsewhere never writes into the course's folder.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import psutil

from coursekit.paths import REPO

REPO_ROOT = REPO   # the same folder, under the name module 07's notebook imports (coursekit.paths.REPO)
ANYSCALE_STORAGE = Path("/mnt/cluster_storage")
# Below this much memory a Ray worker group does not fit beside the notebook's kernel: a 2-worker fit starts
# Ray's own processes, a controller, the workers and four helper actors, each importing torch (README, Binder).
# Such a machine runs Ray Train in local mode on forked ranks (coursekit.localmode) and starts no Ray.
RAY_TRAIN_MIN_GIB = 4

# Size profiles: how much work a notebook does by default. "smoke" is what CI, the autograder and
# --smoke-test use; "cpu" is a student without a GPU (a laptop, Binder), and the size the test suite runs
# every notebook at (on 2 cores it costs about what "smoke" does: most of a notebook is starting processes);
# "gpu" is the real thing on a GPU cluster.
SIZES: dict[str, dict[str, int | str]] = {
    "smoke": dict(train_samples=1024, test_samples=256, epochs=2, global_batch_size=64,
                  vit_depth=2, vit_width=64, vit_heads=4, vit_patch=7, tune_trials=2, multinode_model="resnet18"),
    "cpu": dict(train_samples=1536, test_samples=256, epochs=3, global_batch_size=64,
                vit_depth=3, vit_width=96, vit_heads=4, vit_patch=7, tune_trials=4, multinode_model="resnet18"),
    "gpu": dict(train_samples=60000, test_samples=10000, epochs=5, global_batch_size=512,
                # ViT-Large-like (about 300M parameters): module 05 shards it with FSDP2
                vit_depth=24, vit_width=1024, vit_heads=16, vit_patch=4,
                # Ray Tune trials in module 04's search (each one a Ray Train run)
                tune_trials=8,
                # the model of module 01's two-node torchrun (train_ddp.py --model)
                multinode_model="resnet18"),
}
# What a CPU machine of Binder's size (the platform, or below RAY_TRAIN_MIN_GIB of memory) changes in any profile.
# Module 01's two-node torchrun runs 2 agents and 2 ranks beside the kernel, each importing torch; with ResNet18
# and Adam (about 250 MiB of model state per rank, and torchvision) it held 86% of the notebook's memory limit.
# The small CNN of module 01's exercises leaves a student room for cells of their own (tests/test_notebooks.py).
SMALL_MACHINE_SIZES: dict[str, int | str] = dict(multinode_model="small_cnn")
# COURSE_SCHEDULE=short: the same models, widths and batches, a shorter schedule (at most these many samples,
# epochs and trials): every code path of a profile in minutes (bench/gpu_check.py, at the gpu size).
SHORT_SCHEDULE: dict[str, int] = dict(train_samples=16384, test_samples=2048, epochs=2, tune_trials=2)


def _truthy(value: str | None) -> bool:
    return str(value).strip().lower() in {"1", "true", "yes", "on"}


def _detect_platform(env: dict) -> str:
    forced = env.get("COURSE_PLATFORM")
    if forced:
        if forced not in {"anyscale", "binder", "ci", "local"}:
            raise ValueError(
                f"COURSE_PLATFORM={forced!r} is not one of anyscale, binder, ci, local"
            )
        return forced
    if env.get("ANYSCALE_SESSION_ID") or env.get("ANYSCALE_CLUSTER_ID") or env.get("ANYSCALE_WORKSPACE_ID"):
        return "anyscale"
    if env.get("BINDER_LAUNCH_HOST") or env.get("BINDER_REQUEST") or env.get("BINDER_SERVICE_HOST"):
        return "binder"
    if _truthy(env.get("CI")) or env.get("PYTEST_CURRENT_TEST") or _truthy(env.get("COURSE_GRADING")):
        return "ci"
    return "local"


# A cgroup limit at or above this is "no limit" (cgroup v1 writes 2**63 rounded down to a page).
_UNLIMITED = 2**60


def _read_number(path: Path) -> float | None:
    try:
        text = path.read_text().split()
    except OSError:
        return None
    if not text or text[0] == "max":
        return None
    if path.name == "cpu.max":              # cgroup v2: "<quota> <period>" or "max <period>"
        return int(text[0]) / int(text[1]) if len(text) > 1 else None
    value = int(text[0])
    return None if value < 0 or value >= _UNLIMITED else value


def _limit(base: Path, group: str, *names: str) -> float | None:
    """The tightest limit ``names`` set on ``group`` or any cgroup above it, under the mount ``base``.

    A container sees its own cgroup as the mount's root, and the path in /proc/self/cgroup may then
    not exist under the mount: both the group's folders and the root are read."""
    folder = base / group.lstrip("/")
    folders = [folder, *folder.parents] if folder.is_relative_to(base) else [base]
    limits = []
    for d in folders:
        if not d.is_relative_to(base):
            break
        if len(names) == 2:                 # cgroup v1 CPU: quota / period
            quota, period = _read_number(d / names[0]), _read_number(d / names[1])
            value = quota / period if quota and period else None
        else:
            value = _read_number(d / names[0])
        if value is not None:
            limits.append(value)
    return min(limits) if limits else None


@dataclasses.dataclass(frozen=True)
class Cgroup:
    """One of this process's cgroups: its hierarchy's mount ``base``, the ``group`` path under it (as
    /proc/self/cgroup names it) and the cgroup ``version`` (1, or 2 for the unified hierarchy)."""
    base: Path
    group: str
    version: int

    @property
    def folder(self) -> Path:
        return self.base / self.group.lstrip("/")


def own_cgroups(controller: str, sys_root: Path = Path("/sys/fs/cgroup"),
                proc_cgroup: Path = Path("/proc/self/cgroup")) -> list[Cgroup]:
    """This process's cgroups where ``controller``'s files ("memory", "cpu") may be: the v1 hierarchy
    that holds the controller and the v2 (unified) one, at the root or under "unified" in hybrid mode.
    The one reader of /proc/self/cgroup (limits here, the grader's memory cgroups in autograder.contain)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":
            base = sys_root if (sys_root / "cgroup.controllers").exists() else sys_root / "unified"
            found.append(Cgroup(base, group, 2))
        elif controller in controllers.split(","):
            names = (controllers, controller, *(("cpu,cpuacct", "cpuacct,cpu") if controller == "cpu" else ()))
            base = next((sys_root / n for n in names if (sys_root / n).is_dir()), sys_root / controller)
            found.append(Cgroup(base, group, 1))
    return found


def cgroup_limits(sys_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
                  ) -> tuple[float | None, int | None]:
    """(CPUs, memory bytes) that this process's cgroups allow, None where unlimited or unknown.

    Binder, Kubernetes pods (KubeRay) and Docker set these; the host's CPU and memory counts do not
    show them. Reads cgroup v2 (``cpu.max``, ``memory.max``) and v1 (``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``, ``memory.limit_in_bytes``)."""
    cpu = [_limit(c.base, c.group, "cpu.max") if c.version == 2 else
           _limit(c.base, c.group, "cpu.cfs_quota_us", "cpu.cfs_period_us")
           for c in own_cgroups("cpu", sys_root, proc_cgroup)]
    memory = [_limit(c.base, c.group, "memory.max" if c.version == 2 else "memory.limit_in_bytes")
              for c in own_cgroups("memory", sys_root, proc_cgroup)]
    cpu, memory = [v for v in cpu if v is not None], [v for v in memory if v is not None]
    return (min(cpu) if cpu else None), (int(min(memory)) if memory else None)


def _count_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install must not stop a CPU student
        return 0


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Where the course is running, and the defaults that follow from it."""

    platform: str          # anyscale | binder | ci | local
    # This machine (the driver's: the notebook's kernel or the script), within its container's limits.
    # What Ray Train's workers get on a cluster is coursekit.scaling.worker_resources().
    num_cpus: int          # CPUs this machine offers
    num_gpus: int          # GPUs this machine has
    memory_gib: float      # memory of this machine
    size: str              # smoke | cpu | gpu
    storage_path: str      # Ray Train RunConfig(storage_path=...)
    data_dir: str          # dataset cache
    ray_address: str | None  # an existing Ray cluster to join, or None to start one
    grading: bool = False
    local_mode: bool = False  # Ray Train fits run in local mode on forked ranks; no Ray is started
    short: bool = False       # COURSE_SCHEDULE=short: SHORT_SCHEDULE caps the profile's samples, epochs, trials

    @property
    def use_gpu(self) -> bool:
        return self.num_gpus > 0

    @property
    def device(self) -> str:
        return "cuda" if self.use_gpu else "cpu"

    @property
    def backend(self) -> str:
        """The torch.distributed backend: NCCL between GPUs, gloo on CPUs."""
        return "nccl" if self.use_gpu else "gloo"

    @property
    def sizes(self) -> dict[str, int | str]:
        """The size profile's values; on a CPU machine of Binder's size, with SMALL_MACHINE_SIZES's changes."""
        small = not self.use_gpu and (self.platform == "binder" or self.memory_gib < RAY_TRAIN_MIN_GIB)
        sizes = {**SIZES[self.size], **(SMALL_MACHINE_SIZES if small else {})}
        if self.short:
            sizes.update({k: min(int(sizes[k]), v) for k, v in SHORT_SCHEDULE.items()})
        return sizes

    @property
    def default_workers(self) -> int:
        """Two workers on a CPU box (real distributed behaviour), one per GPU otherwise."""
        if self.use_gpu:
            return self.num_gpus
        return 2

    @property
    def lean(self) -> bool:
        """Small machine: start Ray without the dashboard and with a small object store."""
        return self.platform in {"binder", "ci"} or self.memory_gib < 8

    def describe(self) -> str:
        return (
            f"platform={self.platform} cpus={self.num_cpus} gpus={self.num_gpus} memory={self.memory_gib} GiB "
            f"device={self.device} backend={self.backend} size={self.size} "
            f"storage={self.storage_path}" + (" ray_train=local-mode" if self.local_mode else "")
        )


@dataclasses.dataclass(frozen=True)
class Settings:
    """The switches of the course's tools (not about the machine): see the module's docstring."""

    ray_verbose: bool = False         # COURSE_RAY_VERBOSE: Ray's log lines unfiltered
    start_method: str | None = None   # COURSE_START_METHOD: fork | spawn, None to decide by the GPU
    record_file: str | None = None    # COURSE_RECORD: where record() adds a notebook's figures; None: nowhere
    asked: dict = dataclasses.field(default_factory=dict)   # COURSE_ASKED: what the grader asks test cells to run


def is_grading(env: dict | None = None) -> bool:
    """Whether the exercise checks run for a grade: nbgrader sets NBGRADER_EXECUTION for the kernels it runs,
    "autograde" when grading, "validate" for the Validate button (both run the checks without the demo training
    runs); COURSE_GRADING=1 says the same outside nbgrader."""
    env = os.environ if env is None else env
    return _truthy(env.get("COURSE_GRADING")) or env.get("NBGRADER_EXECUTION") in {"autograde", "validate"}


def settings(env: dict | None = None) -> Settings:
    """The course's switches from the environment (``os.environ`` unless ``env``); raises ValueError for a
    value that is not one of the allowed ones."""
    env = os.environ if env is None else env
    start_method = env.get("COURSE_START_METHOD") or None
    if start_method not in {None, "fork", "spawn"}:
        raise ValueError(f"COURSE_START_METHOD={start_method!r} is not one of fork, spawn")
    try:
        asked = json.loads(env.get("COURSE_ASKED") or "{}")
    except ValueError:
        raise ValueError(f"COURSE_ASKED is not JSON: {env['COURSE_ASKED'][:80]!r}") from None
    return Settings(ray_verbose=_truthy(env.get("COURSE_RAY_VERBOSE")), start_method=start_method,
                    record_file=env.get("COURSE_RECORD") or None, asked=asked if isinstance(asked, dict) else {})


def user_cache(env: dict | None = None) -> Path:
    """The course's folder in the user's cache: ``$XDG_CACHE_HOME/ray-train-course`` (``~/.cache/...``)."""
    env = os.environ if env is None else env
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "ray-train-course"


def _writable(folder: Path) -> bool:
    """Whether ``folder`` can be made (or written to): its nearest existing folder is writable."""
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    return existing is not None and os.access(existing, os.W_OK)


def _own_folders(env: dict, cwd: Path) -> tuple[Path, Path]:
    """(storage, data) where neither is set: the course's folder when the work runs inside it, else the user's
    cache, or where that cannot be written (a read-only home, as in the grader's jail) the working directory."""
    if cwd.is_relative_to(REPO):
        return REPO / "build" / "ray_results", REPO / "data"
    cache = user_cache(env)
    if not _writable(cache):
        cache = cwd / ".ray-train-course"
    return cache / "ray_results", cache / "data"


def detect(env: dict | None = None, cwd: str | os.PathLike | None = None) -> Runtime:
    """Describe the machine we run on. Pure apart from reading hardware counters (and the working directory,
    ``cwd`` unless given: where files go by default)."""
    env = dict(os.environ if env is None else env)
    platform = _detect_platform(env)
    grading = is_grading(env)
    num_cpus = psutil.cpu_count(logical=True) or 1
    try:  # respect CPU affinity / container limits where the OS tells us
        num_cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    memory = psutil.virtual_memory().total
    cpu_limit, memory_limit = cgroup_limits()
    if cpu_limit:                 # a quota of 1.5 CPUs gives one worker's CPU, not two
        num_cpus = max(1, min(num_cpus, int(cpu_limit)))
    if memory_limit:
        memory = min(memory, memory_limit)
    num_gpus = _count_gpus()
    memory_gib = memory / 2**30

    size = env.get("COURSE_SIZE")
    if size is None:
        if grading or platform == "ci":
            size = "smoke"
        else:
            size = "gpu" if num_gpus > 0 else "cpu"
    if size not in SIZES:
        raise ValueError(f"COURSE_SIZE={size!r} is not one of {', '.join(SIZES)}")

    own_storage, own_data = _own_folders(env, Path(os.getcwd() if cwd is None else cwd).resolve())
    # A URI (s3://bucket/path, gs://...) is for Ray Train's pyarrow file system: keep it as written.
    storage_uri = env["COURSE_STORAGE"] if "://" in env.get("COURSE_STORAGE", "") else None
    if storage_uri:
        storage = None
    elif env.get("COURSE_STORAGE"):
        storage = Path(env["COURSE_STORAGE"]).expanduser()
    elif platform == "anyscale" and ANYSCALE_STORAGE.is_dir():
        storage = ANYSCALE_STORAGE / "ray-train-course"
    else:
        storage = own_storage
    data_dir = Path(env["COURSE_DATA"]).expanduser() if env.get("COURSE_DATA") else (
        storage.parent / "data" if platform == "anyscale" and storage is not None else own_data
    )

    schedule = env.get("COURSE_SCHEDULE") or "full"
    if schedule not in ("full", "short"):
        raise ValueError(f"COURSE_SCHEDULE={schedule!r} is not one of full, short")

    ray_address = env.get("RAY_ADDRESS") or ("auto" if platform == "anyscale" else None)
    if env.get("COURSE_LOCAL_MODE"):
        local_mode = _truthy(env["COURSE_LOCAL_MODE"])
    else:   # a cluster to join has its own memory; this machine only holds the driver then
        local_mode = not ray_address and num_gpus == 0 and (platform == "binder" or memory_gib < RAY_TRAIN_MIN_GIB)
    return Runtime(
        platform=platform,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        memory_gib=round(memory_gib, 1),
        size=size,
        storage_path=storage_uri or str(storage.resolve()),
        data_dir=str(data_dir.resolve()),
        ray_address=ray_address,
        grading=grading,
        local_mode=local_mode,
        short=schedule == "short",
    )
