"""Model builders shared by the notebooks, the scripts and the tests."""
from __future__ import annotations

import torch
from torch import nn


def build_resnet18(num_classes: int = 10) -> nn.Module:
    """ResNet18 for 1-channel 28x28 digits, as in the workshop seeds."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False)
    return model


def build_small_cnn(num_classes: int = 10) -> nn.Module:
    """A small CNN without BatchNorm.

    DDP averages gradients, so with equal shards a DDP step equals one
    single-process step on the full batch *exactly*, except for layers whose
    forward pass depends on the batch (BatchNorm). This model has none, which is
    why the exercises use it to check distributed results against a
    single-process reference."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.ReLU(),   # 8 x 14 x 14
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),  # 16 x 7 x 7
        nn.Flatten(),
        nn.Linear(16 * 7 * 7, num_classes),
    )


@torch.no_grad()
def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
             batch_size: int = 512, device: str | torch.device = "cpu") -> float:
    """Fraction of correct predictions; puts the model in eval mode."""
    model.eval()
    correct = 0
    for i in range(0, len(labels), batch_size):
        logits = model(images[i:i + batch_size].to(device))
        correct += (logits.argmax(1).cpu() == labels[i:i + batch_size]).sum().item()
    return correct / max(len(labels), 1)


MODELS = {"resnet18": build_resnet18, "small_cnn": build_small_cnn}


def build_model(name: str) -> nn.Module:
    """A course model by name: ``resnet18`` (the seeds' model) or ``small_cnn`` (no BatchNorm)."""
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}") from None
