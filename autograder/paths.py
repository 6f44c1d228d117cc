"""Where the course's parts are, the environment nbgrader's tools run in, and the Debian packages the
instructors' tools use (shared by the autograder and the tests)."""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from coursekit.paths import REPO

SOLUTIONS = REPO / "solutions"
CONFIG = REPO / "autograder" / "nbgrader_config.py"


def modules() -> list[str]:
    """Module folders of the course, in teaching order (01_..., 02_...)."""
    return sorted(p.name for p in SOLUTIONS.iterdir() if p.is_dir() and p.name[:2].isdigit())


def notebooks(module: str) -> list[str]:
    """The notebooks of ``module`` (nbgrader: one assignment, the module's folder, with one or several notebooks),
    as the stems of the ``.ipynb`` files in ``solutions/<module>/``: the one named ``<module>`` first, then the
    others sorted (``.ipynb_checkpoints`` ignored). A module without its folder (or without notebooks): ``[module]``."""
    folder = SOLUTIONS / module
    stems = sorted(p.stem for p in folder.glob("*.ipynb") if p.is_file()) if folder.is_dir() else []
    return sorted(stems, key=lambda s: s != module) or [module]


def module_cells(module: str, root: Path | None = None) -> list:
    """Every cell of ``module``'s notebooks (:func:`notebooks`) under ``root`` (by default solutions/; or a course/
    folder), in order: the first notebook's, then the next one's."""
    import nbformat

    root = SOLUTIONS if root is None else root
    return [c for name in notebooks(module) for c in nbformat.read(root / module / f"{name}.ipynb", as_version=4).cells]


@functools.lru_cache(maxsize=None)
def _grade_ids(folder: Path, stamps: tuple) -> dict[str, str]:
    """grade_id -> notebook stem of the notebooks in ``folder`` (``stamps``: their names and mtimes, the cache key)."""
    owner: dict[str, str] = {}
    for name, _ in stamps:
        nb = json.loads((folder / name).read_text(encoding="utf-8"))
        for cell in nb.get("cells", []):
            gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
            if gid:
                owner.setdefault(gid, Path(name).stem)
    return owner


_MISSING = object()


def notebook_of(module: str, grade_id: str, default=_MISSING) -> str:
    """The notebook (its stem, see :func:`notebooks`) of ``module`` whose cells carry nbgrader's ``grade_id``, read
    from the solutions notebooks' cell metadata (cached until one of them changes). In none of them: ``default``
    where one is given, else KeyError."""
    folder = SOLUTIONS / module
    stamps = tuple((f"{stem}.ipynb", (folder / f"{stem}.ipynb").stat().st_mtime_ns) for stem in notebooks(module)
                   if (folder / f"{stem}.ipynb").is_file())
    owner = _grade_ids(folder, stamps).get(grade_id)
    if owner is None:
        if default is not _MISSING:
            return default
        raise KeyError(f"{module}: no notebook has a cell with grade_id {grade_id!r}")
    return owner


def tool_env(extra: dict | None = None) -> dict:
    """The environment for nbgrader: it runs ``alembic`` and kernels from this venv's bin/."""
    env = {**os.environ, **(extra or {})}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run_command(cmd: list[str], timeout_s: int) -> str | None:
    """None if ``cmd`` succeeded, else what went wrong."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`{' '.join(cmd)}` failed: {e}"
    if r.returncode:
        return f"`{' '.join(cmd)}` exited {r.returncode}: {(r.stdout + r.stderr).strip()[-800:]}"
    return None


def apt_install(package: str, path: str) -> str | None:
    """Make sure Debian's ``package`` has put ``path`` in place: None if it is there (or now is), else why
    it could not be installed. Uses apt-get as root, or through ``sudo -n``."""
    if Path(path).exists():
        return None
    apt = shutil.which("apt-get")
    if apt is None:
        return f"{path} is missing and apt-get is not available to install {package}"
    prefix = []
    if os.geteuid() != 0:
        if shutil.which("sudo") is None:
            return f"{path} is missing; installing {package} needs root (or sudo), and this user is neither"
        prefix = ["sudo", "-n"]
    install = prefix + [apt, "install", "-y", "--no-install-recommends", package]
    why = run_command(install, 900)
    if why:                                   # stale or missing package lists: refresh them once, retry
        why = run_command(prefix + [apt, "update"], 300) or run_command(install, 900)
    if why:
        return f"apt-get could not install {package}: {why}"
    return None if Path(path).exists() else f"apt-get installed {package} but {path} does not exist"


if __name__ == "__main__":       # python -m autograder.paths --apt PACKAGE PATH: install it, or say why not
    if len(sys.argv) != 4 or sys.argv[1] != "--apt":
        sys.exit("usage: python -m autograder.paths --apt PACKAGE PATH")
    reason = apt_install(sys.argv[2], sys.argv[3])
    if reason:
        print(f"note: {reason}", file=sys.stderr)
