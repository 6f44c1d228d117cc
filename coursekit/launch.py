"""Running launcher commands (torchrun, shell scripts) from a notebook and seeing their output live."""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time

from coursekit.proctree import kill_tree


def stream(jobs: dict[str, tuple[list[str], dict]], timeout_s: float = 1800) -> None:
    """Run ``{name: (argv, env)}`` side by side and print their output here as it arrives.

    Lines are prefixed with the job's name when there is more than one job. Raises
    ``RuntimeError`` naming the jobs that exited non-zero, and ``TimeoutError`` after
    ``timeout_s``; an interrupted or timed-out job is stopped with its children."""
    sel, procs, buffers = selectors.DefaultSelector(), {}, {}
    codes: dict[str, int] = {}
    try:
        for name, (argv, env) in jobs.items():
            p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # own process group: we can stop it and its workers
            procs[name], buffers[name] = p, b""
            sel.register(p.stdout, selectors.EVENT_READ, name)
        deadline, open_pipes = time.monotonic() + timeout_s, len(procs)
        while open_pipes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{list(procs)} did not finish within {timeout_s} s")
            for key, _ in sel.select(timeout=1.0):
                name, chunk = key.data, os.read(key.fileobj.fileno(), 65536)
                if chunk:  # complete lines are printed, a partial last line waits for the rest
                    *lines, buffers[name] = (buffers[name] + chunk).split(b"\n")
                else:      # the command closed its output
                    sel.unregister(key.fileobj)
                    open_pipes -= 1
                    lines, buffers[name] = [buffers[name]] if buffers[name] else [], b""
                for line in lines:
                    print(f"[{name}] " * (len(procs) > 1) + line.decode(errors="replace"), flush=True)
        codes = {name: p.wait() for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:  # interrupted (or timed out): stop the launcher and its workers
                kill_tree(p.pid, signal.SIGTERM, timeout=0, group=True)
                p.wait()
            p.stdout.close()
    failed = {name: rc for name, rc in codes.items() if rc != 0}
    if failed:
        raise RuntimeError(f"failed with exit codes {failed}")
