"""Module 05's check runs: your functions, handed in as arguments, run on forked CPU ranks the way Ray Train's
workers would run them. Each returns plain data (numbers, strings, dicts of tensors) for the test cells to show,
check (``coursekit.exercise_checks.fsdp``) and hand in (``coursekit.evidence``); the grader computes its own
references and verdicts outside your kernel.

The data and the models: ``TINY`` (a 2-block ViT) on 4 processes laid out as 2 simulated nodes x 2 ranks (local and
global ranks differ), three fixed batches of 12 images (``TRAIN_BATCHES``; the first is ``ORACLE_BATCH``), and ``MID``
(2.7M parameters, 11 MB) for the memory of the meta-device build.

- ``fsdp_step``: one training step, each rank on its equal share of the batch: the loss averaged over ranks, the full
  gradients (``DTensor.full_tensor()`` gathers the shards) and the full parameters after the step;
- ``unit_options``: the options a ``fully_shard`` unit was built with, read from FSDP2's (internal) state;
  ``fully_shard_calls()``: each ``fully_shard`` call that built a mesh of its own (no ``mesh=`` given) and the values
  it found already allocated;
- ``setup_on_rank`` (Exercise 1), ``meta_on_rank`` (Exercise 5), ``hybrid_on_rank`` (Exercise 6): the checks' runs;
  ``recorded_collectives()``: every collective FSDP2 calls inside a ``with`` block, and ``traffic`` sums them up.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import tempfile
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from coursekit.distributed import run_distributed
from coursekit.exercise_checks.fsdp import PER_NODE, TINY, WORLD_SIZE, build_vit, digests
from coursekit.memory import PeakMemory, rss_follows_tensors
from coursekit.testing import simulated_worker

__all__ = ["TINY", "WORLD_SIZE", "PER_NODE", "TRAIN_BATCHES", "ORACLE_BATCH", "BF16_OPTIONS", "MID", "HYBRID_LAYOUTS",
           "full", "fsdp_step", "unit_options", "fully_shard_calls", "recorded_collectives", "traffic", "ran",
           "setup_on_rank", "meta_weights", "meta_on_rank", "hybrid_on_rank"]

_g = torch.Generator().manual_seed(1)
TRAIN_BATCHES = [(torch.randn(12, 1, 28, 28, generator=_g), torch.randint(0, 10, (12,), generator=_g))
                 for _ in range(3)]
ORACLE_BATCH = TRAIN_BATCHES[0]
BF16_OPTIONS = dict(reshard_after_forward=False,
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
MID = dict(depth=6, width=192, heads=4, patch=7, lr=1e-2, seed=5)   # 2.7M parameters (11 MB): the checked size
META_BATCH = (TRAIN_BATCHES[1][0][:8], TRAIN_BATCHES[1][1][:8])
COLLECTIVES = {"all_gather_single": "output_tensor", "reduce_scatter_single": "input", "all_reduce": "tensor"}
HYBRID_LAYOUTS = {"2 nodes x 2": (2, 2), "4 nodes x 1": (4, 1)}    # (nodes, ranks_per_node), on the same 4 processes


def ran(fn, world_size: int, *args, local_world_size: int | None = None, timeout_s: float = 60):
    """``(results by rank, None)``, or ``(None, the last lines of the error)`` if a rank failed or the group hung."""
    try:
        return run_distributed(fn, world_size, *args, local_world_size=local_world_size, timeout_s=timeout_s), None
    except (RuntimeError, TimeoutError) as e:
        return None, "\n".join(str(e).strip().splitlines()[-3:])


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathers a DTensor's shards from every rank (a collective), else t itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def fsdp_step(model, optimizer, images, labels, gather: bool = True):
    """One step on this rank's equal share of the batch.

    Returns (mean loss over ranks, full grads, full params after the step), or None if not ``gather``."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    share = len(labels) // world_size
    mine = slice(rank * share, (rank + 1) * share)
    loss = F.cross_entropy(model(images[mine]), labels[mine])
    optimizer.zero_grad()
    loss.backward()
    if not gather:
        optimizer.step()
        return None
    grads = {name: full(p.grad).clone() for name, p in model.named_parameters()}
    optimizer.step()
    params = {name: full(p).clone() for name, p in model.named_parameters()}
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    return mean_loss.item() / world_size, grads, params


