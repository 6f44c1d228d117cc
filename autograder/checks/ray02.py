"""Module 02's code exercises, judged outside the kernel: the configs, trainers, worker runs and loaded models each
test cell handed in, checked with the visible checks (``coursekit.exercise_checks.ray_train``) on the notebook's
cases and on the hidden ones that only the grader knows (``ASKED``). The single-process reference and the weights
written into checkpoints are computed here, never taken from the kernel."""
from __future__ import annotations

from autograder.checks.references import check_batchnorm_counts, reference_for
from coursekit.evidence import tensor
from coursekit.exercise_checks import ray_train as rt

CPUS = {"num_workers": 3, "use_gpu": False, "cpus_per_worker": 0.5}
GPUS = {"num_workers": 2, "use_gpu": True, "cpus_per_worker": 1}
HIDDEN_CHOICES = [{"num_workers": 1, "use_gpu": False, "cpus_per_worker": 2},
                  {"num_workers": 2, "use_gpu": True, "cpus_per_worker": 4},
                  {"num_workers": 1, "use_gpu": True, "cpus_per_worker": 8},
                  {"num_workers": 4, "use_gpu": False, "cpus_per_worker": 1.5},
                  {"num_workers": 3, "use_gpu": False, "cpus_per_worker": 0.5},
                  {"num_workers": 8, "use_gpu": True, "cpus_per_worker": 0.5}]

ORACLE = rt.ORACLE_CONFIG
ADAM = dict(epochs=2, global_batch_size=30, train_samples=180, lr=0.01, model="small_cnn", optimizer="adam", seed=3)
UNEVEN = dict(ORACLE, epochs=1)                                  # 32 examples per step do not split over 3
UNEVEN_HIDDEN = dict(ORACLE, global_batch_size=30, epochs=1)     # 30 = 4 x 7 + 2 (but 2 x 15 per node)
# 200 examples over 2 workers: 100 each, 6 batches of 16 and 4 left over (drop_last drops them, as the reference's
# global batches of 32 drop the last 8); 3 epochs
LEFT_OVER = dict(ORACLE, train_samples=200, epochs=3, seed=5)
# small_cnn with BatchNorm (small_cnn_bn): with BatchNorm DDP is not one big batch, so this run is not compared with
# one process; its last model.pt says whether every step of every epoch trained in training mode (each one counted
# in num_batches_tracked). Two epochs: a loop that calls model.train() once before them and leaves the model in eval
# mode after the first (an evaluation at the end of each epoch, coursekit.models.accuracy included) counts half
BATCHNORM = dict(ORACLE, model="small_cnn_bn", train_samples=64, epochs=2, lr=0.02, seed=2)
RUNS = {"test_train_func_same_weights": ([2, ORACLE, 2], [[4, ORACLE, 2], [3, ADAM, 1], [2, LEFT_OVER, 2]]),
        "test_train_func_reports": ([2, ORACLE, 2], [[4, ORACLE, 2], [3, ADAM, 1], [2, BATCHNORM, 2]]),
        "test_train_func_uneven_batch": ([3, UNEVEN, 3], [[4, UNEVEN_HIDDEN, 2]]),
        "test_train_func_one_worker": ([1, ORACLE, 1], [[1, ADAM, 1]]),
        "test_train_func_device": ([2, ORACLE, 2], [[4, ORACLE, 2], [3, ADAM, 1]])}

_TRAINER = {"scaling": {"num_workers": 2}, "storage_path": "/mnt/cluster_storage/runs", "name": "visible-check",
            "train_loop_config": {"lr": 0.1}, "num_to_keep": 2, "score_attribute": "loss", "score_order": "min"}
HIDDEN_KEEP = [dict(_TRAINER, storage_path="/mnt/shared/runs", name="keep", num_to_keep=keep, score_attribute=attribute,
                    score_order=order)
               for keep, attribute, order in [(None, "accuracy", "max"), (1, "val_error", "min"), (3, "reward", "max"),
                                              (2, "neg_loss", "max")]]
HIDDEN_RUN = [dict(_TRAINER, scaling={"num_workers": 3, "resources_per_worker": {"CPU": 0.5}},
                   storage_path="s3://course-bucket/runs", name="nightly-7", train_loop_config=dict(lr=0.01, epochs=4)),
              dict(_TRAINER, scaling={"num_workers": 2, "use_gpu": True, "resources_per_worker": {"CPU": 4}},
                   storage_path="gs://course-bucket/ray-train-course", name="best-accuracy",
                   train_loop_config=dict(lr=0.3, seed=1)),
              dict(_TRAINER, scaling={"num_workers": 1}, storage_path="/mnt/cluster_storage/ray-train-course",
                   name="one", train_loop_config=dict(lr=0.2))]
MODELS = {"test_load_model_storage": (["memory", 1], [["subtree", 2], ["memory", 4], ["untrusted", 3]]),
          "test_load_model_for_inference": (["gpu", 5], [["gpu", 6], ["cpu", 6]])}

ASKED = {"test_scaling_config_for_cpus": HIDDEN_CHOICES[:4], "test_scaling_config_for_gpus": HIDDEN_CHOICES[2:],
         **{gid: hidden for gid, (_, hidden) in RUNS.items()},
         "test_build_trainer_checkpoints": HIDDEN_KEEP, "test_build_trainer_run": HIDDEN_RUN,
         **{gid: hidden for gid, (_, hidden) in MODELS.items()}}


