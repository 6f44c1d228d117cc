"""Run a function on N local processes joined in a torch.distributed process group.

This is what ``torchrun --nproc_per_node=N`` does for a script, for a function
defined in a notebook: each process gets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``,
joins the group, runs ``fn(rank, world_size, *args)`` and sends its return value
back. Used for small, fast experiments on the CPU (gloo) and by the exercise tests;
real training goes through ``torchrun`` or Ray Train.

On a machine without GPUs the processes are *forked*: they start in milliseconds and
inherit everything the notebook defined. Where the machine has a GPU, forking is unsafe
(the kernel's CUDA context and autograd's per-device threads do not survive a fork:
"CUDA error: initialization error", "Unable to handle autograd's threading in combination
with fork-based multiprocessing"), so the processes are *spawned* instead, with the GPUs
hidden from them, and the function travels by value with cloudpickle. Spawned processes
import torch again (a few seconds per call).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

from coursekit.runtime import settings


def free_port() -> int:
    """A TCP port on localhost that is free right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, backend: str | None, fn: Callable | bytes, args: tuple | None,
           results: "mp.Queue", timeout_s: float, local_world_size: int) -> None:
    code, stage = 0, "setup"
    try:
        if isinstance(fn, bytes):  # spawned: the function and its arguments come cloudpickled
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: before anything imports torch
            os.environ["DS_ACCELERATOR"] = "cpu"     # and DeepSpeed's CPU accelerator (a kernel on a GPU node set cuda)
            from ray import cloudpickle

            fn, args = cloudpickle.loads(fn)
        import torch
        import torch.distributed as dist

        # what torchrun sets, for `world_size // local_world_size` simulated nodes
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          LOCAL_RANK=str(rank % local_world_size), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(local_world_size), GROUP_RANK=str(rank // local_world_size))
        torch.set_num_threads(1)  # N processes share this machine's cores
        if backend is None:   # fn makes (and ends) the group itself from the environment, as under torchrun
            stage = "fn"
            value = pickle.dumps(fn(rank, world_size, *args))
            results.put((rank, "ok", value))
            return
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        try:
            stage = "fn"
            # Plain pickle bytes: torch would otherwise share tensors through file
            # descriptors that disappear when this process exits.
            value = pickle.dumps(fn(rank, world_size, *args))
            stage = "teardown"
            dist.barrier()  # nobody tears the group down while a peer still talks to it
            results.put((rank, "ok", value))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything, including SystemExit from the student's code
        results.put((rank, stage, traceback.format_exc()))
        code = 1
    finally:
        results.close()
        results.join_thread()
        # Leave without running the parent's atexit handlers (a forked Jupyter kernel has some).
        os._exit(code)


def start_method() -> str:
    """``fork`` where it is safe (no GPU visible to torch), else ``spawn``; ``COURSE_START_METHOD`` overrides."""
    forced = settings().start_method
    if forced:
        return forced
    import torch

    return "spawn" if torch.cuda.is_available() else "fork"


def run_distributed(fn: Callable[..., Any], world_size: int = 2, *args: Any, backend: str | None = "gloo",
                    timeout_s: float = 120.0, local_world_size: int | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results by rank.

    ``local_world_size`` processes count as one node (default: all of them): the environment
    gives each its ``LOCAL_RANK`` (``rank % local_world_size``), ``LOCAL_WORLD_SIZE`` and
    ``GROUP_RANK`` (the node) as torchrun does on several nodes. With ``backend=None`` the processes get
    only that environment and ``fn`` creates the process group itself (``init_method="env://"``), as a
    script started by torchrun does.

    Raises ``RuntimeError`` with the failing rank's traceback if any rank fails,
    and ``TimeoutError`` if the group does not finish in ``timeout_s`` (for
    example because one rank skipped a collective the others wait for)."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    local_world_size = local_world_size or world_size
    if world_size % local_world_size:
        raise ValueError(f"{world_size} processes do not fill nodes of {local_world_size}")
    method = start_method()
    if method == "fork":
        import torch._dynamo  # noqa: F401  DDP imports it lazily: once here, not in every forked process

        payload, fn_args = fn, args
    else:
        from ray import cloudpickle

        payload, fn_args = cloudpickle.dumps((fn, args)), None
    ctx = mp.get_context(method)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, backend, payload, fn_args, results, timeout_s,
                                                     local_world_size),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    by_rank: dict[int, Any] = {}
    failure: tuple[int, str, str] | None = None
    try:
        while len(by_rank) < world_size:
            try:
                # After a first failure, wait briefly for the rank whose own code failed:
                # its peers' errors ("connection reset") are only consequences.
                rank, stage, value = results.get(timeout=timeout_s if failure is None else 5)
            except queue.Empty:
                if failure is not None:
                    break
                raise TimeoutError(
                    f"the {world_size} processes did not finish within {timeout_s:.0f} s "
                    f"(ranks that answered: {sorted(by_rank)}); a rank may be waiting in a "
                    "collective that another rank never reached") from None
            if stage == "ok":
                by_rank[rank] = pickle.loads(value)
                continue
            if failure is None or (stage == "fn" and failure[1] != "fn"):
                failure = (rank, stage, value)
            if stage == "fn":
                break
        if failure is not None:
            rank, _, text = failure
            raise RuntimeError(f"rank {rank} of {world_size} failed:\n{text}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [by_rank[r] for r in range(world_size)]


def deepspeed_pytorch_ops_only() -> None:
    """Tell DeepSpeed that none of its optional C++ ops is available, so it never starts a compiler.

    DeepSpeed 0.19 JIT-compiles kernels (a shared-memory all-reduce on CPU, a CPU Adam) the first
    time they are used; with every op marked unavailable it takes its plain PyTorch paths (gloo or
    NCCL collectives, ``torch.optim.AdamW``). Call it in every process that runs DeepSpeed: the
    kernel, each Ray worker (inside the training function), each forked rank. Also keeps DeepSpeed's
    logger at WARNING and hides torch's deprecation warnings for the collectives DeepSpeed calls."""
    import logging
    import warnings

    import deepspeed
    import deepspeed.ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    deepspeed.ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed",
                            category=FutureWarning)
