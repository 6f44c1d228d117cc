"""A module whose folder holds several notebooks (nbgrader: one assignment, several notebooks), on a tiny fake course
in a tmp folder: which notebooks a module has and which one holds a grade_id (``autograder.paths``), how submissions
of such a module are collected (nbgrader's layout, student folders, flat and LMS names), pre-checked and planned
(a missing part scores 0; none handed in is invalid), judged outside the kernel (``autograder.checks.apply``, under
the right notebook's name in nbgrader's gradebook), filled (``autograder.samples``), turned into bad submissions,
mutated and leak-checked. A module of one notebook keeps today's behaviour."""
import json
import os
import types

import nbformat
import pytest

import autograder.bad_submissions as bad_submissions
import autograder.cache as cache
import autograder.checks as checks
import autograder.mutants as mutants
import autograder.paths as paths
import autograder.samples as samples
import autograder.student_release as student_release
from autograder.collect import collect
from autograder.grade import plan, precheck_folder, scan_folder
from coursekit.evidence import MIME

ONE, TWO, PART2 = "01_one", "05_two", "05_two_part2"
# grade_id of each answer cell -> (its notebook, its reference answer); each answer has one test cell test_<gid>
ANSWERS = {
    "a_one": (ONE, "result_of_one = sum(value * weight for value, weight in pairs_of_one)"),
    "p1": (TWO, "total_of_part_one = sum(value * weight for value, weight in pairs_of_part_one)"),
    "p2": (PART2, "total_of_part_two = max(value * weight for value, weight in pairs_of_part_two)"),
}
STUB = "# YOUR CODE HERE\nraise NotImplementedError()"


def _meta(gid: str, solution: bool) -> dict:
    return {"nbgrader": {"grade": not solution, "grade_id": gid, "locked": not solution, "schema_version": 3,
                         "solution": solution, "task": False, **({} if solution else {"points": 1})}}


def _notebook(name: str, release: bool) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_markdown_cell(f"# {name}"))
    for gid, (owner, answer) in ANSWERS.items():
        if owner != name:
            continue
        source = STUB if release else f"### BEGIN SOLUTION\n{answer}\n### END SOLUTION"
        nb.cells.append(nbformat.v4.new_code_cell(source, metadata=_meta(gid, True)))
        nb.cells.append(nbformat.v4.new_code_cell(f"assert {gid}_checked()", metadata=_meta(f"test_{gid}", False)))
    return nb


@pytest.fixture
def course(tmp_path, monkeypatch):
    """tmp/solutions and tmp/course with module 01_one (one notebook) and 05_two (05_two and 05_two_part2), and
    the grader's constants pointed at them."""
    root = tmp_path / "repo"
    for module, names in ((ONE, [ONE]), (TWO, [PART2, TWO])):       # written out of order on purpose
        for kind in ("solutions", "course"):
            folder = root / kind / module
            folder.mkdir(parents=True)
            for name in names:
                nbformat.write(_notebook(name, kind == "course"), folder / f"{name}.ipynb")
    checkpoint = root / "solutions" / TWO / ".ipynb_checkpoints"
    checkpoint.mkdir()
    nbformat.write(_notebook(TWO, False), checkpoint / f"{TWO}-checkpoint.ipynb")
    for module in (paths, cache, student_release):
        monkeypatch.setattr(module, "SOLUTIONS", root / "solutions")
    for module in (samples, bad_submissions, mutants):
        monkeypatch.setattr(module, "REPO", root)
    monkeypatch.setenv("PATH", paths.tool_env()["PATH"])       # a new nbgrader gradebook runs this venv's alembic
    return root


def _write(path, nb) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


# ---------------------------------------------------------------- which notebooks, which one holds a grade_id

