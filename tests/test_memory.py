"""coursekit.memory: per-rank bytes of parameters, gradients and optimizer state (plain, DDP, FSDP2)."""
import math

import pytest
import torch

from coursekit.distributed import run_distributed
from coursekit.memory import (bar_chart, count_params, ddp_bucket_bytes, format_bytes, local_tensor, memory_table,
                              optimizer_state_bytes, padding_bytes, peak_device_bytes, rank_bytes)


def _step(model, optimizer):
    model(torch.randn(3, 5)).sum().backward()
    optimizer.step()


def test_plain_model_counts_full_tensors_and_adam_state():
    model = torch.nn.Linear(5, 3)   # 18 parameters
    optimizer = torch.optim.Adam(model.parameters())
    assert rank_bytes(model, optimizer) == {"params": 72, "grads": 0, "optimizer": 0}
    _step(model, optimizer)
    got = rank_bytes(model, optimizer)
    assert got["params"] == got["grads"] == 72
    # two fp32 moments per parameter, plus one scalar step counter per parameter tensor
    steps = sum(s["step"].numel() * s["step"].element_size() for s in optimizer.state.values())
    assert got["optimizer"] == 2 * 72 + steps
    assert count_params(model) == 18


def test_optimizer_state_counts_shared_tensors_once_and_different_views_apart():
    class State:  # an optimizer's state: a tensor kept under two names, and two views of one buffer
        def __init__(self, state):
            self.state = state

    moment = torch.zeros(3)
    assert optimizer_state_bytes(State({"a": {"exp_avg": moment, "again": moment}})) == 12
    buffer = torch.zeros(6)
    wide, narrow = buffer[2:3], buffer.view(torch.uint8)[5:6]   # bytes 8-11 and byte 5 of the buffer
    # (the old key, data_ptr() + storage_offset(), gave both 10 past the buffer's start: one was not counted)
    assert optimizer_state_bytes(State({"p": {"exp_avg": wide, "exp_avg_sq": narrow}})) == 4 + 1


def test_optimizer_wrappers_and_partitioned_tensors():
    model = torch.nn.Linear(5, 3)
    optimizer = torch.optim.Adam(model.parameters())
    _step(model, optimizer)

    class Wrapper:  # e.g. a DeepSpeed-style wrapper that keeps the real optimizer in .optimizer
        def __init__(self, inner):
            self.optimizer = inner

    assert optimizer_state_bytes(Wrapper(optimizer)) == optimizer_state_bytes(optimizer) > 0
    assert optimizer_state_bytes(None) == 0
    p = torch.nn.Parameter(torch.empty(0))
    p.ds_tensor = torch.zeros(7)  # a ZeRO-3-style partition
    assert local_tensor(p) is p.ds_tensor


def _measure(rank, world_size, strategy):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.ReLU(), torch.nn.Linear(9, 3))  # 9 rows: uneven
    if strategy == "ddp":
        model = DDP(model)
    else:
        fully_shard(model[0], mesh=init_device_mesh("cpu", (world_size,)))
        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.Adam(model.parameters())
    _step(model, optimizer)
    return {"strategy": strategy, "world_size": world_size, "rank": rank, **rank_bytes(model, optimizer),
            "padding": padding_bytes(model), "count": count_params(model)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_ranks_hold_local_shards(world_size):
    ddp = run_distributed(_measure, world_size, "ddp")
    fsdp = run_distributed(_measure, world_size, "fsdp2")
    n = 5 * 9 + 9 + 9 * 3 + 3
    assert all(r["count"] == n for r in ddp + fsdp), "count_params counts the global size"
    assert all(r["params"] == 4 * n and r["grads"] == 2 * 4 * n for r in ddp), "gradients + DDP's bucket copy"
    # the shards add up to the whole, and each rank holds its chunk of every dim-0 split
    assert sum(r["params"] for r in fsdp) == 4 * n
    assert sum(r["grads"] for r in fsdp) == 4 * n
    chunk = lambda rows, cols: [len(c) * cols for c in torch.arange(rows).chunk(world_size)] + [0] * world_size
    expected = [4 * (chunk(9, 5)[r] + chunk(9, 1)[r] + chunk(3, 9)[r] + chunk(3, 1)[r]) for r in range(world_size)]
    assert [r["params"] for r in fsdp] == expected
    # padding: every rank allocates ceil(rows / N) rows per parameter
    padded = 4 * (math.ceil(9 / world_size) * 6 + math.ceil(3 / world_size) * 10)
    assert all(r["params"] + r["padding"] == padded for r in fsdp)
    assert all(r["padding"] == 0 for r in ddp)
    table = memory_table(ddp + fsdp)
    assert list(table.columns)[-1] == "total" and len(table) == 2 * world_size


def _ddp_buckets(rank, world_size, bucket_view):
    from unittest import mock

    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(300, 300) for _ in range(3)]), gradient_as_bucket_view=bucket_view)
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(2):                                     # the reducer may rebuild its buckets after the first step
        model(torch.randn(3, 300)).sum().backward()
        optimizer.step()
    # with bucket views each .grad is a view into its bucket: their storages are the buckets DDP really allocated
    storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in model.parameters()}
    with mock.patch.object(DDP, "_get_ddp_logging_data", lambda self: {}):    # a torch without the private field
        try:
            ddp_bucket_bytes(model)
            refused = bucket_view                      # with bucket views nothing is read: 0, no error needed
        except RuntimeError as e:
            refused = "bucket sizes" in str(e)
    return {"bucket storage": sum(storages.values()), "buckets": ddp_bucket_bytes(model),
            **rank_bytes(model, optimizer), "n": count_params(model), "refused": refused}


