"""The MNIST transformer classifier built from ad ops (CSE234 PA1): short runs in the default suite,
the full 8,000 / 2,000 runs (PA1 >= 50 %, best design >= 90 %) under `slow`."""

from __future__ import annotations

import gzip

import pytest
import torch

from scratchlm.autodiff.examples import mnist


@pytest.fixture(scope="module")
def mnist_dir(data_dir):
    return data_dir / "images" / "mnist"


def test_loader_reads_the_idx_files(mnist_dir):
    images, labels = mnist.load_mnist(mnist_dir)
    assert images.shape == (10_000, 28, 28) and images.dtype == torch.float32
    assert float(images.min()) >= 0.0 and float(images.max()) == 1.0
    assert labels.shape == (10_000,) and sorted(labels.unique().tolist()) == list(range(10))
    (xtr, ytr), (xte, yte) = mnist.split(images, labels, 8000, seed=0)
    assert len(xtr) == 8000 and len(xte) == 2000
    (xtr2, _), _ = mnist.split(images, labels, 8000, seed=0)
    assert torch.equal(xtr, xtr2)  # seeded


def test_loader_rejects_bad_files(tmp_path):
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"\x00\x00\x08\x01" + b"\x00" * 8))
    with pytest.raises(ValueError, match="magic 2049, expected 2051"):
        mnist.load_mnist(tmp_path)
    with pytest.raises(FileNotFoundError, match="MNIST file not found"):
        mnist.load_mnist(tmp_path / "nowhere")


def _cfg(mnist_dir, **kw):
    return mnist.MnistConfig(data_dir=mnist_dir, progress=False, **kw)


def test_best_design_short_run_learns(mnist_dir):
    result = mnist.train_mnist(_cfg(mnist_dir, design="best", epochs=2, limit_train=4000))
    assert result.train_losses[0] > 2.0 and sum(result.train_losses[-20:]) / 20 < 0.8
    assert result.test_accuracy >= 0.85, result.epoch_accuracies


def test_pa1_recipe_short_run_learns(mnist_dir):
    result = mnist.train_mnist(_cfg(mnist_dir, design="pa1", epochs=1, limit_train=2000))
    assert result.test_accuracy >= 0.25, result.epoch_accuracies  # chance is 10 %


def test_runs_are_seeded(mnist_dir):
    a = mnist.train_mnist(_cfg(mnist_dir, design="pa1", epochs=1, limit_train=300))
    b = mnist.train_mnist(_cfg(mnist_dir, design="pa1", epochs=1, limit_train=300))
    assert a.train_losses == b.train_losses and a.test_accuracy == b.test_accuracy


def test_cli(mnist_dir, tmp_path, capsys):
    png = tmp_path / "curve.png"
    rc = mnist.main(["--data-dir", str(mnist_dir), "--design", "pa1", "--epochs", "1", "--limit-train", "200",
                     "--no-progress", "--plot", str(png)])
    assert rc == 0 and "pa1: held-out accuracy" in capsys.readouterr().out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert mnist.main(["--data-dir", str(tmp_path / "missing"), "--no-progress"]) == 2
    assert "MNIST file not found" in capsys.readouterr().err


@pytest.mark.slow
def test_pa1_recipe_full_clears_pa1_bar(mnist_dir):
    result = mnist.train_mnist(_cfg(mnist_dir, design="pa1", epochs=20))
    assert result.test_accuracy >= 0.50, result.epoch_accuracies


@pytest.mark.slow
def test_best_design_full_reaches_90_percent(mnist_dir):
    result = mnist.train_mnist(_cfg(mnist_dir, design="best", epochs=6))
    assert result.test_accuracy >= 0.90, result.epoch_accuracies
