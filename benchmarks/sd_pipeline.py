"""One Stable Diffusion image, scratchlm against diffusers' StableDiffusionPipeline, and the UNet's memory wall.

    python -m benchmarks.sd_pipeline                       # parts attention, pipeline, memory
    python -m benchmarks.sd_pipeline --parts pipeline --sizes 32 --repeats 3 --tag quick

The model: an SD-1.5-shaped pipeline at reduced width, random weights built with diffusers' and transformers' own
classes (seed 0) and saved as an SD folder (`make_folder`): UNet block_out_channels (64, 128, 256, 256), 2 layers
per block, CrossAttn down/up blocks x 3 + plain ones, 8 heads per level (SD 1.5's `attention_head_dim` 8: head dims
8 / 16 / 32), cross_attention_dim 256; SD's VAE at a quarter width (32, 64, 128, 128), 2 layers per block; a CLIP text
encoder at reduced width (256 wide, 12 layers, 4 heads, quick-GELU, 77 tokens); a small CLIP BPE vocabulary; SD 1.5's
DDIM scheduler config. Both pipelines load that same folder.

Parts (comma-separated `--parts`):

- attention: scratchlm's fused kernel (layers.attention "fused") vs torch's SDPA (what diffusers' AttnProcessor2_0
  runs) on the UNet's attention shapes (CFG batch 2, 8 heads), one thread, interleaved, thread CPU time.
- pipeline: one image, prompt + negative prompt "" (CFG, guidance 7.5), 25 DDIM steps, the same latents, at each
  latent size of `--sizes`; scratchlm's `DiffusionPipeline` and diffusers' `StableDiffusionPipeline` each in its
  own process (1 thread pinned to one core, then 2 threads), one warm-up image of the smallest size each, then
  the two interleaved round by round. Reported: wall and process CPU seconds, their ratio, and the split (text
  encoder / UNet over the 25 steps / VAE decoder / the rest) in process CPU seconds, timed by forward hooks on the
  three modules (the same hooks on both sides); the max abs difference between the two images; the load average.
- memory: peak memory (peak RSS over the resident baseline, a fresh process per point) of the UNet's top-level
  self-attention (one call, CFG batch 2, 8 heads, head dim 8) and of a whole UNet forward at 64x64 and 128x128
  latents, with the attention fused (scratchlm's kernel; torch's SDPA) or materialised (whole; in query chunks);
  the VAE decoder whole vs tiled. Points that would not fit in this machine's memory are given by formula only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import REPO_ROOT, Report, rss_kb, set_threads
from scratchlm.tokenizer.formats import bytes_to_unicode

PARTS = ("attention", "pipeline", "memory")
PROMPT = "a photo of an astronaut riding a horse on the moon"
UNET = dict(block_out_channels=(64, 128, 256, 256), layers_per_block=2,
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, cross_attention_dim=256,
            attention_head_dim=8, norm_num_groups=32, sample_size=64, in_channels=4, out_channels=4)
VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
           up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(32, 64, 128, 128), layers_per_block=2,
           latent_channels=4, norm_num_groups=32, sample_size=512, scaling_factor=0.18215)
CLIP = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=4,
            max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=256)
WORDS = ("a", "photo", "of", "an", "astronaut", "riding", "horse", "on", "the", "moon", "cat", "dog", "red", "blue",
         "painting")


# ------------------------------------------------------------------------------------ the model folder
def _clip_vocab(path: Path) -> None:
    """A small CLIP BPE vocabulary (bytes, bytes + </w>, merges spelling WORDS, the two specials)."""
    chars = list(bytes_to_unicode().values())  # GPT-2's byte -> printable character table, CLIP's alphabet
    vocab, merges = chars + [c + "</w>" for c in chars], []
    for w in WORDS:
        toks = list(w[:-1]) + [w[-1] + "</w>"]
        while len(toks) > 1:
            a, b = toks[0], toks[1]
            if f"{a} {b}" not in merges:
                merges.append(f"{a} {b}")
            if a + b not in vocab:
                vocab.append(a + b)
            toks = [a + b] + toks[2:]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")


def make_folder(path: Path) -> Path:
    """The SD-1.5-shaped folder at reduced width, random weights (seed 0), written by diffusers."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    if (path / "model_index.json").is_file():
        return path
    tmp = Path(tempfile.mkdtemp(dir=path.parent if path.parent.is_dir() else None))
    _clip_vocab(tmp / "vocab")
    tok = CLIPTokenizer(vocab=str(tmp / "vocab" / "vocab.json"), merges=str(tmp / "vocab" / "merges.txt"),
                        model_max_length=77)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**UNET)
    vae = AutoencoderKL(**VAE)
    text = CLIPTextModel(CLIPTextConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **CLIP))
    sched = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                          set_alpha_to_one=False, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=tok, unet=unet, scheduler=sched,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(tmp / "sd")
    for f in ("vocab.json", "merges.txt"):  # as shipped SD folders have them, beside tokenizer.json
        (tmp / "sd" / "tokenizer" / f).write_bytes((tmp / "vocab" / f).read_bytes())
    os.replace(tmp / "sd", path)
    return path


