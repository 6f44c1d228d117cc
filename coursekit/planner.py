"""Planning memory per rank before a run, and measuring it (and throughput) the same way in every script.

:func:`predict` answers "how many bytes of model state does one rank hold?" for the course's
strategies, from the parameter count, the world size, the precision and offload:

>>> round(predict(300_000_000, 8, "zero2", precision="mixed")["device"] / 2**30, 2)   # GiB per GPU
1.05

:class:`MemoryPlanner` is the notebook widget around it (module 07). :class:`StepMeter` is the
measurement every training script of module 07 runs at the same point of its loop (after the
backward pass, before the optimizer step): steady-state samples per second over the same steps,
and the model-state bytes of this rank (:func:`coursekit.memory.rank_bytes` for DDP and FSDP2,
:func:`coursekit.memory.zero_rank_bytes` for a DeepSpeed engine). So the prediction can be checked
against a measurement (:func:`compare`).

What is counted is *model state*: parameters, gradients and optimizer state (Adam(W): two moments,
plus the fp32 master copy where one exists). Activations, communication buffers (DDP's buckets),
gathered FSDP2/ZeRO-3 units and the allocator's overhead come on top; on a GPU,
``torch.cuda.max_memory_allocated`` shows them.
"""
from __future__ import annotations

import math
import time

from coursekit.memory import KINDS, format_bytes, state_bytes

#: strategy -> a short description (the planner's dropdown and the comparison table use these names)
STRATEGIES = {
    "ddp": "DDP (torchrun or Ray Train): a full copy on every rank",
    "fsdp2": "FSDP2 (fully_shard): parameters, gradients and optimizer state sharded",
    "zero1": "DeepSpeed ZeRO-1: optimizer state partitioned",
    "zero2": "DeepSpeed ZeRO-2: + gradients partitioned",
    "zero3": "DeepSpeed ZeRO-3: + parameters partitioned",
}
PRECISIONS = ("fp32", "mixed")
#: the names a student may also use for a strategy
ALIASES = {"ray_ddp": "ddp", "torchrun_ddp": "ddp", "zero-1": "zero1", "zero-2": "zero2", "zero-3": "zero3"}


def _strategy(name: str) -> str:
    key = ALIASES.get(str(name).lower(), str(name).lower())
    if key not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}: choose one of {', '.join(STRATEGIES)}")
    return key


#: bytes per parameter: (parameters, gradients, optimizer state) for Adam(W).
#: "mixed": the ZeRO paper's model (fp16/bf16 parameters and gradients, K = 12 bytes of
#: fp32 master weights + two fp32 moments). "fp32": what DeepSpeed 0.19 holds when the
#: model trains in fp32 (CPU here): stage 0 is a plain torch optimizer (two moments, 8 bytes,
#: no master copy); stages 1-3 keep a separate fp32 master partition even though the model
#: is fp32 already (4 + 8 = 12), measured in module 06.
ZERO_PRECISIONS = {
    "mixed": {"params": 2, "grads": 2, "optimizer": {0: 12, 1: 12, 2: 12, 3: 12}},
    "fp32": {"params": 4, "grads": 4, "optimizer": {0: 8, 1: 12, 2: 12, 3: 12}},
}


def zero_bytes(num_params: int, world_size: int, stage: int, precision: str = "mixed") -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state per rank under ZeRO ``stage`` (0-3).

    Stage 1 partitions the optimizer state over the ``world_size`` ranks, stage 2 also the
    gradients, stage 3 also the parameters (Rajbhandari et al., "ZeRO", 2020:
    (2 + 2 + K) x Psi per rank for DDP, K = 12 for mixed-precision Adam). ``precision``
    is ``"mixed"`` (the paper) or ``"fp32"`` (see :data:`ZERO_PRECISIONS`).
    Activations, communication buckets and allocator overhead are not model state and not
    included."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, not {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    try:
        b = ZERO_PRECISIONS[precision]
    except KeyError:
        raise ValueError(f"precision must be one of {sorted(ZERO_PRECISIONS)}, not {precision!r}") from None
    n = num_params
    return {
        "params": b["params"] * n / (world_size if stage >= 3 else 1),
        "grads": b["grads"] * n / (world_size if stage >= 2 else 1),
        "optimizer": b["optimizer"][stage] * n / (world_size if stage >= 1 else 1),
    }


