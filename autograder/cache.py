"""What a grade depends on, hashed: a (student, module) whose submission, module source, nbgrader config and grading
code hash the same as last time is not graded again (``OUT/cache.json``)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from autograder.collect import Found
from autograder.paths import CONFIG, REPO, SOLUTIONS

def _hash_folder(folder: Path, h=None) -> "hashlib._Hash":
    h = h or hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and not any(x in (".ipynb_checkpoints", "__pycache__") for x in rel.parts):
            h.update(str(rel).encode() + b"\0" + p.read_bytes() + b"\0")
    return h


def _code_hash() -> str:
    """The code a grade depends on besides the module: the grader (this package: how a notebook is run,
    limited and scored), coursekit (what the notebooks import, check_concept included) and nbgrader."""
    import nbgrader

    h = hashlib.sha256(f"nbgrader {nbgrader.__version__}\0".encode())
    for folder in (REPO / "autograder", REPO / "coursekit"):
        for p in sorted(folder.rglob("*.py")):           # packages too (coursekit/testing/, coursekit/faults/)
            h.update(str(p.relative_to(folder)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def module_hash(module: str) -> str:
    """What every grade of ``module`` depends on: its source (hidden tests included), the course's
    nbgrader config and the grading code. A change to any of them regrades the module."""
    h = hashlib.sha256(_code_hash().encode())
    h.update(CONFIG.read_bytes())
    return _hash_folder(SOLUTIONS / module, h).hexdigest()


def cache_key(f: Found) -> str:
    """A submission's cache key: its module's hash and the submitted folder's files."""
    return _hash_folder(f.folder, hashlib.sha256(module_hash(f.module).encode())).hexdigest()


class Cache:
    """``OUT/cache.json``: the last row of each (student, module) and the key it was graded under."""

    def __init__(self, path: Path):
        self.path = path
        self.entries = json.loads(path.read_text()) if path.exists() else {}

    def row(self, f: Found, key: str, limits: list, main: Path, feedback: bool = True) -> dict | None:
        """The cached row if nothing it depends on changed (a timed-out or killed one: nor the limits), and its
        feedback page if one is wanted now."""
        hit = self.entries.get(f"{f.student}/{f.module}")
        if not hit or hit["key"] != key:
            return None
        if hit["row"]["status"] in ("timed out", "kernel died") and hit["limits"] != limits:
            return None
        kept = [main / sub / f.student / f.module for sub in ("feedback", "autograded")]
        if not any(p.exists() for p in kept):                          # the gradebook lost it
            return None
        if feedback and not kept[0].exists():                          # graded without feedback, wanted now
            return None
        return dict(hit["row"])

    def store(self, f: Found, key: str, row: dict, limits: list) -> None:
        self.entries[f"{f.student}/{f.module}"] = {"key": key, "row": row, "limits": limits}
        self.path.write_text(json.dumps(self.entries, indent=1, sort_keys=True, ensure_ascii=False))
