"""Encoding throughput (MB/s): scratchlm's BPE Tokenizer against tiktoken's gpt2, same GPT-2 files.

Inputs (issue 3): the TinyStories file (lower-cased head, 4.2 MB) and a Gutenberg book (War and Peace,
header/footer stripped). Contenders, interleaved in one run, 1 thread each unless said:
- scratchlm `encode`, cold: the pre-token cache is emptied before every run (no help from a previous run);
- scratchlm `encode`, warm: the cache kept from the previous run (what a long-running process sees);
- scratchlm parallel corpus encoder (`encode_corpus`, 2 processes, file -> .bin, process start included);
- tiktoken `encode` (1 thread), the baseline of the ratios.
Targets: >= 0.5x tiktoken in one process; >= 1x with the parallel encoder on 2 cores.

    python -m benchmarks.tokenizer_encode [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.common import Report, compare, set_threads, shared_data_dir
from benchmarks.tokenizer_train import strip_gutenberg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2, help="processes of the parallel corpus encoder")
    args = parser.parse_args()
    os.environ["RAYON_NUM_THREADS"] = "1"
    set_threads(1)

    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    from scratchlm.tokenizer.formats import load_gpt2_files
    from scratchlm.tokenizer.pretokenize import GPT2_PATTERN

    data = shared_data_dir()
    gpt2 = data / "tokenizers" / "gpt2"
    tok = load_gpt2_files(gpt2 / "encoder.json", gpt2 / "vocab.bpe")
    ranks = data_gym_to_mergeable_bpe_ranks(str(gpt2 / "vocab.bpe"), str(gpt2 / "encoder.json"))
    enc = tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 50256})

    report = Report("tokenizer_encode", "BPE encoding throughput: scratchlm vs tiktoken (gpt2)", sys.argv[1:])
    report.add("All contenders produce the same ids (checked before timing). Ratios are throughput / tiktoken's "
               "(above 1 = faster than tiktoken). tiktoken and scratchlm `encode` run on 1 thread; the parallel "
               f"encoder uses {args.workers} processes and includes reading the file, starting the workers and "
               "writing the .bin.")
    with tempfile.TemporaryDirectory() as tmp:
        book = Path(tmp) / "war_and_peace.txt"
        book.write_text(strip_gutenberg((data / "corpora" / "gutenberg" / "2600-0.txt").read_text(encoding="utf-8")),
                        encoding="utf-8")
        inputs = [("TinyStories (lower-cased head)",
                   data / "corpora" / "tinystories" / "tinystories_v1_train_head_lowercased.txt"),
                  ("Gutenberg: War and Peace", book)]
        for title, path in inputs:
            _bench_one(report, title, path, Path(tmp) / "out.bin", tok, enc, args)
    report.add(f"Load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.")
    report.write()


def _bench_one(report: Report, title: str, path: Path, out: Path, tok, enc, args: argparse.Namespace) -> None:
    import numpy as np

    from scratchlm.tokenizer.encode_corpus import encode_corpus

    text = path.read_text(encoding="utf-8")
    mb = len(text.encode("utf-8")) / 1e6
    expected = enc.encode(text, allowed_special="all")
    assert tok.encode(text) == expected, "scratchlm and tiktoken disagree"

    def cold():
        tok._cache.clear()
        return tok.encode(text)

    def parallel():  # forked workers inherit the parent's cache: empty it, as in a fresh CLI run
        tok._cache.clear()
        return encode_corpus(tok, [path], out, num_workers=args.workers, progress=False)

    parallel()
    assert np.fromfile(out, dtype=np.uint16).tolist() == expected, "parallel encoder disagrees"
    par_name = f"scratchlm encode_corpus ({args.workers} procs)"
    res = compare({
        "tiktoken (1 thread)": lambda: enc.encode(text, allowed_special="all"),
        "scratchlm encode, cold cache": cold,
        "scratchlm encode, warm cache": lambda: tok.encode(text),
        par_name: parallel,
    }, warmup=1, repeats=args.repeats)
    base = res.timings[0].median
    rows = [[t.name, f"{t.median:.3f} s", f"{t.best:.3f} s", f"{mb / t.median:.2f} MB/s",
             f"{base / t.median:.2f}"] for t in res.timings]
    report.table(["contender", "median", "best", "MB/s (median)", "throughput / tiktoken"], rows,
                 caption=f"{title}: {mb:.2f} MB, {len(expected):,} tokens")
    single = base / res["scratchlm encode, cold cache"].median
    warm = base / res["scratchlm encode, warm cache"].median
    par = base / res[par_name].median
    report.add(f"One process: **{single:.2f}x** tiktoken with a cold cache, {warm:.2f}x warm (target >= 0.5x: "
               f"{'met' if single >= 0.5 else 'NOT met'} cold); parallel encoder: **{par:.2f}x** "
               f"(target >= 1x: {'met' if par >= 1 else 'NOT met'}).")


if __name__ == "__main__":
    main()
