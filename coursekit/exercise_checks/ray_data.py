"""Module 03's checks on plain data: what ``preprocess`` returned (and left of its inputs), the plan of the Dataset
``build_train_dataset`` built and the rows it gave, the TorchTrainer ``make_trainer`` built described field by field,
and what each worker of ``train_func`` read and reported, against one process trained on the rows it was sent
(``reference_train(config, sent, per_worker_batch)``: the notebook's, or the grader's own)."""
from __future__ import annotations

import numpy as np

from coursekit.exercise_checks.ray_train import max_difference


# ---------------------------------------------------------------- preprocess

def preprocess_case(name: str) -> dict:
    """The batch a preprocess check hands to preprocess: the same arrays wherever it is made."""
    if name == "values":
        return {"image": np.stack([np.zeros((28, 28)), np.full((28, 28), 255)]).astype(np.uint8),
                "label": np.array([3, 7]), "id": np.array([10, 11])}
    if name in ("random", "one"):
        raw = np.random.default_rng(0).integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
        if name == "one":
            return {"image": raw[:1], "label": np.array([4]), "id": np.array([1])}
        return {"image": raw, "label": np.array([0, 1, 2, 3, 9], dtype=np.int32),
                "id": np.array([40, 7, 3, 12, 99], dtype=np.int64)}
    if name == "columns":
        return {"image": np.zeros((2, 28, 28), dtype=np.uint8), "label": np.array([3, 7], dtype=np.int32),
                "id": np.array([10, 11])}
    if name == "all_columns":
        raw = np.random.default_rng(1).integers(0, 256, size=(4, 28, 28), dtype=np.uint8)
        return {"image": raw, "label": np.array([9, 0, 4, 1], dtype=np.int32),
                "id": np.array([5, 6, 7, 8], dtype=np.int64), "source": np.array(["a.png", "b.png", "c.png", "d.png"])}
    raise KeyError(name)


def expected_images(raw: np.ndarray) -> np.ndarray:
    """What ToTensor() + Normalize((0.5,), (0.5,)) give, as [B, 1, 28, 28]: the course dataset's own tensors
    (coursekit.data.normalize, what module 02's DataLoader trained on)."""
    import torch

    from coursekit.data import normalize

    return normalize(torch.from_numpy(np.ascontiguousarray(raw))).numpy()


def check_values_visible(out: dict) -> None:
    assert out["image"].shape == (2, 1, 28, 28), f"image shape {out['image'].shape}, expected (B, 1, 28, 28)"
    assert out["image"].dtype == np.float32, f"expected float32 images, got {out['image'].dtype}"
    assert np.allclose(out["image"][0], -1.0) and np.allclose(out["image"][1], 1.0), (
        "a black pixel (0) becomes (0/255 - 0.5) / 0.5 = -1 and a white one (255) +1; got "
        f"{out['image'][0].min():.4f} and {out['image'][1].max():.4f}")


def check_values(out: dict, one: dict) -> None:
    """Random pixels as ToTensor() + Normalize give them, and a batch of one image."""
    raw = preprocess_case("random")["image"]
    assert out["image"].shape == (5, 1, 28, 28), f"image shape {out['image'].shape}, expected (5, 1, 28, 28)"
    assert out["image"].dtype == np.float32, f"images must be float32, got {out['image'].dtype}"
    error = np.abs(out["image"] - expected_images(raw)).max()
    assert error < 1e-6, (f"expected what ToTensor() + Normalize((0.5,), (0.5,)) give, (pixel / 255 - 0.5) / 0.5 in "
                          f"[-1, 1]; your values differ by up to {error:.4f}")
    assert one["image"].shape == (1, 1, 28, 28), f"a batch of one image: expected (1, 1, 28, 28), got {one['image'].shape}"


def check_columns_visible(out: dict) -> None:
    assert out["label"].dtype == np.int64 and out["label"].tolist() == [3, 7], (
        f"expected the labels [3, 7] as int64, got {out['label'].tolist()} as {out['label'].dtype}")
    assert "id" in out and out["id"].tolist() == [10, 11], (
        f"expected the other columns (the row 'id') unchanged, got the columns {sorted(out)}")