def unit_options(module):
    """The options of the fully_shard unit ``module`` (None if it is not one), from FSDP2's internal state."""
    if not isinstance(module, FSDPModule):
        return None
    group = module._get_fsdp_state()._fsdp_param_group
    return {"param_dtype": group.mp_policy.param_dtype,                         # None: the parameters' own dtype
            "reshard_after_forward": group.post_forward_mesh_info is not None}


@contextlib.contextmanager
def fully_shard_calls():
    """Records each fully_shard call made in this process inside the ``with`` block: whether it built a mesh of its
    own (no ``mesh=`` given: FSDP2's default, a 1-D mesh on the machine's accelerator whatever ``device`` says) and
    how many of the values it sharded were already allocated (not on the meta device). Read from FSDP2's internals."""
    from torch.distributed.fsdp._fully_shard import _fully_shard as impl

    calls, made, real_mesh, real_states = [], [], impl._init_default_mesh, impl._get_modules_and_states

    def default_mesh(*args, **kwargs):
        made.append(True)
        return real_mesh(*args, **kwargs)

    def states(*args, **kwargs):
        found = real_states(*args, **kwargs)           # (module, modules, managed modules, params, buffers)
        calls.append({"default_mesh": bool(made),
                      "allocated": sum(p.numel() for p in found[3] if p.device.type != "meta")})
        made.clear()
        return found

    with mock.patch.object(impl, "_init_default_mesh", default_mesh), \
            mock.patch.object(impl, "_get_modules_and_states", states):
        yield calls


def describe_sharding(model, optimizer) -> dict:
    return dict(
        root=unit_options(model),
        blocks=[unit_options(block) for block in model.blocks],
        placements={name: (str(p.placements), p.device_mesh.size(), p.device_mesh.device_type)
                    if isinstance(p, DTensor) else "not a DTensor" for name, p in model.named_parameters()},
        optimizer_holds_model_params={id(p) for group in optimizer.param_groups for p in group["params"]}
        == {id(p) for p in model.parameters()},
        lr=optimizer.param_groups[0]["lr"],
        sharded_dtypes=sorted({str(p.dtype) for p in model.parameters()}),   # what AdamW updates (the master weights)
    )


# ---- Exercise 1: setup_fsdp ------------------------------------------------------------------------------------

def setup_on_rank(rank, world_size, setup_fsdp):
    """``setup_fsdp`` with the default options and with ``BF16_OPTIONS``, each model described; then three steps of
    the default one. Returns (facts, bf16 facts, the first step's (loss, gradients, parameters), the trained weights)."""
    with simulated_worker(rank, world_size, local_world_size=PER_NODE), fully_shard_calls() as calls:   # Ray Train's context, if you use it
        model, optimizer = setup_fsdp(TINY, torch.device("cpu"))
        bf16_model, bf16_optimizer = setup_fsdp(TINY, torch.device("cpu"), **BF16_OPTIONS)
    facts, bf16_facts = describe_sharding(model, optimizer), describe_sharding(bf16_model, bf16_optimizer)
    facts["default_meshes"] = sum(call["default_mesh"] for call in calls)    # fully_shard calls without a mesh
    try:
        bf16_facts["logits_dtype"] = bf16_model(ORACLE_BATCH[0][:2]).dtype
    except RuntimeError as e:      # e.g. bf16 activations meeting fp32 weights: options on some units only
        bf16_facts["logits_dtype"] = f"the forward pass fails: {str(e).splitlines()[0]}"
    first_step = fsdp_step(model, optimizer, *TRAIN_BATCHES[0])     # (loss, gradients, parameters after)
    for images, labels in TRAIN_BATCHES[1:]:
        fsdp_step(model, optimizer, images, labels, gather=False)
    facts["optimizer_state"] = sorted({type(v).__name__ for state in optimizer.state.values()
                                       for v in state.values() if torch.is_tensor(v) and v.dim() > 0})
    trained = {name: full(p).clone() for name, p in model.named_parameters()}
    return facts, bf16_facts, first_step, trained


