"""Module 06's visible checks on plain data: what a DeepSpeed engine took from your config (``build_engine``),
how far your engine's weights ended from the run they must reproduce and what ``train_micro_batches`` returned,
what every rank reported with its checkpoint (``save_and_report``) and what ``restore_checkpoint`` gave back.
The notebook calls them in your kernel; the grader calls the same functions on the data your test cells handed in
(with references it computes itself)."""
from __future__ import annotations

from coursekit.exercise_checks.ray_train import max_difference   # the largest |difference| of two state dicts

BUILD_CASE = dict(global_batch_size=24, micro_batch_size=6, lr=1e-2, stage=2)   # 24 = 6 x 2 micro-batches x 2 ranks
WORLD_SIZE = 2               # the ranks of the checks of Exercises 1, 2 and 4 (Exercise 3: 4, as 2 nodes x 2)
SAME_RUN = 1e-4              # train_micro_batches: weights within this of DDP's run, relative to the distance moved
LOSS_TOLERANCE = 1e-5        # train_micro_batches: the mean loss returned, absolute (fp32 engines)
REPORT_METRICS = {"epoch": 4, "loss": 0.5}   # what save_and_report is given in the check
TAG = "checkpoint"           # the notebook's TAG: the tag save_and_report saves under
WEIGHT_DECAY = 0.01          # AdamW's default (torch.optim.AdamW), which DDP's run of the check uses
CLIPPING = 1.0               # DeepSpeed's default gradient clipping, which DDP's run of the check uses
# errors that say the code broke, not that the batch sizes do not agree (a NameError in the message, say)
_BROKEN = ("NameError", "UnboundLocalError", "TypeError", "AttributeError", "KeyError", "IndexError",
           "ZeroDivisionError")


def _optimizer(engine) -> dict:
    """The optimizer the engine steps (DeepSpeed's ``basic_optimizer``, inside its ZeRO or precision wrapper): its
    class, whether its weight decay is decoupled (AdamW's: torch's AdamW, or DeepSpeed's Adam kernels in AdamW
    mode) and its weight decay."""
    import torch

    optimizer = getattr(engine, "basic_optimizer", None)
    if optimizer is None:
        return {"optimizer": None, "decoupled": None, "weight_decay": None}
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay")) or bool(
        getattr(optimizer, "adam_w_mode", False) or getattr(optimizer, "adamw_mode", False))
    return {"optimizer": type(optimizer).__name__, "decoupled": decoupled, "weight_decay": group.get("weight_decay")}


def what_the_engine_took(engine) -> dict:
    """The settings a DeepSpeed engine runs with, as plain values."""
    device = getattr(engine.zero_offload_optimizer(), "device", None)
    device = getattr(device, "value", device)                         # an enum or its string
    return {"train_batch_size": engine.train_batch_size(), "micro": engine.train_micro_batch_size_per_gpu(),
            "accumulation": engine.gradient_accumulation_steps(), "stage": engine.zero_optimization_stage(),
            "offload": None if device in (None, "none") else device, "bf16": bool(engine.bfloat16_enabled()),
            "lr": engine.get_lr()[0], "clipping": engine.gradient_clipping(), **_optimizer(engine)}


def relative_difference(weights: dict, reference: dict, start: dict) -> float:
    """|weights - reference| / |reference - start| over all tensors: 0 for the same run, about 1 for another run."""
    num = sum(((weights[k].float() - reference[k].float()) ** 2).sum() for k in reference)
    den = sum(((reference[k].float() - start[k].float()) ** 2).sum() for k in reference)
    return (num / den).sqrt().item()


