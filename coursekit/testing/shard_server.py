"""A socket server of real Ray Data shards, for training functions that run on forked or spawned ranks.

``ShardServer`` makes the real split in the process that runs Ray and serves each rank its iterator's batches
over a local socket; on a rank, ``served_dataset_shards`` makes ``ray.train.get_dataset_shard`` return the
served shard and turns every other use of Ray into an error that says to use the shard.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from unittest import mock

import numpy as np

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
    from multiprocessing.connection import Client

    import ray.train

    from coursekit.ray_internals import internal_kv, ray_worker

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