# ---- Exercise 5: build_on_meta ---------------------------------------------------------------------------------

def meta_weights() -> tuple[dict, torch.nn.Module]:
    """The weight files the check loads (``{"tiny": path, "mid": path}``, in a new temporary folder), and the
    ``MID`` model whose weights the "mid" file holds (another seed than ``MID``'s)."""
    root = tempfile.mkdtemp()
    files = {name: os.path.join(root, f"{name}.pt") for name in ("tiny", "mid")}
    torch.save(build_vit({**TINY, "seed": 11}).state_dict(), files["tiny"])
    reference = build_vit({**MID, "seed": 11})
    torch.save(reference.state_dict(), files["mid"])
    return files, reference


def fresh_facts(model) -> dict:
    """What this rank holds after a fresh build: read from its own shards only (no collective)."""
    params = dict(model.named_parameters())
    facts = dict(devices=sorted({p.device.type for p in params.values()}),
                 not_sharded=sorted(k for k, p in params.items() if not isinstance(p, DTensor)),
                 units=[isinstance(b, FSDPModule) for b in model.blocks] + [isinstance(model, FSDPModule)])
    if "meta" in facts["devices"]:
        return facts
    mine = {k: (p.to_local() if isinstance(p, DTensor) else p).detach() for k, p in params.items()}
    facts["not_finite"] = sorted(k for k, t in mine.items() if not torch.isfinite(t).all())
    facts["cls_token"] = mine["cls_token"].abs().max().item() if mine["cls_token"].numel() else None
    facts["pos_embed_std"] = mine["pos_embed"].std().item()
    facts["pos_embed_mean"] = mine["pos_embed"].mean().item()
    facts["layernorm"] = sorted({v for k, t in mine.items() if "norm" in k and k.endswith("weight")
                                 for v in t.unique().tolist()})
    linear = {k: model.get_submodule(k.rsplit(".", 1)[0]) for k in mine if k.endswith("weight")}
    facts["linear_over_bound"] = sorted(   # reset_parameters: |w| <= 1 / sqrt(fan_in)
        k for k, m in linear.items() if isinstance(m, torch.nn.Linear) and mine[k].numel()
        and mine[k].abs().max().item() > 1.0001 / m.in_features ** 0.5)
    return facts


def seeding_probe(build_on_meta) -> dict:
    """The fresh TINY build three times, the global generator moved elsewhere before each: from TINY's seed, from
    the same seed with BF16_OPTIONS, from the next seed. Each build's shards on this rank (by their digests: equal
    digests, equal values), the second build's unit options; and, from every fully_shard call, how many made a mesh
    of their own and how many values they found already allocated."""
    def local_digests(model):
        return digests({k: (p.to_local() if isinstance(p, DTensor) else p).detach() for k, p in model.named_parameters()})

    cpu = torch.device("cpu")
    with fully_shard_calls() as calls:
        torch.manual_seed(1234)
        first = local_digests(build_on_meta(TINY, cpu))
        torch.manual_seed(4321)
        try:
            again = build_on_meta(TINY, cpu, **BF16_OPTIONS)
            bf16_units = [unit_options(b) for b in again.blocks] + [unit_options(again)]
        except Exception as e:       # e.g. no **fsdp_kwargs in the signature: the rest is still checked
            again, bf16_units = build_on_meta(TINY, cpu), f"with BF16_OPTIONS it failed: {type(e).__name__}: {e}"
        again = local_digests(again)
        torch.manual_seed(5678)
        other = local_digests(build_on_meta({**TINY, "seed": TINY["seed"] + 1}, cpu))
    return dict(shards=[first, again, other], bf16_units=bf16_units,
                default_meshes=sum(call["default_mesh"] for call in calls),
                allocated_before_sharding=sum(call["allocated"] for call in calls))


