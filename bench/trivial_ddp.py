"""torchrun's side of the fixed-cost comparison: the trivial 2-process job.

    torchrun --standalone --nproc_per_node 2 -m bench.trivial_ddp OUT.json

Each process records when it started (before importing torch), then joins a gloo process group,
meets the other at a barrier and exits; rank 0 writes the timestamps."""
import json
import sys
import time

t_start = time.time()

import torch.distributed as dist  # noqa: E402

t_imported = time.time()
dist.init_process_group("gloo")
t_group = time.time()
dist.barrier()
t_barrier = time.time()
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"t_start": t_start, "t_imported": t_imported, "t_group": t_group, "t_barrier": t_barrier}, f)
dist.destroy_process_group()
