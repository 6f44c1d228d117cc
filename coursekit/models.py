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


class Attention(nn.Module):
    """Multi-head self-attention, written out (no fused fast paths), deterministic."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"the ViT width ({width}) must be a multiple of the number of heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, w))


class Block(nn.Module):
    """A pre-norm transformer block: attention, then an MLP, each with a residual."""

    def __init__(self, width: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width), nn.GELU(),
                                 nn.Linear(mlp_ratio * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A small Vision Transformer for 1-channel 28x28 digits.

    ``blocks`` is a ModuleList of identical transformer blocks: the unit FSDP2
    shards one at a time. No dropout and no BatchNorm, so distributed training
    can be compared exactly with a single process."""

    def __init__(self, depth: int = 2, width: int = 64, heads: int = 4, patch: int = 7,
                 image: int = 28, channels: int = 1, num_classes: int = 10, mlp_ratio: int = 4):
        super().__init__()
        if image % patch:
            raise ValueError(f"the patch size ({patch}) must divide the image size ({image})")
        tokens = (image // patch) ** 2 + 1                  # patches + the class token
        self.patch_embed = nn.Conv2d(channels, width, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, width))
        self.pos_embed = nn.Parameter(torch.randn(tokens, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)          # [B, patches, width]
        x = torch.cat([self.cls_token.expand(len(x), 1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def build_small_cnn_bn(num_classes: int = 10) -> nn.Module:
    """``small_cnn`` with a BatchNorm after each convolution: a model whose training depends on its mode. In
    training mode (``model.train()``) BatchNorm normalises each batch with that batch's statistics and updates its
    running ones, counting the batches in ``num_batches_tracked``; in eval mode it uses the running ones and counts
    nothing. The grader trains it to see that a training loop trains in training mode."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),    # 8 x 14 x 14
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),  # 16 x 7 x 7
        nn.Flatten(),
        nn.Linear(16 * 7 * 7, num_classes),
    )


def build_vit(num_classes: int = 10, depth: int | None = None, width: int | None = None,
              heads: int | None = None, patch: int | None = None) -> nn.Module:
    """The course ViT; depth, width, heads and patch default to the runtime's size profile
    (tiny on CPU, ViT-Large-like on GPU)."""
    from coursekit.runtime import detect

    sizes = detect().sizes
    return ViT(depth=sizes["vit_depth"] if depth is None else depth,
               width=sizes["vit_width"] if width is None else width,
               heads=sizes["vit_heads"] if heads is None else heads,
               patch=sizes["vit_patch"] if patch is None else patch,
               num_classes=num_classes)


@torch.no_grad()
def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
             batch_size: int = 512, device: str | torch.device | None = None) -> float:
    """Fraction of correct predictions; puts the model in eval mode.

    The images go to ``device``, by default the device the model's parameters are on."""
    model.eval()
    if device is None:
        device = next(model.parameters()).device
    correct = 0
    for i in range(0, len(labels), batch_size):
        logits = model(images[i:i + batch_size].to(device))
        correct += (logits.argmax(1).cpu() == labels[i:i + batch_size].cpu()).sum().item()
    return correct / max(len(labels), 1)


MODELS = {"resnet18": build_resnet18, "small_cnn": build_small_cnn, "small_cnn_bn": build_small_cnn_bn,
          "vit": build_vit}


def build_model(name: str) -> nn.Module:
    """A course model by name: ``resnet18`` (the seeds' model), ``small_cnn`` (no BatchNorm), ``small_cnn_bn``
    (``small_cnn`` with BatchNorm) or ``vit``."""
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}") from None
