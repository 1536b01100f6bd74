"""The judge: a small CNN classifier trained on the 8k MNIST split, used to score generated digits.

- prompted-class accuracy: the fraction of images generated for "a handwritten k" the judge calls k;
- Frechet distance on the judge's 128-d penultimate features (FID's formula with this judge in place
  of Inception): ||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2)).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Judge(nn.Module):
    """conv(16) -> pool -> conv(32) -> pool -> fc(128) [features] -> fc(10)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 7 * 7, 128)
        self.out = nn.Linear(128, 10)
        self.drop = nn.Dropout(0.3)

    def features(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.c1(x)), 2)  # (B, 16, 14, 14)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)  # (B, 32, 7, 7)
        return F.relu(self.fc(x.flatten(1)))  # (B, 128)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.drop(self.features(x)))


def _augment(x: Tensor, g: torch.Generator) -> Tensor:
    """Random shifts of up to 2 pixels (pad + crop)."""
    pad = F.pad(x, (2, 2, 2, 2), value=-1.0)
    dx, dy = torch.randint(0, 5, (2,), generator=g).tolist()
    return pad[:, :, dy:dy + 28, dx:dx + 28]


def train_judge(x: Tensor, y: Tensor, epochs: int = 6, batch: int = 128, lr: float = 2e-3, seed: int = 0,
                log=print) -> Judge:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = Judge()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * (len(x) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    t0, k = time.perf_counter(), 0
    for ep in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        for i in range(len(x) // batch):
            idx = perm[i * batch:(i + 1) * batch]
            loss = F.cross_entropy(model(_augment(x[idx], g)), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            k += 1
        log(f"judge epoch {ep + 1}/{epochs}: loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)")
    return model.eval()


@torch.no_grad()
def predict(judge: Judge, x: Tensor, batch: int = 500) -> tuple[Tensor, Tensor]:
    """(predicted labels (N,), penultimate features (N, 128))."""
    preds, feats = [], []
    for i in range(0, len(x), batch):
        f = judge.features(x[i:i + batch])
        feats.append(f)
        preds.append(judge.out(f).argmax(1))
    return torch.cat(preds), torch.cat(feats)


def frechet_distance(fa: Tensor, fb: Tensor) -> float:
    """Frechet distance between Gaussians fitted to two feature sets (N, D)."""
    from scipy import linalg

    a, b = fa.double().numpy(), fb.double().numpy()
    mu_a, mu_b = a.mean(0), b.mean(0)
    sa, sb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean, _ = linalg.sqrtm(sa @ sb, disp=False)
    covmean = covmean.real
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(sa + sb - 2 * covmean))


# the judge shipped with the package (98.5 % on the 2k held-out split), stored in fp16
SHIPPED_JUDGE = Path(__file__).resolve().parent / "pretrained" / "mnist_judge.safetensors"


def save_judge(judge: Judge, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write the weights: safetensors for a `.safetensors` path (optionally cast to `dtype`), else torch.save."""
    sd = {k: v if dtype is None else v.to(dtype) for k, v in judge.state_dict().items()}
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    else:
        torch.save(sd, path)


def load_judge(path: str | Path = SHIPPED_JUDGE) -> Judge:
    """A judge from `save_judge`'s file (weights only; fp16 files are cast to fp32); default: the shipped one."""
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        sd = load_file(str(path))
    else:
        sd = torch.load(path, weights_only=True)
    j = Judge()
    j.load_state_dict(sd)
    return j.eval()
