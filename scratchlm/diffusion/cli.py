"""`scratchlm diffusion train|sample`: train the MNIST latent-diffusion recipe, or sample a PNG grid.

    scratchlm diffusion train --config recipes/diffusion_mnist.toml [--out-dir runs/x --dit-time-s 600 ...]
    scratchlm diffusion sample --model runs/diffusion_mnist/pipeline --prompt "a handwritten seven" \\
        --n 16 --steps 25 --guidance 3 --sampler ddim --seed 0 --out grid.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scratchlm.config import add_dataclass_arguments, dataclass_from_args, load_config
from scratchlm.threads import add_threads_argument, apply_threads

DEFAULT_MODEL = "runs/diffusion_mnist/pipeline"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from scratchlm.diffusion.schedulers import SAMPLERS
    from scratchlm.diffusion.train import DiffusionTrainConfig

    sub = parser.add_subparsers(dest="diffusion_command", metavar="ACTION", required=True)
    tr = sub.add_parser("train", help="train VAE + text encoder + DiT from a recipe (TOML) plus overrides")
    tr.add_argument("--config", type=Path, help="recipe file, e.g. recipes/diffusion_mnist.toml")
    add_dataclass_arguments(tr, DiffusionTrainConfig)
    sa = sub.add_parser("sample", help="generate images for a prompt and write a PNG grid")
    sa.add_argument("--model", default=DEFAULT_MODEL, help="a pipeline folder written by `diffusion train`")
    sa.add_argument("--prompt", action="append", required=True,
                    help="the prompt (repeat the flag for several; each gets --n images)")
    sa.add_argument("--n", type=int, default=8, help="images per prompt")
    sa.add_argument("--steps", type=int, default=25, help="sampling steps")
    sa.add_argument("--guidance", type=float, default=3.0, help="classifier-free guidance scale (1 = none)")
    sa.add_argument("--sampler", default="ddim", choices=sorted(SAMPLERS), help="sampler")
    sa.add_argument("--seed", type=int, default=0, help="seed of the initial noise")
    add_threads_argument(sa)
    sa.add_argument("--out", type=Path, default=Path("grid.png"), help="output PNG (one row per prompt)")


def run(args: argparse.Namespace) -> int:
    try:
        if args.diffusion_command == "train":
            return _train(args)
        return _sample(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"scratchlm diffusion {args.diffusion_command}: {e}", file=sys.stderr)
        return 2


def _train(args: argparse.Namespace) -> int:
    from scratchlm.diffusion.train import DiffusionTrainConfig, run_training

    base = load_config(DiffusionTrainConfig, args.config) if args.config else DiffusionTrainConfig()
    cfg = dataclass_from_args(DiffusionTrainConfig, args, base=base)
    run_training(cfg, log_fn=lambda s: print(s, flush=True))
    print(f"pipeline written to {Path(cfg.out_dir) / 'pipeline'}")
    return 0


def _sample(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from scratchlm.diffusion.pipeline import DiffusionPipeline, save_png

    if args.n < 1 or args.steps < 1:
        raise ValueError(f"--n and --steps must be >= 1 (got {args.n}, {args.steps})")
    apply_threads(args.threads)
    pipe = DiffusionPipeline.from_pretrained(args.model)
    prompts = [p for p in args.prompt for _ in range(args.n)]
    with tqdm(total=args.steps, desc="denoising", unit="step") as bar:
        images = pipe(prompts, steps=args.steps, guidance=args.guidance, sampler=args.sampler, seed=args.seed,
                      progress=lambda i: bar.update(1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_png(images, args.out, nrow=args.n)
    print(f"wrote {len(prompts)} images to {args.out}")
    return 0
