"""Module 05's visible checks on plain data (``coursekit.evidence.plain``): each rank's sharded model described
(its units, placements, options, dtypes), what the ranks reported and wrote (``save_and_report``,
``export_full_state_dict``), the state a restore put back, the facts and peaks of ``build_on_meta``, and the layout
and collectives of ``shard_hybrid``. The notebook calls these functions in your kernel; the grader calls the same
ones in its own process on the data your test cells handed in, with its hidden checks."""
from __future__ import annotations

import ast
import functools
import hashlib

WORLD_SIZE, PER_NODE = 4, 2                       # the checks' 4 processes, 2 simulated nodes x 2 ranks
TINY = dict(depth=2, width=32, heads=4, patch=7, lr=1e-2, seed=0)
SHARDED = ["(Shard(dim=0),)", WORLD_SIZE, "cpu"]  # placements, mesh size, mesh device type
BF16_UNIT = {"param_dtype": "torch.bfloat16", "reshard_after_forward": False}
DEFAULT_UNIT = {"param_dtype": None, "reshard_after_forward": True}
HYBRID = ["(Replicate(), Shard(dim=0))"]          # replicated over the mesh's first dimension, sharded over its second
# pos_embed's shard on a rank of the check (MID's [17, 192] over 2 ranks: 1728 or 1536 values), drawn with mean 0 and
# std 0.02: the mean of its values spreads by 0.02 / sqrt(1536) = 0.0005, so 0.005 is 10 of those (a mean of 1 is not)
POS_EMBED_MEAN = 0.005


def fixture_name(saved_ranks: int, epoch: int) -> str:
    """The folder in the module's ``fixtures/`` of the sharded checkpoint that ``saved_ranks`` ranks saved at
    ``epoch`` (made by the instructors' ``python -m autograder.fixtures``; Exercise 3's check restores it)."""
    return f"checkpoint_{saved_ranks}_ranks_epoch_{epoch}"


def value_of(run: dict | None, what: str):
    """The value of a handed-in ``attempt`` (``{"value", "error"}``), or AssertionError with its error."""
    if not isinstance(run, dict) or ("value" not in run and "error" not in run):
        raise AssertionError(f"the test cell handed in no result of {what}: run its cells in order, without errors, "
                             "up to the end of the test cell")
    if run.get("error"):
        raise AssertionError(f"{what} failed: {str(run['error'])[-1500:]}")
    return run["value"]


def tensors(data: dict) -> dict:
    """name -> tensor of a handed-in dict of encoded tensors (``plain``)."""
    from coursekit.evidence import tensor

    return {k: tensor(v) for k, v in data.items()}


def max_difference(a: dict, b: dict) -> float:
    """The largest |difference| between the tensors of ``a`` and ``b`` (the keys of ``a``)."""
    return max(((a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0) for k in a)


def digests(state: dict) -> dict:
    """name -> sha256 of a tensor's dtype, shape and bytes: equal digests, equal tensors (bit for bit)."""
    import torch

    out = {}
    for k, t in state.items():
        if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor:
            out[k] = f"not a plain tensor: {type(t).__name__}"
            continue
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[k] = hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode() + raw).hexdigest()
    return out


def build_vit(config: dict):
    """The course ViT with the shape in ``config``, initialised from ``config['seed']`` (the notebook's
    build_vit_from)."""
    import torch

    from coursekit.models import ViT

    torch.manual_seed(config["seed"])
    return ViT(depth=config["depth"], width=config["width"], heads=config["heads"], patch=config["patch"])


# ---------------------------------------------------------------- Exercise 1: setup_fsdp
# facts (one rank's model, described): {"root", "blocks": unit options or None, "placements": {name: [placements,
# mesh size, mesh type] or "not a DTensor"}, "optimizer_holds_model_params", "lr", "sharded_dtypes",
# "optimizer_state", "default_meshes" (fully_shard calls given no mesh)}; bf16 facts also "logits_dtype"

def mesh_type_literals(source: str | None) -> list:
    """The string literals passed as init_device_mesh's device type in ``source`` (a function's code)."""
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(source or ""))
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "init_device_mesh":
            kind = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "device_type"), None)
            if isinstance(kind, ast.Constant):
                found.append(kind.value)
    return found


def unsharded(facts: dict) -> dict:
    return {k: v for k, v in facts["placements"].items() if v != SHARDED}


