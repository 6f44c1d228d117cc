"""Test support: pretend to be one Ray Train worker, without starting Ray.

Exercise tests use this to check rank logic in milliseconds: inside
``simulated_worker(rank, world_size)`` the calls ``ray.train.get_context()`` and
``ray.train.report(...)`` answer as worker ``rank`` of ``world_size`` would,
``ray.train.torch.get_device()`` is the CPU, and every report (metrics and a
copy of the checkpoint's files) is recorded. Combined with
``coursekit.distributed.run_distributed`` (a real gloo process group) a whole
training function runs as N real DDP ranks without starting Ray.
Code must call them as ``ray.train.get_context()`` / ``ray.train.report()``,
the way the course writes them.

For training functions that read data with ``ray.train.get_dataset_shard``:
``simulated_dataset_shard`` hands a rank its part of in-memory columns
(``InMemoryShard``), and ``ShardServer`` with ``served_dataset_shards`` serves
real Ray Data shards to ranks that run in other processes.
"""
from __future__ import annotations

import dataclasses
import io
import threading
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np


@dataclasses.dataclass
class SimulatedReport:
    metrics: dict
    files: dict[str, bytes] | None  # relative path -> content; None when no checkpoint

    @property
    def has_checkpoint(self) -> bool:
        return self.files is not None

    def torch_load(self, name: str = "model.pt"):
        """Load one file of the reported checkpoint with torch.load (on the CPU)."""
        import torch

        if not self.files or name not in self.files:
            raise AssertionError(f"the reported checkpoint has no {name!r} (files: {sorted(self.files or {})})")
        return torch.load(io.BytesIO(self.files[name]), map_location="cpu", weights_only=True)


@contextmanager
def simulated_worker(rank: int = 0, world_size: int = 1, local_world_size: int | None = None):
    """Within this block, ray.train behaves as seen from worker ``rank`` of ``world_size``.

    ``local_world_size`` workers share a node (default: all of them, one node). With
    ``simulated_worker(3, 4, local_world_size=2)`` the worker is local rank 1 on node 1 of
    2 nodes x 2 workers, so code that confuses local and global ranks gives itself away.
    Yields the list of :class:`SimulatedReport` that ``ray.train.report`` receives."""
    import ray.train

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    local = world_size if local_world_size is None else local_world_size
    if local < 1 or world_size % local:
        raise ValueError(f"{world_size} workers do not fill nodes of {local}")
    reports: list[SimulatedReport] = []
    ctx = SimpleNamespace(
        get_world_rank=lambda: rank, get_world_size=lambda: world_size,
        get_local_rank=lambda: rank % local, get_local_world_size=lambda: local,
        get_node_rank=lambda: rank // local, get_experiment_name=lambda: "simulated",
        get_trial_name=lambda: "simulated", get_storage=lambda: None,
    )

    def report(metrics, checkpoint=None, **_):
        from ray.air._internal.torch_utils import contains_tensor

        if contains_tensor(metrics):   # what the real ray.train.report does (Train V2's context)
            raise ValueError("Passing objects containing Torch tensors as metrics is not supported: "
                             "report Python numbers (.item()) and put tensors in the checkpoint")
        files = None
        if checkpoint is not None:
            with checkpoint.as_directory() as d:  # copy now: the student's temp dir vanishes
                files = {str(p.relative_to(d)): p.read_bytes() for p in Path(d).rglob("*") if p.is_file()}
        reports.append(SimulatedReport(metrics=dict(metrics), files=files))

    import ray.train.torch
    import ray.train.v2.torch.train_loop_utils as loop_utils
    import torch

    # prepare_model/prepare_data_loader send a usage tag to the Ray cluster; a simulated
    # worker has no cluster (and in a forked process that call would hang).
    with mock.patch.object(ray.train, "get_context", lambda: ctx), \
            mock.patch.object(ray.train, "report", report), \
            mock.patch.object(loop_utils, "record_extra_usage_tag", lambda *a, **k: None), \
            mock.patch.object(ray.train.torch, "get_device", lambda: torch.device("cpu")):
        yield reports


