"""Run one submission's autograding in its own process, with limits, away from everyone else's files.

What this module does for every submission (and what it does NOT do):

* **Own process, own folders.** ``autograder.worker`` runs ``nbgrader autograde`` and
  ``generate_feedback`` for one (student, module) in a process of its own (forked by a warm worker that has
  imported nbgrader once, ``WarmWorker``) and a fresh scratch course root
  (``JOB/root``: a gradebook holding only that module, with its hidden tests, that one student's
  submission, and as nbgrader's source folder the module's RELEASE without its notebook: nbgrader
  copies those files over the submission, so the scripts beside a graded notebook are the ones
  the student was given, their answers stubbed, never the solutions') and writes the autograded copy, where the student's code
  runs, into ``JOB/work/<student>/<module>`` (nbgrader's ``autograded_directory`` set to an
  absolute path outside the root). The main gradebook is written only by the parent
  (``autograder.grade``), which reads the results out of ``JOB/root/gradebook.db``.
* **Wall-clock limit.** The worker starts in its own session; after ``timeout`` seconds the
  parent kills every process of its tree (the kernel included, found with psutil, and the
  process group) with SIGKILL.
* **Memory limit.** Where this machine lets the grader create memory cgroups (cgroup v1's memory
  hierarchy, or a cgroup v2 subtree with the memory controller delegated: root in a container,
  CI machines; ``memory_cgroup_available()``), every job runs in a cgroup of its own whose limit
  is ``memory`` bytes: the kernel never lets the tree hold more, and past it the OOM killer
  kills the biggest process of the job (the notebook's kernel), which the job reports as
  "kernel died" with the memory named. Elsewhere a watchdog in the parent sums the RSS of the
  worker's process tree every 0.2 s and kills the tree above the limit (RSS counts pages shared
  between forked ranks twice, so that limit is conservative, and a very fast allocation can
  overshoot it by what it allocates in 0.2 s). ``RLIMIT_AS`` is not used: torch reserves far
  more address space than it uses.
* **What the student's kernel can see** (where bubblewrap is installed and can make namespaces:
  root, or unprivileged user namespaces; ``jail_available()``; ``make test`` and ``make grade``
  install Debian's ``bubblewrap``): the kernel starts through ``bwrap`` (``jail_argv``) with the
  whole filesystem read-only; a fresh, empty ``/tmp`` (the scratch roots of every job, with its
  own source folder, hidden tests and gradebook, live under the system temp folder and so are
  gone); every folder of the repository but ``coursekit/``, ``data/`` and the one holding the
  grader's Python (so ``solutions/``, ``course/``, whose module 07 scripts hold earlier modules'
  answers, ``tests/``, ``.git``, ``build/``), the grading output folder (main gradebook, other
  students' feedback) and the submissions folder covered by empty read-only folders; only its
  own working directory, and the folder of its connection file, writable. It has no network but
  a loopback of its own (it cannot reach servers on this machine's loopback either; nbgrader
  talks to it over unix sockets, ``transport = 'ipc'``), its own process namespace (it cannot see
  or signal the grader, or read its memory through /proc), no capabilities even as root, and it
  dies with the process that started it.
* **What is NOT prevented.** The kernel runs as the same user as the grader. The hidden tests
  run in the same kernel as the student's code, after it, so a student's code can still
  monkey-patch what the tests call. Without bubblewrap the kernel sees the whole filesystem and
  the network; only the working-directory separation, the time and the memory limits remain,
  and the grader says so when it starts. Grade untrusted submissions inside a container or VM
  you can throw away all the same.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import psutil

from autograder.paths import tool_env
from coursekit.proctree import kill_tree, sum_memory, tree
from coursekit.runtime import own_cgroups

KERNEL = "ray-train-course"
TMP_SIZE = 512 * 2**20    # bytes: the kernel's private /tmp (its pages count against the job's memory too)


def _visible_under_tmp(paths: list[Path]) -> list[Path]:
    """Those of ``paths`` that live under /tmp: the private /tmp would cover them, so they are bound back."""
    out = []
    for p in paths:
        p = Path(p).resolve()
        if p.is_relative_to("/tmp") and p.exists() and not any(p.is_relative_to(q) for q in out):
            out.append(p)
    return out


def jail_argv(workdir: Path, hide: list[Path], repo: Path, writable: list[Path] = ()) -> list[str]:
    """bubblewrap's command line (the command to run follows it) for a submission's kernel.

    The whole filesystem read-only; a fresh, empty ``/tmp`` (every job's scratch root, with its
    source notebook and gradebook, lives in the system temp folder and so is gone), ``/dev`` and
    ``/proc``; the repository and this Python bound back read-only where they lived under /tmp;
    ``hide`` covered by empty read-only folders; ``workdir`` and ``writable`` bound writable;
    no network but its own loopback, its own process, IPC and host-name namespaces, no
    capabilities, and it dies with the process that started it."""
    s = str
    args = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
            "--perms", "1777", "--size", s(TMP_SIZE), "--tmpfs", "/tmp"]
    for p in _visible_under_tmp([repo, Path(sys.prefix), Path(sys.base_prefix)]):
        args += ["--ro-bind", s(p), s(p)]
    hidden = [Path(p).resolve() for p in hide if Path(p).is_dir()]
    for p in hidden:      # mount points for the writable folders below may still be made in these ...
        args += ["--tmpfs", s(p)]
    for p in [workdir, *writable]:
        p = Path(p).resolve()
        args += ["--bind", s(p), s(p)]
    for p in hidden:      # ... then they become read-only (not recursively: the binds stay writable)
        args += ["--remount-ro", s(p)]
    # ipykernel exits when its parent process changes, and in its own process namespace the parent it sees
    # is bubblewrap's init, not the pid jupyter_client passes: --die-with-parent does that job instead
    return args + ["--dir", "/tmp/home", "--setenv", "HOME", "/tmp/home", "--unsetenv", "JPY_PARENT_PID",
                   "--chdir", s(Path(workdir).resolve()),
                   "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                   "--cap-drop", "ALL", "--die-with-parent", "--"]


@lru_cache(maxsize=1)
def jail_available() -> bool:
    """True when bubblewrap is installed and can make its namespaces here (as root, or where
    unprivileged user namespaces are allowed)."""
    if not shutil.which("bwrap"):
        return False
    import tempfile

    from autograder.paths import REPO

    with tempfile.TemporaryDirectory() as d:
        try:
            r = subprocess.run([*jail_argv(Path(d), [REPO / "autograder"], REPO), "sh", "-c", "touch ok"],
                               capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return False
        return r.returncode == 0 and (Path(d) / "ok").exists()


def jail_missing_reason() -> str:
    """Why submissions' kernels run without the jail here ("" where they run in it)."""
    if jail_available():
        return ""
    if not shutil.which("bwrap"):
        return "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    return "bubblewrap cannot make namespaces here (unprivileged user namespaces are off)"


