"""The references the grader computes itself, in its own process (never taken from a kernel): the same code as
the notebooks' reference cells, which students read below the exercises (module 01's reference_steps, module 02's
and module 03's reference_train). Not in coursekit: a student's release must not hold a line of an answer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from coursekit.data import load_digits
from coursekit.models import build_model, build_small_cnn


def reference_steps(state_dict: dict, batches: list, lr: float, momentum: float = 0.0) -> tuple[dict, list]:
    """SGD steps of ONE process, each on a whole global batch: what DDP steps must reproduce.

    Returns the final weights and the loss of every step (measured before its update)."""
    model = build_small_cnn()
    model.load_state_dict(state_dict)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for images, labels in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)   # the mean over the whole global batch
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def reference_train_02(config: dict) -> dict:
    """Single-process training on the full global batch, in the distributed run's data order.

    Returns the final weights ("state") and each epoch's mean training loss ("losses")."""
    torch.manual_seed(config["seed"])
    model = build_model(config["model"])
    optimizer = (torch.optim.SGD if config["optimizer"] == "sgd" else torch.optim.Adam)(
        model.parameters(), lr=config["lr"])
    criterion = torch.nn.CrossEntropyLoss()
    dataset = load_digits(train=True, limit=config["train_samples"], quiet=True).dataset()
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True)  # one replica: plain randperm
    loader = DataLoader(dataset, batch_size=config["global_batch_size"], sampler=sampler, drop_last=True)
    losses = []
    for epoch in range(config["epochs"]):
        sampler.set_epoch(epoch)
        step_losses = []
        for images, labels in loader:
            loss = criterion(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / len(step_losses))  # every step sees global_batch_size examples
    return {"state": model.state_dict(), "losses": losses}


_references: dict = {}


def reference_for(config: dict) -> dict:
    """reference_train_02(config), once per config, on one thread (as each rank runs; faster for this small model)."""
    key = tuple(sorted(config.items()))
    if key not in _references:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _references[key] = reference_train_02(config)
        finally:
            torch.set_num_threads(threads)
    return _references[key]


def check_batchnorm_counts(state: dict, steps: int, where: str) -> None:
    """Every BatchNorm of a trained model's ``state`` counted ``steps`` batches (``num_batches_tracked``: it counts
    in training mode only, so a loop that trained some steps in eval mode counts fewer)."""
    tracked = sorted({int(v.item()) for k, v in state.items() if k.endswith("num_batches_tracked")})
    assert tracked == [steps], (
        f"{where}: its BatchNorm layers counted {tracked} batches, expected {steps} (one per step of every epoch): "
        "the model must train in training mode (model.train()) at every step, where BatchNorm normalises each batch "
        "with the batch's own statistics and updates its running ones. A model put in eval mode (model.eval(), or a "
        "helper that evaluates it, such as coursekit.models.accuracy) stays there until model.train() is called")


def reference_train_03(config: dict, epochs: list, per_worker_batch: int):
    """One process. `epochs[e][r]`: the rows (columns) worker r was sent in epoch e, in order. Each step trains
    on the global batch made of every worker's next `per_worker_batch` rows. Returns the final weights and each
    epoch's mean loss per example."""
    torch.manual_seed(config["seed"])
    model = build_model(config["model"])
    optimizer = (torch.optim.SGD if config["optimizer"] == "sgd" else torch.optim.Adam)(
        model.parameters(), lr=config["lr"])
    criterion = torch.nn.CrossEntropyLoss()
    losses = []
    for shards in epochs:
        total, count = 0.0, 0
        for start in range(0, len(shards[0]["label"]), per_worker_batch):
            images = torch.cat([torch.as_tensor(s["image"][start:start + per_worker_batch]) for s in shards])
            labels = torch.cat([torch.as_tensor(s["label"][start:start + per_worker_batch]) for s in shards])
            loss = criterion(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, count = total + loss.item() * len(labels), count + len(labels)
        losses.append(total / count)
    return model.state_dict(), losses


# -- module 07: the colleague's script (the notebook's section 5, which students read above the capstone) ----------

class _Block(torch.nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, hidden, bias=False)
        self.fc2 = torch.nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class DigitNet(torch.nn.Module):
    """Module 07's DigitNet, parameter for parameter (the same names, shapes and initialisation order)."""

    def __init__(self, width: int, depth: int, hidden: int):
        super().__init__()
        self.embed = torch.nn.Linear(28 * 28, width)
        self.layers = torch.nn.ModuleList(_Block(width, hidden) for _ in range(depth))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, images):
        x = self.embed(images.flatten(1))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def digitnet_params(config: dict) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in DigitNet(config["width"], config["depth"], config["hidden"]).parameters())


_CAPSTONE: dict = {}


def reference_capstone(config: dict) -> tuple[list, dict]:
    """Module 07's script on one process (CPU): each epoch's mean loss and the final weights (cached per config)."""
    import json

    from torch.utils.data import RandomSampler

    key = json.dumps(config, sort_keys=True)
    if key not in _CAPSTONE:
        torch.manual_seed(config["seed"])
        net = DigitNet(config["width"], config["depth"], config["hidden"])
        adamw = torch.optim.AdamW(net.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])
        train_set = load_digits(train=True, limit=config["train_samples"], quiet=True).dataset()
        order = torch.Generator()
        batches = DataLoader(train_set, batch_size=config["batch_size"],
                             sampler=RandomSampler(train_set, generator=order), drop_last=True)
        history = []
        for epoch in range(config["epochs"]):
            order.manual_seed(config["seed"] + epoch)
            loss_sum, seen = 0.0, 0
            for images, labels in batches:
                loss = F.cross_entropy(net(images), labels)
                adamw.zero_grad()
                loss.backward()
                adamw.step()
                loss_sum += loss.item() * len(labels)
                seen += len(labels)
            history.append(loss_sum / seen)
        _CAPSTONE[key] = (history, {k: v.detach().clone() for k, v in net.state_dict().items()})
    return _CAPSTONE[key]
