"""Run one submission's autograding in its own process, with limits, away from everyone else's files.

What this module does for every submission (and what it does NOT do):

* **Own process, own folders.** ``autograder.worker`` runs ``nbgrader autograde`` and
  ``generate_feedback`` for one (student, module) in a fresh scratch course root
  (``JOB/root``: a copy of the module's source, a gradebook holding only that module, and
  that one student's submission) and writes the autograded copy, where the student's code
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
* **What the student's kernel can see** (when ``unshare`` works, i.e. we are root or have
  CAP_SYS_ADMIN; ``jail_available()``): the kernel is started through ``JOB/jail.sh`` in a
  private mount namespace (``unshare --mount``) where ``/tmp`` is a fresh, empty 512 MiB
  tmpfs (the scratch roots of every job, including its own source notebook with the hidden
  tests and its gradebook, live under the system temp folder and so are gone), the
  repository is mounted read-only, and ``solutions/``, ``.git``, the grading output folder
  (main gradebook, other students' feedback) and the submissions folder are covered by empty
  read-only tmpfs mounts. Only its own working directory is bound back in, writable. So it cannot read
  the hidden tests before they run, cannot read or write ``solutions/`` or the gradebook, and
  cannot read or write other students' files.
* **What is NOT prevented.** This is not a security sandbox: the kernel runs as the same
  user as the grader (root here), in the same network namespace (it can open sockets and
  talk to anything on localhost), with the rest of the filesystem visible and, outside the
  repository and /tmp, writable (``$HOME``, ``/var/tmp``, ``/dev/shm``); root can undo mounts
  (``umount``) or read other processes' memory through /proc (the grader holds the hidden
  tests in memory). The hidden tests run in the same kernel as the student's code, after
  it, so a student's code can still monkey-patch what the tests call. Without ``unshare``
  (non-root CI) the kernel sees the whole filesystem; only the working-directory separation,
  the time and the memory limits remain. Grade untrusted submissions inside a container or
  VM you can throw away.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import psutil

from autograder.release import tool_env
from coursekit.proctree import kill_tree, sum_memory, tree

KERNEL = "ray-train-course"


@lru_cache(maxsize=1)
def jail_available() -> bool:
    """True when ``unshare --mount`` works here (root or CAP_SYS_ADMIN)."""
    if not shutil.which("unshare") or not shutil.which("mount"):
        return False
    import tempfile

    from autograder.release import REPO

    # the same operations the jail does (write_kernelspec), in a throwaway namespace
    with tempfile.TemporaryDirectory() as d:
        q = shlex.quote
        probe = "; ".join(["set -e", f"cd {q(d)}", *_private_tmp_keeping(REPO, size="1m"), f"mkdir -p {q(d)}",
                           f"mount --no-canonicalize --bind /proc/self/cwd {q(d)}", f"cd {q(d)}", "touch ok",
                           f"mount -o remount,bind,ro {q(str(REPO))}",
                           f"mount -t tmpfs -o ro,size=4k hidden {q(str(REPO / 'autograder'))}"])
        try:
            r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", probe],
                               capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return False
        return r.returncode == 0 and (Path(d) / "ok").exists()


def _kernel_python() -> list[str]:
    """The course kernel's command line (from its installed kernelspec when there is one)."""
    spec = Path(sys.prefix) / "share" / "jupyter" / "kernels" / KERNEL / "kernel.json"
    if spec.exists():
        argv = json.loads(spec.read_text())["argv"]
        return [a for a in argv if a != "{connection_file}" and a != "-f"]
    return [sys.executable, "-m", "ipykernel_launcher"]