def check_concept(answer, expected, why: str) -> None:
    """Grade a concept question: ``answer`` (a letter, or a set/list of letters) against ``expected``.

    A wrong answer fails with the expected answer's explanation; a right one prints it (stdout
    only: nbgrader scores a test cell that writes to stderr as failed)."""
    def norm(a):
        if isinstance(a, str):
            return frozenset(x for x in a.replace(",", " ").lower().split())
        if isinstance(a, (set, frozenset, list, tuple)):
            return frozenset(str(x).strip().lower() for x in a)
        return frozenset({str(a).strip().lower()})

    if norm(answer) != norm(expected):
        raise AssertionError(f"not quite ({answer!r}). Why: {why}")
    print(f"Right. {why}")


# -- testing a training function without Ray Data ----------------------------------------


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
    from contextlib import contextmanager
    from unittest import mock

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


# -- real Ray Data shards for training functions on other processes ---------------------------

_SHARD_METHODS = ("iter_torch_batches", "iter_batches", "iter_rows")


def _as_columns(item):
    """A batch (dict of tensors or arrays) as a dict of NumPy copies; None for anything else."""
    if not isinstance(item, dict):
        return None
    out = {}
    for key, value in item.items():
        if hasattr(value, "detach"):
            value = value.detach().cpu().numpy()
        out[key] = np.array(value, copy=True)
    return out


class ShardServer:
    """Ray Train's dataset shards, real, for training functions that run in other processes.

    Ray Train gives worker ``rank`` the iterator ``dataset.streaming_split(world_size, equal=True)[rank]``
    behind ``ray.train.get_dataset_shard(name)``. A test that runs a training function on forked or
    spawned ranks (``coursekit.distributed.run_distributed``) cannot call Ray there (a forked process
    must not use its parent's Ray connection). This server makes the real split here, in the process
    that runs Ray, and serves it: when rank ``r`` calls ``shard.iter_torch_batches(**kwargs)``
    (or ``iter_batches``, ``iter_rows``), the real iterator of split ``r`` runs here with exactly those
    arguments and its batches travel to the rank over a local socket, one by one.

    ``split="streaming"`` (default) uses ``Dataset.streaming_split(world_size, equal=True)``, as Ray
    Train does; ``split="materialized"`` uses ``Dataset.split(world_size, equal=True)`` (no
    coordinator actor to start: a second faster). Everything served is recorded per rank:
    ``requests[rank]`` (dataset name, method, keyword arguments) and ``epochs[rank]`` (one entry per
    iteration: the batches' columns concatenated in the order served, or None when the batches were
    not dicts), plus ``batch_sizes[rank]`` (per iteration, the rows of each batch).

    >>> with ShardServer({"train": ds}, world_size=4) as server:
    ...     run_distributed(worker, 4, server.address)     # worker: `with served_dataset_shards(address, rank):`
    >>> server.epochs[0][0]["id"]                           # the rows rank 0 got in its first pass
    """

    def __init__(self, datasets: dict, world_size: int, split: str = "streaming"):
        import secrets
        import warnings
        from multiprocessing.connection import Listener

        if split not in ("streaming", "materialized"):
            raise ValueError(f"split must be 'streaming' or 'materialized', not {split!r}")
        self.world_size = int(world_size)
        self.iterators = {}
        for name, ds in datasets.items():
            if split == "streaming":
                self.iterators[name] = ds.streaming_split(self.world_size, equal=True)
            else:
                self.iterators[name] = [part.iterator() for part in ds.split(self.world_size, equal=True)]
        self.requests: list[list[tuple]] = [[] for _ in range(self.world_size)]
        self.epochs: list[list] = [[] for _ in range(self.world_size)]
        self.batch_sizes: list[list[list[int]]] = [[] for _ in range(self.world_size)]
        self.errors: list[str] = []
        # Ray Data hands blocks it shares as read-only arrays; torch warns once when it wraps one
        # (harmless here: the batches are only read)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        self._authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=self._authkey)
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> tuple:
        """What a rank passes to ``served_dataset_shards`` (picklable: host, port, key)."""
        return (*self._listener.address, self._authkey, tuple(self.iterators))

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn) -> None:
        import traceback

        from ray import cloudpickle

        try:
            rank = conn.recv()
            while True:
                try:
                    name, method, payload = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    kwargs = cloudpickle.loads(payload)
                    if name not in self.iterators:
                        raise KeyError(f"no dataset named {name!r} was passed to the trainer "
                                       f"(datasets={{{', '.join(repr(n) + ': ...' for n in self.iterators)}}})")
                    if method not in _SHARD_METHODS:
                        raise AttributeError(f"a dataset shard (DataIterator) has no method {method!r} here")
                    self.requests[rank].append((name, method, dict(kwargs)))
                    columns, sizes = [], []
                    for item in getattr(self.iterators[name][rank], method)(**kwargs):
                        cols = _as_columns(item) if method != "iter_rows" else None
                        columns.append(cols)
                        if cols:
                            sizes.append(len(next(iter(cols.values()))))
                        _send(conn, ("item", item))
                    if columns and all(c is not None for c in columns):
                        self.epochs[rank].append({k: np.concatenate([c[k] for c in columns]) for k in columns[0]})
                    else:
                        self.epochs[rank].append(None)
                    self.batch_sizes[rank].append(sizes)
                    _send(conn, ("end", None))
                except Exception as e:  # the rank gets the error, as if its own call had raised it
                    self.errors.append(traceback.format_exc())
                    _send(conn, ("error", e if _picklable(e) else RuntimeError(repr(e))))
        except (EOFError, OSError):
            return
        finally:
            conn.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def __enter__(self) -> "ShardServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _send(conn, message) -> None:
    """Plain pickle bytes: Connection.send would share torch tensors through file descriptors and
    a helper thread per tensor (torch's multiprocessing reductions), slow for many small batches."""
    import pickle

    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    import pickle

    return pickle.loads(conn.recv_bytes())


