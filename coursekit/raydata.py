"""Ray Data set-up for module 03, shared by its notebook, its script and the tests.

The CPU budget of a job where Ray Train and Ray Data share a cluster (``plan_resources``,
``configure_ray_data``): an impossible split is refused with a reason instead of a job
that stalls. The rest of the module's plumbing lives where its name says: the course
digits as files in ``coursekit.data``, the synthetic data set in ``coursekit.synthetic``,
the object-store measurements in ``coursekit.objectstore`` and the stand-ins for Ray
Data shards in ``coursekit.testing``.

What is *not* here on purpose: the preprocessing of the course digits and the
training loop. Those are the module's exercises and stay in the notebook.
"""
from __future__ import annotations

import dataclasses
import html
import time

from coursekit.scaling import ScalingError, check_scaling, cluster_resources
from coursekit.widgets import COLOURS, STYLE, Controls, layout, legend, stacked_bar, warning

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

    def describe(self) -> str:
        train = self.num_workers * self.cpus_per_worker
        store = "default" if self.object_store_bytes is None else f"{self.object_store_bytes / 2**20:.0f} MiB"
        return (f"cluster: {self.cluster_cpus:g} CPUs\n"
                f"  Ray Train: {self.num_workers} workers x {self.cpus_per_worker:g} CPU"
                f"{' + 1 GPU' if self.use_gpu else ''} = {train:g} CPUs\n"
                f"  Ray Data : {self.data_cpus:g} CPUs left -> at most {self.map_concurrency} map_batches "
                f"tasks x {self.map_num_cpus:g} CPU at once; object-store budget {store}")


def _resource_limits(plan: DataPlan):
    from ray.data import ExecutionResources

    return ExecutionResources.for_limits(cpu=plan.data_cpus, object_store_memory=plan.object_store_bytes)


def plan_resources(num_workers: int, cpus_per_worker: float, use_gpu: bool = False,
                   map_num_cpus: float = 0.5, object_store_mib: float | None = None,
                   resources: dict | None = None) -> DataPlan:
    """Split the cluster's CPUs between training workers and Ray Data, or raise ScalingError.

    Ray Train reserves ``num_workers x cpus_per_worker`` CPUs for the whole run; Ray Data's
    preprocessing tasks can only use what is left. If that is less than one task's
    ``map_num_cpus`` the job would start and its workers would wait for data that no preprocessing task
    can make."""
    res = resources if resources is not None else cluster_resources()
    cpus = float(res.get("CPU", 0))
    check_scaling(num_workers, use_gpu, cpus_per_worker, resources=res)  # the training workers alone
    if map_num_cpus <= 0:
        raise ScalingError(f"Each preprocessing task needs some CPU: map_num_cpus={map_num_cpus} must be > 0.")
    train = num_workers * cpus_per_worker
    left = cpus - train
    if left < map_num_cpus:
        hint = (cpus - map_num_cpus) / num_workers
        raise ScalingError(
            f"{num_workers} training workers x {cpus_per_worker:g} CPU = {train:g} of this cluster's {cpus:g} "
            f"CPUs, which leaves {max(left, 0):g} for Ray Data's preprocessing; one map_batches task needs "
            f"{map_num_cpus:g}. The trainer would start, and its workers would wait for data that no task can "
            f"make. Give each training worker at most {hint:g} CPU (e.g. resources_per_worker={{'CPU': {hint:g}}}), use fewer workers, "
            "or add CPUs." if hint > 0 else
            f"{num_workers} training workers x {cpus_per_worker:g} CPU leave no CPU for Ray Data on a "
            f"{cpus:g}-CPU cluster: the workers would wait for data that no task can make. Use fewer workers or add CPUs.")
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
    A trainer that states its own ``DataConfig(execution_options=...)`` uses those limits instead."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.execution_options.resource_limits = _resource_limits(plan)
    # Ray 2.60's new Parquet reader (DataSourceV2) lists files and reads footers with pools of
    # actors (up to 32 footer readers) per read: on a small cluster every read_parquet then
    # starts several new worker processes, which on a few CPUs takes far longer than reading a small
    # data set. The classic reader runs plain tasks. Big clusters keep the default.
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


