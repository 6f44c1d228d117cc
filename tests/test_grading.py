"""The grading loop end to end: nbgrader autogrades real submissions of every module.

One class is graded in one run (as an instructor would): per module, a student
who submitted the reference solution (full marks), one who submitted the
untouched notebook (zero, and grading completes), students with realistic
mistakes from tests/mistakes/<module>.py (``WRONG``: a mistake in every exercise, partial
credit; ``MORE_WRONG``: one student per dict), each of whose wrong exercises must lose the
points of its test cells (a mistake written as ``(code, cells)`` may keep the points of
``cells``, which check something it gets right), and one whose answers are right but written differently from the
reference (``RIGHT``: full marks). A last student submitted only the first module.
Each submission is graded in its own process (autograder/contain.py); the bad-submission corpus,
reruns and input layouts are in test_grading_corpus.py.

The class is graded in two runs into the same folder, as submissions arrive: the first three students with
their HTML feedback pages (the pages this file reads), then the whole class without pages (about 1 s less per
submission), which keeps the first run's grades and pages.
"""
import csv
import importlib.util
import os
from pathlib import Path

import pytest

from autograder.grade import grade
from autograder.paths import notebooks
from autograder.release import modules
from autograder.samples import solution_answers, write_submission

MISTAKES = Path(__file__).parent / "mistakes"
# While developing one module: COURSE_TEST_MODULES=03_ray_data pytest tests/test_grading.py
ONLY = [m for m in os.environ.get("COURSE_TEST_MODULES", "").split(",") if m]


def graded_modules() -> list[str]:
    return ONLY or modules()


