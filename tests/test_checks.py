"""The verdicts decided outside the kernel (autograder/checks): evidence read only from its own cell, concept
answers judged by their form and their key, and the scan that flags code reaching for the grading machinery."""
import json

import nbformat
import pytest

from autograder.checks import evidence, judge, judged_outside
from autograder.checks.concepts import KEYS
from autograder.checks.tamper import scan
from autograder.paths import modules
from coursekit.evidence import MIME, hand_in, plain


def test_hand_in_shows_plain_data_only_when_grading(monkeypatch, capsys):
    monkeypatch.delenv("COURSE_GRADING", raising=False)
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    hand_in("test_x", answer="a")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    hand_in("test_x", answer={"b", "a"}, loss=float("nan"), shape=(2, 3))
    out = capsys.readouterr().out
    assert MIME in out and "'answer': ['a', 'b']" in out and "'loss': 'nan'" in out and "'shape': [2, 3]" in out
    assert plain(object()).startswith("<object object")


def _cell(grade_id, outputs):
    cell = nbformat.v4.new_code_cell("")
    cell.metadata["nbgrader"] = {"grade_id": grade_id, "grade": True}
    cell.outputs = [nbformat.v4.new_output("display_data", data=d) for d in outputs]
    return cell


def test_evidence_counts_only_what_names_its_own_cell_last_one_wins():
    mine = {MIME: {"grade_id": "test_a", "data": {"answer": "b"}}}
    other = {MIME: {"grade_id": "test_b", "data": {"answer": "c"}}}
    assert evidence(_cell("test_a", [mine])) == {"answer": "b"}
    assert evidence(_cell("test_a", [other])) is None
    assert evidence(_cell("test_a", [{MIME: {"grade_id": "test_a", "data": "b"}}])) is None   # not a dict
    assert evidence(_cell("test_a", [mine, {MIME: {"grade_id": "test_a", "data": {"answer": "d"}}}])) == {"answer": "d"}
    assert evidence(_cell("test_a", [{"text/plain": "answer recorded"}])) is None


@pytest.mark.parametrize("module", sorted(KEYS))
def test_every_concept_key_passes_its_own_form_and_a_wrong_or_missing_answer_fails(module):
    assert set(KEYS[module]) <= judged_outside(module)
    for gid, (key, why, several) in KEYS[module].items():
        passed, message = judge(module, gid, {"answer": key})
        assert passed and why in message, (gid, message)
        wrong = next(x for x in "abcd" if x not in key)
        assert judge(module, gid, {"answer": wrong}) == (False, f"not quite ({wrong!r}). Why: {why}")
        assert not judge(module, gid, None)[0] and not judge(module, gid, {})[0]
        assert judge(module, gid, {"answer": sorted(set(key.replace(",", " ").split()))})[0]   # a list of letters
        assert not judge(module, gid, {"answer": 3})[0] and not judge(module, gid, {"answer": ""})[0]
        assert not judge(module, gid, {"answer": "e"})[0]
        if not several:
            assert not judge(module, gid, {"answer": "a b"})[0]


def test_scan_flags_reaching_for_the_grader_in_student_cells_only(tmp_path):
    nb = nbformat.v4.new_notebook()
    answer = nbformat.v4.new_code_cell("x = model.eval()\nget_ipython().input_transformers_post.append(f)")
    answer.metadata["nbgrader"] = {"grade_id": "train_step", "solution": True}
    release = nbformat.v4.new_code_cell("import builtins  # the release's own cell")
    release.metadata["nbgrader"] = {"grade_id": "code_1", "locked": True}
    added = nbformat.v4.new_code_cell("import os\nif os.environ.get('COURSE_GRADING'): pass\ntorch.allclose = lambda *a: True")
    nb.cells = [answer, release, added]
    nbformat.write(nb, tmp_path / "n.ipynb")
    found = scan(tmp_path / "n.ipynb")
    assert [f.split(":")[0] for f in found] == ["train_step", "added cell 3", "added cell 3"], found
    assert "IPython hooks" in found[0] and "grading environment" in found[1] and "patched libraries" in found[2]


