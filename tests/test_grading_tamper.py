"""Attacks on the grading from inside the kernel gain nothing where the verdict is decided outside it.

Module 01 (the fastest to grade, and every one of its cells judged outside the kernel): an honest student who
answers every concept question and every exercise wrongly (tests/mistakes' WRONG), and one student per tamper in
tests/tampering.py with the same answers plus the tamper; the reference beside them, as the control. No tamper may
score more than the honest student, and every tamper is listed in the flags column for the instructor.
"""
import csv
import importlib.util
from pathlib import Path

import pytest

from autograder.checks import VERDICT, judged_outside
from autograder.checks.concepts import KEYS
from autograder.contain import jail_available
from autograder.grade import grade
from autograder.samples import solution_answers, write_submission
from tampering import READS_KEYS, TAMPERS

MODULE = "01_ddp_pytorch"


def wrong_exercises() -> dict[str, str]:
    """grade_id -> a realistic mistake, for every exercise of the module (tests/mistakes' WRONG)."""
    spec = importlib.util.spec_from_file_location("mistakes01", Path(__file__).parent / "mistakes" / f"{MODULE}.py")
    mistakes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mistakes)
    return {gid: m if isinstance(m, str) else m[0] for gid, m in mistakes.WRONG.items()}


def cell_names(module: str) -> list[str]:
    """The grade_ids of ``module``'s test cells."""
    import nbformat

    from autograder.paths import SOLUTIONS

    nb = nbformat.read(SOLUTIONS / module / f"{module}.ipynb", as_version=4)
    return [c.metadata["nbgrader"]["grade_id"] for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]


def wrong_concepts(expression: str | None = None) -> dict[str, str]:
    """grade_id of each concept answer cell -> a wrong answer (or ``expression`` of the question's grade_id)."""
    out = {}
    for gid, (key, _, _) in KEYS[MODULE].items():
        var = gid[len("test_"):].upper()
        wrong = next(x for x in "abcd" if x not in key)
        out[gid[len("test_"):]] = f'{var} = "{wrong}"' if expression is None else \
            f'{var} = {expression.format(gid=gid, wrong=wrong)}'
    return out


@pytest.fixture(scope="module")
def tampered(tmp_path_factory):
    subs, out = tmp_path_factory.mktemp("tamper-submissions"), tmp_path_factory.mktemp("tamper-grading")
    reference = solution_answers(MODULE)
    wrong = {**reference, **wrong_exercises()}
    first = next(gid for gid in reference if not gid.startswith("concept_"))
    write_submission(subs, "reference", MODULE, reference)        # the control: every verdict can be earned
    write_submission(subs, "honest", MODULE, {**wrong, **wrong_concepts()})
    for name, code in TAMPERS.items():
        if name in READS_KEYS and not jail_available():
            continue        # unjailed, the kernel can read the grader's files: that is the jail's job, not this one's
        concepts = wrong_concepts('_keys.get("{gid}", "{wrong}")' if name in READS_KEYS else None)
        answers = {**wrong, **concepts, first: code.strip() + "\n\n" + wrong[first]}
        write_submission(subs, name, MODULE, answers)
    grade(subs, out, only=[MODULE], quiet=True, jobs=2, timeout=300)
    with open(out / "grades.csv", encoding="utf-8", newline="") as f:
        return out, {r["student"]: r for r in csv.DictReader(f)}


@pytest.mark.slow
def test_no_tamper_scores_more_than_the_same_answers_without_it(tampered):
    _, rows = tampered
    assert set(cell_names(MODULE)) <= judged_outside(MODULE), "a cell of the module is still judged in the kernel"
    assert rows["reference"]["score"] == rows["reference"]["max_score"], rows["reference"]
    honest = rows["honest"]
    assert honest["status"] == "graded", honest
    assert 0 < float(honest["score"]) < float(honest["max_score"]) - len(KEYS[MODULE]), honest
    tampers = [s for s in rows if s not in ("honest", "reference")]
    assert len(tampers) >= len(TAMPERS) - len(READS_KEYS)
    gained = {s: rows[s]["score"] for s in tampers if float(rows[s]["score"]) > float(honest["score"])}
    assert not gained, f"tampers that gained points over {honest['score']}: {gained}"


@pytest.mark.slow
def test_every_tamper_is_listed_for_the_instructor_and_the_honest_student_is_not(tampered):
    _, rows = tampered
    assert rows["honest"]["flags"] == rows["reference"]["flags"] == ""
    unlisted = [s for s, r in rows.items() if s not in ("honest", "reference") and not r["flags"]]
    assert not unlisted, f"tampers missing from the flags column: {unlisted}"


@pytest.mark.slow
def test_the_feedback_shows_the_verdicts_decided_outside_the_kernel(tampered):
    out, _ = tampered
    page = (out / "feedback" / "honest" / MODULE / f"{MODULE}.html").read_text(encoding="utf-8")
    assert VERDICT in page and "not quite" in page
    page = (out / "feedback" / "reference" / MODULE / f"{MODULE}.html").read_text(encoding="utf-8")
    assert f"{VERDICT}: Right." in page and f"{VERDICT}: passed:" in page
