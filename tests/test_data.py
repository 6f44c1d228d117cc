"""The course data: MNIST when present, scikit-learn's digits offline."""
import os
import subprocess

import numpy as np
import torch

from helpers import PY

from coursekit.data import load_digits, normalize, write_mnist_idx


def test_offline_fallback_is_real_digits_in_mnist_shape(tmp_path, capsys):
    train = load_digits(train=True, data_dir=str(tmp_path))
    test = load_digits(train=False, data_dir=str(tmp_path))
    assert "scikit-learn" in capsys.readouterr().out  # a clear notice, once per call
    assert train.source == test.source == "sklearn-digits"
    assert train.images.shape[1:] == (28, 28) and train.images.dtype == torch.uint8
    assert len(train) + len(test) == 1797 and len(train) > 4 * len(test) - 10
    assert set(train.labels.tolist()) == set(range(10))
    # the digit sits in the middle 20x20 box, as in MNIST; the border is blank
    assert train.images[:, :4, :].max() == 0 and train.images[:, 8:20, 8:20].float().mean() > 20
    x = train.tensors
    assert x.shape == (len(train), 1, 28, 28) and x.dtype == torch.float32
    assert x.min() >= -1 and x.max() <= 1 and torch.isclose(x.min(), torch.tensor(-1.0))


def test_split_is_deterministic_and_disjoint(tmp_path):
    a, b = load_digits(True, data_dir=str(tmp_path), quiet=True), load_digits(True, data_dir=str(tmp_path), quiet=True)
    assert torch.equal(a.images, b.images)
    test = load_digits(False, data_dir=str(tmp_path), quiet=True)
    train_rows = {bytes(im.numpy()) for im in a.images}
    assert sum(bytes(im.numpy()) in train_rows for im in test.images) < 5  # a few sklearn duplicates at most


def test_limit_keeps_the_first_examples(tmp_path):
    d = load_digits(True, limit=100, data_dir=str(tmp_path), quiet=True)
    assert len(d) == 100 and len(d.dataset()) == 100


def test_normalisation_equals_torchvision_transform():
    from torchvision.transforms import Compose, Normalize, ToTensor

    img = np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8)
    expected = Compose([ToTensor(), Normalize((0.5,), (0.5,))])(img)
    assert torch.allclose(normalize(torch.from_numpy(img)[None])[0], expected)


def test_mnist_files_are_read_as_torchvision_reads_them(tmp_path, capsys):
    rng = np.random.default_rng(1)
    imgs = rng.integers(0, 256, (30, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 30)
    write_mnist_idx(tmp_path, imgs, labels, train=True)
    write_mnist_idx(tmp_path, imgs[:10], labels[:10], train=False)
    d = load_digits(train=True, data_dir=str(tmp_path))
    assert d.source == "mnist" and "scikit-learn" not in capsys.readouterr().out
    assert np.array_equal(d.images.numpy(), imgs) and np.array_equal(d.labels.numpy(), labels)
    t = load_digits(train=False, limit=5, data_dir=str(tmp_path))
    assert len(t) == 5 and np.array_equal(t.images.numpy(), imgs[:5])
    from torchvision.datasets import MNIST

    reference = MNIST(str(tmp_path), train=True, download=False)
    assert torch.equal(d.images, reference.data) and torch.equal(d.labels, reference.targets.long())
    assert d.labels.dtype == torch.int64


def test_training_ranks_load_the_data_without_sklearn_or_torchvision(tmp_path):
    """Each rank of a torchrun job loads the data: after the kernel's first load, neither the MNIST files nor the
    offline fallback (kept as .npy files) makes a rank import scikit-learn or torchvision (a Binder of 2 GiB holds
    a few such ranks)."""
    first = load_digits(train=True, data_dir=str(tmp_path / "offline"), quiet=True)   # the kernel: writes the cache
    rng = np.random.default_rng(2)
    for train in (True, False):
        write_mnist_idx(tmp_path / "mnist", rng.integers(0, 256, (12, 28, 28), dtype=np.uint8), rng.integers(0, 10, 12),
                        train=train)
    check = (
        "import sys, torch\n"
        "from coursekit.data import load_digits\n"
        f"offline = load_digits(train=True, data_dir={str(tmp_path / 'offline')!r}, quiet=True)\n"
        f"mnist = load_digits(train=False, data_dir={str(tmp_path / 'mnist')!r})\n"
        "assert offline.source == 'sklearn-digits' and mnist.source == 'mnist' and len(mnist) == 12\n"
        "torch.save(offline.images, sys.argv[1])\n"
        "print(sorted(m for m in ('sklearn', 'torchvision') if m in sys.modules))\n")
    out = subprocess.run([PY, "-c", check, str(tmp_path / "images.pt")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"a rank imported {out.stdout.strip()} to load the data"
    assert torch.equal(torch.load(tmp_path / "images.pt"), first.images), "the cached fallback is the same data"


def test_download_attempt_fails_fast_offline(tmp_path):
    import time

    start = time.perf_counter()
    d = load_digits(train=True, data_dir=str(tmp_path), download=True, quiet=True)
    assert d.source in {"mnist", "sklearn-digits"}
    assert time.perf_counter() - start < 120


def test_a_copy_of_module_03_writes_its_files_into_the_users_cache_not_the_course(tmp_path):
    """What Validate runs of module 03 from a copy of course/ (grading mode, the working directory the copy's
    folder): the digits' cache and the Parquet files go into the user's cache, nothing into the course's data/."""
    from coursekit.paths import REPO

    copy = tmp_path / "my-course" / "03_ray_data"
    copy.mkdir(parents=True)
    cache = tmp_path / "cache"
    notebook_cells = (   # the lines of the notebook that choose the folder and write there
        "import os, coursekit\n"
        "from coursekit.data import load_digits, write_digits_parquet\n"
        "rt = coursekit.detect()\n"
        "DATA_DIR = os.path.join(rt.data_dir, 'digits_files')\n"
        "train_digits = load_digits(train=True, limit=64, download=False, quiet=True)\n"
        "files = write_digits_parquet(train_digits, os.path.join(DATA_DIR, 'parquet-64'), num_files=2)\n"
        "print(rt.data_dir)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_DATA", "COURSE_STORAGE")}
    env.update(XDG_CACHE_HOME=str(cache), NBGRADER_EXECUTION="validate")
    out = subprocess.run([PY, "-c", notebook_cells], cwd=copy, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data_dir = out.stdout.strip().splitlines()[-1]
    assert data_dir == str(cache / "ray-train-course" / "data")
    assert not data_dir.startswith(str(REPO))
    assert sorted(p.name for p in (cache / "ray-train-course" / "data" / "digits_files" / "parquet-64").iterdir()) == [
        "digits-000.parquet", "digits-001.parquet"]