def check_setup(facts: dict) -> None:
    """A unit per block and one for the root, every parameter a DTensor split along dim 0 over all ranks on the
    device's mesh, the optimizer over the sharded parameters."""
    assert facts["root"] is not None and facts["blocks"] and all(facts["blocks"]), (
        "call fully_shard on each block in model.blocks, then on the whole model: the units found (None: not a unit) "
        f"are blocks {facts['blocks']}, root {facts['root']}")
    assert not unsharded(facts), (
        f"every parameter must be a DTensor split along dim 0 over all {WORLD_SIZE} ranks of the 2 nodes, on the mesh "
        f"of device.type ('cpu' here): {SHARDED}; got {dict(list(unsharded(facts).items())[:3])}")
    check_no_default_mesh(facts.get("default_meshes"))
    assert facts["optimizer_holds_model_params"], (
        "the optimizer does not hold the model's parameters: fully_shard replaced them with DTensors, so an optimizer "
        "created before it updates tensors the model no longer uses. Create the AdamW AFTER fully_shard.")


def check_no_default_mesh(default_meshes) -> None:
    """Every fully_shard call was given the mesh built from ``device``."""
    assert not default_meshes, (
        f"{default_meshes} fully_shard call(s) were given no mesh: pass mesh=mesh (yours, built on device.type) to every "
        "call. Without it fully_shard builds a mesh of its own on the machine's accelerator, whatever `device` says: "
        "'cuda' on a GPU node, where this check's CPU ranks (and a CPU worker) then fail")


def check_mesh_type(source: str | None) -> None:
    """The mesh's device type is not a string literal in the code."""
    literals = mesh_type_literals(source)
    assert not literals, (
        f"the mesh's device type must come from `device` (device.type), not the literal {literals}: the same code "
        "runs on CPU workers ('cpu') and GPU workers ('cuda')")


def check_options(bf16_facts: dict) -> None:
    """With BF16_OPTIONS every unit, the blocks' and the root's, has the bf16 policy and keeps its weights."""
    assert bf16_facts["blocks"] and all(b == BF16_UNIT for b in bf16_facts["blocks"]) \
        and bf16_facts["root"] == BF16_UNIT, (
            "pass **fsdp_kwargs to every fully_shard call, the blocks' and the root's: with BF16_OPTIONS each unit must "
            f"have {BF16_UNIT}; got blocks {bf16_facts['blocks']}, root {bf16_facts['root']}")


# ---------------------------------------------------------------- Exercise 2: save_and_report
# reports[rank] = [{"metrics", "files": the names of its checkpoint's files, or None}] (one per report)

def check_reports(reports: list) -> None:
    """Every rank reports once, the metrics given, with a checkpoint."""
    for rank, rank_reports in enumerate(reports):
        assert len(rank_reports) == 1, f"rank {rank} must call ray.train.report exactly once, not {len(rank_reports)} times"
        assert rank_reports[0]["metrics"] == {"epoch": 4, "loss": 0.5}, \
            f"rank {rank}: report the metrics you were given, not {rank_reports[0]['metrics']}"
        assert rank_reports[0]["files"] is not None, \
            f"rank {rank} must report a checkpoint: every rank holds different shards"


# ---------------------------------------------------------------- Exercise 3: restore_checkpoint

def check_restored(next_epoch, saved_epoch: int, restored_params: dict, saved_params: dict) -> None:
    """Rank 0 of the new run returns the saved epoch + 1 and holds the saved weights."""
    assert next_epoch == saved_epoch + 1, \
        f"return the epoch to continue from: the saved epoch ({saved_epoch}) + 1, not {next_epoch}"
    assert set(restored_params) == set(saved_params) and max_difference(restored_params, saved_params) == 0, \
        "the model's weights must be restored"


# ---------------------------------------------------------------- Exercise 4: export_full_state_dict
# rank 0's file described: {"exists", "error" (torch.load's), "kinds": {name: "Tensor torch.float32 cpu"},
# "state": {name: tensor, or None for anything but a plain tensor}}

def check_export_loads(described: dict, config: dict = TINY) -> dict:
    """Rank 0's model_full.pt exists and loads with torch.load(weights_only=True) into a plain ViT (of ``config``'s
    shape). Returns its tensors."""
    assert described.get("exists"), "rank 0 must save model_full.pt in its directory"
    try:
        if described.get("error"):
            raise RuntimeError(described["error"])
        state = described.get("state")
        if not isinstance(state, dict) or any(v is None for v in state.values()):
            raise RuntimeError(f"it holds other things than plain tensors: {sorted(set(described.get('kinds', {}).values()))}")
        state = tensors(state)
        build_vit(config).load_state_dict(state)
    except Exception as e:
        raise AssertionError(f"model_full.pt must load into a plain ViT (full tensors, the ViT's keys): {e}") from None
    return state