def _picklable(obj) -> bool:
    import pickle

    try:
        pickle.dumps(obj)
        return True
    except Exception:
        return False


class _ServedShard:
    """What ``ray.train.get_dataset_shard`` returns on a rank of a ShardServer: its real iterator, served."""

    def __init__(self, conn, name: str):
        self._conn, self._name = conn, name

    def _iterate(self, method: str, kwargs: dict):
        from ray import cloudpickle

        self._conn.send((self._name, method, cloudpickle.dumps(kwargs)))
        done = False
        try:
            while True:
                kind, value = _recv(self._conn)
                if kind == "item":
                    yield value
                    continue
                done = True
                if kind == "error":
                    raise value
                return
        finally:
            while not done:  # stopped early: read the rest, so the next request starts clean
                kind, _ = _recv(self._conn)
                done = kind != "item"

    def iter_torch_batches(self, **kwargs):
        return self._iterate("iter_torch_batches", kwargs)

    def iter_batches(self, **kwargs):
        return self._iterate("iter_batches", kwargs)

    def iter_rows(self, **kwargs):
        return self._iterate("iter_rows", kwargs)

    def __iter__(self):
        raise TypeError("iterate a dataset shard with shard.iter_torch_batches(batch_size=...)")


NO_RAY_HERE = ("this training worker cannot use Ray Data directly here: read your part of the data with "
               "ray.train.get_dataset_shard('train') (in Ray Train, a dataset used inside the training "
               "function would be read in full by every worker)")


class _NoRay:
    """Stands in for the GCS client on a rank: every use is an error (the parent's connection would hang)."""

    def __getattr__(self, name):
        raise RuntimeError(NO_RAY_HERE)


def served_dataset_shards(address: tuple, rank: int):
    """On rank ``rank`` of a ShardServer: ``ray.train.get_dataset_shard(name)`` returns the served shard.

    Use it together with ``coursekit.testing.simulated_worker``. Inside the block this process may
    not call Ray itself (a forked rank shares its parent's Ray connection, which would hang): a call
    raises a RuntimeError that says to use the shard."""
    from contextlib import contextmanager
    from multiprocessing.connection import Client
    from unittest import mock

    import ray.train
    from ray._private import worker as ray_worker
    from ray.experimental import internal_kv

    @contextmanager
    def _ctx():
        host, port, key, names = address
        conn = Client((host, port), authkey=key)
        conn.send(rank)

        def get_dataset_shard(dataset_name: str | None = None):
            if dataset_name not in names:
                raise KeyError(f"no dataset named {dataset_name!r} was passed to the trainer "
                               f"(datasets={{{', '.join(repr(n) + ': ...' for n in names)}}})")
            return _ServedShard(conn, dataset_name)

        def no_ray(*_args, **_kwargs):
            raise RuntimeError(NO_RAY_HERE)

        try:
            with mock.patch.object(ray.train, "get_dataset_shard", get_dataset_shard), \
                    mock.patch.object(ray_worker.global_worker, "check_connected", no_ray), \
                    mock.patch.object(internal_kv, "global_gcs_client", _NoRay()):
                yield
        finally:
            conn.close()

    return _ctx()