def test_notebooks_and_notebook_of(course):
    assert paths.notebooks(TWO) == [TWO, PART2]            # the module's own first, checkpoints ignored
    assert paths.notebooks(ONE) == [ONE]
    assert paths.notebook_of(TWO, "p1") == TWO and paths.notebook_of(TWO, "test_p1") == TWO
    assert paths.notebook_of(TWO, "p2") == PART2 and paths.notebook_of(TWO, "test_p2") == PART2
    assert paths.notebook_of(ONE, "test_a_one") == ONE
    with pytest.raises(KeyError):
        paths.notebook_of(TWO, "a_one")
    assert paths.notebook_of(TWO, "a_one", default=None) is None and paths.notebook_of(TWO, "p2", default=None) == PART2
    # the cache follows an edited notebook: test_p2 moved to part 1
    part1, part2 = _notebook(TWO, False), _notebook(PART2, False)
    part1.cells.append(part2.cells.pop())
    for name, nb in ((TWO, part1), (PART2, part2)):
        path = course / "solutions" / TWO / f"{name}.ipynb"
        nbformat.write(nb, path)
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert paths.notebook_of(TWO, "test_p2") == TWO


# ---------------------------------------------------------------- collecting

def test_collect_reads_every_notebook_of_a_module_in_nbgraders_layout(course, tmp_path):
    subs = tmp_path / "subs"
    for name in (TWO, PART2):
        _write(subs / "ada" / TWO / f"{name}.ipynb", _notebook(name, True))
    _write(subs / "bob" / TWO / f"{TWO}.ipynb", _notebook(TWO, True))                 # part 2 missing
    _write(subs / "bob" / TWO / "Untitled.ipynb", nbformat.v4.new_notebook())        # holds no cell of it
    _write(subs / "cy" / TWO / f"{TWO}.ipynb", _notebook(TWO, True))
    _write(subs / "cy" / TWO / f"{PART2}-Copy1.ipynb", _notebook(PART2, True))       # part 2, copied
    _write(subs / "dee" / TWO / f"{TWO}-Copy1.ipynb", _notebook(TWO, True))          # part 1, copied
    _write(subs / "dee" / TWO / f"{PART2}.ipynb", _notebook(PART2, True))
    _write(subs / "eve" / TWO / "Untitled.ipynb", nbformat.v4.new_notebook())        # nothing of the module
    _write(subs / "eve" / TWO / "notes.ipynb", nbformat.v4.new_notebook())
    _write(subs / "fay" / ONE / "Untitled.ipynb", _notebook(ONE, True))              # one notebook: as today
    found, unmatched = collect(subs, tmp_path / "out", [ONE, TWO])
    got = {(f.student, f.module): f for f in found}
    assert set(got) == {("ada", TWO), ("bob", TWO), ("cy", TWO), ("dee", TWO), ("eve", TWO), ("fay", ONE)}
    assert not unmatched

    def names(f):
        return sorted(p.name for p in f.folder.glob("*.ipynb"))

    assert names(got[("ada", TWO)]) == [f"{TWO}.ipynb", f"{PART2}.ipynb"] and not got[("ada", TWO)].detail
    assert names(got[("bob", TWO)]) == [f"{TWO}.ipynb", "Untitled.ipynb"] and not got[("bob", TWO)].invalid
    assert got[("cy", TWO)].detail == f"graded {PART2}-Copy1.ipynb as {PART2}.ipynb"
    assert names(got[("cy", TWO)]) == [f"{TWO}.ipynb", f"{PART2}.ipynb"]
    assert got[("dee", TWO)].detail == f"graded {TWO}-Copy1.ipynb as {TWO}.ipynb"
    assert got[("eve", TWO)].invalid == (f"no {TWO}.ipynb or {PART2}.ipynb and other notebooks "
                                         "(Untitled.ipynb, notes.ipynb)")
    assert got[("fay", ONE)].detail == f"graded Untitled.ipynb as {ONE}.ipynb"


