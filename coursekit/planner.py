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
plus the fp32 master copy where one exists). Communication buffers (DDP's buckets),
gathered FSDP2/ZeRO-3 units and the allocator's overhead come on top; on a GPU,
``torch.cuda.max_memory_allocated`` shows them. *Activations* (what the forward pass keeps for the backward pass)
have a model of their own for the course's ViT, with and without activation checkpointing and tensor parallelism
(:func:`vit_activation_bytes`), measured by :func:`saved_activations` (the :class:`StepMeter` does it when the
forward pass runs inside ``meter.forward()``).
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
    "hsdp": "HSDP (fully_shard on a 2-D mesh): sharded within a node, replicated across nodes",
    "tp_fsdp": "TP x FSDP2: layers split over the TP group, then sharded over the data-parallel group",
}
PRECISIONS = ("fp32", "mixed")
#: the course's GPU-sized ViT (runtime.SIZES["gpu"], about 300M parameters): the planner's activations by default
GPU_VIT = {"depth": 24, "width": 1024, "heads": 16, "patch": 4}
ACTIVATIONS_COLOUR = "#c44e52"
#: the names a student may also use for a strategy
ALIASES = {"ray_ddp": "ddp", "torchrun_ddp": "ddp", "zero-1": "zero1", "zero-2": "zero2", "zero-3": "zero3",
           "tp": "tp_fsdp", "tp_dp": "tp_fsdp", "tp-fsdp": "tp_fsdp"}


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


def _divides(part: int, whole: int, what: str) -> int:
    if int(part) != part or part < 1 or whole % int(part):
        raise ValueError(f"{what} must be a whole number that divides the world size ({whole}), not {part!r}")
    return int(part)