@pytest.mark.parametrize("bucket_view", [False, True])
def test_ddp_buckets_count_with_the_gradients_unless_the_gradients_are_views(bucket_view):
    """DDP's buckets hold every gradient: with gradient_as_bucket_view the gradients are views into them (the
    buckets' storage, measured, is every gradient's bytes; counted once); without, the buckets are a second copy of
    the gradients, which rank_bytes counts in grads (as zero_rank_bytes counts DeepSpeed's gradient buffers)."""
    for r in run_distributed(_ddp_buckets, 2, bucket_view):
        assert r["params"] == 4 * r["n"]
        if bucket_view:
            assert r["bucket storage"] == 4 * r["n"], "the buckets hold one slot per gradient value"
        assert r["buckets"] == (0 if bucket_view else 4 * r["n"])
        assert r["grads"] == 4 * r["n"] + r["buckets"]
        assert r["refused"], "a torch that no longer reports the bucket sizes gets a clear error, not 0 bytes"
    assert ddp_bucket_bytes(torch.nn.Linear(3, 3)) == 0, "no DDP, no buckets"


def test_table_chart_and_formatting():
    import matplotlib

    matplotlib.use("Agg")
    rows = [dict(strategy=s, world_size=2, rank=r, params=100 * (2 - (s == "fsdp2")), grads=10, optimizer=20)
            for s in ("ddp", "fsdp2") for r in range(2)]
    table = memory_table(rows)
    assert table["total"].tolist()[0] == 230
    ax = bar_chart(table)
    assert len(ax.patches) == 3 * 2  # three stacked kinds for two strategies
    with pytest.raises(ValueError, match="optimizer"):
        memory_table([dict(strategy="ddp", world_size=1, rank=0, params=1, grads=1)])
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.50 KiB" and format_bytes(3 * 2**30) == "3.00 GiB"
    assert peak_device_bytes("cpu") is None


# --- DeepSpeed ZeRO (module 06) ---

def test_zero_bytes_follows_the_zero_paper():
    from coursekit.planner import zero_bytes

    psi, n = 7_500_000_000, 64          # the paper's example: 7.5B parameters on 64 GPUs
    total = lambda stage: sum(zero_bytes(psi, n, stage).values()) / 1e9
    assert total(0) == pytest.approx(120)            # (2 + 2 + 12) x Psi
    assert total(1) == pytest.approx(31.4, abs=0.05)  # 4 Psi + 12 Psi / N
    assert total(2) == pytest.approx(16.6, abs=0.05)  # 2 Psi + 14 Psi / N
    assert total(3) == pytest.approx(1.875)           # 16 Psi / N
    assert zero_bytes(1000, 4, 1, "fp32") == {"params": 4000, "grads": 4000, "optimizer": 3000}
    assert zero_bytes(1000, 4, 0, "fp32") == {"params": 4000, "grads": 4000, "optimizer": 8000}
    assert zero_bytes(1000, 4, 3, "fp32") == {"params": 1000, "grads": 1000, "optimizer": 3000}
    for bad in (dict(stage=4), dict(stage=1, precision="fp8"), dict(stage=1, world_size=0)):
        with pytest.raises(ValueError):
            zero_bytes(1000, **{"world_size": 2, **bad})


