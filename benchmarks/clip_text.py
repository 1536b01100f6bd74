"""Stable Diffusion's prompt encoding: scratchlm's CLIP tokenizer and text encoder against transformers', side by side.

Two parts, each contender interleaved with its peer (benchmarks.common.compare), outputs checked equal first:

- tokenizer: one diffusers call per image, `tok([negative, prompt], padding="max_length", max_length=77,
  truncation=True)`, over 64 TinyStories prompts (a CLIP-format vocabulary of `--merges` merges trained here on the
  TinyStories train head: no real CLIP vocabulary is available offline); scratchlm with a cold word cache (emptied
  before every pass) and a warm one, against transformers' `CLIPTokenizer` (Rust `tokenizers` backend).
- encoder: an SD-1.5-shaped text encoder (CLIP ViT-L/14's text tower: 12 layers, width 768, 77 positions, quick
  GELU; random weights) on a CFG batch of 2 prompts, fp32, `--threads` threads: scratchlm `CLIPTextModel` against
  transformers' `CLIPTextModel` (its default SDPA attention), same weights (transformers' folder loaded by ours).

    python -m benchmarks.clip_text [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import Report, compare, set_threads, shared_data_dir, tinystories_prompts


def part_tokenizer(report: Report, args) -> None:
    import transformers

    from scratchlm.diffusion.clip_tokenizer import CLIPTokenizer

    corpus = shared_data_dir() / "corpora" / "tinystories" / "tinystories_v1_train_head_cased.txt"
    ours = CLIPTokenizer.train(corpus.read_text(encoding="utf-8").split("\n"), args.merges)
    prompts = tinystories_prompts(64, 30)
    with tempfile.TemporaryDirectory() as tmp:
        ours.save_pretrained(tmp)
        hf = transformers.CLIPTokenizer.from_pretrained(tmp)
    pairs = [["", p] for p in prompts]  # CFG: the empty negative prompt and the prompt, one call per image

    def run_ours(cold: bool):
        def fn():
            if cold:
                ours._cache.clear()
            return [ours(b)["input_ids"] for b in pairs]
        return fn

    def run_hf():
        return [hf(b, padding="max_length", max_length=77, truncation=True, return_tensors="pt")["input_ids"]
                for b in pairs]

    for a, b in zip(run_ours(True)(), run_hf(), strict=True):
        assert torch.equal(a, b), "scratchlm and transformers disagree"
    res = compare({"transformers CLIPTokenizer": run_hf, "scratchlm, cold cache": run_ours(True),
                   "scratchlm, warm cache": run_ours(False)}, warmup=1, repeats=args.repeats)
    report.table(res.headers("calls"), res.rows(len(pairs), "calls"),
                 caption=f"tokenizer: {len(pairs)} calls of 2 prompts (77 ids each), vocabulary "
                         f"{len(ours):,} tokens ({len(ours.merges):,} merges)")
    base = res.timings[0].name
    report.add(f"scratchlm / transformers time: cold cache **{res.ratio('scratchlm, cold cache', base):.2f}**, "
               f"warm **{res.ratio('scratchlm, warm cache', base):.2f}** (below 1 = faster).")


def part_encoder(report: Report, args) -> None:
    import transformers

    from scratchlm.diffusion.clip import CLIPTextModel

    torch.manual_seed(0)
    cfg = transformers.CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                      num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
                                      eos_token_id=2, bos_token_id=0, pad_token_id=1, projection_dim=768)
    ref = transformers.CLIPTextModel(cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(tmp)
        ours = CLIPTextModel.from_pretrained(Path(tmp))
    ids = torch.randint(3, 49405, (2, 77), generator=torch.Generator().manual_seed(0))
    ids[:, 0], ids[:, 20:] = 49406, 49407

    @torch.no_grad()
    def run_hf():
        return ref(ids).last_hidden_state

    @torch.no_grad()
    def run_ours():
        return ours(ids).last_hidden_state

    err = (run_hf() - run_ours()).abs().max().item()
    res = compare({"transformers CLIPTextModel": run_hf, "scratchlm CLIPTextModel": run_ours}, warmup=2,
                  repeats=args.repeats)
    report.table(res.headers(), res.rows(), caption=f"text encoder: SD-1.5-shaped (123M parameters), batch 2 x 77 "
                                                    f"tokens, fp32, {args.threads} thread(s)")
    report.add(f"Max abs difference of last_hidden_state: {err:.2e}. scratchlm / transformers time: "
               f"**{res.ratio('scratchlm CLIPTextModel', 'transformers CLIPTextModel'):.2f}** (below 1 = faster).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--merges", type=int, default=8000, help="merges of the trained CLIP-format vocabulary")
    parser.add_argument("--parts", default="tokenizer,encoder")
    args = parser.parse_args(argv)
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    set_threads(args.threads)
    report = Report("clip_text", "CLIP prompt encoding: scratchlm vs transformers", argv if argv is not None
                    else sys.argv[1:])
    for part in args.parts.split(","):
        {"tokenizer": part_tokenizer, "encoder": part_encoder}[part](report, args)
    report.add(f"Load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.")
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