def test_collect_reads_flat_and_lms_names_longest_notebook_name_first(course, tmp_path):
    flat = tmp_path / "flat"
    files = {f"ada_{PART2}.ipynb": ("ada", PART2),                                  # not part 1 + "_part2"
             f"ada_{TWO}.ipynb": ("ada", TWO),
             f"bob_LATE_12_34_{PART2}-1.ipynb": ("bob", PART2),                      # Canvas
             f"{PART2}_carl.ipynb": ("carl", PART2),
             f"{TWO}_carl.ipynb": ("carl", TWO),
             f"{PART2}_dan_attempt_2024-05-01-10-00-00_{PART2}.ipynb": ("dan", PART2),
             f"{PART2}_dan_attempt_2024-05-02-10-00-00_{PART2}.ipynb": ("dan", PART2),   # the later one wins
             f"ed_{ONE}.ipynb": ("ed", ONE),
             f"eve/{PART2}.ipynb": ("eve", PART2),                                   # a folder per student
             f"{PART2}.ipynb": None,                                                 # no student in the name
             "notes.ipynb": None}
    for name, who in files.items():
        _write(flat / name, _notebook(who[1] if who else TWO, True))
    found, unmatched = collect(flat, tmp_path / "out", [ONE, TWO])
    got = {(f.student, f.module): f for f in found}
    assert set(got) == {("ada", TWO), ("bob", TWO), ("carl", TWO), ("dan", TWO), ("ed", ONE), ("eve", TWO)}
    assert sorted(unmatched) == [f"{PART2}.ipynb", "notes.ipynb"]
    expected: dict = {}
    for who in filter(None, files.values()):
        expected.setdefault((who[0], ONE if who[1] == ONE else TWO), set()).add(f"{who[1]}.ipynb")
    for key, f in got.items():
        assert {p.name for p in f.folder.glob("*.ipynb")} == expected[key], key
    assert "2024-05-02" in got[("dan", TWO)].detail
    assert got[("ada", TWO)].origin == f"ada_{TWO}.ipynb, ada_{PART2}.ipynb"       # in the module's order
    # each file landed under its own notebook's name: part 2's cells in 05_two_part2.ipynb
    part2 = nbformat.read(got[("ada", TWO)].folder / f"{PART2}.ipynb", as_version=4)
    assert any(c.metadata.get("nbgrader", {}).get("grade_id") == "p2" for c in part2.cells)


# ---------------------------------------------------------------- pre-check and plan

def _template(course, tmp_path):
    template = tmp_path / "template"
    for module in (ONE, TWO):
        for name in paths.notebooks(module):
            _write(template / "course" / module / f"{name}.ipynb", _notebook(name, True))
    return template


def test_precheck_of_a_module_of_several_notebooks(course, tmp_path):
    template = _template(course, tmp_path)
    folder = tmp_path / "sub"
    _write(folder / f"{TWO}.ipynb", _notebook(TWO, True))
    assert precheck_folder(folder, template, TWO) == ("", "", f"not handed in (its cells score 0): {PART2}.ipynb")
    edited = _notebook(PART2, True)
    edited.cells[-1].source = "pass"
    _write(folder / f"{PART2}.ipynb", edited)
    assert precheck_folder(folder, template, TWO) == ("", "edited test_p2", "")
    (folder / f"{PART2}.ipynb").write_text("")          # a broken part 2 costs part 1 nothing: it is set aside
    assert precheck_folder(folder, template, TWO) == (
        "", "", f"could not be graded, set aside (its cells score 0): {PART2}.ipynb (empty file)")
    assert not (folder / f"{PART2}.ipynb").exists() and (folder / f"{PART2}.ipynb.unreadable").read_text() == ""
    (folder / f"{PART2}.ipynb.unreadable").unlink()
    (folder / f"{TWO}.ipynb").write_text("{")           # none gradable: invalid, each named with its reason
    assert precheck_folder(folder, template, TWO)[0].startswith(f"{TWO}.ipynb: not a notebook")
    (folder / f"{TWO}.ipynb").unlink()
    assert precheck_folder(folder, template, TWO) == (f"no {TWO}.ipynb or {PART2}.ipynb", "", "")
    assert precheck_folder(folder, template, ONE) == (f"no {ONE}.ipynb", "", "")           # as today
    # the tamper scan reads every notebook, each line after its notebook's name
    part2 = _notebook(PART2, True)
    part2.cells[1].source = "import autograder"
    _write(folder / f"{PART2}.ipynb", part2)
    assert [line.split(":")[0] for line in scan_folder(folder, TWO)] == [f"{PART2}.ipynb"]


