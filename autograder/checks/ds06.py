"""Module 06's code exercises, judged outside the kernel: what each test cell handed in (the settings each engine
took, the full weights and returned losses of the engines your functions trained, what every rank reported with
its checkpoint, the weights and Adam moments saved and loaded back), checked with the visible checks
(``coursekit.exercise_checks.deepspeed``, the functions the notebook calls) and the hidden ones here, on the
notebook's cases and on the hidden ones the grader asks for (``ASKED``). The runs those engines must reproduce are
computed here (``ds06_references``), never taken from the kernel.

Tolerances and the spread measured (this machine, a 2-core x86-64): the kernel's ranks run on 1 thread each (as
run_distributed runs them); the grader's references are computed on 1 thread, and were measured also at torch
threads 2 and 4 and with MKL_CBWR=COMPATIBLE (another CPU's rounding path), each figure the largest over the ranks:

* Exercise 1, 3 optimizer steps of AdamW against one process standing in for DDP: TRAINING_BOUND = 0.02 of the
  distance moved (kept from the notebook's hidden test). Measured 8.8e-4 .. 1.8e-3 (DDP itself on 2 ranks: 7.7e-4 ..
  1.6e-3; Adam's normalised step turns last-bit differences of tiny gradients into whole steps).
* Exercise 2, 2 SGD steps: weights within SAME_RUN = 1e-4 of the distance moved (kept); measured 1.2e-7 .. 3.5e-7
  (ZeRO-2 and ZeRO-3 alike). Mean loss: LOSS_TOLERANCE = 1e-5 absolute (kept); measured 0 .. 1.2e-7.
* Exercise 2, bf16 engine against the same engine trained here: 1e-3 of the distance moved and 1e-4 on the loss
  (kept); measured 0 and 0 (the same DeepSpeed code on the same machine, its ranks on 1 thread), at every setting.
  The mistake it catches (the loss in bf16): 6.6e-2 and 5.1e-3.
* Exercises 3 and 4, the known engine's weights (as saved, and after Exercise 4's further step) against one process's
  AdamW steps: KNOWN_STEPS = 0.02 of the distance moved, Exercise 1's bound for the same kind of run (new: the saved
  state was the kernel's own before). Measured after 1 step 1.7e-7 (1 thread) .. 1.1e-3 (2 and 4 threads), after 2
  steps 3.5e-4 .. 1.2e-3. Anything that trains the engine further is about 1 away. What is loaded back must equal what
  was saved bit for bit, as before.
"""
from __future__ import annotations

from autograder.checks import ds06_references as refs
from coursekit.evidence import tensor
from coursekit.exercise_checks import deepspeed as ds

OFFLOADED = dict(global_batch_size=16, micro_batch_size=4, lr=1e-3, stage=3, offload_optimizer=True, bf16=True)
ONE_PASS = dict(global_batch_size=16, micro_batch_size=8, lr=3e-3, stage=1)     # 16 = 8 x 1 x 2: no accumulation
# offload at ZeRO-2 too (not only beside stage 3), in fp32: 32 = 4 x 4 x 2
OFFLOADED_ZERO2 = dict(global_batch_size=32, micro_batch_size=4, lr=5e-4, stage=2, offload_optimizer=True)
# 20 is no multiple of 6 x 2: build_engine raises (ds.check_refused) rather than build an engine of another batch
NOT_A_MULTIPLE = dict(global_batch_size=20, micro_batch_size=6, lr=1e-3, stage=1)
TRAINING = [ds.BUILD_CASE, 3]        # the notebook's case trained for 3 optimizer steps
TRAINING_BOUND = 0.02
BF16 = dict(stage=1, micro=6, accumulation=2, lr=1e-2, micro_batches=4)
BF16_BOUND, BF16_LOSS = 1e-3, 1e-4
RESUME_SEED = 7                      # the 4 new ranks' other weights
KNOWN_STEPS = 0.02                   # see the spread above

ASKED = {"test_build_engine": [OFFLOADED, ONE_PASS, OFFLOADED_ZERO2, NOT_A_MULTIPLE],
         "test_build_engine_training": [TRAINING],
         "test_train_micro_batches_bf16": [BF16],
         "test_save_and_report_resume": [RESUME_SEED],
         "test_save_and_report_epoch": [RESUME_SEED]}

NOTHING = "run its cells in order, without errors, up to the end of the test cell"


