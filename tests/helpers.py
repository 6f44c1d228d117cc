"""Constants and functions the tests share (fixtures live in conftest.py).

Test modules import it as ``from helpers import ...``: pytest's default import mode puts the tests'
folder (it has no ``__init__.py``) on ``sys.path`` before it imports a test module, as it does for
conftest.py.
"""
from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path

import pytest

from coursekit.paths import REPO  # noqa: F401  (the tests' one root: ``from helpers import REPO``)
from coursekit.proctree import kill_tree
PY = sys.executable


def read_pins(path: Path, strict: bool = True) -> dict[str, str]:
    """name -> version of a pip requirements file's ``name==version`` lines. With ``strict``
    every other non-comment line is an error; otherwise pip options (``-r``, ``--extra-index-url``)
    are skipped."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s;]+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(3)
        else:
            assert not strict, f"{path.name}: {line!r} is not an exact pin (name==version)"
    return pins


def wait_for_server(get, proc, what: str, stop, timeout_s: float = 120) -> None:
    """Poll ``get("/api/status")`` until a Jupyter server started as ``proc`` answers.

    If it exits or does not answer in ``timeout_s``, ``stop(proc)`` and fail with its output."""
    deadline = time.time() + timeout_s
    while True:
        try:
            get("/api/status")
            return
        except Exception:
            if time.time() > deadline or proc.poll() is not None:
                stop(proc)
                pytest.fail(f"{what} did not start: " + proc.stdout.read().decode()[-2000:])
            time.sleep(1)


def stop_process_group(proc, timeout_s: float = 30) -> None:
    """Stop a server started with ``start_new_session=True`` and everything it started: SIGTERM to its
    tree and group, SIGKILL to whatever is left after ``timeout_s``; then reap it."""
    if kill_tree(proc.pid, signal.SIGTERM, timeout=timeout_s, group=True):
        kill_tree(proc.pid, signal.SIGKILL, group=True)
    proc.wait(timeout=30)
