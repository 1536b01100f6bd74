"""Quality target: train on the lower-cased TinyStories head within a wall-clock budget, and beat the
validation bits per byte of the real stories260K model, both computed in this run.

    python -m benchmarks.train_tinystories                       # the full recipe (30 min budget)
    python -m benchmarks.train_tinystories --budget-s 120 --no-write   # a quick pilot

Pipeline, all inside the budget: train a byte-level BPE (`scratchlm.tokenizer.train_bpe`) on
`tinystories_v1_train_head_lowercased.txt`, encode it and the lower-cased validation head to token
files, then `scratchlm.training.Trainer` with `recipes/tinystories.toml` until the budget is spent.
The final validation pass (whole file) is timed separately.

Bits per byte = total nats / ln 2 / UTF-8 bytes, each model in its native format:
- ours: windows of `context_length` tokens tiling the encoded lower-cased validation file (stories
  separated by blank lines); bytes = the whole file, separators included;
- stories260K (llama2.c `.bin` through `scratchlm.model.load`, its own tok512 tokenizer, cased
  validation head): each story as `[BOS] + encode(story)` (how llama2.c trained it), windows of 512;
  bytes = the stories' own bytes (separators excluded, so its figure is not inflated by them).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import REPO_ROOT, RESULTS_DIR, Report, set_threads, shared_data_dir

RECIPE = REPO_ROOT / "recipes" / "tinystories.toml"
log = logging.getLogger("benchmarks.train_tinystories")


@torch.no_grad()
def score_ids(model, ids: list[int], context: int) -> tuple[float, int]:
    """(total nats, predicted tokens) of `ids` under `model`: windows of `context` tokens tiling the
    sequence, each starting with the previous window's last token, so every id after the first is
    predicted exactly once."""
    nats, count = 0.0, 0
    tokens = torch.tensor(ids, dtype=torch.long)
    for start in range(0, len(ids) - 1, context):
        window = tokens[start:start + context + 1]
        x, y = window[:-1][None], window[1:]  # (1, T), (T,)
        logits = model(x)[0].float()  # (T, V)
        nats += float(torch.logsumexp(logits, -1).sub(logits.gather(-1, y[:, None]).squeeze(-1)).sum())
        count += len(y)
    return nats, count


def stories260k_bpb(data: Path, max_stories: int | None) -> dict:
    from scratchlm.model import load

    loaded = load(data / "models/stories260K/stories260K.bin")
    model, tok = loaded.model.eval(), loaded.tokenizer
    text = (data / "corpora/tinystories/tinystories_v1_valid_head.txt").read_text(encoding="utf-8")
    stories = [s.strip() for s in text.split("\n\n") if s.strip()][:max_stories]
    nats, count, n_bytes = 0.0, 0, 0
    t0 = time.perf_counter()
    for story in stories:
        n, c = score_ids(model, tok.encode(story, bos=True), loaded.config.max_seq_len)
        nats, count, n_bytes = nats + n, count + c, n_bytes + len(story.encode("utf-8"))
    return {"bpb": nats / math.log(2) / n_bytes, "loss": nats / count, "tokens": count, "bytes": n_bytes,
            "stories": len(stories), "seconds": time.perf_counter() - t0,
            "params": sum(p.numel() for p in model.parameters())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=1800.0,
                        help="wall clock for tokenizer training + encoding + model training, in seconds")
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="TrainConfig TOML with a [model] table")
    parser.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary size (incl. 256 bytes)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="scratch folder for token files, checkpoints and logs (default: runs/tinystories[_TAG])")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is faster on a loaded 2-core box)")
    parser.add_argument("--stories260k-max-stories", type=int, default=None,
                        help="score only the first N validation stories with stories260K (default: all)")
    parser.add_argument("--tag", default="", help="suffix of the report and result folder names (to keep runs apart)")
    parser.add_argument("--no-write", action="store_true", help="print the report but do not write results/")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    set_threads(args.threads)

    from scratchlm.tokenizer import Tokenizer, train_bpe
    from scratchlm.tokenizer.encode_corpus import encode_corpus
    from scratchlm.training.config import load_run_config
    from scratchlm.training.trainer import Trainer

    data = shared_data_dir()
    corpus = data / "corpora/tinystories/tinystories_v1_train_head_lowercased.txt"
    valid_cased = data / "corpora/tinystories/tinystories_v1_valid_head.txt"
    work = args.work_dir or REPO_ROOT / "runs" / ("tinystories" + (f"_{args.tag}" if args.tag else ""))
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    load_start = os.getloadavg()
    t_start = time.perf_counter()

    # 1. tokenizer
    specials = ["<|endoftext|>"]
    vocab, merges = train_bpe(str(corpus), args.vocab_size, specials, progress=False)
    tok = Tokenizer(vocab, merges, specials)
    t_tok = time.perf_counter() - t_start
    log.info("tokenizer: %d ids in %.1f s", tok.vocab_size, t_tok)
    # 2. token files
    valid_lower = work / "valid_lower.txt"
    valid_lower.write_text(valid_cased.read_text(encoding="utf-8").lower(), encoding="utf-8")
    train_meta = encode_corpus(tok, [corpus], work / "train.bin", tokenizer_name="bpe (this run)", progress=False)
    val_meta = encode_corpus(tok, [valid_lower], work / "valid.bin", tokenizer_name="bpe (this run)", progress=False)
    t_prep = time.perf_counter() - t_start
    log.info("encoded: %d train / %d validation tokens (%.2f / %.2f bytes per token) at %.1f s",
             train_meta["count"], val_meta["count"], train_meta["bytes"] / train_meta["count"],
             val_meta["bytes"] / val_meta["count"], t_prep)
    # 3. training for the rest of the budget
    cfg, model_overrides = load_run_config(args.recipe)
    budget_left = args.budget_s - (time.perf_counter() - t_start)
    if budget_left <= 10:
        raise SystemExit(f"no time left for training: tokenizer + encoding took {t_prep:.0f} s of {args.budget_s} s")
    cfg.train_data, cfg.val_data, cfg.out_dir = work / "train.bin", work / "valid.bin", work / "run"
    cfg.max_time_s, cfg.threads, cfg.progress = budget_left, args.threads, sys.stderr.isatty()
    trainer = Trainer(cfg, model_overrides, tokenizer=tok)
    result = trainer.train()
    t_total = time.perf_counter() - t_start
    final_step, final = result.evals[-1]
    load_end = os.getloadavg()
    log.info("ours: val bpb %.4f (loss %.4f) after %d steps, %.0f s total", final.bits_per_byte, final.loss,
             final_step, t_total)
    # 4. the reference, in the same run
    ref = stories260k_bpb(data, args.stories260k_max_stories)
    log.info("stories260K: val bpb %.4f (loss %.4f over %d tokens, %d stories)", ref["bpb"], ref["loss"],
             ref["tokens"], ref["stories"])

    n_params = sum(p.numel() for p in trainer.model.parameters())
    records = trainer.metrics.read()
    train_time = result.elapsed_s
    name = "train_tinystories" + (f"_{args.tag}" if args.tag else "")
    result_dir = RESULTS_DIR / name
    report = Report(name, "Quality: TinyStories in a 30-minute CPU budget vs stories260K",
                    argv=argv if argv is not None else sys.argv[1:])
    report.command = "python -m benchmarks.train_tinystories " + " ".join(argv if argv is not None else sys.argv[1:])
    report.add(f"- load average at start: {' '.join(f'{x:.2f}' for x in load_start)}; at the end of training: "
               f"{' '.join(f'{x:.2f}' for x in load_end)} (2 cores shared with other work)\n"
               f"- budget {args.budget_s:.0f} s: tokenizer {t_tok:.0f} s, encoding {t_prep - t_tok:.0f} s, "
               f"training {train_time:.0f} s ({final_step} steps, "
               f"{final_step * cfg.batch_size * cfg.context_length / 1e6:.2f} M tokens), "
               f"final validation pass excluded")
    ok = final.bits_per_byte < ref["bpb"]
    report.table(
        ["model", "params", "validation text", "tokens", "loss (nats/token)", "bits per byte"],
        [["scratchlm (this run)", f"{n_params / 1e6:.2f} M", "lower-cased valid head", f"{final.tokens:,}",
          f"{final.loss:.4f}", f"**{final.bits_per_byte:.4f}**"],
         ["stories260K (llama2.c)", f"{ref['params'] / 1e6:.2f} M", "cased valid head", f"{ref['tokens']:,}",
          f"{ref['loss']:.4f}", f"**{ref['bpb']:.4f}**"]],
        caption="Validation bits per byte (lower is better)",
    )
    report.add(f"**Ratio** bpb(scratchlm) / bpb(stories260K) = **{final.bits_per_byte / ref['bpb']:.3f}** -> "
               f"target {'MET' if ok else 'NOT met'} (needs < 1).")
    evals = [r for r in records if "val_bpb" in r]
    report.table(["step", "elapsed s", "val loss", "val bpb", "tokens scored"],
                 [[r["step"], f"{r['elapsed_s']:.0f}", f"{r['val_loss']:.4f}", f"{r['val_bpb']:.4f}",
                   r["val_tokens"]] for r in evals], caption="Validation during training")
    tps = [r["tok_per_s"] for r in records if "tok_per_s" in r]
    mfu = [r["mfu"] for r in records if "mfu" in r]
    if tps:
        report.add(f"Training throughput: median {np.median(tps):,.0f} tok/s, median MFU {100 * np.median(mfu):.1f}% "
                   "of the best fp32 matmul throughput measured during the run (1 thread).")
    report.add("Recipe (`" + str(args.recipe.relative_to(REPO_ROOT) if args.recipe.is_relative_to(REPO_ROOT)
                                  else args.recipe) + "`):\n\n```toml\n" + args.recipe.read_text().strip() + "\n```")
    if result.samples:
        report.add("Samples at the end:\n\n" + "\n\n".join("> " + s.replace("\n", " ") for s in result.samples))
    report.add(f"![loss curve]({name}/loss_curve.png)")
    if not args.no_write:
        result_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(cfg.out_dir / "loss_curve.png", result_dir / "loss_curve.png")
        shutil.copy(cfg.out_dir / "metrics.jsonl", result_dir / "metrics.jsonl")
        ckpt = torch.load(result.checkpoint, map_location="cpu", weights_only=True)
        small = {k: ckpt[k] for k in ("format", "version", "model_config", "model", "tokenizer", "train_config",
                                       "step")}
        from scratchlm.training.checkpoint import atomic_torch_save

        path = atomic_torch_save(small, result_dir / "tinystories_model.pt")
        size_mb = path.stat().st_size / 1e6
        if size_mb > 20:
            path.unlink()
            report.add(f"The model checkpoint ({size_mb:.1f} MB) is over 20 MB and is not shipped.")
        else:
            report.add(f"Model checkpoint (weights + tokenizer, {size_mb:.1f} MB): "
                       f"`benchmarks/results/{name}/tinystories_model.pt` "
                       "(`scratchlm generate --model` it).")
        report.write()
    else:
        print(report.render())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
