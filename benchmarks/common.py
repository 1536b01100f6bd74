"""The common harness of every benchmark.

Machines here are shared and noisy (timings swing 3x), so a benchmark:
- pins thread counts explicitly and records them;
- runs A and B interleaved (A B A B ...) after warm-up, and reports median and best of each;
- reports the ratio, which is what survives the noise;
- writes a dated markdown file into benchmarks/results/ with machine, versions and command.

Usage::

    from benchmarks.common import Report, compare, set_threads

    set_threads(1)
    report = Report("tokenizer_encode", "Encoding throughput against tiktoken")
    res = compare({"scratchlm": lambda: tok.encode(text), "tiktoken": lambda: enc.encode(text)},
                  warmup=1, repeats=5)
    report.table(res.rows(unit="s"), ...)
    report.write()
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from scratchlm import atomic

# `scratchlm bench all --quick` sends a smoke run's results elsewhere through $SCRATCHLM_BENCH_RESULTS
RESULTS_DIR = Path(os.environ.get("SCRATCHLM_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
REPO_ROOT = Path(__file__).resolve().parent.parent


def shared_data_dir() -> Path:
    """../shared/data from the repository root (or $SCRATCHLM_DATA)."""
    env = os.environ.get("SCRATCHLM_DATA")
    path = Path(env) if env else REPO_ROOT.parent / "shared" / "data"
    if not path.is_dir():
        raise SystemExit(f"benchmark data not found at {path}; set SCRATCHLM_DATA to the shared data folder")
    return path


def set_threads(n: int) -> int:
    """Pin torch's intra-op threads (and OMP/MKL for child processes) to `n`."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ["MKL_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)
    return n


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
              "avx512_vnni", "avx512_bf16", "avx512vbmi", "amx_tile", "amx_int8", "amx_bf16")

