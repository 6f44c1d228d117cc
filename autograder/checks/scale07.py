"""Module 07's capstone (``train_func``: the script ported to FSDP2 under Ray Train), judged outside the kernel.

Each test cell hands in what it saw of a run of the student's ``train_func`` (``describe`` in the notebook: every
rank's reports, checkpoint files by size, what the probe saw, the final weights, the checkpoints read back by one
process). Here they are checked with the visible checks (``coursekit.exercise_checks.capstone``) and the hidden ones
below, against the script on one process computed here (``references.reference_capstone``), never in the kernel.
The hidden case (``ASKED``): one worker with other settings.
"""
from __future__ import annotations

import ast
import math

from autograder.checks.references import digitnet_params, reference_capstone
from coursekit.evidence import tensor
from coursekit.exercise_checks import capstone as cap

BUDGET = 900_000        # the notebook's MEMORY_BUDGET: bytes of model state one worker may hold
WORLD_SIZE = 4          # 2 nodes x 2
CHECK = {"width": 64, "depth": 3, "hidden": 256, "train_samples": 104, "batch_size": 24, "epochs": 2, "lr": 3e-3,
         "weight_decay": 0.05, "seed": 0, "device": "cpu"}
ONE = {**CHECK, "width": 48, "hidden": 96, "train_samples": 72, "batch_size": 16, "lr": 2e-3, "weight_decay": 0.1,
       "seed": 3}   # a seed other than the default: the sampler's and the model's must come from the config
ASKED = {"test_train_func_one_worker": [ONE]}


def _weights(data) -> dict | None:
    return None if data is None else {name: tensor(value) for name, value in data.items()}


def _run(data: dict, config: dict = CHECK, field: str = "run", how: str = "as 4 workers on 2 nodes x 2") -> dict:
    """The described run the cell handed in for ``config``, weights made tensors again."""
    runs = data.get("runs", [data.get(field)]) if isinstance(data, dict) else []
    found = next((r for r in runs if isinstance(r, dict) and r.get("config") == config), None)
    assert found is not None, (f"the test cell handed in no run of train_func {how} with the check's settings: run "
                               "its cells in order, up to the end of the test cell")
    run = cap.ran(dict(found), how)
    run["weights"] = _weights(run.get("weights"))
    run["checkpoints"] = {epoch: dict(c, weights=_weights(c.get("weights")))
                          for epoch, c in (run.get("checkpoints") or {}).items()}
    return run


def matches_one_process(data):
    run = _run(data)
    diff = cap.check_matches(run, reference_capstone(CHECK)[1])
    for rank, result in enumerate(run["ranks"]):
        assert cap.epochs(result) == list(range(CHECK["epochs"])), \
            f"{cap.where(rank)} reported the epochs {cap.epochs(result)}: every worker reports once per epoch, from 0"
    return f"the weights within {diff:.1e} (relative) of the script's on one process"


def loss(data):
    run, losses = _run(data), reference_capstone(CHECK)[0]
    for rank, result in enumerate(run["ranks"]):
        assert len(result["reports"]) == len(losses), \
            f"{cap.where(rank)} reported {len(result['reports'])} times in {len(losses)} epochs"
        cap.check_losses(rank, result["reports"], losses)
    return f"every worker's loss, every epoch, within {cap.LOSS_TOLERANCE:.0e} of the script's"


def memory_budget(data):
    run = _run(data)
    cap.check_memory(run, BUDGET, 16 * digitnet_params(CHECK))
    for rank, result in enumerate(run["ranks"]):
        assert result["optimizer_holds_model"], (
            f"{cap.where(rank)}: the optimizer holds other tensors than the model's parameters: fully_shard replaces "
            "the parameters, so build AdamW after sharding, over net.parameters() (its state then is sharded too)")
    return f"at most {max(sum(r['memory'].values()) for r in run['ranks']):,} bytes of model state per worker"


