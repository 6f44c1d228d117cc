"""Data files the released notebooks' checks read instead of code that would show an answer (instructors only).

    python -m autograder.fixtures          # (re)write them into solutions/; then `make assignments` releases them

Module 05's restore check (Exercise 3) needs a sharded checkpoint to restore. Made in the notebook, it would be
Exercise 2's answer written out (get_state_dict, then dcp.save) in a cell a student reads before answering; made by
the student's own Exercise 2, a wrong save would cost the restore's points. So the checkpoints are made here, with
the reference save, and shipped as files: ``solutions/05_fsdp2/fixtures/checkpoint_<N>_ranks_epoch_<E>/`` (DCP's
files, as N ranks write them; its ``.metadata`` renamed ``dcp.metadata``, since nbgrader releases no hidden file, and
named back by the notebook when it uses the checkpoint) and beside each ``...state.pt``, the saved run's full weights and SGD momentum
buffers (``torch.load(..., weights_only=True)``). The saved run is the notebook's ``shard_and_step``: TINY's ViT
(seed 0) sharded at the root over N ranks, one SGD step (momentum 0.9) on the first training batch split over the
ranks, its learning rate then set to ``SAVED_LR`` (as a schedule left it). Each case is the notebook's own
(4 ranks, epoch 2) or one the grader asks (``autograder.checks.fsdp05.ASKED``). tests/test_fixtures.py checks the
files against a fresh computation.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from autograder.paths import SOLUTIONS
from coursekit.exercise_checks.fsdp import fixture_name as checkpoint_name
from coursekit.faults.checkpoints import SHIPPED_METADATA as METADATA

FIXTURES = SOLUTIONS / "05_fsdp2" / "fixtures"


def checkpoint_cases() -> list[tuple[int, int]]:
    """(saved ranks, epoch) of every restore case: the notebook's and the grader's."""
    from autograder.checks import fsdp05

    cases = [(fsdp05.VISIBLE_RESTORE[0], fsdp05.VISIBLE_RESTORE[2])]
    cases += [(saved, epoch) for saved, _, epoch in fsdp05.ASKED["test_restore_checkpoint"]]
    return list(dict.fromkeys(cases))


def _save_rank(rank: int, world_size: int, directory: str, epoch: int):
    """One rank of the saved run (the notebook's shard_and_step, then the reference save of Exercise 2)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from autograder.checks.fsdp05 import SAVED_LR, train_batches
    from coursekit.exercise_checks.fsdp import TINY, build_vit

    model = fully_shard(build_vit({**TINY, "seed": 0}), mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=TINY["lr"], momentum=0.9)
    images, labels = train_batches()[0]
    share = len(labels) // world_size
    mine = slice(rank * share, (rank + 1) * share)
    F.cross_entropy(model(images[mine]), labels[mine]).backward()
    optimizer.step()
    for group in optimizer.param_groups:
        group["lr"] = SAVED_LR
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state, "epoch": epoch}, checkpoint_id=directory)

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t.detach()).clone()

    weights = {k: full(v) for k, v in model.state_dict().items()}
    buffers = {f"{name}.{k}": full(v) for name, p in model.named_parameters()
               for k, v in optimizer.state[p].items() if torch.is_tensor(v)}
    dist.barrier()
    return {"weights": weights, "optimizer": buffers}


def make(out: Path = FIXTURES) -> list[Path]:
    """Write every restore case's checkpoint and saved state into ``out``; return the folders written."""
    import torch

    from coursekit.distributed import run_distributed

    written = []
    out.mkdir(parents=True, exist_ok=True)
    for saved_ranks, epoch in checkpoint_cases():
        directory = out / checkpoint_name(saved_ranks, epoch)
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        state = run_distributed(_save_rank, saved_ranks, str(directory), epoch, local_world_size=1, timeout_s=120)[0]
        (directory / ".metadata").rename(directory / METADATA)
        torch.save(state, out / f"{directory.name}.state.pt")
        written.append(directory)
    return written


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for directory in make():
        print(f"wrote {directory.relative_to(SOLUTIONS.parent)} ({len(list(directory.iterdir()))} files) and its "
              f"{directory.name}.state.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
