"""The single-process baseline of module 07: the module-05 ViT on handwritten digits, one process.

    python train_single.py --smoke-test

The other scripts of this folder are this file made distributed; module 07 counts the lines each
one changes (difflib) and measures all of them the same way (``coursekit.stepmeter.StepMeter``).
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from coursekit import detect
from coursekit.data import load_digits
from coursekit.models import ViT, accuracy
from coursekit.stepmeter import StepMeter
from coursekit.runtime import SIZES


def parse_args(argv=None) -> dict:
    rt = detect()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--global-batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--smoke-test", action="store_true", help="the smallest sizes (CI)")
    p.add_argument("--metrics-out", default=None, help="write losses, accuracy, throughput and memory here")
    p.add_argument("--checkpoint-dir", default=os.path.join(rt.storage_path, "07_scaling_up", "checkpoints"))
    args = p.parse_args(argv)
    sizes = SIZES["smoke"] if args.smoke_test else rt.sizes
    return {"epochs": args.epochs or sizes["epochs"], "lr": args.lr,
            "global_batch_size": args.global_batch_size or sizes["global_batch_size"],
            "train_samples": sizes["train_samples"], "test_samples": sizes["test_samples"],
            "vit": {k: sizes[f"vit_{k}"] for k in ("depth", "width", "heads", "patch")},
            "metrics_out": args.metrics_out, "checkpoint_dir": args.checkpoint_dir, "seed": 0}


def build_model(cfg: dict) -> ViT:
    torch.manual_seed(cfg["seed"])
    return ViT(**cfg["vit"])


def train(cfg: dict) -> dict:
    device = torch.device(detect().device)
    model = build_model(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    digits = load_digits(train=True, limit=cfg["train_samples"], quiet=True).dataset()
    batches = DataLoader(digits, batch_size=cfg["global_batch_size"], shuffle=True, drop_last=True,
                         generator=torch.Generator().manual_seed(cfg["seed"]))
    meter = StepMeter(warmup=2, steps=cfg.get("measure_steps", 8))
    losses = []
    for epoch in range(cfg["epochs"]):
        model.train()
        epoch_sums = torch.zeros(2, device=device)           # loss x samples, samples
        for inputs, targets in batches:
            inputs, targets = inputs.to(device), targets.to(device)
            loss = F.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            meter.tick(model, optimizer, len(targets))
            optimizer.step()
            epoch_sums += torch.tensor([loss.item() * len(targets), len(targets)], device=device)
        losses.append((epoch_sums[0] / epoch_sums[1]).item())
        print(f"epoch {epoch}: loss {losses[-1]:.4f}", flush=True)
        os.makedirs(cfg["checkpoint_dir"], exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                   os.path.join(cfg["checkpoint_dir"], "checkpoint.pt"))
    held_out = load_digits(train=False, limit=cfg["test_samples"], quiet=True)
    return {"losses": losses, "test_accuracy": accuracy(model, held_out.tensors, held_out.labels, device=device),
            **meter.results()}


if __name__ == "__main__":
    config = parse_args()
    results = train(config)
    print({k: v for k, v in results.items() if k != "memory"})
    if config["metrics_out"]:
        with open(config["metrics_out"], "w") as f:
            json.dump(results, f)