def _describe() -> str:
    return (f"SD-1.5-shaped at reduced width, random weights: UNet {UNET['block_out_channels']}, 2 layers/block, "
            f"8 heads/level (head dims 8/16/32), text width 256; VAE {VAE['block_out_channels']}; CLIP text 256 wide, "
            f"12 layers, 77 tokens; DDIM")


# ------------------------------------------------------------------------------------ attention part
def part_attention(report: Report, args) -> None:
    import torch.nn.functional as F

    from scratchlm.diffusion import fused_attention as fa

    set_threads(1)
    if not fa.kernel_available():
        report.add("**Attention**: the fused kernel does not run on this machine (see the log); nothing to compare.")
        return
    shapes = []
    for s in [int(x) for x in args.sizes.split(",")]:
        for level, d in ((0, 8), (1, 16)):
            n = (s >> level) ** 2
            shapes += [(f"{s}x{s} latent, level {level}, self", n, n, d), (f"{s}x{s} latent, level {level}, cross",
                                                                           n, 77, d)]
    g = torch.Generator().manual_seed(0)
    data = {name: tuple(torch.randn(2, m, 8, d, generator=g) for m in (n, s_, s_)) for name, n, s_, d in shapes}
    times: dict[tuple[str, str], list[float]] = {}
    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

    for _ in range(args.attn_repeats):
        for name, qkv in data.items():
            for impl, fn in (("sdpa", sdpa), ("fused", fa.attention)):
                t0 = time.thread_time()
                fn(*qkv)
                times.setdefault((name, impl), []).append(time.thread_time() - t0)
    rows = []
    for name, n, s_, d in shapes:
        q, k, v = data[name]
        err = (fa.attention(q, k, v) - sdpa(q, k, v).transpose(1, 2)).abs().max().item()
        a, b = statistics.median(times[(name, "sdpa")]), statistics.median(times[(name, "fused")])
        rows.append([name, f"{n} x {s_}", d, f"{a * 1e3:.2f} ms", f"{b * 1e3:.2f} ms", f"{a / b:.2f}x", f"{err:.1e}"])
    report.table(["attention", "queries x keys", "head dim", "torch SDPA (diffusers)", "scratchlm fused kernel",
                  "speed-up", "max abs diff"], rows,
                 caption=f"The UNet's attention calls (CFG batch 2, 8 heads), 1 thread, thread CPU time, medians of "
                         f"{args.attn_repeats} interleaved repeats")


