"""Module 07's baseline sharded with FSDP2 (module 05) under Ray Train.

    python train_ray_fsdp2.py --smoke-test                   # 2 CPU workers here
    python train_ray_fsdp2.py --num-workers 8 --use-gpu      # on a GPU cluster (RAY_ADDRESS or Anyscale)
    python train_ray_fsdp2.py --num-workers 8 --use-gpu --bf16   # bf16 compute, fp32 shards (as DeepSpeed --bf16)
    python train_ray_fsdp2.py --num-workers 16 --use-gpu --hsdp 8          # HSDP: 2 nodes of 8 GPUs
    python train_ray_fsdp2.py --num-workers 16 --use-gpu --tp 8            # TP in a node x FSDP2 across nodes
    python train_ray_fsdp2.py --num-workers 8 --use-gpu --activation-checkpointing
    python train_ray_fsdp2.py --smoke-test --no-checkpoints  # report the metrics only (see below)

fully_shard on every block, then the root, over a device mesh of the worker's device type; the
optimizer after sharding; every rank saves its shards with DCP and reports them. The options change
only the mesh and the blocks (module 05): --hsdp K shards within groups of K ranks (a node) and
replicates across them; --tp K splits each block's linear layers over K ranks (a node) with DTensor,
then FSDP2 shards over the data-parallel dimension; --activation-checkpointing keeps only each
block's input for the backward pass and recomputes the rest.

The per-epoch checkpoint (save_shards_and_report) is step 4 of the notebook's capstone: the course's copy
of this script leaves it to you (copy yours in from the notebook); until then run it with
--no-checkpoints, as the notebook's measurements do.

What a --tp K checkpoint holds: the fused qkv layer's output rows are all heads' q, then all k, then
all v. A plain ColwiseParallel would give each TP rank a contiguous block of those rows (the q of some
heads and the k of others): wrong. So tensor_parallel first permutes the rows (qkv_rows_by_rank) so
that each rank's block holds its own heads' q, k and v, and replaces the attention's forward by one
that reads the local heads. The checkpoints store qkv's weight and bias, and their AdamW moments, in
that permuted order, which depends on K: resume them only with the same --tp K. Loaded at another TP
degree or without TP, nothing fails (DCP loads the rows by position) and the attention silently mixes
the wrong heads' q, k and v. The full model gathered at the end of training is un-permuted
(torch.argsort of the permutation) before it is tested.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import ray.train
import ray.train.torch
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_data_loader

from coursekit import detect
from coursekit.data import load_digits
from coursekit.localmode import fit_trainer
from coursekit.models import ViT, accuracy
from coursekit.stepmeter import StepMeter
from coursekit.raysetup import init_ray, storage_path
from coursekit.runtime import SIZES
from coursekit.scaling import check_scaling, worker_resources


def parse_args(argv=None) -> dict:
    rt = detect()
    workers = worker_resources(rt)   # the cluster's workers (joined first), or this machine
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--smoke-test", action="store_true", help="the smallest sizes (CI)")
    p.add_argument("--metrics-out", default=None, help="write losses, accuracy, throughput and memory here")
    p.add_argument("--num-workers", type=int, default=workers.default_workers,
                   help="default: one per GPU of the cluster's workers, else 2")
    p.add_argument("--use-gpu", action=argparse.BooleanOptionalAction, default=workers.use_gpu,
                   help="one GPU per worker (default: yes where the cluster's workers have GPUs)")
    p.add_argument("--hsdp", type=int, default=0, metavar="K",
                   help="HSDP: shard within groups of K ranks (a node), replicate across the groups")
    p.add_argument("--tp", type=int, default=1, metavar="K", help="tensor parallelism over K ranks (a node) x FSDP2")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="keep only each block's input for the backward pass, recompute the rest")
    p.add_argument("--bf16", action="store_true",
                   help="bf16 compute and all-gathers, fp32 shards and gradient reduction (module 05's "
                        "MixedPrecisionPolicy; GPUs with bf16, as train_ray_deepspeed.py --bf16)")
    p.add_argument("--no-checkpoints", action="store_true",
                   help="report the metrics without a checkpoint (the course's copy leaves the checkpoint to you)")
    args = p.parse_args(argv)
    if args.hsdp and args.tp > 1:
        p.error("choose --hsdp or --tp: this script builds 2-D meshes, not 3-D ones")
    for flag, group in (("--hsdp", args.hsdp), ("--tp", args.tp)):
        if group and args.num_workers % group:
            p.error(f"{flag} {group} must divide --num-workers ({args.num_workers}): whole nodes of {group} ranks")
    sizes = SIZES["smoke"] if args.smoke_test else rt.sizes
    return {"epochs": args.epochs or sizes["epochs"], "lr": args.lr,
            "global_batch_size": args.global_batch_size or sizes["global_batch_size"],
            "train_samples": sizes["train_samples"], "test_samples": sizes["test_samples"],
            "vit": {k: sizes[f"vit_{k}"] for k in ("depth", "width", "heads", "patch")},
            "metrics_out": args.metrics_out, "seed": 0,
            "num_workers": args.num_workers, "use_gpu": args.use_gpu,
            "hsdp": args.hsdp, "tp": args.tp, "checkpointing": args.activation_checkpointing, "bf16": args.bf16,
            "checkpoints": not args.no_checkpoints}


def build_model(cfg: dict) -> ViT:
    torch.manual_seed(cfg["seed"])
    return ViT(**cfg["vit"])


def qkv_rows_by_rank(width: int, tp: int) -> torch.Tensor:
    """The order of qkv's output rows that gives each TP rank's contiguous chunk its own heads' q, k and v."""
    return torch.arange(3 * width).view(3, tp, width // tp).transpose(0, 1).reshape(-1)


def local_heads_attention(attn, x: torch.Tensor) -> torch.Tensor:
    """The ViT's attention on the heads this rank holds (-1: heads / tp of them), as torchtitan writes it."""
    b, t, _ = x.shape
    q, k, v = attn.qkv(x).view(b, t, 3, -1, attn.head_dim).permute(2, 0, 3, 1, 4)
    y = F.scaled_dot_product_attention(q, k, v)
    return attn.proj(y.transpose(1, 2).reshape(b, t, -1))


def tensor_parallel(model: ViT, tp_mesh) -> None:
    """Megatron's plan on every block: qkv and the MLP's first layer split by columns (heads, hidden units),
    proj and the MLP's second layer by rows; one all-reduce after each pair, forward and backward."""
    # the gathered full state dict of 2-D parameters (end of training) takes two all-gathers: torch says so, loudly
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    for block in model.blocks:
        attn = block.attn
        order = qkv_rows_by_rank(attn.qkv.in_features, tp_mesh.size())
        with torch.no_grad():   # rank r's rows: [q, k, v] of its heads; the checkpoints keep this order (docstring)
            attn.qkv.weight.copy_(attn.qkv.weight[order])
            attn.qkv.bias.copy_(attn.qkv.bias[order])
        attn.head_dim = attn.qkv.in_features // attn.heads
        attn.forward = functools.partial(local_heads_attention, attn)
        parallelize_module(block, tp_mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})


