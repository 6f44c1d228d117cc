"""Module 04's checks on plain data: the files each rank wrote for a checkpoint (``save_training_state``), the
random stream each rank gets back from the merged folder and a GPU-written checkpoint read on a CPU
(``load_training_state``), the epoch ``resume`` returns and what it hands ``load_training_state``, the
``RunConfig`` of ``make_run_config`` and the ``Tuner`` of ``build_tuner`` described field by field.

The notebook's test cells call these functions in your kernel (what Validate shows); the grader calls the same
ones on the data the cells handed in, with its hidden checks."""
from __future__ import annotations

import base64

STATE_FILE = "state.pt"


# ---------------------------------------------------------------- plain data about files

def files_data(files: dict | None) -> dict:
    """A checkpoint's files ({name: bytes}) as plain data: {name: base64 text}."""
    return {name: base64.b64encode(content).decode() for name, content in (files or {}).items()}


def files_bytes(data: dict | None) -> dict:
    """The files that ``files_data`` made plain: {name: bytes}."""
    return {name: base64.b64decode(text) for name, text in (data or {}).items()}


# ---------------------------------------------------------------- save_training_state / load_training_state

def check_writers(written: dict) -> None:
    """``written``: {rank: [file names]} of the checkpoint of epoch 0 (4 ranks, 2 nodes x 2)."""
    written = {int(rank): list(names) for rank, names in written.items()}
    assert STATE_FILE in written.get(0, []), f"rank 0 writes {STATE_FILE} (it wrote {written.get(0)})"
    for rank in (1, 2, 3):
        assert STATE_FILE not in written.get(rank, []), \
            f"rank {rank} wrote {STATE_FILE} too: under DDP only rank 0 writes the model and the optimizer"


def check_one_folder(files_by_rank: list) -> None:
    """``files_by_rank[rank]``: {name: bytes} that rank wrote for one checkpoint. Ray Train merges them into one
    folder: no two ranks may write one file name with different contents."""
    merged, writer = {}, {}
    for rank, files in enumerate(files_by_rank):
        for name, content in (files or {}).items():
            assert name not in merged or merged[name] == content, (
                f"ranks {writer[name]} and {rank} both wrote {name!r}, with different contents: in the "
                "checkpoint folder one overwrites the other")
            merged[name], writer[name] = content, rank


def check_rng(rank: int, restored, saved) -> None:
    """``restored``: rank ``rank``'s generator state after load_training_state; ``saved``: its state when it
    reported the checkpoint (tensors)."""
    import torch

    assert torch.equal(restored, saved), (
        f"after load_training_state, rank {rank}'s generator continues the stream rank {rank} saved (its own, not "
        "another rank's): every rank saves its own state under its global rank, and restores that one")


def check_loads_on_cpu(run: dict) -> None:
    """``run``: {"finished": what load_training_state returned, "error": its error} on a checkpoint written by GPU
    workers, read on a machine without a GPU."""
    assert not run.get("error"), (f"a checkpoint written on GPU workers does not load on this CPU machine: "
                                  f"{run['error']}")
    assert run.get("finished") == 0, f"load_training_state returns the saved epoch: 0 (got {run.get('finished')!r})"


def check_refuses_code(tampered: list) -> None:
    """``tampered``: [{"file", "ran": whether a call pickled in that file ran, "error"}] of load_training_state on
    a checkpoint in which one file's value is a pickled call (what a tampered or foreign checkpoint can hold)."""
    for entry in tampered:
        assert not entry.get("ran"), (
            f"load_training_state ran a call pickled in {entry.get('file')}: unpickling a file may run any code in "
            "it. Load every file with torch.load(..., weights_only=True), which reads tensors and plain data only "
            "and refuses the call")


RESTART_TOL = 1e-5   # the grader's bound (autograder/checks/ft04.py: WEIGHTS_TOL)


def check_restart(run: dict, uninterrupted: dict) -> float:
    """``run``: a group of 4 ranks restarted from the checkpoint of epoch 0, described (``{"epochs": the epochs rank 0
    trained, "weights": its last checkpoint's model, "error"}``); ``uninterrupted``: the model of the same 3 epochs
    trained without a restart. Returns the largest weight difference."""
    assert not run.get("error"), f"the restart from your checkpoint of epoch 0 failed: {run['error']}"
    assert run.get("epochs") == [1, 2], (
        f"restarted from the checkpoint of epoch 0, the group trains epochs 1 and 2 (it trained {run.get('epochs')})")
    weights = run.get("weights") or {}
    assert set(weights) == set(uninterrupted), "the restarted group's model has other weights than the uninterrupted run's"
    difference = max((weights[k].float() - uninterrupted[k].float()).abs().max().item() for k in uninterrupted)
    assert difference < RESTART_TOL, (
        f"after a restart from your checkpoint the weights differ from the uninterrupted run's by {difference:.1e}: "
        "save and restore the optimizer, and on every rank its own RNG state (saved under its global rank)")
    return difference


