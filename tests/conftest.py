"""Shared fixtures. Every test runs in smoke size, offline, with results in a temp folder.

Constants and functions the tests share are in helpers.py (``from helpers import ...``)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# No GPU for the tests, set when pytest loads this file rather than in a fixture: torch fixes the devices
# it sees (and caches their count) the first time it asks CUDA, and test modules do that while they are
# collected, before any fixture runs (tests/test_module03_ray_data.py calls detect() at import).
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="session", autouse=True)
def _course_test_env(tmp_path_factory):
    """Smoke sizes, no result recording and a private storage folder for every test and everything it
    starts (subprocesses, papermill kernels and Ray workers inherit ``os.environ``); undone at the end."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COURSE_SIZE", os.environ.get("COURSE_SIZE", "smoke"))
        mp.delenv("COURSE_RECORD", raising=False)
        mp.setenv("COURSE_STORAGE", str(tmp_path_factory.mktemp("ray_results")))
        yield


@pytest.fixture(scope="session")
def released(tmp_path_factory) -> Path:
    """What nbgrader generates from solutions/ right now (course/ must equal it)."""
    from autograder.release import generate

    out = tmp_path_factory.mktemp("release") / "course"
    generate(out)
    return out