def answers_file(module: str):
    """tests/mistakes/<module>.py: WRONG, MORE_WRONG and RIGHT (grade_id -> code)."""
    path = MISTAKES / f"{module}.py"
    assert path.exists(), f"{module}: add realistic mistakes in {path.relative_to(MISTAKES.parent.parent)}"
    spec = importlib.util.spec_from_file_location(f"mistakes_{module}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def wrong_students(module: str) -> dict[str, dict[str, tuple[str, tuple[str, ...]]]]:
    """student name -> that student's wrong answers (grade_id -> (code, test cells it may keep)).

    A mistake is written as its code, or as ``(code, cells)`` where ``cells`` are test cells of that
    exercise that check something the mistake gets right (a pipeline without its resources still
    yields the right rows): it keeps their points and must lose all the others."""
    mod = answers_file(module)
    students = {"partial": mod.WRONG}
    for i, wrong in enumerate(getattr(mod, "MORE_WRONG", [])):
        students[f"wrong{i + 1}"] = wrong
    return {student: {gid: (m, ()) if isinstance(m, str) else (m[0], tuple(m[1])) for gid, m in wrong.items()}
            for student, wrong in students.items()}


def cell_scores(out: Path, student: str, module: str) -> dict[str, tuple[float, float]]:
    """grade cell name -> (score, max_score) of one graded submission (all its notebooks), from the main gradebook."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{out / 'nbgrader' / 'gradebook.db'}") as gb:
        return {g.name: (g.score, g.max_score) for nb in gb.find_submission(module, student).notebooks
                for g in nb.grades}


def importer_answers(module: str) -> dict[str, str]:
    """grade_id -> ``from <script> import <names>`` for each exercise whose functions a script of the module
    defines too: the submission of a student who keeps the answers in the script, or who hopes that the grader
    puts the reference script beside the notebook."""
    import ast

    from autograder.paths import SOLUTIONS

    in_scripts = {}
    for script in sorted((SOLUTIONS / module).glob("*.py")):
        for node in ast.parse(script.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef):
                in_scripts.setdefault(node.name, script.stem)
    out = {}
    for gid, code in solution_answers(module).items():
        names = [n.name for n in ast.parse(code).body if isinstance(n, ast.FunctionDef) and n.name in in_scripts]
        if names:
            out[gid] = "\n".join(f"from {in_scripts[n]} import {n}" for n in names)
    return out


FEEDBACK_READ = ("ada", "blank", "partial")   # graded first, with feedback pages: the ones the last test reads


def class_answers(module: str) -> dict[str, dict[str, str]]:
    """student -> answers (grade_id -> code) of every student who submitted ``module``."""
    reference = solution_answers(module)
    out = {"ada": reference, "blank": {}}                        # the reference solution; the untouched notebook
    for student, wrong in wrong_students(module).items():
        out[student] = {**reference, **{gid: code for gid, (code, _) in wrong.items()}}
    if importer_answers(module):
        out["importer"] = {**reference, **importer_answers(module)}
    right = getattr(answers_file(module), "RIGHT", None)
    if right:
        out["right"] = {**reference, **right}
    return out


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    subs = tmp_path_factory.mktemp("submissions")
    out = tmp_path_factory.mktemp("grading")
    ms = graded_modules()
    answers = {m: class_answers(m) for m in ms}

    def run(students, feedback: bool) -> dict:
        for m in ms:
            for student in students(m):
                write_submission(subs, student, m, answers[m][student])
        # two submissions at a time (the test machines have 2 cores: three took as long over all modules, with
        # more memory); a generous limit: the machine may be shared
        rows = grade(subs, out, only=ms, quiet=True, jobs=2, timeout=600, feedback=feedback)
        return {(r["student"], r["module"]): r for r in rows}

    first = run(lambda m: FEEDBACK_READ, feedback=True)
    write_submission(subs, "late", ms[0], answers[ms[0]]["ada"])           # only the first module
    rows = run(lambda m: [s for s in answers[m] if s not in FEEDBACK_READ], feedback=False)
    return out, rows, first


@pytest.mark.slow
def test_reference_solution_gets_full_marks(graded):
    _, rows, _ = graded
    for m in graded_modules():
        r = rows[("ada", m)]
        assert r["status"] == "graded" and r["max_score"] > 0
        assert r["score"] == r["max_score"], f"{m}: the reference solution scored {r['score']}/{r['max_score']}"


@pytest.mark.slow
def test_untouched_notebook_gets_zero_and_grading_completes(graded):
    _, rows, _ = graded
    for m in graded_modules():
        assert rows[("blank", m)]["status"] == "graded" and rows[("blank", m)]["score"] == 0


@pytest.mark.slow
def test_realistic_mistakes_get_partial_credit(graded):
    _, rows, _ = graded
    for m in graded_modules():
        r = rows[("partial", m)]
        assert r["status"] == "graded"
        assert 0 < r["score"] < r["max_score"], f"{m}: mistakes scored {r['score']}/{r['max_score']}"


@pytest.mark.slow
def test_each_realistic_mistake_loses_the_points_of_its_exercise(graded):
    out, rows, _ = graded
    for m in graded_modules():
        for student, wrong in wrong_students(m).items():
            assert rows[(student, m)]["status"] == "graded", rows[(student, m)]
            cells = cell_scores(out, student, m)
            for gid, (_, may_keep) in wrong.items():
                tests = {name: sc for name, sc in cells.items() if name.startswith(f"test_{gid}")}
                assert tests, f"{m}: no test cell for {gid}"
                assert set(may_keep) < set(tests), (
                    f"{m}/{student}: {gid} may keep {may_keep}, but its test cells are {sorted(tests)}: "
                    f"name existing cells, and leave at least one that the mistake must fail")
                kept = {name: sc for name, sc in tests.items() if sc[0] > 0 and name not in may_keep}
                assert not kept, (f"{m}/{student}: the mistake in {gid} kept points in {kept} "
                                  f"(tests/mistakes/{m}.py)")


@pytest.mark.slow
def test_answers_imported_from_the_modules_scripts_lose_their_points(graded):
    """A notebook is graded beside the release's scripts (answers stubbed), never the reference ones."""
    out, rows, _ = graded
    probed = [m for m in graded_modules() if importer_answers(m)]
    assert probed or ONLY, "no module's script defines an answer function: the probe tests nothing"
    for m in probed:
        cells = cell_scores(out, "importer", m)
        for gid in importer_answers(m):
            kept = {name: sc for name, sc in cells.items() if name.startswith(f"test_{gid}") and sc[0] > 0}
            assert not kept, f"{m}: answers of {gid} imported from the module's script kept points: {kept}"
        assert rows[("importer", m)]["score"] < rows[("ada", m)]["score"], rows[("importer", m)]


@pytest.mark.slow
def test_right_answers_written_differently_get_full_marks(graded):
    out, rows, _ = graded
    for m in graded_modules():
        if not getattr(answers_file(m), "RIGHT", None):
            continue
        r = rows[("right", m)]
        lost = {n: sc for n, sc in cell_scores(out, "right", m).items() if sc[0] < sc[1]}
        assert r["score"] == r["max_score"], f"{m}: a correct answer written differently lost {lost}"


@pytest.mark.slow
def test_csv_and_feedback_cover_every_student_and_module(graded):
    out, rows, _ = graded
    with open(out / "grades.csv") as f:
        table = list(csv.DictReader(f))
    students = {"late"} | {s for m in graded_modules() for s in class_answers(m)}
    assert {(r["student"], r["module"]) for r in table} == {(s, m) for s in students for m in graded_modules()}
    assert all(rows[("late", m)]["status"] == "missing" for m in graded_modules()[1:])
    assert rows[("late", graded_modules()[0])]["status"] == "graded"
    for s in FEEDBACK_READ:
        for m in graded_modules():
            for name in notebooks(m):                  # a page per notebook of the module
                html = out / "feedback" / s / m / f"{name}.html"
                assert html.exists(), html
                assert "Score:" in html.read_text() or "score" in html.read_text().lower()


@pytest.mark.slow
def test_a_run_without_feedback_keeps_the_earlier_grades_and_pages_and_writes_no_new_page(graded):
    out, rows, first = graded
    for key, row in first.items():                # graded once, in the first run: the second reused its rows
        assert rows[key] == row, (key, rows[key], row)
    for m in graded_modules():
        for s in class_answers(m):
            if s not in FEEDBACK_READ:
                assert rows[(s, m)]["status"] == "graded", rows[(s, m)]
                assert not (out / "feedback" / s / m).exists(), f"{s}/{m}: a page from the run without feedback"