def to_empty_devices(rank, build_on_meta) -> dict:
    """build_on_meta handed a GPU worker's device, without and with CPU offload: the devices its to_empty calls name
    (the mesh and the storage are made on the CPU in their place, so that it runs on this CPU machine). What the
    function did after a call that this machine cannot make (e.g. moving a tensor to the GPU) is not seen; its error
    is noted beside the devices."""
    import torch.distributed.device_mesh as device_mesh_module
    from torch.distributed.fsdp import CPUOffloadPolicy

    asked, real_init, real_to_empty = [], device_mesh_module.init_device_mesh, torch.nn.Module.to_empty

    def standin_mesh(device_type, *args, **kwargs):
        return real_init("cpu", *args, **kwargs)

    def standin_to_empty(module, *, device, recurse=True):
        asked.append(None if device is None else str(torch.device(device)))
        return real_to_empty(module, device="cpu", recurse=recurse)

    names = getattr(build_on_meta, "__globals__", {})     # where your function finds init_device_mesh
    out = {}
    for case, options in (("on the device", {}), ("offloaded", {"offload_policy": CPUOffloadPolicy()})):
        asked.clear()
        try:
            with mock.patch.object(device_mesh_module, "init_device_mesh", standin_mesh), \
                    mock.patch.dict(names, init_device_mesh=standin_mesh), \
                    mock.patch.object(torch.nn.Module, "to_empty", standin_to_empty):
                build_on_meta(TINY, torch.device("cuda", rank % 2), **options)
            error = None
        except Exception as e:   # noqa: BLE001  what this CPU machine cannot do; the devices asked before it count
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        out[case] = {"to_empty": list(asked), "error": error}
    return out


def meta_on_rank(rank, world_size, build_on_meta, weight_files: dict):
    """A warm-up on ``TINY`` (so the peaks measured next are the model's, not code that runs for the first time), the
    seeding probe, then ``build_on_meta`` on ``MID`` the fresh way and the loaded way, each inside ``PeakMemory``; the
    loaded model takes one step on this rank's half of a batch, its full weights and gradients come back."""
    rss_follows_tensors()          # RSS follows the live tensors (coursekit.memory): peaks measured exactly
    for weights in (None, weight_files["tiny"]):     # the warm-up: the same code on TINY
        warm = build_on_meta(TINY, torch.device("cpu"), weights)
        F.cross_entropy(warm(ORACLE_BATCH[0][:2]), ORACLE_BATCH[1][:2]).backward()
        del warm
    probe = seeding_probe(build_on_meta)
    probe["gpu_worker"] = to_empty_devices(rank, build_on_meta)
    torch.use_deterministic_algorithms(True)         # uninitialised memory is NaN from here on
    try:
        with PeakMemory("cpu") as fresh_peak:
            model = build_on_meta(MID, torch.device("cpu"))
        facts = fresh_facts(model)
        del model
        with PeakMemory("cpu") as load_peak:
            model = build_on_meta(MID, torch.device("cpu"), weight_files["mid"])
    finally:
        torch.use_deterministic_algorithms(False)
    weights = {k: full(p).clone() for k, p in model.named_parameters()}
    share = len(META_BATCH[1]) // world_size
    mine = slice(rank * share, (rank + 1) * share)
    loss = F.cross_entropy(model(META_BATCH[0][mine]), META_BATCH[1][mine])
    loss.backward()
    grads = {k: full(p.grad).clone() for k, p in model.named_parameters()}
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    return dict(fresh=facts, fresh_peak=fresh_peak.bytes, load_peak=load_peak.bytes, weights=weights,
                grads=grads, loss=mean_loss.item() / world_size, probe=probe)


# ---- Exercise 6: shard_hybrid ----------------------------------------------------------------------------------

@contextlib.contextmanager
def recorded_collectives():
    """Records every collective FSDP2 calls on this rank: (name, global ranks of its group, bytes of its tensor)."""
    calls, real = [], {name: getattr(dist, name) for name in COLLECTIVES}

    def recording(name):
        def call(*args, **kwargs):
            bound = inspect.signature(real[name]).bind(*args, **kwargs).arguments
            tensor, group = bound[COLLECTIVES[name]], bound.get("group")
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
            calls.append((name, ranks, tensor.numel() * tensor.element_size()))
            return real[name](*args, **kwargs)
        return call

    with contextlib.ExitStack() as stack:
        for name in COLLECTIVES:
            stack.enter_context(mock.patch.object(dist, name, recording(name)))
        yield calls


