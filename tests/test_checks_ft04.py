"""Module 04's checks outside the kernel (autograder/checks/ft04.py), on data made here: the reference answers and
the mistakes of tests/mistakes/04_fault_tolerance.py for the exercises whose objects are only described (the
RunConfig, the Tuner), the reference run the grader trains itself, and the reference functions it sends."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import tempfile
from pathlib import Path

import pytest

from autograder.checks import ft04, judge
from coursekit.evidence import plain
from coursekit.exercise_checks import fault_tolerance as ft

MODULE = "04_fault_tolerance"
MISTAKES = Path(__file__).parent / "mistakes" / f"{MODULE}.py"


def _answers():
    spec = importlib.util.spec_from_file_location("mistakes_04", MISTAKES)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _define(code: str) -> dict:
    """An answer cell's code run with the notebook's names it uses."""
    import os
    from pathlib import Path

    import ray
    import ray.train
    from ray import tune
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.tune.schedulers import ASHAScheduler

    space = dict(os=os, Path=Path, ray=ray, tune=tune, RunConfig=RunConfig, FailureConfig=FailureConfig,
                 CheckpointConfig=CheckpointConfig, ASHAScheduler=ASHAScheduler)
    exec(code, space)
    return space


def _reference(gid: str) -> str:
    from autograder.samples import solution_answers

    return solution_answers(MODULE)[gid]


def _run_config_data(make_run_config, cases) -> dict:
    configs = []
    for case in cases:
        with tempfile.TemporaryDirectory() as d:
            name, retries, keep, metric, mode = case[:5]
            storage = case[5] if len(case) > 5 else d     # a URI where the case names one, as the test cell
            try:
                rc = make_run_config(name, storage, max_retries=retries, keep=keep, metric=metric, mode=mode)
                configs.append({"case": list(case), "value": ft.describe_run_config(rc, storage), "error": None})
            except Exception as e:  # noqa: BLE001
                configs.append({"case": list(case), "value": None, "error": f"{type(e).__name__}: {e}"})
    return json.loads(json.dumps(plain({"configs": configs})))


RUN_CONFIG_VISIBLE = {"test_make_run_config_failures": [["demo", 2, 4, "accuracy", "max"],
                                                        ["demo", None, 4, "accuracy", "max"]],
                      "test_make_run_config_keep": [["demo", 2, 3, None, "max"]],
                      "test_make_run_config_score": [["demo", 2, 2, "error_rate", "min"]]}


def _run_config_verdicts(code: str) -> dict:
    make = _define(code)["make_run_config"]
    return {gid: judge(MODULE, gid, _run_config_data(make, [*visible, *ft04.ASKED[gid]]))[0]
            for gid, visible in RUN_CONFIG_VISIBLE.items()}


def _cases():
    mod = _answers()
    return mod, [mod.WRONG, *mod.MORE_WRONG]


def _tuner_data(build_tuner, cases) -> dict:
    def never_run(config):
        pass

    tuners = []
    for case in cases:
        num_samples, max_epochs, min_epochs, lr_range, batch_sizes, name = case[:6]
        with tempfile.TemporaryDirectory() as d, contextlib.chdir(d):   # (as the test cell: a mangled URI lands there)
            storage = case[7] if len(case) > 7 else d
            try:
                tuner = build_tuner(never_run, num_samples=num_samples, max_epochs=max_epochs, min_epochs=min_epochs,
                                    lr_range=tuple(lr_range), storage_path=storage, name=name,
                                    batch_sizes=tuple(batch_sizes) if case[6:7] == [True] else list(batch_sizes))
                tuners.append({"case": list(case), "value": ft.describe_tuner(tuner, never_run, storage),
                               "error": None})
            except Exception as e:  # noqa: BLE001
                tuners.append({"case": list(case), "value": None, "error": f"{type(e).__name__}: {e}"})
    return json.loads(json.dumps(plain({"tuners": tuners})))


def _tuner_verdicts(code: str) -> dict:
    build = _define(code)["build_tuner"]
    return {gid: judge(MODULE, gid, _tuner_data(build, [ft04.VISIBLE_TUNER, *ft04.ASKED[gid]]))[0]
            for gid in ("test_build_tuner_search", "test_build_tuner_asha")}


@pytest.mark.parametrize("exercise, verdicts", [("make_run_config", _run_config_verdicts),
                                               ("build_tuner", _tuner_verdicts)])
def test_reference_and_right_pass_and_each_mistake_loses_its_cells(exercise, verdicts):
    mod, wrongs = _cases()
    assert all(verdicts(_reference(exercise)).values())
    assert all(verdicts(mod.RIGHT[exercise]).values())
    for wrong in wrongs:
        if exercise not in wrong:
            continue
        code, keeps = wrong[exercise]
        got = verdicts(code)
        assert {gid for gid, passed in got.items() if passed} == set(keeps), (code, got)


def test_verbosity_fit_refuses_fails_the_search():
    """verbose is not graded, except a level Tune's fit() raises ValueError for (its levels are 0 to 3)."""
    mod, _ = _cases()
    for verbose, passes in [("0", True), ("1", True), ("None", True), ("-1", False), ("4", False)]:
        code = _tuner(mod, f"tune.RunConfig(name=name, storage_path=storage_path, verbose={verbose})")
        got = _tuner_verdicts(code)
        assert got["test_build_tuner_search"] is passes and got["test_build_tuner_asha"], (verbose, got)


