"""The release's leak check (autograder.student_release.answer_leaks) finds each answer that an earlier release
showed in plain sight (issue 38, section 2): the cases are kept in tests/leak_cases/<case>/ as they were released
(the answer, the text that held it, and what kind of text it was), and each must still be found, whatever the check
becomes. The release itself holding none is tests/test_release.py's and tests/test_grading_release.py's."""
import ast
from pathlib import Path

import pytest

from autograder.student_release import leak_of

CASES = Path(__file__).with_name("leak_cases")


def _case(name: str) -> tuple[str, str, str, str, str]:
    folder = CASES / name
    module, grade_id, kind = (folder / "case.txt").read_text().splitlines()[:3]
    leaked = next(p for p in folder.iterdir() if p.name.startswith("leaked"))
    return module, grade_id, kind, (folder / "answer.txt").read_text(), leaked.read_text()


@pytest.mark.parametrize("name", sorted(p.name for p in CASES.iterdir() if p.is_dir()))
def test_each_answer_once_released_in_plain_sight_is_found(name):
    module, grade_id, kind, answer, leaked = _case(name)
    why = leak_of(answer, leaked, module, kind)
    assert why, f"{name}: {module}'s {grade_id} in a {kind} is no longer found"


@pytest.mark.parametrize("name", ["07_capstone_in_its_script", "03_loop_in_its_script"])
def test_two_thirds_of_a_long_answer_renamed_is_a_leak(name):
    """The threshold, from the cases: an answer's first two thirds of statements, every name changed, in a
    function of their own."""
    module, _, _, answer, _ = _case(name)
    tree = ast.parse(answer)
    body = tree.body
    cut = max(1, 2 * len(body) // 3)

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
            node.id = f"{node.id}_2"
            return node

    renamed = ast.unparse(Rename().visit(ast.Module(body=body[:cut], type_ignores=[])))
    disguised = "def helper(cfg):\n" + "\n".join("    " + ln for ln in renamed.splitlines())
    assert leak_of(answer, disguised, module, "file"), f"{name}: two thirds renamed are not found"


@pytest.mark.parametrize("name", sorted(p.name for p in CASES.iterdir() if p.is_dir()))
def test_an_answer_is_not_found_in_text_that_does_not_hold_it(name):
    """The rules do not fire on everything: each case's answer against another module's case text."""
    module, _, _, answer, _ = _case(name)
    other = next(n for n in sorted(p.name for p in CASES.iterdir() if p.is_dir()) if not n.startswith(module[:2]))
    _, _, kind, _, text = _case(other)
    assert not leak_of(answer, text, module, kind), (name, other, leak_of(answer, text, module, kind))


def test_every_reviewed_finding_is_still_found_and_none_else_remains(tmp_path):
    """autograder/leaks_reviewed.toml holds no stale entry (each keeps a finding the check makes today), and the
    release holds no finding beyond them."""
    from autograder.student_release import answer_leaks, build, reviewed, unreviewed

    found = answer_leaks(build(tmp_path / "release"))
    assert not unreviewed(found), unreviewed(found)
    for entry in reviewed():
        assert any(f.split(":", 1)[0] == entry["where"] and entry["shows"] in f for f in found), \
            f"a stale entry of leaks_reviewed.toml: {entry['answer']} in {entry['where']}"
