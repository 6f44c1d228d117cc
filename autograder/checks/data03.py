"""Module 03's code exercises, judged outside the kernel: what preprocess returned, the plans and rows of the
Dataset build_train_dataset built, the trainer make_trainer built, and what train_func's workers read and reported,
each test cell's data checked with the visible checks (``coursekit.exercise_checks.ray_data``) and the hidden ones,
on the notebook's cases and on those that only the grader knows (``ASKED``). The inputs (the check's batches, the
oracle's rows) and the single-process reference are made here, never taken from the kernel."""
from __future__ import annotations

from autograder.checks.references import check_batchnorm_counts, reference_train_03
from coursekit.evidence import array, tensor
from coursekit.exercise_checks import ray_data as rd

# a model with BatchNorm, whose training depends on the model's mode: its run is judged by what its BatchNorm layers
# counted (see train_func_one_worker)
BATCHNORM = dict(rd.ONE_WORKER_CONFIG, model="small_cnn_bn", global_batch_size=101, optimizer="sgd", lr=0.05, epochs=2,
                 seed=6)
ASKED = {"test_preprocess_values": ["random", "one"],
         "test_preprocess_columns": ["all_columns"],
         "test_build_train_dataset_resources": [[1.5, 1, 8], [0.5, 2, 16]],
         "test_build_train_dataset_plan": [[0.75, 4, 20]],
         "test_make_trainer": [1.5],
         # one worker with other settings: another seed, SGD, 3 epochs; and BATCHNORM
         "test_train_func_one_worker": [dict(rd.ONE_WORKER_CONFIG, optimizer="sgd", lr=0.05, epochs=3, seed=4),
                                        BATCHNORM]}


def _arrays(value):
    """Handed-in data with every encoded array and tensor decoded."""
    if isinstance(value, dict):
        if "__ndarray__" in value:
            return array(value)
        if "__tensor__" in value:
            return tensor(value)
        return {k: _arrays(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_arrays(v) for v in value]
    return value


def _entry(data, field: str, key: str, wanted, what: str):
    for entry in (data or {}).get(field, []):
        if entry.get(key) == wanted:
            if entry.get("error"):
                raise AssertionError(f"{what} raised {entry['error']}")
            return _arrays(entry["value"])
    raise AssertionError(f"the test cell handed in no result of {what}: run its cells in order, without errors, up "
                         "to the end of the test cell")


def preprocess_values(data):
    rd.check_values_visible(_entry(data, "cases", "case", "values", "preprocess")["out"])
    rd.check_values(_entry(data, "cases", "case", "random", "preprocess")["out"],
                    _entry(data, "cases", "case", "one", "preprocess on one image")["out"])
    return "ToTensor() + Normalize((0.5,), (0.5,)) values, float32 [B, 1, 28, 28], a batch of one too"


def preprocess_columns(data):
    rd.check_columns_visible(_entry(data, "cases", "case", "columns", "preprocess")["out"])
    result = _entry(data, "cases", "case", "all_columns", "preprocess")
    rd.check_columns(result["out"], result["given"])
    return "int64 labels, the other columns kept, the arrays given left unchanged"


def _plan(data, case):
    return _entry(data, "plans", "case", list(case), f"build_train_dataset(..., {', '.join(map(str, case))})")


def build_train_dataset_resources(data):
    for case in [[0.25, 3, 37], *ASKED["test_build_train_dataset_resources"]]:
        rd.check_resources(_plan(data, case), *case)
    return "map_batches reserves the CPUs, the number of tasks and the batch size it is given"


def build_train_dataset_plan(data):
    rd.check_plan_visible(_plan(data, [0.5, 2, 64]))
    rd.check_plan(_plan(data, ASKED["test_build_train_dataset_plan"][0]))
    return "a lazy read -> map_batches over the folder's Parquet files"


def build_train_dataset_rows(data):
    assert data and not data.get("error"), f"the pipeline failed: {(data or {}).get('error')}"
    value = _arrays(data["value"])
    rd.check_rows(value["rows"], value["expected"])
    return "every row of the files once, as preprocess makes it"


def make_trainer(data):
    from ray.train import ScalingConfig

    from coursekit.exercise_checks.ray_train import describe_scaling

    scaling = describe_scaling(ScalingConfig(**rd.CHECK_SCALING))
    for cpus in [0.75, *ASKED["test_make_trainer"]]:
        rd.check_trainer(_entry(data, "trainers", "data_cpus", cpus, f"make_trainer(..., data_cpus={cpus})"), cpus,
                         scaling)
    return "the Dataset under 'train', Ray Data capped at the CPUs given, the arguments as given"


def _run(data, what):
    assert data and not data.get("error"), f"train_func failed {what}. The error:\n{str((data or {}).get('error'))[-1500:]}"
    return _arrays(data["run"])


def train_func_shard(data):
    run = _run(data, "on 4 workers (2 nodes x 2)")
    diff = rd.check_shard_visible(run, reference_train_03)
    rd.check_shard(run)
    return f"disjoint shards in batches of 8, the weights of one process (max |difference| {diff:.1e})"


def train_func_report(data):
    run = _run(data, "on 4 workers (2 nodes x 2)")
    rd.check_report_visible(run)
    rd.check_report(run, reference_train_03)
    return "every worker reports the mean loss over all workers every epoch; only rank 0 a checkpoint"


def train_func_one_worker(data):
    run = _run(data, "on 1 worker without a process group")
    rd.check_one_worker(run, reference_train_03)
    for config in ASKED["test_train_func_one_worker"]:
        entry = next((e for e in data.get("asked") or [] if e.get("config") == config), None)
        assert entry is not None, ("the test cell handed in no run of train_func on 1 worker with the grader's "
                                   "settings: run its cells in order, up to the end of the test cell")
        assert not entry.get("error"), (f"train_func failed on 1 worker with {config}. The error:\n"
                                        f"{str(entry['error'])[-1500:]}")
        run = _arrays(entry["value"])
        if config == BATCHNORM:
            # the last checkpoint counts every step of every epoch when each ran in training mode (the weights are
            # left to the small_cnn runs: one process's batch statistics on another thread count round differently,
            # a mode does not)
            reports = rd.check_epoch_reports(run, config["epochs"])
            steps = config["epochs"] * -(-rd.ORACLE_ROWS // config["global_batch_size"])
            check_batchnorm_counts(reports[-1][1], steps, f"1 worker, {config['model']}, {config['epochs']} epochs")
        else:
            rd.check_one_worker(run, reference_train_03, config)
    return "one worker trains like one process on the whole global batch, with two settings, in training mode"


def train_func_device(data):
    assert data is not None and "seen" in data, "the test cell handed in nothing: run it to its end"
    rd.check_device([(name, devices) for name, devices in data["seen"]], data.get("error"))
    return "the sums are all-reduced on the worker's device"


CHECKS = {f"test_{f.__name__}": f for f in (
    preprocess_values, preprocess_columns, build_train_dataset_resources, build_train_dataset_plan,
    build_train_dataset_rows, make_trainer, train_func_shard, train_func_report, train_func_one_worker,
    train_func_device)}
