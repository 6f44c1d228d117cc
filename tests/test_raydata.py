"""Module 03's plumbing: the course digits as files, synthetic data, the CPU plan, the simulated shard. No Ray started."""
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from coursekit.data import load_digits, normalize, require_files, write_digits_image_folder, write_digits_parquet
from coursekit.objectstore import ObjectStoreMonitor
from coursekit.raydata import configure_ray_data, plan_resources
from coursekit.scaling import ScalingError
from coursekit.synthetic import ROW_BYTES, generate_synthetic_batch, preprocess_synthetic, synthetic_rows
from coursekit.testing import InMemoryShard, simulated_dataset_shard, split_rows


@pytest.fixture(scope="module")
def digits():
    return load_digits(train=True, limit=50, quiet=True)


def test_parquet_round_trip(digits, tmp_path):
    files = write_digits_parquet(digits, tmp_path, num_files=3)
    assert len(files) == 3
    tables = [pq.read_table(f) for f in files]
    assert sum(t.num_rows for t in tables) == 50
    images = np.concatenate([t.column("image").combine_chunks().to_numpy() for t in tables])
    labels = np.concatenate([t.column("label").to_numpy() for t in tables])
    ids = np.concatenate([t.column("id").to_numpy() for t in tables])
    assert images.shape == (50, 28, 28) and images.dtype == np.uint8
    assert np.array_equal(images, digits.images.numpy()) and np.array_equal(labels, digits.labels.numpy())
    assert ids.tolist() == list(range(50))
    write_digits_parquet(digits, tmp_path, num_files=1)   # rewriting replaces the old files
    assert len(list(tmp_path.glob("*.parquet"))) == 1


def test_image_folder_round_trip(digits, tmp_path):
    from PIL import Image

    write_digits_image_folder(digits, tmp_path)
    files = require_files(tmp_path, "*.png", "PNG images")
    assert len(files) == 50
    for f in files[:10]:
        i = int(f.stem)
        assert int(f.parent.name) == int(digits.labels[i])
        assert np.array_equal(np.asarray(Image.open(f)), digits.images[i].numpy())


def test_missing_files_get_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="Run the cell that writes the course digits"):
        require_files(tmp_path / "nowhere", "*.parquet", "Parquet files")


def test_synthetic_preprocessing_normalises_like_the_course():
    from coursekit.data import MEAN, STD
    from coursekit.synthetic import NORMALIZE_MEAN_STD

    assert NORMALIZE_MEAN_STD == (MEAN, STD)


def test_synthetic_rows_are_deterministic_learnable_digits():
    assert synthetic_rows(100 * ROW_BYTES) == 100
    ids = np.arange(10, 20)
    a, b = generate_synthetic_batch({"id": ids}), generate_synthetic_batch({"id": ids})
    assert a["image"].shape == (10, 224, 224) and a["image"].dtype == np.uint8
    assert np.array_equal(a["image"], b["image"]) and a["id"].tolist() == ids.tolist()
    # preprocessing pools the noise away: close to the normalised 28x28 digit it came from
    base = load_digits(train=True, quiet=True)
    out = preprocess_synthetic(a)
    assert out["image"].shape == (10, 1, 28, 28) and out["image"].dtype == np.float32
    ref = normalize(base.images[ids % len(base)]).numpy()
    assert np.abs(out["image"] - ref).mean() < 0.1
    assert out["label"].tolist() == base.labels[ids % len(base)].tolist()


def test_plan_splits_cpus_and_refuses_a_stall():
    plan = plan_resources(2, 0.5, resources={"CPU": 2, "GPU": 0})
    assert plan.data_cpus == 1 and plan.map_concurrency == 2
    assert "2 workers x 0.5 CPU" in plan.describe()
    with pytest.raises(ScalingError, match="leaves 0 for Ray Data"):
        plan_resources(2, 1.0, resources={"CPU": 2, "GPU": 0})
    with pytest.raises(ScalingError, match="at most 0.75 CPU"):
        plan_resources(2, 1.0, map_num_cpus=0.5, resources={"CPU": 2, "GPU": 0})
    with pytest.raises(ScalingError, match="GPUs"):
        plan_resources(2, 1.0, use_gpu=True, resources={"CPU": 8, "GPU": 1})
    gpu = plan_resources(4, 1.0, use_gpu=True, resources={"CPU": 32, "GPU": 4})
    assert gpu.data_cpus == 28 and gpu.map_concurrency == 56


def test_configure_ray_data_sets_the_limits():
    from ray.data import DataContext

    ctx = DataContext.get_current()
    saved = (ctx.execution_options.resource_limits, ctx.target_max_block_size, ctx.enable_progress_bars,
             ctx.use_datasource_v2)
    try:
        ctx.use_datasource_v2 = True
        configure_ray_data(plan_resources(4, 1.0, use_gpu=True, resources={"CPU": 32, "GPU": 4}))
        assert ctx.use_datasource_v2 is True, "a big cluster keeps Ray Data's default Parquet reader"
        plan = plan_resources(2, 0.5, object_store_mib=64, resources={"CPU": 2, "GPU": 0})
        configure_ray_data(plan)
        assert ctx.execution_options.resource_limits.cpu == 1
        assert ctx.execution_options.resource_limits.object_store_memory == 64 * 2**20
        assert ctx.enable_progress_bars is False
        assert ctx.use_datasource_v2 is False, "a 2-CPU cluster reads Parquet with tasks, not actor pools"
    finally:
        (ctx.execution_options.resource_limits, ctx.target_max_block_size, ctx.enable_progress_bars,
         ctx.use_datasource_v2) = saved


def test_split_rows_like_equal_streaming_split():
    cols = {"id": np.arange(11), "x": np.arange(11) * 2}
    parts = [split_rows(cols, 3, r) for r in range(3)]
    assert [len(p["id"]) for p in parts] == [3, 3, 3]           # 11 // 3 each, 2 rows dropped
    assert len(set(np.concatenate([p["id"] for p in parts]).tolist())) == 9
    with pytest.raises(ValueError):
        split_rows(cols, 2, 2)


def test_in_memory_shard_batches_and_records_calls():
    shard = InMemoryShard({"image": np.zeros((10, 1, 2, 2), np.float32), "label": np.arange(10)})
    sizes = [len(b["label"]) for b in shard.iter_torch_batches(batch_size=4)]
    assert sizes == [4, 4, 2] and shard.calls[0]["batch_size"] == 4
    assert [len(b["label"]) for b in shard.iter_torch_batches(batch_size=4, drop_last=True)] == [4, 4]
    b = next(iter(shard.iter_torch_batches(batch_size=3, dtypes={"label": torch.float64, "image": torch.float16})))
    assert b["label"].dtype == torch.float64 and b["image"].dtype == torch.float16
    with pytest.raises(KeyError):  # as in Ray Data, a dtypes dict names every column
        next(iter(shard.iter_torch_batches(batch_size=3, dtypes={"label": torch.float64})))
    assert len(shard.calls) == 4


def test_simulated_dataset_shard_patches_ray_train():
    import ray.train

    cols = {"label": np.arange(8)}
    with simulated_dataset_shard(cols, rank=1, world_size=2) as shard:
        assert ray.train.get_dataset_shard("train") is shard
        assert shard.columns["label"].tolist() == [4, 5, 6, 7]
        with pytest.raises(KeyError, match="no dataset named 'val'"):
            ray.train.get_dataset_shard("val")


def test_monitor_without_ray_is_unavailable_not_an_error():
    with ObjectStoreMonitor(interval_s=0.05) as mon:
        pass
    assert mon.available is False and mon.peak == 0
