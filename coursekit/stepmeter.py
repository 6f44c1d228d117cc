"""Measuring memory and throughput the same way in every script of module 07.

:class:`StepMeter` runs at the same point of every training loop (after the backward pass, before the optimizer
step): steady-state samples per second over the same steps, and the model-state bytes of this rank
(:func:`coursekit.memory.rank_bytes` for DDP and FSDP2, :func:`coursekit.memory.zero_rank_bytes` for a DeepSpeed
engine), so that :func:`coursekit.planner.predict` can be checked against a measurement
(:func:`coursekit.planner.compare`). :func:`saved_activations` measures what a forward pass keeps for the backward
pass (the meter does it when the forward pass runs inside ``meter.forward()``). Beside those counts of tensors, the
meter measures what the rank really peaked at over the timed steps (:class:`coursekit.memory.PeakMemory`'s
high-water mark): CUDA's allocator on a GPU, the process's resident set on a CPU.
"""
from __future__ import annotations

import contextlib
import time

from coursekit.memory import PeakMemory, state_bytes


@contextlib.contextmanager
def saved_activations(model=None):
    """Measures what a forward pass run inside it keeps for the backward pass, on this rank.

    >>> with saved_activations(model) as saved:
    ...     loss = F.cross_entropy(model(inputs), targets)
    >>> saved["bytes"]

    Every tensor autograd saves passes through a saved-tensors hook; each storage counts once (``q``, ``k`` and
    ``v`` are views of one ``qkv`` output), with the bytes it holds when the block ends (FSDP2 frees a block's
    gathered parameters after its forward pass: they count 0). The ``model``'s parameters (the weights a layer
    keeps for its input's gradient) are not activations and are left out. A ``DTensor`` counts by its local
    shard. Under ``torch.utils.checkpoint`` (non-reentrant) only the checkpointed blocks' inputs are saved."""
    import torch

    from coursekit.memory import local_tensor

    held: dict[int, object] = {}

    def pack(t):
        storage = local_tensor(t).untyped_storage()
        held.setdefault(storage.data_ptr(), storage)
        return t

    result = {"bytes": 0}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
    params = set() if model is None else {local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()}
    result["bytes"] = sum(s.nbytes() for ptr, s in held.items() if ptr not in params)
    held.clear()


# --- what the rank really peaked at ------------------------------------------------------------

def _device_of(model):
    import torch

    engine_device = getattr(model, "device", None)          # a DeepSpeed engine knows its device
    if isinstance(engine_device, torch.device):
        return engine_device
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


# --- measuring, the same way in every script ------------------------------------------------

class StepMeter:
    """Steady-state throughput and model-state memory of one rank.

    Call :meth:`tick` once per optimizer step, **after the backward pass and before the optimizer
    step** (gradients alive), with the number of samples this rank used in the step. The first
    ``warmup`` steps are not timed (allocations, first collectives); at the next tick the meter
    counts this rank's model state (the optimizer state exists after ``warmup >= 1`` steps) and
    starts the clock; ``steps`` ticks later it stops. Every rank of a synchronous data-parallel job
    runs at the pace of the slowest, so the job's throughput is this rank's samples per second
    times the world size."""

    def __init__(self, warmup: int = 2, steps: int = 8):
        if warmup < 1 or steps < 1:
            raise ValueError("warmup and steps must be at least 1 (the optimizer state appears after one step)")
        self.warmup, self.steps = warmup, steps
        self.ticks, self.samples, self.start, self.elapsed, self.memory = 0, 0, None, None, None
        self.activations: dict | None = None
        self.peak: dict = {}
        self._peak: PeakMemory | None = None

    def tick(self, model, optimizer=None, samples: int = 0) -> None:
        self.ticks += 1
        now = time.perf_counter()
        if self.ticks == self.warmup + 1:
            self.memory = state_bytes(model, optimizer)
            self._peak = PeakMemory(_device_of(model)).__enter__()
            self.start = time.perf_counter()      # counting is not part of a training step
        elif self.start is not None and self.elapsed is None:
            self.samples += samples
            if self.ticks == self.warmup + 1 + self.steps:
                self.elapsed = now - self.start
                self._peak.__exit__(None, None, None)
                self.peak = self._peak.high_water()

    def forward(self, model=None, samples: int = 0):
        """Wrap the forward pass (the loss included) in it: on the step whose memory the meter counts, it also
        measures the activations that pass keeps for the backward pass (:func:`saved_activations`, ``samples``
        being the batch of this rank), reported in ``results()["memory"]`` as ``activations`` and ``batch``."""
        if self.ticks != self.warmup:
            return contextlib.nullcontext()
        return self._measure_forward(model, samples)

    @contextlib.contextmanager
    def _measure_forward(self, model, samples: int):
        with saved_activations(model) as saved:
            yield saved
        self.activations = {"activations": saved["bytes"], "batch": int(samples)}

    @property
    def done(self) -> bool:
        return self.elapsed is not None

    def results(self) -> dict:
        """``samples_per_s`` (whole job), ``step_ms``, ``world_size`` and ``memory`` (this rank's bytes; with
        :meth:`forward`, also the ``activations`` it measured and their ``batch``; and what the rank peaked at over
        the timed steps, ``PeakMemory.high_water``'s ``peak_kind`` and ``peak_bytes``)."""
        if not self.done:
            raise RuntimeError(f"the meter needs {self.warmup + 1 + self.steps} steps and saw {self.ticks}: "
                               "train longer (more samples or epochs) or measure fewer steps")
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return {"samples_per_s": world_size * self.samples / self.elapsed,
                "step_ms": 1000 * self.elapsed / self.steps, "world_size": world_size,
                "memory": {**self.memory, **(self.activations or {}), **self.peak}}
