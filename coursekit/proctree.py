"""Process trees: a process and all its descendants, what they hold in memory, and stopping them.

A notebook's kernel, Ray's raylet and workers, torchrun and its ranks, a grading worker and the
student's kernel all run as trees of processes; the memory that counts is the whole tree's, and
stopping the job means stopping every process in it.

* :func:`tree` the process and its descendants, :func:`process_kind` a short name for one;
* :func:`tree_pss` the tree's proportional set size (:func:`sum_memory` for a list of processes, in
  PSS or RSS), optionally per kind of process;
* :class:`PeakSampler` samples a tree's PSS in a thread and keeps the peak, and what held it;
* :func:`kill_tree` signals the descendants, then the root (and its process group, if asked).

Every function tolerates processes that end while it looks at them.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import psutil


def _process(p: int | psutil.Process) -> psutil.Process:
    return p if isinstance(p, psutil.Process) else psutil.Process(p)


def tree(root: int | psutil.Process) -> list[psutil.Process]:
    """``root`` and all its descendants (root first); empty when ``root`` is gone."""
    try:
        root = _process(root)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def process_kind(p: psutil.Process) -> str:
    """A short name for a process: Ray's title (``ray::RayTrainWorker``), the script, or the program."""
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return "?"
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split()[0]
    scripts = [Path(a).name for a in cmd[1:3] if a.endswith(".py")]
    if "-m" in cmd[1:3]:
        scripts = [cmd[cmd.index("-m") + 1]]
    return scripts[0] if scripts else (Path(cmd[0]).name if cmd else p.name())


def sum_memory(procs: list[psutil.Process], by_kind: dict | None = None, pss: bool = True) -> int:
    """Bytes that ``procs`` hold together: proportional set size (RSS where PSS is unreadable), or
    resident set size with ``pss=False`` (cheaper to read; pages shared between processes count
    once per process). Processes that are gone count 0.

    Pass a dict as ``by_kind`` to also get ``[bytes, processes]`` per kind of process (see process_kind)."""
    total = 0
    for p in procs:
        try:
            size = p.memory_full_info().pss if pss else p.memory_info().rss
        except (psutil.Error, AttributeError):
            if not pss:
                continue
            try:
                size = p.memory_info().rss
            except psutil.Error:
                continue
        total += size
        if by_kind is not None:
            entry = by_kind.setdefault(process_kind(p), [0, 0])
            entry[0] += size
            entry[1] += 1
    return total


def tree_pss(root: int | psutil.Process, by_kind: dict | None = None) -> int:
    """Memory of ``root`` and all its descendants: proportional set size (RSS where PSS is unreadable).

    Pass a dict as ``by_kind`` to also get ``[bytes, processes]`` per kind of process (see process_kind)."""
    return sum_memory(tree(root), by_kind)


class PeakSampler:
    """Sample the PSS of a process tree every ``interval_s`` seconds in a thread, from ``start()``
    (or entering the ``with`` block) until ``stop()``; keep the highest.

    * ``peak``: the most bytes the tree held at one sample;
    * ``peak_by_kind``: at that sample, ``{kind: [bytes, processes]}`` (see process_kind);
    * ``last``: the latest sample.

    >>> with PeakSampler(proc.pid) as sampler:
    ...     proc.wait()
    >>> sampler.peak, sampler.peak_by_kind
    """

    def __init__(self, root: int | psutil.Process, interval_s: float = 1.0):
        self.root, self.interval_s = root, interval_s
        self.peak, self.peak_by_kind, self.last = 0, {}, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int:
        by_kind: dict = {}
        try:
            total = tree_pss(self.root, by_kind)
        except psutil.Error:  # a process that ends while we name it
            return self.last
        self.last = total
        if total > self.peak:
            self.peak, self.peak_by_kind = total, by_kind
        return total

    def _run(self) -> None:
        try:
            self.root = _process(self.root)
        except psutil.Error:  # gone before the first sample
            return
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> "PeakSampler":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True, name="PeakSampler")
        self._thread.start()
        return self

    def stop(self) -> "PeakSampler":
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self

    def __enter__(self) -> "PeakSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def kill_tree(root: int | psutil.Process, sig: int = signal.SIGKILL, timeout: float = 5.0,
              known: list[psutil.Process] = (), group: bool = False) -> list[psutil.Process]:
    """Send ``sig`` to every descendant of ``root``, then to ``root``; return the processes still running.

    ``known``: processes seen in the tree earlier (a child that has since left it, reparented when its
    parent died) that get the signal too. ``group``: ``root`` leads a process group (started with
    ``start_new_session=True``): the group gets the signal at once, with ``killpg``, after the
    descendants outside it (each process gets the signal once). Waits up to ``timeout`` seconds for the
    signalled processes to end (an unreaped child counts as ended: nothing is reaped here, so a
    ``subprocess.Popen`` can still ``wait()`` for its exit status). Processes that are gone are skipped."""
    pid = root.pid if isinstance(root, psutil.Process) else int(root)
    procs = tree(root)
    if not procs and isinstance(root, psutil.Process) and root.is_running():
        procs = [root]  # its children cannot be listed, but it is still there
    descendants = {p.pid: p for p in [*known, *procs[1:]] if p.pid != pid}.values()

    def in_group(p: psutil.Process) -> bool:
        try:
            return os.getpgid(p.pid) == pid
        except OSError:
            return False

    signalled, grouped = [], []
    for p in [*descendants, *procs[:1]]:
        if group and in_group(p):
            grouped.append(p)
            continue
        try:
            p.send_signal(sig)  # psutil first checks that the pid is still this process
            signalled.append(p)
        except psutil.Error:
            pass
    if group:
        try:
            os.killpg(pid, sig)
            signalled += grouped
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout
    alive = [p for p in signalled if not _gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if not _gone(p)]
    return alive


def kill_named(fragments: list[str], timeout: float = 10.0) -> int:
    """SIGKILL every process (but this one) whose command line contains one of ``fragments``, such as the private
    temp dir of a Ray node: Ray's worker processes run in process groups of their own, so they can outlive the
    node that started them. Returns how many were killed."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
        except psutil.Error:
            continue
        if proc.pid != os.getpid() and any(f in cmd for f in fragments):
            found.append(proc)
    for proc in found:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(found, timeout=timeout)
    return len(found)