def predict(num_params: int, world_size: int, strategy: str, precision: str = "fp32",
            offload: bool = False, accumulation: bool = True) -> dict[str, float]:
    """Bytes of model state per rank: ``params``, ``grads``, ``optimizer``, their sum on the
    accelerator (``device``) and what offload keeps in host memory instead (``host``).

    - DDP holds everything in full: 4 + 4 + 8 bytes per parameter with Adam. Mixed precision under
      DDP (``torch.autocast``) casts activations and matmuls, not the model state: still 16 bytes.
    - FSDP2 shards all three along dim 0 (the largest rank holds ``ceil(num_params / N)`` values);
      its ``MixedPrecisionPolicy`` keeps the sharded fp32 state, so precision does not change it.
      ``CPUOffloadPolicy`` (``offload=True``) keeps the shards and the optimizer step on the host.
    - ZeRO follows :func:`zero_bytes` (the paper's 2 + 2 + 12 bytes in mixed
      precision; in fp32 DeepSpeed 0.19 keeps a separate fp32 master partition, 4 + 4 + 12).
      ``offload=True`` is ZeRO-Offload: the optimizer state (stages 1-3) and, in stage 3, the
      parameters live on the host.
    - ``accumulation``: whether gradients are accumulated over several micro-batches per optimizer step.
      The paper's ZeRO-1 keeps full gradients; DeepSpeed 0.19 does so only between the micro-batches of an
      accumulation. At the last micro-batch (and always with ``gradient_accumulation_steps=1``) it reduces
      the gradients into this rank's partition and frees the rest, so ZeRO-1 then holds what ZeRO-2 holds
      (measured in module 07). ``accumulation=False`` predicts that.
    """
    key = _strategy(strategy)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if int(world_size) != world_size or world_size < 1:
        raise ValueError(f"world_size must be a whole number of at least 1, not {world_size!r}")
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, not {num_params!r}")
    host = dict.fromkeys(KINDS, 0.0)
    if key == "ddp":
        if offload:
            raise ValueError("DDP cannot offload: every rank keeps a full copy on its device. "
                             "Use FSDP2 (CPUOffloadPolicy) or ZeRO-Offload (zero1/zero2/zero3)")
        state = {"params": 4.0 * num_params, "grads": 4.0 * num_params, "optimizer": 8.0 * num_params}
    elif key == "fsdp2":
        shard = math.ceil(num_params / world_size)
        state = {"params": 4.0 * shard, "grads": 4.0 * shard, "optimizer": 8.0 * shard}
        if offload:
            state, host = dict.fromkeys(KINDS, 0.0), state
    else:
        stage = int(key[-1])
        state = zero_bytes(num_params, int(world_size), 2 if stage == 1 and not accumulation else stage, precision)
        if offload:
            host["optimizer"], state["optimizer"] = state["optimizer"], 0.0
            if key == "zero3":
                host["params"], state["params"] = state["params"], 0.0
    return {**state, "device": sum(state[k] for k in KINDS), "host": sum(host[k] for k in KINDS)}


def compare(measured, num_params: int, precision: str = "fp32", tolerance: float = 0.10,
            accumulation: bool = True):
    """Prediction against measurement, one row per strategy and world size of ``measured``.

    ``measured`` is a DataFrame (or list of dicts) with ``strategy``, ``world_size`` and the bytes
    of ``params``, ``grads`` and ``optimizer`` of a rank (the largest rank per strategy counts).
    Returns a DataFrame with the predicted and measured totals, their ratio and ``within``
    (``|ratio - 1| <= tolerance``); ``accumulation`` as in :func:`predict`."""
    import pandas as pd

    df = pd.DataFrame(measured).copy()
    df["measured"] = df[list(KINDS)].sum(axis=1)
    worst = df.loc[df.groupby(["strategy", "world_size"], sort=False)["measured"].idxmax()]
    rows = []
    for _, row in worst.iterrows():
        predicted = predict(num_params, int(row["world_size"]), row["strategy"], precision,
                            accumulation=accumulation)["device"]
        ratio = row["measured"] / predicted if predicted else float("nan")
        rows.append({"strategy": row["strategy"], "world_size": int(row["world_size"]),
                     "predicted": predicted, "measured": int(row["measured"]), "measured / predicted": ratio,
                     "within": abs(ratio - 1) <= tolerance})
    return pd.DataFrame(rows)


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

    def tick(self, model, optimizer=None, samples: int = 0) -> None:
        self.ticks += 1
        now = time.perf_counter()
        if self.ticks == self.warmup + 1:
            self.memory = state_bytes(model, optimizer)
            self.start = time.perf_counter()      # counting is not part of a training step
        elif self.start is not None and self.elapsed is None:
            self.samples += samples
            if self.ticks == self.warmup + 1 + self.steps:
                self.elapsed = now - self.start

    @property
    def done(self) -> bool:
        return self.elapsed is not None

    def results(self) -> dict:
        """``samples_per_s`` (whole job), ``step_ms``, ``world_size`` and ``memory`` (this rank's bytes)."""
        if not self.done:
            raise RuntimeError(f"the meter needs {self.warmup + 1 + self.steps} steps and saw {self.ticks}: "
                               "train longer (more samples or epochs) or measure fewer steps")
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return {"samples_per_s": world_size * self.samples / self.elapsed,
                "step_ms": 1000 * self.elapsed / self.steps, "world_size": world_size,
                "memory": dict(self.memory)}