# ------------------------------------------------------------------------------------ pipeline part
def _client(conn, which: str, folder: str, threads: int, pin: int | None, steps: int, guidance: float) -> None:
    """A contender in its own process: answers a latent size with one image's timings (and the image)."""
    if pin is not None:
        os.sched_setaffinity(0, {pin})
    set_threads(threads)
    if which == "diffusers":
        from diffusers import StableDiffusionPipeline

        pipe = StableDiffusionPipeline.from_pretrained(folder, safety_checker=None, requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        mods = {"text": pipe.text_encoder, "unet": pipe.unet, "vae": pipe.vae.decoder}

        def run(lat):
            img = pipe(PROMPT, negative_prompt="", num_inference_steps=steps, guidance_scale=guidance, latents=lat,
                       height=lat.shape[-2] * 8, width=lat.shape[-1] * 8, output_type="pt").images
            return img * 2 - 1  # [0, 1] -> [-1, 1]
    else:
        from scratchlm.diffusion.pipeline import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(folder)
        mods = {"text": pipe.text_encoder, "unet": pipe.denoiser, "vae": pipe.vae.decoder}

        def run(lat):
            return pipe([PROMPT], steps=steps, guidance=guidance, latents=lat, negative_prompts=[""],
                        size=tuple(lat.shape[-2:]))
    spent = {k: [0.0, 0.0] for k in mods}
    start: dict[str, tuple[float, float]] = {}
    for key, m in mods.items():
        m.register_forward_pre_hook(lambda _m, _a, key=key: start.__setitem__(key, (time.perf_counter(),
                                                                                   time.process_time())))

        def post(_m, _a, _o, key=key):
            w0, c0 = start[key]
            spent[key][0] += time.perf_counter() - w0
            spent[key][1] += time.process_time() - c0
        m.register_forward_hook(post)
    conn.send(f"{which} loaded, {threads} thread(s)" + (f" pinned to CPU {pin}" if pin is not None else ""))
    while (kind := conn.recv()) is not None:
        s = int(kind)
        lat = torch.randn(1, 4, s, s, generator=torch.Generator().manual_seed(0))
        for v in spent.values():
            v[0] = v[1] = 0.0
        w0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            img = run(lat)
        res = {"wall": time.perf_counter() - w0, "cpu": time.process_time() - c0,
               **{f"{k}_wall": v[0] for k, v in spent.items()}, **{f"{k}_cpu": v[1] for k, v in spent.items()},
               "image": img.float().clamp(-1, 1)}
        conn.send(res)


def _interleaved(target, client_args: dict[str, tuple], sizes: list[str], repeats: int) -> dict:
    """One process per contender (`target(conn, *args)`); a single warm-up image of the smallest size each (kernel
    builds, allocator), then `repeats` rounds per size with the contenders interleaved. {name: {size: [result]}}"""
    ctx = mp.get_context("spawn")
    clients = {}
    try:
        for name, cargs in client_args.items():
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(child, *cargs))
            proc.start()
            clients[name] = (proc, parent)
            print(f"{name}: {parent.recv()}", file=sys.stderr)
        warm = min(sizes, key=int)
        for name, (_, conn) in clients.items():
            conn.send(warm)
            print(f"  warm-up {warm}: {name} {conn.recv()['wall']:.1f} s", file=sys.stderr)
        out: dict = {n: {s: [] for s in sizes} for n in client_args}
        for s in sizes:
            for r in range(repeats):
                for name, (_, conn) in clients.items():
                    conn.send(s)
                    out[name][s].append(conn.recv())
                    print(f"  {s} round {r + 1}: {name} {out[name][s][-1]['wall']:.1f} s", file=sys.stderr)
        return out
    finally:
        for proc, conn in clients.values():
            conn.send(None)
            proc.join(120)


def part_pipeline(report: Report, args) -> None:
    folder = make_folder(Path(args.folder))
    sizes = [s for s in args.sizes.split(",") if s]
    pin = min(os.sched_getaffinity(0))
    configs = [("1 thread (pinned)", 1, pin), ("2 threads", 2, None)] if args.threads == "both" else \
        [(f"{args.threads} thread(s)", int(args.threads), pin if args.threads == "1" else None)]
    names = ("diffusers", "scratchlm")
    for label, threads, pin_to in configs:
        load0 = os.getloadavg()
        res = _interleaved(_client, {n: (n, str(folder), threads, pin_to, args.steps, args.guidance)
                                     for n in names}, sizes, args.repeats)
        load1 = os.getloadavg()
        rows = []
        for s in sizes:
            med = {n: {k: statistics.median(r[k] for r in res[n][s]) for k in res[n][s][0] if k != "image"}
                   for n in names}
            diff = max((a["image"] - b["image"]).abs().max().item()
                       for a, b in zip(res["diffusers"][s], res["scratchlm"][s]))
            for n in names:
                m = med[n]
                rest = m["cpu"] - m["text_cpu"] - m["unet_cpu"] - m["vae_cpu"]
                rows.append([f"{s}x{s} -> {int(s) * 8} px", n, f"{m['wall']:.2f} s", f"{m['cpu']:.2f} s",
                             f"{m['text_cpu'] * 1e3:.0f} ms",
                             f"{m['unet_cpu']:.2f} s ({m['unet_cpu'] / args.steps * 1e3:.0f} ms/step)",
                             f"{m['vae_cpu']:.2f} s", f"{rest * 1e3:.0f} ms", "",
                             ", ".join(f"{r['wall']:.1f}" for r in res[n][s])])
            d, o = med["diffusers"], med["scratchlm"]
            rows.append([f"{s}x{s}", "**diffusers / scratchlm**", f"**{d['wall'] / o['wall']:.2f}x**",
                         f"**{d['cpu'] / o['cpu']:.2f}x**", f"{d['text_cpu'] / o['text_cpu']:.2f}x",
                         f"{d['unet_cpu'] / o['unet_cpu']:.2f}x", f"{d['vae_cpu'] / o['vae_cpu']:.2f}x", "",
                         f"{diff:.1e}", ""])
        report.table(["latent -> image", "pipeline", "wall (median)", "CPU s (process, median)", "text encoder (CPU)",
                      "UNet, 25 steps (CPU)", "VAE decoder (CPU)", "rest (CPU)", "max abs(image diff), [-1, 1]",
                      "walls per round"],
                     rows, caption=f"One image, {label}: {args.steps} DDIM steps, CFG guidance {args.guidance}, "
                                   f"{args.repeats} interleaved round(s) after one warm-up image (medians); load "
                                   f"average {load0[0]:.1f} before, {load1[0]:.1f} after")
        report.write()  # the tables so far: a long run that is stopped leaves them


