"""Bad submissions are contained: each gets its status and score, and nobody else's grade is lost.

One grading run of the corpus from autograder/bad_submissions.py (module 01, the fastest to
grade) with small limits, two at a time; then reruns: the same input again (nothing is
graded, grades.csv is identical, the gradebook has no duplicates) and one late submission
(only it is graded). The input layouts (flat folder, LMS zip) are checked without grading.
"""
import csv
import json
import shutil
import socket
import sqlite3
import zipfile

import pytest

from autograder.bad_submissions import MODULE, build
from autograder.collect import collect
from autograder.contain import jail_available, jail_missing_reason
from autograder.grade import grade
from autograder.gradebook import merge
from autograder.reports import FIELDS, STATUSES
from autograder.paths import tool_env
from autograder.release import REPO, SOLUTIONS, modules
from autograder.samples import solution_answers, write_submission

TIMEOUT = 60             # s per submission: several times what a good module-01 notebook needs, 3 at a time
ROSTER = ["absent"]      # on the roster, submitted nothing: a 'missing' row
MEMORY = 4 * 2**30       # above a good module-01 grading's RSS summed over its tree (2 gloo ranks), below a runaway's


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    subs = tmp_path_factory.mktemp("corpus")
    out = tmp_path_factory.mktemp("corpus-grading")
    with socket.socket() as server:          # on this machine's loopback: the snoop must not reach it
        server.bind(("127.0.0.1", 0))
        server.listen()
        expected = build(subs, MODULE, out, port=server.getsockname()[1])
        rows = grade(subs, out, only=[MODULE], quiet=True, jobs=3, timeout=TIMEOUT, memory=MEMORY, roster=ROSTER)
    return out, subs, expected, {r["student"]: r for r in rows}


