"""Ray Train's local mode on forked ranks: a ``TorchTrainer``'s run without starting Ray.

``ScalingConfig(num_workers=0)`` makes ``TorchTrainer.fit()`` run the training function in the
calling process (Ray Train's *local mode*). Under torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) each process is one rank:
local mode makes the process group and ``ray.train.get_context()`` gives each rank its real rank and
world size, so ``prepare_model`` wraps DDP and ``prepare_data_loader`` adds a ``DistributedSampler``
as in a worker group. Nothing of Ray starts: no GCS, raylet, controller or worker actors. That is
how Ray Train users debug a training function under torchrun, and how this course fits a
small machine (Binder's 2 GiB), where a Ray worker group of two does not.

:func:`fit_trainer` runs a trainer that way on forked ranks, one per worker of its ``ScalingConfig``. Local
mode keeps only the last report in memory; here each report also goes where a worker group's would,
with Ray Train's own pieces: every rank copies its checkpoint into the run's storage
(``StorageContext.persist_current_checkpoint``), rank 0 registers it with Ray Train's
``CheckpointManager`` (``num_to_keep``, the score order, the snapshot that a later ``fit()`` of the
same ``RunConfig(name=...)`` resumes from), and the ``Result`` is built as the controller builds it.
A trainer with Ray Data ``datasets`` runs on one rank in the calling process (local mode reads them
on one rank only; Ray stays up for Ray Data's tasks). ``FailureConfig(max_failures)`` is honoured as
a worker group's controller honours it: when a rank fails, all ranks are started again from the
run's latest checkpoint, until the failures allowed are spent. What a worker group adds and this
cannot: datasets split between ranks, GPUs, other machines, preemption handling.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

from coursekit.runtime import Runtime, detect


def _in_thread(fn, *args) -> Any:
    """``fn(*args)`` on a thread of its own with an event loop (the checkpoint manager notifies its
    listeners with asyncio; a forked rank may have inherited the kernel's running loop)."""
    out: dict = {}

    def target():
        async def call():
            return fn(*args)
        try:
            out["value"] = asyncio.run(call())
        except BaseException as e:  # noqa: BLE001  re-raised in the caller
            out["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _storage(trainer):
    from coursekit.ray_internals import StorageContext

    run = trainer.run_config
    return StorageContext(storage_path=run.storage_path, experiment_dir_name=run.name,
                          storage_filesystem=run.storage_filesystem)


def _manager(trainer, storage):
    """Ray Train's checkpoint bookkeeping for this run; it loads the run's snapshot when there is one."""
    from coursekit.ray_internals import CheckpointManager

    return _in_thread(lambda: CheckpointManager(checkpoint_config=trainer.run_config.checkpoint_config,
                                                storage_context=storage))


def _rank(rank: int, world_size: int, trainer, storage, manager) -> Any:
    """One rank: the trainer's function in Ray Train's local mode, its reports persisted."""
    import torch.distributed as dist
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from coursekit.ray_internals import (LocalTorchController, LocalTrainFnUtils, TrainingReport,
                                         get_train_fn_utils, set_train_fn_utils)

    # The private members overridden and set here are checked by tests/test_ray_internals.py (MEMBERS).
    class StoredReports(LocalTrainFnUtils):
        def report(self, metrics, checkpoint=None, checkpoint_dir_name=None, **kwargs):
            # one name for the checkpoint all ranks write into (rank 0's), as a worker group uses
            names = [checkpoint_dir_name or storage.make_default_checkpoint_dir_name()]
            has = [checkpoint is not None]
            if dist.is_initialized():
                dist.broadcast_object_list(names, src=0)
                everyone = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, has[0])
                has = everyone
            persisted = storage.persist_current_checkpoint(checkpoint, names[0]) if checkpoint else None
            if dist.is_initialized():
                dist.barrier()   # report is a barrier: every rank's files are in storage before it is registered
            if any(has):
                from ray.train import Checkpoint

                persisted = Checkpoint(storage.build_checkpoint_path_from_name(names[0]),
                                       storage.storage_filesystem)
                if not dist.is_initialized() or dist.get_rank() == 0:
                    _in_thread(manager.register_checkpoint,
                               TrainingReport(checkpoint=persisted, metrics=metrics, validation=False))
                if dist.is_initialized():
                    dist.barrier()   # the snapshot is written before anyone goes on (or resumes from it)
            super().report(metrics, persisted)

    latest = manager.latest_checkpoint_result
    resume_from = latest.checkpoint if latest else None

    class Controller(LocalTorchController):
        def _set_train_fn_utils(self) -> None:
            super()._set_train_fn_utils()   # makes the process group from torchrun's environment
            c = get_train_fn_utils().get_context()
            utils = StoredReports(experiment_name=self.experiment_name, dataset_shards=self.datasets,
                                  world_size=c.get_world_size(), world_rank=c.get_world_rank(),
                                  local_rank=c.get_local_rank(), local_world_size=c.get_local_world_size(),
                                  node_rank=c.get_node_rank())
            utils._last_checkpoint = resume_from   # what ray.train.get_checkpoint() returns: the run's latest
            set_train_fn_utils(utils)

    class LocalTrainer(TorchTrainer):
        def _get_local_controller(self):
            return Controller(experiment_name=self.run_config.name, datasets=self.datasets)

    local = LocalTrainer(trainer.train_loop_per_worker, train_loop_config=trainer.train_loop_config,
                         scaling_config=ScalingConfig(num_workers=0), run_config=trainer.run_config,
                         datasets=trainer.datasets or None)
    result = local.fit()
    return result.return_value if rank == 0 else None   # Ray Train returns rank 0's


def fit_trainer(trainer, runtime: Runtime | None = None, timeout_s: float = 3600):
    """``trainer.fit()``, or, where the runtime says a Ray worker group does not fit (``rt.local_mode``:
    Binder, a small memory limit), the same run in Ray Train's local mode on forked ranks, one per
    worker of the trainer's ``ScalingConfig``. Returns a ``ray.train.Result`` either way."""
    rt = runtime or detect()
    if not rt.local_mode or trainer.scaling_config.num_workers == 0:   # 0 workers: Ray Train's own local mode
        return trainer.fit()
    with _quiet("ray.train"):   # the controller's and workers' log lines, which a worker group keeps in its logs
        return _fit_locally(trainer, rt, timeout_s)


@contextlib.contextmanager
def _quiet(name: str):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _fit_locally(trainer, rt: Runtime, timeout_s: float):
    from coursekit.ray_internals import result_from_checkpoint_manager

    workers = trainer.scaling_config.num_workers
    if isinstance(workers, tuple):   # elastic (min, max): local mode runs the minimum
        workers = workers[0]
    if trainer.datasets:
        # Ray Train's local mode gives Ray Data's datasets to one rank only, and a rank forked from this process
        # could not use its connection to Ray (Ray Data's tasks still run on Ray): one rank, in this process.
        print(f"Ray Train local mode: 1 rank in this process, reading the Ray Data datasets itself (your "
              f"ScalingConfig asks for {workers}; {rt.memory_gib} GiB here is too little for a Ray worker group)")
    else:
        print(f"Ray Train local mode: {workers} forked rank(s) under torchrun's environment, no Ray processes "
              f"({rt.memory_gib} GiB here is too little for a Ray worker group)")
    storage = _storage(trainer)
    failure_config = trainer.run_config.failure_config
    max_failures = failure_config.max_failures if failure_config else 0
    failures = 0
    while True:
        # each attempt starts from the run's latest registered checkpoint, as a restarted worker group does
        manager = _manager(trainer, storage)
        try:
            if trainer.datasets:
                value = _rank(0, 1, trainer, storage, manager)
            else:
                from coursekit.distributed import run_distributed

                value = run_distributed(_rank, workers, trainer, storage, manager, backend=None,
                                        timeout_s=timeout_s)[0]
            break
        except Exception as error:  # noqa: BLE001  a failed rank, as FailureConfig sees a failed worker
            failures += 1
            if max_failures != -1 and failures > max_failures:
                raise
            last_line = str(error).strip().splitlines()[-1]
            print(f"Ray Train local mode: the ranks failed ({last_line}); starting them again from the latest "
                  f"checkpoint, as Ray Train restarts a worker group (failure {failures} of "
                  f"{'unlimited' if max_failures == -1 else max_failures} allowed by FailureConfig)")
    result = result_from_checkpoint_manager(_manager(trainer, storage), storage)
    result.return_value = value
    return result
