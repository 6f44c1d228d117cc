"""Module 06's checks outside the kernel (autograder/checks/ds06.py) on hand-made data: cheap, no DeepSpeed run."""
import nbformat
import pytest

from autograder.checks import ds06
from autograder.checks import ds06_references as refs
from autograder.paths import SOLUTIONS
from coursekit.evidence import plain
from coursekit.exercise_checks import deepspeed as ds

TOOK = {"train_batch_size": 24, "micro": 6, "accumulation": 2, "stage": 2, "offload": None, "bf16": False, "lr": 1e-2,
        "clipping": 1.0, "optimizer": "AdamW", "decoupled": True, "weight_decay": 0.01}


def test_every_code_cell_of_the_module_is_checked():
    nb = nbformat.read(SOLUTIONS / "06_deepspeed" / "06_deepspeed.ipynb", as_version=4)
    graded = {c.metadata["nbgrader"]["grade_id"] for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")}
    assert set(ds06.CHECKS) == {g for g in graded if not g.startswith("test_concept")}


def test_check_took_says_what_was_expected():
    ds.check_took(TOOK, ds.BUILD_CASE)
    with pytest.raises(AssertionError, match="GLOBAL batch"):
        ds.check_took({**TOOK, "train_batch_size": 12}, ds.BUILD_CASE)
    with pytest.raises(AssertionError, match="expected 2, not 1"):
        ds.check_took({**TOOK, "accumulation": 1}, ds.BUILD_CASE)
    with pytest.raises(AssertionError, match="offload_optimizer"):
        ds.check_took({**TOOK, "stage": 3, "micro": 4, "train_batch_size": 16, "bf16": True, "lr": 1e-3},
                      ds06.OFFLOADED)
    # a torch Adam handed to initialize: L2 penalty 0, not AdamW's decoupled 0.01 (3 steps of training stay within 2%)
    with pytest.raises(AssertionError, match="AdamW"):
        ds.check_took({**TOOK, "optimizer": "Adam", "decoupled": False, "weight_decay": 0}, ds.BUILD_CASE)
    with pytest.raises(AssertionError, match="AdamW"):
        ds.check_took({**TOOK, "weight_decay": 0.0}, ds.BUILD_CASE)
    with pytest.raises(AssertionError, match="clipping"):
        ds.check_took({**TOOK, "clipping": 0.0}, ds.BUILD_CASE)


def test_a_global_batch_that_does_not_split_is_refused():
    case = ds06.NOT_A_MULTIPLE
    ds.check_refused({"value": None, "error": "ValueError: the global batch 20 is not a multiple of 6 x 2"}, case)
    ds.check_refused({"value": None, "error": "AssertionError: Check batch related parameters."}, case)
    with pytest.raises(AssertionError, match="must raise"):
        ds.check_refused({"value": dict(TOOK), "error": None}, case)
    with pytest.raises(AssertionError, match="NameError"):
        ds.check_refused({"value": None, "error": "NameError: name 'local_world_size' is not defined"}, case)


def test_the_tag_is_checked():
    ds.check_tag("checkpoint\n")
    for latest, words in [(None, "latest"), ("global_step1", "TAG")]:
        with pytest.raises(AssertionError, match=words):
            ds.check_tag(latest)


def _took_data(cases, change=None, at=-1):
    took = [{"value": dict(TOOK), "error": None} for _ in cases]
    for i, case in enumerate(cases):
        if case is ds06.NOT_A_MULTIPLE:
            took[i] = {"value": None, "error": "ValueError: not a multiple"}
            continue
        micro = case["micro_batch_size"]
        took[i]["value"].update(train_batch_size=case["global_batch_size"], micro=micro, stage=case["stage"],
                                accumulation=case["global_batch_size"] // (micro * 2), lr=case["lr"],
                                offload="cpu" if case.get("offload_optimizer") else None, bf16=bool(case.get("bf16")))
    if change:
        took[at]["value"].update(change)
    return {"cases": cases, "error": None, "ranks": [took, took]}


def test_build_engine_judges_the_hidden_configs():
    cases = [ds.BUILD_CASE, *ds06.ASKED["test_build_engine"]]
    assert ds06.build_engine(_took_data(cases))
    with pytest.raises(AssertionError, match="lr=0.003"):
        ds06.build_engine(_took_data(cases, {"lr": 1e-3}, at=cases.index(ds06.ONE_PASS)))
    built = _took_data(cases)
    built["ranks"] = [[*took[:-1], {"value": dict(TOOK), "error": None}] for took in built["ranks"]]
    assert cases[-1] is ds06.NOT_A_MULTIPLE
    with pytest.raises(AssertionError, match="must raise"):
        ds06.build_engine(built)
    with pytest.raises(AssertionError, match="no engine built"):
        ds06.build_engine(_took_data(cases[:1]))
    with pytest.raises(AssertionError, match="failed"):
        ds06.build_engine({"error": "AssertionError: build_engine failed on 2 ranks"})


def _micro_data(shift=0.0, steps=2, loss_scale=1.0, problems=()):
    _, weights, losses = refs.micro_batches_sgd()
    ranks = []
    for rank in range(2):
        mean = sum(losses[rank]) / len(losses[rank]) * loss_scale
        ranks.append([{"stage": stage, "weights": plain({k: v + shift for k, v in weights.items()}), "steps": steps,
                       "mean_loss": mean, "problems": list(problems)} for stage in (2, 3)])
    return {"error": None, "ranks": ranks}


def test_train_micro_batches_against_the_graders_own_run():
    good = _micro_data()
    for check in (ds06.train_micro_batches, ds06.train_micro_batches_zero3, ds06.train_micro_batches_loss):
        assert check(good)
    with pytest.raises(AssertionError, match="differ from DDP's"):
        ds06.train_micro_batches(_micro_data(shift=1e-3))
    with pytest.raises(AssertionError, match="gathers the parameters"):
        ds06.train_micro_batches_zero3(_micro_data(shift=1e-3))
    with pytest.raises(AssertionError, match="make 2 steps of the engine, not 4"):
        ds06.train_micro_batches(_micro_data(steps=4))
    with pytest.raises(AssertionError, match="divided it by the accumulation"):
        ds06.train_micro_batches_loss(_micro_data(loss_scale=0.5))
    with pytest.raises(AssertionError, match="on a GPU worker"):
        ds06.train_micro_batches_loss(_micro_data(problems=["line 3 mixes"]))


def test_nothing_handed_in_fails_every_cell_with_a_message():
    for check in ds06.CHECKS.values():
        with pytest.raises(AssertionError, match="."):
            check(None)


def test_the_known_step_reference_is_checked():
    _, reference, _ = refs.known_steps(2)
    ds06._check_known_step("rank 0", reference, 2)
    with pytest.raises(AssertionError, match="known engine"):
        ds06._check_known_step("rank 0", {k: v + 1e-2 for k, v in reference.items()}, 2)


def test_the_visible_checks_of_training_loss_and_restore_say_what_was_expected():
    import torch

    ds.check_trained_like_ddp("rank 0", 1e-3)
    with pytest.raises(AssertionError, match="differ from DDP's"):
        ds.check_trained_like_ddp("rank 0", 0.5)
    ds.check_mean_loss("rank 0", 2.0, 2.0, 2.1)
    ds.check_mean_loss("rank 0", 2.1, 2.0, 2.1)                       # the mean over all ranks is accepted too
    with pytest.raises(AssertionError, match="mean of this rank's micro-batch losses"):
        ds.check_mean_loss("rank 0", 1.0, 2.0, 2.1)                   # after engine.backward scaled it by 1/2
    with pytest.raises(AssertionError, match="on a GPU worker this would fail"):
        ds.check_mean_loss("rank 0", 2.0, 2.0, 2.0, ["line 3 mixes a tensor"])
    with pytest.raises(AssertionError, match="mean of this rank's"):   # a bf16 loss: off in the third digit
        ds.check_mean_loss("bf16", 2.005, 2.0, 2.0, tolerance=ds.BF16_LOSS)
    moments = {"0.exp_avg": torch.ones(3)}
    ds.check_restored_moments("rank 0", {"0.exp_avg": torch.ones(3)}, moments)
    with pytest.raises(AssertionError, match="Adam's moments must come back"):
        ds.check_restored_moments("rank 0", {"0.exp_avg": torch.zeros(3)}, moments)
    ds.check_continues("rank 0", 1.5, 1.5, {"w": torch.ones(2)}, {"w": torch.ones(2)})
    with pytest.raises(AssertionError, match="continue exactly"):
        ds.check_continues("rank 0", 1.5, 1.6, {"w": torch.ones(2)}, {"w": torch.ones(2)})
    ds.check_client_epoch("rank 0", {"epoch": 4}, 4)
    with pytest.raises(AssertionError, match="epoch saved"):
        ds.check_client_epoch("rank 0", {"epoch": None}, 4)


def test_the_visible_cases_are_the_graders():
    assert ds.BF16_CASE == ds06.BF16 and ds.RESUME_SEED == ds06.RESUME_SEED
    assert ds.TRAINING_BOUND == ds06.TRAINING_BOUND and ds.BF16_LOSS == ds06.BF16_LOSS
