"""Recording a notebook's key numbers, and the plots the notebooks show."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coursekit.runtime import settings


def record(name: str, value: Any) -> Any:
    """Remember a figure a notebook produced (final loss, accuracy, wall time...).

    When ``COURSE_RECORD`` names a JSON file (the tests and ``make course`` set
    it) the value is added to it, so tests can check what the notebook showed
    without parsing its output. Returns ``value`` unchanged."""
    path = settings().record_file
    if path:
        p = Path(path)
        data = json.loads(p.read_text()) if p.exists() and p.stat().st_size else {}
        data[name] = value
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(data, indent=1, default=float))
    return value


def plot_curves(curves: dict[str, list[float]], xlabel: str = "epoch", title: str = "", ax=None, x=None):
    """Line plot of one or more named curves (loss, accuracy) against the epoch or step (1, 2, ... or ``x``)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for label, ys in curves.items():
        ax.plot(list(x) if x is not None else range(1, len(ys) + 1), ys, marker="o", label=label)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def predictions_grid(model, digits, n: int = 9, seed: int = 0, device: str = "cpu"):
    """A 3x3 grid of test images with label and the model's prediction (as in the seeds)."""
    import math

    import matplotlib.pyplot as plt
    import torch

    from coursekit.data import normalize

    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(digits), generator=g)[:n]
    model.eval()
    with torch.no_grad():
        preds = model(normalize(digits.images[idx]).to(device)).argmax(1).cpu()
    cols = int(math.ceil(math.sqrt(n)))
    rows = int(math.ceil(n / cols))
    fig = plt.figure(figsize=(2.4 * cols, 2.6 * rows))
    for k, i in enumerate(idx.tolist()):
        ax = fig.add_subplot(rows, cols, k + 1)
        ok = int(preds[k]) == int(digits.labels[i])
        ax.set_title(f"label: {int(digits.labels[i])}; pred: {int(preds[k])}",
                     color="black" if ok else "#b00020")
        ax.axis("off")
        ax.imshow(digits.images[i], cmap="gray")
    fig.tight_layout()
    return fig