# ---------------------------------------------------------------- resume

def check_fresh_start(first) -> None:
    assert first == 0, f"a fresh start (no checkpoint) begins at epoch 0 (got {first!r})"


def check_next_epoch(start, finished: int = 4) -> None:
    """resume on a checkpoint whose load_training_state says ``finished``."""
    assert start == finished + 1, (f"the checkpoint says epoch {finished} finished: resume returns {finished + 1}, the "
                                   f"first epoch still to train (got {start!r})")


def check_calls(calls: dict) -> None:
    """``calls``: {"count", "model": the model given each time?, "optimizer": the optimizer given each time?}."""
    assert calls.get("count") == 1 and calls.get("model") and calls.get("optimizer"), (
        "resume restores the checkpoint with load_training_state(folder, model, optimizer): once, on the model and "
        f"the optimizer it was given (load_training_state was called {calls.get('count')} time(s))")


def check_cloud(run: dict) -> None:
    """``run``: {"error", "seen": [the files of each folder load_training_state was given]} of resume on a
    checkpoint in cloud storage."""
    assert not run.get("error"), (
        f"resume failed on a checkpoint in cloud storage: {run['error']}. Its path is not a folder on this machine: "
        "open it with checkpoint.as_directory(), and load inside the with block (the downloaded copy is deleted when "
        "it ends)")
    assert all(files == [STATE_FILE] for files in run.get("seen", [])), \
        f"load_training_state gets a local folder holding the checkpoint's files (it saw {run.get('seen')})"


# ---------------------------------------------------------------- make_run_config
# a RunConfig described: {"type": [its class and bases, as module.name], "name", "storage_path", "given": the
# storage path given, "failure_config": {"type", "max_failures"} or None, "checkpoint_config": {"type",
# "num_to_keep", "checkpoint_score_attribute", "checkpoint_score_order"} or None}

def _classes(obj) -> list:
    return [f"{c.__module__}.{c.__qualname__}" for c in type(obj).__mro__]


def _is(described: dict | None, cls) -> bool:
    return isinstance(described, dict) and f"{cls.__module__}.{cls.__qualname__}" in described.get("type", [])


def describe_run_config(rc, given: str) -> dict:
    fc, cc = getattr(rc, "failure_config", None), getattr(rc, "checkpoint_config", None)
    return {"type": _classes(rc), "name": getattr(rc, "name", None),
            "storage_path": None if getattr(rc, "storage_path", None) is None else str(rc.storage_path),
            "given": given,
            "failure_config": None if fc is None else {"type": _classes(fc),
                                                      "max_failures": getattr(fc, "max_failures", None)},
            "checkpoint_config": None if cc is None else {
                "type": _classes(cc), **{k: getattr(cc, k, None) for k in (
                    "num_to_keep", "checkpoint_score_attribute", "checkpoint_score_order")}}}


def _run_config_type(rc: dict) -> None:
    import ray.train

    assert _is(rc, ray.train.RunConfig), f"return a ray.train.RunConfig (got {(rc.get('type') or ['?'])[0]})"


def check_failures_visible(rc: dict, no_limit: dict) -> None:
    """``rc``: make_run_config("demo", d, max_retries=2, keep=4, metric="accuracy", mode="max") described;
    ``no_limit``: the same with max_retries=None."""
    _run_config_type(rc)
    assert (rc["name"], rc["storage_path"]) == ("demo", rc["given"]), "name and storage_path as given"
    assert (rc["failure_config"] or {}).get("max_failures") == 2, "recover from up to max_retries=2 failures"
    got = (no_limit["failure_config"] or {}).get("max_failures")
    assert got == -1, f"max_retries=None: any number of failures, FailureConfig(max_failures=-1) (got {got!r})"


def check_keep_visible(rc: dict) -> None:
    """``rc``: make_run_config("demo", d, max_retries=2, keep=3, metric=None, mode="max") described."""
    recent = rc.get("checkpoint_config")
    assert recent is not None and recent["num_to_keep"] == 3, f"keep=3: CheckpointConfig(num_to_keep=3) (got {recent})"
    assert recent["checkpoint_score_attribute"] is None, (
        "metric=None keeps the most recent checkpoints: no score attribute (got checkpoint_score_attribute="
        f"{recent['checkpoint_score_attribute']!r}, which keeps the best by it)")