def _kernel_python() -> list[str]:
    """The course kernel's command line (from its installed kernelspec when there is one)."""
    spec = Path(sys.prefix) / "share" / "jupyter" / "kernels" / KERNEL / "kernel.json"
    if spec.exists():
        argv = json.loads(spec.read_text())["argv"]
        return [a for a in argv if a != "{connection_file}" and a != "-f"]
    return [sys.executable, "-m", "ipykernel_launcher"]


def write_kernelspec(job: Path, workdir: Path, hide: list[Path], repo: Path, writable: list[Path],
                     env: dict | None = None) -> Path:
    """A ``ray-train-course`` kernelspec under ``job/jupyter`` that starts the kernel in the jail.

    ``writable``: folders bound writable into the jail besides ``workdir`` (made if missing): the
    Jupyter runtime folder, where the connection file and (with no network in the jail) the
    kernel's unix sockets live, and the job's checkpoint storage. ``env``: variables the kernel gets on top of
    the job's (Jupyter's kernelspec ``env``). Returns the folder to put on ``JUPYTER_PATH``.
    """
    kdir = job / "jupyter" / "kernels" / KERNEL
    kdir.mkdir(parents=True)
    argv = [*_kernel_python(), "-f", "{connection_file}"]
    if jail_available():
        for p in [workdir, *writable]:
            p.mkdir(parents=True, exist_ok=True)
        argv = [*jail_argv(workdir, hide, repo, writable=writable), *argv]
    (kdir / "kernel.json").write_text(json.dumps({
        "argv": argv, "display_name": "Python (Ray Train course, grading)", "language": "python", "env": env or {}}))
    return job / "jupyter"


