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

import contextlib
import math
import time

from coursekit.memory import KINDS, format_bytes, state_bytes
from coursekit.widgets import COLOURS, STYLE, Controls, layout, legend, stacked_bar, warning

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

class MemoryPlanner(Controls):
    """Model size, world size, precision, strategy and offload in; predicted bytes per rank out, drawn as a bar
    per strategy next to what was measured.

    >>> planner = MemoryPlanner(num_params=300e6, world_size=8)
    >>> planner                 # the controls, the answer and the bars, in JupyterLab
    >>> planner.prediction()    # the same answer as a dict (what papermill and tests read)
    >>> planner.bars()          # the bars drawn now: {strategy: device bytes per rank}

    ``measured`` (optional) is what :func:`compare` returns for real runs: the planner draws their measured and
    predicted bytes side by side, beside its own bars. Without a front end nobody moves the controls: the values
    passed in are what you get."""

    def __init__(self, num_params: float = 300e6, world_size: int = 8, precision: str = "mixed",
                 strategy: str = "zero2", offload: bool = False, budget_gib: float = 24.0, measured=None):
        import ipywidgets as w

        self.millions = w.BoundedFloatText(value=num_params / 1e6, min=0.001, max=1e7, step=1,
                                           description="parameters (M)", style=STYLE, layout=layout())
        self.world_size = w.IntSlider(value=int(world_size), min=1, max=max(256, int(world_size)),
                                      description="world size (ranks)", style=STYLE, layout=layout())
        self.precision = w.Dropdown(options=list(PRECISIONS), value=precision, description="precision",
                                    style=STYLE, layout=layout())
        self.strategy = w.Dropdown(options=[(f"{k}: {v.split(':')[0]}", k) for k, v in STRATEGIES.items()],
                                   value=_strategy(strategy), description="strategy", style=STYLE, layout=layout())
        self.offload = w.Checkbox(value=bool(offload), description="offload to host memory", style=STYLE,
                                  layout=layout())
        self.budget = w.BoundedFloatText(value=float(budget_gib), min=0.01, max=1e5, step=1,
                                         description="device memory (GiB)", style=STYLE, layout=layout())
        self.answer, self.chart = w.HTML(), w.HTML()
        self.measured = None if measured is None else _measured_bars(measured)
        self._watch(self.millions, self.world_size, self.precision, self.strategy, self.offload, self.budget)
        controls = w.VBox([w.HTML("<b>Memory planner</b> &nbsp; model state per rank"), self.millions,
                           self.world_size, self.precision, self.strategy, self.offload, self.budget])
        side = [self.chart] + ([w.HTML(self.measured)] if self.measured else [])
        self.widget = w.VBox([w.HBox([controls, w.VBox(side)]), self.answer])
        self._refresh()

    @property
    def num_params(self) -> int:
        return int(round(self.millions.value * 1e6))

    def prediction(self, strategy: str | None = None) -> dict[str, float]:
        """The prediction for the current controls (or for another ``strategy``)."""
        return predict(self.num_params, self.world_size.value, strategy or self.strategy.value,
                       self.precision.value, self.offload.value)

    def bars(self) -> dict[str, float]:
        """Device bytes per rank of every strategy for the current controls (the bars drawn)."""
        out = {}
        for key in STRATEGIES:
            with contextlib.suppress(ValueError):            # DDP has no offload
                out[key] = self.prediction(key)["device"]
        return out

    def table(self):
        """Every strategy for the current model, world size, precision and offload (GiB per rank)."""
        import pandas as pd

        rows = []
        for key in self.bars():
            p = self.prediction(key)
            rows.append({"strategy": key, **{k: p[k] / 2**30 for k in (*KINDS, "device", "host")},
                         "fits": p["device"] <= self.budget.value * 2**30})
        return pd.DataFrame(rows).set_index("strategy")

    def _refresh(self, _change=None) -> None:
        self.chart.value = self._chart()
        try:
            p = self.prediction()
        except ValueError as e:
            self.answer.value = warning(str(e))
            return
        budget = self.budget.value * 2**30
        verdict = ("<span style='color:#1b7a1b'>fits</span>" if p["device"] <= budget
                   else "<span style='color:#b00020'>does not fit</span>")
        parts = ", ".join(f"{k} {format_bytes(p[k])}" for k in KINDS)
        host = f"; on the host: {format_bytes(p['host'])}" if p["host"] else ""
        self.answer.value = (f"per rank on the device: <b>{format_bytes(p['device'])}</b> ({parts}){host}; "
                             f"{verdict} in {self.budget.value:g} GiB (model state only: activations, "
                             "buffers and the CUDA context need room too)")

    def _chart(self) -> str:
        budget, bars = self.budget.value * 2**30, self.bars()
        rows, scale = [], max(bars.values(), default=0.0) or 1.0
        for key in bars:
            p = self.prediction(key)
            mark = "<b>&#9654;</b>" if key == self.strategy.value else "&nbsp;&nbsp;"
            over = " <span style='color:#b00020'>over</span>" if p["device"] > budget else ""
            bar = stacked_bar([(k, p[k], COLOURS[k]) for k in KINDS], scale, width_px=220,
                              label=f"{format_bytes(p['device'])}{over}")
            rows.append(f"<tr><td>{mark} {key}</td><td>{bar}</td></tr>")
        return (f"<b>Predicted, per rank</b> ({self.world_size.value} ranks, {self.precision.value}; "
                f"<span style='color:#b00020'>over</span>: more than {self.budget.value:g} GiB)<table>"
                f"{''.join(rows)}</table>{legend({k: k for k in KINDS})}")

    def __repr__(self) -> str:
        return (f"MemoryPlanner(num_params={self.num_params}, world_size={self.world_size.value}, "
                f"precision={self.precision.value!r}, strategy={self.strategy.value!r}, "
                f"offload={self.offload.value})")


