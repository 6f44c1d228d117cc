"""Shared fixtures. Every test runs in smoke size, offline, with results in a temp folder."""
from __future__ import annotations

import os
import time
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable

# Smoke sizes and a private storage folder for everything the tests start
# (subprocesses, papermill kernels and Ray workers inherit these).
os.environ.setdefault("COURSE_SIZE", "smoke")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.pop("COURSE_RECORD", None)


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


@pytest.fixture(scope="session", autouse=True)
def _private_storage(tmp_path_factory):
    os.environ["COURSE_STORAGE"] = str(tmp_path_factory.mktemp("ray_results"))
    yield


@pytest.fixture(scope="session")
def released(tmp_path_factory) -> Path:
    """What nbgrader generates from solutions/ right now (course/ must equal it)."""
    from autograder.release import generate

    out = tmp_path_factory.mktemp("release") / "course"
    generate(out)
    return out


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