# rank 0 holds the whole model once while it builds (the script's weights, to hand every rank its shards): measured
# 1.25 x the model for the reference (see capstone.CONSTRUCTION_BOUND); twice the model means a second whole copy
RANK0_CONSTRUCTION_BOUND = 1.6


def built_on_meta(data):
    run = _run(data)
    model_bytes = 4 * digitnet_params(CHECK)
    cap.check_built_on_meta(run, model_bytes)
    peak = run["ranks"][0]["construction_peak"]
    assert peak <= RANK0_CONSTRUCTION_BOUND * model_bytes, (
        f"{cap.where(0)}'s tensors rose by {peak:,} bytes before the first forward pass, {peak / model_bytes:.2f} x the "
        f"whole model: rank 0 builds the script's weights once to hand them out, and holds no second whole copy")
    others = max(r["construction_peak"] for r in run["ranks"][1:])
    return f"ranks 1-3 built with at most {others / model_bytes:.2f} x the whole model's bytes, rank 0 {peak / model_bytes:.2f} x"


def _calls(source, name: str):
    """The calls of ``name`` (``torch.device``, ``init_device_mesh``: by its last dotted part) in ``source``."""
    try:
        tree = ast.parse(source) if isinstance(source, str) else None
    except SyntaxError:
        return
    for node in ast.walk(tree) if tree else []:
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == name:
            yield node


def _pinned_to_the_cpu(source) -> str | None:
    """``torch.device("cpu")`` in train_func's source (the driver's device, not the worker's), or None."""
    for node in _calls(source, "device"):
        if node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("cpu"):
            return ast.unparse(node)
    return None


def _literal_mesh_device(source) -> str | None:
    for node in _calls(source, "init_device_mesh"):
        kind = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "device_type"), None)
        if isinstance(kind, ast.Constant):
            return ast.unparse(kind)
    return None


def layers_sharded(data):
    run = _run(data)
    cap.check_layers_sharded(run)
    for rank, result in enumerate(run["ranks"]):
        assert result["meshes"] == [["cpu", WORLD_SIZE]], (
            f"{cap.where(rank)}: the parameters are sharded over {result['meshes']} (device type, ranks): use a 1-D "
            f"mesh of all {WORLD_SIZE} ranks of the job, of the worker's device type")
    pinned = _pinned_to_the_cpu(data.get("source"))
    assert pinned is None, (f"train_func pins its device to the CPU ({pinned}): the workers' device comes from "
                            "ray.train.torch.get_device() (cuda:N on GPU workers), so the same code runs on both")
    literal = _literal_mesh_device(data.get("source"))
    assert literal is None, (f"the mesh's device type must come from the worker's device "
                             f"(ray.train.torch.get_device().type), not the literal {literal}: the same code runs on "
                             "CPU and GPU workers")
    return "every parameter sharded over all 4 ranks, one layer gathered at a time"


def _read(run: dict, epoch: int, who: str = "the run") -> dict:
    read = run["checkpoints"].get(str(epoch))
    assert read is not None, f"{who}: no checkpoint of epoch {epoch} was read back"
    assert not read.get("error"), read["error"]
    return read


def _check_checkpoints(run: dict, config: dict, world_size: int, per_node: int, who: str) -> None:
    """Every rank reports its own DCP shards every epoch; put together they are the run's model, sharded."""
    cap.check_reported_checkpoints(run, per_node)
    for rank, result in enumerate(run["ranks"]):
        written = max(sum(report["files"].values()) for report in result["reports"])
        assert written <= BUDGET, (
            f"{cap.where(rank, per_node)} wrote a checkpoint of {written:,} bytes, more than the budget: to write them "
            "it held them (a full state dict gathered on a rank). Every rank writes only its own shards")
    last = cap.epochs(run["ranks"][0])[-1]
    read = _read(run, last, who)
    assert read["epoch"] == last, f"{who}: the checkpoint reported with epoch {last} says epoch {read['epoch']!r}"
    saved = read["saved"]
    assert any(key.startswith("optimizer.") for key in saved), f"{who}: save the optimizer's state under 'optimizer' too"
    whole = sorted(key for key, item in saved.items() if key.startswith("model.") and item.get("size")
                   and item["size"][0] >= world_size and item["chunks"] < world_size)
    assert not whole, (f"{whole[:3]} are saved as whole tensors, not as {world_size} shards: every rank saves its own "
                       "shards (the sharded state dicts of get_state_dict), no rank gathers the whole model")
    diff = cap.max_difference(read["weights"], run["weights"])
    assert diff == 0, f"{who}: the last checkpoint's model differs from the weights the run ended with by {diff:.1e}"


