"""The memory model: how many bytes one rank holds, before a run.

:func:`predict` answers "how many bytes of model state does one rank hold?" for the course's
strategies, from the parameter count, the world size, the precision and offload:

>>> round(predict(300_000_000, 8, "zero2", precision="mixed")["device"] / 2**30, 2)   # GiB per GPU
1.05

What is counted is *model state*: parameters, gradients and optimizer state (Adam(W): two moments,
plus the fp32 master copy where one exists), and under DDP the second copy of the gradients that its all-reduce
buckets hold (counted with the gradients, as the measurement counts it). Other communication buffers (ZeRO's
buckets), gathered FSDP2/ZeRO-3 units and the allocator's overhead come on top; on a GPU,
``torch.cuda.max_memory_allocated`` shows them. *Activations* (what the forward pass keeps for the backward pass)
have a model of their own for the course's ViT, with and without activation checkpointing and tensor parallelism
(:func:`vit_activation_bytes`). The measurement that checks these predictions is
:class:`coursekit.stepmeter.StepMeter` (:func:`compare` puts the two side by side); the notebook widgets around
them are in :mod:`coursekit.planner_widgets`.
"""
from __future__ import annotations

import math

from coursekit.memory import KINDS

#: strategy -> a short description (the planner's dropdown and the comparison table use these names)
STRATEGIES = {
    "ddp": "DDP (torchrun or Ray Train): a full copy on every rank, and the gradients again in its buckets",
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
            tp: int | None = None, tp_params: int | None = None, buckets: bool = True) -> dict[str, float]:
    """Bytes of model state per rank: ``params``, ``grads``, ``optimizer``, their sum on the
    accelerator (``device``) and what offload keeps in host memory instead (``host``).

    - DDP holds everything in full: 4 + 4 + 8 bytes per parameter with Adam, and its all-reduce buckets hold a
      second copy of the gradients (4 more bytes in ``grads``: 20 in all). ``buckets=False`` leaves that copy out:
      ``DistributedDataParallel(..., gradient_as_bucket_view=True)`` makes the gradients views into the buckets, and
      a single process that nothing wraps in DDP (Ray Train's ``prepare_model`` on one worker) has none: 16 bytes.
      Mixed precision under DDP (``torch.autocast``) casts activations and matmuls, not the model state or its fp32
      gradients: still the same bytes.
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
        copy = 4.0 * num_params if buckets else 0.0      # DDP's buckets: a copy of every fp32 gradient
        state = {"params": 4.0 * num_params, "grads": 4.0 * num_params + copy, "optimizer": 8.0 * num_params}
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
OPTIONS = ("ranks_per_node", "tp", "tp_params", "buckets", "checkpointing")


def _given(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def compare(measured, num_params: int, precision: str = "fp32", tolerance: float = 0.10,
            accumulation: bool = True, vit: dict | None = None):
    """Prediction against measurement, one row per strategy and world size of ``measured``.

    ``measured`` is a DataFrame (or list of dicts) with ``strategy``, ``world_size`` and the bytes
    of ``params``, ``grads`` and ``optimizer`` of a rank (the largest rank per strategy counts).
    Rows may carry :data:`OPTIONS`: ``ranks_per_node`` (HSDP), ``tp`` and ``tp_params`` (TP x FSDP2) and
    ``buckets`` (DDP) go to :func:`predict`; runs that differ in them, or in ``checkpointing``, are compared apart.
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
        if "buckets" in given:
            shape["buckets"] = bool(given["buckets"])
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
