"""Module 04's code exercises, judged outside the kernel: the files each rank wrote for a checkpoint, the streams and
weights load_training_state restored, the epochs and weights of groups restarted from a checkpoint, what resume
returned and restored, and the RunConfig and Tuner the last two exercises built, described field by field. Each
test cell's data is checked with the visible checks (``coursekit.exercise_checks.fault_tolerance``, which the
notebook runs too) and the hidden ones below, on the notebook's cases and on those only the grader knows (``ASKED``).

The reference run (3 epochs straight through on 4 ranks, 2 nodes x 2) is trained here (``ft04_reference``), never
taken from the kernel, and no reference answer is ever sent to the kernel (code there could read it): each
exercise is graded on its own with stand-ins written in the test cells, which answer nothing. The restart of
Exercise 1 resumes with a resume of the test's (your checkpoint's files in a local folder, your
load_training_state); Exercise 2 runs your resume beside a stand-in load_training_state that records the folder it
is given and leaves known marks (weights, learning rate, each rank's seed), which must still be there when resume
returns."""
from __future__ import annotations

import io
import math
from pathlib import Path

from autograder.checks import ft04_reference as ref
from coursekit.evidence import tensor
from coursekit.exercise_checks import fault_tolerance as ft

STATE_FILE = ft.STATE_FILE

# A restarted group against the uninterrupted run: max |weight difference| below WEIGHTS_TOL (the notebook's
# bound, kept; the weights are at most 0.36 in size). Measured here (torch 2.14, 2-core x86-64): every rank runs on
# one thread (coursekit.distributed sets it), so OMP_NUM_THREADS=1, 2 and 4 give the same weights to the bit; the
# reference restarted from its own checkpoint of epoch 0 ends 4.9e-08 from the uninterrupted run (1.2e-07 with
# MKL_CBWR=COMPATIBLE), and the same run made with the default and the COMPATIBLE MKL paths differs by 7.8e-07,
# the widest spread seen (kernel against grader on two code paths): 13x below the bound. The weights of a run the
# kernel made with the reference functions, against the grader's own run, are held to the same bound; its random
# streams and the restored weights are compared exactly (as before).
WEIGHTS_TOL = 1e-5

HIDDEN_RNG_RANKS = [0, 1, 2]
# the restarted group's own checkpoints, compared with the uninterrupted run's of the same epochs (every one), and
# each loaded (as rank 2, then rank 1): the epoch returned and the stream restored
LATER_EPOCHS = (1, 2)
HIDDEN_FAILURES = {"never-retry": (0, 0), "one-retry": (1, 1), "spot-run": (5, 5), "forever": (None, -1)}
HIDDEN_KEEP = [(2, None, "min"), (1, None, "max"), (None, "val_loss", "min"), (1, "accuracy", "max"), (5, "bleu", "max")]
# storage that is not a folder on this machine: a URI, passed on as given (os.path.abspath or str(Path(...)) of it
# names a local folder "s3:/...")
HIDDEN_STORAGE = [["cloud-run", 3, 2, "val_loss", "min", "s3://course-bucket/runs"]]
HIDDEN_SCORE = [("accuracy", "max"), ("neg_val_loss", "max"), ("accuracy_drop", "min"), ("perplexity", "min"),
                ("bleu", "max"), ("loss", "min")]
# build_tuner's cases: [num_samples, max_epochs, min_epochs, lr_range, batch_sizes, name(, batch sizes as a tuple)]
VISIBLE_TUNER = [4, 3, 1, [1e-4, 1e-2], [32, 64], "tune-check"]
# (a Tuner resolves its storage when it is built: pyarrow's in-memory "mock://" filesystem stands for a bucket, which
# would need the network)
HIDDEN_SEARCH = [[7, 9, 3, [3e-4, 3e-2], [16, 48, 96], "sweep-a"], [5, 12, 2, [1e-5, 1e-3], [8, 24], "sweep-b", True],
                 [6, 9, 3, [3e-4, 3e-2], [16, 48], "sweep-c", False, "mock://course-bucket/tune"]]
