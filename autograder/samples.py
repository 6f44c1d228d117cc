"""Make submissions from the student release: the solution, an untouched notebook, wrong answers.

A student's submission is the released notebook (course/) with code written
into its solution cells. ``fill`` reproduces exactly that, so the grader is
tested on notebooks shaped like real ones (same cell ids, checksums, locks).
A module of several notebooks (``autograder.paths.notebooks``): answers are
keyed by grade_id, and each goes into the notebook that holds its cell.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import nbformat

from autograder.paths import REPO, module_cells, notebooks


def solution_answers(module: str) -> dict[str, str]:
    """grade_id -> the reference code of each solution cell (markers removed), of all the module's notebooks."""
    answers = {}
    for cell in module_cells(module):
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution") and cell.cell_type == "code":
            lines = [ln for ln in cell.source.splitlines()
                     if ln.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION")]
            answers[meta["grade_id"]] = "\n".join(lines)
    return answers


def fill_all(module: str, answers: dict[str, str], release: Path | None = None) -> dict[str, nbformat.NotebookNode]:
    """Every released notebook of ``module`` (notebook name -> notebook, in ``notebooks(module)``'s order) with
    ``answers`` (grade_id -> code) written into the solution cells that carry those grade_ids."""
    release = release or REPO / "course"
    filled = {name: nbformat.read(release / module / f"{name}.ipynb", as_version=4) for name in notebooks(module)}
    unknown = set(answers) - {c.metadata.get("nbgrader", {}).get("grade_id") for nb in filled.values() for c in nb.cells}
    if unknown:
        raise KeyError(f"{module} has no solution cells named {sorted(unknown)}")
    for nb in filled.values():
        for cell in nb.cells:
            gid = cell.metadata.get("nbgrader", {}).get("grade_id")
            if gid in answers and cell.metadata["nbgrader"].get("solution"):
                cell.source = answers[gid]
    return filled


def fill(module: str, answers: dict[str, str], release: Path | None = None,
         notebook: str | None = None) -> nbformat.NotebookNode:
    """The released notebook of ``module`` (its first, ``<module>``, or ``notebook``) with ``answers``
    (grade_id -> code, of any of the module's notebooks) written in where they belong to it."""
    return fill_all(module, answers, release)[notebook or notebooks(module)[0]]


def write_submission(folder: Path, student: str, module: str, answers: dict[str, str]) -> Path:
    """Write a student's module folder (every notebook and the scripts) in nbgrader's layout."""
    dest = Path(folder) / student / module
    shutil.copytree(REPO / "course" / module, dest, dirs_exist_ok=True)
    for name, nb in fill_all(module, answers).items():
        nbformat.write(nb, dest / f"{name}.ipynb")
    return dest
