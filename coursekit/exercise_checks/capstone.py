"""The visible checks of module 07's capstone (``train_func``: the colleague's script ported to FSDP2 under Ray Train).

They read what a test cell hands in about a run of your ``train_func`` (``describe`` in the notebook): each rank's
reports (metrics, and the checkpoint files by name and size), what the checks' probe saw on that rank (the bytes of
model state at the second optimizer step, the layers gathered at once, the meshes), the weights the run ended with
and its checkpoints read back. The notebook runs them for Validate; the grader runs them again, outside your
kernel, on the data handed in, with checks of its own.
"""
from __future__ import annotations

from coursekit.exercise_checks.ray_train import max_difference as largest_difference

PER_NODE = 2           # the check's runs: 2 nodes x 2 workers

# How far a correct port's weights end from the script's, as the largest relative difference of a tensor
# (|a - b| / |b|, Frobenius norms): the same reductions in another order, amplified by AdamW's normalised steps.
# Measured for the reference port (2 epochs, 4 ranks): 1.3e-7 to 4.2e-6 with torch at 1, 2 and 4 threads and MKL's
# and ATen's other code paths (MKL_CBWR=COMPATIBLE, the largest; ATEN_CPU_CAPABILITY=default/avx2), where the
# largest single weight moved 1.9e-5. The cheapest mistake measured, AdamW without its weight decay, moves 9.9e-4.
WEIGHTS_RTOL = 1e-4
# The losses: the same sums in another order; measured within 2e-7 of the script's (losses near 2), at 1 to 4 threads.
LOSS_TOLERANCE = 1e-5


def where(rank: int, per_node: int = PER_NODE) -> str:
    return f"worker {rank} (node {rank // per_node}, local rank {rank % per_node})"


def ran(run, how: str = "as 4 workers on 2 nodes x 2") -> dict:
    """The described run, or an AssertionError that says how it failed."""
    assert isinstance(run, dict), f"nothing was handed in about your train_func's run {how}"
    assert not run.get("error"), f"your train_func failed {how}:\n{run['error']}"
    assert isinstance(run.get("ranks"), list) and run["ranks"], f"your train_func's run {how} reported no rank"
    return run


def epochs(result: dict) -> list:
    """The epochs one rank reported, in order."""
    return [report["metrics"].get("epoch") for report in result["reports"]]


def max_difference(a: dict | None, b: dict) -> float:
    """The largest difference between two state dicts (AssertionError if their parameter names differ)."""
    assert a is not None, "the check saw no DigitNet compute: build the model with build_net(config) and train it"
    assert set(a) == set(b), f"the model has other parameter names than the script's: {sorted(a)[:2]}, {sorted(b)[:2]}"
    return largest_difference(a, b)


def relative_difference(a: dict | None, b: dict) -> float:
    """The largest relative difference |a - b| / |b| of a tensor of two state dicts (names checked as above)."""
    max_difference(a, b)
    return max(((a[k].float() - b[k].float()).norm() / b[k].float().norm().clamp_min(1e-12)).item() for k in a)


def check_matches(run: dict, reference: dict) -> float:
    """The run's final weights against the script's on one process (``reference``): returns the difference."""
    diff = relative_difference(ran(run)["weights"], reference)
    assert diff < WEIGHTS_RTOL, (f"after training, the weights differ from the script's by {diff:.1e} (relative; "
                                 f"rounding alone stays below {WEIGHTS_RTOL:.0e}): check the sharding (each layer, "
                                 "then the root), the optimizer (built after sharding), the per-worker batch and "
                                 "set_epoch")
    return diff


def check_losses(rank: int, reports: list, reference: list, per_node: int = PER_NODE) -> None:
    """One rank's reported losses against the script's, epoch by epoch."""
    for report, ref in zip(reports, reference):
        metrics = report["metrics"]
        loss = metrics.get("loss")
        assert isinstance(loss, (int, float)) and not isinstance(loss, bool), \
            f"{where(rank, per_node)}: report the loss as a number, not {loss!r}"
        assert abs(loss - ref) <= LOSS_TOLERANCE * max(1.0, abs(ref)), (
            f"{where(rank, per_node)} reported loss {loss:.6f} in epoch {metrics.get('epoch')}, the script {ref:.6f}: "
            "report the mean over all workers' examples (sum the loss x examples and the examples on every worker, "
            "all-reduce both), the same number on every worker")


