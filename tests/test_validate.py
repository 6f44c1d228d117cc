"""JupyterLab's Validate button (nbgrader's validate server extension) works on the course's notebooks.

The button's handler loads nbgrader's config from the Jupyter config path (where
``coursekit.jupyter_setup`` put the course's cell time limit) and the server's working folder,
then runs the notebook with nbgrader's Validator; the kernel sees ``NBGRADER_EXECUTION=validate``
and the notebook runs in grading mode (no demo training runs). Here: the same handler code on a
released notebook with the reference answers written in (nothing fails) and untouched (the
exercises fail), inside the grader's time per submission.
"""
import shutil
import time

import nbformat
import pytest

from autograder.release import REPO
from autograder.samples import fill, solution_answers
from coursekit.jupyter_setup import CELL_TIMEOUT_S
from coursekit.validate import main as validate_main

MODULE = "02_ray_train"
# a cell that makes every later cell warn on stderr, as a library's deprecation notice or torch's c10d notice does
# (the grader ignores stderr: Validate must too)
WARNS = ("import sys, warnings\n"
         "def _warn(*_):\n"
         "    warnings.warn('this API is deprecated', DeprecationWarning, stacklevel=1)\n"
         "    print('[W socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved', file=sys.stderr)\n"
         "warnings.simplefilter('always')\n"
         "get_ipython().events.register('post_run_cell', _warn)")


def _validate(folder):
    from nbgrader.server_extensions.validate_assignment.handlers import ValidateAssignmentHandler
    from nbgrader.validator import Validator

    config = ValidateAssignmentHandler.load_config(None)   # exactly what the button's handler loads
    assert config.Execute.timeout == CELL_TIMEOUT_S, "run `python -m coursekit.jupyter_setup` (make venv does)"
    start = time.perf_counter()
    result = Validator(config=config).validate(str(folder / f"{MODULE}.ipynb"))
    return result, time.perf_counter() - start


@pytest.mark.slow
def test_validate_passes_the_reference_and_fails_the_untouched_notebook(tmp_path, monkeypatch, capsys):
    # the server's working folder of a student's release, which has no nbgrader_config.py (the repository's
    # root has the instructors' one, which would hide a missing jupyter_setup)
    monkeypatch.chdir(tmp_path)
    right = tmp_path / "right"
    shutil.copytree(REPO / "course" / MODULE, right)
    nb = fill(MODULE, solution_answers(MODULE))
    nb.cells.insert(0, nbformat.v4.new_code_cell(WARNS))   # right answers whose every later cell warns on stderr
    nbformat.write(nb, right / f"{MODULE}.ipynb")
    result, seconds = _validate(right)
    assert not result.get("changed") and not result.get("type_changed"), result
    assert not result.get("failed"), [f["raw_error"][-500:] for f in result["failed"]]
    assert seconds < 120, f"Validate took {seconds:.0f} s: the notebook did not run in grading mode?"

    # from a terminal: an untouched notebook fails, with the reason, and a non-zero exit status
    blank = tmp_path / "blank"
    shutil.copytree(REPO / "course" / MODULE, blank)
    assert validate_main([str(blank / f"{MODULE}.ipynb")]) == 1, "an untouched notebook must not validate"
    printed = capsys.readouterr().out
    assert "check(s) failed" in printed and "NotImplementedError" in printed, printed[-2000:]