def check_columns(out: dict, given_after: dict) -> None:
    """Labels int64, the other columns unchanged, and the arrays handed in left as they were."""
    batch = preprocess_case("all_columns")
    labels = batch["label"]
    assert out["label"].dtype == np.int64 and out["label"].tolist() == labels.tolist(), (
        f"expected the labels {labels.tolist()} as int64, got {out['label'].tolist()} as {out['label'].dtype}")
    for name in ("id", "source"):
        want = batch[name]
        assert name in out and np.array_equal(out[name], want), (
            f"expected the column {name!r} unchanged ({want.tolist()}), got "
            f"{out[name].tolist() if name in out else 'no such column'}")
    assert np.array_equal(given_after["image"], batch["image"]) and np.array_equal(given_after["label"], labels), (
        "expected the arrays you were given unchanged: make new arrays instead of changing them in place")


# ---------------------------------------------------------------- build_train_dataset
# a plan described: {"type", "materialized", "steps": [{"op", "num_cpus", "compute", "size", "batch_size",
# "batch_format"}], "input_files": [paths], "check_files": [the paths of the files written]}

def describe_plan(ds, check_files: list | None = None) -> dict:
    """The Dataset's logical plan from the read to the last step, described (plain data); with ``check_files``,
    also the files it reads and those (only then does Ray Data list the files)."""
    import os

    import ray
    from ray.data.dataset import MaterializedDataset

    if not isinstance(ds, ray.data.Dataset):
        return {"type": type(ds).__name__}
    steps, op = [], ds._logical_plan.dag
    while op is not None:
        steps.append(op)
        op = op.input_dependencies[0] if op.input_dependencies else None
    described = []
    for op in steps[::-1]:
        step = {"op": type(op).__name__}
        if step["op"] == "MapBatches":
            step.update(num_cpus=op.ray_remote_args.get("num_cpus"), compute=type(op.compute).__name__,
                        size=getattr(op.compute, "size", None), batch_size=op.batch_size,
                        batch_format=op.batch_format)
        described.append(step)
    files = None
    if check_files is not None:
        try:
            files = sorted(os.path.realpath(str(f)) for f in ds.input_files())
        except Exception:  # noqa: BLE001  (a plan that cannot say: the check reports the files as unknown)
            files = None
    return {"type": "Dataset", "materialized": isinstance(ds, MaterializedDataset), "steps": described,
            "input_files": files,
            "check_files": None if check_files is None else sorted(os.path.realpath(str(f)) for f in check_files)}


def _dataset(plan: dict, where: str) -> list:
    assert plan.get("type") == "Dataset", f"{where}: expected a Dataset, got {plan.get('type')}"
    return plan["steps"]


def check_resources(plan: dict, num_cpus: float, concurrency: int, batch_size: int) -> None:
    """Every map_batches step reserves num_cpus CPUs per task, runs at most `concurrency` tasks at once and hands
    batch_size rows to each call."""
    where = f"build_train_dataset(..., num_cpus={num_cpus}, concurrency={concurrency}, batch_size={batch_size})"
    steps = _dataset(plan, where)
    maps = [s for s in steps if s["op"] == "MapBatches"]
    assert maps, f"{where}: expected a map_batches step in the plan, got {[s['op'] for s in steps]}"
    for step in maps:
        got = step["num_cpus"]
        assert got == num_cpus, (f"{where}: each map_batches task must reserve num_cpus={num_cpus} CPUs (the "
                                 f"argument), got {'none given (1 CPU each by default)' if got is None else got}")
        assert step["compute"] == "TaskPoolStrategy" and step["size"] == concurrency, (
            f"{where}: expected at most concurrency={concurrency} tasks at once (a TaskPoolStrategy of that size), "
            f"got {step['compute']}(size={step['size']})")
        assert step["batch_size"] == batch_size, (
            f"{where}: expected batches of batch_size={batch_size} rows for preprocess, got batch_size={step['batch_size']}")


def check_plan_visible(plan: dict) -> None:
    steps = _dataset(plan, "build_train_dataset")
    assert not plan["materialized"], (
        "expected the lazy Dataset, got a materialized one: do not run it (materialize(), take, count, show)")
    names = [s["op"] for s in steps]
    assert names == ["Read", "MapBatches"], f"expected a read and one map_batches step, got {names}"


