"""Module 07's construction check on plain data (what a test cell hands in), the visible one and the grader's: the
figures are those measured for the check's DigitNet (coursekit/exercise_checks/capstone.py's CONSTRUCTION_BOUND)."""
import pytest

from autograder.checks import scale07
from autograder.checks.references import digitnet_params
from coursekit.exercise_checks import capstone as cap

MODEL = 4 * digitnet_params(scale07.CHECK)


def _run(*fractions, **facts):
    return {"config": scale07.CHECK, "error": None,
            "ranks": [{"construction_peak": None if f is None else int(f * MODEL), "reports": [],
                       "allocated_before_sharding": 0, "to_empty_devices": ["cpu"], **facts} for f in fractions]}


def test_a_meta_build_loaded_from_rank_0_passes_both():
    run = _run(1.25, 0.59, 0.81, 0.59)          # the reference, as measured (0.81: gloo let go of tensors late)
    cap.check_built_on_meta(run, MODEL)
    assert "ranks 1-3" in scale07.built_on_meta({"run": run})


@pytest.mark.parametrize("fractions, facts, message", [
    ((1.05,) * 4, {"allocated_before_sharding": 12_345}, "fully_shard met 12,345"),   # whole on every rank, then sharded
    ((1.67, 1.50, 1.50, 1.50), {}, r"worker 1 \(.*\)'s tensors rose"),                         # every rank builds a copy to load
    ((1.25, 0.59, 1.50, 0.59), {}, r"worker 2 \(.*\)'s tensors rose"),                         # one rank does
    ((1.25, 0.59, None, 0.59), {}, r"worker 2 \(.*\): the check saw no forward pass"),
    ((1.25, 0.59, 0.59, 0.59), {"to_empty_devices": [None]}, r"to_empty\(device=None\)")])
def test_a_rank_holding_or_allocating_the_whole_model_fails(fractions, facts, message):
    with pytest.raises(AssertionError, match=message):
        cap.check_built_on_meta(_run(*fractions, **facts), MODEL)


def test_the_grader_also_bounds_rank_0_to_one_whole_copy():
    with pytest.raises(AssertionError, match="second whole copy"):
        scale07.built_on_meta({"run": _run(2.1, 0.59, 0.59, 0.59)})
    assert scale07.RANK0_CONSTRUCTION_BOUND * MODEL > 1.25 * MODEL