def check_score_visible(rc: dict) -> None:
    """``rc``: make_run_config("demo", d, max_retries=2, keep=2, metric="error_rate", mode="min") described."""
    cc = rc.get("checkpoint_config") or {}
    got = (cc.get("checkpoint_score_attribute"), cc.get("checkpoint_score_order"))
    assert got == ("error_rate", "min"), (
        "metric='error_rate', mode='min': keep the lowest error rates, checkpoint_score_order='min' (got "
        f"{got[0]!r}, {got[1]!r})")


# ---------------------------------------------------------------- build_tuner
# a Tuner described: {"type", "trainable_is_trial", "space": {key: a domain described}, "tune_config": {...},
# "scheduler": {...} or None, "run_config": {"name", "storage_path", "given", "verbose"}}

def _domain(value) -> dict:
    from ray.tune.search.sample import Categorical, Domain

    if isinstance(value, dict) and "grid_search" in value:
        return {"kind": "grid_search", "values": list(value["grid_search"])}
    if isinstance(value, Domain):
        out = {"kind": "domain", "type": _classes(value), "sampler": _classes(value.get_sampler())}
        if isinstance(value, Categorical):
            out["categories"] = list(value.categories)
        else:
            out["lower"], out["upper"] = getattr(value, "lower", None), getattr(value, "upper", None)
        return out
    return {"kind": "value", "repr": repr(value)}


def _level(verbose):
    """A verbosity as plain data: None, its number (an int or one of Tune's enums), or its repr."""
    try:
        return None if verbose is None else int(verbose)
    except (TypeError, ValueError):
        return repr(verbose)


def describe_tuner(tuner, trial, given: str) -> dict:
    """The Tuner's search, scheduler and run config, field by field (read from ``tuner._local_tuner``: Ray 2.60
    has no public getter)."""
    import copy

    inner = getattr(tuner, "_local_tuner", None)
    if inner is None:
        return {"type": _classes(tuner)}
    tc = inner._tune_config
    search, sched = tc.search_alg, tc.scheduler
    described_sched = None
    if sched is not None:
        try:
            properties = bool(copy.deepcopy(sched).set_search_properties(tc.metric, tc.mode))
        except Exception as e:  # noqa: BLE001
            properties = f"{type(e).__name__}: {e}"
        described_sched = {"type": _classes(sched), "metric": getattr(sched, "_metric", None),
                           "mode": getattr(sched, "_mode", None), "time_attr": getattr(sched, "_time_attr", None),
                           "max_t": getattr(sched, "_max_t", None),
                           "reduction_factor": getattr(sched, "_reduction_factor", None),
                           "rungs": [[r[0] for r in b._rungs] for b in getattr(sched, "_brackets", [])],
                           "search_properties": properties}
    rc = inner.get_run_config()
    return {"type": _classes(tuner), "trainable_is_trial": inner.trainable is trial,
            "space": {str(k): _domain(v) for k, v in (inner.param_space or {}).items()},
            "tune_config": {"num_samples": tc.num_samples, "max_concurrent_trials": tc.max_concurrent_trials,
                            "metric": tc.metric, "mode": tc.mode,
                            "search_alg": None if search is None else {
                                "type": _classes(search), "max_concurrent": getattr(search, "max_concurrent", None)}},
            "scheduler": described_sched,
            "run_config": {"name": rc.name, "storage_path": None if rc.storage_path is None else str(rc.storage_path),
                           "given": given, "verbose": _level(rc.verbose)}}


def _tuner_type(tuner: dict) -> None:
    from ray import tune

    assert _is(tuner, tune.Tuner) and "space" in tuner, \
        f"return a tune.Tuner (got {(tuner.get('type') or ['?'])[0]}); do not fit it"


def check_search_visible(tuner: dict) -> None:
    _tuner_type(tuner)
    space = tuner["space"]
    assert {"lr", "global_batch_size"} <= set(space), f"search 'lr' and 'global_batch_size' (param_space has {sorted(space)})"


def check_asha_visible(tuner: dict) -> None:
    from ray.tune.schedulers import ASHAScheduler

    _tuner_type(tuner)
    sched = tuner.get("scheduler")
    assert _is(sched, ASHAScheduler), \
        f"stop weak trials early: ASHAScheduler(...) in the TuneConfig (got {(sched or {}).get('type', ['None'])[0]})"
