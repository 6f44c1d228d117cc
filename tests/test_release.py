"""course/ is exactly what nbgrader generates from solutions/, with no outputs and no answers in it."""
import filecmp
import json
from pathlib import Path

import nbformat
import pytest

from autograder.release import modules
from conftest import REPO

COURSE = REPO / "course"


def _all_files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()
            and "__pycache__" not in p.parts and ".ipynb_checkpoints" not in p.parts}


def test_every_module_is_released():
    assert modules() == sorted(p.name for p in COURSE.iterdir() if p.is_dir()), "run `make assignments`"
    assert len(modules()) >= 2


def test_course_equals_what_nbgrader_generates(released):
    assert _all_files(COURSE) == _all_files(released), "course/ is stale: run `make assignments`"
    for rel in _all_files(COURSE):
        if rel.endswith(".ipynb"):
            mine = json.loads((COURSE / rel).read_text())
            fresh = json.loads((released / rel).read_text())
            assert mine == fresh, f"{rel} differs from nbgrader's output: run `make assignments`"
        else:
            assert filecmp.cmp(COURSE / rel, released / rel, shallow=False), rel


def _notebooks():
    return sorted(list(COURSE.rglob("*.ipynb")) + list((REPO / "solutions").rglob("*.ipynb")))


@pytest.mark.parametrize("path", _notebooks(), ids=lambda p: str(p.relative_to(REPO)))
def test_notebooks_are_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: stored outputs"
    assert nb.metadata["kernelspec"]["name"] == "ray-train-course"


def test_no_solution_or_hidden_test_text_in_the_release():
    # the same check `make release` runs on the student copy (autograder.student_release.leaks)
    from autograder.student_release import leaks

    problems = leaks(COURSE)
    assert not problems, problems[:3]
    for module in modules():
        source = nbformat.read(REPO / "solutions" / module / f"{module}.ipynb", as_version=4)
        for cell in source.cells:
            assert cell.metadata.get("nbgrader", {}).get("solution") or "SOLUTION" not in cell.source


def test_each_module_has_graded_exercises_with_hidden_tests():
    for module in modules():
        nb = nbformat.read(REPO / "solutions" / module / f"{module}.ipynb", as_version=4)
        solutions = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")]
        tests = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
        assert len(solutions) >= 3 and len(tests) >= 3, module
        assert sum("BEGIN HIDDEN TESTS" in c.source for c in tests) >= 3, module
        assert all(c.metadata["nbgrader"]["locked"] and 1 <= c.metadata["nbgrader"]["points"] <= 3 for c in tests)
        test_ids = [c.metadata["nbgrader"]["grade_id"] for c in tests]
        for cell in solutions:
            gid = cell.metadata["nbgrader"]["grade_id"]
            assert "### BEGIN SOLUTION" in cell.source and "### END SOLUTION" in cell.source, gid
            assert any(t.startswith(f"test_{gid}") for t in test_ids), f"{module}: no test cell for {gid}"
        ids = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells if "nbgrader" in c.metadata]
        assert len(ids) == len(set(ids)), f"{module}: grade ids must be unique"
        params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(params) == 1, f"{module}: exactly one papermill parameters cell"


def _points(cells):
    return sum(c.metadata["nbgrader"]["points"] for c in cells)


def test_points_go_mostly_to_code_and_each_module_asks_concept_questions():
    """3-5 concept questions per module, each checked by a hidden check_concept with its explanation;
    more points for the code the student writes than for the questions."""
    for module in modules():
        nb = nbformat.read(REPO / "solutions" / module / f"{module}.ipynb", as_version=4)
        tests = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
        concept = [c for c in tests if "concept" in c.metadata["nbgrader"]["grade_id"]]
        code = [c for c in tests if c not in concept]
        assert 3 <= len(concept) <= 5, f"{module}: {len(concept)} concept questions"
        for c in concept:
            hidden = c.source.split("### BEGIN HIDDEN TESTS", 1)[-1]
            assert "check_concept(" in hidden, f"{module}/{c.metadata['nbgrader']['grade_id']}: hidden check_concept"
        assert _points(code) > _points(concept), f"{module}: {_points(code)} code vs {_points(concept)} concept points"
