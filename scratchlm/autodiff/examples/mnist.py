"""A transformer classifier on MNIST built only from `scratchlm.autodiff` ops (CSE234 PA1, part 2).

Each 28x28 image is a sequence of 28 rows of 28 features. Two designs, both one layer:

- ``pa1``: PA1's recipe: single-head attention (model_dim 128), layernorm, ReLU feed-forward, mean over
  the sequence, SGD lr 0.02, batch 50, uniform init ±1/sqrt(num_classes).
- ``best``: input projection + learned positions, a pre-norm residual block with 4-head attention and a
  ReLU MLP, final layernorm, mean pooling, and Adam; Adam's update is itself an ad graph.

The optimiser step is part of the graph: one `Evaluator.run` returns the loss and the updated parameters.

    python -m scratchlm.autodiff.examples.mnist --design best --epochs 6
"""

from __future__ import annotations

import argparse
import gzip
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

import scratchlm.autodiff as ad
from scratchlm import atomic
from scratchlm.config import add_dataclass_arguments, dataclass_from_args

log = logging.getLogger("scratchlm.autodiff.mnist")

SEQ_LEN, FEATURES, NUM_CLASSES = 28, 28, 10


@dataclass
class MnistConfig:
    """Options of the MNIST transformer run."""

    data_dir: Path | None = field(
        default=None, metadata={"help": "folder with t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz "
                                        "(None: $SCRATCHLM_DATA/images/mnist, else ../shared/data/images/mnist)"})
    design: Literal["pa1", "best"] = field(default="best", metadata={"help": "model + optimiser recipe"})
    epochs: int = field(default=6, metadata={"help": "passes over the training split"})
    batch_size: int = field(default=50, metadata={"help": "images per step"})
    lr: float | None = field(default=None, metadata={"help": "learning rate (None: 0.02 for pa1, 2e-3 for best)"})
    model_dim: int = field(default=128, metadata={"help": "width of the model"})
    train_size: int = field(default=8000, metadata={"help": "images in the training split (the rest are held out)"})
    limit_train: int | None = field(default=None, metadata={"help": "use only this many training images (quick runs)"})
    seed: int = field(default=0, metadata={"help": "seed of the split, the init and the batch order"})
    threads: int = field(default=1, metadata={"help": "torch intra-op threads"})
    device: str = field(default="cpu", metadata={"help": "torch device for data and parameters (cpu, cuda, ...)"})
    progress: bool = field(default=True, metadata={"help": "show a tqdm progress bar"})
    plot: Path | None = field(default=None, metadata={"help": "write the loss / accuracy curve to this PNG"})


# ----------------------------------------------------------------------------------------------- data
def _read_idx(path: Path, magic: int) -> np.ndarray:
    if not path.is_file():
        raise FileNotFoundError(f"MNIST file not found: {path}")
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    got = int.from_bytes(raw[:4], "big")
    if got != magic:
        raise ValueError(f"{path}: not an IDX file of the expected kind (magic {got}, expected {magic})")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != math.prod(dims):
        raise ValueError(f"{path}: header says {dims} but the file holds {data.size} values")
    return data.reshape(dims)


def default_mnist_dir() -> Path:
    """$SCRATCHLM_DATA/images/mnist, or ../shared/data/images/mnist next to the repository (then the cwd)."""
    env = os.environ.get("SCRATCHLM_DATA")
    if env:
        return Path(env) / "images" / "mnist"
    beside_repo = Path(__file__).resolve().parents[4] / "shared" / "data" / "images" / "mnist"
    return beside_repo if beside_repo.is_dir() else Path("../shared/data/images/mnist")