def _sharded_params(key: str, num_params: int, world_size: int, ranks_per_node, tp, tp_params) -> float:
    """Parameters one rank holds under FSDP2, HSDP or TP x FSDP2 (before rounding up)."""
    if key == "fsdp2":
        return num_params / world_size
    if key == "hsdp":
        return num_params / _divides(ranks_per_node or world_size, world_size, "ranks_per_node (HSDP's shard group)")
    tp = _divides(tp or ranks_per_node or world_size, world_size, "tp (the tensor-parallel group)")
    split = num_params if tp_params is None else tp_params
    if not 0 <= split <= num_params:
        raise ValueError(f"tp_params ({tp_params}) must be between 0 and num_params ({num_params})")
    return (split / tp + (num_params - split)) / (world_size // tp)


def predict(num_params: int, world_size: int, strategy: str, precision: str = "fp32",
            offload: bool = False, accumulation: bool = True, *, ranks_per_node: int | None = None,
            tp: int | None = None, tp_params: int | None = None) -> dict[str, float]:
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
    - HSDP (``hsdp``) shards like FSDP2 over the ``ranks_per_node`` ranks of one node (the mesh's "shard"
      dimension) and replicates that shard across the nodes ("replicate"): per-rank bytes are FSDP2's on
      ``ranks_per_node`` ranks, whatever the number of nodes (default: one node, plain FSDP2).
    - TP x FSDP2 (``tp_fsdp``) splits the ``tp_params`` parameters that tensor parallelism parallelizes (the
      blocks' linear layers: :func:`vit_parameters`; default all) over the ``tp`` ranks of a TP group (default
      ``ranks_per_node``, else all ranks: TP stays inside a node), keeps the rest whole on each of them, then
      shards both over the ``world_size / tp`` ranks of the data-parallel dimension: per rank
      ``16 x (tp_params / tp + other) / dp`` bytes.
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
    elif key in ("fsdp2", "hsdp", "tp_fsdp"):
        shard = math.ceil(_sharded_params(key, num_params, int(world_size), ranks_per_node, tp, tp_params))
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


#: per-row options of a measurement that :func:`compare` passes on to :func:`predict` (and keeps apart)
OPTIONS = ("ranks_per_node", "tp", "tp_params", "checkpointing")


def _given(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def compare(measured, num_params: int, precision: str = "fp32", tolerance: float = 0.10,
            accumulation: bool = True, vit: dict | None = None):
    """Prediction against measurement, one row per strategy and world size of ``measured``.

    ``measured`` is a DataFrame (or list of dicts) with ``strategy``, ``world_size`` and the bytes
    of ``params``, ``grads`` and ``optimizer`` of a rank (the largest rank per strategy counts).
    Rows may carry :data:`OPTIONS`: ``ranks_per_node`` (HSDP), ``tp`` and ``tp_params`` (TP x FSDP2) go to
    :func:`predict`; runs that differ in them, or in ``checkpointing``, are compared apart.
    Returns a DataFrame with the predicted and measured totals, their ratio and ``within``
    (``|ratio - 1| <= tolerance``); ``accumulation`` as in :func:`predict`.

    With ``vit`` (the ViT's ``depth``, ``width``, ``heads``, ``patch``), rows that carry ``activations`` (bytes
    saved for the backward pass, :func:`saved_activations`) and ``batch`` (the samples of that forward pass) are
    also checked against :func:`vit_activation_bytes`: ``within`` then needs both."""
    import pandas as pd

    df = pd.DataFrame(measured).copy()
    df["measured"] = df[list(KINDS)].sum(axis=1)
    options = [c for c in OPTIONS if c in df.columns]
    worst = df.loc[df.groupby(["strategy", "world_size", *options], sort=False, dropna=False)["measured"].idxmax()]
    rows = []
    for _, row in worst.iterrows():
        given = {k: row[k] for k in options if _given(row[k])}
        shape = {k: int(given[k]) for k in ("ranks_per_node", "tp", "tp_params") if k in given}
        predicted = predict(num_params, int(row["world_size"]), row["strategy"], precision,
                            accumulation=accumulation, **shape)["device"]
        ratio = row["measured"] / predicted if predicted else float("nan")
        out = {"strategy": row["strategy"], "world_size": int(row["world_size"]), **given,
               "predicted": predicted, "measured": int(row["measured"]), "measured / predicted": ratio,
               "within": abs(ratio - 1) <= tolerance}
        if vit is not None and _given(row.get("activations")) and _given(row.get("batch")):
            expected = vit_activation_bytes(int(row["batch"]), **vit, checkpointing=bool(given.get("checkpointing")),
                                            tp=int(given.get("tp", 1)))
            out.update({"activations predicted": expected, "activations measured": int(row["activations"]),
                        "activations ratio": row["activations"] / expected})
            out["within"] = out["within"] and abs(out["activations ratio"] - 1) <= tolerance
        rows.append(out)
    return pd.DataFrame(rows)


def label(row) -> str:
    """A short name for a row of :func:`compare`: ``fsdp2 (N=2)``, ``hsdp (N=4, 2/node)``, ``tp_fsdp (N=4, tp=2)``,
    ``+ AC`` for activation checkpointing."""
    parts = [f"N={int(row['world_size'])}"]
    if _given(row.get("ranks_per_node")):
        parts.append(f"{int(row['ranks_per_node'])}/node")
    if _given(row.get("tp")):
        parts.append(f"tp={int(row['tp'])}")
    checkpointing = row.get("checkpointing")
    return f"{row['strategy']} ({', '.join(parts)})" + (" + AC" if _given(checkpointing) and checkpointing else "")


# --- activations: the course ViT's model, and the measurement -------------------------------

#: the time activation checkpointing adds, as a fraction of a step: one more forward pass of the blocks, out of
#: forward + backward (about 1 + 2 forward passes' worth of work)
RECOMPUTE_COST = 1 / 3


def vit_parameters(depth: int, width: int, heads: int = 4, patch: int = 7, image: int = 28, channels: int = 1,
                   num_classes: int = 10, mlp_ratio: int = 4) -> dict[str, int]:
    """The course ViT's parameters (``total``) and those tensor parallelism splits over a TP group (``tp``).

    TP (Megatron's plan, as module 07's FSDP2 script applies it) splits each block's ``qkv`` and ``mlp[0]``
    column-wise (weights and biases) and ``proj`` and ``mlp[2]`` row-wise (weights; their biases stay whole):
    ``12 w^2 + 7 w`` per block. The embedding, the class token, the positions, the norms and the head stay
    whole on every rank of the TP group."""
    del heads                                        # the number of heads does not change the parameters
    w, h = width, mlp_ratio * width
    block = (3 * w * w + 3 * w) + (w * w + w) + (w * h + h) + (h * w + w) + 4 * w     # qkv, proj, mlp, two norms
    tokens = (image // patch) ** 2 + 1
    total = (channels * patch * patch * w + w) + w + tokens * w + depth * block + 2 * w + (w * num_classes + num_classes)
    return {"total": total, "tp": depth * (4 * w * w + 2 * w * h + 3 * w + h)}


def vit_activation_bytes(batch: int, depth: int, width: int, heads: int, patch: int = 7, image: int = 28,
                         channels: int = 1, num_classes: int = 10, mlp_ratio: int = 4,
                         checkpointing: bool = False, tp: int = 1, bytes_per_value: int = 4) -> float:
    """Bytes the course ViT's forward pass keeps for the backward pass, for ``batch`` samples on one rank.

    The model counts the tensors autograd saves (each storage once), with ``T`` tokens (patches + the class
    token), width ``D``, ``H`` heads and the MLP ``m`` times wider, per sample:

    - **a block**: its input, the first norm's output, the ``qkv`` output (3), the attention's output, the
      residual sum and the second norm's output (1 each: ``8 T D``), the MLP's hidden layer before and after
      GELU (``2 m T D``), the norms' mean and 1/std (``4 T``) and the fused attention's log-sum-exp (``H T``:
      flash attention keeps no ``T x T`` score matrix). ``(8 + 2m) T D + (4 + H) T`` values: 16 T D for m = 4.
    - **around the blocks**: the images (``C x image^2``, the patch embedding's input), the last block's output
      (``T D``: the final norm reads its class token, a view of it), the norm's output and statistics
      (``D + 2``), the log-softmax (``classes``) and the integer label (8 bytes).
    - **activation checkpointing** (``checkpoint`` per block) keeps only each block's input (``T D``); the
      backward pass recomputes one block at a time (its activations live again, briefly, on top of this) and
      pays one more forward pass of the blocks (:data:`RECOMPUTE_COST` of a step).
    - **tensor parallelism** over ``tp`` ranks (no sequence parallelism) splits what lies between a column-wise
      and a row-wise layer, ``(4 + 2m) T D + H T`` per block, over the TP group; the block's input, the norms'
      inputs and outputs and the residual stay whole on every TP rank.

    ``bytes_per_value`` is 4 in fp32 (what the course measures on CPU); with bf16 autocast most saved tensors
    take 2 (the norms' statistics stay fp32)."""
    if tp < 1 or heads % tp:
        raise ValueError(f"tp ({tp}) must be at least 1 and divide the number of heads ({heads})")
    t, d, m = (image // patch) ** 2 + 1, width, mlp_ratio
    if checkpointing:
        per_block = t * d
    else:
        per_block = 4 * t * d + 4 * t + ((4 + 2 * m) * t * d + heads * t) / tp
    around = channels * image * image + t * d + d + 2 + num_classes
    return batch * ((depth * per_block + around) * bytes_per_value + 8)


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
        :meth:`forward`, also the ``activations`` it measured and their ``batch``)."""
        if not self.done:
            raise RuntimeError(f"the meter needs {self.warmup + 1 + self.steps} steps and saw {self.ticks}: "
                               "train longer (more samples or epochs) or measure fewer steps")
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return {"samples_per_s": world_size * self.samples / self.elapsed,
                "step_ms": 1000 * self.elapsed / self.steps, "world_size": world_size,
                "memory": {**self.memory, **(self.activations or {})}}


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
