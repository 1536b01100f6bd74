"""`scratchlm bench serve`: the OpenAI server under load, against the offline engine on the same workload.

A client with vLLM's `benchmark_serving` metric definitions:
- request throughput = completed requests / wall time; output throughput = output tokens / wall time;
- TTFT = time from sending a request to its first streamed token;
- TPOT = (e2e latency - TTFT) / (output tokens - 1), per request;
- ITL = the gaps between successive streamed chunks (one chunk per engine step and request);
each reported as mean, median and p99. ``--max-concurrency`` caps the requests in flight,
``--request-rate`` draws Poisson arrivals (inf = all at once).

Contenders, interleaved (offline, server, offline, server, ...), same requests, same thread count:
- ``offline``: ``LLM.generate`` on all requests in this process (the engine's own ceiling);
- ``scratchlm serve``: a `scratchlm serve` subprocess, driven over HTTP with streaming;
- ``vllm serve``: from the engine benchmark's ``.peers/vllm`` virtual environment when it exists
  (skipped with a note otherwise), same HF export of the model.

Workload (the engine issue's): fixed seed, 32 requests, prompt lengths U[16, 256] of random token ids,
output lengths U[16, 128], ``ignore_eos``, greedy. Every repeat draws *fresh* prompts (seed + repeat; the
warm-up its own), the same for every contender within the repeat: all contenders keep their prompt caches on
(scratchlm's prefix cache, llama-server's per-slot ``cache_prompt``, vLLM's prefix caching), and a prompt sent
again would be served from that cache (llama-server reported 231 of 232 prompt tokens cached for a repeated
prompt, TTFT 55 ms instead of 3.1 s), which measures the cache, not prefill. The cached prompt tokens a server
reports in its usage chunk (``prompt_tokens_details.cached_tokens``) are summed per run and reported.
TTFT is the time to the first chunk that carries generated text (vLLM's definition: a chunk whose
``choices[0].text`` is non-empty), the same code for every server.

    python -m benchmarks.serve                         # SmolLM2-135M-Instruct, 32 requests, 32 clients
    python -m benchmarks.serve --model ../shared/data/models/stories260K/stories260K.bin --repeats 3
    python -m benchmarks.serve --url http://127.0.0.1:8000 --model-name X   # just measure a running server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import REPO_ROOT, Report, apply_isa, isa_env, set_threads


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    cached_tokens: int = 0  # prompt tokens the server says it took from its cache (when it reports them)


@dataclass
class RunResult:
    name: str
    duration: float
    requests: list[RequestResult]
    cpu_s: float = math.nan  # CPU seconds (user + system) of the contender's processes during the run

    @property
    def output_tok_per_cpu_s(self) -> float:
        """Output tokens per CPU second of the contender: its efficiency, far less sensitive to the machine's load
        than tokens per wall second (a loaded core gives every contender fewer CPU seconds per second)."""
        return self.output_tokens / self.cpu_s if self.cpu_s > 0 else math.nan

    @property
    def completed(self) -> int:
        return sum(r.ok for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests if r.ok)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration

    @property
    def request_s(self) -> float:
        return self.completed / self.duration


def make_workload(num_requests: int, vocab_size: int, seed: int, prompt_len: tuple[int, int],
                  output_len: tuple[int, int]) -> list[Job]:
    rng = random.Random(seed)
    low = min(3, vocab_size - 1)  # skip the lowest ids (special tokens in most vocabularies)
    return [Job([rng.randrange(low, vocab_size) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len))
            for _ in range(num_requests)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ------------------------------------------------------------------------------------------ the client


async def _one(client, url: str, model: str, job: Job, api_key: str | None) -> RequestResult:
    body = {"model": model, "prompt": job.prompt_ids, "max_tokens": job.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = RequestResult(ok=False)
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        if not result.output_tokens and last is not None:  # a server that sends no usage chunk: one token a chunk
            result.output_tokens = len(result.itl) + 1
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no usage chunk / no tokens"
    except Exception as e:  # a failed request is reported, not fatal
        result.error = f"{type(e).__name__}: {e}"
    return result


async def drive(url: str, model: str, jobs: list[Job], max_concurrency: int | None, request_rate: float,
                seed: int, api_key: str | None = None) -> tuple[float, list[RequestResult]]:
    """Send `jobs` (Poisson arrivals at `request_rate`/s, at most `max_concurrency` in flight)."""
    import httpx

    rng = random.Random(seed + 1)
    semaphore = asyncio.Semaphore(max_concurrency or len(jobs))
    limits = httpx.Limits(max_connections=len(jobs) + 4, max_keepalive_connections=len(jobs) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:

        async def limited(job: Job) -> RequestResult:
            async with semaphore:
                return await _one(client, url, model, job, api_key)

        tasks = []
        start = time.perf_counter()
        for job in jobs:
            tasks.append(asyncio.create_task(limited(job)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return time.perf_counter() - start, list(results)


# ------------------------------------------------------------------------------------------ contenders


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} during start-up")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server at {url} was not healthy within {timeout_s:.0f} s")


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live descendants (Linux /proc; nan elsewhere)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0.0
    try:
        for p in _descendants(pid):
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14 and 15 of stat)
    except (OSError, IndexError, ValueError):
        return math.nan
    return total


def pinned(cmd: list[str], cores: str) -> list[str]:
    """`cmd` under `taskset -c cores` (no pinning when cores is empty)."""
    return ["taskset", "-c", cores, *cmd] if cores else cmd


def start_llama_server(binary: Path, gguf: str, threads: int, parallel: int, ctx_per_slot: int, cores: str,
                       log_path: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """llama.cpp's own llama-server (built by `benchmarks/llamacpp_decode.py --setup-peers`, native or AVX2):
    continuous batching over `parallel` slots of `ctx_per_slot` tokens each, `threads` threads for decode and prompt
    processing."""
    port = free_port()
    cmd = [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--parallel", str(parallel),
           "--cont-batching", "-c", str(parallel * ctx_per_slot), "-t", str(threads), "-tb", str(threads),
           "--alias", "bench", "--no-webui"]
    log = open(log_path, "w")  # noqa: SIM115 (closed with the process)
    env = dict(os.environ if env is None else env, LD_LIBRARY_PATH=str(binary.parent))
    proc = subprocess.Popen(pinned(cmd, cores), stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 600)
    return proc, url


def model_shape(model: str) -> tuple[int, int]:
    """(vocabulary size, longest sequence) of `model` without building an engine (GGUF: its metadata)."""
    if model.endswith(".gguf"):
        from scratchlm.model.loading.gguf_file import config_from_gguf
        from scratchlm.model.loading.gguf_reader import read_gguf

        meta, tensors = read_gguf(model)
        config = config_from_gguf(meta, tensors, model)[0]
    else:
        from scratchlm.model import load

        config = load(model).config
    return config.vocab_size, config.max_seq_len


def start_scratchlm_server(model: str, threads: int, max_num_seqs: int, log_path: Path,
                           engine_process: bool = False, quantization: str | None = None,
                           cores: str = "", extra: list[str] | None = None,
                           env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`scratchlm serve` in a subprocess (environment `env`, default os.environ: e.g. an ISA cap)."""
    port = free_port()
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONPATH=str(REPO_ROOT))
    cmd = [sys.executable, "-m", "scratchlm", "serve", model, "--port", str(port), "--threads", str(threads),
           "--max-num-seqs",
           str(max_num_seqs), "--max-queue", "4096", "--log-level", "warning", "--served-model-name", "bench",
           "--engine-process" if engine_process else "--no-engine-process"]
    if quantization:
        cmd += ["--quantization", quantization]
    cmd += extra or []
    log = open(log_path, "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(pinned(cmd, cores), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 600)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def find_vllm() -> Path | None:
    for root in (REPO_ROOT, REPO_ROOT.parent):
        candidate = root / ".peers" / "vllm" / "bin" / "vllm"
        if candidate.is_file():
            return candidate
    return None


def export_for_vllm(model: str, out_dir: Path) -> Path:
    """An HF directory of `model` (weights, config.json, tokenizer.json) that vLLM loads; cached in out_dir."""
    if (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file():
        return out_dir
    from scratchlm.model import load
    from scratchlm.model.loading.export import export_hf

    loaded = load(model)
    export_hf(loaded.model, loaded.config, loaded.tokenizer, out_dir)
    tok = loaded.tokenizer
    special = {}
    for key, attr in (("bos_token", "bos_id"), ("eos_token", "eos_id")):
        if getattr(tok, attr, None) is not None:
            special[key] = tok.decode([getattr(tok, attr)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "model_max_length": 8192,
              **special}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def start_vllm_server(vllm: Path, hf_dir: Path, threads: int, max_num_seqs: int, log_path: Path
                      ) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    # `vllm serve` itself asks for the metadata of a package named "vllm" (this one is "vllm-cpu"), so run
    # the same OpenAI server through its module.
    python = vllm.parent / "python"
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir), "--port", str(port),
           "--served-model-name", "bench", "--max-num-seqs", str(max_num_seqs), "--dtype", "float32",
           "--max-model-len", "2048"]
    log = open(log_path, "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=hf_dir)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 900)
    return proc, url


def run_offline(llm, jobs: list[Job]) -> RunResult:
    from scratchlm.inference import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=j.max_tokens, ignore_eos=True) for j in jobs]
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([j.prompt_ids for j in jobs], params, use_tqdm=False)
    duration = time.perf_counter() - start
    return RunResult("offline LLM.generate", duration,
                     [RequestResult(True, output_tokens=len(o.outputs[0].token_ids)) for o in outs],
                     cpu_s=time.process_time() - cpu)