def check_memory(run: dict, budget: int, whole_state: int) -> None:
    """Every rank's bytes of model state at its second optimizer step, within ``budget``."""
    for rank, result in enumerate(ran(run)["ranks"]):
        memory = result.get("memory")
        assert memory is not None, (f"{where(rank)}: the check saw no second optimizer step of your DigitNet (it counts "
                                    "the bytes there): train build_net(config)'s model with a torch optimizer")
        total = sum(memory.values())
        assert total <= budget, (
            f"{where(rank)} holds {total:,} bytes of model state ({memory}), over the budget of {budget:,}"
            + (": that is the whole model's state, as one process or a DDP worker holds it. Shard the model with "
               "fully_shard over all the ranks" if total >= 0.9 * whole_state else
               ": shard every layer and the root over all 4 ranks"))


def check_layers_sharded(run: dict) -> None:
    """Every parameter a DTensor, and fewer than all layers gathered at one moment."""
    for rank, result in enumerate(ran(run)["ranks"]):
        assert not result["unsharded"], (
            f"{where(rank)}: the parameters {result['unsharded'][:3]} are not sharded (not DTensors): fully_shard each "
            "layer, then the whole model")
        gathered, layers = result["layers_gathered"], result["layers"]
        assert len(gathered) < layers, (
            f"while the model computed, {where(rank)} held the full weights of the layers {gathered} at once, all "
            f"{layers} of them: make each of net.layers its own fully_shard unit with the defaults, then the root, so "
            "that a layer is gathered only while it computes")


def check_reported_checkpoints(run: dict, per_node: int = PER_NODE) -> None:
    """Every rank called DCP's collectives with the others, and reported a checkpoint every epoch."""
    for rank, result in enumerate(ran(run)["ranks"]):
        assert not result["alone"], result["alone"][0]
        missing = [report["metrics"].get("epoch") for report in result["reports"] if not report["files"]]
        assert not missing, (f"{where(rank, per_node)} reported the epochs {missing} without a checkpoint: every rank "
                             "holds other shards, so every rank writes and reports its own")


def check_resumed_epochs(resumed: dict, total_epochs: int) -> None:
    """Resumed from epoch 0's checkpoint, every rank reports the epochs after it."""
    for rank, result in enumerate(ran(resumed, "when Ray Train handed it its own checkpoint of epoch 0 "
                                           "(ray.train.get_checkpoint())")["ranks"]):
        assert epochs(result) == list(range(1, total_epochs)), (
            f"resumed from the checkpoint of epoch 0, {where(rank)} reported the epochs {epochs(result)}: continue "
            "with the epoch after the saved one")


# A rank other than 0, from the start of train_func to the model's first forward pass: its live tensors may rise by at
# most this multiple of the whole model's fp32 bytes. A rank that holds a whole copy of the model besides its shards
# reaches at least 1 + 1/4 = 1.25 (4 ranks). Measured with coursekit.memory.PeakTensorBytes (the CPU allocator's own
# events) for the check's DigitNet (596,776 bytes) on 4 ranks: built on the meta device and loaded from rank 0, 0.59 on
# ranks 1-3 in 63 of 66 (22 runs at 1 and 2 threads: a quarter of the model, its shards, and the largest whole tensor
# received, the embedding's weight, a third) and 0.69-0.81 in 3 (gloo let go of received layer weights late), 1.25 on
# rank 0; every rank building the whole model to load its shards from, 1.50. (A build whole on every rank, 1.05, is
# caught before: fully_shard meets allocated parameters.)
CONSTRUCTION_BOUND = 1.1


def check_built_on_meta(run: dict, model_bytes: int) -> None:
    """No rank but rank 0 held the whole model between the start of train_func and the first forward pass."""
    for rank, result in enumerate(ran(run)["ranks"]):
        peak = result.get("construction_peak")
        assert peak is not None, (f"{where(rank)}: the check saw no forward pass of your DigitNet, so no construction "
                                  "to measure: build the model with build_net(config) and train it")
        allocated = result.get("allocated_before_sharding")
        assert not allocated, (
            f"{where(rank)}: fully_shard met {allocated:,} parameter values already allocated: allocate nothing before "
            "the last fully_shard (the root's). Build the model where nothing is allocated; only its shards get memory")
        devices = result.get("to_empty_devices") or []
        assert None not in devices, (
            f"{where(rank)}: to_empty(device=None) allocates the shards on the default device, the CPU: on a GPU worker "
            "they must be on its GPU, ray.train.torch.get_device()")
        assert rank == 0 or peak <= CONSTRUCTION_BOUND * model_bytes, (
            f"{where(rank)}'s tensors rose by {peak:,} bytes before the model's first forward pass, "
            f"{peak / model_bytes:.2f} x the whole model ({model_bytes:,} bytes): only rank 0 may hold the whole "
            f"model (at most {CONSTRUCTION_BOUND} x on the others: its shards and what it receives). Build it where "
            "nothing is allocated, shard it, "
            "then allocate and fill only this rank's shards, from the script's weights on rank 0 (module 05, section 9)")
