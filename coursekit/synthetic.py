"""A synthetic data set of any size, for streaming with Ray Data (module 03).

The course digits at 8x resolution (224x224 uint8) with noise, generated block by block
on Ray Data's CPU workers, with a row ``id`` so that a test can check that every row
reached training exactly once (``synthetic_dataset``), and the preprocessing that brings
them back to 28x28 (``preprocess_synthetic``).

This module imports only NumPy: Ray Data's tasks import it on every fresh worker process.
"""
from __future__ import annotations

import functools

import numpy as np

# coursekit.data's MEAN and STD (a test keeps them equal): importing coursekit.data here would
# import torch into every Ray Data task that preprocesses, seconds per fresh worker process.
NORMALIZE_MEAN_STD = (0.5, 0.5)
SCALE = 8                     # 28x28 digits -> 224x224 "raw" images (ImageNet-sized)
RAW_SIDE = 28 * SCALE
ROW_BYTES = RAW_SIDE * RAW_SIDE + 8 + 8   # image + id + label, as generated


@functools.lru_cache(maxsize=1)
def _base_digits():
    from coursekit.data import load_digits

    d = load_digits(train=True, quiet=True)
    return d.images.numpy(), d.labels.numpy()


def synthetic_rows(size_bytes: float) -> int:
    """How many synthetic rows make ``size_bytes`` of raw data."""
    return max(1, int(size_bytes // ROW_BYTES))


def generate_synthetic_batch(batch: dict, digits: tuple | None = None) -> dict:
    """``{"id": int64[B]}`` -> ``{"id", "image": uint8[B,224,224], "label"}``: digit ``id % N`` at 8x, plus noise.

    Deterministic in the ids (the noise is seeded by the batch's first id). ``digits``: the
    (images, labels) arrays to draw from; ``synthetic_dataset`` passes them from the driver so
    that Ray Data's tasks do not each load the digits (and import torch) on a fresh worker."""
    ids = np.asarray(batch["id"], dtype=np.int64)
    images, labels = digits if digits is not None else _base_digits()
    base = images[ids % len(images)]
    big = base.repeat(SCALE, axis=1).repeat(SCALE, axis=2).astype(np.int16)
    rng = np.random.default_rng(int(ids[0]) if len(ids) else 0)
    big += rng.integers(-48, 49, size=big.shape, dtype=np.int16)
    return {"id": ids, "image": np.clip(big, 0, 255).astype(np.uint8),
            "label": labels[ids % len(labels)].astype(np.int64)}


def preprocess_synthetic(batch: dict) -> dict:
    """Preprocessing of the synthetic raw images, on Ray Data's CPU tasks.

    uint8 [B,224,224] -> 8x8 average pooling -> float32 [B,1,28,28] in [0, 1], normalised with
    the course's mean and std (``coursekit.data``), so the model sees what it sees for real digits."""
    MEAN, STD = NORMALIZE_MEAN_STD
    raw = np.asarray(batch["image"], dtype=np.float32) / 255.0
    b, h, w = raw.shape
    small = raw.reshape(b, h // SCALE, SCALE, w // SCALE, SCALE).mean(axis=(2, 4))
    return {"id": batch["id"], "label": batch["label"],
            "image": ((small - MEAN) / STD)[:, None, :, :].astype(np.float32)}


def synthetic_dataset(size_bytes: float | None = None, num_rows: int | None = None,
                      block_bytes: int = 4 * 2**20, num_cpus: float = 0.5, concurrency: int | None = None):
    """A lazy Ray Dataset of synthetic 224x224 digits totalling about ``size_bytes`` (or ``num_rows`` rows).

    Nothing is generated until the data set is consumed: blocks of about ``block_bytes``
    are made by Ray Data tasks (``num_cpus`` each) as the consumer asks for them."""
    import ray.data

    if (size_bytes is None) == (num_rows is None):
        raise ValueError("give exactly one of size_bytes and num_rows")
    n = synthetic_rows(size_bytes) if num_rows is None else int(num_rows)
    if n < 1:
        raise ValueError(f"a data set needs at least one row (got {n})")
    rows_per_block = max(1, block_bytes // ROW_BYTES)
    blocks = max(1, -(-n // rows_per_block))
    generate = functools.partial(generate_synthetic_batch, digits=_base_digits())
    return ray.data.range(n, override_num_blocks=blocks).map_batches(
        generate, batch_format="numpy", batch_size=None, num_cpus=num_cpus,
        compute=ray.data.TaskPoolStrategy(size=concurrency) if concurrency else None)
