"""Plumbing for module 03 (Ray Data), shared by its notebook, its script and the tests.

* the course digits written as real files: Parquet (``write_digits_parquet``)
  and an image folder, one sub-folder per label (``write_digits_image_folder``);
* a synthetic data set of any size for streaming: the course digits at 8x
  resolution (224x224 uint8) with noise, generated block by block on Ray
  Data's CPU workers, with a row ``id`` so that a test can check that every
  row reached training exactly once (``synthetic_dataset``);
* the CPU budget of a job where Ray Train and Ray Data share a cluster
  (``plan_resources``, ``configure_ray_data``): an impossible split is refused
  with a reason instead of a job that stalls;
* object-store and memory measurements of this node's Ray (``ObjectStoreMonitor``).

What is *not* here on purpose: the preprocessing of the course digits and the
training loop. Those are the module's exercises and stay in the notebook.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
import time
from pathlib import Path

import numpy as np

from coursekit.proctree import tree, tree_pss
from coursekit.scaling import ScalingError, cluster_resources

# -- the course digits as files ------------------------------------------------------------


def write_digits_parquet(digits, folder: str | Path, num_files: int = 4) -> list[Path]:
    """Write ``digits`` (a coursekit.data.Digits) as ``num_files`` Parquet files.

    Columns: ``image`` (uint8 28x28, stored as Ray's tensor extension type, so
    ``ray.data.read_parquet`` gives it back as an ndarray column), ``label`` (int64) and
    ``id`` (the row's index in ``digits``, to check later which rows arrived where).
    Existing ``*.parquet`` files in ``folder`` are replaced."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.extensions import ArrowTensorArray

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.parquet"):
        old.unlink()
    images = digits.images.numpy() if hasattr(digits.images, "numpy") else np.asarray(digits.images)
    labels = digits.labels.numpy() if hasattr(digits.labels, "numpy") else np.asarray(digits.labels)
    if len(images) == 0:
        raise ValueError("no digits to write")
    num_files = max(1, min(int(num_files), len(images)))
    paths = []
    for i, idx in enumerate(np.array_split(np.arange(len(images)), num_files)):
        table = pa.table({"image": ArrowTensorArray.from_numpy(np.ascontiguousarray(images[idx])),
                          "label": pa.array(labels[idx].astype(np.int64)),
                          "id": pa.array(idx.astype(np.int64))})
        path = folder / f"digits-{i:03d}.parquet"
        pq.write_table(table, path)
        paths.append(path)
    return paths


def write_digits_image_folder(digits, folder: str | Path) -> Path:
    """Write ``digits`` as grayscale PNG files, ``folder/<label>/<index>.png`` (torchvision's ImageFolder layout)."""
    from PIL import Image

    folder = Path(folder)
    images = digits.images.numpy() if hasattr(digits.images, "numpy") else np.asarray(digits.images)
    labels = digits.labels.numpy() if hasattr(digits.labels, "numpy") else np.asarray(digits.labels)
    for i, (img, label) in enumerate(zip(images, labels)):
        sub = folder / str(int(label))
        sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.asarray(img, dtype=np.uint8), mode="L").save(sub / f"{i:05d}.png")
    return folder


def require_files(folder: str | Path, pattern: str, what: str) -> list[Path]:
    """The files matching ``pattern`` in ``folder``, or a FileNotFoundError that says how to make them."""
    folder = Path(folder)
    files = sorted(folder.rglob(pattern)) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(
            f"No {what} ({pattern}) in {folder}. Run the cell that writes the course digits to disk "
            "first (write_digits_parquet / write_digits_image_folder), or point the path at your data.")
    return files


# -- a synthetic data set of a chosen size ----------------------------------------------

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


# -- sharing the CPUs between Ray Train and Ray Data ------------------------------------


@dataclasses.dataclass(frozen=True)
class DataPlan:
    """Who gets which CPUs: Ray Train's workers, and Ray Data's preprocessing tasks."""

    cluster_cpus: float
    num_workers: int
    cpus_per_worker: float        # each Ray Train worker's CPU reservation
    use_gpu: bool
    data_cpus: float              # CPUs left for Ray Data (its resource limit)
    map_num_cpus: float           # CPUs each map_batches task reserves
    map_concurrency: int          # most map_batches tasks running at once
    object_store_bytes: int | None  # Ray Data's object-store budget (None: Ray Data's default)

    def data_config(self):
        """A ``ray.train.DataConfig`` that gives the trainer's data ingest this plan's limits."""
        from ray.train import DataConfig

        return DataConfig(execution_options=_execution_options(self))

    def describe(self) -> str:
        train = self.num_workers * self.cpus_per_worker
        store = "default" if self.object_store_bytes is None else f"{self.object_store_bytes / 2**20:.0f} MiB"
        return (f"cluster: {self.cluster_cpus:g} CPUs\n"
                f"  Ray Train: {self.num_workers} workers x {self.cpus_per_worker:g} CPU"
                f"{' + 1 GPU' if self.use_gpu else ''} = {train:g} CPUs\n"
                f"  Ray Data : {self.data_cpus:g} CPUs left -> at most {self.map_concurrency} map_batches "
                f"tasks x {self.map_num_cpus:g} CPU at once; object-store budget {store}")