def _zero_measure(rank, world_size, stage):
    import deepspeed
    from coursekit.distributed import deepspeed_pytorch_ops_only

    from coursekit.memory import zero_rank_bytes

    deepspeed_pytorch_ops_only()   # no C++ op builds
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 40), torch.nn.ReLU(), torch.nn.Linear(40, 10))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "train_batch_size": 4 * world_size, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for micro in range(3):   # one full step (2 micro-batches), then a backward with the gradients alive
        engine.backward(engine(torch.randn(2, 20)).square().mean())
        if micro < 2:
            engine.step()
    return zero_rank_bytes(engine)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_zero_rank_bytes_counts_what_each_rank_holds(stage):
    from coursekit.planner import zero_bytes

    n = 20 * 40 + 40 + 40 * 10 + 10
    expected = zero_bytes(n, 2, stage, "fp32")
    for got in run_distributed(_zero_measure, 2, stage, timeout_s=120):
        for kind in ("params", "optimizer"):
            # flat buffers are padded to an alignment; the optimizer's step counters are tiny
            assert expected[kind] <= got[kind] <= expected[kind] * 1.02 + 64, (stage, kind, got, expected)
        # gradients: in DeepSpeed 0.19 stages 1 and 2 also keep references to the last step's gradient
        # tensors (``all_grad_tensors``) and bucket remainders: up to about one more full copy
        slack = 1.2 * 4 * n if stage in (1, 2) else 64
        assert expected["grads"] <= got["grads"] <= expected["grads"] + slack, (stage, got, expected)
        assert got["master"] == (0 if stage == 0 else pytest.approx(4 * n / 2, abs=64))


# --- peak memory of a piece of code (module 05: construction on the meta device) ---

def _peaks(rank, world_size):
    from coursekit.memory import PeakMemory, rss_follows_tensors

    took = rss_follows_tensors()
    warm = torch.ones(2**16)          # the allocator's first use, before measuring
    del warm
    with PeakMemory("cpu") as idle:
        pass
    with PeakMemory("cpu") as freed:
        x = torch.ones(2**24)         # 64 MiB, freed before the block ends
        del x
    with PeakMemory("cpu") as after:  # freed memory went back: a second block sees the same 64 MiB again
        y = torch.ones(2**24)
        del y
    with PeakMemory("cpu") as small:
        z = torch.ones(2**20)         # 4 MiB, kept
    return took, idle.bytes, freed.bytes, after.bytes, small.bytes, z.numel()


def test_peak_memory_measures_the_rise_of_the_rss_in_a_block():
    # on Linux: VmHWM reset through /proc/self/clear_refs; run in a fresh forked process, as the notebook does
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("VmHWM and clear_refs are Linux's")
    took, idle, freed, after, small, _ = run_distributed(_peaks, 1)[0]
    mib = 2**20
    assert took, "glibc's mallopt(M_MMAP_THRESHOLD) was refused"
    assert idle is not None and idle < 2 * mib, f"an empty block rose by {idle} bytes"
    assert 63 * mib <= freed < 72 * mib, f"a 64 MiB tensor freed inside the block: peak {freed / mib:.1f} MiB"
    assert 63 * mib <= after < 72 * mib, f"the same again after the first was freed: {after / mib:.1f} MiB"
    assert 3.9 * mib <= small < 6 * mib, f"a 4 MiB tensor: {small / mib:.1f} MiB"


def test_peak_memory_without_a_counter_and_on_cuda():
    from coursekit.memory import PeakMemory

    with mock_open_failing():
        with PeakMemory("cpu") as peak:
            pass
    assert peak.bytes is None
    if torch.cuda.is_available():
        with PeakMemory("cuda") as gpu:
            t = torch.ones(2**20, device="cuda")
            del t
        assert gpu.bytes >= 4 * 2**20


def mock_open_failing():
    """/proc missing (not Linux): opening its files fails."""
    import builtins
    from unittest import mock

    real = builtins.open

    def fake(path, *args, **kwargs):
        if str(path).startswith("/proc/self/"):
            raise OSError("no /proc here")
        return real(path, *args, **kwargs)

    return mock.patch("builtins.open", fake)


def test_peak_tensor_bytes_counts_live_tensors_alone_the_same_at_any_thread_count():
    """The rise of the live tensors' bytes: a freed tensor's bytes while it lived, nothing of what stayed from before
    the block, and the same figure at 1 and 2 threads (the export bound of module 05 relies on it)."""
    from coursekit.memory import PeakTensorBytes

    before = torch.ones(2**22)                      # 16 MiB allocated before the block: not counted
    figures = []
    for threads in (1, 2):
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with PeakTensorBytes() as peak:
                x = torch.ones(2**24)               # 64 MiB, freed inside
                del x
                y = torch.randn(300, 300) @ torch.randn(300, 300)
                del y
        finally:
            torch.set_num_threads(saved)
        figures.append(peak.bytes)
    assert figures[0] == figures[1] == 64 * 2**20
    assert before.numel() == 2**22