# ---------------------------------------------------------------- Exercise 5: build_on_meta
# fresh facts (one rank's shards, read locally): {"devices", "not_sharded", "units", "not_finite", "cls_token"
# (largest |value| of its rows, None if it holds none), "pos_embed_std", "pos_embed_mean", "layernorm" (distinct
# values), "linear_over_bound"}
# probe (TINY built fresh three times: from TINY's seed, again with BF16_OPTIONS, from the next seed): {"shards": the
# three builds' shards on this rank {name: digest}, "bf16_units": unit options (blocks, then root) with BF16_OPTIONS,
# "default_meshes", "allocated_before_sharding": values found allocated by fully_shard}

def check_meta_ran(error: str | None) -> None:
    assert error is None, f"build_on_meta must run on 2 ranks, fresh and loaded; it failed with: {error}"


def check_meta_fresh(facts: dict, rank: int = 1) -> None:
    """The fresh shards are on the CPU, every value initialised, pos_embed drawn with std 0.02."""
    assert facts["devices"] == ["cpu"], (
        f"the shards must be on the device given (cpu here), not {facts['devices']}: call model.to_empty(device=device) "
        "after fully_shard; a meta tensor has no storage, and reset_parameters() on it does nothing")
    assert not facts["not_finite"], (
        f"parameters left uninitialised (NaN: memory to_empty allocated and nothing wrote): {facts['not_finite']}. "
        "reset_parameters() covers nn.Linear, nn.LayerNorm and nn.Conv2d; cls_token and pos_embed belong to the ViT "
        "itself")
    assert 0.015 < facts["pos_embed_std"] < 0.025 and abs(facts.get("pos_embed_mean", 0.0)) < POS_EMBED_MEAN, (
        f"pos_embed must be drawn from a normal with mean 0 and std 0.02; rank {rank}'s shard has mean "
        f"{facts.get('pos_embed_mean', 0.0):.4f} and std {facts['pos_embed_std']:.4f}")


@functools.lru_cache(maxsize=None)
def random_parameters() -> frozenset:
    """The TINY ViT's parameters that ViT.__init__ draws at random (the others are constants: zeros, ones)."""
    a, b = build_vit({**TINY, "seed": 0}).state_dict(), build_vit({**TINY, "seed": 1}).state_dict()
    return frozenset(k for k in a if not a[k].equal(b[k]))


def check_meta_probe(probe: dict, rank: int = 1) -> None:
    """Fresh TINY builds: the same seed gives the same shards, another seed other shards; the options reach every
    unit; every fully_shard call gets the mesh."""
    first, again, other = probe["shards"]
    differ = sorted(k for k in first if first[k] != again.get(k))
    assert not differ, (
        f"rank {rank}: built fresh twice from the same config['seed'], the shards differ ({differ[:3]}): seed with "
        "torch.manual_seed(config['seed']) before the first random draw (every reset_parameters() draws)")
    fixed = sorted(k for k in random_parameters() if first.get(k) == other.get(k))
    assert not fixed, (
        f"rank {rank}: built fresh from two different config['seed'], these random parameters are equal: {fixed[:3]}: "
        "seed with config['seed'], not a constant")
    assert isinstance(probe["bf16_units"], list) and all(u == BF16_UNIT for u in probe["bf16_units"]), (
        f"rank {rank}: pass **fsdp_kwargs to every fully_shard call: with BF16_OPTIONS each unit must have {BF16_UNIT}; "
        f"got (blocks, then root) {probe['bf16_units']}")
    check_no_default_mesh(probe["default_meshes"])


def check_meta_device(probe: dict, rank: int = 1) -> None:
    """Handed a GPU worker's device: the shards are allocated on it, and on the CPU only with CPU offload."""
    runs = probe.get("gpu_worker")
    assert isinstance(runs, dict), f"rank {rank}: the check handed in no run with a GPU worker's device"
    plain, offloaded = runs.get("on the device", {}), runs.get("offloaded", {})
    pinned = [d for d in plain.get("to_empty", []) if d is None or d.startswith("cpu")]
    assert not pinned, (
        f"rank {rank}: handed a GPU worker's device (cuda:{rank % 2}) without CPU offload, to_empty allocated the "
        f"shards on {pinned[0]}: allocate them on `device`, where the model computes")
    elsewhere = [d for d in offloaded.get("to_empty", []) if d is None or not d.startswith("cpu")]
    assert not elsewhere, (
        f"rank {rank}: with a CPUOffloadPolicy in fsdp_kwargs and a GPU worker's device, to_empty allocated the shards "
        f"on {elsewhere[0]}: offloaded shards live in host memory, to_empty(device=\"cpu\") (FSDP2 refuses them "
        "anywhere else at the first forward)")