def _execution_options(plan: DataPlan):
    from ray.data import ExecutionOptions, ExecutionResources

    return ExecutionOptions(resource_limits=ExecutionResources.for_limits(
        cpu=plan.data_cpus, object_store_memory=plan.object_store_bytes))


def plan_resources(num_workers: int, cpus_per_worker: float, use_gpu: bool = False,
                   map_num_cpus: float = 0.5, object_store_mib: float | None = None,
                   resources: dict | None = None) -> DataPlan:
    """Split the cluster's CPUs between training workers and Ray Data, or raise ScalingError.

    Ray Train reserves ``num_workers x cpus_per_worker`` CPUs for the whole run; Ray Data's
    preprocessing tasks can only use what is left. If that is less than one task's
    ``map_num_cpus`` the job would start and then wait forever for data."""
    res = resources if resources is not None else cluster_resources()
    cpus = float(res.get("CPU", 0))
    if int(num_workers) != num_workers or num_workers < 1:
        raise ScalingError(f"num_workers must be a whole number of at least 1 (got {num_workers}).")
    if cpus_per_worker <= 0 or map_num_cpus <= 0:
        raise ScalingError("Training workers and preprocessing tasks each need some CPU (> 0).")
    if use_gpu and res.get("GPU", 0) < num_workers:
        raise ScalingError(f"{num_workers} GPU workers need {num_workers} GPUs; this cluster has "
                           f"{res.get('GPU', 0)}. Use fewer workers or use_gpu=False.")
    train = num_workers * cpus_per_worker
    left = cpus - train
    if left < map_num_cpus:
        hint = (cpus - map_num_cpus) / num_workers
        raise ScalingError(
            f"{num_workers} training workers x {cpus_per_worker:g} CPU = {train:g} of this cluster's {cpus:g} "
            f"CPUs, which leaves {max(left, 0):g} for Ray Data's preprocessing; one map_batches task needs "
            f"{map_num_cpus:g}. The trainer would start and then wait forever for data. Give each training "
            f"worker at most {hint:g} CPU (e.g. resources_per_worker={{'CPU': {hint:g}}}), use fewer workers, "
            "or add CPUs." if hint > 0 else
            f"{num_workers} training workers x {cpus_per_worker:g} CPU leave no CPU for Ray Data on a "
            f"{cpus:g}-CPU cluster. Use fewer workers or add CPUs.")
    return DataPlan(cluster_cpus=cpus, num_workers=int(num_workers), cpus_per_worker=float(cpus_per_worker),
                    use_gpu=bool(use_gpu), data_cpus=left, map_num_cpus=float(map_num_cpus),
                    map_concurrency=max(1, int(left // map_num_cpus)),
                    object_store_bytes=None if object_store_mib is None else int(object_store_mib * 2**20))


def local_ray_options(object_store_mib: float | None = None) -> dict:
    """``init_ray`` options for a local Ray that runs Ray Data next to Ray Train on a few CPUs.

    Ray keeps as many idle worker processes as the machine has CPUs and kills the others after
    1 s idle; Ray Data's fractional-CPU tasks need more processes than that, pause under
    backpressure, and then pay for a new process (seconds of imports on 2 CPUs) again and again.
    Idle workers are kept for 10 minutes instead. ``object_store_mib`` caps the object store."""
    options: dict = {"_system_config": {"idle_worker_killing_time_threshold_ms": 600_000}}
    if object_store_mib:
        options["object_store_memory"] = int(object_store_mib * 2**20)
    return options


SMALL_CLUSTER_CPUS = 16   # below this, configure_ray_data picks Ray Data's task-based Parquet reader


def configure_ray_data(plan: DataPlan, block_bytes: int = 4 * 2**20):
    """Apply a DataPlan to this driver's ``DataContext`` (Ray Train passes it on to its data ingest).

    Sets the CPU (and object-store) limit of Ray Data's streaming executor, a block size
    that suits a small object store, and turns the progress bars off (noise in a notebook).
    Pass ``plan.data_config()`` as the trainer's ``dataset_config=`` to apply the same limits there."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.execution_options.resource_limits = _execution_options(plan).resource_limits
    # Ray 2.60's new Parquet reader (DataSourceV2) lists files and reads footers with pools of
    # actors (up to 32 footer readers) per read: on a small cluster every read_parquet then
    # starts several new worker processes, 20-50 s on 2 CPUs for a 1 MB data set. The classic
    # reader runs plain tasks. Big clusters keep the default.
    if plan.cluster_cpus < SMALL_CLUSTER_CPUS:
        ctx.use_datasource_v2 = False
    ctx.target_max_block_size = block_bytes
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    from ray.util.debug import log_once

    log_once("ray_data_progress_manager_disabled")  # we know: no "Progress bars disabled" warning here
    import logging

    logging.getLogger("ray.data").setLevel(logging.WARNING)  # no per-run info lines in the notebook
    return ctx


# -- measuring the object store --------------------------------------------------------


def _find_raylet():
    """The raylet (which hosts the object store) of this node: an ancestor of a Ray worker,
    or a child of a driver that started Ray. None where it cannot be seen (a remote cluster)."""
    import psutil

    me = psutil.Process()
    for p in [me, *me.parents()]:
        if p.name() == "raylet":
            return p
    for p in tree(me)[1:]:
        if p.name() == "raylet":
            return p
    return None


def _plasma_file(raylet) -> str | None:
    fd_dir = Path(f"/proc/{raylet.pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = Path(fd).readlink().as_posix()
        except OSError:
            continue
        if "/plasma" in target:
            return str(fd)
    return None


def _spill_dirs(raylet) -> list[Path]:
    for arg in raylet.cmdline():
        if arg.startswith("--session_dir="):
            return [p for p in Path(arg.split("=", 1)[1]).glob("*spill*") if p.is_dir()]
    return []


def _dir_bytes(dirs: list[Path]) -> int:
    return sum(f.stat().st_size for d in dirs for f in d.rglob("*") if f.is_file())


class ObjectStoreMonitor:
    """Watch this node's object store and Ray processes while a block of code runs.

    * ``peak``: bytes of the object store's shared memory that are in use (pages touched;
      a high-water mark: the store keeps pages it has used) at the end;
    * ``capacity``: the store's size;
    * ``peak_pss``: the most memory (PSS) the raylet and every Ray worker on this node used
      together, object store included;
    * ``spilled``: bytes Ray wrote to disk because the store was full;
    * ``pss``: that memory at the latest sample (read it while the block runs to trace memory over time).

    Local to one node (the one this process runs on); ``available`` is False elsewhere.

    >>> with ObjectStoreMonitor() as mon:
    ...     consume(dataset)
    >>> mon.peak, mon.capacity, mon.peak_pss
    """

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.peak = self.capacity = self.peak_pss = self.spilled = 0
        self.pss = 0                  # the Ray processes' PSS at the last sample
        self._raylet = _find_raylet()
        self._plasma = _plasma_file(self._raylet) if self._raylet else None
        self._spill = _spill_dirs(self._raylet) if self._raylet else []
        self._spill0 = _dir_bytes(self._spill)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self._plasma is not None

    def sample(self) -> None:
        if not self.available:
            return
        st = Path(self._plasma).stat()
        self.peak = max(self.peak, st.st_blocks * 512)
        self.capacity = st.st_size
        self.pss = tree_pss(self._raylet)
        self.peak_pss = max(self.peak_pss, self.pss)
        self.spilled = _dir_bytes(self._spill) - self._spill0

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # a process that ends while we look is not an error
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "ObjectStoreMonitor":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.sample()
        except Exception:
            pass

    def as_dict(self) -> dict:
        return {"object_store_peak": self.peak, "object_store_capacity": self.capacity,
                "ray_peak_pss": self.peak_pss, "spilled": self.spilled}


def timed(iterable, warmup: int = 0):
    """Iterate ``iterable``, returning (number of items, seconds after the first ``warmup`` items)."""
    n, start = 0, None
    for i, _ in enumerate(iterable):
        if i == warmup:
            start = time.perf_counter()
        n += 1
    return n, (time.perf_counter() - start) if start else 0.0


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
        n = self.count()
        size = n if batch_size is None else int(batch_size)
        for start in range(0, n, max(size, 1)):
            if drop_last and start + size > n:
                break
            batch = {k: torch.as_tensor(v[start:start + size]) for k, v in self.columns.items()}
            if isinstance(dtypes, dict):  # like Ray Data: a dict must name every column
                batch = {k: t.to(dtypes[k]) for k, t in batch.items()}
            elif dtypes is not None:
                batch = {k: t.to(dtypes) for k, t in batch.items()}
            yield batch

    def iter_batches(self, *, batch_size: int | None = 256, drop_last: bool = False, **kwargs):
        self.calls.append(dict(batch_size=batch_size, drop_last=drop_last, numpy=True, **kwargs))
        n = self.count()
        size = n if batch_size is None else int(batch_size)
        for start in range(0, n, max(size, 1)):
            if drop_last and start + size > n:
                break
            yield {k: v[start:start + size] for k, v in self.columns.items()}


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