def _ranks(data: dict | None, what: str, world_size: int = ds.WORLD_SIZE, field: str = "ranks") -> list:
    """The handed-in per-rank results, or AssertionError: the run failed, or nothing was handed in."""
    data = data or {}
    if data.get("error"):
        raise AssertionError(f"{what} failed; the error:\n{str(data['error'])[-1500:]}")
    ranks = data.get(field)
    assert isinstance(ranks, list) and len(ranks) == world_size, (
        f"the test cell handed in {len(ranks) if isinstance(ranks, list) else 'no'} ranks' results of {what}, "
        f"expected {world_size}: {NOTHING}")
    return ranks


def _value(entry: dict, what: str):
    if entry.get("error"):
        raise AssertionError(f"{what} failed: {str(entry['error'])[-1500:]}")
    return entry["value"]


def _tensors(state: dict) -> dict:
    return {k: tensor(v) for k, v in state.items()}


# ---------------------------------------------------------------- Exercise 1: build_engine

def build_engine(data):
    ranks = _ranks(data, "build_engine on 2 ranks")
    cases = (data or {}).get("cases", [])
    for case in [ds.BUILD_CASE, OFFLOADED, ONE_PASS, OFFLOADED_ZERO2, NOT_A_MULTIPLE]:
        assert case in cases, f"the test cell handed in no engine built for {case}: {NOTHING}"
        i = cases.index(case)
        for rank, took in enumerate(ranks):
            assert isinstance(took, list) and len(took) == len(cases), f"rank {rank}: {len(took or [])} engines handed in"
            if case is NOT_A_MULTIPLE:
                ds.check_refused(took[i], case)
                continue
            ds.check_took(_value(took[i], f"rank {rank}: build_engine(..., {case})"), case)
    return ("the batch sizes, stage, AdamW at lr, clipping, offload (ZeRO-2 and 3) and bf16 of 4 configs taken by the "
            "engine on both ranks; a global batch that does not split refused")


def build_engine_training(data):
    ranks = _ranks(data, "building and training your engine on 2 ranks")
    trainings = (data or {}).get("trainings", [])
    assert TRAINING in trainings, f"the test cell handed in no training of your engine: {NOTHING}"
    i = trainings.index(TRAINING)
    case, steps = TRAINING
    took = (data or {}).get("took")
    assert isinstance(took, list) and len(took) == len(ranks), f"the test cell handed in no engine of {case}: {NOTHING}"
    for rank, entry in enumerate(took):    # as before: the engine is trained once it is the one asked for (cell above)
        try:
            ds.check_took(_value(entry, f"rank {rank}: build_engine(..., {case})"), case)
        except AssertionError as e:
            raise AssertionError(f"the engine of the cell above is not the one asked for ({e}): its training is "
                                 "graded once it is") from None
    start, reference, _ = refs.engine_training(case["global_batch_size"], case["micro_batch_size"], case["lr"], steps)
    for rank, trained in enumerate(ranks):
        weights = _tensors(_value(trained[i], f"rank {rank}: your engine of {case} trained"))
        difference = ds.relative_difference(weights, reference, start)
        assert difference < TRAINING_BOUND, (
            f"rank {rank}: after 3 optimizer steps your engine's weights differ from DDP's by {difference:.1%} of the "
            "distance they moved; expected the same run: AdamW at lr, default gradient clipping (1.0), the "
            "micro-batches of a step accumulated")
    return "3 optimizer steps of your ZeRO-2 engine end where DDP ends"


# ---------------------------------------------------------------- Exercise 2: train_micro_batches

def _stage_runs(data, stage: int) -> list:
    """Per rank, the handed-in run of ZeRO-`stage` (a dict)."""
    out = []
    for rank, runs in enumerate(_ranks(data, "train_micro_batches on 2 ranks")):
        run = next((r for r in runs if r.get("stage") == stage), None)
        assert run is not None, f"rank {rank}: the test cell handed in no ZeRO-{stage} run: {NOTHING}"
        out.append(run)
    return out


def _same_run(data, stage: int) -> str:
    start, reference, _ = refs.micro_batches_sgd()
    for rank, run in enumerate(_stage_runs(data, stage)):
        difference = ds.relative_difference(_tensors(run["weights"]), reference, start)
        where = f"rank {rank}, ZeRO-{stage}"
        if stage == 3 and run["steps"] == 2 and difference >= ds.SAME_RUN:
            raise AssertionError(
                f"{where}: {run['steps']} optimizer steps, weights {difference:.1%} away from DDP's; expected the same "
                "run: the forward pass through the engine itself (engine(images): it gathers the parameters), then "
                "engine.backward and engine.step")
        ds.check_same_run(where, difference, run["steps"])
    return f"ZeRO-{stage}: 2 optimizer steps, the weights of DDP's run on both ranks"


def train_micro_batches(data):
    return _same_run(data, 2)


