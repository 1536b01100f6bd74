"""The SD-shaped MNIST model (recipes/diffusion_sd_mnist.toml) scored like the DiT one, side by side.

    python -m benchmarks.diffusion_sd_mnist --model runs/diffusion_sd_mnist/pipeline
    python -m benchmarks.diffusion_sd_mnist --model DIR --parts parallel --par-per-class 10

Parts (comma-separated `--parts`, default both):

- accuracy: prompted-class accuracy by the shipped judge and the Frechet distance on its features (against the 2k
  held-out digits) of 10 x `--n-per-class` generated digits (prompt "a handwritten <digit>", DDIM `--steps`,
  guidance `--guidance`), for the SD pipeline and the shipped DiT pipeline (`--dit`), in this process one after
  the other; the real-data reference rows of benchmarks/diffusion.py. The SD model makes 32x32 images (the digits
  were padded with 2 px of background for its 8x8 latents): the judge sees their middle 28x28. Also: the same
  folder through diffusers' `StableDiffusionPipeline` (same latents and prompts): max abs difference. PNG grid.
- parallel: DistriFusion on the trained UNet (`scratchlm.diffusion.unet_parallel`), 2 ranks, the same latents as
  one rank: exact patch parallel and displaced patch parallel (stale halos, GroupNorm statistics and K/V after
  `--warmup` synchronous steps): per-pixel error against one rank and the judge's accuracy. PNG grids.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, Report
from benchmarks.diffusion import _judged_mnist
from scratchlm.diffusion.judge import SHIPPED_JUDGE

PARTS = ("accuracy", "parallel")


def judge_view(images: torch.Tensor) -> torch.Tensor:
    """The judge's 28x28 input: the middle of larger images (the SD model's 32x32 = 28x28 digits + 2 px pad)."""
    h, w = images.shape[-2:]
    top, left = (h - 28) // 2, (w - 28) // 2
    return images[..., top:top + 28, left:left + 28]  # (N, 1, 28, 28)


def generate(pipe, labels: torch.Tensor, latents: torch.Tensor, steps: int, guidance: float,
             batch: int = 100) -> torch.Tensor:
    from scratchlm.diffusion.data import canonical_prompt

    out = []
    for i in range(0, len(labels), batch):
        prompts = [canonical_prompt(int(k)) for k in labels[i:i + batch]]
        out.append(pipe(prompts, steps=steps, guidance=guidance, sampler="ddim", latents=latents[i:i + batch],
                        seed=i))
    return torch.cat(out)


def grid_of(images: torch.Tensor, per_class: int, show: int = 10) -> torch.Tensor:
    idx = torch.cat([torch.arange(k * per_class, k * per_class + min(show, per_class)) for k in range(10)])
    return images[idx]


def folder_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def part_accuracy(report: Report, args) -> None:
    from scratchlm.diffusion.judge import frechet_distance, predict
    from scratchlm.diffusion.pipeline import DiffusionPipeline, save_png

    torch.set_num_threads(args.threads)
    judge, ph, yh, fh, ft, sub = _judged_mnist(args)
    n = args.n_per_class
    labels = torch.arange(10).repeat_interleave(n)
    rows = [["reference: held-out 2k (judge accuracy) vs train 8k (FD)", "-", "-", "-",
             f"{(ph == yh).float().mean().item() * 100:.2f} %", f"{frechet_distance(fh, ft):.2f}"],
            [f"reference: {10 * n} train images vs held-out 2k", "-", "-", "-", "-",
             f"{frechet_distance(ft[sub], fh):.2f}"]]
    for name, model in (("SD-shaped (CLIP + UNet)", args.model), ("DiT (shipped)", args.dit)):
        pipe = DiffusionPipeline.from_pretrained(model)
        params = sum(p.numel() for p in pipe.denoiser.parameters())
        text_params = sum(p.numel() for p in pipe.text_encoder.parameters())
        lat = pipe.initial_latents(10 * n, seed=123)
        t0 = time.perf_counter()
        imgs = generate(pipe, labels, lat, args.steps, args.guidance)
        secs = time.perf_counter() - t0
        pred, feats = predict(judge, judge_view(imgs))
        acc = (pred == labels).float().mean().item()
        per_class = [(pred[labels == k] == k).float().mean().item() for k in range(10)]
        rows.append([f"{name}: {model}", f"{params / 1e6:.2f} M + {text_params / 1e6:.2f} M",
                     f"{folder_mib(Path(model)):.2f} MiB", f"{secs:.1f} s", f"{acc * 100:.2f} %",
                     f"{frechet_distance(feats, fh):.2f}"])
        report.add(f"{name}: per-class accuracy " + ", ".join(f"{k}: {a * 100:.0f} %" for k, a in enumerate(per_class))
                   + f"; latents {tuple(lat.shape[1:])}, images {tuple(imgs.shape[1:])}")
        tag = "sd" if model == args.model else "dit"
        save_png(grid_of(imgs, n), RESULTS_DIR / f"diffusion_sd_mnist_grid_{tag}.png", nrow=min(10, n))
        if model == args.model:
            report.add(_diffusers_check(pipe, model, lat[:10], args))
    report.table(["pipeline", "denoiser + text encoder parameters", "folder", "time to generate",
                  "prompted-class accuracy (judge)", "Frechet distance to held-out"], rows,
                 caption=f"{10 * n} generated digits per pipeline ({n} per class, prompt \"a handwritten <digit>\", "
                         f"DDIM {args.steps} steps, guidance {args.guidance}, {args.threads} thread(s)); grids: "
                         "diffusion_sd_mnist_grid_sd.png, diffusion_sd_mnist_grid_dit.png")


def _diffusers_check(pipe, model: str, lat: torch.Tensor, args) -> str:
    """The trained folder through diffusers' StableDiffusionPipeline on the same latents: max abs difference."""
    import diffusers

    from scratchlm.diffusion.data import canonical_prompt

    prompts = [canonical_prompt(k) for k in range(10)]
    ref = diffusers.StableDiffusionPipeline.from_pretrained(model, safety_checker=None, requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    with torch.no_grad():
        theirs = ref(prompts, num_inference_steps=args.steps, guidance_scale=args.guidance, latents=lat,
                     output_type="pt").images  # (B, 1, 32, 32) in [0, 1]
    ours = (pipe(prompts, steps=args.steps, guidance=args.guidance, sampler="ddim", latents=lat) + 1) / 2
    return (f"**Export**: the trained SD folder loaded by diffusers' `StableDiffusionPipeline` (10 prompts, the same "
            f"latents, {args.steps} DDIM steps, guidance {args.guidance}): max abs(diffusers - scratchlm) = "
            f"{(theirs - ours).abs().max().item():.2e} (images in [0, 1]).")


def part_parallel(report: Report, args) -> None:
    from dataclasses import asdict

    from scratchlm.diffusion import parallel as pp
    from scratchlm.diffusion import unet_parallel as up
    from scratchlm.diffusion.data import canonical_prompt
    from scratchlm.diffusion.judge import load_judge, predict
    from scratchlm.diffusion.pipeline import DiffusionPipeline, save_png

    torch.set_num_threads(args.threads)
    judge = load_judge(args.judge)
    pipe = DiffusionPipeline.from_pretrained(args.model)
    n = args.par_per_class
    labels = torch.arange(10).repeat_interleave(n)
    prompts = [canonical_prompt(int(k)) for k in labels]
    lat = pipe.initial_latents(10 * n, seed=321)
    text, uncond = pipe.encode_prompts(prompts), pipe.encode_prompts([""] * len(prompts))
    unet_dir, sched = str(Path(args.model) / "unet"), asdict(pipe.schedule)
    common = (unet_dir, sched, lat, text, uncond, args.steps, args.guidance, "ddim")

    def judged(z: torch.Tensor) -> tuple[torch.Tensor, float]:
        img = pipe.decode(z)
        return img, (predict(judge, judge_view(img))[0] == labels).float().mean().item()

    t0 = time.perf_counter()
    base_img, base_acc = judged(pp.launch(up.run_unet_reference, 1, *common, threads=1, timeout_s=900)[0]["latents"])
    rows = [["one rank", "-", f"{time.perf_counter() - t0:.0f} s", f"{base_acc * 100:.1f} %"]]
    save_png(grid_of(base_img, n), RESULTS_DIR / "diffusion_sd_mnist_grid_one_rank.png", nrow=min(10, n))
    variants = [("exact patch parallel (2 ranks)", "exact", 0)]
    variants += [(f"displaced patch parallel (2 ranks, {w} warm-up step{'s' if w > 1 else ''})", "displaced", w)
                 for w in (int(v) for v in args.warmup.split(","))]
    for name, mode, warmup in variants:
        t0 = time.perf_counter()
        res = pp.launch(up.run_unet_patch, 2, *common, mode, warmup, threads=1, timeout_s=900)
        img, acc = judged(res[0]["latents"])
        diff = (img - base_img).abs()
        p99 = diff.flatten().kthvalue(int(0.99 * diff.numel())).values.item()
        rows.append([name, f"{diff.max().item():.2e} max, {diff.mean().item():.2e} mean, {p99:.2e} p99",
                     f"{time.perf_counter() - t0:.0f} s", f"{acc * 100:.1f} %"])
        tag = mode + (f"_w{warmup}" if mode == "displaced" else "")
        save_png(grid_of(img, n), RESULTS_DIR / f"diffusion_sd_mnist_grid_{tag}.png", nrow=min(10, n))
    report.table(["variant", "per-pixel abs error vs one rank (images in [-1, 1])", "wall (2 shared cores)",
                  "prompted-class accuracy (judge)"], rows,
                 caption=f"DistriFusion on the trained SD UNet: {10 * n} digits ({n} per class), the same latents "
                         f"{tuple(lat.shape[1:])} split into 2 bands of 4 rows, {args.steps} DDIM steps, guidance "
                         f"{args.guidance}, 1 thread per rank; grids diffusion_sd_mnist_grid_<variant>.png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="runs/diffusion_sd_mnist/pipeline", help="the trained SD pipeline folder")
    ap.add_argument("--dit", default="scratchlm/diffusion/pretrained/mnist", help="the DiT pipeline to compare with")
    ap.add_argument("--judge", default=str(SHIPPED_JUDGE), help="judge weights (default: the shipped judge)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    ap.add_argument("--threads", type=int, default=1, help="threads for the single-process parts")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--guidance", type=float, default=3.0)
    ap.add_argument("--n-per-class", type=int, default=30)
    ap.add_argument("--par-per-class", type=int, default=10)
    ap.add_argument("--warmup", default="1,4", help="displaced variant: synchronous warm-up steps to try")
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    bad = set(parts) - set(PARTS)
    if bad:
        ap.error(f"unknown parts {sorted(bad)}; expected some of {PARTS}")
    torch.set_num_threads(args.threads)  # before the report records the machine
    report = Report("diffusion_sd_mnist" + (f"_{args.tag}" if args.tag else ""),
                    "SD-shaped MNIST model: judge accuracy vs the DiT, DistriFusion's displaced variant",
                    argv if argv is not None else sys.argv[1:])
    report.command = "python -m benchmarks.diffusion_sd_mnist " + " ".join(argv if argv is not None else sys.argv[1:])
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for part in parts:
        t0 = time.perf_counter()
        {"accuracy": part_accuracy, "parallel": part_parallel}[part](report, args)
        report.add(f"_(part {part}: {time.perf_counter() - t0:.0f} s)_")
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