def _entry(data: dict | None, field: str, key: str, wanted, what: str):
    for entry in (data or {}).get(field, []):
        if entry.get(key) == wanted:
            if entry.get("error"):
                raise AssertionError(f"{what} raised {entry['error']}")
            return entry["value"]
    raise AssertionError(f"the test cell handed in no result of {what}: run its cells in order, without errors, up "
                         "to the end of the test cell")


def _scaling(check, visible, hidden):
    def judge(data):
        for choice in [visible, *hidden]:
            check(choice, _entry(data, "configs", "choice", choice, f"scaling_config_for({choice})"))
        return f"{1 + len(hidden)} choices of workers, GPUs and CPUs"
    return judge


def _decode_run(by_rank: list) -> list:
    """A run's ranks with every model.pt state dict made tensors again."""
    out = []
    for rank in by_rank:
        rank = dict(rank)
        if "reports" in rank:
            rank["reports"] = [[metrics, None if state is None else {k: tensor(v) for k, v in state.items()}]
                               for metrics, state in rank["reports"]]
        out.append(rank)
    return out


def _batchnorm_trained(by_rank: list, config: dict, local: int) -> str:
    """A run of a model with BatchNorm: rank 0's last model.pt counts every step of every epoch in each BatchNorm's
    num_batches_tracked (a model left in eval mode, or put there, normalises with its running statistics and never
    updates them)."""
    reports = rt.trained(by_rank, config, local)
    last = reports[0][-1][1] if reports[0] else None
    assert last is not None, "world rank 0 attaches a checkpoint with model.pt to its last report"
    steps = config["epochs"] * (config["train_samples"] // config["global_batch_size"])
    check_batchnorm_counts(last, steps, f"{config['model']} on {len(by_rank)} workers, {config['epochs']} epochs")
    return f"BatchNorm trained in training mode ({steps} steps counted)"


def _runs(gid):
    visible, hidden = RUNS[gid]
    check = {"test_train_func_same_weights": lambda r, c, n: rt.check_same_weights(r, c, n, reference_for(c)),
             "test_train_func_reports": lambda r, c, n: rt.check_reports(r, c, n, reference_for(c)),
             "test_train_func_uneven_batch": lambda r, c, n: rt.check_refused(r, c),
             "test_train_func_one_worker": lambda r, c, n: rt.check_one_worker(r, c),
             "test_train_func_device": lambda r, c, n: rt.check_device(r, c, local_world_size=n)}[gid]

    def judge(data):
        done = []
        for ws, config, local in [visible, *hidden]:
            by_rank = _entry(data, "runs", "layout", [ws, config, local],
                             f"train_func on {ws} worker(s), {local} per node")
            assert isinstance(by_rank, list) and len(by_rank) == ws, f"{len(by_rank or [])} ranks handed in, not {ws}"
            done.append((_batchnorm_trained if config.get("model") == BATCHNORM["model"] else check)(
                _decode_run(by_rank), config, local))
        return "; ".join(done)
    return judge


def _trainers(check, visible, hidden):
    def judge(data):
        from ray.train import ScalingConfig

        for case in [visible, *hidden]:
            got = _entry(data, "trainers", "case", case, f"build_trainer for {case}")
            check({**case, "scaling": rt.describe_scaling(ScalingConfig(**case["scaling"]))}, got)
        return f"{1 + len(hidden)} trainers built from their arguments"
    return judge


def _refused(data: dict | None, case: list) -> None:
    """load_model on a model.pt whose pickle calls a function: torch.load(weights_only=True) refuses it."""
    for entry in (data or {}).get("models", []):
        if entry.get("case") == case:
            error = str(entry.get("error") or "")
            assert error, ("load_model loaded a model.pt whose pickle calls a function while it is read (anyone who "
                           "can write to the storage could have put it there): expected torch.load(..., "
                           "weights_only=True), torch's default, to refuse it; do not pass weights_only=False")
            assert "Weights only load failed" in error or "Unpickling" in error, (
                f"load_model on a model.pt whose pickle calls a function should fail in torch.load(weights_only=True)'s "
                f"refusal; it raised {error[:300]}")
            return
    raise AssertionError("the test cell handed in no result of load_model on an untrusted model.pt: run its cells in "
                         "order, without errors, up to the end of the test cell")


def _models(gid):
    visible, hidden = MODELS[gid]
    check = rt.check_loaded if gid == "test_load_model_storage" else rt.check_for_inference

    def judge(data):
        for storage, seed in [visible, *hidden]:
            if storage == "untrusted":
                _refused(data, [storage, seed])
                continue
            got = dict(_entry(data, "models", "case", [storage, seed], f"load_model on a checkpoint in {storage} storage"))
            got["state"] = {k: tensor(v) for k, v in got.get("state", {}).items()}
            check(got, "small_cnn", rt.seeded_weights(seed))
        return (f"{1 + len(hidden)} checkpoints ({', '.join(sorted({s for s, _ in [visible, *hidden]}))}) loaded, "
                "or refused when untrusted")
    return judge


CHECKS = {"test_scaling_config_for_cpus": _scaling(rt.check_scaling_cpus, CPUS, ASKED["test_scaling_config_for_cpus"]),
          "test_scaling_config_for_gpus": _scaling(rt.check_scaling_gpus, GPUS, ASKED["test_scaling_config_for_gpus"]),
          **{gid: _runs(gid) for gid in RUNS},
          "test_build_trainer_checkpoints": _trainers(rt.check_trainer_checkpoints, _TRAINER, HIDDEN_KEEP),
          "test_build_trainer_run": _trainers(rt.check_trainer_run, _TRAINER, HIDDEN_RUN),
          **{gid: _models(gid) for gid in MODELS}}
