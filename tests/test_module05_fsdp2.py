"""Module 05 outside the notebook: FSDP2 on real gloo ranks equals one process, and shards memory by 1/N."""
import pytest
import torch
import torch.nn.functional as F

from coursekit.distributed import run_distributed
from coursekit.memory import ddp_bucket_bytes, rank_bytes
from coursekit.models import ViT, build_model

SHAPE = dict(depth=2, width=64, heads=4, patch=7)   # the smoke-size ViT
g = torch.Generator().manual_seed(1)
BATCH = (torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g))


def _sharded(world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = ViT(**SHAPE)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_grads(rank, world_size):
    import torch.distributed as dist

    model = _sharded(world_size)
    share = len(BATCH[1]) // world_size
    mine = slice(rank * share, (rank + 1) * share)
    loss = F.cross_entropy(model(BATCH[0][mine]), BATCH[1][mine])
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / world_size, {k: p.grad.full_tensor() for k, p in model.named_parameters()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_loss_and_gradients_equal_single_process(world_size):
    loss, grads = run_distributed(_fsdp_grads, world_size)[0]
    torch.manual_seed(0)
    ref = ViT(**SHAPE)
    ref_loss = F.cross_entropy(ref(BATCH[0]), BATCH[1])
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) < 1e-5
    assert set(grads) == {k for k, _ in ref.named_parameters()}
    assert max((grads[k] - p.grad).abs().max().item() for k, p in ref.named_parameters()) < 1e-5


def _bytes(rank, world_size, strategy):
    from torch.nn.parallel import DistributedDataParallel as DDP

    if strategy == "ddp":
        torch.manual_seed(0)
        model = DDP(ViT(**SHAPE))
    else:
        model = _sharded(world_size)
    optimizer = torch.optim.AdamW(model.parameters())
    F.cross_entropy(model(BATCH[0][:2]), BATCH[1][:2]).backward()
    optimizer.step()
    return {**rank_bytes(model, optimizer), "buckets": ddp_bucket_bytes(model)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_memory_per_rank_is_within_5_percent_of_one_nth(world_size):
    ddp = run_distributed(_bytes, world_size, "ddp")
    fsdp = run_distributed(_bytes, world_size, "fsdp2")
    assert all(r["buckets"] == r["params"] for r in ddp), "DDP's buckets: a second copy of every fp32 gradient"
    for kind in ("params", "grads", "optimizer"):
        assert len({r[kind] for r in ddp}) == 1, "DDP ranks hold identical full copies"
        full = ddp[0][kind] - (ddp[0]["buckets"] if kind == "grads" else 0)   # DDP's bucket copy is not sharded
        assert full > 0
        for r in fsdp:
            assert r[kind] <= 1.05 * full / world_size, (kind, r[kind], full / world_size)
        assert abs(sum(r[kind] for r in fsdp) - full) <= 0.01 * full, "the shards add up to one copy"


def test_vit_builder_follows_the_runtime_sizes(monkeypatch):
    monkeypatch.setenv("COURSE_SIZE", "smoke")
    model = build_model("vit")
    assert len(model.blocks) == 2 and model.head.in_features == 64
    with pytest.raises(ValueError, match="multiple of the number of heads"):
        ViT(width=30, heads=4)
    with pytest.raises(ValueError, match="patch size"):
        ViT(patch=5)
    assert ViT(**SHAPE)(BATCH[0][:3]).shape == (3, 10)


def _unit_options(rank, world_size):
    """What module 05's grader reads from FSDP2's internal state: the options each fully_shard unit was built with."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    plain, tuned = ViT(**SHAPE), ViT(**SHAPE)
    for block in plain.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(plain, mesh=mesh)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in tuned.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    fully_shard(tuned, mesh=mesh, mp_policy=policy)

    def options(unit):
        group = unit._get_fsdp_state()._fsdp_param_group
        return group.mp_policy.param_dtype, group.post_forward_mesh_info is not None

    return ([options(b) for b in plain.blocks], options(plain), [options(b) for b in tuned.blocks], options(tuned),
            tuned(BATCH[0][:2]).dtype)


def test_fsdp2_state_shows_each_units_options():
    # the module 05 notebook's hidden test for Exercise 1 relies on these private attributes (torch 2.14)
    plain_blocks, plain_root, tuned_blocks, tuned_root, logits_dtype = run_distributed(_unit_options, 2)[0]
    assert plain_blocks == [(None, True)] * 2 and plain_root == (None, True)
    assert tuned_blocks == [(torch.bfloat16, False)] * 2 and tuned_root == (torch.bfloat16, True)
    assert logits_dtype == torch.bfloat16


def _all_gathers(rank, world_size, per_block, options):
    """The all-gathers of one training step (after a first one), counted as module 05's questions 1 and 2 count them."""
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = ViT(**SHAPE)
    mesh = init_device_mesh("cpu", (world_size,))
    if per_block:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    optimizer = torch.optim.AdamW(model.parameters())

    def step():
        F.cross_entropy(model(BATCH[0][:4]), BATCH[1][:4]).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    sizes, real = [], dist.all_gather_single
    with mock.patch.object(dist, "all_gather_single", lambda out, *a, **k: sizes.append(out.numel()) or real(out, *a, **k)):
        step()
    return sizes, sum(p.numel() for p in model.parameters())


def test_fsdp2_all_gathers_per_step_as_module_05_counts_them():
    # FSDP2 gathers a unit's shards with dist.all_gather_single (torch 2.14): 3 units (2 blocks and the root)
    counts = {name: len(run_distributed(_all_gathers, 2, True, options)[0][0])
              for name, options in {"True": dict(reshard_after_forward=True), "False": dict(reshard_after_forward=False),
                                    "unset": {}}.items()}
    assert counts == {"True": 6, "False": 3, "unset": 5}, counts
    (per_block, whole), (root_only, _) = run_distributed(_all_gathers, 2, True, {})[0], \
        run_distributed(_all_gathers, 2, False, {})[0]
    assert len(root_only) == 1 and root_only[0] >= whole, (root_only, whole)   # the whole model at once (padded)
    assert max(per_block) < whole / 2, (per_block, whole)                       # at most one block at a time


def _save_both_ways(rank, world_size, root):
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model = _sharded(world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    F.cross_entropy(model(BATCH[0][:4]), BATCH[1][:4]).backward()
    optimizer.step()
    for name, options in (("sharded", StateDictOptions()), ("full", StateDictOptions(full_state_dict=True))):
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        dcp.save({"model": model_state, "optimizer": optim_state, "epoch": 1}, checkpoint_id=os.path.join(root, name))


def test_dcp_metadata_tells_a_sharded_save_from_a_gathered_one(tmp_path):
    """What module 05's hidden test of Exercise 2 reads: each tensor's chunks in .metadata and the file of each."""
    import torch.distributed.checkpoint as dcp

    run_distributed(_save_both_ways, 4, str(tmp_path))
    for name, chunks in (("sharded", 4), ("full", 1)):
        metadata = dcp.FileSystemReader(str(tmp_path / name)).read_metadata()
        files = {(i.fqn, tuple(i.offset or ())): info.relative_path for i, info in metadata.storage_data.items()}
        for key in ("model.head.weight", "optimizer.state.head.weight.momentum_buffer"):
            meta = metadata.state_dict_metadata[key]
            assert len(meta.chunks) == chunks, (name, key, meta.chunks)
            used = {files[(key, tuple(c.offsets))] for c in meta.chunks}
            assert len(used) == chunks, (name, key, used)       # sharded: one piece per rank's file; full: one file


def _hsdp_and_tp(rank, world_size):
    """One step of HSDP on a (2, 2) mesh with its collectives recorded, and one of TP x FSDP on a (dp, tp) mesh."""
    import logging
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = ViT(**SHAPE)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    calls, real = [], {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single", "all_reduce")}

    def recording(name):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            calls.append((name, tuple(dist.get_process_group_ranks(group)) if group is not None else None))
            return real[name](*args, **kwargs)
        return call

    mine = slice(rank * 2, (rank + 1) * 2)
    with mock.patch.multiple(dist, **{n: recording(n) for n in real}):
        loss = F.cross_entropy(model(BATCH[0][mine]), BATCH[1][mine])
        loss.backward()
    hsdp = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
    placements = {str(p.placements) for p in model.parameters()}

    torch.manual_seed(0)
    model = ViT(**SHAPE)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block.mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    node = rank // 2                                    # a TP group computes its node's half of the batch
    F.cross_entropy(model(BATCH[0][node * 4:(node + 1) * 4]), BATCH[1][node * 4:(node + 1) * 4]).backward()
    tp = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
    mlp = [p.to_local().numel() / p.numel() for k, p in model.named_parameters() if k.startswith("blocks.0.mlp.0.")]
    return calls, placements, hsdp, tp, mlp


def test_hsdp_gathers_inside_a_node_and_tp_x_fsdp_equals_one_process():
    # module 05 sections 10 and 13, and the hidden tests of Exercise 6, rely on these (torch 2.14, gloo)
    ranks = run_distributed(_hsdp_and_tp, 4, local_world_size=2)
    torch.manual_seed(0)
    ref = ViT(**SHAPE)
    F.cross_entropy(ref(BATCH[0]), BATCH[1]).backward()
    for rank, (calls, placements, hsdp, tp, mlp) in enumerate(ranks):
        node, local = rank // 2, rank % 2
        assert placements == {"(Replicate(), Shard(dim=0))"}, placements
        assert {g for n, g in calls if n != "all_reduce"} == {(2 * node, 2 * node + 1)}, calls     # inside the node
        assert {g for n, g in calls if n == "all_reduce"} == {(local, local + 2)}, calls           # across nodes
        for grads in (hsdp, tp):
            assert max((grads[k] - p.grad).abs().max().item() for k, p in ref.named_parameters()) < 1e-5
        assert mlp == [0.25, 0.25], mlp                 # TP (1/2) x FSDP (1/2)
