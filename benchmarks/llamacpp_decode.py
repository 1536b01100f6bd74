"""Batch-1 decode on the same GGUF: scratchlm (fp32, int8, int4, packed GGUF) against llama.cpp, side by side.

    python -m benchmarks.llamacpp_decode --setup-peers   # build llama-cpp-python into .peers/llamacpp (~20 min)
    python -m benchmarks.llamacpp_decode [--rounds 5] [--tokens 64]

llama.cpp runs in its own virtual environment (.peers/llamacpp) as a long-lived worker process that loads
SmolLM2-135M-Instruct.Q4_1.gguf with n_threads = 1 and times `--tokens` greedy decode steps (`Llama.eval` of
one token, argmax of its logits) after a 16-token prompt; scratchlm times the same number of decode steps
through `LLMEngine` after the same prompt. Both are pinned to the same core and run interleaved
(scratchlm variants, llama.cpp, again), best and median of `--rounds`. A missing peer is a note.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import REPO_ROOT, Report, set_threads

VENV = REPO_ROOT / ".peers" / "llamacpp"
PROMPT_IDS = list(range(100, 116))

WORKER = r'''
import json, sys, time
import numpy as np
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=1, n_threads_batch=1, n_ctx=512, verbose=False)
prompt = json.loads(sys.argv[2])
print("READY", flush=True)
for line in sys.stdin:
    n = int(line)
    llm.reset()
    llm.eval(prompt)
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    ids = [tok]
    t0 = time.perf_counter()
    for _ in range(n):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        ids.append(tok)
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "ids": ids}), flush=True)
'''


class LlamaCppWorker:
    """llama.cpp in .peers/llamacpp, timing `n` decode steps per request on stdin."""

    def __init__(self, gguf: str, core: int):
        script = REPO_ROOT / ".peers" / "llamacpp_worker.py"
        script.write_text(WORKER)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [str(VENV / "bin" / "python"), str(script), gguf, json.dumps(PROMPT_IDS)]
        if core >= 0:
            cmd = ["taskset", "-c", str(core), *cmd]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for line in self.proc.stdout:
            if line.startswith("READY"):
                return
        raise RuntimeError("the llama.cpp worker exited before it was ready")

    def decode_tok_s(self, n: int) -> tuple[float, list[int]]:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                res = json.loads(line[7:])
                return n / res["seconds"], res["ids"]
        raise RuntimeError("the llama.cpp worker died")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def setup_peers() -> None:
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=ON", CMAKE_BUILD_PARALLEL_LEVEL="2")
    subprocess.run([str(VENV / "bin" / "pip"), "install", "llama-cpp-python"], check=True, env=env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup-peers", action="store_true", help="build llama-cpp-python into .peers/llamacpp and exit")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed per measurement")
    ap.add_argument("--bind-core", type=int, default=0, help="pin every contender to this core; -1: no pinning")
    args = ap.parse_args(argv)
    if args.setup_peers:
        setup_peers()
        return 0
    set_threads(1)
    if args.bind_core >= 0:
        os.sched_setaffinity(0, {args.bind_core})
    from scratchlm.defaults import default_model_path
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from scratchlm.inference.quantization import load_gguf_packed, quantize_model
    from scratchlm.model import load

    path = default_model_path()
    ref = load(path)
    models = {"scratchlm fp32": ref.model, "scratchlm int8": quantize_model(ref.model, "int8"),
              "scratchlm int4-g32-sym": quantize_model(ref.model, "int4-g32-sym"),
              "scratchlm gguf-packed (Q4_1)": load_gguf_packed(path).model}
    engines = {n: LLMEngine(m, ref.tokenizer, ref.config, EngineConfig(max_num_seqs=1, kv_cache_memory=64 << 20))
               for n, m in models.items()}
    counter = iter(range(10**9))

    def scratchlm_tok_s(engine) -> float:
        engine.add_request(str(next(counter)), PROMPT_IDS,
                           SamplingParams(temperature=0, max_tokens=args.tokens + 1, ignore_eos=True))
        engine.step()  # prefill + first token
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return args.tokens / (time.perf_counter() - t0)

    contenders = {n: (lambda e=e: scratchlm_tok_s(e)) for n, e in engines.items()}
    notes = []
    worker = None
    if (VENV / "bin" / "python").exists():
        worker = LlamaCppWorker(str(path), args.bind_core)
        contenders["llama.cpp (Q4_1, llama-cpp-python)"] = lambda: worker.decode_tok_s(args.tokens)[0]
    else:
        notes.append("llama.cpp skipped: no .peers/llamacpp (run with --setup-peers; it builds for ~20 min)")
    for fn in contenders.values():
        fn()  # warm-up
    rates: dict[str, list[float]] = {n: [] for n in contenders}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name, fn in contenders.items():
            rates[name].append(fn())
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()), file=sys.stderr)
    if worker is not None:
        worker.close()
    peer = "llama.cpp (Q4_1, llama-cpp-python)"
    ref_rate = statistics.median(rates[peer]) if peer in rates else None
    rows = []
    for name, rs in rates.items():
        med = statistics.median(rs)
        rows.append([name, f"{med:.1f}", f"{max(rs):.1f}", f"{med / ref_rate:.2f}x" if ref_rate else "n/a"])
    report = Report("llamacpp_decode", "Batch-1 decode against llama.cpp on the same GGUF", argv or sys.argv[1:])
    report.add(f"Model `{path.name}`; {args.tokens} greedy decode steps after a {len(PROMPT_IDS)}-token prompt; one "
               f"thread per contender{f', all pinned to core {args.bind_core}' if args.bind_core >= 0 else ''}; "
               f"{args.rounds} interleaved rounds. Load average during the run: "
               f"{min(loads):.1f}-{max(loads):.1f}.")
    report.table(["contender", "decode tok/s (median)", "decode tok/s (best)", "vs llama.cpp (median)"], rows)
    if notes:
        report.add("\n".join(f"- {n}" for n in notes))
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
