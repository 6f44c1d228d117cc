"""Choosing a ScalingConfig: plain-language checks and an ipywidgets picker.

``check_scaling`` explains why a choice cannot run *before* Ray waits forever
for resources that do not exist. ``ScalingConfigPicker`` is the widget the
notebooks display; it hands back the choice as plain values (``choice()``), and the
notebook builds the ``ray.train.ScalingConfig`` from them (module 02's Exercise 1:
this package never builds one, so it cannot give that exercise away). Without a
front end (papermill, nbgrader, a script) nobody moves the sliders, so the
values passed in (the notebook's parameters) are what you get.
"""
from __future__ import annotations

import dataclasses

from coursekit.runtime import Runtime, detect
from coursekit.widgets import Controls, warning


class ScalingError(ValueError):
    """A ScalingConfig that cannot run on this cluster, with the reason in plain words."""


def _autoscaler_limits() -> dict[str, int]:
    """Most CPUs and GPUs the cluster's autoscaler may start (its node types x their max counts), or {}.

    An autoscaling cluster (deploy/cluster.yaml, Anyscale, KubeRay with autoscaling) may run no GPU node
    until a job asks for one: its current resources say 0 GPUs. Ray Data reads the same record."""
    try:
        from coursekit.ray_internals import cluster_state

        limits = cluster_state.get_max_resources_from_cluster_config() or {}
    except Exception:   # no autoscaler, or a Ray without this record
        return {}
    # a node type without a max count can grow without bound; count what is there now instead
    return {k: int(v) for k, v in limits.items() if k in ("CPU", "GPU") and 0 < v < 1 << 31}


def cluster_resources(runtime: Runtime | None = None) -> dict[str, int]:
    """CPUs and GPUs Ray Train's workers can get: those of the Ray cluster we are connected to (with the
    nodes its autoscaler may still add), else this machine's (what a local Ray is started with)."""
    try:
        import ray

        if ray.is_initialized():
            res = ray.cluster_resources()
            now = {"CPU": int(res.get("CPU", 0)), "GPU": int(res.get("GPU", 0))}
            limits = _autoscaler_limits()
            return {k: max(v, limits.get(k, 0)) for k, v in now.items()}
    except Exception:
        pass
    rt = runtime or detect()
    return {"CPU": rt.num_cpus, "GPU": rt.num_gpus}


@dataclasses.dataclass(frozen=True)
class WorkerResources:
    """What Ray Train's workers can get, and the defaults that follow from it.

    On a laptop that is this machine. On a cluster it is the worker nodes, not the driver's machine:
    a head node often has no GPU (deploy/cluster.yaml, many Anyscale set-ups) while its workers do."""

    cpus: int
    gpus: int

    @property
    def use_gpu(self) -> bool:
        return self.gpus > 0

    @property
    def default_workers(self) -> int:
        """One worker per GPU; two CPU workers where there are no GPUs (real distributed behaviour)."""
        return self.gpus if self.use_gpu else 2

    @property
    def backend(self) -> str:
        """What Ray Train's TorchConfig() picks for such workers: NCCL when each has a GPU, else gloo."""
        return "nccl" if self.use_gpu else "gloo"


def worker_resources(runtime: Runtime | None = None) -> WorkerResources:
    """What Ray Train's workers can get. Where the runtime names a cluster (Anyscale, ``RAY_ADDRESS``) it is
    joined first (``init_ray``) and asked; a local Ray is started with this machine's resources, so
    until one runs this machine answers. The autograder never starts or joins Ray for this."""
    rt = runtime or detect()
    if rt.ray_address and not rt.grading:
        from coursekit.raysetup import init_ray

        init_ray(rt)
    res = cluster_resources(rt)
    return WorkerResources(cpus=res["CPU"], gpus=res["GPU"])