def train_micro_batches_zero3(data):
    return _same_run(data, 3)


def train_micro_batches_loss(data):
    _, _, losses = refs.micro_batches_sgd()
    expected = [sum(mine) / len(mine) for mine in losses]
    everyone = sum(expected) / len(expected)                 # the mean over all ranks
    for stage in (2, 3):
        for rank, run in enumerate(_stage_runs(data, stage)):
            problems, mean_loss = run["problems"], run["mean_loss"]
            assert not problems, (
                f"rank {rank}, ZeRO-{stage}: on a GPU worker this would fail: {problems[:2]}. Keep the running losses "
                "as Python floats (.item()) or on engine.device")
            assert isinstance(mean_loss, (int, float)) and \
                min(abs(mean_loss - expected[rank]), abs(mean_loss - everyone)) < ds.LOSS_TOLERANCE, (
                f"rank {rank}, ZeRO-{stage}: return the mean of this rank's micro-batch losses ({expected[rank]:.5f}; "
                f"the mean over all ranks, {everyone:.5f}, is accepted too), not {mean_loss} (is it the loss after "
                "engine.backward divided it by the accumulation steps?)")
    return "the mean loss of each rank's micro-batches, where a GPU worker keeps it, at ZeRO-2 and ZeRO-3"


def train_micro_batches_bf16(data):
    runs = [r for r in (data or {}).get("runs", []) if r.get("spec") == BF16]
    assert runs, f"the test cell handed in no run of the bf16 engine: {NOTHING}"
    ranks = _ranks(runs[0], "train_micro_batches on 2 ranks with a bf16 engine (its images are bf16, like its "
                   "weights)", field="value")
    reference = refs.bf16_reference(BF16)
    start = {k: v.float() for k, v in refs.tiny_vit().state_dict().items()}
    expected = [sum(losses) / len(losses) for _, losses in reference]
    everyone = sum(expected) / len(expected)
    for rank, run in enumerate(ranks):
        mean_loss = run["mean_loss"]
        assert isinstance(mean_loss, (int, float)) and \
            min(abs(mean_loss - expected[rank]), abs(mean_loss - everyone)) < BF16_LOSS, (
            f"rank {rank}, bf16 engine: return the mean of the losses computed in fp32 ({expected[rank]:.5f}), not "
            f"{mean_loss}: under bf16 the logits are bf16; call .float() on them before the loss, or the loss keeps "
            "about 3 significant digits")
        difference = ds.relative_difference(_tensors(run["weights"]), reference[rank][0], start)
        assert difference < BF16_BOUND, (
            f"rank {rank}, bf16 engine: the weights differ by {difference:.1%} of the distance they moved from those of "
            "the same engine trained with the loss computed in fp32 (.float() on the logits before cross_entropy)")
    return "a bf16 engine trained with the loss in fp32: its weights and mean loss"


# ---------------------------------------------------------------- Exercise 3: save_and_report

def save_and_report(data):
    reports = _ranks(data, "save_and_report on 4 ranks (2 nodes x 2 workers)", world_size=4, field="reports")
    ds.check_reports(reports)
    latest = (data or {}).get("latest")
    ds.check_tag(latest)
    tag = latest.strip()
    for rank, mine in enumerate(reports):
        assert f"{tag}/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in mine[0]["files"], (
            f"rank {rank}'s reported checkpoint must hold its own optimizer partition: call engine.save_checkpoint on "
            "every rank into the directory you report, with the same tag on all ranks")
    assert f"{tag}/mp_rank_00_model_states.pt" in reports[0][0]["files"], (
        f"rank 0's reported checkpoint must hold the model states {tag}/mp_rank_00_model_states.pt")
    return ("every rank reports once, with its own partition of the checkpoint under the tag TAG; rank 0's holds the "
            "model states")


def _check_known_step(where: str, params: dict, world_size: int, steps: int = 1):
    """The known engine's weights, as the kernel's run handed them in, against one process's run here."""
    start, reference, _ = refs.known_steps(world_size, steps)
    difference = ds.relative_difference(params, reference, start)
    assert difference < KNOWN_STEPS, (
        f"{where}: the known engine's weights after {steps} step(s) differ from the expected run by {difference:.1e} "
        "of the distance they moved: something changed the engine while saving or restoring")


def _resume_run(data, seed):
    run = next((r for r in (data or {}).get("runs", []) if r.get("seed") == seed), None)
    assert run is not None, f"the test cell handed in no resume of the checkpoint: {NOTHING}"
    return run