def _csv(out):
    with open(out / "grades.csv", encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_every_bad_submission_gets_its_status_and_score(corpus):
    _, _, expected, rows = corpus
    assert set(rows) == set(expected) | set(ROSTER)
    assert rows["absent"]["status"] == "missing" and rows["absent"]["score"] == 0
    for student, exp in expected.items():
        r = rows[student]
        assert r["status"] == exp["status"], f"{student}: {r['status']} ({r['detail']}), expected {exp['status']}"
        if exp["score"] == "full":
            assert r["score"] == r["max_score"] > 0, f"{student}: {r['score']}/{r['max_score']} {r['detail']}"
        elif exp["score"] == "partial":      # a module of several notebooks, one of them broken and set aside
            assert 0 < r["score"] < r["max_score"], f"{student}: {r['score']}/{r['max_score']} {r['detail']}"
        else:
            assert r["score"] == 0, f"{student}: {r['score']}"
    assert "deleted test_" in rows["deleted_test"]["detail"]
    assert "edited test_" in rows["edited_test"]["detail"]
    assert "memory" in rows["membomb"]["detail"]
    assert "Copy1" in rows["renamed"]["detail"]


@pytest.mark.slow
def test_csv_schema_and_feedback(corpus):
    out, _, expected, _ = corpus
    table = _csv(out)
    assert list(table[0]) == FIELDS
    assert sorted(r["student"] for r in table) == sorted([*expected, *ROSTER])
    for r in table:
        assert r["module"] == MODULE and r["status"] in STATUSES
        assert 0 <= float(r["score"]) <= float(r["max_score"]) and float(r["seconds"]) >= 0
        html = out / "feedback" / r["student"] / MODULE / f"{MODULE}.html"
        assert html.exists() == (r["status"] != "missing"), html
    timings = json.loads((out / "timings.json").read_text())
    assert timings["seconds_per_submission"][MODULE]["submissions"] >= 7


@pytest.mark.slow
def test_nbgraders_own_export_agrees_with_grades_csv(corpus):
    """nbgrader's CsvExportPlugin reads the main gradebook: its scores are the ones grades.csv reports."""
    out, _, _, _ = corpus
    ours = {r["student"]: float(r["score"]) for r in _csv(out)}
    with open(out / "nbgrader-grades.csv", encoding="utf-8", newline="") as f:
        theirs = {r["student_id"]: float(r["score"]) for r in csv.DictReader(f) if r["assignment"] == MODULE}
    assert theirs == ours
    assert theirs["good"] > 0


@pytest.mark.slow
def test_merge_copies_every_field_of_a_jobs_gradebook(tmp_path, monkeypatch):
    """A job's submission, notebook, grade and comment rows reach the main gradebook whole, set fields and
    all (late penalty, flags, manual scores), whatever columns this nbgrader version has."""
    from nbgrader.api import Gradebook

    monkeypatch.setenv("PATH", tool_env()["PATH"])      # a new gradebook runs this venv's `alembic`
    job, main = tmp_path / "job", tmp_path / "main"
    (job / "root").mkdir(parents=True)
    main.mkdir()
    for db in (job / "root" / "gradebook.db", main / "gradebook.db"):
        with Gradebook(f"sqlite:///{db}") as gb:
            gb.add_assignment("m1")
            gb.add_notebook("m1", "m1")
            gb.add_grade_cell("t1", "m1", "m1", max_score=3, cell_type="code")
            gb.add_solution_cell("s1", "m1", "m1")
            gb.add_student("ada")
    with Gradebook(f"sqlite:///{job / 'root' / 'gradebook.db'}") as gb:
        gb.add_submission("m1", "ada", timestamp="2026-01-02 03:04:05")
        nb = gb.find_submission_notebook("m1", "m1", "ada")
        nb.flagged, nb.late_submission_penalty = True, 0.5
        g = gb.find_grade("t1", "m1", "m1", "ada")
        g.auto_score, g.manual_score, g.extra_credit, g.needs_manual_grade = 1.5, 2.5, 0.25, True
        c = gb.find_comment("s1", "m1", "m1", "ada")
        c.auto_comment, c.manual_comment = "auto", "see me"
        gb.db.commit()

    score = merge(main, {"job": job}, "ada", "m1")

    def rows(db):
        with Gradebook(f"sqlite:///{db}") as gb:
            sub = gb.find_submission("m1", "ada")
            objs = [sub, *sub.notebooks, *sub.notebooks[0].grades, *sub.notebooks[0].comments]
            return [{col.key: getattr(o, col.key) for col in type(o).__table__.columns
                     if not (col.primary_key or col.foreign_keys)} for o in objs]

    assert rows(main / "gradebook.db") == rows(job / "root" / "gradebook.db")
    assert score == 2.5 + 0.25


@pytest.mark.slow
def test_chatty_output_is_truncated_in_feedback(corpus):
    out, _, _, _ = corpus
    html = (out / "feedback" / "chatty" / MODULE / f"{MODULE}.html").read_text()
    assert len(html) < 3_000_000, "nbgrader's LimitOutput should cut 100 000 printed lines"


@pytest.mark.slow
@pytest.mark.skipif(not jail_available(), reason=f"no jail here: {jail_missing_reason()}")
def test_submissions_cannot_see_secrets_or_write_outside(corpus):
    out, subs, _, _ = corpus
    text = (out / "feedback" / "snoop" / MODULE / f"{MODULE}.html").read_text()
    assert "SNOOP-SEES" in text, "the snoop cell did not run"
    for name in ("solutions", "gradebook", "submissions", "scratch_source", "scratch_gradebook", "release", "tests",
                 "network"):
        assert f"SNOOP-SEES {name} False" in text, f"a submission could see {name}"
    assert "SNOOP-STUBS True" in text, (
        "the scripts beside a graded notebook must be the release's, their answers stubbed")
    assert "SNOOP-WROTE" not in text and text.count("SNOOP-BLOCKED") == 4   # (the source says 'SNOOP-' + ...)
    for p in (SOLUTIONS / "PWNED.txt", out / "PWNED.txt", REPO / "PWNED.txt", subs / "good" / "PWNED.txt"):
        assert not p.exists(), p


@pytest.mark.slow
def test_rerun_is_identical_and_a_late_submission_alone_is_graded(corpus):
    out, subs, expected, _ = corpus
    before = (out / "grades.csv").read_bytes()
    db = out / "nbgrader" / "gradebook.db"

    def counts():
        with sqlite3.connect(db) as con:
            return {t: con.execute(f"select count(*) from {t}").fetchone()[0]
                    for t in ("student", "submitted_assignment", "grade")}

    n = counts()
    grade(subs, out, only=[MODULE], quiet=True, jobs=2, timeout=TIMEOUT, memory=MEMORY, roster=ROSTER)
    assert (out / "grades.csv").read_bytes() == before
    assert counts() == n
    assert json.loads((out / "timings.json").read_text())["graded_this_run"] == 0

    write_submission(subs, "late", MODULE, solution_answers(MODULE))
    rows = {r["student"]: r for r in grade(subs, out, only=[MODULE], quiet=True, jobs=2,
                                           timeout=TIMEOUT, memory=MEMORY, roster=ROSTER)}
    assert json.loads((out / "timings.json").read_text())["graded_this_run"] == 1
    assert rows["late"]["status"] == "graded" and rows["late"]["score"] == rows["late"]["max_score"]
    assert counts()["submitted_assignment"] == n["submitted_assignment"] + 1
    old = {r["student"]: r for r in csv.DictReader(before.decode().splitlines())}
    for r in _csv(out):
        if r["student"] != "late":
            assert r == old[r["student"]]


def test_input_layouts_flat_folder_and_lms_zip(tmp_path):
    """collect() reads nbgrader's layout, student folders, flat LMS names and a zip of them."""
    ms = modules()
    m = ms[0]
    flat = tmp_path / "flat"
    flat.mkdir()
    nb = (REPO / "course" / m / f"{m}.ipynb").read_bytes()
    names = {f"ada_{m}.ipynb": ("ada", m),
             f"{m}_bob_attempt_2024-05-01-10-00-00_{m}.ipynb": ("bob", m),
             f"{m}_bob_attempt_2024-05-02-10-00-00_{m}.ipynb": ("bob", m),       # later attempt wins
             f"carolsmith_LATE_1234_56789_{m}-1.ipynb": ("carolsmith", m),
             f"{m}_dörte.ipynb": ("dörte", m),
             "notes.ipynb": None}
    for name in names:
        (flat / name).write_bytes(nb)
    (flat / "eve").mkdir()
    (flat / "eve" / f"{m}.ipynb").write_bytes(nb)
    found, unmatched = collect(flat, tmp_path / "out1", ms)
    got = {(f.student, f.module): f for f in found}
    assert set(got) == {("ada", m), ("bob", m), ("carolsmith", m), ("dörte", m), ("eve", m)}
    assert "2024-05-02" in got[("bob", m)].detail and unmatched == ["notes.ipynb"]
    assert (tmp_path / "out1" / "collected" / "dörte" / m / f"{m}.ipynb").read_bytes() == nb

    archive = tmp_path / "lms.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for name in names:
            z.write(flat / name, f"download/{name}")
    found_zip, _ = collect(archive, tmp_path / "out2", ms)
    assert {(f.student, f.module) for f in found_zip} == set(got) - {("eve", m)}

    layout = tmp_path / "nbgrader"
    write_submission(layout, "fay", m, {})
    shutil.move(layout / "fay" / m / f"{m}.ipynb", layout / "fay" / m / "Untitled.ipynb")
    found_nb, _ = collect(layout, tmp_path / "out3", ms)
    assert [(f.student, f.module) for f in found_nb] == [("fay", m)]
    assert "Untitled.ipynb" in found_nb[0].detail


def test_an_instructors_own_lms_naming_is_read_by_nbgraders_collector(tmp_path, monkeypatch):
    """``c.FileNameCollectorPlugin.named_regexp`` in the course's nbgrader config names another LMS's files."""
    import autograder.collect as collect_module

    m = modules()[0]
    monkeypatch.setattr(collect_module, "_instructor_regexp",
                        lambda: r"^sub-(?P<student_id>[a-z]+)-(?P<file_id>[0-9a-z_]+\.ipynb)$")
    flat = tmp_path / "flat"
    flat.mkdir()
    for name in (f"sub-zed-{m}.ipynb", "sub-yan-notamodule.ipynb"):
        (flat / name).write_bytes((REPO / "course" / m / f"{m}.ipynb").read_bytes())
    found, unmatched = collect(flat, tmp_path / "out", modules())
    assert [(f.student, f.module) for f in found] == [("zed", m)]
    assert unmatched == ["sub-yan-notamodule.ipynb"]


@pytest.mark.slow
def test_watch_grades_a_submission_as_it_arrives(tmp_path):
    """``autograder.grade --watch``: a submission that lands in the watched folder is graded at the next pass,
    with its feedback; Ctrl-C stops the watch cleanly."""
    import signal
    import subprocess
    import sys
    import time

    subs, out = tmp_path / "inbox", tmp_path / "out"
    subs.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "autograder.grade", str(subs), "--out", str(out), "--modules",
                             MODULE, "--watch", "2", "--jobs", "1", "--timeout", str(TIMEOUT)],
                            cwd=REPO, env=tool_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(5)                                   # a pass or two over an empty inbox
        write_submission(subs, "early_bird", MODULE, {})
        deadline = time.time() + 180
        rows = []
        while time.time() < deadline and not any(r["student"] == "early_bird" for r in rows):
            time.sleep(2)
            rows = _csv(out) if (out / "grades.csv").exists() else []
        assert any(r["student"] == "early_bird" and r["status"] == "graded" for r in rows), (
            f"the new submission was not graded within 3 minutes: {rows}")
        assert (out / "feedback" / "early_bird" / MODULE / f"{MODULE}.html").exists()
    finally:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "stopping after this pass" in output and "stopped watching" in output, \
        output[-2000:]
    assert "not in session" not in output, "SQLAlchemy's session warnings reach the instructor's console"