# ------------------------------------------------------------------------------------ memory part
def _measure_child(spec: dict) -> dict:
    """In a fresh process: peak RSS over the resident baseline, and the time, of one call."""
    set_threads(spec.get("threads", 2))
    from scratchlm.diffusion.layers import attention, attention_impl, chunked_attention

    torch.manual_seed(0)
    s = spec["size"]
    if spec["kind"] == "attn":
        n = s * s
        q, k, v = (torch.randn(2, n, 8, 8) for _ in range(3))

        def fn():
            return attention(q, k, v)
    elif spec["kind"] == "unet":
        from scratchlm.diffusion.unet import UNet2DConditionModel

        model = UNet2DConditionModel.from_pretrained(Path(spec["folder"]) / "unet")
        x, t, text = torch.randn(2, 4, s, s), torch.tensor([500.0, 500.0]), torch.randn(2, 77, 256)

        def fn():
            return model(x, t, text)
    else:
        from scratchlm.diffusion.vae import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(Path(spec["folder"]) / "vae")
        z = torch.randn(1, 4, s, s)

        def fn():
            return vae.decode(z, tile=spec.get("tile"), overlap=spec.get("overlap", 4))
    with torch.no_grad(), attention_impl(spec.get("impl", "fused")), chunked_attention(spec.get("chunk")):
        if spec.get("warmup", True):
            fn()
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM)
        base = rss_kb("VmRSS:")
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
        peak = rss_kb("VmHWM:")
    res = {"peak_mb": (peak - base) / 1024, "seconds": seconds}
    if spec["kind"] == "vae" and spec.get("tile"):
        with torch.no_grad():
            full = vae.decode(z)
        res["seam_max"] = (out - full).abs().max().item()
        res["seam_mean"] = (out - full).abs().mean().item()
    return res


def _measure(spec: dict) -> dict:
    # every large buffer mmap'd and returned on free: the baseline after the warm-up keeps none of its activations
    out = subprocess.run([sys.executable, "-m", "benchmarks.sd_pipeline", "--_child", json.dumps(spec)],
                         capture_output=True, text=True, cwd=REPO_ROOT,
                         env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}, timeout=3600)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cell(r: dict) -> str:
    return f"failed: {r['error'][:60]}" if "error" in r else f"{r['peak_mb']:.0f} MB / {r['seconds']:.2f} s"


