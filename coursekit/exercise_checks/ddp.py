"""Module 01's checks on plain data: what each rank read (``sharded_epochs``), the weights and losses of DDP steps
against one process (``train_step``), what a save wrote and when each rank returned (``save_checkpoint``)."""
from __future__ import annotations

import io

import torch
import torch.nn.functional as F

from coursekit.models import build_small_cnn

SAVE_WAIT_S = 2.5   # how long a rank that has returned waits for the others before the check reports them


# ---------------------------------------------------------------- sharded_epochs
# runs[rank][case][epoch] = that rank's batches in that epoch, each a list of example indices

def sampler_order(rank: int, world_size: int, n: int, epoch: int, seed: int) -> list[int]:
    """The indices DistributedSampler(shuffle=True, seed=seed) gives global rank `rank` of `world_size` in `epoch`,
    by torch's own rule (torch/utils/data/distributed.py, ``__iter__`` with drop_last=False): a permutation drawn
    from a generator seeded with seed + epoch, repeated from its start up to a multiple of world_size, then every
    world_size-th index from `rank` on (tests/test_module01_scripts.py compares it with the sampler)."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    order = torch.randperm(n, generator=generator).tolist()
    total = -(-n // world_size) * world_size
    order = (order * -(-total // n))[:total]
    return [int(i) for i in order[rank:total:world_size]]


def check_shards(runs: list, world_size: int, cases: list) -> None:
    """Every epoch each rank reads ceil(n / world_size) examples, in batches of batch_size (the last, smaller one
    kept); together the ranks read every example, each exactly once when n divides evenly."""
    assert len(runs) == world_size, f"{len(runs)} ranks reported, expected {world_size}"
    for c, (n, batch_size, epochs, _seed) in enumerate(cases):
        where = f"{n} examples on {world_size} process(es), batch_size={batch_size}"
        per_rank = -(-n // world_size)
        sizes = [batch_size] * (per_rank // batch_size) + ([per_rank % batch_size] if per_rank % batch_size else [])
        for rank in range(world_size):
            got = runs[rank][c]
            assert len(got) == epochs, (
                f"{where}: rank {rank} got {len(got)} epochs, expected {epochs}: yield (epoch, loader) once per epoch")
            for epoch, batches in enumerate(got):
                read = sum(len(b) for b in batches)
                assert read == per_rank, (
                    f"{where}: rank {rank} read {read} examples in epoch {epoch}, expected {per_rank} (its 1/"
                    f"{world_size} of the data, padded to equal shards): a DistributedSampler over the process group?")
                assert [len(b) for b in batches] == sizes, (
                    f"{where}: rank {rank}, epoch {epoch}: batches of {[len(b) for b in batches]} examples, expected "
                    f"{sizes} (batch_size examples per rank, the last, smaller batch kept)")
        for epoch in range(epochs):
            reads = [i for rank in range(world_size) for b in runs[rank][c][epoch] for i in b]
            missed = sorted(set(range(n)) - set(reads))
            assert not missed, (
                f"{where}, epoch {epoch}: no rank read the examples {missed}; together the ranks must read all of them")
            twice = sorted({i for i in reads if reads.count(i) > 1})
            assert n % world_size or not twice, (
                f"{where}, epoch {epoch}: the examples {twice} were read by more than one rank, expected disjoint shards")


def check_global_rank(runs: list, cases: list) -> None:
    """On 4 processes laid out as 2 nodes x 2, each rank reads in epoch 0 the examples that DistributedSampler gives
    its GLOBAL rank among the 4 (LOCAL_RANK is 0 or 1 on both nodes)."""
    assert len(runs) == 4, f"{len(runs)} ranks reported, expected 4"
    for c, (n, _batch_size, _epochs, seed) in enumerate(cases):
        for rank in range(4):
            got = sorted(i for b in runs[rank][c][0] for i in b)
            want = sorted(sampler_order(rank, 4, n, 0, seed))
            if got == want:
                continue
            local = rank % 2
            by_local = [sorted(sampler_order(local, 2, n, 0, seed)), sorted(sampler_order(local, 4, n, 0, seed))]
            hint = (f": the shard of LOCAL_RANK {local}. The sampler needs the GLOBAL rank and world size (the "
                    "process group's, or torchrun's RANK and WORLD_SIZE)" if got in by_local else "")
            raise AssertionError(
                f"{n} examples on 4 processes (2 nodes x 2): rank {rank} (LOCAL_RANK {local} on node {rank // 2}) read "
                f"{got} in epoch 0, expected {want}, the examples DistributedSampler gives global rank {rank} of 4{hint}")


def check_new_order_every_epoch(runs: list) -> None:
    """Each rank reads its shard in a new order in epoch 1 (the first case of the run)."""
    for rank, epochs in enumerate(runs):
        e0, e1 = ([i for b in batches for i in b] for batches in epochs[0][:2])
        assert e0 != e1, (
            f"rank {rank} read its shard in the same order in epoch 0 ({e0}) and in epoch 1 ({e1}), expected a new "
            "order every epoch: the sampler's set_epoch(epoch)")


def check_order(runs: list, world_size: int, cases: list) -> None:
    """Each rank reads its examples in the order DistributedSampler(shuffle=True, seed=seed) gives after
    set_epoch(epoch), for every epoch."""
    assert len(runs) == world_size, f"{len(runs)} ranks reported, expected {world_size}"
    for c, (n, _batch_size, epochs, seed) in enumerate(cases):
        for rank in range(world_size):
            orders = [[i for b in batches for i in b] for batches in runs[rank][c]]
            assert len(orders) == epochs, f"rank {rank} read {len(orders)} epochs, expected {epochs}"
            for epoch, order in enumerate(orders):
                want = sampler_order(rank, world_size, n, epoch, seed)
                if order == want:
                    continue
                where = f"{n} examples on {world_size} process(es), seed={seed}: rank {rank}, epoch {epoch}"
                assert not (epoch > 0 and order == orders[epoch - 1]), (
                    f"{where} read its examples in the order of epoch {epoch - 1} ({order}), expected a new order "
                    f"{want}: call the sampler's set_epoch(epoch) before each epoch is read")
                assert order != sampler_order(rank, world_size, n, epoch, 0), (
                    f"{where} read {order}, the order of seed 0, expected {want}: shuffle with the seed given")
                raise AssertionError(f"{where} read {order}, but DistributedSampler(shuffle=True, seed={seed}) "
                                     f"after set_epoch({epoch}) gives {want}")


# ---------------------------------------------------------------- train_step

def step_inputs(seed: int, steps: int, global_batch: int) -> tuple[dict, list]:
    """The starting weights and the global batches of a train_step check: the same from the same seed anywhere."""
    torch.manual_seed(seed)
    state0 = build_small_cnn().state_dict()
    batches = [(torch.randn(global_batch, 1, 28, 28), torch.randint(0, 10, (global_batch,))) for _ in range(steps)]
    return state0, batches


def check_weights(where: str, states: list, expected_state: dict) -> None:
    """Every rank's weights (a state dict per rank) within 1e-5 of one process trained on the whole batches."""
    for rank, state in enumerate(states):
        for k, v in expected_state.items():
            assert k in state, f"{where}, rank {rank}: the model has no {k}"
            diff = (state[k].float() - v.float()).abs().max().item()
            assert diff <= 1e-5, (
                f"{where}, rank {rank}: {k} differs from one process training on the whole batches by {diff:.2e}, "
                "expected at most 1e-5. Did the batch go through ddp_model (not ddp_model.module), with a mean loss, "
                "not scaled by the world size, and the gradients zeroed before each step?")