def test_plan_grades_a_submission_without_part_2_and_refuses_one_without_any_notebook(course, tmp_path):
    from autograder.cache import Cache

    template = _template(course, tmp_path)
    subs = tmp_path / "subs"
    _write(subs / "ada" / TWO / f"{TWO}.ipynb", _notebook(TWO, True))                 # part 1 only
    _write(subs / "bob" / TWO / "other.ipynb", nbformat.v4.new_notebook())            # none of them
    found, _ = collect(subs, tmp_path / "out", [ONE, TWO])
    main = tmp_path / "out" / "nbgrader"
    main.mkdir(parents=True)
    rows, jobs, _ = plan(found, [TWO], {TWO: template}, main, Cache(tmp_path / "out" / "cache.json"),
                         60.0, 2**30, {TWO: 2.0})
    assert [(j.found.student, j.status, j.detail) for j in jobs] == [
        ("ada", "graded", f"not handed in (its cells score 0): {PART2}.ipynb")]
    assert rows[("bob", TWO)]["status"] == "invalid notebook" and rows[("bob", TWO)]["score"] == 0
    assert rows[("bob", TWO)]["detail"] == f"no {TWO}.ipynb or {PART2}.ipynb and other notebooks (other.ipynb)"


# ---------------------------------------------------------------- judged outside the kernel, into the gradebook

def _evidence(gid: str, data: dict) -> dict:
    return nbformat.v4.new_output("display_data", data={MIME: {"grade_id": gid, "data": data}})


def test_apply_writes_each_notebooks_verdicts_under_its_name(course, tmp_path, monkeypatch):
    from nbgrader.api import Gradebook

    def check(data):
        assert data.get("right"), "the data is wrong"
        return "right"

    monkeypatch.setitem(checks.CODE, TWO, types.SimpleNamespace(CHECKS={"test_p1": check, "test_p2": check}))
    url = f"sqlite:///{tmp_path / 'gradebook.db'}"
    with Gradebook(url) as gb:
        gb.add_assignment(TWO)
        for name in (TWO, PART2):
            gb.add_notebook(name, TWO)
        gb.add_grade_cell("test_p1", TWO, TWO, max_score=1, cell_type="code")
        gb.add_grade_cell("test_p2", PART2, TWO, max_score=2, cell_type="code")
        gb.add_student("ada")
        gb.add_submission(TWO, "ada")
    work = tmp_path / "work"
    part2 = _notebook(PART2, True)
    part2.cells[2].outputs = [_evidence("test_p2", {"right": True})]
    _write(work / f"{PART2}.ipynb", part2)

    assert checks.apply(work / f"{PART2}.ipynb", url, TWO, "ada") == {"test_p2": True}
    assert checks.apply(work / f"{TWO}.ipynb", url, TWO, "ada") == {"test_p1": False}   # not handed in
    assert not (work / f"{TWO}.ipynb").exists()
    with Gradebook(url) as gb:
        assert gb.find_grade("test_p2", PART2, TWO, "ada").auto_score == 2
        assert gb.find_grade("test_p1", TWO, TWO, "ada").auto_score == 0
    cell = nbformat.read(work / f"{PART2}.ipynb", as_version=4).cells[2]
    assert [o.get("text", "") for o in cell.outputs] == [f"{checks.VERDICT}: passed: right\n"]   # evidence removed


# ---------------------------------------------------------------- sample submissions, bad ones, mutants

def test_samples_route_each_answer_to_its_notebook(course, tmp_path):
    answers = samples.solution_answers(TWO)
    assert answers == {"p1": ANSWERS["p1"][1], "p2": ANSWERS["p2"][1]}
    filled = samples.fill_all(TWO, answers)
    assert list(filled) == [TWO, PART2]
    assert filled[TWO].cells[1].source == ANSWERS["p1"][1] and filled[PART2].cells[1].source == ANSWERS["p2"][1]
    assert samples.fill(TWO, {"p2": "x = 2"}).cells[1].source == STUB               # the first notebook
    assert samples.fill(TWO, {"p2": "x = 2"}, notebook=PART2).cells[1].source == "x = 2"
    with pytest.raises(KeyError):
        samples.fill(TWO, {"a_one": "x = 1"})
    dest = samples.write_submission(tmp_path / "subs", "ada", TWO, answers)
    for name, gid in ((TWO, "p1"), (PART2, "p2")):
        assert nbformat.read(dest / f"{name}.ipynb", as_version=4).cells[1].source == ANSWERS[gid][1]


