"""Checkpoints as module 04 examines them: one on storage that is not a local folder, and which ones Ray keeps.

:func:`bucket_checkpoint` makes a checkpoint live in an in-memory bucket (as S3 or GCS would hold it), and
:func:`checkpoints_ray_keeps` asks Ray Train's own checkpoint manager which checkpoints a ``CheckpointConfig``
keeps. :func:`shipped_checkpoint` unpacks a DCP checkpoint that a module ships as data (module 05's ``fixtures/``).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path


# DCP's metadata file (``.metadata``) under the name a module ships it: nbgrader releases no hidden file
SHIPPED_METADATA = "dcp.metadata"


def shipped_checkpoint(folder: str | os.PathLike) -> str:
    """A temporary copy of the DCP checkpoint shipped in ``folder``, its files named as DCP writes them (the
    metadata as ``.metadata`` again): a folder ``dcp.load`` reads, which the caller may hand to
    :func:`bucket_checkpoint`. ``FileNotFoundError`` names the folder when the module's copy lacks it."""
    folder = Path(folder)
    if not (folder / SHIPPED_METADATA).is_file():
        raise FileNotFoundError(f"{folder} is missing: it comes with the module's folder (restore it from the "
                                "course, or run this notebook from its own folder)")
    directory = tempfile.mkdtemp()
    for name in os.listdir(folder):
        shutil.copyfile(folder / name, Path(directory, ".metadata" if name == SHIPPED_METADATA else name))
    return directory


def bucket_checkpoint(files: dict[str, bytes], name: str | None = None):
    """A ``ray.train.Checkpoint`` holding ``files`` ({file name: bytes}) on storage that is not a local folder.

    The files go into an in-memory bucket: a pyarrow filesystem (fsspec's ``MemoryFileSystem`` behind
    ``pyarrow.fs.PyFileSystem``, seen through a ``SubTreeFileSystem``), the way ``RunConfig(storage_path="s3://...")``
    or ``RunConfig(storage_filesystem=...)`` gives Ray Train a checkpoint in cloud storage. Its ``.path`` is then a
    path inside the bucket (``course-bucket/<name>``, as an S3 checkpoint's is ``bucket/path``), which no local
    ``open()`` or ``os`` function finds; ``checkpoint.as_directory()`` (or ``to_directory()``) downloads it into a
    local temporary folder, and removes that folder when the ``with`` block ends. The bucket lives in this process
    only."""
    import pyarrow.fs
    from fsspec.implementations.memory import MemoryFileSystem
    from ray.train import Checkpoint

    fs = pyarrow.fs.SubTreeFileSystem("/", pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(MemoryFileSystem())))
    path = f"course-bucket/{name or 'checkpoint-' + uuid.uuid4().hex[:8]}"
    fs.create_dir(path)
    for file_name, content in files.items():
        parent = os.path.dirname(file_name)
        if parent:
            fs.create_dir(f"{path}/{parent}")
        with fs.open_output_stream(f"{path}/{file_name}") as f:
            f.write(content)
    return Checkpoint(path, filesystem=fs)


def checkpoints_ray_keeps(reports: list[dict], checkpoint_config, storage_path: str | os.PathLike | None = None,
                          name: str = "keep-demo") -> dict:
    """What ``checkpoint_config`` leaves in storage after one checkpoint per report, decided by Ray Train itself.

    Each report (a metrics dict with an ``"epoch"``) gets a small checkpoint, persisted and registered as the
    controller does at a ``ray.train.report(..., checkpoint=...)``: Ray Train's ``StorageContext`` and
    ``CheckpointManager`` (ray/train/v2/_internal/execution/checkpoint/checkpoint_manager.py), which prunes with
    ``num_to_keep`` and the score after every registration. Returns ``{"in_storage": [epochs of the checkpoint
    folders left in storage], "latest": epoch of the checkpoint that ray.train.get_checkpoint() hands a restarted
    worker group or a rerun under the same name (``result.checkpoint``), "rows": [epochs of the checkpoints that
    ``result.best_checkpoints`` and ``result.metrics_dataframe`` list, worst first]}``."""
    from ray.train import Checkpoint

    from coursekit.localmode import _in_thread, _quiet
    from coursekit.ray_internals import CheckpointManager, StorageContext, TrainingReport

    with tempfile.TemporaryDirectory() as scratch, _quiet("ray.train"):
        storage = StorageContext(storage_path=str(storage_path or scratch), experiment_dir_name=name)
        manager = _in_thread(lambda: CheckpointManager(checkpoint_config=checkpoint_config, storage_context=storage))
        for metrics in reports:
            with tempfile.TemporaryDirectory() as tmp:
                Path(tmp, "metrics.json").write_text(json.dumps(metrics))
                persisted = storage.persist_current_checkpoint(Checkpoint.from_directory(tmp),
                                                               f"epoch_{metrics['epoch']:04d}")
            _in_thread(manager.register_checkpoint,
                       TrainingReport(checkpoint=persisted, metrics=dict(metrics), validation=False))
        run = Path(storage.experiment_fs_path)
        in_storage = sorted(int(p.name.split("_")[1]) for p in run.glob("epoch_*"))
        rerun = _in_thread(lambda: CheckpointManager(checkpoint_config=checkpoint_config, storage_context=storage))
        latest = rerun.latest_checkpoint_result
        rows = [r.metrics["epoch"] for r in rerun.best_checkpoint_results]
        return {"in_storage": in_storage, "latest": latest.metrics["epoch"] if latest else None, "rows": rows}