def _measured_bars(checked) -> str:
    """Measured next to predicted, one pair of bars per row of :func:`compare`'s table."""
    import pandas as pd

    df = pd.DataFrame(checked)
    scale = float(max(df["measured"].max(), df["predicted"].max())) or 1.0
    rows = []
    for _, r in df.iterrows():
        label = f"{r['strategy']} (N={int(r['world_size'])})"
        rows.append(f"<tr><td rowspan=2>{label}</td><td>"
                    + stacked_bar([("measured", r["measured"], COLOURS["measured"])], scale, 160,
                                  f"{format_bytes(r['measured'])} measured")
                    + "</td></tr><tr><td>"
                    + stacked_bar([("predicted", r["predicted"], COLOURS["params"])], scale, 160,
                                  f"{format_bytes(r['predicted'])} predicted")
                    + "</td></tr>")
    return f"<b>Measured on this machine</b> (largest rank)<table>{''.join(rows)}</table>"


class ZeroPicker(Controls):
    """Module 06's run, chosen with controls: the ZeRO stage and optimizer offload, with the predicted model state
    per rank of the run's own model for each stage.

    >>> zero = ZeroPicker(num_params=1_000_000, world_size=2, stage=3, precision="fp32")
    >>> zero                       # the controls and the prediction
    >>> zero.stage, zero.offload_optimizer     # what the training run reads
    ``world_size`` may be an ipywidgets IntSlider (a ScalingConfigPicker's ``num_workers``): the prediction follows
    it. ``accumulation`` says whether the run accumulates gradients over micro-batches (module 06's does)."""

    def __init__(self, num_params: int, world_size, stage: int = 3, offload_optimizer: bool = False,
                 precision: str = "fp32", accumulation: bool = True):
        import ipywidgets as w

        self.num_params, self.precision, self.accumulation = int(num_params), precision, accumulation
        self.stage_control = w.ToggleButtons(options=[("0 (DDP)", 0), ("1", 1), ("2", 2), ("3", 3)], value=int(stage),
                                             description="ZeRO stage", style=STYLE)
        self.offload_control = w.Checkbox(value=bool(offload_optimizer), description="offload_optimizer to the host",
                                          style=STYLE, layout=layout())
        follows = isinstance(world_size, w.ValueWidget)
        self.world_size = w.IntText(value=world_size.value if follows else int(world_size), disabled=follows,
                                    description="ranks" + (" (the picker's)" if follows else ""), style=STYLE,
                                    layout=layout())
        if follows:
            w.dlink((world_size, "value"), (self.world_size, "value"))
        self.summary, self.error = w.HTML(), w.HTML()
        self._watch(self.stage_control, self.offload_control, self.world_size)
        self.widget = w.VBox([w.HTML(f"<b>DeepSpeed ZeRO</b> &nbsp; {self.num_params:,} parameters, "
                                     f"{precision}"), self.stage_control, self.offload_control, self.world_size,
                              self.summary, self.error])
        self._refresh()

    @property
    def stage(self) -> int:
        return int(self.stage_control.value)

    @property
    def offload_optimizer(self) -> bool:
        return bool(self.offload_control.value)

    def problem(self) -> str | None:
        if self.offload_optimizer and self.stage == 0:
            return "DeepSpeed offloads the optimizer with ZeRO stages 1, 2 and 3 only: choose a stage, or no offload."
        return None

    def prediction(self, stage: int | None = None, offload: bool | None = None) -> dict[str, float]:
        """Bytes per rank: ``params``, ``grads``, ``optimizer`` on the device, ``device`` and ``host`` totals."""
        stage = self.stage if stage is None else stage
        offload = self.offload_optimizer if offload is None else offload
        kept = 2 if stage == 1 and not self.accumulation else stage
        state, host = zero_bytes(self.num_params, max(1, self.world_size.value), kept, self.precision), 0.0
        if offload and stage:
            host, state["optimizer"] = state["optimizer"], 0.0
        return {**state, "device": sum(state[k] for k in KINDS), "host": host}

    def _refresh(self, _change=None) -> None:
        why = self.problem()
        self.error.value = warning(why)
        scale = max(self.prediction(s, False)["device"] for s in range(4)) or 1.0
        rows = []
        for s in range(4):
            p = self.prediction(s, self.offload_optimizer and s > 0)
            mark = "<b>&#9654;</b>" if s == self.stage else "&nbsp;&nbsp;"
            parts = [(k, p[k], COLOURS[k]) for k in KINDS] + [("host", p["host"], COLOURS["host"])]
            host = f" + {format_bytes(p['host'])} on the host" if p["host"] else ""
            rows.append(f"<tr><td>{mark} stage {s}</td><td>"
                        f"{stacked_bar(parts, scale, 260, format_bytes(p['device']) + host)}</td></tr>")
        chosen = "" if why else (f"The run trains with <b>ZeRO-{self.stage}</b>"
                                 f"{' and the optimizer on the host' if self.offload_optimizer else ''}: "
                                 f"<b>{format_bytes(self.prediction()['device'])}</b> of model state per rank on the "
                                 "device.")
        self.summary.value = (f"<table>{''.join(rows)}</table>"
                              f"{legend({'parameters': 'params', 'gradients': 'grads', 'optimizer state': 'optimizer', 'on the host': 'host'})}"
                              f"<br>{chosen}")

    def __repr__(self) -> str:
        return f"ZeroPicker(stage={self.stage}, offload_optimizer={self.offload_optimizer}, world_size={self.world_size.value})"
