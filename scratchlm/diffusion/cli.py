"""`scratchlm diffusion train|sample|serve`: train the MNIST latent-diffusion recipe, sample a PNG grid, or
serve the images API with its page.

    scratchlm diffusion sample --prompt "a seven"          # the shipped MNIST pipeline, writes grid.png
    scratchlm diffusion serve                              # http://127.0.0.1:8000/: prompt box -> images
    scratchlm diffusion train --config recipes/diffusion_mnist.toml [--out-dir runs/x --dit-time-s 600 ...]
    scratchlm diffusion sample --model runs/diffusion_mnist/pipeline --prompt "a handwritten seven" \\
        --n 16 --steps 25 --guidance 3 --sampler ddim --seed 0 --out grid.png
    scratchlm diffusion sample --model path/to/stable-diffusion-folder "a red fox in the snow" \\
        --negative-prompt "blurry" --size 512x512 --steps 25 --guidance 7.5 --seed 1 --out fox.png
    scratchlm diffusion serve --model path/to/stable-diffusion-folder   # or: scratchlm serve path/to/folder

Without `--model`, sample and serve use the trained pipeline shipped with the package and say so. A Stable
Diffusion folder (diffusers layout) runs with its own scheduler unless `--sampler` picks another; what loading
maps or leaves out (the safety checker not run, ...) is printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from scratchlm.config import add_dataclass_arguments, dataclass_from_args, load_config
from scratchlm.threads import add_threads_argument, apply_threads

TRAIN_EPILOG = """what a budget gives: quality follows the optimiser steps (chiefly the DiT's), measured with the
judge CNN on 300 samples (200 in the 98.5 % row), 25 DDIM steps, guidance 3 (docs/diffusion.md):
  VAE + DiT steps   took                                                accuracy  Frechet  digits
  700 + 1,900       348 CPU-s at 1 thread (~10 min wall on 2 quiet cores)  88.7 %    72.0     blotchy
  915 + 5,390       852 CPU-s at 1 thread (the shipped pipeline)           99.7 %    39.7     clean
  1,215 + 5,493     26 min 52 s wall on 2 quiet cores, 2 threads           98.5 %    32.9     clean
  566 + 9,958       2,183 CPU-s at 2 threads                               100 %     31.3     clean
  915 + 10,007      1,524 CPU-s at 1 thread                                100 %     37.2     clean
  SD-shaped (recipes/diffusion_sd_mnist.toml: CLIP + SD UNet on the shipped VAE, 32x32):
  0 + 5,396         1,142 CPU-s at 1 thread (44 min wall, load ~7)         99.7 %    16.7     clean
(the 2-thread rows were scored by an earlier judge: compare their Frechet distances only with each other)
On a busy machine two threads mostly wait for each other (a VAE step cost ~1 CPU-s, 0.07 with one):
pass --threads 1, --dit-max-steps 5000 and a --dit-time-s large enough not to end the run first.
Without --model, `diffusion sample` and `diffusion serve` use the trained pipeline shipped with scratchlm.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from scratchlm.diffusion.schedulers import SAMPLERS
    from scratchlm.diffusion.train import DiffusionTrainConfig

    sub = parser.add_subparsers(dest="diffusion_command", metavar="ACTION", required=True)
    tr = sub.add_parser("train", help="train VAE + text encoder + DiT from a recipe (TOML) plus overrides",
                        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    tr.add_argument("--config", type=Path, help="recipe file, e.g. recipes/diffusion_mnist.toml")
    add_dataclass_arguments(tr, DiffusionTrainConfig)
    sa = sub.add_parser("sample", help="generate images for a prompt and write a PNG grid")
    sa.add_argument("prompts", nargs="*", metavar="PROMPT", help="the prompt(s); --prompt works as well")
    sa.add_argument("--model", default=None, help="a pipeline folder: one written by `diffusion train`, or a Stable "
                                                  "Diffusion folder in diffusers' layout (default: the trained "
                                                  "MNIST pipeline shipped with scratchlm)")
    sa.add_argument("--variant", default=None, help='weight files of an SD folder: "fp16" reads *.fp16.safetensors')
    sa.add_argument("--prompt", action="append", default=[],
                    help="the prompt (repeat the flag for several; each gets --n images)")
    sa.add_argument("--negative-prompt", default=None,
                    help="what to steer away from (classifier-free guidance's unconditional input; default empty)")
    sa.add_argument("--n", type=int, default=None,
                    help="images per prompt (default 8 for scratchlm's small folders, 1 for Stable Diffusion ones)")
    sa.add_argument("--size", default=None, help="image size WxH or N (pixels; multiples of the VAE's factor, "
                                                 "8 for SD); default: the model's native size")
    sa.add_argument("--steps", type=int, default=25, help="sampling steps")
    sa.add_argument("--guidance", type=float, default=None,
                    help="classifier-free guidance scale (1 = none; default 7.5 for SD folders, 3 otherwise)")
    sa.add_argument("--guidance-rescale", type=float, default=0.0, help="guidance_rescale in [0, 1] (0 = off)")
    sa.add_argument("--sampler", default=None, choices=sorted(SAMPLERS),
                    help="sampler (default: the folder's scheduler; ddim for scratchlm folders)")
    sa.add_argument("--seed", type=int, default=0, help="seed of the initial noise")
    add_threads_argument(sa)
    sa.add_argument("--out", type=Path, default=Path("grid.png"), help="output PNG (one row per prompt)")
    se = sub.add_parser("serve", help="serve POST /v1/images/generations and a prompt page at /",
                        epilog=SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    se.add_argument("model", nargs="?", default=None, help="a pipeline folder, scratchlm's or a Stable Diffusion one "
                                                          "(default: the shipped MNIST pipeline)")
    se.add_argument("--model", dest="model_flag", default=None, help="the pipeline folder (same as the positional)")
    _add_server_arguments(se)


SERVE_EPILOG = """examples:
  scratchlm diffusion serve                         # the shipped MNIST pipeline on http://127.0.0.1:8000
  scratchlm diffusion serve runs/diffusion_mnist/pipeline --port 8001 --api-key secret
  scratchlm diffusion serve --model path/to/stable-diffusion-folder     # size= any WxH in multiples of 8

then open http://127.0.0.1:8000/ (a prompt box), or
  curl http://127.0.0.1:8000/v1/images/generations -H 'Content-Type: application/json' \\
       -d '{"prompt": "a handwritten seven", "n": 2, "steps": 25, "seed": 7}'
"""


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's flags (host, port, API key, limits) and --threads; not the LLM engine's."""
    from scratchlm.server.config import ServerConfig

    add_threads_argument(parser, "of the denoiser")
    add_dataclass_arguments(parser, ServerConfig)


def resolve_model(model: str | None, log=print) -> Path:
    """The pipeline folder to use: `model`, or the shipped MNIST pipeline (logged, so the user knows which)."""
    from scratchlm.diffusion.pipeline import SHIPPED_MNIST

    if model is not None:
        return Path(model)
    log(f"using the trained MNIST pipeline shipped with scratchlm ({SHIPPED_MNIST}); pass --model to use another")
    return SHIPPED_MNIST


def run(args: argparse.Namespace) -> int:
    try:
        if args.diffusion_command == "train":
            return _train(args)
        if args.diffusion_command == "serve":
            return _serve(args)
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

    from scratchlm.diffusion.pipeline import DiffusionPipeline, parse_size, save_png
    from scratchlm.diffusion.schedulers import make_sampler

    given = list(args.prompts) + list(args.prompt)
    if not given:
        raise ValueError("no prompt: pass it as an argument (`diffusion sample \"a prompt\"`) or with --prompt")
    if (args.n is not None and args.n < 1) or args.steps < 1:
        raise ValueError(f"--n and --steps must be >= 1 (got {args.n}, {args.steps})")
    apply_threads(args.threads)
    t0 = time.perf_counter()
    pipe = DiffusionPipeline.from_pretrained(resolve_model(args.model, log=lambda s: print(s, file=sys.stderr)),
                                             variant=args.variant)
    for note in pipe.notes:
        print(f"note: {note}", file=sys.stderr)
    size = None if args.size is None else pipe.latent_size_for(parse_size(args.size))
    n = args.n if args.n is not None else 1 if pipe.is_sd else 8
    prompts = [p for p in given for _ in range(n)]
    negative = None if args.negative_prompt is None else [args.negative_prompt] * len(prompts)
    sch = make_sampler(args.sampler or pipe.sampler, pipe.schedule)  # refuses a sampler the schedule cannot run
    sch.set_timesteps(args.steps)
    with tqdm(total=len(sch.timesteps), desc="denoising", unit="step") as bar:  # model calls: PNDM makes steps + 1
        images = pipe(prompts, steps=args.steps, guidance=args.guidance, sampler=args.sampler, seed=args.seed,
                      progress=lambda i: bar.update(1), negative_prompts=negative, size=size,
                      guidance_rescale=args.guidance_rescale)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_png(images, args.out, nrow=n)
    h, w = images.shape[-2:]
    print(f"wrote {len(prompts)} {w}x{h} images ({len(given)} row(s) of {n}) to "
          f"{args.out.resolve()} in {time.perf_counter() - t0:.1f} s")
    return 0


def _serve(args: argparse.Namespace) -> int:
    """`scratchlm serve` on a pipeline folder (the server builds the images app for it)."""
    from scratchlm.server import cli as server_cli

    if args.model is not None and args.model_flag is not None and args.model != args.model_flag:
        raise ValueError(f"two models given: {args.model!r} and --model {args.model_flag!r}")
    args.model = str(resolve_model(args.model or args.model_flag, log=lambda s: print(s, file=sys.stderr)))
    args.engine_process = False
    return server_cli.run(args)