def save_and_report_resume(data):
    saved = (data or {}).get("saved")
    assert isinstance(saved, list) and len(saved) == 4, (
        "4 new ranks could not resume from the merged checkpoint: it was not saved (the cell above says why)")
    loaded = _ranks(_resume_run(data, RESUME_SEED), "4 new ranks resuming from the merged checkpoint (every rank's "
                    "files are needed)", world_size=4)
    for rank, (mine, back) in enumerate(zip(saved, loaded)):
        saved_params, saved_moments = _tensors(mine["params"]), _tensors(mine["moments"])
        params, moments = _tensors(back["params"]), _tensors(back["moments"])
        _check_known_step(f"rank {rank}", saved_params, 4)
        assert set(params) == set(saved_params) and ds.max_difference(saved_params, params) == 0, (
            f"rank {rank}: the weights must come back from the checkpoint")
        assert len(moments) == len(saved_moments) and set(moments) == set(saved_moments) and \
            ds.max_difference(saved_moments, moments) == 0, (
            f"rank {rank}: its partition of Adam's moments must come back from the checkpoint")
    return "4 new ranks resume the weights and every partition of Adam's moments"


def save_and_report_epoch(data):
    run = _resume_run(data, RESUME_SEED)
    states = _ranks(run, "4 new ranks resuming from the merged checkpoint (the cell above says why)", world_size=4,
                    field="client_states")
    for rank, client_state in enumerate(states):
        assert isinstance(client_state, dict) and client_state.get("epoch") == ds.REPORT_METRICS["epoch"], (
            f"rank {rank}: save the epoch in client_state={{'epoch': metrics['epoch']}}; the checkpoint holds "
            f"{client_state}")
    return "the epoch saved in the client state comes back on every rank"


# ---------------------------------------------------------------- Exercise 4: restore_checkpoint

def _restored(data):
    ranks = _ranks(data, "restoring on 2 ranks (every rank loads its own partition; the checkpoint of epoch 0 is in "
                   "cloud storage, where checkpoint.path is no local folder: open it with checkpoint.as_directory())")
    for rank, runs in enumerate(ranks):
        assert sorted((r.get("epoch"), bool(r.get("cloud"))) for r in runs) == [(0, True), (2, False)], (
            f"rank {rank}: restores of epoch 2 (a local folder) and epoch 0 (cloud storage) expected: {NOTHING}")
    return ranks


def restore_checkpoint(data):
    for rank, runs in enumerate(_restored(data)):
        for run in runs:
            epoch = run["epoch"]
            assert run["next_epoch"] == epoch + 1, (
                f"rank {rank}: saved at epoch {epoch}, continue at {epoch + 1}, not {run['next_epoch']}")
            params = _tensors(run["params"])
            _check_known_step(f"rank {rank}", params, 2)
            ds.check_restored_weights(f"rank {rank}", _tensors(run["fresh_params"]), params)
    return "the next epoch and the weights, on both ranks, for checkpoints of epochs 2 (a local folder) and 0 (cloud storage)"


def restore_checkpoint_optimizer(data):
    for rank, runs in enumerate(_restored(data)):
        for run in runs:
            moments, fresh_moments = _tensors(run["moments"]), _tensors(run["fresh_moments"])
            assert len(fresh_moments) == len(moments) and set(fresh_moments) == set(moments) and \
                ds.max_difference(fresh_moments, moments) == 0, (
                f"rank {rank}: restore the optimizer state too (Adam's moments): load_checkpoint loads it unless told "
                "not to")
            after = _tensors(run["after"])
            _check_known_step(f"rank {rank}", after, 2, steps=2)
            assert run["loss"] == run["fresh_loss"] and ds.max_difference(_tensors(run["fresh_after"]), after) == 0, (
                f"rank {rank}: training must continue exactly where the saved run stopped (loss {run['fresh_loss']} "
                f"vs {run['loss']})")
    return "Adam's moments restored on both ranks; one more step continues the saved run exactly"


# the references, computed once before the jobs that need them where the grader does so (autograder.checks.prepare)
PREPARE = (lambda: refs.engine_training(TRAINING[0]["global_batch_size"], TRAINING[0]["micro_batch_size"],
                                        TRAINING[0]["lr"], TRAINING[1]),
           refs.micro_batches_sgd, lambda: refs.known_steps(4), lambda: refs.known_steps(2),
           lambda: refs.known_steps(2, 2), lambda: refs.bf16_reference(BF16))

CHECKS = {f"test_{f.__name__}": f for f in (
    build_engine, build_engine_training, train_micro_batches, train_micro_batches_zero3, train_micro_batches_loss,
    train_micro_batches_bf16, save_and_report, save_and_report_resume, save_and_report_epoch, restore_checkpoint,
    restore_checkpoint_optimizer)}