HIDDEN_ASHA = [[4, 9, 3, [1e-4, 1e-2], [32, 64], "sweep-a"], [4, 12, 2, [1e-4, 1e-2], [32, 64], "sweep-b"]]

# resume beside the notebook's marking stand-in of load_training_state: as rank `rank` of 4 from a marked
# checkpoint of epoch `finished` (a local folder; in cloud storage for test_resume_storage), and a group of 4 ranks
# restarted from the marked checkpoint of epoch `group`
HIDDEN_RESUMED = {"test_resume_epoch": [{"rank": 2, "finished": 1}, {"group": 0}],
                  "test_resume_state": [{"rank": 0, "finished": 0}, {"rank": 3, "finished": 0}],
                  "test_resume_storage": [{"rank": 1, "finished": 1}]}
# the marks the stand-in leaves (the notebook's MARK_WEIGHT, MARK_LR, MARK_SEED): every weight, the learning rate,
# each rank's generator seeded with MARK_SEED + its rank
MARK_WEIGHT, MARK_LR, MARK_SEED = 0.5, 0.123, 1000

ASKED = {"test_training_state_rng": HIDDEN_RNG_RANKS,
         **HIDDEN_RESUMED,
         "test_make_run_config_failures": [[name, retries, 2, "val_loss", "min"]
                                           for name, (retries, _) in HIDDEN_FAILURES.items()] + HIDDEN_STORAGE,
         "test_make_run_config_keep": [["keep-check", 2, keep, metric, mode] for keep, metric, mode in HIDDEN_KEEP],
         "test_make_run_config_score": [["keep-check", 2, 2, metric, mode] for metric, mode in HIDDEN_SCORE],
         "test_build_tuner_search": HIDDEN_SEARCH, "test_build_tuner_asha": HIDDEN_ASHA}

_NOTHING = "run its cells in order, without errors, up to the end of the test cell"


def _max_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), f"the weights' keys {sorted(a)} are not the model's {sorted(b)}"
    for k in a:
        assert a[k].shape == b[k].shape, f"{k}: shape {tuple(a[k].shape)}, expected {tuple(b[k].shape)}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _tensors(data: dict | None) -> dict:
    return {k: tensor(v) for k, v in (data or {}).items()}