def cluster_nodes() -> int:
    """Alive nodes of the Ray cluster we are connected to, else 1 (this machine)."""
    try:
        import ray

        if ray.is_initialized():
            return sum(1 for node in ray.nodes() if node.get("Alive"))
    except Exception:
        pass
    return 1


def check_scaling(num_workers: int, use_gpu: bool, cpus_per_worker: float = 1,
                  global_batch_size: int | None = None,
                  resources: dict[str, int] | None = None) -> None:
    """Raise :class:`ScalingError` if this choice cannot run on ``resources``."""
    res = resources if resources is not None else cluster_resources()
    cpus, gpus = res.get("CPU", 0), res.get("GPU", 0)
    if int(num_workers) != num_workers or num_workers < 1:
        raise ScalingError(f"num_workers must be a whole number of at least 1 (got {num_workers}).")
    if cpus_per_worker <= 0:
        raise ScalingError(f"Each worker needs some CPU: cpus_per_worker={cpus_per_worker} must be > 0.")
    if use_gpu and gpus == 0:
        raise ScalingError(
            "use_gpu=True, but this cluster has no GPUs. Set use_gpu=False: the same training "
            "code runs on CPU workers (gloo instead of nccl).")
    if use_gpu and num_workers > gpus:
        raise ScalingError(
            f"{num_workers} GPU workers need {num_workers} GPUs (one each), but this cluster has "
            f"{gpus}. Choose at most {gpus} workers, or add GPU nodes.")
    need = num_workers * cpus_per_worker
    if need > cpus:
        most = int(cpus // cpus_per_worker)
        raise ScalingError(
            f"{num_workers} workers x {cpus_per_worker:g} CPU each = {need:g} CPUs, but this cluster "
            f"has {cpus}. Ray would wait for them forever. Choose at most {most} workers or fewer "
            "CPUs per worker.")
    if global_batch_size is not None:
        if global_batch_size < num_workers:
            raise ScalingError(
                f"A global batch of {global_batch_size} cannot feed {num_workers} workers "
                "(each needs at least one example).")
        if global_batch_size % num_workers:
            lo = global_batch_size - global_batch_size % num_workers
            raise ScalingError(
                f"The global batch of {global_batch_size} does not split evenly over {num_workers} "
                f"workers. Choose a multiple of {num_workers}, e.g. {lo} or {lo + num_workers}.")


# The placement-group strategies Ray accepts (ray.util.placement_group), default first.
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")


def check_placement(num_workers: int, placement_strategy: str = "PACK") -> None:
    """Raise :class:`ScalingError` if Ray does not know ``placement_strategy`` or this cluster cannot place
    ``num_workers`` workers with it (STRICT_SPREAD: one node each)."""
    if placement_strategy not in PLACEMENT_STRATEGIES:
        raise ScalingError(f"placement_strategy={placement_strategy!r} is not one of "
                           f"{', '.join(PLACEMENT_STRATEGIES)}.")
    if placement_strategy == "STRICT_SPREAD" and num_workers > (nodes := cluster_nodes()):
        raise ScalingError(
            f"STRICT_SPREAD puts every worker on a different node: {num_workers} workers need "
            f"{num_workers} nodes, but this cluster has {nodes}. Ray would wait for them forever. "
            "Use SPREAD or PACK, or add nodes.")


class ScalingConfigPicker(Controls):
    """Sliders for a ScalingConfig, bounded by what the cluster has.

    >>> picker = ScalingConfigPicker(num_workers=2, use_gpu=False, global_batch_size=64)
    >>> picker            # shows the controls in JupyterLab
    >>> picker.choice()   # {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1.0} (ScalingError if impossible)
    """

    def __init__(self, num_workers: int | None = None, use_gpu: bool | None = None,
                 cpus_per_worker: float = 1, global_batch_size: int = 64,
                 resources: dict[str, int] | None = None):
        import ipywidgets as w

        self.resources = resources if resources is not None else cluster_resources()
        cpus, gpus = self.resources["CPU"], self.resources["GPU"]
        use_gpu = gpus > 0 if use_gpu is None else bool(use_gpu)
        num_workers = (gpus if use_gpu and gpus else 2) if num_workers is None else int(num_workers)
        # Bounds come from the cluster, but a requested value beyond them is kept (and
        # explained) rather than silently clamped by the slider.
        top = max(int(cpus // cpus_per_worker), gpus, num_workers, 1)
        style = {"description_width": "150px"}
        layout = w.Layout(width="460px")
        self.num_workers = w.IntSlider(value=num_workers, min=1, max=top, description="num_workers",
                                       style=style, layout=layout)
        self.use_gpu = w.Checkbox(value=use_gpu, description="use_gpu", disabled=gpus == 0 and not use_gpu,
                                  style=style, layout=layout)
        self.cpus_per_worker = w.FloatSlider(value=float(cpus_per_worker), min=0.25, step=0.25,
                                             max=max(float(cpus), float(cpus_per_worker), 1.0),
                                             description="CPUs per worker", style=style, layout=layout)
        self.global_batch_size = w.BoundedIntText(value=int(global_batch_size), min=1, max=1 << 16,
                                                  description="global batch size", style=style, layout=layout)
        self.summary = w.HTML()
        self.error = w.HTML()
        for control in (self.num_workers, self.use_gpu, self.cpus_per_worker, self.global_batch_size):
            control.observe(self._refresh, names="value")
        header = w.HTML(f"<b>ScalingConfig</b> &nbsp; cluster: {cpus} CPUs, {gpus} GPUs"
                        + ("" if gpus else " (no GPUs: use_gpu is off)"))
        self.widget = w.VBox([header, self.num_workers, self.use_gpu, self.cpus_per_worker,
                              self.global_batch_size, self.summary, self.error])
        self._refresh()

    # -- what the notebook reads -------------------------------------------------
    @property
    def per_worker_batch_size(self) -> int:
        return self.global_batch_size.value // self.num_workers.value

    def problem(self) -> str | None:
        """The reason this choice cannot run, or None."""
        try:
            check_scaling(self.num_workers.value, self.use_gpu.value, self.cpus_per_worker.value,
                          self.global_batch_size.value, self.resources)
        except ScalingError as e:
            return str(e)
        return None

    def choice(self) -> dict:
        """The current choice as plain values (num_workers, use_gpu, cpus_per_worker): what a ScalingConfig is
        built from. Raises :class:`ScalingError` with the reason when this cluster cannot run it."""
        problem = self.problem()
        if problem:
            raise ScalingError(problem)
        return {"num_workers": self.num_workers.value, "use_gpu": self.use_gpu.value,
                "cpus_per_worker": self.cpus_per_worker.value}

    # -- display -------------------------------------------------------------------
    def _workers_bound(self) -> int:
        """Most workers the cluster can hold with the current per-worker resources."""
        if self.use_gpu.value:
            return max(self.resources["GPU"], 1)
        return max(int(self.resources["CPU"] // self.cpus_per_worker.value), 1)

    def _refresh(self, _change=None) -> None:
        # The slider's bound follows the per-worker resources; a value beyond it is kept (and explained).
        self.num_workers.max = max(self._workers_bound(), self.num_workers.value)
        n, g = self.num_workers.value, self.global_batch_size.value
        device = "GPU" if self.use_gpu.value else "CPU"
        self.summary.value = (f"{n} {device} worker{'s' if n > 1 else ''}; per-worker batch = "
                              f"{g} // {n} = <b>{g // n}</b>")
        self.error.value = warning(self.problem())

    def __repr__(self) -> str:
        return (f"ScalingConfigPicker(num_workers={self.num_workers.value}, use_gpu={self.use_gpu.value}, "
                f"cpus_per_worker={self.cpus_per_worker.value}, global_batch_size={self.global_batch_size.value})")