def check_losses(where: str, returned: list, expected_losses: list) -> None:
    """What train_step returned on each rank, each step ([type name, is a Python number, value]): the mean loss over
    all ranks' examples, as a float."""
    for rank, values in enumerate(returned):
        assert len(values) == len(expected_losses), (
            f"{where}, rank {rank}: {len(values)} values returned, expected one per step ({len(expected_losses)})")
        for step, ((kind, is_number, got), want) in enumerate(zip(values, expected_losses)):
            assert is_number, (
                f"{where}, rank {rank}, step {step}: train_step returned a {kind}, expected a Python float (train_ddp.py "
                "adds the losses up and writes them to JSON): tensor.item() gives one")
            assert isinstance(got, (int, float)) and abs(got - want) <= 1e-5 * max(1.0, abs(want)), (
                f"{where}, rank {rank}, step {step}: returned loss {got}, expected {want:.6f}, the mean loss over "
                "ALL ranks' examples: all-reduce this rank's loss and divide by the world size")


def check_device(seen: list, error: str | None) -> None:
    """train_step with the model and batch on the meta device (standing in for a GPU): it worked, and every
    collective it called got tensors on that device (``seen``: [collective, [devices]])."""
    assert error is None, (
        f"train_step failed with the model and the batch on another device than the CPU (the meta device, standing in "
        f"for a GPU): {error}. Expected it to work wherever the loss is: keep the copy of the loss on the loss's device")
    off = [(name, devices) for name, devices in seen if any(d != "meta" for d in devices)]
    assert not off, (
        f"train_step gave dist.{off[0][0]}() a tensor on {', '.join(d for d in off[0][1] if d != 'meta')} while the "
        "loss was on the meta device (standing in for cuda:LOCAL_RANK), expected the loss's device. A tensor made with "
        "torch.tensor(...) and no device= is on the CPU: on a GPU node the process group is NCCL's, which reduces GPU "
        "tensors only, and this all-reduce would fail. Copy the loss itself (loss.detach()) or pass device=loss.device")