def _load(content: bytes, what: str):
    import torch

    try:
        return torch.load(io.BytesIO(content), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{what} does not load with torch.load(..., weights_only=True): "
                             f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None


def _error(message) -> str:
    return str(message).removeprefix("AssertionError: ")


def _same_storage(got: str | None, given: str) -> bool:
    """storage_path as given: the same folder, or for a URI ("s3://...") the same text."""
    if got is None:
        return False
    if "://" in given:
        return got.rstrip("/") == given.rstrip("/")
    return Path(got) == Path(given)


def _same_optimizer(state: dict, expected: dict, what: str) -> None:
    """An optimizer's state_dict against the reference's: the same hyperparameters, and every state tensor within
    WEIGHTS_TOL (Adam's step, running averages: computed from the same gradients). Measured (the reference run at
    epochs 0, 1, 2): OMP_NUM_THREADS=4 against 1 gives the same state to the bit; MKL_CBWR=COMPATIBLE against the
    default path differs by 1.7e-08 at most (the weights by 7.8e-07): 600x below the bound."""
    import torch

    got_groups = [{k: v for k, v in g.items() if k != "params"} for g in state.get("param_groups", [])]
    ref_groups = [{k: v for k, v in g.items() if k != "params"} for g in expected["param_groups"]]
    assert got_groups == ref_groups, f"{what}: its param_groups are not the optimizer's ({got_groups})"
    got, ref_state = state.get("state", {}), expected["state"]
    assert sorted(got) == sorted(ref_state), (
        f"{what}: the state of {len(got)} parameters, expected {len(ref_state)} (the optimizer's state_dict())")
    for key, values in ref_state.items():
        for name, value in values.items():
            mine = got[key].get(name) if isinstance(got[key], dict) else None
            assert isinstance(mine, torch.Tensor) and mine.shape == value.shape, \
                f"{what}: parameter {key}'s {name!r} is not the optimizer's (got {type(mine).__name__})"
            diff = (mine.double() - value.double()).abs().max().item() if value.numel() else 0.0
            assert diff < WEIGHTS_TOL, (f"{what}: parameter {key}'s {name!r} differs from the reference run's by "
                                        f"{diff:.1e}: save optimizer.state_dict() after the epoch's last step")


def _same_as_reference(weights: dict, expected: dict, what: str) -> None:
    """The weights of a run the kernel made with the reference functions against the grader's own run."""
    diff = _max_difference({k.removeprefix("module."): v for k, v in weights.items()}, expected)
    assert diff < WEIGHTS_TOL, (f"{what} differs from the grader's own reference run by {diff:.1e} (tolerance "
                                f"{WEIGHTS_TOL:g}): the test cell did not train what it says")


# ---------------------------------------------------------------- Exercise 1: save_training_state, load_training_state

def _first_part(data) -> list:
    assert data is not None and "files" in data, f"the test cell handed in no checkpoint: {_NOTHING}"
    assert not data.get("error"), f"train_func with your save_training_state failed: {data['error']}"
    files = [ft.files_bytes(f) for f in data["files"]]
    assert len(files) == 4, f"the checkpoint of {len(files)} ranks handed in, expected 4"
    return files


def training_state_files(data):
    files = _first_part(data)
    ft.check_writers({rank: sorted(f) for rank, f in enumerate(files)})
    ft.check_one_folder(files)
    for rank in (1, 2, 3):
        sizes = {name: len(content) for name, content in files[rank].items()}
        assert len(sizes) <= 1 and sum(sizes.values()) < 20_000, \
            f"rank {rank} writes only its own RNG state (one small file); it wrote {sizes}"
    state = _load(files[0][STATE_FILE], f"rank 0's {STATE_FILE}")
    assert isinstance(state, dict) and {"model", "optimizer", "epoch"} <= set(state), (
        f"{STATE_FILE} holds a dict with keys model, optimizer, epoch (found "
        f"{sorted(state) if isinstance(state, dict) else type(state).__name__})")
    assert state["epoch"] == 0, f"'epoch' is the epoch that just finished: 0 after the first one (found {state['epoch']!r})"
    assert isinstance(state["optimizer"], dict) and state["optimizer"].get("state"), \
        "'optimizer' is the optimizer's state_dict(), with Adam's running averages in its 'state'"
    from coursekit.models import build_model

    try:
        build_model("small_cnn").load_state_dict(state["model"])
    except (RuntimeError, TypeError, AttributeError) as e:
        raise AssertionError("save the unwrapped model's state_dict (model.module under DDP), so that it loads into "
                             f"a plain model: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    _same_as_reference(state["model"], ref.saved_state(0)["model"], f"the model in rank 0's {STATE_FILE} of epoch 0")
    _same_optimizer(state["optimizer"], ref.saved_state(0)["optimizer"], f"the optimizer in rank 0's {STATE_FILE}")
    return "rank 0 writes the model, the optimizer and the epoch; every other rank only its own small RNG file"


def training_state_rng(data):
    restored = {entry.get("rank"): entry for entry in (data or {}).get("restored", [])}
    for rank in [3, *HIDDEN_RNG_RANKS]:
        entry = restored.get(rank)
        assert entry is not None, f"the test cell handed in no restore as rank {rank}: {_NOTHING}"
        assert not entry.get("error"), _error(entry["error"])
        saved = tensor(entry["saved"])
        ft.check_rng(rank, tensor(entry["value"]), saved)
        assert saved.equal(ref.reported_rng(0, rank)), (
            f"rank {rank}'s generator when it reported the checkpoint of epoch 0 is not the one train_func has "
            "there (does save_training_state draw random numbers?)")
    return "every rank of 4 (2 nodes x 2) gets its own stream back from the merged folder"


def training_state_cpu(data):
    assert data is not None and "finished" in data, f"the test cell handed in nothing: {_NOTHING}"
    ft.check_loads_on_cpu(data)
    saved = _load(ft.files_bytes(data.get("saved")).get(STATE_FILE, b""), f"rank 0's {STATE_FILE}")
    weights = _tensors(data.get("weights"))
    diff = _max_difference(weights, saved["model"])
    assert diff == 0, f"after load_training_state the model holds the saved weights (they differ by {diff:.1e})"
    assert data.get("devices") == ["cpu"], f"the weights stay on the CPU (they are on {data.get('devices')})"
    _same_as_reference(weights, ref.saved_state(0)["model"], "the model loaded from the checkpoint of epoch 0")
    tampered = {entry.get("file"): entry for entry in data.get("tampered") or []}
    for name in (STATE_FILE, "rng_rank_1.pt"):
        assert name in tampered, f"the test cell handed in no load of a checkpoint whose {name} holds a call: {_NOTHING}"
    ft.check_refuses_code(list(tampered.values()))
    return "a checkpoint written by GPU workers, in cloud storage, loads on a CPU-only machine"


def _restarted(run: dict | None, what: str) -> tuple[list, dict]:
    assert run is not None and "epochs" in run, f"the test cell handed in no restarted group: {_NOTHING}"
    assert not run.get("error"), _error(run["error"])
    return run["epochs"], _tensors(run.get("weights"))


def training_state_restart(data):
    epochs, weights = _restarted(data, "the restart from your checkpoint")
    assert epochs == [1, 2], f"epochs after the restart: {epochs}"
    diff = _max_difference(weights, ref.final_weights())
    assert diff < WEIGHTS_TOL, (
        f"after a restart from your checkpoint the weights differ from the uninterrupted run's by {diff:.1e}: "
        "save and restore the optimizer, and on every rank its own RNG state (saved under its global rank)")
    later = data.get("later") or {}
    assert later and not later.get("error"), (
        f"your load_training_state failed on a checkpoint the restarted group wrote: {later.get('error')}")
    assert len(later["value"]["states"]) == len(later["value"]["loads"]) == len(LATER_EPOCHS), \
        f"the test cell handed in the restarted group's checkpoints of epochs {list(LATER_EPOCHS)}: {_NOTHING}"
    for epoch, files, load in zip(LATER_EPOCHS, later["value"]["states"], later["value"]["loads"]):
        files = ft.files_bytes(files)
        assert STATE_FILE in files, f"the restarted group's checkpoint of epoch {epoch} has no {STATE_FILE}"
        state = _load(files[STATE_FILE], f"the {STATE_FILE} of epoch {epoch}")
        assert isinstance(state, dict) and state.get("epoch") == epoch, (
            f"the {STATE_FILE} written after epoch {epoch} says epoch "
            f"{state.get('epoch') if isinstance(state, dict) else '?'!r}: 'epoch' is the epoch that just finished")
        _same_as_reference(state["model"], ref.saved_state(epoch)["model"],
                           f"the model in the restarted group's checkpoint of epoch {epoch}")
        _same_optimizer(state["optimizer"], ref.saved_state(epoch)["optimizer"],
                        f"the optimizer in the restarted group's checkpoint of epoch {epoch}")
        assert load["finished"] == epoch, (f"load_training_state on the checkpoint of epoch {epoch} returns {epoch}, "
                                           f"the saved epoch (got {load['finished']!r})")
        ft.check_rng(load["rank"], tensor(load["rng"]), ref.reported_rng(epoch, load["rank"]))
    return f"4 ranks restarted from your checkpoint end on the uninterrupted run (max |difference| {diff:.1e})"


# ---------------------------------------------------------------- Exercise 2: resume

def _resumed(data, rank: int, finished: int, cloud: bool = False) -> dict:
    for entry in (data or {}).get("resumed", []):
        if (entry.get("rank"), entry.get("finished"), bool(entry.get("cloud"))) == (rank, finished, cloud):
            return entry
    raise AssertionError(f"the test cell handed in no resume as rank {rank} from a checkpoint of epoch {finished}: "
                         f"{_NOTHING}")


def _marked(entry: dict, rank: int, what: str) -> None:
    """The marks the stand-in load_training_state left are there when resume returns."""
    import torch

    checkpoint = ft.files_bytes(entry.get("checkpoint"))
    given = [ft.files_bytes(load.get("files")) for load in entry.get("loads", [])]
    assert any(all(files.get(n) == content for n, content in checkpoint.items()) for files in given), (
        f"{what}: load_training_state gets a local folder holding the checkpoint's files (it was given "
        f"{[sorted(files) for files in given]})")
    weights = _tensors(entry.get("weights"))
    diff = max((w.double() - MARK_WEIGHT).abs().max().item() for w in weights.values()) if weights else math.inf
    assert diff == 0, (f"{what}: after resume the model holds the checkpoint's weights (they differ by {diff:.1e}): "
                       "restore the checkpoint with load_training_state on every rank")
    assert all(load.get("model") and load.get("optimizer") for load in entry["loads"]) and \
        entry.get("lr") == [MARK_LR], \
        f"{what}: after resume the optimizer holds the checkpoint's state (load_training_state restores it)"
    assert torch.equal(tensor(entry["rng"]), torch.Generator().manual_seed(MARK_SEED + rank).get_state()), \
        f"{what}: after resume its generator holds its saved stream"


def resume_epoch(data):
    assert data is not None and "fresh" in data, f"the test cell handed in nothing: {_NOTHING}"
    assert not data["fresh"].get("error"), f"resume failed on a fresh start: {data['fresh']['error']}"
    ft.check_fresh_start(data["fresh"]["value"])
    assert not data["stand_in"].get("error"), f"resume failed: {data['stand_in']['error']}"
    ft.check_next_epoch(data["stand_in"]["value"], 4)
    for case in HIDDEN_RESUMED["test_resume_epoch"]:
        if "rank" in case:
            entry = _resumed(data, case["rank"], case["finished"])
            assert not entry.get("error"), f"resume failed on the checkpoint of epoch {case['finished']}: {entry['error']}"
            start, expected = entry.get("start"), case["finished"] + 1
            assert start == expected, (
                f"the checkpoint says epoch {case['finished']} finished: resume returns {expected}, the first epoch "
                f"still to train (got {start!r}; the saved epoch repeats it, saved + 2 skips one)")
            continue
        group = next((g for g in data.get("groups", []) if g.get("finished") == case["group"]), None)
        assert group is not None, f"the test cell handed in no restarted group: {_NOTHING}"
        assert not group.get("error"), f"the restarted group failed: {_error(group['error'])}"
        epochs = (group.get("epochs") or [None])[0]
        assert epochs == [1, 2], (
            f"epoch 0 had finished: the restarted group trains epochs 1 and 2 (it trained {epochs}; starting at the "
            "saved epoch repeats it, saved + 2 skips one)")
    return "0 on a fresh start, the epoch after the saved one otherwise; a restarted group trains epochs 1 and 2"


def resume_state(data):
    assert data is not None and "calls" in data, f"the test cell handed in nothing: {_NOTHING}"
    ft.check_calls(data["calls"])
    for case in HIDDEN_RESUMED["test_resume_state"]:
        rank = case["rank"]
        entry = _resumed(data, rank, case["finished"])
        assert not entry.get("error"), f"rank {rank}: resume failed: {entry['error']}"
        _marked(entry, rank, f"rank {rank}")
    return "every rank holds the checkpoint's weights, optimizer and own stream when resume returns"


def resume_storage(data):
    assert data is not None and "cloud" in data, f"the test cell handed in nothing: {_NOTHING}"
    ft.check_cloud(data["cloud"])
    for case in HIDDEN_RESUMED["test_resume_storage"]:
        entry = _resumed(data, case["rank"], case["finished"], cloud=True)
        assert not entry.get("error"), (
            "resume failed on a checkpoint in cloud storage, whose path ('course-bucket/...') is not a folder on this "
            "machine: open it with checkpoint.as_directory() and load inside the with block (the downloaded copy is "
            f"deleted when it ends). The error: {entry['error']}")
        weights = _tensors(entry.get("weights"))
        diff = max((w.double() - MARK_WEIGHT).abs().max().item() for w in weights.values()) if weights else math.inf
        assert diff == 0, \
            f"after resume from cloud storage the model holds the checkpoint's weights (they differ by {diff:.1e})"
    return "a checkpoint in cloud storage is opened with as_directory() and restored"


# ---------------------------------------------------------------- Exercise 3: make_run_config

def _configs(data, case: list, what: str = "make_run_config") -> dict:
    for entry in (data or {}).get("configs", []):
        if entry.get("case") == list(case):
            assert not entry.get("error"), f"{what}{tuple(case)} raised {entry['error']}"
            return entry["value"]
    raise AssertionError(f"the test cell handed in no result of {what}{tuple(case)}: {_NOTHING}")


def _run_config(data, name, max_retries, keep, metric, mode) -> dict:
    import ray.train

    rc = _configs(data, [name, max_retries, keep, metric, mode])
    assert ft._is(rc, ray.train.RunConfig), f"return a ray.train.RunConfig (got {(rc.get('type') or ['?'])[0]})"
    assert rc["name"] == name and _same_storage(rc["storage_path"], rc["given"]), \
        f"name={name!r}, storage_path as given (got {rc['name']!r}, {rc['storage_path']!r})"
    return rc


def _checkpoint_config(data, keep, metric, mode) -> dict:
    import ray.train

    cc = _configs(data, ["keep-check", 2, keep, metric, mode]).get("checkpoint_config")
    assert ft._is(cc, ray.train.CheckpointConfig), \
        f"a ray.train.CheckpointConfig in the RunConfig (got {(cc or {}).get('type', ['None'])[0]})"
    return cc


def make_run_config_failures(data):
    import ray.train

    ft.check_failures_visible(_configs(data, ["demo", 2, 4, "accuracy", "max"]),
                              _configs(data, ["demo", None, 4, "accuracy", "max"]))
    for name, (retries, failures) in HIDDEN_FAILURES.items():
        fc = _run_config(data, name, retries, 2, "val_loss", "min").get("failure_config")
        assert ft._is(fc, ray.train.FailureConfig), \
            f"a ray.train.FailureConfig in the RunConfig (got {(fc or {}).get('type', ['None'])[0]})"
        assert fc["max_failures"] == failures, (
            f"max_retries={retries!r}: FailureConfig(max_failures={failures}) (got {fc['max_failures']!r}; "
            "0 means no retry at all, -1 retries without limit)")
    for case in HIDDEN_STORAGE:
        rc = _configs(data, case)
        assert _same_storage(rc["storage_path"], case[-1]), (
            f"storage_path={case[-1]!r} as given (got {rc['storage_path']!r}): storage may be a URI, which is not a "
            "folder on this machine; os.path or Path would turn it into one")
    return "FailureConfig(max_failures) from max_retries: 0 none, N up to N, None without limit"


def make_run_config_keep(data):
    ft.check_keep_visible(_configs(data, ["demo", 2, 3, None, "max"]))
    for keep, metric, mode in HIDDEN_KEEP:
        cc = _checkpoint_config(data, keep, metric, mode)
        assert cc["num_to_keep"] == keep, (f"keep={keep!r}: num_to_keep={keep!r} "
                                           f"({'every checkpoint' if keep is None else f'{keep} checkpoint(s)'}; "
                                           f"got {cc['num_to_keep']!r})")
        assert cc["checkpoint_score_attribute"] == metric, (
            f"metric={metric!r}: " + ("the most recent, no score attribute" if metric is None else
                                      f"the best by it, checkpoint_score_attribute={metric!r}")
            + f" (got {cc['checkpoint_score_attribute']!r})")
    return "num_to_keep as given; the most recent without a metric, the best by it with one"


def make_run_config_score(data):
    ft.check_score_visible(_configs(data, ["demo", 2, 2, "error_rate", "min"]))
    for metric, mode in HIDDEN_SCORE:
        cc = _checkpoint_config(data, 2, metric, mode)
        got = (cc["checkpoint_score_attribute"], cc["checkpoint_score_order"])
        assert got == (metric, mode), (
            f"metric={metric!r}, mode={mode!r}: the best are the {'lowest' if mode == 'min' else 'highest'}, "
            f"checkpoint_score_order={mode!r} as given (got {got[0]!r}, {got[1]!r}; a metric's name does not say "
            "which end is best)")
    return "checkpoint_score_order as the mode given"


# ---------------------------------------------------------------- Exercise 4: build_tuner

def _tuner(data, case: list) -> dict:
    for entry in (data or {}).get("tuners", []):
        if entry.get("case") == list(case):
            assert not entry.get("error"), f"build_tuner raised {entry['error']}"
            from ray import tune

            got = entry["value"]
            assert ft._is(got, tune.Tuner) and "space" in got, \
                f"return a tune.Tuner (got {(got.get('type') or ['?'])[0]})"
            return got
    raise AssertionError(f"the test cell handed in no Tuner built for {case}: {_NOTHING}")


def _describe(value: dict | None) -> str:
    if not value:
        return "None"
    if value.get("kind") == "domain":
        sampler = value["sampler"][0].rsplit(".", 1)[-1].strip("_")
        if "categories" in value:
            return f"a choice ({sampler}) among {value['categories']}"
        return (f"a {value['type'][0].rsplit('.', 1)[-1]} domain, {sampler} between {value.get('lower')} and "
                f"{value.get('upper')}")
    if value.get("kind") == "grid_search":
        return f"{{'grid_search': {value['values']}}}"
    return value.get("repr", "?")


def _has(described: dict | None, cls) -> bool:
    return isinstance(described, dict) and f"{cls.__module__}.{cls.__qualname__}" in described.get(
        "type" if "type" in described else "sampler", [])


def _concurrency(tc: dict):
    """How many trials Tune runs at once with this TuneConfig (ray/tune/tune.py, run()); None: no limit."""
    from ray.tune.search import BasicVariantGenerator

    search = tc["search_alg"]
    if search is None:
        return tc["max_concurrent_trials"] or None
    if ft._is(search, BasicVariantGenerator):   # Tune ignores max_concurrent_trials beside a search generator
        return search["max_concurrent"] or None
    return None


def _check_search(data, case):
    from ray.tune.search import BasicVariantGenerator
    from ray.tune.search.sample import Categorical, Float

    num_samples, _, _, lr_range, batch_sizes, name = case[:6]
    got = _tuner(data, case)
    assert got["trainable_is_trial"], "give the Tuner `trial` itself as its trainable"
    space = got["space"]
    lr, batch = space.get("lr"), space.get("global_batch_size")
    log_uniform = f"{Float._LogUniform.__module__}.{Float._LogUniform.__qualname__}"
    assert _has(lr, Float) and log_uniform in lr.get("sampler", []), (
        f"'lr': tune.loguniform(low, high) (got {_describe(lr)}): a learning rate spans orders of magnitude, "
        "and log-uniform draws cover each of them equally")
    assert math.isclose(lr["lower"], min(lr_range)) and math.isclose(lr["upper"], max(lr_range)), \
        f"'lr' between {lr_range[0]} and {lr_range[1]} (got {lr['lower']} .. {lr['upper']})"
    assert not (batch or {}).get("kind") == "grid_search", (
        "'global_batch_size': tune.choice(...), one random draw per trial; tune.grid_search runs num_samples "
        "trials for each batch size")
    assert _has(batch, Categorical) and sorted(batch.get("categories", [])) == sorted(batch_sizes), \
        f"'global_batch_size': tune.choice({list(batch_sizes)}) (got {_describe(batch)})"
    extra = [k for k, v in space.items() if k not in ("lr", "global_batch_size") and v.get("kind") != "value"]
    assert not extra, f"search only lr and global_batch_size (also searched: {extra})"
    tc = got["tune_config"]
    assert tc["num_samples"] == num_samples, f"num_samples={num_samples} trials (got {tc['num_samples']})"
    assert tc["search_alg"] is None or ft._is(tc["search_alg"], BasicVariantGenerator), (
        "draw each trial's config at random from param_space (Tune's default search, BasicVariantGenerator), "
        f"not with {tc['search_alg']['type'][0].rsplit('.', 1)[-1]}")
    at_once = _concurrency(tc)
    assert at_once == 2, (f"up to 2 trials at the same time (Tune would run {at_once or 'any number of'} at once; "
                          "beside a BasicVariantGenerator, TuneConfig(max_concurrent_trials=...) is ignored)")
    sched = got["scheduler"]
    metric = tc["metric"] or (sched or {}).get("metric")
    mode = tc["mode"] or (sched or {}).get("mode")
    assert (metric, mode) == ("accuracy", "max"), \
        f"rank trials by accuracy, higher is better: metric='accuracy', mode='max' (got {metric!r}, {mode!r})"
    assert sched is None or sched["search_properties"] is True, (
        "metric and mode are set twice, in the TuneConfig and in the scheduler: Tune refuses that at fit(); "
        "give them once (in the TuneConfig)")
    rc = got["run_config"]
    assert rc["name"] == name and _same_storage(rc["storage_path"], rc["given"]), (
        f"results under storage_path/name, as given: name={name!r}, storage_path={rc['given']!r} (got "
        f"{rc['name']!r}, {rc['storage_path']!r}; a URI is not a folder on this machine)")
    verbose = rc.get("verbose", None)   # (ray.train's RunConfig, which Tune also takes, holds a "DEPRECATED" text)
    assert not isinstance(verbose, int) or 0 <= verbose <= 3, (
        f"verbose={verbose!r}: fit() raises ValueError for it (Tune's levels are 0 to 3; 0 keeps its tables out)")


def build_tuner_search(data):
    ft.check_search_visible(_tuner(data, VISIBLE_TUNER))
    for case in HIDDEN_SEARCH:
        _check_search(data, case)
    return "lr log-uniform, the batch size a choice, num_samples trials, 2 at once, by accuracy (max), under storage_path/name"


def _check_asha(data, case):
    from ray.tune.schedulers import ASHAScheduler

    _, max_epochs, min_epochs = case[:3]
    sched = _tuner(data, case)["scheduler"]
    assert ft._is(sched, ASHAScheduler), \
        f"scheduler: ASHAScheduler(...) in the TuneConfig (got {(sched or {}).get('type', ['None'])[0]})"
    assert sched["time_attr"] == "training_iteration", (
        f"ASHA counts reports (time_attr='training_iteration', its default), not {sched['time_attr']!r}")
    assert sched["max_t"] == max_epochs, \
        f"no trial trains more than {max_epochs} epochs: max_t={max_epochs} (got {sched['max_t']})"
    grace = min(sched["rungs"][0]) if sched["rungs"] and sched["rungs"][0] else None
    assert grace == min_epochs, (f"no trial is stopped before {min_epochs} epochs: grace_period={min_epochs} "
                                 f"(the first rung is at {grace}; ASHA's default grace_period is 1)")
    assert sched["reduction_factor"] == 2, (f"the best half continue at each rung: reduction_factor=2 (got "
                                            f"{sched['reduction_factor']}; the default 4 keeps a quarter)")
    expected = ASHAScheduler(max_t=max_epochs, grace_period=min_epochs, reduction_factor=2)
    rungs = sched["rungs"]
    assert rungs == [[r[0] for r in b._rungs] for b in expected._brackets], f"one bracket of rungs (got {rungs})"


def build_tuner_asha(data):
    ft.check_asha_visible(_tuner(data, VISIBLE_TUNER))
    for case in HIDDEN_ASHA:
        _check_asha(data, case)
    return "ASHA over training iterations: max_t, grace_period as given, the best half at each rung"


CHECKS = {f"test_{f.__name__}": f for f in (
    training_state_files, training_state_rng, training_state_cpu, training_state_restart, resume_epoch, resume_state,
    resume_storage, make_run_config_failures, make_run_config_keep, make_run_config_score, build_tuner_search,
    build_tuner_asha)}

# what every submission's checks compare with, computed once by a warm worker before it forks the jobs
PREPARE = (ref.uninterrupted,)
