"""Per-rank memory accounting: how many bytes of parameters, gradients and optimizer state
does *this* rank hold?

Under DDP every rank holds full copies (and a second copy of the gradients in its all-reduce buckets,
counted with the gradients). Under FSDP2 (``fully_shard``) the parameters,
their gradients and the optimizer state are ``DTensor``s, and a rank holds only its
local shard (``DTensor.to_local()``). The functions here count what a rank really
holds, so notebooks *measure* the saving instead of quoting it:

>>> rank_bytes(model, optimizer)     # on each rank, after one optimizer step
{'params': 144404, 'grads': 144404, 'optimizer': 288936}

The counts are device-independent (they work on CPU and GPU tensors alike). On a GPU,
:func:`peak_device_bytes` adds what the allocator saw (activations, all-gathered
parameters, communication buffers), which model-state counting cannot.

Other sharding schemes plug in through :func:`local_tensor`: a tensor that carries its
local partition as ``ds_tensor`` (DeepSpeed ZeRO-3 parameters) is counted by that
partition, and optimizer wrappers that keep the real optimizer in ``.optimizer`` are
unwrapped by :func:`optimizer_state_bytes`.
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch

KINDS = ("params", "grads", "optimizer")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` that lives on this rank: a DTensor's local shard, else ``t`` itself."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.to_local()
    part = getattr(t, "ds_tensor", None)  # DeepSpeed ZeRO-3: the partition this rank owns
    if isinstance(part, torch.Tensor):
        return part
    return t


def tensor_bytes(t: torch.Tensor | None) -> int:
    """Bytes of ``t`` held by this rank (0 for None)."""
    if t is None:
        return 0
    local = local_tensor(t)
    return local.numel() * local.element_size()


def _state_tensors(state) -> Iterable[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _state_tensors(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _state_tensors(v)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state (Adam's two moments, step counters...) held by this rank."""
    if optimizer is None:
        return 0
    inner = getattr(optimizer, "optimizer", None)  # wrappers (e.g. DeepSpeed's) keep the real one here
    if not hasattr(optimizer, "state") and inner is not None:
        return optimizer_state_bytes(inner)
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in _state_tensors(dict(optimizer.state)):
        local = local_tensor(t)
        # the same bytes seen again (one tensor under two names); data_ptr() already includes the view's offset
        key = (id(local), 0) if local.numel() == 0 else (local.data_ptr(), local.numel() * local.element_size())
        if key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def ddp_bucket_bytes(model: torch.nn.Module) -> int:
    """Bytes DDP keeps in its all-reduce buckets beside the gradients (0 for a model that is not DDP).

    DDP's reducer allocates, when it is built, buckets that hold every gradient (in 25 MiB buckets by default) and
    all-reduces them there: a second copy of all the gradients, unless ``gradient_as_bucket_view=True`` makes each
    ``.grad`` a view into its bucket (then the buckets *are* the gradients, counted once). The sizes are the ones the
    reducer reports itself (``bucket_sizes`` of DDP's logging data: private, torch 2.14; a torch that no longer has
    it raises here, saying so, instead of counting no buckets)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or model.gradient_as_bucket_view:
        return 0
    try:
        sizes = model._get_ddp_logging_data()["bucket_sizes"]
    except (AttributeError, KeyError) as e:
        raise RuntimeError(f"torch {torch.__version__} does not report DDP's bucket sizes where coursekit.memory "
                           "reads them (DistributedDataParallel._get_ddp_logging_data()['bucket_sizes'], torch "
                           "2.14): update ddp_bucket_bytes for this torch") from e
    return sum(int(size) for size in str(sizes).replace(",", " ").split())


def rank_bytes(model: torch.nn.Module, optimizer=None) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state.

    Works for a plain model, a DDP-wrapped one (full copies) and an FSDP2 model
    (local shards). Gradients count once they exist (after a backward pass), the
    optimizer state once it exists (after the first ``step``). Under DDP ``grads`` also holds the
    copy of the gradients in DDP's all-reduce buckets (:func:`ddp_bucket_bytes`), as
    :func:`zero_rank_bytes` counts DeepSpeed's gradient buffers: what each strategy keeps to reduce its
    gradients counts the same way."""
    params = list(model.parameters())
    return {
        "params": sum(tensor_bytes(p) for p in params),
        "grads": sum(tensor_bytes(p.grad) for p in params) + ddp_bucket_bytes(model),
        "optimizer": optimizer_state_bytes(optimizer),
    }


def padding_bytes(model: torch.nn.Module) -> int:
    """Bytes FSDP2 allocates on this rank beyond its shard.

    ``fully_shard`` splits each parameter along dim 0 into ``world_size`` chunks of
    ``ceil(dim0 / world_size)`` rows and pads the short ones, so every rank allocates
    the same padded size; ``to_local()`` shows the unpadded shard."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        if isinstance(p, DTensor):
            local = p.to_local()
            total += local.untyped_storage().nbytes() - local.numel() * local.element_size()
    return total


def count_params(model: torch.nn.Module) -> int:
    """Number of parameters of the whole model (a DTensor counts with its global size)."""
    return sum(p.numel() for p in model.parameters())


def peak_device_bytes(device: str | torch.device) -> int | None:
    """Peak bytes the CUDA allocator handed out on ``device`` (None on CPU, where there is no such counter)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(device))
    return None


