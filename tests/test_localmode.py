"""coursekit.localmode: a TorchTrainer run in Ray Train's local mode on forked ranks (what Binder runs) gives
what a Ray worker group gives: the same weights as one process on the full batch, every rank's own rank and
world size, checkpoints in storage kept and scored by CheckpointConfig, a resume by name, FailureConfig's
restarts; and the same Result as trainer.fit() on a real worker group."""
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ray.train
import ray.train.torch
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from coursekit.localmode import fit_trainer
from coursekit.runtime import detect

X = torch.randn(64, 5, generator=torch.Generator().manual_seed(1))
Y = X @ torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0]) + 0.25


def train_func(config: dict) -> dict:
    """DDP linear regression, each rank on its half of every batch; rank 0 saves, every rank reports."""
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Linear(5, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            saved = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        getattr(model, "module", model).load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["epoch"] + 1
    fail = config.get("fail_once_at")
    for epoch in range(start, config["epochs"]):
        if fail is not None and epoch == fail["epoch"] and rank == fail["rank"]:
            marker = Path(fail["marker"])
            if not marker.exists():
                marker.write_text("failed")
                raise RuntimeError("injected failure")
        for batch in range(0, len(X), 16):
            xs, ys = X[batch:batch + 16], Y[batch:batch + 16]
            part = slice(rank * len(xs) // world, (rank + 1) * len(xs) // world)
            loss = torch.nn.functional.mse_loss(model(xs[part]).squeeze(1), ys[part])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        full_loss = torch.nn.functional.mse_loss(getattr(model, "module", model)(X).squeeze(1), Y).item()
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                torch.save({"model": getattr(model, "module", model).state_dict(),
                            "optimizer": optimizer.state_dict(), "epoch": epoch}, os.path.join(d, "state.pt"))
            ray.train.report({"epoch": epoch, "loss": full_loss, "start": start, "rank": rank, "world": world,
                              # a score that is best at epoch 1, so that keeping by score differs from keeping the latest
                              "score": -abs(epoch - 1)},
                             checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)
    return {"rank": rank, "world": world, "in_group": dist.is_initialized()}


def reference(epochs: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(epochs):
        for batch in range(0, len(X), 16):
            loss = torch.nn.functional.mse_loss(model(X[batch:batch + 16]).squeeze(1), Y[batch:batch + 16])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.state_dict()


def weights(result) -> dict:
    with result.checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "state.pt"), weights_only=True)


@pytest.fixture
def local(monkeypatch):
    monkeypatch.setenv("COURSE_LOCAL_MODE", "1")
    monkeypatch.setenv("RAY_TRAIN_V2_ENABLED", "1")
    return detect()


def trainer(storage, name, epochs, workers=2, keep=None, score=None, failures=0, config=None):
    return TorchTrainer(train_func, train_loop_config={"epochs": epochs, **(config or {})},
                        scaling_config=ScalingConfig(num_workers=workers),
                        run_config=RunConfig(storage_path=storage, name=name,
                                             failure_config=FailureConfig(max_failures=failures),
                                             checkpoint_config=CheckpointConfig(
                                                 num_to_keep=keep, checkpoint_score_attribute=score)))


def test_runtime_chooses_local_mode_from_memory_and_platform():
    assert detect({"COURSE_PLATFORM": "binder"}).local_mode
    assert not detect({"COURSE_PLATFORM": "binder", "COURSE_LOCAL_MODE": "0"}).local_mode
    assert detect({"COURSE_PLATFORM": "local", "COURSE_LOCAL_MODE": "1"}).local_mode
    assert not detect({"COURSE_PLATFORM": "binder", "RAY_ADDRESS": "ray://head:10001"}).local_mode   # a cluster
    big = detect({"COURSE_PLATFORM": "local"})
    assert big.local_mode == (big.memory_gib < 4)


def test_two_ranks_equal_one_process_and_keep_the_checkpoints_config_says(local, tmp_path):
    result = fit_trainer(trainer(str(tmp_path), "run", epochs=4, keep=2, score="score"), local)
    # each rank had its own rank in a real 2-process group (rank 0's return value is the Result's)
    assert result.return_value == {"rank": 0, "world": 2, "in_group": True}
    assert result.metrics["world"] == 2
    expected = reference(4)
    got = weights(result)["model"]
    assert max((got[k] - expected[k]).abs().max().item() for k in expected) < 1e-6
    # keep 2 by score ("score" is best at epoch 1): Ray Train's CheckpointManager deletes the worst but never the
    # latest; best_checkpoints and metrics_dataframe list the 2 best, result.checkpoint is the latest
    assert sorted(result.metrics_dataframe["epoch"]) == [1, 2]
    assert result.metrics["epoch"] == 3 and weights(result)["epoch"] == 3
    kept = sorted(p.name for p in Path(result.path).iterdir() if p.is_dir())
    assert len(kept) == 3 and Path(result.path) == tmp_path / "run"   # epoch 0's was deleted
    # Ray Train reads the run back as it reads a worker group's (from_path keeps every checkpoint still stored)
    assert sorted(ray.train.Result.from_path(result.path).metrics_dataframe["epoch"]) == [1, 2, 3]


def test_zero_workers_is_ray_trains_own_local_mode_in_this_process(local, tmp_path):
    result = fit_trainer(trainer(str(tmp_path), "zero", epochs=1, workers=0), local)
    assert result.return_value == {"rank": 0, "world": 1, "in_group": False}


def test_same_name_resumes_from_the_latest_checkpoint(local, tmp_path):
    fit_trainer(trainer(str(tmp_path), "resume", epochs=2), local)
    resumed = fit_trainer(trainer(str(tmp_path), "resume", epochs=4), local)
    assert resumed.metrics["start"] == 2 and sorted(resumed.metrics_dataframe["epoch"]) == [0, 1, 2, 3]
    expected = reference(4)
    got = weights(resumed)["model"]
    assert max((got[k] - expected[k]).abs().max().item() for k in expected) < 1e-6


def test_failure_config_restarts_the_ranks_or_gives_up(local, tmp_path):
    fail = {"fail_once_at": {"epoch": 2, "rank": 1, "marker": str(tmp_path / "failed-once")}}
    recovered = fit_trainer(trainer(str(tmp_path), "recover", epochs=4, failures=1, config=fail), local)
    assert recovered.metrics["start"] == 2, "the restarted ranks continue after the last checkpoint (epoch 1)"
    expected = reference(4)
    got = weights(recovered)["model"]
    assert max((got[k] - expected[k]).abs().max().item() for k in expected) < 1e-6
    fail = {"fail_once_at": {"epoch": 1, "rank": 1, "marker": str(tmp_path / "fails-again")}}
    with pytest.raises(RuntimeError, match="injected failure"):
        fit_trainer(trainer(str(tmp_path), "give-up", epochs=3, failures=0, config=fail), local)


@pytest.mark.slow
def test_local_mode_gives_the_result_a_worker_group_gives(tmp_path, monkeypatch):
    """The same trainer on a real Ray worker group of 2 and in local mode: the same metrics rows, weights
    and files in storage."""
    monkeypatch.setenv("RAY_TRAIN_V2_ENABLED", "1")
    import sys

    from ray import cloudpickle
    from coursekit.raysetup import init_ray

    cloudpickle.register_pickle_by_value(sys.modules[__name__])   # Ray's workers cannot import this test file

    real_rt = detect({**os.environ, "COURSE_LOCAL_MODE": "0", "COURSE_PLATFORM": "ci"})
    init_ray(real_rt)
    try:
        real = fit_trainer(trainer(str(tmp_path), "group", epochs=4, keep=2, score="score"), real_rt)
    finally:
        ray.shutdown()
    local = fit_trainer(trainer(str(tmp_path), "local", epochs=4, keep=2, score="score"),
                        detect({**os.environ, "COURSE_LOCAL_MODE": "1"}))
    columns = ["epoch", "loss", "start", "world"]
    assert real.metrics_dataframe[columns].round(6).to_dict("records") == \
        local.metrics_dataframe[columns].round(6).to_dict("records")
    a, b = weights(real)["model"], weights(local)["model"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6

    def layout(path):
        return sorted(p.name if not p.name.startswith("checkpoint_") else "checkpoint_*" for p in Path(path).iterdir())
    assert layout(real.path) == layout(local.path)
    snapshot = json.loads(Path(local.path, "checkpoint_manager_snapshot.json").read_text())
    assert len(snapshot["checkpoint_results"]) == 3