def check_meta_sharded_first(probe: dict, rank: int = 1) -> None:
    """fully_shard met only parameters on the meta device: nothing was allocated before it."""
    assert not probe["allocated_before_sharding"], (
        f"rank {rank}: fully_shard found {probe['allocated_before_sharding']} values already allocated: allocate nothing "
        "before the last fully_shard (the root's); call to_empty after it, and build the model on the meta device")


def check_meta_loaded(weight_digests: dict, reference_digests: dict) -> None:
    """Loaded from the file, rank 0's model holds exactly the file's weights (compared by their digests)."""
    differ = sorted(k for k in set(weight_digests) | set(reference_digests)
                    if weight_digests.get(k) != reference_digests.get(k))
    assert not differ, (
        "with weights_file, the model must hold exactly the file's weights: rank 0 reads it, set_model_state_dict "
        f"with full_state_dict=True and broadcast_from_rank0=True hands every rank its shards (differ: {differ[:3]})")


def check_meta_memory(peak, model_bytes: int, rank: int = 1) -> None:
    """Building fresh, the rank's memory rose by less than 0.8 x the whole model."""
    from coursekit.memory import format_bytes

    limit = 0.8 * model_bytes
    assert peak is not None and peak < limit, (
        f"rank {rank}'s memory rose by {format_bytes(peak or 0)} while build_on_meta built the model fresh: no rank may "
        f"hold the whole model ({format_bytes(model_bytes)}); expected about half of it (its shards), at most "
        f"{format_bytes(limit)}. Build on the meta device and call to_empty only after fully_shard")


# ---------------------------------------------------------------- Exercise 6: shard_hybrid
# facts (one rank, one layout): {"units", "placements", "mesh_shape" ([nodes, per node], or "<n> meshes"),
# "groups" (per mesh dimension: the ranks of this rank's group), "local_fraction", "collectives": [[name, ranks,
# bytes]], "loss", "grads"}

def check_hybrid_ran(error: str | None) -> None:
    assert error is None, f"shard_hybrid must run on 4 ranks (2 nodes x 2, then 4 nodes x 1); it failed with: {error}"


def check_hybrid_layout(facts: dict) -> None:
    """Rank 1 of 2 nodes x 2: a unit per block and the root, (Replicate(), Shard(dim=0)) on a (2, 2) mesh,
    replicated with rank 3 and sharded with rank 0."""
    assert all(facts["units"]), \
        f"fully_shard each block in model.blocks, then the whole model; units found (blocks, then root): {facts['units']}"
    assert facts["placements"] == HYBRID and facts["mesh_shape"] == [2, 2], (
        f"on 2 nodes x 2 every parameter must be {HYBRID[0]} on a mesh of shape (nodes, ranks_per_node) = (2, 2); "
        f"rank 1 has {facts['placements']} on a mesh of shape {facts['mesh_shape']}")
    assert facts["groups"] == [[1, 3], [0, 1]], (
        "rank 1 (node 0) must replicate with rank 3 (the same local rank on node 1) and shard with rank 0 (its own "
        f"node): the groups along the mesh's dimensions are {facts['groups']}, expected [(1, 3), (0, 1)]")


def check_hybrid_device(device_types) -> None:
    """Handed a GPU's device, the mesh is asked for on 'cuda'."""
    assert device_types == ["cuda"], (
        "handed a GPU worker's device (torch.device('cuda', 0)), shard_hybrid must build its mesh with "
        f"init_device_mesh(device.type, ...), i.e. 'cuda'; it asked for {device_types}")


# ---------------------------------------------------------------- the pitfalls the notebook's test cells check in
# the kernel (their graded parts check more, outside it)

TRAINING_TOLERANCE = 1e-5     # a sharded run and one process differ by float32 rounding only (the order of the sums)


