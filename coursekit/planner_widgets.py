"""The notebook widgets around the memory model (:mod:`coursekit.planner`): :class:`MemoryPlanner` (module 07: bytes
per rank for every strategy, beside what was measured) and :class:`ZeroPicker` (module 06: a ZeRO stage and its
offload, and what they hold per rank)."""
from __future__ import annotations

import contextlib

from coursekit.memory import KINDS, format_bytes
from coursekit.planner import (GPU_VIT, PRECISIONS, STRATEGIES, _strategy, label, predict, vit_activation_bytes,
                               zero_bytes)
from coursekit.widgets import COLOURS, STYLE, Controls, layout, legend, stacked_bar, warning

ACTIVATIONS_COLOUR = "#c44e52"

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
    passed in are what you get.

    ``ranks_per_node`` sets HSDP's shard group and TP's group (tensor parallelism stays inside a node; the bars
    assume it splits every parameter). ``batch_per_rank`` > 0 adds the activations of a ViT of shape ``vit``
    (default: the course's GPU ViT, about 300M parameters) for that many samples per rank, with or without
    ``checkpointing`` (:func:`vit_activation_bytes`); 0 draws model state only."""

    def __init__(self, num_params: float = 300e6, world_size: int = 8, precision: str = "mixed",
                 strategy: str = "zero2", offload: bool = False, budget_gib: float = 24.0, measured=None,
                 ranks_per_node: int | None = None, batch_per_rank: int = 0, checkpointing: bool = False,
                 vit: dict | None = None):
        import ipywidgets as w

        self.vit = dict(vit or GPU_VIT)

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
        self.ranks_per_node = w.IntSlider(value=int(ranks_per_node or min(8, int(world_size))), min=1, max=64,
                                          description="ranks per node (HSDP, TP)", style=STYLE, layout=layout())
        self.batch = w.BoundedIntText(value=int(batch_per_rank), min=0, max=10**6, description="batch per rank (ViT)",
                                      style=STYLE, layout=layout())
        self.checkpointing = w.Checkbox(value=bool(checkpointing), description="activation checkpointing",
                                        style=STYLE, layout=layout())
        self.answer, self.chart = w.HTML(), w.HTML()
        self.measured = None if measured is None else _measured_bars(measured)
        self._watch(self.millions, self.world_size, self.precision, self.strategy, self.offload, self.budget,
                    self.ranks_per_node, self.batch, self.checkpointing)
        controls = w.VBox([w.HTML("<b>Memory planner</b> &nbsp; model state per rank"), self.millions,
                           self.world_size, self.ranks_per_node, self.precision, self.strategy, self.offload,
                           self.budget, self.batch, self.checkpointing])
        side = [self.chart] + ([w.HTML(self.measured)] if self.measured else [])
        self.widget = w.VBox([w.HBox([controls, w.VBox(side)]), self.answer])
        self._refresh()

    @property
    def num_params(self) -> int:
        return int(round(self.millions.value * 1e6))

    def prediction(self, strategy: str | None = None) -> dict[str, float]:
        """The prediction for the current controls (or for another ``strategy``); with a batch per rank, the
        ViT's ``activations`` are in ``device`` too."""
        key = _strategy(strategy or self.strategy.value)
        node = min(self.ranks_per_node.value, self.world_size.value)   # fewer ranks than a node: one node
        shape = {"ranks_per_node": node} if key == "hsdp" else {"tp": node} if key == "tp_fsdp" else {}
        p = predict(self.num_params, self.world_size.value, key, self.precision.value, self.offload.value, **shape)
        if not self.batch.value:                             # model state only: predict's answer as it is
            return p
        activations = vit_activation_bytes(self.batch.value, **self.vit, checkpointing=self.checkpointing.value,
                                           tp=shape.get("tp", 1),
                                           bytes_per_value=2 if self.precision.value == "mixed" else 4)
        return {**p, "activations": activations, "device": p["device"] + activations}

    def bars(self) -> dict[str, float]:
        """Device bytes per rank of every strategy for the current controls (the bars drawn)."""
        out = {}
        for key in STRATEGIES:
            with contextlib.suppress(ValueError):            # DDP has no offload; HSDP and TP need whole nodes
                out[key] = self.prediction(key)["device"]
        return out

    def table(self):
        """Every strategy for the current model, world size, precision and offload (GiB per rank)."""
        import pandas as pd

        rows = []
        for key in self.bars():
            p = self.prediction(key)
            rows.append({"strategy": key, **{k: p.get(k, 0.0) / 2**30 for k in (*KINDS, "activations", "device", "host")},
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
        if p.get("activations"):
            parts += f", activations {format_bytes(p['activations'])}"
            left = "buffers and the CUDA context need room too"
        else:
            left = "model state only: activations, buffers and the CUDA context need room too"
        self.answer.value = (f"per rank on the device: <b>{format_bytes(p['device'])}</b> ({parts}){host}; "
                             f"{verdict} in {self.budget.value:g} GiB ({left})")

    def _chart(self) -> str:
        budget, bars = self.budget.value * 2**30, self.bars()
        rows, scale = [], max(bars.values(), default=0.0) or 1.0
        activations = (f" &nbsp; <span style='color:{ACTIVATIONS_COLOUR}'>&#9632;</span> activations "
                       f"({self.batch.value} per rank{', checkpointed' if self.checkpointing.value else ''})"
                       if self.batch.value else "")
        for key in bars:
            p = self.prediction(key)
            mark = "<b>&#9654;</b>" if key == self.strategy.value else "&nbsp;&nbsp;"
            over = " <span style='color:#b00020'>over</span>" if p["device"] > budget else ""
            bar = stacked_bar([(k, p[k], COLOURS[k]) for k in KINDS] + [("activations", p.get("activations", 0.0),
                                                                          ACTIVATIONS_COLOUR)],
                              scale, width_px=220, label=f"{format_bytes(p['device'])}{over}")
            rows.append(f"<tr><td>{mark} {key}</td><td>{bar}</td></tr>")
        return (f"<b>Predicted, per rank</b> ({self.world_size.value} ranks, {self.precision.value}; "
                f"<span style='color:#b00020'>over</span>: more than {self.budget.value:g} GiB)<table>"
                f"{''.join(rows)}</table>{legend({k: k for k in KINDS})}{activations}")

    def __repr__(self) -> str:
        return (f"MemoryPlanner(num_params={self.num_params}, world_size={self.world_size.value}, "
                f"ranks_per_node={self.ranks_per_node.value}, batch_per_rank={self.batch.value}, "
                f"checkpointing={self.checkpointing.value}, "
                f"precision={self.precision.value!r}, strategy={self.strategy.value!r}, "
                f"offload={self.offload.value})")


def _measured_bars(checked) -> str:
    """Measured next to predicted, one pair of bars per row of :func:`compare`'s table."""
    import pandas as pd

    df = pd.DataFrame(checked)
    scale = float(max(df["measured"].max(), df["predicted"].max())) or 1.0
    rows = []
    for _, r in df.iterrows():
        name = label(r)
        rows.append(f"<tr><td rowspan=2>{name}</td><td>"
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