def checkpointed(block) -> None:
    """Activation checkpointing: the block keeps its input, and recomputes the rest in the backward pass."""
    forward = block.forward
    block.forward = lambda x: checkpoint(forward, x, use_reentrant=False)


def shard(model: ViT, cfg: dict, device: torch.device, world_size: int):
    """The options' mesh (module 05), then each block (checkpointed with --activation-checkpointing) and the root
    sharded over it (in bf16 with --bf16); returns the mesh of the data-parallel ranks."""
    hsdp, tp = cfg.get("hsdp", 0), cfg.get("tp", 1)
    options = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} \
        if cfg.get("bf16") else {}
    if hsdp:       # (nodes, ranks per node): sharded within a node, replicated across nodes
        ranks = init_device_mesh(device.type, (world_size // hsdp, hsdp), mesh_dim_names=("replicate", "shard"))
    elif tp > 1:   # (data parallel, tensor parallel): the TP group is a node's ranks
        mesh = init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh["tp"])
        ranks = mesh["dp"]
    else:
        ranks = init_device_mesh(device.type, (world_size,))     # one dimension: every rank holds a shard
    for layer in model.blocks:                               # one unit per block, gathered one at a time
        if cfg.get("checkpointing"):
            checkpointed(layer)
        fully_shard(layer, mesh=ranks, **options)
    fully_shard(model, mesh=ranks, **options)                # the root: embedding and head
    return ranks


def save_shards_and_report(model, optimizer, epoch: int, metrics: dict) -> None:
    """Every rank writes its own shards of the model and the optimizer with DCP, with the epoch, into a folder of
    its own, and reports it to Ray Train with the metrics (the capstone's step 4). With --tp K the qkv rows are
    stored permuted for K (the module's docstring): such a checkpoint resumes only with the same --tp K."""
    ### BEGIN SOLUTION
    with tempfile.TemporaryDirectory() as folder:        # every rank writes its shards, then reports them
        shards, optimizer_shards = get_state_dict(model, optimizer)
        dcp.save({"model": shards, "optimizer": optimizer_shards, "epoch": epoch}, checkpoint_id=folder)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))
    ### END SOLUTION