# --- the widget ---------------------------------------------------------------------------

class MemoryPlanner:
    """Model size, world size, precision, strategy and offload in; predicted bytes per rank out.

    >>> planner = MemoryPlanner(num_params=300e6, world_size=8)
    >>> planner                 # the controls and the answer, in JupyterLab
    >>> planner.prediction()    # the same answer as a dict (what papermill and tests read)

    Without a front end nobody moves the controls: the values passed in are what you get."""

    def __init__(self, num_params: float = 300e6, world_size: int = 8, precision: str = "mixed",
                 strategy: str = "zero2", offload: bool = False, budget_gib: float = 24.0):
        import ipywidgets as w

        style, layout = {"description_width": "150px"}, w.Layout(width="460px")
        self.millions = w.BoundedFloatText(value=num_params / 1e6, min=0.001, max=1e7, step=1,
                                           description="parameters (M)", style=style, layout=layout)
        self.world_size = w.IntSlider(value=int(world_size), min=1, max=max(256, int(world_size)),
                                      description="world size (ranks)", style=style, layout=layout)
        self.precision = w.Dropdown(options=list(PRECISIONS), value=precision, description="precision",
                                    style=style, layout=layout)
        self.strategy = w.Dropdown(options=[(f"{k}: {v.split(':')[0]}", k) for k, v in STRATEGIES.items()],
                                   value=_strategy(strategy), description="strategy", style=style, layout=layout)
        self.offload = w.Checkbox(value=bool(offload), description="offload to host memory", style=style,
                                  layout=layout)
        self.budget = w.BoundedFloatText(value=float(budget_gib), min=0.01, max=1e5, step=1,
                                         description="device memory (GiB)", style=style, layout=layout)
        self.answer = w.HTML()
        for control in (self.millions, self.world_size, self.precision, self.strategy, self.offload, self.budget):
            control.observe(self._refresh, names="value")
        self.widget = w.VBox([w.HTML("<b>Memory planner</b> &nbsp; model state per rank"), self.millions,
                              self.world_size, self.precision, self.strategy, self.offload, self.budget,
                              self.answer])
        self._refresh()

    @property
    def num_params(self) -> int:
        return int(round(self.millions.value * 1e6))

    def prediction(self, strategy: str | None = None) -> dict[str, float]:
        """The prediction for the current controls (or for another ``strategy``)."""
        return predict(self.num_params, self.world_size.value, strategy or self.strategy.value,
                       self.precision.value, self.offload.value)

    def table(self):
        """Every strategy for the current model, world size, precision and offload (GiB per rank)."""
        import pandas as pd

        rows = []
        for key in STRATEGIES:
            try:
                p = self.prediction(key)
            except ValueError:            # DDP has no offload
                continue
            rows.append({"strategy": key, **{k: p[k] / 2**30 for k in (*KINDS, "device", "host")},
                         "fits": p["device"] <= self.budget.value * 2**30})
        return pd.DataFrame(rows).set_index("strategy")

    def _refresh(self, _change=None) -> None:
        try:
            p = self.prediction()
        except ValueError as e:
            self.answer.value = f"<span style='color:#b00020'>&#9888; {e}</span>"
            return
        budget = self.budget.value * 2**30
        verdict = ("<span style='color:#1b7a1b'>fits</span>" if p["device"] <= budget
                   else "<span style='color:#b00020'>does not fit</span>")
        parts = ", ".join(f"{k} {format_bytes(p[k])}" for k in KINDS)
        host = f"; on the host: {format_bytes(p['host'])}" if p["host"] else ""
        self.answer.value = (f"per rank on the device: <b>{format_bytes(p['device'])}</b> ({parts}){host}; "
                             f"{verdict} in {self.budget.value:g} GiB (model state only: activations, "
                             "buffers and the CUDA context need room too)")

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def __repr__(self) -> str:
        return (f"MemoryPlanner(num_params={self.num_params}, world_size={self.world_size.value}, "
                f"precision={self.precision.value!r}, strategy={self.strategy.value!r}, "
                f"offload={self.offload.value})")