def part_memory(report: Report, args) -> None:
    folder = make_folder(Path(args.folder))
    sizes = [int(x) for x in args.memory_sizes.split(",")]
    budget_mb = args.memory_budget_gb * 1024
    impls = (("fused", None, "fused: scratchlm kernel"), ("sdpa", None, "fused: torch SDPA"),
             ("math", 1024, "materialised, 1024-query chunks"), ("math", None, "materialised"))
    for kind, what in (("attn", "one top-level self-attention (2 x 8 heads x N tokens, head dim 8)"),
                       ("unet", "one UNet forward (CFG batch 2, all 16 attentions)")):
        rows = []
        for s in sizes:
            n = s * s
            scores_mb = 2 * 8 * n * n * 4 / 2**20
            row = [f"{s}x{s}", n, f"{scores_mb:,.0f} MB"]
            for impl, chunk, _ in impls:
                # materialised: the scores and their softmax live at once (2x); chunks hold chunk/N of that
                need = 2 * scores_mb * (min(chunk, n) / n if chunk else 1)
                if impl == "math" and need > budget_mb:
                    row.append(f"not run: needs ~{need / 1024:.0f} GB (> {args.memory_budget_gb} GB budget)")
                    continue
                if kind == "unet" and impl == "math" and chunk and s > 64:
                    row.append("not run (time)")
                    continue
                r = _measure({"kind": kind, "size": s, "impl": impl, "chunk": chunk, "folder": str(folder),
                              "warmup": kind == "attn" or s <= 64})
                row.append(_cell(r))
                print(kind, s, impl, chunk, row[-1], file=sys.stderr)
            rows.append(row)
        report.table(["latent", "tokens N", "scores 2*H*N^2*4 B"] + [x[2] + " (peak / time)" for x in impls], rows,
                     caption=f"Memory wall, {what}: peak RSS above the resident baseline / time, 2 threads, a fresh "
                             f"process per cell (every buffer over 64 KiB mmap'd fresh so that freed memory leaves the "
                             f"RSS: the times include those page faults and are not speed figures)")
    vrows = []
    for s in [int(x) for x in args.vae_sizes.split(",")]:
        full = _measure({"kind": "vae", "size": s, "folder": str(folder)})
        tiled = _measure({"kind": "vae", "size": s, "folder": str(folder), "tile": args.vae_tile, "overlap": 4})
        ratio = f"{full['peak_mb'] / tiled['peak_mb']:.1f}x" if "error" not in full and "error" not in tiled \
            and tiled["peak_mb"] > 0.1 else "-"
        seam = f"{tiled['seam_max']:.3f} max, {tiled['seam_mean']:.4f} mean" if "seam_max" in tiled else "-"
        vrows.append([f"{s}x{s} -> {s * 8} px", _cell(full), _cell(tiled), seam, ratio])
        print(vrows[-1], file=sys.stderr)
    report.table(["latent -> image", "whole: peak / time", f"tiled ({args.vae_tile}x{args.vae_tile} latent tiles, "
                  "overlap 4)", "seam error (decoder output, unclamped)", "memory whole / tiled"], vrows,
                 caption="The SD VAE decoder (reduced width, random weights) whole vs tiled, 2 threads")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    ap.add_argument("--folder", default=str(Path(tempfile.gettempdir()) / "scratchlm_sd_bench"),
                    help="the SD folder (made if absent)")
    ap.add_argument("--sizes", default="32,64", help="latent sides of the pipeline / attention parts")
    ap.add_argument("--threads", default="both", help="'both' (1 pinned, then 2), or a thread count")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--guidance", type=float, default=7.5)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per size (after a warm-up)")
    ap.add_argument("--attn-repeats", type=int, default=7)
    ap.add_argument("--memory-sizes", default="64,128")
    ap.add_argument("--memory-budget-gb", type=float, default=6.0, help="skip materialised points needing more")
    ap.add_argument("--vae-sizes", default="64,128")
    ap.add_argument("--vae-tile", type=int, default=32)
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        print(json.dumps(_measure_child(json.loads(args._child))))
        return 0
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        ap.error(f"unknown parts {sorted(set(parts) - set(PARTS))}; expected some of {PARTS}")
    report = Report("sd_pipeline" + (f"_{args.tag}" if args.tag else ""),
                    "Stable Diffusion (SD-1.5-shaped, reduced width): one image vs diffusers, the UNet's memory wall",
                    argv if argv is not None else sys.argv[1:])
    report.add(f"Model: {_describe()}. diffusers {_version('diffusers')}, transformers {_version('transformers')}.")
    for part in parts:
        t0 = time.perf_counter()
        {"attention": part_attention, "pipeline": part_pipeline, "memory": part_memory}[part](report, args)
        report.add(f"_(part {part}: {time.perf_counter() - t0:.0f} s)_")
    report.write()
    return 0


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


if __name__ == "__main__":
    sys.exit(main())