def checkpoint(data):
    run = _run(data)
    _check_checkpoints(run, CHECK, WORLD_SIZE, cap.PER_NODE, "the run")
    first = _read(run, 0)["epoch"]
    assert first == 0, f"the checkpoint reported with epoch 0 says epoch {first!r}"
    return "every rank's own DCP shards every epoch, the model and the optimizer, read back whole"


def resume(data):
    resumed = _run(data, how="when Ray Train handed it its own checkpoint of epoch 0")
    cap.check_resumed_epochs(resumed, CHECK["epochs"])
    diff = cap.relative_difference(resumed["weights"], reference_capstone(CHECK)[1])
    assert diff < cap.WEIGHTS_RTOL, (
        f"resumed from epoch 0's checkpoint, the run ends {diff:.1e} away from the script's weights: on every rank, "
        "load the model and the optimizer (AdamW's moments) before training on")
    return f"resumed at epoch 1, ending within {diff:.1e} of the script"


def one_worker(data):
    for config in ASKED["test_train_func_one_worker"]:
        run = _run(data, config, how="on one worker (other settings)")
        (result,) = run["ranks"]
        epochs = cap.epochs(result)
        assert epochs == list(range(config["epochs"])), f"one worker reported the epochs {epochs}"
        for report in result["reports"]:
            metrics = report["metrics"]
            value = metrics.get("loss")
            assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), \
                f"one worker: report the loss as a finite number ({metrics})"
            assert report["files"], f"one worker: report a checkpoint every epoch ({metrics})"
        assert not result["alone"], result["alone"][0]
        read = _read(run, epochs[-1], "one worker")
        assert read["epoch"] == epochs[-1], f"one worker: the last checkpoint says epoch {read['epoch']!r}"
        diff = cap.max_difference(read["weights"], run["weights"])
        assert diff == 0, f"one worker: the last checkpoint's model differs from the run's weights by {diff:.1e}"
        losses, script = reference_capstone(config)       # values, not only properties: the script's run
        try:
            cap.check_matches(run, script)
            cap.check_losses(0, result["reports"], losses, per_node=1)
        except AssertionError as e:
            raise AssertionError(f"one worker with other settings (seed {config['seed']}, lr {config['lr']}, "
                                 f"{config['train_samples']} examples): {e}. Every setting comes from the config: "
                                 "the model's and the sampler's seed too") from None
    return "one worker (a group of one): every epoch reported with its checkpoint, the script's weights and losses"


CHECKS = {"test_train_func_matches_one_process": matches_one_process, "test_train_func_loss": loss,
          "test_train_func_memory_budget": memory_budget, "test_train_func_layers_sharded": layers_sharded,
          "test_train_func_built_on_meta": built_on_meta,
          "test_train_func_checkpoint": checkpoint, "test_train_func_resume": resume,
          "test_train_func_one_worker": one_worker}
# the cells whose checks here demand more than the notebook's visible ones (every one: the epochs of every rank, every
# rank's losses, the optimizer built after sharding, the mesh, rank 0's construction, the checkpoint read back, the
# resumed weights)
HIDDEN_CHECKS = set(CHECKS)
# what every submission's checks compare with, computed once by a warm worker before it forks the jobs
PREPARE = (lambda: reference_capstone(CHECK), lambda: reference_capstone(ONE))