def mib(n: float) -> float:
    return n / 2**20


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def memory_table(rows: list[dict]):
    """A pandas DataFrame of measurements: one row per (strategy, world_size, rank), values in bytes.

    Each row is a dict with ``strategy``, ``world_size``, ``rank`` and the keys of
    :func:`rank_bytes`; a ``total`` column is added."""
    import pandas as pd

    df = pd.DataFrame(rows)
    missing = {"strategy", "world_size", "rank", *KINDS} - set(df.columns)
    if missing:
        raise ValueError(f"each row needs {sorted(missing)}")
    df["total"] = df[list(KINDS)].sum(axis=1)
    return df.sort_values(["world_size", "strategy", "rank"]).reset_index(drop=True)


def bar_chart(table, ax=None, title: str = "Model state per rank"):
    """Stacked bars (params, grads, optimizer) of the largest rank per strategy and world size, in MiB."""
    import matplotlib.pyplot as plt

    worst = table.loc[table.groupby(["world_size", "strategy"])["total"].idxmax()]
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{s}\nN={n}" for s, n in zip(worst["strategy"], worst["world_size"])]
    bottom = [0.0] * len(worst)
    for kind, colour in zip(KINDS, ("#4c72b0", "#dd8452", "#55a868")):
        values = [mib(v) for v in worst[kind]]
        ax.bar(labels, values, bottom=bottom, label=kind, color=colour)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("MiB on the largest rank")
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return ax


# --- DeepSpeed ZeRO (module 06) -------------------------------------------------------

def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _reachable_tensors(obj, out: list, seen: set, depth: int = 0, extras: bool = True) -> None:
    """Tensors in ``obj`` (nested lists, tuples, dicts), with their ``.grad``/``ds_tensor`` if ``extras``."""
    if depth > 4 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        if extras:
            out.extend(x for x in (obj.grad, getattr(obj, "ds_tensor", None)) if isinstance(x, torch.Tensor))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _reachable_tensors(v, out, seen, depth + 1, extras)
    elif isinstance(obj, dict):
        for v in obj.values():
            _reachable_tensors(v, out, seen, depth + 1, extras)


#: attributes of DeepSpeed's ZeRO optimizers that hold the fp32 master partition
ZERO_MASTER_ATTRIBUTES = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")


def zero_rank_bytes(engine) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state in a DeepSpeed engine.

    Counts allocated storage, each storage once (DeepSpeed keeps parameters as views of
    flat buffers): ``params`` are the model's parameters (under ZeRO-3 their partition
    ``ds_tensor``; a parameter gathered at this moment counts in full); ``optimizer`` is
    the inner optimizer's state (Adam's moments) plus the fp32 master partition
    (``master``, also reported on its own); ``grads`` is everything else the ZeRO optimizer
    holds: gradients, gradient partitions and its buffers (offload buffers too). Call it
    on every rank, e.g. after a backward pass (gradients alive) that follows a first step
    (optimizer state exists)."""
    module = getattr(engine, "module", engine)
    zero_opt = engine.optimizer
    inner = getattr(zero_opt, "optimizer", None) or zero_opt
    counted: set[int] = set()

    def add(tensors) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            ptr, nbytes = _storage(t)
            if nbytes == 0 or ptr in counted:
                continue
            counted.add(ptr)
            total += nbytes
        return total

    params = add(t for p in module.parameters() for t in (p.data, getattr(p, "ds_tensor", None)))
    state: list = []
    _reachable_tensors(dict(getattr(inner, "state", {})), state, set())
    moments = add(state)
    master_tensors: list = [p for g in getattr(inner, "param_groups", []) for p in g["params"]]
    for name in ZERO_MASTER_ATTRIBUTES:
        _reachable_tensors(getattr(zero_opt, name, None), master_tensors, set(), extras=False)
    master = add(t.data if isinstance(t, torch.nn.Parameter) else t for t in master_tensors)
    rest: list = [p.grad for p in module.parameters()]
    if zero_opt is not inner:
        _reachable_tensors(vars(zero_opt), rest, set())
    grads = add(rest)
    return {"params": params, "grads": grads, "optimizer": moments + master, "master": master}


def state_bytes(model, optimizer=None) -> dict[str, int]:
    """This rank's model-state bytes: a DeepSpeed engine through ``zero_rank_bytes``, else ``rank_bytes``."""
    if type(model).__name__ == "DeepSpeedEngine":
        counted = zero_rank_bytes(model)
        return {k: counted[k] for k in KINDS}
    return rank_bytes(model, optimizer)


# --- peak memory of a piece of code (module 05: construction on the meta device) ------------------------