# The AVX2 cap of a fair side-by-side on an AVX-512 machine (issue 29): scratchlm's kernels (simd_common.h), torch's
# own vectorised kernels (ATen), oneDNN (torch's and vLLM's) and MKL all run the code an AVX2 + FMA CPU would.
ISA_CAP_ENV = {
    "native": {"SCRATCHLM_ISA": "native"},
    "avx2": {"SCRATCHLM_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
CAP_VARIABLES = ("SCRATCHLM_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def simd_flags() -> str:
    """The SIMD features /proc/cpuinfo lists for this CPU (of SIMD_FLAGS, in that order)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return " ".join(f for f in SIMD_FLAGS if f in have) or "none of " + " ".join(SIMD_FLAGS)
    except OSError:
        pass
    return "unknown (no /proc/cpuinfo)"


def isa_env(isa: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: os.environ) with the ISA cap `isa` ("native" or "avx2", see ISA_CAP_ENV): the cap's
    variables set, every other cap variable removed (a cap left in the shell never leaks into a native column)."""
    if isa not in ISA_CAP_ENV:
        raise ValueError(f"ISA cap {isa!r}: expected one of {sorted(ISA_CAP_ENV)}")
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in CAP_VARIABLES}
    env.update(ISA_CAP_ENV[isa])
    return env


def apply_isa(isa: str) -> None:
    """Put the ISA cap `isa` into this process's environment (before torch or any kernel is first used: each
    library reads its variable once)."""
    env = isa_env(isa)
    for k in CAP_VARIABLES:
        os.environ.pop(k, None)
    os.environ.update({k: env[k] for k in CAP_VARIABLES if k in env})


def isa_cap_text() -> str:
    """The cap variables as this process has them ("none" when unset)."""
    return ", ".join(f"{k}={os.environ[k]}" for k in CAP_VARIABLES if k in os.environ) or "none (native)"


TORCH_ISA_PROBE = r"""
import torch
x, w = torch.randn(64, 256), torch.randn(256, 256)
torch.mm(x, w)
if torch.backends.mkldnn.is_available():
    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
print("ATEN_CAPABILITY " + torch.backends.cpu.get_cpu_capability())
"""


def torch_isa_check(python: str, env: dict[str, str]) -> str:
    """What torch under `python` (a venv's interpreter) runs with `env`: ATen's CPU capability and the ISA oneDNN
    reports (ONEDNN_VERBOSE's info line). MKL prints no ISA; MKL_ENABLE_INSTRUCTIONS is only set, not verified."""
    env = dict(env, ONEDNN_VERBOSE="profile_create", OMP_NUM_THREADS="1")
    try:
        out = subprocess.run([python, "-c", TORCH_ISA_PROBE], env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return f"probe failed: {e}"
    lines = out.stdout.splitlines()
    aten = next((x.split(" ", 1)[1] for x in lines if x.startswith("ATEN_CAPABILITY ")), "?")
    onednn = next((x.split("isa:", 1)[1].strip() for x in lines if "isa:" in x), "not reported")
    return f"ATen CPU capability {aten}, oneDNN ISA: {onednn}"


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=5,
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info() -> dict[str, str]:
    """What a reader needs to judge a figure: CPU, cores, load, versions, commit."""
    info = {
        "date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_model(),
        "cores": f"{os.cpu_count()} (usable: {len(os.sched_getaffinity(0))})",
        "SIMD flags": simd_flags(),
        "ISA cap": isa_cap_text(),
        "load average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "git commit": git_commit(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch threads"] = str(torch.get_num_threads())
    except ImportError:
        pass
    return info


CLOCKS = {"wall": time.perf_counter, "thread_cpu": time.thread_time}


def time_once(fn: Callable[[], object], clock: str = "wall") -> float:
    """Seconds `fn()` took on `clock`: "wall" (perf_counter) or "thread_cpu" (time.thread_time: the calling
    thread's CPU time; with torch pinned to one thread it measures the work itself and is far less
    sensitive to other processes' load than wall clock)."""
    now = CLOCKS[clock]
    t0 = now()
    fn()
    return now() - t0


def tinystories_prompts(n: int = 8, words: int = 40) -> list[str]:
    """The first `words` words of the first `n` stories of the shared TinyStories validation head."""
    stories = (shared_data_dir() / "corpora" / "tinystories" / "tinystories_v1_valid_head.txt").read_text()
    return [" ".join(p.split()[:words]) for p in stories.split("\n\n")[:n]]


def engine_decode_tok_s(engine, prompt, max_tokens: int, request_id: str) -> float:
    """Batch-1 decode rate of an `LLMEngine`: one greedy request of `max_tokens` (`ignore_eos`), its steps after
    the first (prefill + first token) per wall second."""
    from scratchlm.inference import SamplingParams

    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    engine.step()
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - t0)


def engine_batch_tok_s(engine, prompts: Sequence, max_tokens: int, request_ids: Sequence[str]) -> float:
    """Output tokens per wall second of an `LLMEngine` given all `prompts` at once, `max_tokens` greedy tokens
    each (`ignore_eos`), until every request finished."""
    from scratchlm.inference import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for rid, p in zip(request_ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    while engine.has_unfinished_requests():
        engine.step()
    return max_tokens * len(prompts) / (time.perf_counter() - t0)


@dataclass
class Timing:
    name: str
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)


@dataclass
class Comparison:
    """Interleaved timings of several contenders; the first is the baseline of the ratios."""

    timings: list[Timing]

    def __getitem__(self, name: str) -> Timing:
        return next(t for t in self.timings if t.name == name)

    def ratio(self, a: str, b: str, stat: str = "median") -> float:
        """time(a) / time(b): below 1 means `a` is faster."""
        return getattr(self[a], stat) / getattr(self[b], stat)

    def rows(self, work: float | None = None, work_unit: str = "") -> list[list[str]]:
        """Table rows: name, median, best, (throughput), ratio to the first contender."""
        base = self.timings[0]
        rows = []
        for t in self.timings:
            row = [t.name, f"{t.median * 1e3:.2f} ms", f"{t.best * 1e3:.2f} ms"]
            if work is not None:
                row.append(f"{work / t.median:.2f} {work_unit}/s")
            row.append(f"{t.median / base.median:.3f}")
            rows.append(row)
        return rows

    def headers(self, work_unit: str | None = None) -> list[str]:
        h = ["contender", "median", "best"]
        if work_unit is not None:
            h.append(f"{work_unit}/s (median)")
        h.append(f"time / {self.timings[0].name}")
        return h


def interleaved_clients(target: Callable, client_args: dict[str, tuple], kinds: Sequence[str], repeats: int,
                        join_timeout: float = 60.0) -> dict[str, dict[str, list[dict]]]:
    """Start one spawned process per contender, `target(conn, *client_args[name])`, which sends one ready line,
    then answers each `kind` sent to it with a result dict (with "wall") and stops on None; run every kind
    `repeats` + 1 times, the contenders interleaved round by round (the first round a warm-up, dropped).
    Returns {name: {kind: [result per kept round]}}."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    clients = {}
    for name, args in client_args.items():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, *args))
        proc.start()
        clients[name] = (proc, parent)
        print(f"{name}: {parent.recv()}", file=sys.stderr)
    results: dict[str, dict[str, list[dict]]] = {n: {k: [] for k in kinds} for n in client_args}
    try:
        for kind in kinds:
            for r in range(repeats + 1):  # the first round is a warm-up
                for name, (_, conn) in clients.items():
                    conn.send(kind)
                    res = conn.recv()
                    if r:
                        results[name][kind].append(res)
                    print(f"  {kind} round {r}: {name} {res['wall']:.3f} s", file=sys.stderr)
    finally:
        for _, conn in clients.values():
            conn.send(None)
        for proc, _ in clients.values():
            proc.join(join_timeout)
    return results


def compare(
    contenders: dict[str, Callable[[], object]],
    warmup: int = 1,
    repeats: int = 5,
    progress: bool = True,
    clock: str = "wall",
) -> Comparison:
    """Time each contender `repeats` times, interleaved (A B A B ...), after `warmup` calls each, on `clock`
    ("wall" or "thread_cpu", see `time_once`)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}: expected one of {sorted(CLOCKS)}")
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    timings = {name: Timing(name) for name in contenders}
    for r in range(repeats):
        for name, fn in contenders.items():
            timings[name].times.append(time_once(fn, clock))
        if progress:
            now = ", ".join(f"{n} {t.times[-1]:.4g}s" for n, t in timings.items())
            print(f"  repeat {r + 1}/{repeats}: {now}", file=sys.stderr)
    return Comparison(list(timings.values()))


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(str(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _running_module(name: str) -> str:
    """The benchmark module this process runs (`python -m benchmarks.X`): the report's name can differ
    (`--name`, partial runs), so the command line names the script, falling back to the report name."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name.startswith("benchmarks."):
        return spec.name
    return "benchmarks." + name


class Report:
    """A markdown report: title, machine, command, then sections; written to results/."""

    def __init__(self, name: str, title: str, argv: Sequence[str] | None = None):
        self.name = name
        self.title = title
        self.command = f"python -m {_running_module(name)}" + (" " + " ".join(argv) if argv else "")
        self.machine = machine_info()
        self.sections: list[str] = []

    def add(self, text: str) -> None:
        self.sections.append(text.rstrip())

    def table(self, headers: Sequence[str], rows: Sequence[Sequence[object]], caption: str = "") -> None:
        self.add((f"**{caption}**\n\n" if caption else "") + markdown_table(headers, rows))

    def render(self) -> str:
        machine = "\n".join(f"- {k}: {v}" for k, v in self.machine.items())
        body = "\n\n".join(self.sections)
        return f"# {self.title}\n\n{machine}\n- command: `{self.command}`\n\n{body}\n"

    def write(self, results_dir: Path = RESULTS_DIR) -> Path:
        """Print the report and write it atomically to results/<date>-<name>.md."""
        text = self.render()
        print(text)
        results_dir.mkdir(parents=True, exist_ok=True)
        path = results_dir / f"{_dt.date.today().isoformat()}-{self.name}.md"
        tmp = path.with_suffix(".md.tmp")
        tmp.write_text(text, encoding="utf-8")
        atomic.replace(tmp, path)
        print(f"[written to {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}]",
              file=sys.stderr)
        return path


def rss_kb(field: str) -> int:
    """A memory field of this process from /proc/self/status in KiB ("VmRSS:", "VmHWM:"); 0 where absent."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0
