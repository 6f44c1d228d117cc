"""In-memory dataset shards: a rank's part of some columns, standing in for ``ray.train.get_dataset_shard``.

For training functions that read data with ``ray.train.get_dataset_shard``: ``split_rows`` cuts columns as
Ray Train's equal split does, ``InMemoryShard`` iterates a rank's rows as a ``DataIterator`` would, and
``simulated_dataset_shard`` makes ``ray.train.get_dataset_shard`` return it (with ``simulated_worker``).
"""
from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import numpy as np


def split_rows(columns: dict, world_size: int, rank: int) -> dict:
    """Rank ``rank``'s rows of ``columns`` when they are split ``world_size`` ways into equal parts.

    Like ``Dataset.streaming_split(world_size, equal=True)`` (which Ray Train uses): every
    worker gets ``num_rows // world_size`` rows per epoch. Here the parts are contiguous, so
    a test knows which rows each worker sees; real Ray Data hands out blocks as they are ready."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    n = len(next(iter(columns.values())))
    per = n // world_size
    return {k: np.asarray(v)[rank * per:(rank + 1) * per] for k, v in columns.items()}


class InMemoryShard:
    """Stands in for the ``DataIterator`` that ``ray.train.get_dataset_shard`` returns.

    Yields this worker's rows in order, as dicts of torch tensors, and remembers how
    it was asked (``calls``: the keyword arguments of every ``iter_torch_batches`` call)."""

    def __init__(self, columns: dict):
        self.columns = {k: np.asarray(v) for k, v in columns.items()}
        self.calls: list[dict] = []

    def count(self) -> int:
        return len(next(iter(self.columns.values())))

    def iter_torch_batches(self, *, batch_size: int | None = 256, dtypes=None, device="auto",
                           drop_last: bool = False, **kwargs):
        import torch

        self.calls.append(dict(batch_size=batch_size, dtypes=dtypes, drop_last=drop_last, **kwargs))
        for rows in self._slices(batch_size, drop_last):
            batch = {k: torch.as_tensor(v[rows]) for k, v in self.columns.items()}
            if isinstance(dtypes, dict):  # like Ray Data: a dict must name every column
                batch = {k: t.to(dtypes[k]) for k, t in batch.items()}
            elif dtypes is not None:
                batch = {k: t.to(dtypes) for k, t in batch.items()}
            yield batch

    def iter_batches(self, *, batch_size: int | None = 256, drop_last: bool = False, **kwargs):
        self.calls.append(dict(batch_size=batch_size, drop_last=drop_last, numpy=True, **kwargs))
        for rows in self._slices(batch_size, drop_last):
            yield {k: v[rows] for k, v in self.columns.items()}

    def _slices(self, batch_size: int | None, drop_last: bool):
        """The row slices of the batches, as Ray Data cuts them (batch_size=None: one batch of everything)."""
        n = self.count()
        size = n if batch_size is None else int(batch_size)
        for start in range(0, n, max(size, 1)):
            if drop_last and start + size > n:
                break
            yield slice(start, start + size)


def simulated_dataset_shard(columns: dict, rank: int, world_size: int, name: str = "train"):
    """Within this block ``ray.train.get_dataset_shard(name)`` returns rank ``rank``'s InMemoryShard.

    Use it together with ``coursekit.testing.simulated_worker``. Yields the shard."""
    import ray.train

    @contextmanager
    def _ctx():
        shard = InMemoryShard(split_rows(columns, world_size, rank))

        def get_dataset_shard(dataset_name: str | None = None):
            if dataset_name != name:
                raise KeyError(f"no dataset named {dataset_name!r} was passed to the trainer "
                               f"(datasets={{'{name}': ...}})")
            return shard

        with mock.patch.object(ray.train, "get_dataset_shard", get_dataset_shard):
            yield shard

    return _ctx()