def _status_kib(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``), None where there is no such file (not Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def rss_follows_tensors(threshold: int = 64 * 1024) -> bool:
    """Make this process's RSS follow its live tensors: glibc's malloc then gives every block of ``threshold``
    bytes or more its own memory mapping, returned to the system when freed.

    By default glibc raises that threshold as a program frees large blocks and keeps later ones in its heap,
    where a freed block stays resident and a new tensor reuses it unseen: a peak measured after other work
    then misses what the code allocated. Call it at the start of a process that measures with
    :class:`PeakMemory` (a forked rank: it does not change the notebook's kernel). True if glibc took it."""
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "mallopt") and libc.mallopt(-3, threshold))  # M_MMAP_THRESHOLD


def _trim() -> None:
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class PeakMemory:
    """How far this process's memory rose above where it stood when the block began.

    >>> with PeakMemory("cpu") as peak:
    ...     x = torch.ones(2**24)          # 64 MiB
    ...     del x
    >>> peak.bytes >= 64 * 2**20           # the peak, although x was freed before the end
    True

    On CPU it reads the resident set size (RSS): Linux's ``VmHWM`` (the RSS high-water mark) is reset to the
    current RSS by writing ``5`` to ``/proc/self/clear_refs`` on entry, and read on exit; ``bytes`` is that peak
    minus the RSS on entry. It counts everything the process touched (tensors, allocator slack, pages of code
    run for the first time), so run a small warm-up through the same code first when a few MiB matter, and call
    :func:`rss_follows_tensors` at the start of the process. On a
    CUDA device it is ``torch.cuda.max_memory_allocated`` (reset on entry) minus the bytes allocated on entry:
    tensors only. ``bytes`` is None where neither counter exists (CPU on a system without ``/proc``).

    ``high`` is the absolute high-water mark of the block: on a CPU the resident set at its highest (the libraries'
    code and data and the allocator's slack included), on a CUDA device the memory its allocator reserved at most
    (``high_allocated``: its tensors at most). :meth:`high_water` gives them as plain data."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.bytes: int | None = None
        self.high: int | None = None
        self.high_allocated: int | None = None
        self._start: int | None = None

    def _cuda(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    def __enter__(self) -> "PeakMemory":
        if self._cuda():
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        _trim()                            # freed heap memory back to the system first: a lower, truer start
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")            # VmHWM := VmRSS now
        except OSError:
            self._start = None
            return self
        self._start = _status_kib("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self._start is None:
            return
        if self._cuda():
            torch.cuda.synchronize(self.device)
            self.high_allocated = int(torch.cuda.max_memory_allocated(self.device))
            self.high = int(torch.cuda.max_memory_reserved(self.device))
            self.bytes = self.high_allocated - self._start
        else:
            peak = _status_kib("VmHWM")
            self.bytes = None if peak is None else max(peak - self._start, 0) * 1024
            self.high = None if peak is None else peak * 1024

    def high_water(self) -> dict:
        """``peak_kind`` ("cuda" or "rss") and ``peak_bytes`` (``high``), with ``peak_allocated`` on a CUDA device;
        empty where nothing was measured."""
        if self.high is None:
            return {}
        if self._cuda():
            return {"peak_kind": "cuda", "peak_bytes": self.high, "peak_allocated": self.high_allocated}
        return {"peak_kind": "rss", "peak_bytes": self.high}


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 sent to /dev/null: the profiler's C++ side prints a line on every start and stop."""
    import os
    import sys

    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class PeakTensorBytes:
    """How far the bytes of this process's live tensors rose above where they stood when the block began.

    >>> with PeakTensorBytes() as peak:
    ...     x = torch.ones(2**24)          # 64 MiB
    ...     del x
    ...     y = torch.ones(2**20)          # 4 MiB, freed after the block
    >>> peak.bytes == 64 * 2**20
    True

    Unlike :class:`PeakMemory` (the resident set size) it counts tensors only: every allocation and free of
    PyTorch's CPU allocator, in order, as ``torch.profiler`` (``profile_memory=True``) records them; not
    allocator slack, pages of code or libraries run for the first time, or buffers a library keeps outside
    tensors. The same code gives the same figure at any thread count, so a bound on it holds on any machine.
    On a CUDA device it is ``torch.cuda.max_memory_allocated`` (reset on entry) minus the bytes allocated on
    entry, as :class:`PeakMemory`."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.bytes: int | None = None
        self._profile = None
        self._start = 0

    def __enter__(self) -> "PeakTensorBytes":
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._profile is None:
            torch.cuda.synchronize(self.device)
            self.bytes = int(torch.cuda.max_memory_allocated(self.device)) - self._start
            return
        with _quiet_stderr():
            self._profile.__exit__(*exc)
        live = peak = 0
        changes = sorted((e.start_ns(), e.nbytes()) for e in self._profile.profiler.kineto_results.events()
                         if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
        for _, change in changes:
            live += change
            peak = max(peak, live)
        self.bytes = peak
