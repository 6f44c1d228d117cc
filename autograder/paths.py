"""Where the course's parts are, and the environment nbgrader's tools run in (shared by the autograder)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS = REPO / "solutions"
CONFIG = REPO / "autograder" / "nbgrader_config.py"


def modules() -> list[str]:
    """Module folders of the course, in teaching order (01_..., 02_...)."""
    return sorted(p.name for p in SOLUTIONS.iterdir() if p.is_dir() and p.name[:2].isdigit())


def tool_env(extra: dict | None = None) -> dict:
    """The environment for nbgrader: it runs ``alembic`` and kernels from this venv's bin/."""
    env = {**os.environ, **(extra or {})}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env
