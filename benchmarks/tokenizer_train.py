"""BPE training time and peak memory: scratchlm's `train_bpe` against HF `tokenizers` BpeTrainer.

Workloads (issue 3): 10K vocab on TinyStories (lower-cased head, 4.2 MB); 32K vocab on the first
~20 MB of Gutenberg (whole books in file-name order, header and footer stripped). Both trainers use
the GPT-2 byte-level pre-tokenization, the same special token and 2 threads/processes. Every run is a
fresh subprocess (so peak RSS is per run), alternating scratchlm / HF. Target: scratchlm <= 2x HF.

    python -m benchmarks.tokenizer_train [--repeats 3] [--only tinystories|gutenberg]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import Comparison, Report, Timing, shared_data_dir

EOT = "<|endoftext|>"
_START = re.compile(r"^\*\*\* ?START OF.*$", re.MULTILINE)
_END = re.compile(r"^\*\*\* ?END OF.*$", re.MULTILINE)


def strip_gutenberg(text: str) -> str:
    """The text between the ``*** START OF`` and ``*** END OF`` lines (the whole text if absent)."""
    start, end = _START.search(text), _END.search(text)
    return text[start.end() if start else 0 : end.start() if end else len(text)].strip() + "\n"


def gutenberg_head(max_bytes: int) -> str:
    """Whole Gutenberg books in file-name order, stripped, until at least `max_bytes` UTF-8 bytes."""
    books, size = [], 0
    for path in sorted((shared_data_dir() / "corpora" / "gutenberg").glob("*.txt")):
        book = strip_gutenberg(path.read_text(encoding="utf-8", errors="replace"))
        books.append(book)
        size += len(book.encode("utf-8"))
        if size >= max_bytes:
            break
    return "\n".join(books)


def _child(args: argparse.Namespace) -> None:
    """One training run in this (fresh) process; prints {seconds, peak_mb, vocab} as JSON."""
    t0 = time.perf_counter()
    if args.child == "scratchlm":
        from scratchlm.tokenizer import train_bpe

        vocab, _ = train_bpe(args.input, args.vocab_size, [EOT], num_workers=args.threads, progress=False)
        size = len(vocab)
    else:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=[EOT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train([args.input], trainer)
        size = tok.get_vocab_size()
    seconds = time.perf_counter() - t0
    # VmHWM is this process's own high-water mark (ru_maxrss would carry the parent's over exec).
    hwm_kb = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                  if line.startswith("VmHWM:"))
    worker_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"seconds": seconds, "peak_mb": hwm_kb / 1024, "worker_peak_mb": worker_kb / 1024,
                      "vocab": size}))


def _run_child(name: str, path: Path, vocab_size: int, threads: int) -> dict:
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="true")
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.tokenizer_train", "--child", name, "--input", str(path),
         "--vocab-size", str(vocab_size), "--threads", str(threads)],
        capture_output=True, text=True, env=env, check=True, cwd=Path(__file__).resolve().parent.parent,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each trainer per workload")
    parser.add_argument("--threads", type=int, default=2, help="processes (scratchlm) / rayon threads (HF)")
    parser.add_argument("--only", choices=["tinystories", "gutenberg"], help="run one workload")
    parser.add_argument("--child", choices=["scratchlm", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--input", help=argparse.SUPPRESS)
    parser.add_argument("--vocab-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return

    data = shared_data_dir()
    report = Report("tokenizer_train", "BPE training: scratchlm train_bpe vs HF tokenizers BpeTrainer",
                    sys.argv[1:])
    report.add(f"Threads: {args.threads} (scratchlm worker processes for pre-tokenization; HF RAYON_NUM_THREADS). "
               "Each run is a fresh process; time is measured inside it (imports excluded); peak memory is the "
               "process's VmHWM and, for scratchlm, the largest pre-tokenization worker's max RSS (workers are "
               "forked, so it includes pages shared with the parent). Runs alternate scratchlm / HF.")
    with tempfile.TemporaryDirectory() as tmp:
        workloads = []
        if args.only in (None, "tinystories"):
            workloads.append(("TinyStories 4.2 MB, vocab 10K",
                              data / "corpora" / "tinystories" / "tinystories_v1_train_head_lowercased.txt", 10_000))
        if args.only in (None, "gutenberg"):
            path = Path(tmp) / "gutenberg_20mb.txt"
            path.write_text(gutenberg_head(20_000_000), encoding="utf-8")
            workloads.append((f"Gutenberg first {path.stat().st_size / 1e6:.1f} MB (whole books), vocab 32K", path,
                              32_000))
        for title, path, vocab_size in workloads:
            timings = {n: Timing(n) for n in ("scratchlm", "hf tokenizers")}
            peaks: dict[str, list[float]] = {n: [] for n in timings}
            worker_peaks: dict[str, list[float]] = {n: [] for n in timings}
            for r in range(args.repeats):
                for name, child in (("scratchlm", "scratchlm"), ("hf tokenizers", "hf")):
                    res = _run_child(child, path, vocab_size, args.threads)
                    timings[name].times.append(res["seconds"])
                    peaks[name].append(res["peak_mb"])
                    worker_peaks[name].append(res["worker_peak_mb"])
                    print(f"  {title}: repeat {r + 1}/{args.repeats} {name} {res['seconds']:.2f}s "
                          f"{res['peak_mb']:.0f} MB (load {os.getloadavg()[0]:.2f})", file=sys.stderr)
            comp = Comparison(list(timings.values()))
            rows = [[t.name, f"{t.median:.2f} s", f"{t.best:.2f} s", f"{max(peaks[t.name]):.0f} MB",
                     f"{max(worker_peaks[t.name]):.0f} MB" if max(worker_peaks[t.name]) else "-",
                     f"{t.median / comp['hf tokenizers'].median:.2f}"] for t in comp.timings]
            report.table(["trainer", "median", "best", "peak RSS (main)", "peak RSS (largest worker)", "time / HF"],
                         rows, caption=title)
            ratio = comp.ratio("scratchlm", "hf tokenizers")
            report.add(f"scratchlm / HF = **{ratio:.2f}x** the time (median; best-of: "
                       f"{comp.ratio('scratchlm', 'hf tokenizers', 'best'):.2f}x); target <= 2x: "
                       f"{'met' if ratio <= 2 else 'NOT met'}.")
    report.add(f"Load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.")
    report.write()


if __name__ == "__main__":
    main()
