"""The course data: torchvision's MNIST when present, scikit-learn's digits offline."""
import numpy as np
import torch

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


def test_mnist_files_are_read_through_torchvision(tmp_path, capsys):
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


def test_download_attempt_fails_fast_offline(tmp_path):
    import time

    start = time.perf_counter()
    d = load_digits(train=True, data_dir=str(tmp_path), download=True, quiet=True)
    assert d.source in {"mnist", "sklearn-digits"}
    assert time.perf_counter() - start < 120
