"""The course's images: MNIST when it is available, a real offline fallback when not.

MNIST comes through ``torchvision.datasets.MNIST`` from the data directory (or a
download into it). Where there is no internet (Binder with egress blocked, CI,
this course's test machines) the fallback is scikit-learn's handwritten digits
(1,797 real 8x8 scans that ship inside scikit-learn), placed on MNIST's 28x28
canvas the way MNIST itself was made (digit in a 20x20 box, centred) and
normalised exactly like the seeds' ``Normalize((0.5,), (0.5,))``.

Both sources return the same thing: a :class:`Digits` with uint8 images for
plotting and normalised float tensors for training.

The same digits as real files, for the data-loading modules: Parquet
(``write_digits_parquet``) and an image folder, one sub-folder per label
(``write_digits_image_folder``).
"""
from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

MEAN, STD = 0.5, 0.5  # the seeds' Normalize((0.5,), (0.5,))


@dataclasses.dataclass
class Digits:
    """One split of the course data."""

    images: torch.Tensor   # uint8 [N, 28, 28], for plotting
    labels: torch.Tensor   # int64 [N]
    source: str            # "mnist" or "sklearn-digits"

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def tensors(self) -> torch.Tensor:
        """Float32 [N, 1, 28, 28], scaled to [0, 1] then normalised with mean=std=0.5."""
        return normalize(self.images)

    def dataset(self) -> TensorDataset:
        """A map-style dataset of (image, label) pairs ready for a DataLoader."""
        return TensorDataset(self.tensors, self.labels)