def check_plan(plan: dict) -> None:
    """Lazy, a read then one map_batches of dicts of arrays, over the Parquet files of the folder given."""
    check_plan_visible(plan)
    assert plan["check_files"] and plan["input_files"] == plan["check_files"], (
        f"expected the Parquet files of the folder given (parquet_dir), {plan['check_files']}; the plan reads "
        f"{plan['input_files']}")
    assert plan["steps"][1]["batch_format"] in ("numpy", "default"), (
        f"expected batch_format='numpy' (dicts of arrays), got {plan['steps'][1]['batch_format']!r}")


def check_rows_visible(rows: dict) -> None:
    assert len(rows["label"]) == 101, f"expected the file's 101 rows, each once; got {len(rows['label'])}"


def check_rows(rows: dict, expected: dict) -> None:
    """Every row of the file exactly once, as (your) preprocess makes it: ``expected`` is preprocess applied to
    the same 101 digits directly."""
    check_rows_visible(rows)
    got_images = np.asarray(rows["image"], dtype=np.float64).reshape(len(rows["label"]), -1)
    want_images = np.asarray(expected["image"], dtype=np.float64).reshape(len(expected["label"]), -1)
    distances = ((got_images[:, None, :] - want_images[None, :, :]) ** 2).sum(-1)
    match = distances.argmin(axis=1)   # the source row of each output row
    assert sorted(match.tolist()) == list(range(101)), (
        f"expected every row of the files once, as preprocess makes it; {101 - len(set(match.tolist()))} of the 101 "
        "rows never came out so")
    assert distances[np.arange(101), match].max() < 1e-10, (
        "expected the rows exactly as preprocess makes them (once), got differences up to "
        f"{distances[np.arange(101), match].max():.2e}")
    assert np.array_equal(np.asarray(rows["label"]), np.asarray(expected["label"])[match]), (
        f"expected each row's label with its image; "
        f"{int((np.asarray(rows['label']) != np.asarray(expected['label'])[match]).sum())} differ")
    assert np.asarray(rows["image"]).dtype == np.asarray(expected["image"]).dtype, (
        f"expected the images in preprocess's dtype {np.asarray(expected['image']).dtype}, got "
        f"{np.asarray(rows['image']).dtype}")


# ---------------------------------------------------------------- make_trainer
# a trainer described: {"type", "data_cpus", "datasets", "materialized", "ids", "train_loop_config",
# "scaling", "storage_path", "name", "ran_train_func"}

CHECK_STORAGE = "/mnt/cluster_storage/check-runs"   # never written: the trainer is built, not run
CHECK_LOOP_CONFIG = {"epochs": 7, "global_batch_size": 48, "lr": 0.01}
CHECK_SCALING = {"num_workers": 3, "resources_per_worker": {"CPU": 0.25}}


def check_trainer(got: dict, data_cpus: float, scaling: dict) -> None:
    """The Dataset under 'train' (lazy, its rows), Ray Data capped at data_cpus, the other arguments as given.
    ``scaling``: the ScalingConfig given, described (coursekit.exercise_checks.ray_train.describe_scaling)."""
    where = f"make_trainer(..., data_cpus={data_cpus})"
    assert got.get("type") == "TorchTrainer", f"{where}: expected a TorchTrainer, got {got.get('type')}"
    assert got["data_cpus"] == data_cpus, (
        f"{where}: expected the trainer's DataConfig to cap Ray Data at data_cpus={data_cpus} CPUs (its execution "
        f"options' resource limits), got a CPU limit of {got['data_cpus']}")
    assert got["datasets"] == ["train"], f"{where}: expected one Dataset, named 'train', got {got['datasets']}"
    assert not got["materialized"], (
        f"{where}: the trainer got a materialized Dataset (every row held in the object store before training "
        "starts), expected the lazy one, streamed while training")
    assert got["ids"] == list(range(10)), (
        f"{where}: the Dataset named 'train' must give the rows of the one passed in (ids 0..9), got {got['ids']}")
    assert got["train_loop_config"] == CHECK_LOOP_CONFIG, (
        f"{where}: expected train_loop_config as given, got {got['train_loop_config']}")
    assert got["scaling"] == scaling, f"{where}: expected the scaling_config given, got {got['scaling']}"
    assert (got["storage_path"], got["name"]) == (CHECK_STORAGE, f"check-{data_cpus}"), (
        f"{where}: expected the run_config given, got storage_path={got['storage_path']!r}, name={got['name']!r}")
    assert got["ran_train_func"], f"{where}: expected the trainer to run the train_func given"