def check_took(took: dict, case: dict, world_size: int = WORLD_SIZE) -> None:
    """The engine runs the case's batch sizes, stage, learning rate, offload and precision."""
    assert isinstance(took, dict), f"build_engine(..., {case}) gave no engine: {took}"
    micro, total = case["micro_batch_size"], case["global_batch_size"]
    accumulation = total // (micro * world_size)
    split = f"{total} = {micro} (micro) x {accumulation} (accumulation) x {world_size} (ranks)"
    assert took["train_batch_size"] == total, (
        f"train_batch_size is the GLOBAL batch ({total}), not {took['train_batch_size']} ({split})")
    assert took["micro"] == micro, (
        f"train_micro_batch_size_per_gpu is one worker's micro batch ({micro}), not {took['micro']} ({split})")
    assert took["accumulation"] == accumulation, f"{split}: expected {accumulation}, not {took['accumulation']}"
    assert took["stage"] == case["stage"], (
        f"ZeRO stage {case['stage']} was asked, the engine runs stage {took['stage']}: pass your config to it")
    assert took["lr"] == case["lr"], f"the optimizer's learning rate must be lr={case['lr']}, not {took['lr']}"
    assert took.get("decoupled") and took.get("weight_decay") == WEIGHT_DECAY, (
        f"the optimizer is AdamW (decoupled weight decay, {WEIGHT_DECAY} by default, as in DDP's run); the engine "
        f"steps {took.get('optimizer')} with weight_decay={took.get('weight_decay')}"
        + ("" if took.get("decoupled") else " and no decoupled weight decay (Adam's L2 penalty instead)"))
    assert took.get("clipping") == CLIPPING, (
        f"gradient clipping stays at DeepSpeed's default, {CLIPPING} (DDP's run clips to it too), not "
        f"{took.get('clipping')}")
    if case.get("offload_optimizer"):
        assert took["offload"] == "cpu", (
            "offload_optimizer=True: put \"offload_optimizer\": {\"device\": \"cpu\"} in zero_optimization; the "
            f"engine took {took}")
    else:
        assert took["offload"] is None, f"no offload unless asked: {took}"
    if case.get("bf16"):
        assert took["bf16"], f"bf16=True: the config must enable bf16 (\"bf16\": {{\"enabled\": True}}); the engine took {took}"
    else:
        assert not took["bf16"], f"no bf16 unless asked: {took}"


def check_refused(entry: dict, case: dict, world_size: int = WORLD_SIZE) -> None:
    """``entry``: {"value", "error"} of build_engine on ``case``, whose global batch is not a multiple of the micro
    batch times the world size: no engine can run it, so build_engine raises (a ValueError of its own, or DeepSpeed's
    AssertionError on the batch sizes)."""
    total, micro = case["global_batch_size"], case["micro_batch_size"]
    what = f"global_batch_size={total} is not a multiple of micro_batch_size x world_size = {micro} x {world_size}"
    error = entry.get("error")
    assert error, (f"{what}: no whole number of accumulation steps makes them agree, so build_engine must raise (a "
                   f"ValueError); it built an engine that took {entry.get('value')}")
    kind = str(error).split(":", 1)[0].strip()
    assert kind not in _BROKEN, (f"{what}: build_engine raised {kind}, an error in the code itself ({error}); raise "
                                 "a ValueError that says the batch sizes do not agree")


def check_tag(latest, tag: str = TAG) -> None:
    """``latest``: the text of the checkpoint's ``latest`` file (the tag save_checkpoint saved under)."""
    assert isinstance(latest, str), "the checkpoint needs DeepSpeed's `latest` file (save_checkpoint writes it)"
    assert latest.strip() == tag, (f"save under the tag TAG ({tag!r}: save_checkpoint(directory, tag=TAG, ...)), not "
                                   f"{latest.strip()!r}")


def check_same_run(where: str, difference: float, steps: int, expected_steps: int = 2) -> None:
    """train_micro_batches through a DeepSpeed engine: the engine's optimizer steps, and its weights within SAME_RUN
    of DDP's run (relative to the distance they moved)."""
    assert steps == expected_steps, (
        f"{where}: {2 * expected_steps} micro-batches with 2 per optimizer step make {expected_steps} steps of the "
        f"engine, not {steps}: call engine.step() after every micro-batch")
    assert difference < SAME_RUN, (
        f"{where}: the weights differ from DDP's by {difference:.1%} of the distance they moved; expected the same run "
        "(forward, backward and step through the engine)")


