"""Make submissions from the student release: the solution, an untouched notebook, wrong answers.

A student's submission is the released notebook (course/) with code written
into its solution cells. ``fill`` reproduces exactly that, so the grader is
tested on notebooks shaped like real ones (same cell ids, checksums, locks).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import nbformat

from autograder.paths import REPO, SOLUTIONS


def solution_answers(module: str) -> dict[str, str]:
    """grade_id -> the reference code of each solution cell (markers removed)."""
    nb = nbformat.read(SOLUTIONS / module / f"{module}.ipynb", as_version=4)
    answers = {}
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution") and cell.cell_type == "code":
            lines = [ln for ln in cell.source.splitlines()
                     if ln.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION")]
            answers[meta["grade_id"]] = "\n".join(lines)
    return answers


def fill(module: str, answers: dict[str, str], release: Path | None = None) -> nbformat.NotebookNode:
    """The released notebook of ``module`` with ``answers`` (grade_id -> code) written in."""
    release = release or REPO / "course"
    nb = nbformat.read(release / module / f"{module}.ipynb", as_version=4)
    unknown = set(answers) - {c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells}
    if unknown:
        raise KeyError(f"{module} has no solution cells named {sorted(unknown)}")
    for cell in nb.cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        if gid in answers and cell.metadata["nbgrader"].get("solution"):
            cell.source = answers[gid]
    return nb


def write_submission(folder: Path, student: str, module: str, answers: dict[str, str]) -> Path:
    """Write a student's module folder (notebook and scripts) in nbgrader's layout."""
    dest = Path(folder) / student / module
    shutil.copytree(REPO / "course" / module, dest, dirs_exist_ok=True)
    nbformat.write(fill(module, answers), dest / f"{module}.ipynb")
    return dest