def _private_tmp_keeping(repo: Path, size: str = "512m") -> list[str]:
    """Shell lines: an empty private tmpfs on /tmp, with ``repo`` (and its .venv) still bound at its path.

    A repository under /tmp (a CI clone, say) would vanish with the rest of /tmp: it is first
    bound to a holding folder under /run, then bound back onto a folder made in the new tmpfs."""
    q = shlex.quote
    r = q(str(repo))
    if not str(Path(repo).resolve()).startswith("/tmp/"):
        return [f"mount -t tmpfs -o size={size},mode=1777 course-tmp /tmp", f"mount --bind {r} {r}"]
    return ['HOLD="$(mktemp -d /run/course-jail.XXXXXX)"', f'mount --bind {r} "$HOLD"',
            f"mount -t tmpfs -o size={size},mode=1777 course-tmp /tmp",
            f"mkdir -p {r}", f'mount --bind "$HOLD" {r}', 'umount "$HOLD"', 'rmdir "$HOLD"']


def write_kernelspec(job: Path, workdir: Path, hide: list[Path], repo: Path) -> Path:
    """A ``ray-train-course`` kernelspec under ``job/jupyter`` that starts the kernel in the jail.

    Returns the folder to put on ``JUPYTER_PATH``.
    """
    kdir = job / "jupyter" / "kernels" / KERNEL
    kdir.mkdir(parents=True)
    python = " ".join(shlex.quote(a) for a in _kernel_python())
    if jail_available():
        q = shlex.quote
        lines = ["set -e", 'CF="$1"', 'CONN="$(cat "$CF")"', f"cd {q(str(workdir))}",
                 # private, empty /tmp: every job's scratch root (source notebook, gradebook) is gone
                 *_private_tmp_keeping(repo),
                 f"mount -o remount,bind,ro {q(str(repo))}"]
        for p in hide:      # (paths under /tmp are already gone)
            lines.append(f"if [ -d {q(str(p))} ]; then mount -t tmpfs -o ro,size=4k,mode=755 hidden {q(str(p))}; fi")
        lines += [f"mkdir -p {q(str(workdir))}",
                  # the kernel's own folder, bound back from its (still open) working directory
                  f"mount --no-canonicalize --bind /proc/self/cwd {q(str(workdir))}",
                  f"cd {q(str(workdir))}",
                  'mkdir -p "$(dirname "$CF")"', 'printf "%s" "$CONN" > "$CF"',
                  f'exec {python} -f "$CF"']
        inner = "\n".join(lines)
        script = job / "jail.sh"
        script.write_text("#!/bin/sh\n# the student's kernel, in a private mount namespace "
                          "(see autograder/contain.py)\nexec unshare --mount --propagation private "
                          f"sh -c {shlex.quote(inner)} jail \"$1\"\n")
        argv = ["/bin/sh", str(script), "{connection_file}"]
    else:
        argv = [*_kernel_python(), "-f", "{connection_file}"]
    (kdir / "kernel.json").write_text(json.dumps({
        "argv": argv, "display_name": "Python (Ray Train course, grading)", "language": "python"}))
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
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if "memory" in controllers.split(","):
            candidates.append((Path("/sys/fs/cgroup/memory") / group.lstrip("/"), 1))
        elif controllers == "":
            base = Path("/sys/fs/cgroup")
            folder = base / group.lstrip("/")
            try:   # v2: only where the memory controller is enabled for this group's children
                if "memory" in (folder / "cgroup.subtree_control").read_text().split():
                    candidates.append((folder, 2))
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


def run_limited(cmd: list[str], cwd: Path, env: dict, timeout: float, memory: int,
                log: Path) -> Outcome:
    """Run ``cmd`` in its own session; kill its whole tree past ``timeout`` s, and hold it to ``memory``
    bytes (a memory cgroup where there is one, else an RSS watchdog)."""
    start = time.perf_counter()
    group = memory_cgroup(memory)
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(group.enter_argv(cmd) if group else cmd, cwd=cwd, env=tool_env(env),
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            ps = psutil.Process(proc.pid)
            killed, peak, seen = "", 0, []
            while proc.poll() is None:
                procs = tree(ps)
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
        if group is not None:
            peak = max(peak, group.peak())
            if not killed and group.oom_kills():
                killed = "memory"
    finally:
        if group is not None:
            group.remove()
    return Outcome(proc.returncode, time.perf_counter() - start, killed, peak,
                   log.read_text(errors="replace")[-20000:])