def train_func(cfg: dict) -> None:
    worker = ray.train.get_context()
    rank, world_size, device = worker.get_world_rank(), worker.get_world_size(), ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model(cfg).to(device)
    ranks = shard(model, cfg, device, world_size)
    tp = cfg.get("tp", 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])   # after sharding: it holds the shards
    digits = load_digits(train=True, limit=cfg["train_samples"], quiet=True).dataset()
    if tp > 1:     # the ranks of a TP group read the same batch: a sampler over the data-parallel ranks
        order = DistributedSampler(digits, num_replicas=ranks.size(), rank=ranks.get_local_rank(), seed=cfg["seed"])
        batches = DataLoader(digits, batch_size=cfg["global_batch_size"] // ranks.size(), sampler=order,
                             drop_last=True)
    else:
        batches = prepare_data_loader(DataLoader(digits, batch_size=cfg["global_batch_size"] // world_size,
                                                 shuffle=True, drop_last=True,
                                                 generator=torch.Generator().manual_seed(cfg["seed"])))
    meter = StepMeter(warmup=2, steps=cfg.get("measure_steps", 8))
    losses = []
    for epoch in range(cfg["epochs"]):
        if world_size > 1:                                   # the DistributedSampler prepare_data_loader added
            batches.sampler.set_epoch(epoch)
        model.train()
        epoch_sums = torch.zeros(2, device=device)           # loss x samples, samples
        for inputs, targets in batches:
            inputs, targets = inputs.to(device), targets.to(device)
            with meter.forward(model, len(targets)):             # measures the activations, once
                loss = F.cross_entropy(model(inputs).float(), targets)   # the loss in fp32, also under --bf16
            optimizer.zero_grad()
            loss.backward()
            meter.tick(model, optimizer, len(targets))
            optimizer.step()
            epoch_sums += torch.tensor([loss.item() * len(targets), len(targets)], device=device)
        dist.all_reduce(epoch_sums)
        losses.append((epoch_sums[0] / epoch_sums[1]).item())
        metrics = dict(epoch=epoch, loss=losses[-1])
        if epoch == cfg["epochs"] - 1:
            results = meter.results()
            memory_by_rank = [None] * world_size
            dist.all_gather_object(memory_by_rank, results.pop("memory"))
            held_out = load_digits(train=False, limit=cfg["test_samples"], quiet=True)
            gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:                                # the gathered full model, on rank 0 only
                for key in (key for key in gathered if tp > 1 and ".attn.qkv." in key):
                    gathered[key] = gathered[key][torch.argsort(qkv_rows_by_rank(cfg["vit"]["width"], tp))]
                plain = build_model(cfg)
                plain.load_state_dict(gathered)
                metrics["test_accuracy"] = accuracy(plain, held_out.tensors, held_out.labels)
            metrics.update(losses=losses, **results, memory_by_rank=memory_by_rank)
        if cfg.get("checkpoints", True):
            save_shards_and_report(model, optimizer, epoch, metrics)
        else:
            ray.train.report(metrics)


def main(argv=None) -> dict:
    rt = detect()
    cfg = parse_args(argv)
    if not rt.local_mode:   # a small machine (Binder) runs Ray Train's local mode on forked ranks: no Ray
        init_ray(rt)
    check_scaling(cfg["num_workers"], cfg["use_gpu"], global_batch_size=cfg["global_batch_size"])
    scaling = ScalingConfig(num_workers=cfg["num_workers"], use_gpu=cfg["use_gpu"],
                            resources_per_worker={"CPU": 1})   # a GPU worker gets its GPU too
    run = RunConfig(storage_path=storage_path(rt), name=time.strftime("07-ray-fsdp2-%Y%m%d-%H%M%S"))
    # no TorchConfig(backend=...): Ray Train picks NCCL when each worker has a GPU, else gloo
    trainer = TorchTrainer(train_func, train_loop_config=cfg, scaling_config=scaling, run_config=run)
    results = fit_trainer(trainer, rt).metrics   # trainer.fit(), or local mode where Ray does not fit
    print({k: v for k, v in results.items() if k != "memory_by_rank"})
    if cfg["metrics_out"]:
        with open(cfg["metrics_out"], "w") as f:
            json.dump(results, f)
    return results


if __name__ == "__main__":
    main()