# ---------------------------------------------------------------- train_func
# a run described: {"reports": [per rank: [[metrics, model.pt's state or None], ...]], "requests": [per rank:
# [[name, method, batch_size], ...]], "batch_sizes": [per rank: [per epoch: [rows of each batch]]],
# "ids": [per rank: [per epoch: the ids of the rows it was sent, in order]]}

ORACLE_CONFIG = dict(epochs=2, global_batch_size=32, lr=0.05, model="small_cnn", optimizer="sgd", seed=0)
ORACLE_WORKERS, ORACLE_PER_NODE, ORACLE_ROWS = 4, 2, 202          # 2 nodes x 2 workers
ONE_WORKER_CONFIG = dict(epochs=2, global_batch_size=24, lr=0.01, model="small_cnn", optimizer="adam", seed=1)


def oracle_columns() -> dict:
    """The rows the workers read: 202 digits, already preprocessed, with their ids."""
    from coursekit.data import load_digits, normalize

    digits = load_digits(train=True, limit=ORACLE_ROWS, quiet=True)
    return {"image": normalize(digits.images).numpy(), "label": digits.labels.numpy().astype(np.int64),
            "id": np.arange(len(digits))}


def sent_rows(run: dict, epochs: int) -> list:
    """sent[e][r]: the rows worker r was sent in epoch e, rebuilt from their ids and the oracle's data."""
    columns = oracle_columns()
    workers = len(run["ids"])
    return [[{k: v[np.asarray(run["ids"][r][e], dtype=np.int64)] for k, v in columns.items()}
             for r in range(workers)] for e in range(epochs)]


