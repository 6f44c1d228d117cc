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
* **Memory limit.** A watchdog in the parent sums the RSS of the worker's process tree every
  0.2 s and kills the tree above ``memory`` bytes (RSS counts pages shared between forked
  ranks twice, so the limit is conservative). A very fast allocation can overshoot the limit
  by what it allocates in 0.2 s before it is killed. ``RLIMIT_AS`` is not used: torch
  reserves far more address space than it uses.
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
import shlex
import shutil
import subprocess
import sys
import time
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


def run_limited(cmd: list[str], cwd: Path, env: dict, timeout: float, memory: int,
                log: Path) -> Outcome:
    """Run ``cmd`` in its own session; kill its whole tree past ``timeout`` s or ``memory`` bytes RSS."""
    start = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=tool_env(env), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        ps = psutil.Process(proc.pid)
        killed, peak, seen = "", 0, []
        while proc.poll() is None:
            procs = tree(ps)
            seen = list({p.pid: p for p in [*seen, *procs]}.values())[-64:]
            rss = sum_memory(procs, pss=False)
            peak = max(peak, rss)
            if rss > memory:
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
    return Outcome(proc.returncode, time.perf_counter() - start, killed, peak,
                   log.read_text(errors="replace")[-20000:])

