"""Module 02's checks on plain data: the ScalingConfig and the TorchTrainer described field by field, what each
simulated Ray Train worker reported (``train_func``) against one process on the whole global batch, and the model
``load_model`` returned."""
from __future__ import annotations

import numbers

import torch

from coursekit.models import build_model

ORACLE_CONFIG = dict(epochs=2, global_batch_size=32, train_samples=256, lr=0.05,
                     model="small_cnn", optimizer="sgd", seed=0)


def max_difference(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ---------------------------------------------------------------- scaling_config_for
# a ScalingConfig described: {"type", "num_workers", "use_gpu", "num_cpus_per_worker", "num_gpus_per_worker"}

def describe_scaling(config) -> dict:
    """The fields of a ScalingConfig that the checks read (plain data), or its type when it is not one."""
    from ray.train import ScalingConfig

    if not isinstance(config, ScalingConfig):
        return {"type": type(config).__name__}
    return {"type": "ScalingConfig", "num_workers": config.num_workers, "use_gpu": config.use_gpu,
            "num_cpus_per_worker": config.num_cpus_per_worker, "num_gpus_per_worker": config.num_gpus_per_worker,
            "resources_per_worker": config.resources_per_worker}


def _is_scaling(got: dict) -> None:
    assert got.get("type") == "ScalingConfig", f"return a ray.train.ScalingConfig, not {got.get('type')}"


def check_scaling_cpus(choice: dict, got: dict) -> None:
    """Workers and CPUs per worker as chosen."""
    _is_scaling(got)
    expected, seen = (choice["num_workers"], choice["cpus_per_worker"]), (got["num_workers"], got["num_cpus_per_worker"])
    assert seen == expected, (
        f"for the choice {choice}, expected (num_workers, CPUs per worker) = {expected}, got {seen}: name the CPUs in "
        "resources_per_worker (without them Ray reserves 1 per CPU worker); every worker reserves the chosen CPUs, "
        "GPU workers too")


def check_scaling_gpus(choice: dict, got: dict) -> None:
    """GPU workers get one GPU each; CPU workers none."""
    _is_scaling(got)
    expected = (choice["num_workers"], choice["use_gpu"], 1 if choice["use_gpu"] else 0)
    seen = (got["num_workers"], got["use_gpu"], got["num_gpus_per_worker"])
    assert seen == expected, (f"for the choice {choice}, expected (num_workers, use_gpu, GPUs per worker) = "
                              f"{expected}, got {seen}")


# ---------------------------------------------------------------- build_trainer
# a trainer described: {"type", "checkpoint": [num_to_keep, attribute, order], "scaling": describe_scaling(...),
# "storage_path", "name", "train_loop_config", "received": what train_loop_per_worker(dict(config)) received}

def check_trainer_checkpoints(case: dict, got: dict) -> None:
    assert got.get("type") == "TorchTrainer", f"return a ray.train.torch.TorchTrainer, not {got.get('type')}"
    expected = [case["num_to_keep"], case["score_attribute"], case["score_order"]]
    assert got["checkpoint"] == expected, (
        "CheckpointConfig(num_to_keep, checkpoint_score_attribute, checkpoint_score_order) in the RunConfig should be "
        f"{tuple(expected)}, got {tuple(got['checkpoint'])}: use the arguments as given")


def check_trainer_run(case: dict, got: dict) -> None:
    assert got.get("type") == "TorchTrainer", f"return a ray.train.torch.TorchTrainer, not {got.get('type')}"
    scaling = case["scaling"]
    assert got["scaling"] == scaling, f"use the scaling_config you were given ({scaling}), got {got['scaling']}"
    seen, storage, name = (got["storage_path"], got["name"]), case["storage_path"], case["name"]
    assert seen == [storage, name] or tuple(seen) == (storage, name), (
        f"RunConfig(storage_path={storage!r}, name={name!r}) expected, got {tuple(seen)}: hand the storage path to "
        "RunConfig as it is (a URI such as s3://... is not a local path)")
    loop = case["train_loop_config"]
    assert got["train_loop_config"] == loop, f"train_loop_config={loop} expected, got {got['train_loop_config']}"
    assert got["received"] == [loop], "the trainer must run the train_func it was given"


# ---------------------------------------------------------------- train_func
# by_rank[rank] = {"reports": [[metrics, model.pt's state dict or None], ...], "device_problems": [...]}
# or {"raised": "ValueError: ...", "device_problems": [...]}

def where(rank: int, local_world_size: int) -> str:
    return f"rank {rank} (local rank {rank % local_world_size} on node {rank // local_world_size})"


def trained(by_rank: list, config: dict, local_world_size: int) -> list:
    """Every rank's reports, after checking that no rank refused a global batch that splits evenly."""
    raised = [r for r, out in enumerate(by_rank) if "raised" in out]
    assert not raised, (f"{where(raised[0], local_world_size)} raised {by_rank[raised[0]]['raised']}, but a global "
                        f"batch of {config['global_batch_size']} splits evenly over {len(by_rank)} workers")
    return [out["reports"] for out in by_rank]


def check_same_weights(by_rank: list, config: dict, local_world_size: int, reference: dict) -> str:
    """Rank 0's last model.pt equals one process trained on the full global batch (``reference``: the weights
    "state" and each epoch's mean loss "losses" of that process)."""
    reports = trained(by_rank, config, local_world_size)
    last = reports[0][-1][1] if reports[0] else None
    assert last is not None, ("world rank 0 attaches a checkpoint with model.pt to its last report; the check "
                              f"compares its weights, but rank 0 reported {[m for m, _ in reports[0]]} without one")
    state = {k.removeprefix("module."): v for k, v in last.items()}   # the keys are check_reports' business
    assert sorted(state) == sorted(reference["state"]), (
        f"model.pt should hold {config['model']}'s weights {sorted(reference['state'])}, got {sorted(state)}")
    diff = max_difference(state, reference["state"])
    assert diff < 1e-5, (
        f"after training on {len(by_rank)} workers ({local_world_size} per node), rank 0's model differs from one "
        f"process on the full global batch by {diff:.1e} (tolerance 1e-5): check the per-worker batch size, the "
        "seed, the optimizer and lr from the config, prepare_data_loader and set_epoch")
    return (f"{len(by_rank)} workers, {local_world_size} per node: the same weights as one process on the full "
            f"batch (max |difference| {diff:.1e})")


def check_reports(by_rank: list, config: dict, local_world_size: int, reference: dict) -> str:
    """Every worker reports every epoch the mean loss over all workers; only world rank 0 attaches a checkpoint,
    whose model.pt loads into a plain model."""
    reports = trained(by_rank, config, local_world_size)
    epochs = list(range(config["epochs"]))
    for rank, mine in enumerate(reports):
        assert [m.get("epoch") for m, _ in mine] == epochs, (
            f"{where(rank, local_world_size)} must call ray.train.report once per epoch with 'epoch' in {epochs}; "
            f"it reported {[m for m, _ in mine]} (every worker reports: report is a barrier)")
        for metrics, state in mine:
            loss = metrics.get("loss")
            assert isinstance(loss, numbers.Real) and not isinstance(loss, bool), (
                "report the loss as a Python number (.item()): Ray Train refuses tensors in metrics; "
                f"{where(rank, local_world_size)} sent {loss!r}")
            if rank == 0:
                assert state is not None, f"world rank 0 attaches a checkpoint with model.pt every epoch ({metrics})"
            else:
                assert state is None, (f"only world rank 0 attaches a checkpoint; {where(rank, local_world_size)} "
                                       f"did too ({metrics})")
    for epoch in epochs:
        losses = [mine[epoch][0]["loss"] for mine in reports]
        assert max(losses) - min(losses) < 1e-6, (
            f"epoch {epoch}: the workers reported different losses {losses}; the loss over all workers is one "
            "number, the same on every worker (add the sums up with dist.all_reduce)")
    mean_loss = reference["losses"][0]
    assert abs(reports[0][0][0]["loss"] - mean_loss) < 1e-5, (
        f"epoch 0: the workers reported {reports[0][0][0]['loss']:.6f}, but the mean training loss over all workers "
        f"is {mean_loss:.6f} (a sum over workers, or the mean of the last batch, is not)")
    try:
        build_model(config["model"]).load_state_dict(reports[0][-1][1])   # strict: no 'module.' prefix
    except RuntimeError as e:
        raise AssertionError("model.pt must hold the unwrapped model's state_dict, which loads into a plain "
                             f"build_model({config['model']!r}) (keys like '0.weight', not 'module.0.weight'): "
                             f"{str(e)[:300]}") from None
    return (f"{len(by_rank)} workers, {local_world_size} per node: every worker reports the mean loss over all "
            "workers every epoch; only world rank 0 checkpoints, a model.pt that loads into a plain model")


def check_refused(by_rank: list, config: dict) -> str:
    """Every rank raised a ValueError for a global batch that does not split evenly."""
    quiet = [r for r, out in enumerate(by_rank) if "raised" not in out]
    assert not quiet, (f"a global batch of {config['global_batch_size']} does not split over {len(by_rank)} "
                       f"workers: every worker must raise ValueError (rank {quiet[0]} trained instead)")
    return f"{len(by_rank)} workers refuse a global batch of {config['global_batch_size']}: {by_rank[0]['raised']}"


def check_one_worker(by_rank: list, config: dict) -> str:
    """One worker (prepare_model does not wrap): one report per epoch, each with a model.pt for a plain model."""
    (reports,) = trained(by_rank, config, 1)
    assert [m.get("epoch") for m, _ in reports] == list(range(config["epochs"])), (
        f"one worker must report once per epoch {list(range(config['epochs']))}, it reported {[m for m, _ in reports]}")
    for metrics, state in reports:
        assert state is not None, f"the only worker is world rank 0: it attaches a checkpoint every epoch ({metrics})"
        try:
            build_model(config["model"]).load_state_dict(state)   # strict: no 'module.' prefix, no missing keys
        except RuntimeError as e:
            raise AssertionError(f"with one worker, model.pt does not load into a plain model: {str(e)[:300]}") from None
        assert isinstance(metrics.get("loss"), numbers.Real), f"report the loss as a Python number, not {metrics.get('loss')!r}"
    return "1 worker: a report every epoch, with a checkpoint that loads into a plain model"


def check_device(by_rank: list, config: dict, local_world_size: int) -> str:
    """Nothing the workers did would fail on GPUs: what they all-reduce is on get_device(), and no line of
    train_func mixes a tensor on the device with one on the CPU."""
    trained(by_rank, config, local_world_size)
    for rank, out in enumerate(by_rank):
        problems = out["device_problems"]
        assert not problems, (f"{where(rank, local_world_size)} would fail on a GPU node: " + "; ".join(problems[:2])
                              + ". Make the tensor on ray.train.torch.get_device(), or compute it from the loss")
    return f"{len(by_rank)} workers: what they all-reduce would be on their GPU (ray.train.torch.get_device())"


# ---------------------------------------------------------------- load_model
# a loaded model described: {"type", "state": state dict, "training", "devices"} or {"error": "..."}

def seeded_weights(seed: int, name: str = "small_cnn") -> dict:
    """The weights a check writes into model.pt: build_model(name) from `seed`."""
    torch.manual_seed(seed)
    return build_model(name).state_dict()


def describe_model(model) -> dict:
    return {"type": type(model).__name__, "state": dict(model.state_dict()) if hasattr(model, "state_dict") else {},
            "training": getattr(model, "training", None),
            "devices": sorted({p.device.type for p in model.parameters()}) if hasattr(model, "parameters") else []}


def check_loaded(got: dict, name: str, state: dict) -> None:
    """``got`` (describe_model) is a plain build_model(name) holding `state`."""
    assert "error" not in got, got.get("error")
    plain = type(build_model(name)).__name__
    assert got["type"] == plain, f"load_model should return a plain {plain} for {name!r}, got {got['type']}"
    mine = got["state"]
    assert sorted(mine) == sorted(state), f"the model's keys {sorted(mine)} are not model.pt's {sorted(state)}"
    diff = max_difference(mine, state)
    assert diff == 0, f"the returned model's weights differ from the checkpoint's model.pt by {diff:.1e}"


def check_for_inference(got: dict, name: str, state: dict) -> None:
    check_loaded(got, name, state)
    assert got["training"] is False, "return the model in eval mode (model.eval()): BatchNorm then uses its running statistics"
    assert got["devices"] == ["cpu"], f"the model's parameters should be on the CPU, they are on {set(got['devices'])}"
