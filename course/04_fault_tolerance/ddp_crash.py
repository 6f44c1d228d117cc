"""Plain DDP under torchrun, where one worker dies: the whole job ends.

    torchrun --nproc_per_node=2 --max-restarts=0 ddp_crash.py --kill-at-step 3

Rank 1 sends itself SIGKILL at the chosen step (the same real process death as in
the Ray Train run of module 04). torchrun notices that a worker died, stops the
others and exits with an error: every step since the start is lost unless you wrote
checkpoints *and* the logic to resume from them, and somebody relaunches the job.
(``torchrun --max-restarts=N`` would relaunch all workers from the start of the
script; resuming from a checkpoint is still your code's job.)
"""
from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from coursekit import detect
from coursekit.data import load_digits
from coursekit.models import build_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kill-at-step", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    rt = detect()
    dist.init_process_group(rt.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if rt.use_gpu else "cpu")
    torch.manual_seed(0)
    model = DDP(build_model("small_cnn").to(device), device_ids=[device.index] if rt.use_gpu else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    data = load_digits(train=True, limit=64 * args.steps, quiet=True)
    x, y = data.tensors, data.labels
    for step in range(args.steps):
        if step == args.kill_at_step and rank == 1:
            print(f"rank {rank}: SIGKILL to my own process at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        lo = step * 64 + rank * 64 // world
        xb, yb = x[lo:lo + 64 // world].to(device), y[lo:lo + 64 // world].to(device)
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()  # rank 0 waits here for rank 1's gradients, which never come
        optimizer.step()
        print(f"rank {rank}: step {step} loss {loss.item():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