def check_shard_visible(run: dict, reference_train) -> float:
    """Each worker read its 'train' shard with iter_torch_batches once per epoch, and rank 0's last model equals
    one process trained on the global batches made of what the workers were sent. Returns the difference."""
    epochs, workers = ORACLE_CONFIG["epochs"], ORACLE_WORKERS
    asked = [[(name, method) for name, method, _ in run["requests"][r]] for r in range(workers)]
    assert all(a == [("train", "iter_torch_batches")] * epochs for a in asked), (
        f"expected every worker to read its 'train' shard with iter_torch_batches once per epoch ({epochs}); asked: {asked}")
    assert all(len(run["ids"][r]) == epochs and all(e is not None for e in run["ids"][r]) for r in range(workers)), (
        "expected the shard's batches to be iterated as dicts of tensors")
    reports = run["reports"]
    assert reports[0] and reports[0][-1][1] is not None, (
        "expected rank 0 to report a checkpoint with model.pt (save_checkpoint_and_report), got none")
    ref_state, _ = reference_train(ORACLE_CONFIG, sent_rows(run, epochs), ORACLE_CONFIG["global_batch_size"] // workers)
    diff = max_difference(reports[0][-1][1], ref_state)
    assert diff < 1e-5, (f"expected the 4 ranks to train exactly like one process on the global batches (difference "
                         f"below 1e-5), got {diff:.2e}: check the per-worker batch size and that batches are used as they "
                         "come (Ray Data preprocessed them)")
    return diff


def check_shard(run: dict) -> None:
    """Batches of global batch // workers, nothing dropped, disjoint shards."""
    epochs, workers = ORACLE_CONFIG["epochs"], ORACLE_WORKERS
    sizes = [batch_size for r in range(workers) for _, _, batch_size in run["requests"][r]]
    assert sizes == [8] * (workers * epochs), (
        f"expected iter_torch_batches(batch_size=global batch // number of workers in the job = 32 // 4 = 8); asked for {sizes}")
    assert all(s == [8] * 6 + [2] for r in range(workers) for s in run["batch_sizes"][r]), (
        f"expected each worker's 50 rows as 6 batches of 8 and one of 2 (nothing dropped), got {run['batch_sizes']}")
    for e in range(epochs):   # disjoint, together every row but the 202 - 4 * 50 left over
        ids = [np.asarray(run["ids"][r][e]) for r in range(workers)]
        assert all(len(i) == 50 for i in ids), f"expected 202 // 4 = 50 rows per worker and epoch, got {[len(i) for i in ids]}"
        together = np.concatenate(ids)
        assert len(np.unique(together)) == 200 and set(together.tolist()) <= set(range(ORACLE_ROWS)), (
            f"expected disjoint shards, got {len(together) - len(np.unique(together))} rows read by two workers")


def check_report_visible(run: dict) -> list:
    assert len(run["reports"][0]) == ORACLE_CONFIG["epochs"], (
        f"expected one report per epoch ({ORACLE_CONFIG['epochs']}), got {len(run['reports'][0])}")
    return [m.get("loss") for m, _ in run["reports"][0]]


def check_report(run: dict, reference_train) -> None:
    """Every rank reports every epoch, only rank 0 a checkpoint, the mean loss over all workers."""
    runs = run["reports"]
    epochs = ORACLE_CONFIG["epochs"]
    _, ref_losses = reference_train(ORACLE_CONFIG, sent_rows(run, epochs),
                                    ORACLE_CONFIG["global_batch_size"] // ORACLE_WORKERS)
    assert all([m.get("epoch") for m, _ in w] == list(range(epochs)) for w in runs), (
        f"expected every rank to report every epoch, counted from 0; got {[[m.get('epoch') for m, _ in w] for w in runs]}")
    assert all(state is None for w in runs[1:] for _, state in w), "expected only rank 0 to attach a checkpoint"
    for w in runs:
        got = [m["loss"] for m, _ in w]
        assert all(isinstance(x, (int, float)) for x in got) and np.allclose(got, ref_losses, rtol=1e-4, atol=1e-6), (
            f"report the epoch's mean loss per example over ALL workers (sum loss * batch and the count, "
            f"all_reduce both): expected {ref_losses}, got {got}")


def check_epoch_reports(run: dict, epochs: int) -> list:
    """The only worker reported once per epoch, the last report with a checkpoint; its reports."""
    reports = run["reports"][0]
    assert len(reports) == epochs and reports[-1][1] is not None, (
        f"expected one report per epoch ({epochs}), the last with a checkpoint; got {len(reports)} report(s), "
        f"checkpoints: {[state is not None for _, state in reports]}")
    return reports


def check_one_worker_visible(run: dict) -> None:
    check_epoch_reports(run, ONE_WORKER_CONFIG["epochs"])


def check_one_worker(run: dict, reference_train, config: dict = ONE_WORKER_CONFIG) -> None:
    """The only worker trains like one process on the same batches of the whole global batch."""
    epochs = config["epochs"]
    reports = check_epoch_reports(run, epochs)
    solo_state, solo_losses = reference_train(config, sent_rows(run, epochs), config["global_batch_size"])
    diff = max_difference(reports[-1][1], solo_state)
    assert diff < 1e-5, (f"1 worker, {config['model']}: expected the weights of one process on the same batches of "
                         f"{config['global_batch_size']} (the whole global batch on the only worker, the model in "
                         f"training mode), differing by at most 1e-5; got {diff:.2e}")
    got = [m.get("loss") for m, _ in reports]
    assert all(isinstance(x, (int, float)) for x in got) and np.allclose(got, solo_losses, rtol=1e-4, atol=1e-6), (
        f"1 worker: expected the epochs' mean losses per example {solo_losses}, got {got}")


def check_device(seen: list, error: str | None) -> None:
    """train_func on a worker whose device is the meta device (standing in for a GPU): it worked, and every
    collective got tensors on that device."""
    assert error is None, (
        f"train_func failed on a worker whose device is not the CPU (ray.train.torch.get_device() returned the meta "
        f"device, standing in for a GPU): {error}. Expected it to work on the worker's device: keep what you "
        "compute on ray.train.torch.get_device()")
    off = [(name, devices) for name, devices in seen if any(d != "meta" for d in devices)]
    assert not off, (
        f"train_func gave dist.{off[0][0]}() a tensor on {', '.join(d for d in off[0][1] if d != 'meta')} while "
        "ray.train.torch.get_device() was the meta device (standing in for cuda:N), expected the worker's device. A "
        "tensor made with torch.zeros(...) or torch.tensor(...) and no device= is on the CPU: on GPU workers Ray Train's "
        "process group is NCCL's, which reduces GPU tensors only, and this all-reduce would fail. Create the sums with "
        "device=ray.train.torch.get_device()")