# ---------------------------------------------------------------- save_checkpoint
# logs[rank] = that rank's events: {"t", "event": call | enter | leave | save | saved | raised | return | gave_up, ...}

def where_of(world_size: int, nodes: int) -> str:
    return f"{world_size} process(es)" + (f" on {nodes} nodes" if nodes > 1 else "")


def first(log: list, event: str) -> dict | None:
    return next((e for e in log if e["event"] == event), None)


def stuck(logs: list) -> list[int]:
    """The ranks that had not returned when another rank gave up waiting for them."""
    gave_up = [e["t"] for log in logs for e in log if e["event"] == "gave_up"]
    if not gave_up:
        return []
    return [r for r, log in enumerate(logs) if not any(e["event"] == "return" and e["t"] <= min(gave_up) for e in log)]


def raise_if_crashed(where: str, logs: list, error: str | None) -> None:
    """Your save_checkpoint raised, or the run failed for another reason than a rank the check stopped waiting for."""
    if error is None or stuck(logs):
        return
    raised = [(r, first(log, "raised")["error"]) for r, log in enumerate(logs) if first(log, "raised")]
    if raised:
        raise AssertionError(f"{where}: save_checkpoint raised on rank {raised[0][0]}: {raised[0][1]}")
    raise AssertionError(f"{where}: the check could not run save_checkpoint; the error:\n{error[-1500:]}")


def trained_reference() -> dict:
    """The weights every rank's DDP model holds when save_checkpoint is called: one Adam step from seed 0."""
    torch.manual_seed(0)   # the same model and batch on every rank
    reference = build_small_cnn()
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    F.cross_entropy(reference(torch.randn(4, 1, 28, 28)), torch.randint(0, 10, (4,))).backward()
    optimizer.step()
    return reference.state_dict()