def load_mnist(data_dir: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (N, 28, 28) float32 in [0, 1] and labels (N,) int64 from the IDX files in `data_dir`."""
    data_dir = Path(data_dir) if data_dir is not None else default_mnist_dir()
    images = _read_idx(data_dir / "t10k-images-idx3-ubyte.gz", 2051)
    labels = _read_idx(data_dir / "t10k-labels-idx1-ubyte.gz", 2049)
    if len(images) != len(labels):
        raise ValueError(f"{data_dir}: {len(images)} images but {len(labels)} labels")
    return torch.from_numpy(images.astype(np.float32) / 255.0), torch.from_numpy(labels.astype(np.int64))


def split(images: torch.Tensor, labels: torch.Tensor, train_size: int, seed: int):
    """A seeded random split: (train_x, train_y), (test_x, test_y)."""
    if not 0 < train_size < len(images):
        raise ValueError(f"train_size must be in (0, {len(images)}), got {train_size}")
    perm = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    tr, te = perm[:train_size], perm[train_size:]
    return (images[tr], labels[tr]), (images[te], labels[te])


# ----------------------------------------------------------------------------------------------- models
def _uniform(gen: torch.Generator, shape: tuple[int, ...], bound: float) -> torch.Tensor:
    return (torch.rand(shape, generator=gen) * 2 - 1) * bound


def init_params(design: str, d: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if design == "pa1":
        b = 1.0 / math.sqrt(NUM_CLASSES)  # PA1's init
        shapes = {"W_Q": (FEATURES, d), "W_K": (FEATURES, d), "W_V": (FEATURES, d), "W_O": (d, d),
                  "W_1": (d, d), "b_1": (d,), "W_2": (d, NUM_CLASSES), "b_2": (NUM_CLASSES,)}
        return {k: _uniform(gen, s, b) for k, s in shapes.items()}
    shapes = {"W_in": (FEATURES, d), "pos": (SEQ_LEN, d), "W_qkv": (d, 3 * d), "W_O": (d, d),
              "W_1": (d, 2 * d), "b_1": (2 * d,), "W_2": (2 * d, d), "b_2": (d,), "W_out": (d, NUM_CLASSES),
              "b_out": (NUM_CLASSES,)}
    out = {}
    for k, s in shapes.items():
        fan_in = s[0] if len(s) == 2 else 1
        out[k] = torch.zeros(s) if k.startswith("b_") else _uniform(gen, s, 1.0 / math.sqrt(fan_in))
    out["pos"] = 0.02 * torch.randn(SEQ_LEN, d, generator=gen)
    return out


def pa1_logits(x: ad.Node, p: dict[str, ad.Node], d: int) -> ad.Node:
    """PA1: single-head attention, layernorm, ReLU feed-forward, mean over the 28 rows."""
    q, k, v = x @ p["W_Q"], x @ p["W_K"], x @ p["W_V"]  # (B, 28, d)
    attn = ad.softmax(ad.mul_by_const(q @ ad.transpose(k, -1, -2), 1 / math.sqrt(d)), -1)  # (B, 28, 28)
    h = ad.layernorm((attn @ v) @ p["W_O"], (d,), 1e-5)  # (B, 28, d)
    z = ad.relu(h @ p["W_1"] + p["b_1"]) @ p["W_2"] + p["b_2"]  # (B, 28, 10)
    return ad.mean(z, 1)  # (B, 10)


def best_logits(x: ad.Node, p: dict[str, ad.Node], d: int, heads: int = 4) -> ad.Node:
    """Pre-norm residual block with multi-head attention and a ReLU MLP, then layernorm and mean pooling."""
    h = x @ p["W_in"] + p["pos"]  # (B, 28, d)
    qkv = ad.layernorm(h, (d,), 1e-5) @ p["W_qkv"]  # (B, 28, 3d)
    qkv = ad.transpose(ad.split_heads(qkv, 3 * heads), 1, 2)  # (B, 3H, 28, d/H)
    q, k, v = (_heads_slice(qkv, i, heads) for i in range(3))  # each (B, H, 28, d/H)
    attn = ad.softmax(ad.mul_by_const(q @ ad.transpose(k, -1, -2), 1 / math.sqrt(d // heads)), -1)
    h = h + ad.merge_heads(ad.transpose(attn @ v, 1, 2)) @ p["W_O"]  # (B, 28, d)
    h = h + ad.relu(ad.layernorm(h, (d,), 1e-5) @ p["W_1"] + p["b_1"]) @ p["W_2"] + p["b_2"]
    pooled = ad.mean(ad.layernorm(h, (d,), 1e-5), 1)  # (B, d)
    return pooled @ p["W_out"] + p["b_out"]  # (B, 10)


def _heads_slice(qkv: ad.Node, i: int, heads: int) -> ad.Node:
    """Heads [i*H, (i+1)*H) of (B, 3H, T, D), as a matmul-free reshape + sum with a one-hot mask."""
    return _SliceOp()(qkv, 1, i * heads, (i + 1) * heads)


class _SliceOp(ad.Op):
    """x[..., start:stop, ...] along `dim`; gradient: zero-pad back (_PadOp)."""

    name = "slice"

    def __call__(self, x, dim, start, stop):
        return ad.Node([x], self, {"dim": dim, "start": start, "stop": stop}, f"{x.name}[{start}:{stop}]")

    def compute(self, node, input_values):
        a = node.attrs
        return input_values[0].narrow(a["dim"], a["start"], a["stop"] - a["start"])

    def gradient(self, node, output_grad):
        return [_PadOp()(output_grad, node.inputs[0], **node.attrs)]


class _PadOp(ad.Op):
    """Place g into zeros shaped like `like` at [start:stop] along `dim` (the adjoint of a slice)."""

    name = "pad_into"

    def __call__(self, g, like, dim, start, stop):
        return ad.Node([g, like], self, {"dim": dim, "start": start, "stop": stop}, f"pad({g.name})")

    def compute(self, node, input_values):
        g, like = input_values
        a = node.attrs
        out = torch.zeros_like(like)
        out.narrow(a["dim"], a["start"], a["stop"] - a["start"]).copy_(g)
        return out

    def gradient(self, node, output_grad):
        return [_SliceOp()(output_grad, **node.attrs), None]


# ----------------------------------------------------------------------------------------------- optimisers
def sgd_updates(params: dict[str, ad.Node], grads: dict[str, ad.Node], lr: float) -> dict[str, ad.Node]:
    return {k: params[k] - grads[k] * lr for k in params}


def adam_updates(params, grads, state, lr_t: ad.Node, b1=0.9, b2=0.999, eps=1e-8):
    """Adam as an ad graph; `lr_t` (a 0-d Variable) carries lr * sqrt(1 - b2^t) / (1 - b1^t)."""
    new_p, new_m, new_v = {}, {}, {}
    for k in params:
        m, v = state[f"m.{k}"], state[f"v.{k}"]
        new_m[k] = m * b1 + grads[k] * (1 - b1)
        new_v[k] = v * b2 + grads[k] * grads[k] * (1 - b2)
        new_p[k] = params[k] - lr_t * new_m[k] / (ad.sqrt(new_v[k]) + eps)
    return new_p, new_m, new_v


# ----------------------------------------------------------------------------------------------- training
@dataclass
class MnistResult:
    design: str
    test_accuracy: float
    train_losses: list[float]
    epoch_accuracies: list[float]
    seconds: float


def train_mnist(cfg: MnistConfig) -> MnistResult:
    """Train `cfg.design` on the seeded 8,000 split and return held-out accuracy on the other 2,000."""
    torch.manual_seed(cfg.seed)
    images, labels = load_mnist(cfg.data_dir)
    (xtr, ytr), (xte, yte) = split(images, labels, cfg.train_size, cfg.seed)
    if cfg.limit_train is not None:
        xtr, ytr = xtr[: cfg.limit_train], ytr[: cfg.limit_train]
    dev = torch.device(cfg.device)
    xtr, ytr, xte, yte = xtr.to(dev), ytr.to(dev), xte.to(dev), yte.to(dev)
    d = cfg.model_dim
    lr = cfg.lr if cfg.lr is not None else (0.02 if cfg.design == "pa1" else 2e-3)
    values = {k: v.to(dev) for k, v in init_params(cfg.design, d, cfg.seed).items()}
    params = {k: ad.Variable(k) for k in values}
    x, y = ad.Variable("images"), ad.Variable("labels")
    logits = (pa1_logits if cfg.design == "pa1" else best_logits)(x, params, d)
    loss = ad.cross_entropy(logits, y)
    grads = dict(zip(params, ad.gradients(loss, list(params.values()))))
    state_values: dict[str, torch.Tensor] = {}
    lr_t = ad.Variable("lr_t")
    if cfg.design == "pa1":
        new_params = sgd_updates(params, grads, lr)
        extra: list[ad.Node] = []
    else:
        state = {f"{s}.{k}": ad.Variable(f"{s}.{k}") for k in params for s in ("m", "v")}
        state_values = {n: torch.zeros_like(values[n.split(".", 1)[1]]) for n in state}
        new_params, new_m, new_v = adam_updates(params, grads, state, lr_t)
        extra = [*new_m.values(), *new_v.values()]
    step_eval = ad.Evaluator([loss, *new_params.values(), *extra])
    predict = ad.Evaluator([logits])

    gen = torch.Generator().manual_seed(cfg.seed + 1)
    steps_per_epoch = len(xtr) // cfg.batch_size
    losses, accs = [], []
    t0 = time.perf_counter()
    bar = _progress(cfg.epochs * steps_per_epoch, cfg.progress, cfg.design)
    step = 0
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(xtr), generator=gen)
        for i in range(steps_per_epoch):
            idx = order[i * cfg.batch_size: (i + 1) * cfg.batch_size].to(dev)
            step += 1
            feed = {params[k]: values[k] for k in params} | {x: xtr[idx], y: ytr[idx]}
            if cfg.design != "pa1":
                feed |= {state[n]: state_values[n] for n in state}
                feed[lr_t] = torch.tensor(lr * math.sqrt(1 - 0.999**step) / (1 - 0.9**step), device=dev)
            out = step_eval.run(feed)
            losses.append(float(out[0]))
            values = dict(zip(params, out[1: 1 + len(params)]))
            if cfg.design != "pa1":
                rest = out[1 + len(params):]
                n = len(params)
                state_values = {f"m.{k}": t for k, t in zip(params, rest[:n])} | {
                    f"v.{k}": t for k, t in zip(params, rest[n:])}
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
        accs.append(accuracy(predict, x, params, values, xte, yte))
        log.info("epoch %d/%d: train loss %.4f, held-out accuracy %.2f%%", epoch + 1, cfg.epochs,
                 float(np.mean(losses[-steps_per_epoch:])), 100 * accs[-1])
    if bar is not None:
        bar.close()
    result = MnistResult(cfg.design, accs[-1], losses, accs, time.perf_counter() - t0)
    if cfg.plot is not None:
        plot_curves(result, cfg.plot)
    return result


def accuracy(predict: ad.Evaluator, x: ad.Node, params, values, xte, yte, batch: int = 500) -> float:
    correct = 0
    for i in range(0, len(xte), batch):
        feed = {params[k]: values[k] for k in params} | {x: xte[i: i + batch]}
        correct += int((predict.run(feed)[0].argmax(-1) == yte[i: i + batch]).sum())
    return correct / len(xte)


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"mnist {desc}", unit="step")


def plot_curves(result: MnistResult, path: Path) -> Path:
    """Training loss per step and held-out accuracy per epoch, written atomically as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(result.train_losses, lw=0.7)
    a.set(xlabel="step", ylabel="train loss", title=f"MNIST {result.design}: training loss")
    b.plot(range(1, len(result.epoch_accuracies) + 1), [100 * v for v in result.epoch_accuracies], marker="o")
    b.set(xlabel="epoch", ylabel="held-out accuracy (%)", title="held-out accuracy (2,000 images)")
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    atomic.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scratchlm.autodiff.examples.mnist",
        description="Train a one-layer transformer classifier on MNIST rows with the scratchlm autodiff engine "
                    "(8,000 train / 2,000 held-out images from the MNIST test set) and report held-out accuracy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_dataclass_arguments(parser, MnistConfig)
    cfg = dataclass_from_args(MnistConfig, parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(cfg.threads)
    try:
        result = train_mnist(cfg)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{cfg.design}: held-out accuracy {100 * result.test_accuracy:.2f}% after {cfg.epochs} epochs "
          f"({result.seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
