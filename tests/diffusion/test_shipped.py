"""The trained MNIST pipeline shipped with the package: `scratchlm diffusion sample` works with no --model, and
the shipped judge (a CNN trained on real MNIST, independent of the pipeline) reads the prompted digits.

Seeded and few steps so the outcome is deterministic and fast; the thresholds sit below what was measured
(docs/diffusion.md gives the full evaluation: 300 images, 25 DDIM steps).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from scratchlm.diffusion.data import WORDS
from scratchlm.diffusion.judge import SHIPPED_JUDGE, load_judge, predict
from scratchlm.diffusion.pipeline import SHIPPED_MNIST, DiffusionPipeline

REPO = Path(__file__).resolve().parents[2]


def _tiles(png: Path, n: int, side: int = 28) -> torch.Tensor:
    """The n images of a one-row grid (2-px gaps) as (n, 1, side, side) in [-1, 1]."""
    from PIL import Image

    a = np.array(Image.open(png))
    return torch.stack([torch.from_numpy(a[:side, k * (side + 2):k * (side + 2) + side].copy())
                        for k in range(n)]).float().div(127.5).sub(1).unsqueeze(1)


def test_shipped_files_are_small_fp16_safetensors():
    weights = sorted(SHIPPED_MNIST.rglob("*.safetensors"))
    assert {p.parent.name for p in weights} == {"vae", "transformer", "text_encoder"}
    total = sum(p.stat().st_size for p in SHIPPED_MNIST.rglob("*") if p.is_file())
    assert total < 5 * 2**20, f"the shipped pipeline is {total / 2**20:.1f} MiB"
    from safetensors import safe_open

    for p in weights:
        with safe_open(str(p), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}, p  # noqa: SIM118 (safe_open)


def test_sample_with_no_model_uses_the_shipped_pipeline(tmp_path):
    out = tmp_path / "seven.png"
    proc = subprocess.run([sys.executable, "-m", "scratchlm", "diffusion", "sample", "--prompt", "a seven",
                           "--n", "4", "--steps", "10", "--out", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert "shipped" in proc.stderr and str(SHIPPED_MNIST) in proc.stderr  # says which model it used
    assert str(out) in proc.stdout  # and where the PNG went
    from PIL import Image

    assert Image.open(out).size == (4 * 30, 30)  # four 28x28 images with 2-px gaps
    pred, _ = predict(load_judge(SHIPPED_JUDGE), _tiles(out, 4))
    assert (pred == 7).sum().item() >= 3, pred.tolist()


def test_shipped_pipeline_draws_the_prompted_digits():
    pipe = DiffusionPipeline.from_pretrained(SHIPPED_MNIST)
    judge = load_judge()
    digits = [0, 1, 3, 7, 8]
    prompts = [f"a handwritten {WORDS[d]}" for d in digits for _ in range(4)]
    images = pipe(prompts, steps=10, guidance=3.0, seed=0)
    assert images.shape == (len(prompts), 1, 28, 28)
    pred, _ = predict(judge, images)
    want = torch.tensor([d for d in digits for _ in range(4)])
    acc = (pred == want).float().mean().item()
    assert acc >= 0.9, f"prompted-class accuracy {acc:.2f}: {pred.tolist()}"


def test_the_shipped_judge_reads_real_digits(data_dir):
    from scratchlm.diffusion.data import load_mnist

    x, y = load_mnist(data_dir / "images" / "mnist", "heldout")
    pred, _ = predict(load_judge(), x[:500])
    assert (pred == y[:500]).float().mean().item() >= 0.97
