"""Elastic training (module 04) on a real 2-node Ray cluster on this machine (coursekit.elastic.LocalCluster).

A TorchTrainer with ScalingConfig(num_workers=(1, 2)) trains on a head and a worker node with one CPU each (one
worker per node). After epoch 1 the worker node is lost: Ray Train restarts the group with 1 worker from the
latest checkpoint (a failure, counted by max_failures=1). After epoch 3 a node joins: the healthy 1-worker group is
replaced by 2 workers, again from the latest checkpoint (a resize, not counted). After epoch 5 that node is
preempted (drained, then lost): the group shrinks again, and since a preemption is counted apart from
max_failures, whose one allowed failure is spent, the run still finishes. The checks: every epoch trained exactly
once, by the group size expected at that point, the global batch of every step the configured one (per worker:
global // world size), and a model that learned.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import ray
import ray.train
import ray.train.torch
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from coursekit.data import load_digits
from coursekit.elastic import LocalCluster, reporting_world_size
from coursekit.models import accuracy, build_model

EPOCHS = 8
# after epoch 1 the worker node is lost, after epoch 3 one joins, after epoch 5 it is preempted
CHANGES = {1: "remove", 3: "add", 5: "preempt"}
EXPECTED_WORLD = [2, 2, 1, 1, 2, 2, 1, 1]  # the size of the group that trains each epoch
GLOBAL_BATCH = 64
STATE = "elastic_state.pt"


def elastic_train(config: dict) -> None:
    """A training function that survives any change of world size: the global batch stays the configured one
    (each worker gets global // world size), the checkpoint (rank 0's model, optimizer and epoch) does not depend
    on the number of ranks, and there is no per-rank state to restore (no random augmentation)."""
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(config["seed"])
    model = ray.train.torch.prepare_model(build_model("small_cnn"))
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    data = load_digits(train=True, limit=config["train_samples"], quiet=True)
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(data.dataset(), batch_size=config["global_batch_size"] // world, shuffle=True, drop_last=True))
    test = load_digits(train=False, limit=config["test_samples"], quiet=True)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d, STATE), map_location="cpu", weights_only=True)
        getattr(model, "module", model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    for epoch in range(start, config["epochs"]):
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        model.train()
        total, global_batches = torch.zeros(2), []
        for images, labels in loader:
            n = torch.tensor([len(labels)])
            if world > 1:
                dist.all_reduce(n)               # the samples of this step, all ranks together
            global_batches.append(int(n))
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(labels), len(labels)])
        if world > 1:
            dist.all_reduce(total)
        metrics = {"epoch": epoch, "loss": (total[0] / total[1]).item(), "started_at_epoch": start,
                   "steps": len(global_batches), "global_batch_min": min(global_batches),
                   "global_batch_max": max(global_batches), "finished_at": time.time(),
                   "accuracy": accuracy(getattr(model, "module", model), test.tensors, test.labels)}
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                torch.save({"model": getattr(model, "module", model).state_dict(),
                            "optimizer": optimizer.state_dict(), "epoch": epoch}, Path(tmp, STATE))
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp) if rank == 0 else None,
                             checkpoint_dir_name=f"epoch_{epoch:04d}")


@pytest.mark.slow
def test_an_elastic_run_shrinks_and_grows_with_the_cluster(tmp_path):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])   # Ray's workers cannot import this test file
    storage = tmp_path / "storage"
    config = dict(epochs=EPOCHS, lr=2e-3, global_batch_size=GLOBAL_BATCH, train_samples=1024, test_samples=256,
                  seed=0)
    started = time.time()
    with LocalCluster(worker_nodes=1, cpus_per_node=1) as cluster:
        assert cluster.alive_nodes() == 2
        trainer = TorchTrainer(
            reporting_world_size(elastic_train, hold_after={e: EXPECTED_WORLD[e] for e in CHANGES}, hold_s=150),
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=(1, 2), elastic_resize_monitor_interval_s=1),
            # the lost node is a worker-group failure, counted by max_failures (a resize and a preemption are not)
            run_config=RunConfig(name="elastic", storage_path=str(storage),
                                 failure_config=FailureConfig(max_failures=1)))
        result = cluster.fit(trainer, changes=CHANGES, timeout_s=400)
        events, temp_dir = list(cluster.events), cluster._temp_dir
        assert os.environ["RAY_TMPDIR"] == temp_dir   # the cluster's address file is private
    wall = time.time() - started

    # nothing of the cluster is left: not this process's connection, not a process, not its temp dir
    assert not ray.is_initialized()
    assert os.environ.get("RAY_TMPDIR") != temp_dir and not Path(temp_dir).exists()
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes of the cluster still running: {left}"

    assert result.error is None, result.error
    history = result.metrics_dataframe.sort_values("epoch").reset_index(drop=True)
    print(history[["epoch", "world_size", "per_worker_batch", "global_batch_min", "global_batch_max", "steps",
                   "started_at_epoch", "loss", "accuracy"]].to_string())

    # every epoch exactly once, resumed from the latest checkpoint at each resize
    assert history["epoch"].tolist() == list(range(EPOCHS))
    assert history["started_at_epoch"].tolist() == [0, 0, 2, 2, 4, 4, 6, 6]
    # 2 workers, 1 after the node was lost, 2 again after one joined, 1 after it was preempted
    assert history["world_size"].tolist() == EXPECTED_WORLD
    # the global batch of every step is the configured one; each worker gets its share
    assert history["per_worker_batch"].tolist() == [GLOBAL_BATCH // w for w in EXPECTED_WORLD]
    assert set(history["global_batch_min"]) == {GLOBAL_BATCH} == set(history["global_batch_max"])
    assert set(history["steps"]) == {config["train_samples"] // GLOBAL_BATCH}
    # and it learned
    losses = history["loss"].tolist()
    assert losses[-1] < 0.6 * losses[0], losses
    assert history["accuracy"].iloc[-1] > 0.5, history["accuracy"].tolist()

    # the timeline: what the cluster did, and when the resized groups finished their first epoch
    print("\n".join(f"{t - started:6.1f} s  {what}" for t, what in events))
    finished = dict(zip(history["epoch"], history["finished_at"]))
    changed = [(t, what.split(":")[0]) for t, what in events if what.startswith("node ")]
    assert [what for _, what in changed] == ["node removed", "node joined", "node preempted"], events
    took = {what: finished[epoch + 1] - t for epoch, (t, what) in zip(sorted(CHANGES), changed)}
    print("from the cluster's change to the end of the resized group's first epoch: "
          + ", ".join(f"{what} {s:.0f} s" for what, s in took.items()) + f"; whole test {wall:.0f} s")
    assert max(took.values()) < 120, took


def _reports_a_few_epochs(config: dict) -> None:
    for epoch in range(config["epochs"]):
        ray.train.report({"epoch": epoch, "loss": 1.0 / (epoch + 1)})


def test_reporting_world_size_adds_the_groups_size_to_every_report_without_patching_ray_train(tmp_path):
    """In Ray Train's own local mode (num_workers=0: the training function runs here, one worker of a group of 1):
    every report carries world_size and per_worker_batch, ray.train.report stays Ray Train's own function, and
    Ray Train's reporting is back once the function returns."""
    from coursekit.ray_internals import get_train_fn_utils

    report_before = ray.train.report
    seen = []

    def train(config):
        seen.append(ray.train.report is report_before)
        _reports_a_few_epochs(config)

    trainer = TorchTrainer(reporting_world_size(train), train_loop_config={"epochs": 3, "global_batch_size": 64},
                           scaling_config=ScalingConfig(num_workers=0),
                           run_config=RunConfig(name="world-size", storage_path=str(tmp_path)))
    result = trainer.fit()
    assert seen == [True] and ray.train.report is report_before
    assert result.metrics == {"epoch": 2, "loss": 1.0 / 3, "world_size": 1, "per_worker_batch": 64}
    assert type(get_train_fn_utils()).__name__ == "LocalTrainFnUtils"   # Ray Train's own again


def test_reporting_world_size_takes_a_function_without_a_config(tmp_path):
    def train():
        ray.train.report({"epoch": 0})

    wrapped = reporting_world_size(train)
    assert wrapped.__doc__ == "train, reporting world_size"
    result = TorchTrainer(wrapped, scaling_config=ScalingConfig(num_workers=0),
                          run_config=RunConfig(name="no-config", storage_path=str(tmp_path))).fit()
    assert result.metrics == {"epoch": 0, "world_size": 1}   # no global_batch_size: no per_worker_batch
