"""Module 07's construction check on plain data (what a test cell hands in), the visible one and the grader's: the
figures are those measured for the check's DigitNet (coursekit/exercise_checks/capstone.py's CONSTRUCTION_BOUND)."""
import pytest

from autograder.checks import scale07
from autograder.checks.references import digitnet_params
from coursekit.exercise_checks import capstone as cap

MODEL = 4 * digitnet_params(scale07.CHECK)


def _run(*fractions):
    return {"config": scale07.CHECK, "error": None,
            "ranks": [{"construction_peak": None if f is None else int(f * MODEL), "reports": []} for f in fractions]}


def test_a_meta_build_loaded_from_rank_0_passes_both():
    run = _run(1.25, 0.59, 0.70, 0.59)          # the reference, as measured (0.70: once, in the notebook's kernel)
    cap.check_built_on_meta(run, MODEL)
    assert "ranks 1-3" in scale07.built_on_meta({"run": run})


@pytest.mark.parametrize("fractions, where", [((1.05, 1.05, 1.05, 1.05), "worker 1"),    # whole on every rank
                                              ((1.25, 0.59, 1.05, 0.59), "worker 2"),    # one rank builds it whole
                                              ((1.25, 0.59, None, 0.59), "worker 2")])   # no forward pass seen
def test_a_rank_other_than_0_holding_the_whole_model_fails(fractions, where):
    with pytest.raises(AssertionError, match=where):
        cap.check_built_on_meta(_run(*fractions), MODEL)


def test_the_grader_also_bounds_rank_0_to_one_whole_copy():
    with pytest.raises(AssertionError, match="second whole copy"):
        scale07.built_on_meta({"run": _run(2.1, 0.59, 0.59, 0.59)})
    assert scale07.RANK0_CONSTRUCTION_BOUND * MODEL > 1.25 * MODEL
