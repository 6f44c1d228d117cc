"""Module 01's code exercises, judged outside the kernel: the runs each test cell handed in, checked with the
visible checks (``coursekit.exercise_checks.ddp``, the functions the notebook calls) on the layouts the notebook
shows, and on the hidden layouts that only the grader knows (``ASKED``: the test cells run them because the grader
asks, ``coursekit.evidence.asked``). The references (one process's steps, the trained weights, the sampler's
orders) are computed here, never taken from the kernel."""
from __future__ import annotations

import base64

from autograder.checks.references import reference_steps
from coursekit.evidence import tensor
from coursekit.exercise_checks import ddp

# the layouts of each test cell: (world size, nodes, cases) for sharded_epochs, (world size, nodes, seed, steps,
# global batch, lr, momentum) for train_step, (world size, nodes) for save_checkpoint
VISIBLE_SHARDS = (2, 1, [[10, 2, 2, 0]])       # 10 examples over 2 ranks: 5 each, batches [2, 2, 1]; 2 epochs
VISIBLE_GLOBAL = (4, 2, [[12, 2, 1, 0]])
VISIBLE_STEPS = (2, 1, 0, 2, 8, 0.1, 0.0)
HIDDEN_SHARDS = [(2, 1, [[13, 3, 3, 3]]),      # 13 over 2 ranks: 7 each (1 padded), batches [3, 3, 1]; seed 3
                 (1, 1, [[7, 3, 3, 5]])]       # one process reads all 7, batches [3, 3, 1]; seed 5
HIDDEN_GLOBAL = [(4, 2, [[10, 3, 1, 0]])]      # 10 over 4 ranks: 3 each, 2 of them padded
HIDDEN_STEPS = {"4 processes on 2 nodes, SGD with momentum": (4, 2, 1, 3, 16, 0.05, 0.9),
                "1 process, SGD with momentum": (1, 1, 2, 2, 6, 0.05, 0.9)}
SAVES = [(2, 1), (4, 2), (1, 1)]              # the first is the notebook's own

ASKED = {"test_sharded_epochs_shards": [list(x) for x in HIDDEN_SHARDS],
         "test_sharded_epochs_global_rank": [list(x) for x in HIDDEN_GLOBAL],
         "test_sharded_epochs_order": [list(x) for x in HIDDEN_SHARDS],
         "test_train_step_weights": [list(x) for x in HIDDEN_STEPS.values()],
         "test_train_step_loss": [list(x) for x in HIDDEN_STEPS.values()],
         "test_save_checkpoint_contents": [list(x) for x in SAVES[1:]],
         "test_save_checkpoint_rank0": [list(x) for x in SAVES[1:]],
         "test_save_checkpoint_barrier": [list(x) for x in SAVES[1:]]}


def _run(data: dict | None, layout: list, what: str):
    """The handed-in run of ``layout`` (its value), or AssertionError: it failed, or it was not handed in."""
    for entry in (data or {}).get("runs", []):
        if entry.get("layout") == layout:
            if entry.get("error"):
                raise AssertionError(f"{what} failed on {layout[0]} process(es) on {layout[1]} node(s); the error:\n"
                                     f"{str(entry['error'])[-1500:]}")
            return entry
    raise AssertionError(f"the test cell handed in no run of {what} on {layout[0]} process(es) on {layout[1]} "
                         "node(s): run its cells in order, without errors, up to the end of the test cell")


def _shards(data, world_size, nodes, cases):
    return _run(data, [world_size, nodes, cases], "sharded_epochs")["value"]


def sharded_epochs_shards(data):
    for ws, nodes, cases in [VISIBLE_SHARDS, *HIDDEN_SHARDS]:
        ddp.check_shards(_shards(data, ws, nodes, cases), ws, cases)
    return "disjoint shards covering the data on 2 processes and 1, in batches of batch_size"


def sharded_epochs_global_rank(data):
    for ws, nodes, cases in [VISIBLE_GLOBAL, *HIDDEN_GLOBAL]:
        ddp.check_global_rank(_shards(data, ws, nodes, cases), cases)
    return "the shard of each process's global rank on 2 nodes x 2"


def sharded_epochs_order(data):
    ddp.check_new_order_every_epoch(_shards(data, *VISIBLE_SHARDS))
    for ws, nodes, cases in HIDDEN_SHARDS:
        ddp.check_order(_shards(data, ws, nodes, cases), ws, cases)
    return "every epoch in DistributedSampler's order for the seed given"


def _steps(data, layout):
    """(per rank: state dict, returned values) of a handed-in train_step run, and one process's (weights, losses)."""
    ws, nodes, seed, steps, global_batch, lr, momentum = layout
    ranks = _run(data, list(layout), "train_step")["value"]
    assert isinstance(ranks, list) and len(ranks) == ws, f"{len(ranks or [])} ranks handed in, expected {ws}"
    state0, batches = ddp.step_inputs(seed, steps, global_batch)
    expected = reference_steps(state0, batches, lr=lr, momentum=momentum)
    states = [{k: tensor(v) for k, v in state.items()} for state, _ in ranks]
    return states, [returned for _, returned in ranks], expected


def train_step_weights(data):
    for where, layout in {"2 processes": VISIBLE_STEPS, **HIDDEN_STEPS}.items():
        states, _, (expected_state, _) = _steps(data, layout)
        ddp.check_weights(where, states, expected_state)
    return "the weights of one process on the whole batches, on 2 processes, 2 nodes x 2 and 1"


def train_step_loss(data):
    for where, layout in {"2 processes": VISIBLE_STEPS, **HIDDEN_STEPS}.items():
        _, returned, (_, expected_losses) = _steps(data, layout)
        ddp.check_losses(where, returned, expected_losses)
    return "the loss over all ranks, as a float, on 2 processes, 2 nodes x 2 and 1"


def train_step_device(data):
    assert data is not None and "seen" in data, "the test cell handed in nothing: run it to its end"
    ddp.check_device([(name, devices) for name, devices in data["seen"]], data.get("error"))
    return "the loss is all-reduced on the device it was computed on"


def _saves(data):
    for ws, nodes in SAVES:
        entry = _run(data, [ws, nodes], "save_checkpoint")
        checkpoint = base64.b64decode(entry["checkpoint"]) if entry.get("checkpoint") else None
        yield ws, ddp.where_of(ws, nodes), entry.get("files", []), entry.get("logs", []), entry.get("crash"), checkpoint


def save_checkpoint_contents(data):
    for _, where, files, logs, crash, checkpoint in _saves(data):
        ddp.check_contents(where, files, logs, crash, checkpoint)
    return "the checkpoint loads into a plain model and its optimizer, on 2 processes, 2 nodes x 2 and 1"


def save_checkpoint_rank0(data):
    for _, where, files, logs, crash, _ in _saves(data):
        ddp.check_writers(where, files, logs, crash)
    return "global rank 0 alone writes, on 2 processes, 2 nodes x 2 and 1"


def save_checkpoint_barrier(data):
    for ws, where, _, logs, crash, _ in _saves(data):
        ddp.check_waited(where, ws, logs, crash)
    return "every rank waits for the complete checkpoint, on 2 processes, 2 nodes x 2 and 1"


CHECKS = {f"test_{f.__name__}": f for f in (
    sharded_epochs_shards, sharded_epochs_global_rank, sharded_epochs_order, train_step_weights, train_step_loss,
    train_step_device, save_checkpoint_contents, save_checkpoint_rank0, save_checkpoint_barrier)}