def normalize(images_uint8: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 28, 28] -> float32 [N, 1, 28, 28], same as ToTensor() + Normalize(0.5, 0.5)."""
    x = images_uint8.to(torch.float32).div(255.0).unsqueeze(1)
    return (x - MEAN) / STD


def _mnist_present(root: Path) -> bool:
    raw = root / "MNIST" / "raw"
    return all((raw / f"{stem}-ubyte").exists() for stem in (
        "train-images-idx3", "train-labels-idx1", "t10k-images-idx3", "t10k-labels-idx1"))


def _try_download(root: Path, timeout_s: float = 10.0) -> bool:
    """Download MNIST into root; False (quickly) where there is no internet."""
    from torchvision.datasets import MNIST

    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout_s)
    try:
        MNIST(str(root), train=True, download=True)
        MNIST(str(root), train=False, download=True)
        return True
    except Exception:
        return False
    finally:
        socket.setdefaulttimeout(old)


def _read_idx(path: Path) -> np.ndarray:
    """An array from MNIST's idx format (big-endian dimensions, then uint8 data), without torchvision: each
    rank that loads the data then imports only numpy and torch."""
    data = path.read_bytes()
    ndim = data[3]
    dims = np.frombuffer(data, ">i4", count=ndim, offset=4)
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _load_mnist(root: Path, train: bool) -> Digits:
    raw, prefix = root / "MNIST" / "raw", "train" if train else "t10k"
    images = torch.from_numpy(_read_idx(raw / f"{prefix}-images-idx3-ubyte").copy())
    labels = torch.from_numpy(_read_idx(raw / f"{prefix}-labels-idx1-ubyte").astype(np.int64))
    return Digits(images=images, labels=labels, source="mnist")


def _sklearn_digits(train: bool, seed: int = 0, cache: Path | None = None) -> Digits:
    """scikit-learn's digits on MNIST's canvas. With ``cache`` (a folder), the result is kept there as .npy files
    the first time, so that later loads (every training rank) need not import scikit-learn."""
    name = "train" if train else "test"
    if cache is not None:
        try:
            return Digits(images=torch.from_numpy(np.load(cache / f"{name}-images.npy")),
                          labels=torch.from_numpy(np.load(cache / f"{name}-labels.npy")), source="sklearn-digits")
        except (OSError, ValueError):
            pass
    from sklearn.datasets import load_digits

    bunch = load_digits()
    imgs = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)  # [N,1,8,8] in [0,1]
    # MNIST's recipe: the digit fills a 20x20 box centred on a 28x28 canvas.
    imgs = torch.nn.functional.interpolate(imgs, size=(20, 20), mode="bilinear", align_corners=False)
    imgs = torch.nn.functional.pad(imgs, (4, 4, 4, 4))
    images = (imgs.squeeze(1).clamp(0, 1) * 255).round().to(torch.uint8)
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    # A fixed, stratification-free split: 80 % train, 20 % test.
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(labels))
    idx = order[:cut] if train else order[cut:]
    digits = Digits(images=images[idx], labels=labels[idx], source="sklearn-digits")
    if cache is not None:
        try:   # written whole, then renamed: a rank reading it meanwhile sees no file, never half of one
            cache.mkdir(parents=True, exist_ok=True)
            for part, value in (("images", digits.images), ("labels", digits.labels)):
                tmp = cache / f".{name}-{part}.{os.getpid()}.npy"
                np.save(tmp, value.numpy())
                os.replace(tmp, cache / f"{name}-{part}.npy")
        except OSError:
            pass
    return digits


def load_digits(train: bool = True, limit: int | None = None, data_dir: str | None = None,
                download: bool = False, quiet: bool = False) -> Digits:
    """The course data set: MNIST if present (or downloadable), else scikit-learn's digits.

    ``limit`` keeps the first ``limit`` examples (the sizes come from the runtime).
    ``download=True`` tries the internet once, with a short timeout. Training
    workers call this with ``download=False``: only the driver downloads.
    """
    if data_dir is None:
        from coursekit.runtime import detect

        data_dir = detect().data_dir
    root = Path(data_dir)
    if not _mnist_present(root) and download:
        root.mkdir(parents=True, exist_ok=True)
        _try_download(root)
    if _mnist_present(root):
        digits = _load_mnist(root, train)
    else:
        if not quiet:
            print(f"MNIST is not available offline in {root}; using scikit-learn's handwritten "
                  "digits on MNIST's 28x28 canvas instead (same shapes, same normalisation).")
        digits = _sklearn_digits(train, cache=root / "sklearn-digits")
    if limit is not None and limit < len(digits):
        digits = Digits(digits.images[:limit], digits.labels[:limit], digits.source)
    return digits


def write_mnist_idx(root: str | Path, images: np.ndarray, labels: np.ndarray, train: bool) -> None:
    """Write images/labels in MNIST's idx format where torchvision looks for them.

    Used by the tests (and by anyone who wants to bring their own digits)."""
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    prefix = "train" if train else "t10k"
    images = np.asarray(images, dtype=np.uint8)
    labels = np.asarray(labels, dtype=np.uint8)
    n, h, w = images.shape
    with open(raw / f"{prefix}-images-idx3-ubyte", "wb") as f:
        f.write(np.array([0x00000803, n, h, w], dtype=">i4").tobytes())
        f.write(images.tobytes())
    with open(raw / f"{prefix}-labels-idx1-ubyte", "wb") as f:
        f.write(np.array([0x00000801, n], dtype=">i4").tobytes())
        f.write(labels.tobytes())


# -- the course digits as files ------------------------------------------------------------


def write_digits_parquet(digits, folder: str | Path, num_files: int = 4) -> list[Path]:
    """Write ``digits`` (a coursekit.data.Digits) as ``num_files`` Parquet files.

    Columns: ``image`` (uint8 28x28, stored as Ray's tensor extension type, so
    ``ray.data.read_parquet`` gives it back as an ndarray column), ``label`` (int64) and
    ``id`` (the row's index in ``digits``, to check later which rows arrived where).
    Existing ``*.parquet`` files in ``folder`` are replaced."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.extensions import ArrowTensorArray

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.parquet"):
        old.unlink()
    images = digits.images.numpy() if hasattr(digits.images, "numpy") else np.asarray(digits.images)
    labels = digits.labels.numpy() if hasattr(digits.labels, "numpy") else np.asarray(digits.labels)
    if len(images) == 0:
        raise ValueError("no digits to write")
    num_files = max(1, min(int(num_files), len(images)))
    paths = []
    for i, idx in enumerate(np.array_split(np.arange(len(images)), num_files)):
        table = pa.table({"image": ArrowTensorArray.from_numpy(np.ascontiguousarray(images[idx])),
                          "label": pa.array(labels[idx].astype(np.int64)),
                          "id": pa.array(idx.astype(np.int64))})
        path = folder / f"digits-{i:03d}.parquet"
        pq.write_table(table, path)
        paths.append(path)
    return paths


def write_digits_image_folder(digits, folder: str | Path) -> Path:
    """Write ``digits`` as grayscale PNG files, ``folder/<label>/<index>.png`` (torchvision's ImageFolder layout)."""
    from PIL import Image

    folder = Path(folder)
    images = digits.images.numpy() if hasattr(digits.images, "numpy") else np.asarray(digits.images)
    labels = digits.labels.numpy() if hasattr(digits.labels, "numpy") else np.asarray(digits.labels)
    for i, (img, label) in enumerate(zip(images, labels)):
        sub = folder / str(int(label))
        sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.asarray(img, dtype=np.uint8), mode="L").save(sub / f"{i:05d}.png")
    return folder


def require_files(folder: str | Path, pattern: str, what: str) -> list[Path]:
    """The files matching ``pattern`` in ``folder``, or a FileNotFoundError that says how to make them."""
    folder = Path(folder)
    files = sorted(folder.rglob(pattern)) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(
            f"No {what} ({pattern}) in {folder}. Run the cell that writes the course digits to disk "
            "first (write_digits_parquet / write_digits_image_folder), or point the path at your data.")
    return files