def test_a_job_grades_on_the_templates_digits_with_its_share_of_the_cores(tmp_path):
    """A module's template holds the course's data set (``autograder.grade.offline_digits``), which each job copies
    and its kernel reads as ``COURSE_DATA`` (no scikit-learn import in each kernel; the same data whatever the grading
    machine's own data folder holds) and a Ray cluster's node receives with the template; each job gets the machine's
    CPUs divided among the jobs that run at once."""
    from autograder.cluster import template_parts
    from autograder.grade import prepare
    from autograder.job import DATA, job_threads
    from coursekit.data import load_digits
    from coursekit.runtime import detect

    module = modules()[0]
    template = prepare(tmp_path / "out", [module])[module]
    assert sorted(p.name for p in (template / DATA / "sklearn-digits").iterdir()) == [
        "test-images.npy", "test-labels.npy", "train-images.npy", "train-labels.npy"]
    assert DATA in template_parts(module)
    kept = load_digits(train=True, data_dir=str(template / DATA), quiet=True)
    fresh = load_digits(train=True, data_dir=str(tmp_path / "fresh"), quiet=True)
    assert kept.source == fresh.source == "sklearn-digits"
    assert kept.images.equal(fresh.images) and kept.labels.equal(fresh.labels)
    cpus = detect().num_cpus
    assert job_threads(1) == cpus and job_threads(2) == max(1, cpus // 2) and job_threads(10 * cpus) == 1