def timed(iterable, warmup: int = 0):
    """Iterate ``iterable``, returning (number of items, seconds after the first ``warmup`` items)."""
    n, start = 0, None
    for i, _ in enumerate(iterable):
        if i == warmup:
            start = time.perf_counter()
        n += 1
    return n, (time.perf_counter() - start) if start else 0.0


# -- the widget: the CPU split, chosen ---------------------------------------------------

class DataSplitPicker(Controls):
    """Sliders for the CPU split between Ray Train's workers and Ray Data's tasks (module 03).

    >>> split = DataSplitPicker(num_workers=2, cpus_per_worker=0.5, map_num_cpus=0.5, resources={"CPU": 2, "GPU": 0})
    >>> split            # the sliders, the split drawn as a bar, and the reason when it cannot run
    >>> split.plan()     # the DataPlan of the current choice (raises ScalingError if it would stall)
    """

    def __init__(self, num_workers: int, cpus_per_worker: float, use_gpu: bool = False, map_num_cpus: float = 0.5,
                 object_store_mib: float | None = None, resources: dict | None = None):
        import ipywidgets as w

        self.resources = resources if resources is not None else cluster_resources()
        self.use_gpu, self.object_store_mib = bool(use_gpu), object_store_mib
        cpus = float(self.resources.get("CPU", 0))
        top = max(cpus, float(cpus_per_worker), float(map_num_cpus), 1.0)
        self.num_workers = w.IntSlider(value=int(num_workers), min=1, max=max(int(num_workers), int(top // 0.25), 1),
                                       description="training workers", style=STYLE, layout=layout())
        self.cpus_per_worker = w.FloatSlider(value=float(cpus_per_worker), min=0.25, max=top, step=0.25,
                                             description="CPUs per training worker", style=STYLE, layout=layout())
        self.map_num_cpus = w.FloatSlider(value=float(map_num_cpus), min=0.25, max=top, step=0.25,
                                          description="CPUs per map_batches task", style=STYLE, layout=layout())
        self.summary, self.error = w.HTML(), w.HTML()
        self._watch(self.num_workers, self.cpus_per_worker, self.map_num_cpus)
        gpus = self.resources.get("GPU", 0)
        header = w.HTML(f"<b>CPU split</b> &nbsp; cluster: {cpus:g} CPUs, {gpus:g} GPUs")
        self.widget = w.VBox([header, self.num_workers, self.cpus_per_worker, self.map_num_cpus, self.summary,
                              self.error])
        self._refresh()

    def plan(self) -> DataPlan:
        """The plan of the current choice (raises ScalingError with the reason when it cannot run)."""
        return plan_resources(self.num_workers.value, self.cpus_per_worker.value, self.use_gpu,
                              self.map_num_cpus.value, self.object_store_mib, self.resources)

    def problem(self) -> str | None:
        try:
            self.plan()
        except ScalingError as e:
            return str(e)
        return None

    def _refresh(self, _change=None) -> None:
        cpus = float(self.resources.get("CPU", 0))
        train = self.num_workers.value * self.cpus_per_worker.value
        data = max(cpus - train, 0.0)
        bar = stacked_bar([("training", min(train, cpus), COLOURS["train"]), ("Ray Data", data, COLOURS["data"])],
                          scale=max(cpus, train),
                          label=f"training {train:g} + Ray Data {data:g} of {cpus:g} CPUs")
        why = self.problem()
        text = "" if why else f"<pre style='margin:4px 0'>{html.escape(self.plan().describe())}</pre>"
        self.summary.value = f"{bar}<br>{legend({'Ray Train workers': 'train', 'Ray Data tasks': 'data'})}{text}"
        self.error.value = warning(why)

    def __repr__(self) -> str:
        return (f"DataSplitPicker(num_workers={self.num_workers.value}, cpus_per_worker={self.cpus_per_worker.value}, "
                f"map_num_cpus={self.map_num_cpus.value})")