def test_modules_judged_outside_have_no_hidden_tests_and_no_cell_judged_in_the_kernel():
    """Every module's code exercises are judged in autograder/checks: every graded cell is judged there, no notebook
    holds hidden tests, and what the grader asks the test cells to run names cells of the module."""
    from autograder.checks import CODE, asked
    from autograder.paths import module_cells

    assert set(CODE) == set(modules()), f"judged in the kernel still: {sorted(set(modules()) - set(CODE))}"
    for module in CODE:
        cells = module_cells(module)      # every notebook of the module
        graded = {c.metadata["nbgrader"]["grade_id"] for c in cells if c.metadata.get("nbgrader", {}).get("grade")}
        assert graded == judged_outside(module), f"{module}: judged in the kernel: {graded - judged_outside(module)}"
        assert not any("HIDDEN TESTS" in c.source for c in cells), f"{module}: hidden tests in the notebook"
        assert set(asked(module)) <= graded
        for gid in asked(module):
            cell = next(c for c in cells if c.metadata.get("nbgrader", {}).get("grade_id") == gid)
            assert f'asked("{gid}")' in cell.source, f"{module}/{gid}: the test cell does not run what is asked"


def test_preparing_the_references_starts_no_thread_that_a_forked_job_would_wait_for():
    """A warm worker computes every module's references (``prepare``) and then forks the jobs: a thread started
    there (OpenMP's pool, on a torch computation with more than one thread) does not exist in the job, which then
    waits for it forever. Measured: module 07's reference on 2 threads left one more thread; on 1, none."""
    import os
    import subprocess
    import sys

    code = ("import os\n"
            "from autograder.checks import CODE, prepare\n"
            "before = len(os.listdir('/proc/self/task'))\n"
            "for module in CODE:\n"
            "    prepare(module)\n"
            "print(before, len(os.listdir('/proc/self/task')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split()[-2:])
    assert after == before, f"preparing the references left {after - before} more thread(s) in the grader"


def test_what_the_grader_asks_a_kernel_to_run_is_inputs_never_answer_code():
    """COURSE_ASKED reaches the kernel, where a submission's code can read it while it is graded: it holds inputs
    (seeds, sizes, configs), never code; above all no line of a solution cell."""
    from autograder.checks import asked
    from autograder.paths import module_cells

    for module in modules():
        sent = json.dumps(asked(module))
        cells = module_cells(module)
        answers = [line.strip() for c in cells if c.metadata.get("nbgrader", {}).get("solution")
                   for line in c.source.splitlines()]
        leaked = [line for line in answers if len(line) > 12 and not line.startswith(("#", "###")) and line in sent]
        assert not leaked, f"{module}: answer lines in what the grader asks: {leaked[:3]}"
        for word in ("def ", "lambda", "import ", "return "):
            assert word not in sent, f"{module}: code ({word!r}) in what the grader asks the kernel to run"


def test_batchnorm_counts_tell_a_loop_that_trained_in_eval_mode():
    """The hidden BatchNorm cases of modules 02 and 03: a loop that leaves its model in eval mode after an evaluation
    (coursekit.models.accuracy puts it there) counts fewer batches than it trained, and fails; one that trains every
    step in training mode passes."""
    import torch

    from autograder.checks.references import check_batchnorm_counts
    from coursekit.models import accuracy, build_model

    def trained(reset_mode: bool) -> dict:
        torch.manual_seed(0)
        model, images, labels = build_model("small_cnn_bn"), torch.randn(8, 1, 28, 28), torch.arange(8) % 10
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model.train()
        for _ in range(2):                       # two epochs of two steps, an evaluation after each epoch
            if reset_mode:
                model.train()
            for half in (slice(0, 4), slice(4, 8)):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(images[half]), labels[half]).backward()
                optimizer.step()
            accuracy(model, images, labels)
        return model.state_dict()

    check_batchnorm_counts(trained(reset_mode=True), 4, "right")
    with pytest.raises(AssertionError, match=r"counted \[2\] batches, expected 4.*training mode"):
        check_batchnorm_counts(trained(reset_mode=False), 4, "left in eval mode")