def check_contents(where: str, files: list, logs: list, error: str | None, checkpoint: bytes | None) -> None:
    """The checkpoint file (its bytes) is a dict of state dicts and the epoch given (7) that a plain model and its
    Adam optimizer load, holding the trained weights."""
    raise_if_crashed(where, logs, error)
    assert "checkpoint.pt" in files and checkpoint is not None, (
        f"{where}: expected a checkpoint at the path given, found the files {files}")
    try:
        ckpt = torch.load(io.BytesIO(checkpoint), weights_only=True)   # tensors, dicts and plain values
    except Exception as e:
        why = next((line.strip() for line in str(e).splitlines() if "Unsupported global" in line), str(e)[:300])
        raise AssertionError(f"{where}: torch.load refuses the checkpoint ({type(e).__name__}: {why}); expected "
                             "state dicts and plain values, not the model or optimizer objects") from None
    assert isinstance(ckpt, dict) and {"model", "optimizer", "epoch"} <= set(ckpt), (
        f"{where}: expected a dict with the keys model, optimizer, epoch; got "
        f"{sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__}")
    assert not any(str(k).startswith("module.") for k in ckpt["model"]), (
        f"{where}: the model's keys start with 'module.' (DDP's wrapper), expected the keys of the plain model")
    assert ckpt["epoch"] == 7, f"{where}: expected the epoch given (7), got {ckpt['epoch']!r}"
    plain = build_small_cnn()
    try:
        plain.load_state_dict(ckpt["model"])
        optimizer = torch.optim.Adam(plain.parameters(), lr=1e-3)
        optimizer.load_state_dict(ckpt["optimizer"])
    except Exception as e:
        raise AssertionError(f"{where}: a plain build_small_cnn() and its Adam optimizer must load the checkpoint; "
                             f"{type(e).__name__}: {e}") from None
    assert optimizer.state and all("exp_avg" in s for s in optimizer.state.values()), (
        f"{where}: expected the optimizer's state (Adam's moments after one step), got an empty one")
    for k, v in trained_reference().items():
        assert torch.allclose(ckpt["model"][k], v, atol=1e-6), (
            f"{where}: the saved {k} differs from the trained weights by {(ckpt['model'][k] - v).abs().max():.2e}")


def check_writers(where: str, files: list, logs: list, error: str | None) -> None:
    """Global rank 0 alone called torch.save, and the checkpoint is the one file written."""
    raise_if_crashed(where, logs, error)
    writers = [r for r, log in enumerate(logs) if first(log, "save")]
    assert writers == [0], (
        f"{where}: ranks {writers} called torch.save, expected global rank 0 alone"
        + (" (LOCAL_RANK is 0 once on every node: the test needs the global rank)" if 0 in writers and len(writers) > 1
           else ""))
    assert files == ["checkpoint.pt"], f"{where}: expected one file, the checkpoint, found {files}"


def check_waited(where: str, world_size: int, logs: list, error: str | None) -> None:
    """Every rank returned, after joining a collective with the others, once rank 0's file was complete."""
    assert len(logs) == world_size, f"{where}: {len(logs)} ranks' logs, expected {world_size}"
    for r in stuck(logs):
        waiting = [e["op"] for e in logs[r] if e["event"] == "enter"]
        left = [e["op"] for e in logs[r] if e["event"] == "leave"]
        others = [o for o in range(world_size) if o not in stuck(logs)]
        joined = {o: [e["op"] for e in logs[o] if e["event"] == "leave"] for o in others}
        inside = (f"it entered dist.{waiting[-1]}() and never left: " if len(waiting) > len(left)
                  else "it was not in a collective (polling or waiting in a loop?); ")
        raise AssertionError(
            f"{where}: rank {r} had not returned from save_checkpoint {SAVE_WAIT_S:.0f} s after ranks {others}; {inside}"
            f"the other ranks joined {joined}. Expected every rank to join the same collective after rank 0's write: "
            "a collective that only some ranks reach waits forever")
    raise_if_crashed(where, logs, error)
    if world_size > 1:
        alone = [r for r, log in enumerate(logs) if not first(log, "leave")]
        assert not alone, (
            f"{where}: ranks {alone} returned without joining any collective with the other ranks, expected every rank "
            "to wait with one (a barrier). A rank that polls for the file can find it half written, and waits forever "
            "if rank 0 fails or writes to another node's disk")
    saved = first(logs[0], "saved")
    for r, log in enumerate(logs):
        returned = first(log, "return")
        assert returned is not None, f"{where}: rank {r} never returned from save_checkpoint"
        assert returned["complete"] and (saved is None or returned["t"] >= saved["t"]), (
            f"{where}: rank {r} returned before rank 0 had finished writing the checkpoint"
            + (f" ({saved['t'] - returned['t']:.2f} s before)" if saved else "")
            + ", expected every rank to return once the file is complete: wait for it after the write, not before")