def test_bad_submissions_of_a_module_of_several_notebooks(course, tmp_path, monkeypatch):
    monkeypatch.setattr(bad_submissions, "snoop_code", lambda *a, **k: "pass")
    expected = bad_submissions.build(tmp_path / "corpus", TWO, tmp_path / "out")
    assert expected["renamed"] == {"status": "graded", "score": "full"}
    renamed = tmp_path / "corpus" / "renamed" / TWO
    assert sorted(p.name for p in renamed.glob("*.ipynb")) == [f"{TWO}-Copy1.ipynb", f"{PART2}.ipynb"]
    for student in ("good", "busy_loop", "bad_json"):           # the other notebooks hold the reference
        part2 = nbformat.read(tmp_path / "corpus" / student / TWO / f"{PART2}.ipynb", as_version=4)
        assert part2.cells[1].source == ANSWERS["p2"][1]
    found, _ = collect(tmp_path / "corpus", tmp_path / "out", [TWO])
    got = {f.student: f for f in found}
    assert got["renamed"].detail == f"graded {TWO}-Copy1.ipynb as {TWO}.ipynb"
    template = _template(course, tmp_path)
    assert expected["bad_json"] == {"status": "graded", "score": "partial"}      # part 2 still earns its points
    invalid, _, missing = precheck_folder(got["bad_json"].folder, template, TWO)
    assert not invalid and missing.startswith(f"could not be graded, set aside (its cells score 0): {TWO}.ipynb (not a")
    assert precheck_folder(got["good"].folder, template, TWO) == ("", "", "")


def test_mutants_read_the_notebook_that_holds_the_exercise(course, tmp_path, monkeypatch):
    monkeypatch.setitem(checks.CODE, TWO, types.SimpleNamespace(CHECKS={"test_p1": None, "test_p2": None}))
    assert [c.metadata["nbgrader"]["grade_id"] for c in mutants.Kernel(TWO, tmp_path).nb.cells[1:]] == \
        ["p1", "test_p1"]
    kernel = mutants.Kernel(TWO, tmp_path, PART2)
    assert [(e.name, e.tests) for e in mutants.exercises(TWO, kernel.nb)] == [("p2", ["test_p2"])]
    out = tmp_path / "mutants"
    out.mkdir()
    (out / f"{TWO}.json").write_text(json.dumps({"module": TWO, "exercises": {"p2": {}, "p1": {}}}))
    assert list(mutants.latest(TWO, out)["exercises"]) == ["p1", "p2"]      # in the notebooks' order


# ---------------------------------------------------------------- the leak check

def test_the_leak_check_treats_every_notebook_as_the_modules(course, tmp_path):
    assert {a[1]: a[0] for a in student_release.answers(TWO)} == {"p1": 1, "p2": 1}   # indices in their notebooks
    assert ANSWERS["p2"][1] in student_release.secret_lines(TWO)
    release = tmp_path / "release"
    for name in (TWO, PART2):
        _write(release / "course" / TWO / f"{name}.ipynb", _notebook(name, True))
    assert not student_release.answer_leaks(release, [TWO])
    # part 2's answer in part 1's cell of the same index: a leak (only the answer's own cell, in its own notebook,
    # may show it)
    part1 = _notebook(TWO, True)
    part1.cells[1].source = ANSWERS["p2"][1]
    _write(release / "course" / TWO / f"{TWO}.ipynb", part1)
    found = student_release.answer_leaks(release, [TWO])
    assert any(f.startswith(f"course/{TWO}/{TWO}.ipynb: the answer of {TWO}'s p2 is shown outside its cell")
               for f in found), found
    assert any("line(s) of its solutions" in f for f in student_release.leaks(release, [TWO]))
    (release / "course" / TWO / f"{PART2}.ipynb").unlink()
    assert f"course/{TWO}/{PART2}.ipynb: missing" in student_release.leaks(release, [TWO])