# ------------------------------------------------------------------------------------------ report


def latency_rows(name: str, run: RunResult) -> list[list[str]]:
    ok = [r for r in run.requests if r.ok]
    ttft = [r.ttft * 1e3 for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) * 1e3 for r in ok if r.output_tokens > 1]
    itl = [x * 1e3 for r in ok for x in r.itl]

    def stats(v: list[float]) -> list[str]:
        return [f"{statistics.fmean(v):.1f}", f"{statistics.median(v):.1f}", f"{percentile(v, 99):.1f}"] if v else \
            ["-", "-", "-"]

    return [[name, metric, *stats(v)] for metric, v in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=32, help="requests in flight at most")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrival rate, req/s (inf = all)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch/OpenMP threads of every contender (on a busy 2-core machine 2 threads can be "
                             "many times slower than 1)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each contender")
    parser.add_argument("--url", default=None, help="only measure this running server (no offline, no peers)")
    parser.add_argument("--model-name", default=None, help="model name for --url")
    parser.add_argument("--api-key", default=None, help="Bearer key for --url")
    placement = parser.add_mutually_exclusive_group()
    placement.add_argument("--engine-process", action="store_true",
                           help="start `scratchlm serve --engine-process` (the engine in its own process)")
    placement.add_argument("--engine-thread", action="store_true",
                           help="start `scratchlm serve` with the engine in a thread of the server (the default)")
    parser.add_argument("--no-vllm", action="store_true", help="do not start `vllm serve` even if .peers/vllm exists")
    parser.add_argument("--vllm-url", default=None,
                        help="use this running vLLM OpenAI server (model name `bench`) instead of starting one")
    parser.add_argument("--no-write", action="store_true", help="print the report without writing results/")
    parser.add_argument("--quantization", default=None,
                        help="scratchlm's weights (e.g. gguf: the GGUF's packed Q4_1 blocks); default: fp32")
    parser.add_argument("--no-llama-server", action="store_true",
                        help="do not start llama.cpp's llama-server even if .peers has it")
    parser.add_argument("--no-offline", action="store_true", help="leave out the offline LLM.generate contender")
    parser.add_argument("--isa", nargs="+", default=["native"], choices=["native", "avx2"],
                        help="ISA columns: scratchlm serve under this cap (benchmarks/common.py ISA_CAP_ENV) beside "
                             "llama-server of the matching build (.peers/llama-server-build or llama-avx2-build); "
                             "several columns run at the same time, interleaved (without the offline contender and "
                             "vLLM); one column caps this process too")
    parser.add_argument("--bind-core", type=int, default=-1,
                        help="pin the servers to cores bind_core .. bind_core + threads - 1 (-1: no pinning)")
    parser.add_argument("--results-name", default=None,
                        help="name of the results file (results/<date>-<name>.md; default: serve[-model][-placement])")
    parser.add_argument("--serve-args", default="",
                        help="more flags for `scratchlm serve`, e.g. '--max-num-batched-tokens 1024' (in the report)")
    parser.add_argument("--scheduling-ab", default=None, metavar="POLICY:BUDGET,...",
                        help="instead: offline engines with these scheduling policies and token budgets (e.g. "
                             "fcfs:512,shortest-first:512), interleaved; tokens per engine CPU s and median TTFT")
    parser.add_argument("--inspector-overhead", action="store_true",
                        help="instead: the engine's step-event cost with a listener / an inspector viewer, interleaved")
    parser.add_argument("--setup-peers", action="store_true",
                        help="build llama.cpp (both ISA builds) and the GGUF files (python -m "
                             "benchmarks.llamacpp_decode --setup-peers) and exit; vLLM: python -m "
                             "benchmarks.engine_throughput --setup-peers")
    args = parser.parse_args(argv)
    if args.setup_peers:
        from benchmarks.llamacpp_decode import setup_peers

        setup_peers()
        return 0

    if len(args.isa) == 1:
        apply_isa(args.isa[0])  # before torch's and the kernels' first use: the offline engine runs under it
    set_threads(args.threads)
    if args.url:
        import httpx

        name = args.model_name or httpx.get(args.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        vocab = int(os.environ.get("BENCH_VOCAB", "512"))
        jobs = make_workload(args.num_requests, vocab, args.seed, tuple(args.prompt_len), tuple(args.output_len))
        duration, results = asyncio.run(drive(args.url, name, jobs, args.max_concurrency, args.request_rate,
                                              args.seed, args.api_key))
        run = RunResult(args.url, duration, results)
        print(f"{run.completed}/{len(jobs)} ok, {run.output_tok_s:.1f} output tok/s, {run.request_s:.2f} req/s")
        for row in latency_rows(args.url, run):
            print(row)
        return 0

    from scratchlm.defaults import default_model_path
    from scratchlm.inference import LLM

    model = args.model or str(default_model_path())
    if args.inspector_overhead:
        return inspector_overhead(args, model)
    if args.scheduling_ab:
        return scheduling_ab(args, model)
    multi = len(args.isa) > 1
    offline = not (args.no_offline or multi)
    if offline:
        print(f"loading {model} for the offline engine ...", file=sys.stderr)
        llm = LLM(model, max_num_seqs=args.max_concurrency, quantization=args.quantization)
        vocab, max_len = llm.engine.model_config.vocab_size, llm.engine.max_model_len
    else:
        vocab, max_len = model_shape(model)

    def workload(seed: int) -> list[Job]:
        jobs = make_workload(args.num_requests, vocab, seed, tuple(args.prompt_len), tuple(args.output_len))
        return [Job(j.prompt_ids[: max_len - j.max_tokens - 1], j.max_tokens) for j in jobs]  # fit short contexts

    jobs = workload(args.seed)
    warmup = workload(args.seed + 10_000)[:4]  # prompts no repeat sends (a cached prompt would skip its prefill)
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    cores = ",".join(str(c) for c in range(args.bind_core, args.bind_core + args.threads)) if args.bind_core >= 0 \
        else ""
    if cores:
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})  # the offline engine too
    notes = []
    servers: dict[str, str] = {}
    pids: dict[str, int] = {}  # contender -> server process (its CPU time, with its children's, is measured)
    procs: list[subprocess.Popen] = []
    runs: dict[str, list[RunResult]] = {"offline LLM.generate": []} if offline else {}
    if not offline:
        notes.append("offline LLM.generate not run (" + ("several ISA columns" if multi else "--no-offline") + ").")
    pairs: dict[str, tuple[str, str]] = {}  # ISA column -> (scratchlm contender, llama-server contender)
    try:
        for isa in args.isa:
            name = "scratchlm serve" + (f" [{isa}]" if multi else "")
            log_path = tmp / f"scratchlm-bench-serve-{isa}.log"
            print(f"starting `scratchlm serve` under the {isa} cap (log: {log_path}) ...", file=sys.stderr)
            proc, servers[name] = start_scratchlm_server(model, args.threads, args.max_concurrency, log_path,
                                                         engine_process=args.engine_process,
                                                         quantization=args.quantization, cores=cores,
                                                         extra=args.serve_args.split(), env=isa_env(isa))
            pids[name] = proc.pid
            procs.append(proc)
            pairs[isa] = (name, "llama-server" + (f" [{isa}]" if multi else ""))
        notes.append("`scratchlm serve` ran its engine in " + ("its own process (--engine-process)."
                                                               if args.engine_process else "a thread of the server."))
        vllm = None if args.no_vllm or args.vllm_url or multi else find_vllm()
        if multi and not args.no_vllm:
            notes.append("`vllm serve` not run (several ISA columns).")
        elif args.vllm_url:
            servers["vllm serve"] = args.vllm_url
            notes.append(f"`vllm serve` already running at {args.vllm_url} (--vllm-url), serving an HF export of "
                         "the same weights as `bench`.")
        elif args.no_vllm:
            notes.append("`vllm serve` not run (--no-vllm).")
        elif vllm is None:
            notes.append("`vllm serve` skipped: no `.peers/vllm` virtual environment (the engine benchmark's "
                         "`--setup-peers` creates it).")
        else:
            try:
                hf_dir = export_for_vllm(model, tmp / f"scratchlm-hf-export-{Path(model).stem}")
                print(f"starting `vllm serve` on {hf_dir} (log: {tmp / 'vllm-bench-serve.log'}) ...", file=sys.stderr)
                proc, servers["vllm serve"] = start_vllm_server(vllm, hf_dir, args.threads, args.max_concurrency,
                                                                tmp / "vllm-bench-serve.log")
                pids["vllm serve"] = proc.pid
                procs.append(proc)
                notes.append(f"`vllm serve` from {vllm.parent.parent} on an HF export of the same weights (fp32).")
            except Exception as e:  # a peer that cannot start is reported, not fatal
                notes.append(f"`vllm serve` failed to start ({e}); see {tmp / 'vllm-bench-serve.log'}.")
        from benchmarks.llamacpp_decode import llama_server_binary, system_info

        for isa, (_, name) in pairs.items():
            binary = llama_server_binary(isa)
            if args.no_llama_server:
                notes.append("llama-server not run (--no-llama-server).")
                break
            if not binary.exists():
                notes.append(f"llama-server ({isa}) skipped: {binary.relative_to(REPO_ROOT)} not built (python -m "
                             "benchmarks.llamacpp_decode --setup-peers).")
                print(notes[-1], file=sys.stderr)
                continue
            if not model.endswith(".gguf"):
                notes.append("llama-server skipped: the model is not a GGUF.")
                break
            log_path = tmp / f"llama-server-bench-{isa}.log"
            try:
                ctx = args.prompt_len[1] + args.output_len[1] + 16
                proc, servers[name] = start_llama_server(binary, model, args.threads, args.max_concurrency, ctx,
                                                         cores, log_path, env=isa_env(isa))
                pids[name] = proc.pid
                procs.append(proc)
                notes.append(f"{name} ({binary.relative_to(REPO_ROOT)}) on the same GGUF: --parallel "
                             f"{args.max_concurrency} --cont-batching, -c {args.max_concurrency * ctx}, "
                             f"-t/-tb {args.threads}; its libraries' system_info: `{system_info(isa)}`.")
            except (OSError, TimeoutError, RuntimeError) as e:
                notes.append(f"{name} failed to start ({e}); see {log_path}.")
        for name in servers:
            runs[name] = []
        # warm-up every contender
        if offline:
            run_offline(llm, warmup)
        for url in servers.values():
            asyncio.run(drive(url, "bench", warmup, args.max_concurrency, math.inf, args.seed))
        for r in range(args.repeats):
            jobs = workload(args.seed + r)  # fresh prompts each repeat, the same for every contender
            line = []
            if offline:
                off = run_offline(llm, jobs)
                runs["offline LLM.generate"].append(off)
                line.append(f"offline {off.output_tok_s:.1f} tok/s ({off.output_tok_per_cpu_s:.1f} per CPU s)")
            order = list(servers.items())
            for name, url in order if r % 2 == 0 else order[::-1]:  # drift cancels over the repeats
                cpu = process_cpu_seconds(pids[name]) if name in pids else math.nan
                duration, results = asyncio.run(drive(url, "bench", jobs, args.max_concurrency, args.request_rate,
                                                      args.seed))
                cpu = process_cpu_seconds(pids[name]) - cpu if name in pids else math.nan
                run = RunResult(name, duration, results, cpu_s=cpu)
                runs[name].append(run)
                failed = [x.error for x in results if not x.ok]
                ttft = statistics.median([x.ttft for x in results if x.ok] or [math.nan])
                line.append(f"{name} {run.output_tok_s:.1f} tok/s ({run.output_tok_per_cpu_s:.1f} per CPU s), TTFT "
                            f"{1e3 * ttft:.0f} ms ({run.completed}/"
                            f"{len(jobs)} ok{', ' + failed[0] if failed else ''})")
            print(f"  repeat {r + 1}/{args.repeats}: " + ", ".join(line) + f"; load {os.getloadavg()[0]:.2f}",
                  file=sys.stderr)
    finally:
        for proc in procs:
            stop(proc)


    report = Report("serve", "OpenAI server under load against the offline engine", argv=sys.argv[1:])
    report.machine["ISA columns"] = ", ".join(args.isa)
    # one results file per model and engine placement
    report.name = ("serve" if args.model is None else f"serve-{Path(model).stem}") + \
        ("-engine-process" if args.engine_process else "-engine-thread" if args.engine_thread else "")
    report.name = args.results_name or report.name
    report.add(f"Model `{Path(model).name}`; {len(jobs)} requests, prompt lengths U{tuple(args.prompt_len)} "
               f"(random token ids, seed {args.seed} + repeat: fresh prompts every repeat), output lengths "
               f"U{tuple(args.output_len)}, `ignore_eos`, "
               f"greedy; max concurrency {args.max_concurrency}, request rate {args.request_rate}; "
               f"{args.threads} threads per contender{f' pinned to cores {cores}' if cores else ''}; "
               f"scratchlm weights: {args.quantization or 'fp32'}; {args.repeats} interleaved repeats (median and "
               f"best; the servers' order reversed on odd repeats). ISA columns: {', '.join(args.isa)} (avx2: "
               f"scratchlm serve under SCRATCHLM_ISA=avx2, ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, "
               f"MKL_ENABLE_INSTRUCTIONS=AVX2; llama-server of .peers/llama-avx2-build). Load average "
               f"at the end: {os.getloadavg()[0]:.1f}.")
    base = statistics.median(r.output_tok_s for r in runs["offline LLM.generate"]) if offline else None
    rows = []
    for name, rs in runs.items():
        toks = [r.output_tok_s for r in rs]
        reqs = [r.request_s for r in rs]
        per_cpu = [r.output_tok_per_cpu_s for r in rs]
        cpu_text = f"{statistics.median(per_cpu):.1f}" if not any(math.isnan(x) for x in per_cpu) else "-"
        rows.append([name, f"{sum(r.completed for r in rs)}/{len(jobs) * len(rs)}", f"{statistics.median(toks):.1f}",
                     f"{max(toks):.1f}", f"{statistics.median(reqs):.3f}",
                     f"{statistics.median(toks) / base:.3f}" if base else "-",
                     cpu_text, f"{statistics.median(r.cpu_s / r.duration for r in rs):.2f}"])
    report.table(["contender", "completed", "output tok/s (median)", "output tok/s (best)", "req/s (median)",
                  "ratio to offline (median)", "output tok per CPU s (median)", "CPU s per wall s"], rows,
                 caption="Throughput (CPU s: user + system of the contender's processes during the run; the client "
                         "is not counted)")
    latency = []
    for name in servers:
        rs = runs[name]
        median_run = sorted(rs, key=lambda r: r.output_tok_s)[len(rs) // 2]
        latency += latency_rows(name, median_run)
    report.table(["contender", "metric (ms)", "mean", "median", "p99"], latency,
                 caption="Latency of each server's median run (vLLM definitions)")
    prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
    report.add("Prompt tokens a server reported as taken from its cache, per run (of ~"
               f"{prompt_tokens} sent): " + "; ".join(
                   f"{name}: {', '.join(str(sum(x.cached_tokens for x in r.requests)) for r in runs[name])}"
                   for name in servers) + " (scratchlm's usage does not report it; its prompts share no 16-token "
               "block).")
    if offline:
        ratio = statistics.median(r.output_tok_s for r in runs["scratchlm serve"]) / base
        report.add(f"**Server / offline output throughput: {ratio:.3f}x** (target >= 0.9x).")
    rows = []
    for isa, (ours_name, theirs_name) in pairs.items():
        if not runs.get(theirs_name):
            continue
        ours, theirs = runs[ours_name], runs[theirs_name]
        per = [a.output_tok_s / b.output_tok_s for a, b in zip(ours, theirs)]
        per_cpu = [a.output_tok_per_cpu_s / b.output_tok_per_cpu_s for a, b in zip(ours, theirs)]

        def ttft(rs):
            return statistics.median(statistics.median(x.ttft for x in r.requests if x.ok) for r in rs)

        ratio = statistics.median(per)
        rows.append([isa, f"{statistics.median(r.output_tok_s for r in ours):.1f}",
                     f"{statistics.median(r.output_tok_s for r in theirs):.1f}", f"**{ratio:.2f}x**",
                     ", ".join(f"{x:.2f}" for x in per), "met" if ratio >= 2.0 else "MISSED",
                     f"{1e3 * ttft(ours):.0f} vs {1e3 * ttft(theirs):.0f}", f"{statistics.median(per_cpu):.2f}x"])
    if rows:
        report.table(["ISA", "scratchlm serve output tok/s (median)", "llama-server (median)",
                      "ratio (median of paired repeats)", "per repeat", "target >= 2.0x",
                      "median TTFT, ms (scratchlm vs llama-server)", "output tok per CPU s ratio (median)"], rows,
                     caption="scratchlm serve against llama-server on the same GGUF")
    if "vllm serve" in runs and runs["vllm serve"]:
        ours = statistics.median(r.output_tok_s for r in runs["scratchlm serve"])
        theirs = statistics.median(r.output_tok_s for r in runs["vllm serve"])
        report.add(f"**scratchlm serve / vllm serve output throughput: {ours / theirs:.3f}x** (target >= 1.0x).")
    report.add("\n".join(f"- {n}" for n in notes))
    if args.no_write:
        print(report.render())
    else:
        report.write()
    return 0


# ------------------------------------------------------------------------------------------ scheduling A/B


def scheduling_ab(args: argparse.Namespace, model: str) -> int:
    """`--scheduling-ab`: the same workload through offline engines that differ only in scheduling policy and token
    budget, interleaved (A B C, A B C, ...; fresh prompts every repeat). Measured on the engine thread's CPU clock
    (`time.thread_time`, 1 thread: the work itself, not the machine's load): output tokens per CPU second, and each
    request's TTFT as the engine CPU seconds spent from the start of the run until the step that sampled its first
    token (all requests are submitted at once, as the benchmark's wave of 32 clients)."""
    from scratchlm.inference import LLM, SamplingParams

    configs = []
    for item in args.scheduling_ab.split(","):
        policy, _, budget = item.partition(":")
        configs.append((policy, int(budget or 512)))
    llms = {c: LLM(model, max_num_seqs=args.max_concurrency, quantization=args.quantization, scheduling_policy=c[0],
                   max_num_batched_tokens=c[1]) for c in configs}
    engine = next(iter(llms.values())).engine
    vocab, max_len = engine.model_config.vocab_size, engine.max_model_len

    def workload(seed: int) -> list[Job]:
        jobs = make_workload(args.num_requests, vocab, seed, tuple(args.prompt_len), tuple(args.output_len))
        return [Job(j.prompt_ids[: max_len - j.max_tokens - 1], j.max_tokens) for j in jobs]

    def run(llm, jobs: list[Job]) -> tuple[float, float, float]:
        eng = llm.engine
        first: dict[str, float] = {}
        spent = [0.0]
        step = eng.step

        def timed_step():
            t = time.thread_time()
            outs = step()
            spent[0] += time.thread_time() - t
            for o in outs:
                if o.outputs and o.outputs[0].token_ids:
                    first.setdefault(o.request_id, spent[0])
            return outs

        eng.step = timed_step
        try:
            params = [SamplingParams(temperature=0.0, max_tokens=j.max_tokens, ignore_eos=True) for j in jobs]
            t0, c0 = time.perf_counter(), time.thread_time()
            outs = llm.generate([j.prompt_ids for j in jobs], params, use_tqdm=False)
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        finally:
            del eng.step
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return tokens / cpu, statistics.median(first.values()), tokens / wall

    warm = workload(args.seed + 10_000)[:4]
    for llm in llms.values():
        run(llm, warm)
    res: dict[tuple[str, int], list[tuple[float, float, float]]] = {c: [] for c in configs}
    for r in range(args.repeats):
        jobs = workload(args.seed + r)
        for c, llm in llms.items():
            res[c].append(run(llm, jobs))
        print(f"  repeat {r + 1}/{args.repeats}: " + ", ".join(
            f"{p}:{b} {v[-1][0]:.1f} tok/CPU-s, TTFT {v[-1][1]:.2f} CPU-s" for (p, b), v in res.items())
            + f"; load {os.getloadavg()[0]:.2f}", file=sys.stderr)

    report = Report("serve", "Scheduling policy and token budget, offline, interleaved", argv=sys.argv[1:])
    report.name = args.results_name or "serve-scheduling-ab"
    report.add(f"Model `{Path(model).name}`, weights {args.quantization or 'fp32'}; {args.num_requests} requests "
               f"submitted at once, prompt lengths U{tuple(args.prompt_len)} (random ids, fresh every repeat), output "
               f"lengths U{tuple(args.output_len)}, greedy, `ignore_eos`; {args.threads} thread(s); {args.repeats} "
               "interleaved repeats. Clock: the engine thread's CPU time (the machine is shared; wall time is given "
               f"for reference). Load average at the end: {os.getloadavg()[0]:.1f}.")
    base = configs[0]
    rows = []
    for c, v in res.items():
        tok = statistics.median(x[0] for x in v)
        ttft = statistics.median(x[1] for x in v)
        rows.append([f"{c[0]}, budget {c[1]}", f"{tok:.1f}", f"{tok / statistics.median(x[0] for x in res[base]):.3f}",
                     f"{ttft:.2f}", f"{ttft / statistics.median(x[1] for x in res[base]):.3f}",
                     ", ".join(f"{x[1]:.2f}" for x in v), f"{statistics.median(x[2] for x in v):.1f}"])
    report.table(["policy, token budget", "output tok per CPU s (median)", "ratio", "median TTFT, CPU s (median)",
                  "ratio", "median TTFT per repeat", "output tok/s wall (median)"], rows,
                 caption=f"Against the first row ({base[0]}, budget {base[1]})")
    if args.no_write:
        print(report.render())
    else:
        report.write()
    return 0


# ------------------------------------------------------------------------------------------ inspector overhead


def _events_listener(event) -> None:
    event.to_dict()  # what the server's inspector hub does in the engine thread for every step


def _thread_cpu_s(thread) -> float:
    """CPU seconds of `thread` (a threading.Thread) so far: its own clock (Linux), not the process's."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def overhead_ci(without: list[float], with_: list[float], cost: bool) -> tuple[float, float, float]:
    """(overhead, low, high) with a 95 % t-interval from interleaved pairs: the mean of log(with / without) over
    the pairs (a cost such as CPU per token: overhead = ratio - 1; a rate such as tok/s: overhead = 1 - ratio)."""
    from scipy import stats

    logs = [math.log(b / a) for a, b in zip(without, with_)]
    n, mean = len(logs), statistics.fmean(logs)
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(logs) / math.sqrt(n) if n > 1 else math.inf
    lo, hi = math.exp(mean - half), math.exp(mean + half)
    if cost:
        return math.exp(mean) - 1, lo - 1, hi - 1
    return 1 - math.exp(mean), 1 - hi, 1 - lo


def inspector_overhead(args: argparse.Namespace, model: str) -> int:
    """`--inspector-overhead`: the cost of the engine's step events while someone listens, interleaved.

    Two pairs, each run A B, B A, ... (`--repeats` pairs) on one warm engine per pair, same workload, prefix cache
    reset before every run:
    - offline: `LLM.generate` without a listener, and with the inspector hub's listener (`event.to_dict()`);
    - server: an in-process `scratchlm serve` app (engine thread) without a viewer, and with `curl -N` reading
      `/inspector/events` in another process (the hub subscribed: `to_dict` and `call_soon_threadsafe` on the
      engine thread, JSON and SSE writes on the event loop).
    Per run: output tok/s (wall), the engine thread's own CPU seconds per output token (offline the main thread,
    served the engine loop's thread: its clock, so the machine's load, which takes wall time, not the thread's
    work, matters far less), and the whole process's CPU per token (server plus the in-process load driver,
    identical in both arms). The overheads are the mean of the log pair ratios with a 95 % t-interval."""
    import shutil

    from scratchlm.inference import LLM
    from scratchlm.server import BackgroundServer, ServerConfig, create_app

    llm = LLM(model, max_num_seqs=args.max_concurrency)
    engine = llm.engine
    vocab, max_len = engine.model_config.vocab_size, engine.max_model_len
    jobs = make_workload(args.num_requests, vocab, args.seed, tuple(args.prompt_len), tuple(args.output_len))
    jobs = [Job(j.prompt_ids[: max_len - j.max_tokens - 1], j.max_tokens) for j in jobs]
    arms = ("offline", "offline + listener", "serve", "serve + viewer")
    wall: dict[str, list[float]] = {k: [] for k in arms}  # output tok/s
    cpu_tok: dict[str, list[float]] = {k: [] for k in arms}  # engine-thread CPU s per output token
    proc_tok: dict[str, list[float]] = {k: [] for k in arms}  # process CPU s per output token
    steps: dict[str, list[int]] = {k: [] for k in arms}
    curl = shutil.which("curl")

    direct: list[float] = []  # per listened run: CPU s of building the events + the listener, per output token
    build = engine.events._build  # the event's construction (after each step, on the engine thread)

    def offline(listen: bool) -> None:
        arm = "offline + listener" if listen else "offline"
        engine.reset_prefix_cache()
        spent = [0.0]
        if listen:
            def timed_build(*a, **k):
                t0 = time.thread_time()
                try:
                    return build(*a, **k)
                finally:
                    spent[0] += time.thread_time() - t0

            def timed_listener(event) -> None:
                t0 = time.thread_time()
                _events_listener(event)
                spent[0] += time.thread_time() - t0

            engine.events._build = timed_build  # instance attribute: the direct cost of what listening adds
            engine.events.subscribe(timed_listener)
        before = engine.events.steps  # counts the steps it observed (with the listener)
        try:
            t, p = time.thread_time(), time.process_time()  # torch runs on this thread (1 thread)
            result = run_offline(llm, jobs)
            cpu, proc = time.thread_time() - t, time.process_time() - p
        finally:
            if listen:
                engine.events.unsubscribe(timed_listener)
                del engine.events._build
        if listen:
            direct.append(spent[0] / result.output_tokens)
        wall[arm].append(result.output_tok_s)
        cpu_tok[arm].append(cpu / result.output_tokens)
        proc_tok[arm].append(proc / result.output_tokens)
        if listen:
            steps[arm].append(engine.events.steps - before)

    run_offline(llm, jobs[:4])  # warm-up
    served = LLM(model, max_num_seqs=args.max_concurrency).engine  # the server's own: its thread steps it
    app = create_app(served, ServerConfig(), model_name="bench")
    with BackgroundServer(app) as srv:
        engine_thread = app.state.server.loop._thread

        def serve(view: bool) -> None:
            arm = "serve + viewer" if view else "serve"
            served.reset_prefix_cache()  # the engine thread is idle between runs
            viewer = None
            if view:
                viewer = subprocess.Popen([curl, "-sN", srv.url + "/inspector/events"], stdout=subprocess.DEVNULL)
                deadline = time.monotonic() + 60
                while served.events.num_listeners == 0 and time.monotonic() < deadline:
                    time.sleep(0.02)
                if served.events.num_listeners == 0:
                    raise RuntimeError("the inspector viewer never subscribed")
            try:
                before = served.events.steps
                t, p = _thread_cpu_s(engine_thread), time.process_time()
                duration, results = asyncio.run(drive(srv.url, "bench", jobs, args.max_concurrency, math.inf,
                                                      args.seed))
                cpu, proc = _thread_cpu_s(engine_thread) - t, time.process_time() - p
                run = RunResult("serve", duration, results)
                wall[arm].append(run.output_tok_s)
                cpu_tok[arm].append(cpu / run.output_tokens)
                proc_tok[arm].append(proc / run.output_tokens)
                if view:
                    steps[arm].append(served.events.steps - before)
            finally:
                if viewer is not None:
                    viewer.terminate()
                    viewer.wait(10)
                    deadline = time.monotonic() + 30
                    while served.events.num_listeners and time.monotonic() < deadline:
                        time.sleep(0.02)

        asyncio.run(drive(srv.url, "bench", jobs[:4], args.max_concurrency, math.inf, args.seed))  # warm-up
        for r in range(args.repeats):
            order = (False, True) if r % 2 == 0 else (True, False)  # A B, then B A: drift cancels in the pairs
            for listen in order:
                offline(listen)
            if curl is not None:
                for view in order:
                    serve(view)
            print(f"  pair {r + 1}/{args.repeats}: " + ", ".join(
                f"{k} {wall[k][-1]:.1f} tok/s {1e3 * cpu_tok[k][-1]:.2f} ms CPU/tok" for k in arms if wall[k])
                + f"; load {os.getloadavg()[0]:.2f}", file=sys.stderr)

    report = Report("serve", "Cost of the engine's step events (the inspector) while someone listens",
                    argv=sys.argv[1:])
    report.name = "serve-inspector-overhead" + ("" if args.model is None else f"-{Path(model).stem}")
    report.add(f"Model `{Path(model).name}`; {len(jobs)} requests, prompt lengths U{tuple(args.prompt_len)}, output "
               f"lengths U{tuple(args.output_len)}, greedy, `ignore_eos`, {args.max_concurrency} concurrent; "
               f"{args.threads} torch thread(s); {args.repeats} pairs per mode, run A B then B A alternately "
               "(interleaved), prefix cache reset before every run. Overheads: the mean of log(with / without) "
               "over the pairs, with its 95 % t-interval.")

    def pct(o: tuple[float, float, float]) -> str:
        return f"{100 * o[0]:+.2f} % [{100 * o[1]:+.2f}, {100 * o[2]:+.2f}]"

    pairs = [(base, other) for base, other in (("offline", "offline + listener"), ("serve", "serve + viewer"))
             if wall[base]]
    rows = []
    for base, other in pairs:
        a, b = wall[base], wall[other]
        ratios = [y / x for x, y in zip(a, b)]
        rows.append([base, f"{statistics.median(a):.1f}", other, f"{statistics.median(b):.1f}", len(a),
                     pct(overhead_ci(a, b, cost=False)), f"{min(ratios):.3f}-{max(ratios):.3f}"])
    report.table(["without", "output tok/s (median)", "with", "output tok/s (median)", "pairs",
                  "throughput overhead (mean, 95 % CI)", "pair ratios with/without (range)"], rows,
                 caption="Throughput with / without (wall clock)")
    rows, verdicts = [], {}
    for base, other in pairs:
        a, b = cpu_tok[base], cpu_tok[other]
        o = overhead_ci(a, b, cost=True)
        verdicts[base] = o
        ratios = [y / x for x, y in zip(a, b)]
        n_steps = statistics.median(steps[other]) if steps[other] else None
        per_step = "" if not n_steps else \
            f"{1e6 * (statistics.median(b) - statistics.median(a)) * served_tokens(jobs) / n_steps:.0f} us"
        rows.append([base, other, len(a), f"{1e3 * statistics.median(a):.3f}", f"{1e3 * statistics.median(b):.3f}",
                     pct(o), f"{min(ratios):.3f}-{max(ratios):.3f}",
                     pct(overhead_ci(proc_tok[base], proc_tok[other], cost=True)), per_step or "-"])
    report.table(["without", "with", "pairs", "engine-thread CPU ms / token, without (median)", "with (median)",
                  "engine-thread CPU overhead (mean, 95 % CI)", "pair ratios (range)",
                  "process CPU per token overhead (mean, 95 % CI; includes the load driver)",
                  "listener CPU per step"], rows,
                 caption="Engine-thread CPU time per output token (the thread's own clock: the work itself, far less "
                         "sensitive to the machine's load than wall time)")
    if direct:
        base = statistics.median(cpu_tok["offline"])
        shares = [d / base for d in direct]
        report.table(["runs", "event build + listener CPU ms / token (median)", "share of the engine's CPU per token "
                      "without a listener (median)", "range"],
                     [[len(direct), f"{1e3 * statistics.median(direct):.3f}",
                       f"{100 * statistics.median(shares):.2f} %",
                       f"{100 * min(shares):.2f}-{100 * max(shares):.2f} %"]],
                     caption="Direct cost, offline: the thread CPU time inside the event's construction and the "
                             "listener (timed around them in the listened runs; the stage timers are not included)")
    if verdicts:
        def verdict(o: tuple[float, float, float]) -> str:
            if o[2] < 0.02:
                return "met: the whole 95 % interval is below 2 %"
            if o[1] >= 0.02:
                return "missed: the whole 95 % interval is above 2 %"
            return "not established: the 95 % interval spans 2 % (the pairs' noise is wider than the target)"

        report.table(["mode", "engine-thread CPU per token overhead (mean, 95 % CI)", "target", "status"],
                     [[k, pct(o), "< 2 %", verdict(o)] for k, o in verdicts.items()],
                     caption="Verdict: the cost of listening on the engine's own thread")
        text = "; ".join(f"{k}: {pct(o)}, {verdict(o)}" for k, o in verdicts.items())
        report.add(f"**Overhead of listening, engine-thread CPU per token: {text}** (target < 2 %). Without a "
                   "listener the engine checks one attribute per step and builds nothing. Wall-clock pairs on a "
                   "shared machine swing with its load (see the ranges); the thread's CPU clock is the measurement of "
                   "the engine's own cost.")
    if curl is None:
        report.add("The server pair was skipped: no `curl` to read `/inspector/events` from another process.")
    if args.no_write:
        print(report.render())
    else:
        report.write()
    return 0


def served_tokens(jobs: list[Job]) -> int:
    """Output tokens of one run of `jobs` (greedy, ignore_eos: each job's max_tokens)."""
    return sum(j.max_tokens for j in jobs)


if __name__ == "__main__":
    sys.exit(main())