def one_process_trained(config: dict, batches, lr: float | None = None) -> dict:
    """One process, AdamW, one step per batch on the whole batch: its weights (what every rank of a right FSDP run
    must hold after the same steps on its share of each batch)."""
    import torch
    import torch.nn.functional as F

    model = build_vit(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"] if lr is None else lr)
    for batch in batches:                 # (images, labels)
        optimizer.zero_grad()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def comparable(name: str, t):
    """Everything but the attention's key bias: its gradient is 0 in exact arithmetic, and Adam turns the rounding
    noise into full-size steps (section 5)."""
    import torch

    if name.endswith("qkv.bias"):
        width = len(t) // 3
        return torch.cat([t[:width], t[2 * width:]])
    return t


def check_trained_like_one_process(ranks_trained: list, reference: dict) -> None:
    """Every rank's full weights after the steps equal one process's on the whole batches."""
    for rank, trained in enumerate(ranks_trained):
        trained = tensors(trained)
        assert set(trained) == set(reference), \
            f"rank {rank}: the model's parameters changed names: {sorted(set(trained) ^ set(reference))[:3]}"
        worst = max((comparable(k, trained[k]).double() - comparable(k, p).double()).abs().max().item()
                    for k, p in reference.items())
        assert worst < TRAINING_TOLERANCE, (
            f"rank {rank}: after 3 steps the weights must equal those of one process trained on the whole batches "
            f"(max |diff| {worst:.1e}, tolerance {TRAINING_TOLERANCE:.0e}): the optimizer must step the sharded "
            "parameters")


def check_sharded_metadata(metadata: dict, world_size: int = WORLD_SIZE) -> None:
    """DCP's .metadata (described: each tensor's size and chunks): every tensor of ``world_size`` rows or more was
    saved as the ranks' shards (no chunk above ceil(rows / world_size) rows), one chunk in each rank's file."""
    import re

    big = {name: meta for name, meta in metadata["tensors"].items()
           if len(meta["size"]) and meta["size"][0] >= world_size}
    assert big, f"the checkpoint holds no tensor of {world_size} rows or more: {metadata['names'][:5]}"
    whole = []
    for name, meta in big.items():
        rows = -(-meta["size"][0] // world_size)
        files = sorted({int(m.group(1)) for c in meta["chunks"] if (m := re.match(r"__(\d+)_", c["file"] or ""))})
        owners = [r for r in range(world_size) if r * rows < meta["size"][0]]     # the ranks with rows of it
        if any(c["sizes"][0] > rows for c in meta["chunks"]) or files != owners:
            whole.append(f"{name} {list(meta['size'])} as " + ", ".join(
                f"rows {c['offsets'][0]}-{c['offsets'][0] + c['sizes'][0] - 1} in {c['file'] or '?'}"
                for c in meta["chunks"]))
    assert not whole, (
        f"the checkpoint is not sharded: {len(whole)} of {len(big)} tensors were not saved as one piece per rank "
        f"(at most ceil(rows / {world_size}) rows, in that rank's file), e.g. {whole[:2]}. Each rank must save its "
        "own shards, as get_state_dict gives them by default, with DCP's collective save on every rank")


def check_restored_optimizer(restored: dict, saved: dict, lr, saved_lr: float) -> None:
    """A restoring rank's full optimizer state (momentum buffers by name) equals the saved run's, and its learning
    rate is the checkpoint's."""
    restored, saved = tensors(restored), tensors(saved)
    assert set(restored) == set(saved) and max_difference(restored, saved) == 0, (
        "restore the optimizer state too (SGD's momentum buffers): the restored buffers differ from the saved ones "
        f"(missing or extra: {sorted(set(restored) ^ set(saved))[:3]})")
    assert lr == [saved_lr], (
        f"the optimizer's learning rate must be the checkpoint's ({saved_lr}), not {lr}: loading fills tensors in "
        "place, but only writing the loaded optimizer state dict back puts its param_groups in the optimizer")


def check_export_weights(described: dict, reference: dict) -> None:
    """model_full.pt holds plain fp32 CPU tensors equal to the sharded model's full weights."""
    assert described.get("exists") and not described.get("error"), \
        f"rank 0's model_full.pt must load with torch.load(weights_only=True): {described.get('error') or 'no file'}"
    kinds = sorted(set(described["kinds"].values()))
    assert kinds == ["Tensor torch.float32 cpu"], (
        f"save plain fp32 CPU tensors (the sharded fp32 master weights gathered into CPU memory), not {kinds}")
    state = tensors(described.get("state") or {})
    assert set(state) == set(reference) and max_difference(state, reference) == 0, \
        "the file must hold the sharded model's full weights: every key, every shard gathered"