def hybrid_facts(model) -> dict:
    """How this rank's parameters are laid out, read locally (no collective)."""
    params = dict(model.named_parameters())
    meshes = {p.device_mesh for p in params.values() if isinstance(p, DTensor)}
    mesh = next(iter(meshes)) if len(meshes) == 1 else None
    groups = [tuple(dist.get_process_group_ranks(mesh.get_group(d))) for d in range(mesh.ndim)] if mesh else []
    return dict(
        units=[isinstance(b, FSDPModule) for b in model.blocks] + [isinstance(model, FSDPModule)],
        placements=sorted({str(p.placements) if isinstance(p, DTensor) else "not a DTensor" for p in params.values()}),
        mesh_shape=tuple(mesh.shape) if mesh else f"{len(meshes)} meshes",
        groups=groups,          # per mesh dimension: the ranks of this rank's group along it
        local_fraction=sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params.values())
        / sum(p.numel() for p in params.values()))


def hybrid_step(rank, world_size, shard_hybrid, nodes, ranks_per_node, device: str = "cpu"):
    """Exercise 6 on this rank as ``nodes`` x ``ranks_per_node``: its layout, then one step on its quarter of the
    batch with every collective recorded; the loss (mean over ranks) and the full gradients."""
    env = dict(LOCAL_WORLD_SIZE=str(ranks_per_node), LOCAL_RANK=str(rank % ranks_per_node),
               GROUP_RANK=str(rank // ranks_per_node))
    with simulated_worker(rank, world_size, local_world_size=ranks_per_node), mock.patch.dict(os.environ, env):
        model = build_vit(TINY)
        model = shard_hybrid(model, torch.device(device), nodes, ranks_per_node) or model     # your Exercise 6 (shards in place)
    facts = hybrid_facts(model)
    images, labels = ORACLE_BATCH
    share = len(labels) // world_size
    mine = slice(rank * share, (rank + 1) * share)
    with recorded_collectives() as calls:
        loss = F.cross_entropy(model(images[mine]), labels[mine])
        loss.backward()
    facts["collectives"] = calls
    facts["grads"] = {name: full(p.grad).clone() for name, p in model.named_parameters()}
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    facts["loss"] = mean_loss.item() / world_size
    return facts


def mesh_device_types(rank, shard_hybrid):
    """Exercise 6 handed a GPU worker's device: the device types it asks init_device_mesh for (a CPU mesh is
    built in their place, so that the check runs on this CPU machine)."""
    import torch.distributed.device_mesh as device_mesh_module
    asked, real_init = [], device_mesh_module.init_device_mesh

    def standin(device_type, *args, **kwargs):
        asked.append(device_type)
        return real_init("cpu", *args, **kwargs)

    names = getattr(shard_hybrid, "__globals__", {})     # the notebook's names, where your function finds init_device_mesh
    with mock.patch.object(device_mesh_module, "init_device_mesh", standin), \
            mock.patch.dict(names, init_device_mesh=standin):
        shard_hybrid(build_vit(TINY), torch.device("cuda", rank % 2), 2, 2)
    return asked


def hybrid_on_rank(rank, world_size, shard_hybrid):
    """``shard_hybrid`` on both layouts of ``HYBRID_LAYOUTS``, then handed a GPU's device."""
    layouts = {name: hybrid_step(rank, world_size, shard_hybrid, *shape) for name, shape in HYBRID_LAYOUTS.items()}
    try:
        layouts["device types asked for"] = mesh_device_types(rank, shard_hybrid)
    except Exception as e:      # e.g. a mesh on "cuda:0" or a literal that this machine cannot build
        layouts["device types asked for"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return layouts


def traffic(facts, ranks_per_node) -> dict:
    """(collective, 'inside a node' or 'across nodes') -> [calls, bytes] from one rank's recorded collectives."""
    out = {}
    for name, ranks, size in facts["collectives"]:
        where = "inside a node" if len({r // ranks_per_node for r in ranks}) == 1 else "across nodes"
        entry = out.setdefault((name, where), [0, 0])
        entry[0] += 1
        entry[1] += size
    return out