def check_reports(reports: list) -> None:
    """Every rank reported once, the metrics it was given, with a checkpoint. ``reports[rank]``: that rank's reports,
    each {"metrics", "has_checkpoint", "files"}."""
    for rank, mine in enumerate(reports):
        assert len(mine) == 1, f"rank {rank} must call ray.train.report exactly once, not {len(mine)} times"
        assert mine[0]["metrics"] == REPORT_METRICS, f"rank {rank}: report the metrics you were given"
        assert mine[0]["has_checkpoint"], f"rank {rank} must report a checkpoint: every rank holds different partitions"


def check_next_epoch(next_epoch, saved_epoch: int) -> None:
    assert next_epoch == saved_epoch + 1, (
        f"return the epoch to continue from: the saved epoch ({saved_epoch}) + 1, not {next_epoch}")


def check_restored_weights(where: str, restored: dict, saved: dict) -> None:
    """The weights restore_checkpoint loaded are those saved, bit for bit."""
    assert set(restored) == set(saved) and max_difference(saved, restored) == 0, (
        f"{where}: the model's weights must be restored")


TRAINING_BOUND = 0.02        # build_engine trained 3 AdamW steps: within this of DDP's run (Adam's steps amplify rounding)
BF16_CASE = dict(stage=1, micro=6, accumulation=2, lr=1e-2, micro_batches=4)   # the bf16 engine of Exercise 2's check
BF16_LOSS = 1e-4             # bf16 engine: the mean loss, against the fp32 (here fp64) loss of its own bf16 logits
RESUME_SEED = 7              # Exercise 3's check: the other weights the 4 resuming ranks start from


def check_trained_like_ddp(where: str, difference: float, bound: float = TRAINING_BOUND) -> None:
    """Your engine, trained 3 optimizer steps, ends where DDP ends (AdamW at lr, clipping 1.0, accumulation)."""
    assert difference < bound, (
        f"{where}: after 3 optimizer steps your engine's weights differ from DDP's by {difference:.1%} of the distance "
        "they moved; expected the same run: AdamW at lr, DeepSpeed's default gradient clipping (1.0), the "
        "micro-batches of a step accumulated")


def check_mean_loss(where: str, mean_loss, mine: float, everyone: float, problems=(),
                    tolerance: float = LOSS_TOLERANCE) -> None:
    """train_micro_batches returns the mean of this rank's micro-batch losses (or of all ranks'), before
    engine.backward scales anything, and keeps it where a GPU worker can add it up (``problems``: what the device
    tracker saw)."""
    assert not problems, (f"{where}: on a GPU worker this would fail: {list(problems)[:2]}. Keep the running losses as "
                          "Python floats (.item()) or on engine.device")
    assert isinstance(mean_loss, (int, float)) and min(abs(mean_loss - mine), abs(mean_loss - everyone)) < tolerance, (
        f"{where}: return the mean of this rank's micro-batch losses ({mine:.5f}; the mean over all ranks, "
        f"{everyone:.5f}, is accepted too), not {mean_loss}; a loss computed in bf16, or taken after engine.backward "
        "scaled it, is off")


def check_restored_moments(where: str, restored: dict, saved: dict) -> None:
    """Adam's moments (this rank's partition) loaded back equal those saved, bit for bit."""
    assert len(restored) == len(saved) and set(restored) == set(saved) and max_difference(saved, restored) == 0, (
        f"{where}: its partition of Adam's moments must come back from the checkpoint (load_checkpoint loads the "
        "optimizer state unless told not to)")


def check_continues(where: str, loss: float, fresh_loss: float, after: dict, fresh_after: dict) -> None:
    """One more step from the restored engine equals one more step of the run that saved."""
    assert loss == fresh_loss and max_difference(after, fresh_after) == 0, (
        f"{where}: training must continue exactly where the saved run stopped (loss {fresh_loss} vs {loss})")


def check_client_epoch(where: str, client_state, epoch: int) -> None:
    """The client state that load_checkpoint returns carries the epoch saved with the checkpoint."""
    got = client_state.get("epoch") if isinstance(client_state, dict) else client_state
    assert got == epoch, (f"{where}: load_checkpoint must give back the epoch saved in the checkpoint's client state "
                          f"({epoch}), not {got!r}")
