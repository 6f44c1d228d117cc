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

MODULE = "02_ray_train"


def _validate(folder):
    from nbgrader.server_extensions.validate_assignment.handlers import ValidateAssignmentHandler
    from nbgrader.validator import Validator

    config = ValidateAssignmentHandler.load_config(None)   # exactly what the button's handler loads
    assert config.Execute.timeout == CELL_TIMEOUT_S, "run `python -m coursekit.jupyter_setup` (make venv does)"
    start = time.perf_counter()
    result = Validator(config=config).validate(str(folder / f"{MODULE}.ipynb"))
    return result, time.perf_counter() - start


@pytest.mark.slow
def test_validate_passes_the_reference_and_fails_the_untouched_notebook(tmp_path, monkeypatch):
    # the server's working folder of a student's release, which has no nbgrader_config.py (the repository's
    # root has the instructors' one, which would hide a missing jupyter_setup)
    monkeypatch.chdir(tmp_path)
    right = tmp_path / "right"
    shutil.copytree(REPO / "course" / MODULE, right)
    nbformat.write(fill(MODULE, solution_answers(MODULE)), right / f"{MODULE}.ipynb")
    result, seconds = _validate(right)
    assert not result.get("changed") and not result.get("type_changed"), result
    assert not result.get("failed"), [f["raw_error"][-500:] for f in result["failed"]]
    assert seconds < 120, f"Validate took {seconds:.0f} s: the notebook did not run in grading mode?"

    blank = tmp_path / "blank"
    shutil.copytree(REPO / "course" / MODULE, blank)
    result, _ = _validate(blank)
    assert result.get("failed"), "an untouched notebook must not validate"
    assert any("NotImplementedError" in f["raw_error"] for f in result["failed"])