@dataclass
class Outcome:
    returncode: int | None
    seconds: float
    killed: str = ""           # "" | "timeout" | "memory"
    peak_rss: int = 0
    output: str = ""
    extra: dict = field(default_factory=dict)


class MemoryCgroup:
    """A memory cgroup of its own for one job: ``limit`` bytes for every process put in it."""

    def __init__(self, parent: Path, version: int, limit: int):
        self.version = version
        self.path = parent / f"course-grading-{uuid.uuid4().hex[:12]}"
        self.path.mkdir()
        try:
            (self.path / ("memory.limit_in_bytes" if version == 1 else "memory.max")).write_text(str(int(limit)))
            if version == 1:   # count swap too where the kernel accounts it, so the limit cannot be dodged
                swap = self.path / "memory.memsw.limit_in_bytes"
                if swap.exists():
                    try:
                        swap.write_text(str(int(limit)))
                    except OSError:
                        pass
        except OSError:
            self.remove()
            raise

    def enter_argv(self, cmd: list[str]) -> list[str]:
        """``cmd`` started inside the group: the shell moves itself in, then becomes ``cmd`` (no race with
        the children it starts later, and no ``preexec_fn`` in the grader's threads)."""
        return ["sh", "-c", f'echo $$ > {shlex.quote(str(self.path / "cgroup.procs"))} && exec "$@"', "sh", *cmd]

    def oom_kills(self) -> int:
        """How many processes of the group the OOM killer killed for its limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def peak(self) -> int:
        try:
            return int((self.path / ("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak")).read_text())
        except (OSError, ValueError):
            return 0

    def remove(self) -> None:
        """Kill what is still in the group (a daemon that left the job's process tree, a rank that outlived an
        OOM-killed parent), then remove the group."""
        for _ in range(50):          # the kernel may take a moment to let the dead processes go
            try:
                for pid in (self.path / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


@lru_cache(maxsize=1)
def _cgroup_parent() -> tuple[Path, int] | None:
    """(folder, version) under which the grader may create memory cgroups, or None."""
    candidates = []
    for c in own_cgroups("memory"):
        if c.version == 1:
            candidates.append((c.folder, 1))
            continue
        try:   # v2: only where the memory controller is enabled for this group's children
            if "memory" in (c.folder / "cgroup.subtree_control").read_text().split():
                candidates.append((c.folder, 2))
        except OSError:
            pass
    for folder, version in candidates:
        try:
            MemoryCgroup(folder, version, 2**30).remove()
            return folder, version
        except OSError:
            continue
    return None


def memory_cgroup(limit: int) -> MemoryCgroup | None:
    """A new memory cgroup of ``limit`` bytes (remove it when done), or None where none can be made."""
    parent = _cgroup_parent()
    return MemoryCgroup(*parent, limit) if parent else None


def memory_cgroup_available() -> bool:
    """True when each job can get a memory cgroup of its own (see the module's docstring)."""
    return _cgroup_parent() is not None


# ---------------------------------------------------------------- starting a job's process

class _Forked:
    """A job that a warm worker forked (``autograder.worker.serve``), seen through Popen's interface."""

    def __init__(self, server: "WarmWorker", pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.server.exit_code(block=False)
        return self.returncode

    def wait(self):
        if self.returncode is None:
            self.returncode = self.server.exit_code(block=True)
        return self.returncode


class WarmWorker:
    """A long-lived ``python -m autograder.worker --serve`` that has imported what a grading job needs before
    its kernel starts (nbgrader, its converters, nbconvert's HTML exporter: about 1 s here) and forks one job
    at a time on request. Each job is still a process of its own: its own session, memory cgroup and limits.
    Idle warm workers wait in a pool, one per job running at once (``--jobs``; on a Ray cluster, one per Ray
    worker process, which Ray reuses from task to task); each exits when the grader's process does."""

    _idle: list["WarmWorker"] = []
    _lock = threading.Lock()

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "autograder.worker", "--serve"], env=tool_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the grading worker did not start")

    @classmethod
    def take(cls) -> "WarmWorker":
        with cls._lock:
            while cls._idle:
                w = cls._idle.pop()
                if w.proc.poll() is None:
                    return w
        return cls()

    def give_back(self, done: bool) -> None:
        """Back to the pool once its job has ended; a worker whose job's end was not read is closed instead."""
        if done and self.proc.poll() is None:
            with self._lock:
                self._idle.append(self)
        elif self.proc.poll() is None:
            self.proc.stdin.close()

    def start(self, argv: list[str], cwd: Path, env: dict, group, log: Path,
              call: str = "autograder.worker:main") -> _Forked:
        """Fork a job that runs ``call`` (``module:function``, called with ``argv``; by default a grading job)."""
        request = {"call": call, "argv": argv, "cwd": str(cwd), "env": env, "log": str(log),
                   "cgroup_procs": str(group.path / "cgroup.procs") if group is not None else ""}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return _Forked(self, int(json.loads(self.proc.stdout.readline())["pid"]))

    def exit_code(self, block: bool) -> int | None:
        import select

        if not block and not select.select([self.proc.stdout], [], [], 0)[0]:
            return None
        line = self.proc.stdout.readline()
        if not line:                       # the warm worker itself died: the job died with it
            return -9
        return int(json.loads(line)["exit"])


def run_limited(cmd: list[str] | None, cwd: Path, env: dict, timeout: float, memory: int,
                log: Path, worker_argv: list[str] | None = None, worker_call: str = "autograder.worker:main") -> Outcome:
    """Run ``cmd`` (or, with ``worker_argv``, a grading job forked by a warm worker: see ``WarmWorker``) in its
    own session; kill its whole tree past ``timeout`` s, and hold it to ``memory`` bytes (a memory cgroup
    where there is one, else an RSS watchdog)."""
    start = time.perf_counter()
    group = memory_cgroup(memory)
    warm = WarmWorker.take() if worker_argv is not None else None
    proc = None
    try:
        with open(log, "wb") as out:
            if warm is not None:
                proc = warm.start(list(worker_argv), cwd, tool_env(env), group, log, worker_call)
            else:
                proc = subprocess.Popen(group.enter_argv(cmd) if group else cmd, cwd=cwd, env=tool_env(env),
                                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
            try:
                ps = psutil.Process(proc.pid)
            except psutil.NoSuchProcess:       # a forked job that has already ended (its warm worker reaped it)
                ps = None
            killed, peak, seen = "", 0, []
            while proc.poll() is None:
                procs = tree(ps) if ps is not None else []
                seen = list({p.pid: p for p in [*seen, *procs]}.values())[-64:]
                rss = sum_memory(procs, pss=False)
                peak = max(peak, rss)
                if rss > memory and group is None:
                    killed = "memory"
                elif time.perf_counter() - start > timeout:
                    killed = "timeout"
                if killed:
                    kill_tree(proc.pid, known=seen, group=True)
                    proc.wait()
                    break
                time.sleep(0.2)
            # anything the worker left behind (a kernel that outlived it) goes too
            kill_tree(proc.pid, known=seen)
        extra = {}
        if group is not None:
            extra["cgroup_peak"] = group.peak()     # what the kernel charged the job (the RSS sum counts shared pages)
            peak = max(peak, extra["cgroup_peak"])
            if not killed and group.oom_kills():
                killed = "memory"
    finally:
        if warm is not None:
            warm.give_back(done=proc is not None and proc.returncode is not None)
        if group is not None:
            group.remove()
    return Outcome(proc.returncode, time.perf_counter() - start, killed, peak,
                   log.read_text(errors="replace")[-20000:], extra)