def _tuner(mod, run_config: str) -> str:
    return mod._tuner(run_config=run_config)


def test_storage_uri_kept_as_given():
    """A storage URI passed on as given passes; made absolute with os.path, or through Path, it is a local folder."""
    mod, _ = _cases()
    for storage, passes in [("storage_path", True), ("os.path.abspath(storage_path)", False),
                            ("str(Path(storage_path))", False)]:
        got = _tuner_verdicts(_tuner(mod, f"tune.RunConfig(name=name, storage_path={storage})"))
        assert got["test_build_tuner_search"] is passes, (storage, got)
        got = _run_config_verdicts(mod._run_config().replace("storage_path=storage_path",
                                                              f"storage_path={storage}"))
        assert got["test_make_run_config_failures"] is passes and got["test_make_run_config_keep"], (storage, got)


def test_a_pickled_call_that_ran_fails_the_cpu_cell():
    ft.check_refuses_code([{"file": "state.pt", "ran": False, "error": "UnpicklingError: Weights only load failed"}])
    with pytest.raises(AssertionError, match="weights_only=True"):
        ft.check_refuses_code([{"file": "state.pt", "ran": False, "error": None},
                               {"file": "rng_rank_1.pt", "ran": True, "error": None}])


def test_nothing_handed_in_fails_every_cell_with_a_message():
    for gid in ft04.CHECKS:
        passed, message = judge(MODULE, gid, {})
        assert not passed and message, gid


def test_no_answer_is_sent_to_the_kernel():
    """What the grader asks the test cells to run is inputs only: code in the kernel can read it (COURSE_ASKED)."""
    from autograder.checks import asked
    from autograder.checks.ft04_reference import REFERENCE

    sent = json.dumps(asked(MODULE))
    for line in [*REFERENCE.splitlines(), *_reference("training_state").splitlines(), *_reference("resume").splitlines()]:
        line = line.strip()
        if len(line) > 12 and not line.startswith("#"):
            assert line not in sent, line
    for word in ("load_state_dict", "set_rng_state", "get_checkpoint", "as_directory", "def "):
        assert word not in sent, word


def test_marks_left_by_the_stand_in_are_checked_on_every_rank():
    """resume_state passes the marks the stand-in leaves and fails a resume that loses any of them."""
    import torch

    from coursekit.models import build_model

    def entry(rank, weight=ft04.MARK_WEIGHT, lr=ft04.MARK_LR, seed=None, model=True, files=None):
        net = build_model("small_cnn")
        with torch.no_grad():
            for p in net.parameters():
                p.fill_(weight)
        checkpoint = {"state.pt": b"x", "rng_rank_0.pt": b"y"}
        return {"rank": rank, "finished": 0, "cloud": False, "start": 1, "error": None,
                "checkpoint": ft.files_data(checkpoint),
                "loads": [{"files": ft.files_data(checkpoint if files is None else files), "model": model,
                           "optimizer": True}],
                "weights": net.state_dict(), "lr": [lr],
                "rng": torch.Generator().manual_seed(ft04.MARK_SEED + rank if seed is None else seed).get_state()}

    def verdict(**changed):
        ranks = [entry(0), entry(3, **changed)]
        data = json.loads(json.dumps(plain({"calls": {"count": 1, "model": True, "optimizer": True},
                                            "resumed": ranks})))
        return judge(MODULE, "test_resume_state", data)

    assert verdict()[0], verdict()[1]
    for changed, words in [({"weight": 0.25}, "weights"), ({"lr": 5e-3}, "optimizer"), ({"seed": 1000}, "stream"),
                           ({"model": False}, "optimizer"), ({"files": {"state.pt": b"x"}}, "files")]:
        passed, message = verdict(**changed)
        assert not passed and words in message and message.startswith("rank 3"), (changed, message)


@pytest.mark.slow
def test_the_grader_trains_the_reference_run_itself():
    """3 epochs on 4 ranks (2 nodes x 2) from the notebook's own train_func and the reference functions."""
    from autograder.checks import ft04_reference as ref

    run = ref.uninterrupted()
    assert [[r.epoch for r in rank] for rank in run] == [[0, 1, 2]] * 4
    state = ref.saved_state(0)
    assert state["epoch"] == 0 and sorted(state["model"]) == sorted(ref.final_weights())
    assert not ref.saved_rng(0, 0).equal(ref.saved_rng(0, 1))       # every rank its own stream
