"""Batch-1 decode on the same GGUF: scratchlm (fp32, int8, packed GGUF Q4_1 / Q8_0) against llama.cpp, side by side.

    python -m benchmarks.llamacpp_decode --setup-peers   # build llama.cpp + llama-server into .peers (~20 min)
    python -m benchmarks.llamacpp_decode [--rounds 5] [--tokens 64] [--threads 1]

--setup-peers downloads the llama-cpp-python sdist (pip, no binary) into .peers/, builds the llama.cpp sources it
vendors with CMake (CPU only, -DGGML_NATIVE=ON, -DLLAMA_CURL=OFF, shared libraries, target llama-server) into
.peers/llama-server-build, and makes .peers/llamacpp a virtual environment whose `llama_cpp` package is the
sdist's Python code on those libraries (LLAMA_CPP_LIB_PATH): one build serves the batch-1 peer here and
llama-server in benchmarks/serve.py. It then writes a Q8_0 GGUF of the default model with llama.cpp's own
quantizer (`llama_cpp.llama_model_quantize`) for the int8 comparison.

llama.cpp runs as a long-lived worker process per GGUF (Q4_1 and Q8_0) with n_threads = --threads and times
`--tokens` greedy decode steps (`Llama.eval` of one token, argmax of its logits) after a 16-token prompt; scratchlm
times the same number of decode steps through `LLMEngine` after the same prompt. All are pinned to the same cores
and run interleaved, best and median of `--rounds`. A plain streaming read (torch.sum of 256 MiB) is timed in every
round too, so each contender's GB/s (bytes of weights read per token x tok/s) can be read against it.
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

from benchmarks.common import REPO_ROOT, Report, set_threads

PEERS = REPO_ROOT / ".peers"
VENV = PEERS / "llamacpp"
SDIST_VERSION = "0.3.36"
SDIST_DIR = PEERS / f"llama_cpp_python-{SDIST_VERSION}"
BUILD = PEERS / "llama-server-build"
LIB_DIR = BUILD / "bin"
LLAMA_SERVER = LIB_DIR / "llama-server"
Q8_0_GGUF = PEERS / "SmolLM2-135M-Instruct.Q8_0.gguf"
PROMPT_IDS = list(range(100, 116))

WORKER = r'''
import json, sys, time
import numpy as np
from llama_cpp import Llama
threads = int(sys.argv[3])
llm = Llama(model_path=sys.argv[1], n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
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
    """llama.cpp in .peers/llamacpp, timing `n` decode steps per request on stdin (or what `script` times, one
    request line in, one ``RESULT {json}`` line out: benchmarks/quant_speed.py's prompt processing)."""

    def __init__(self, gguf: str, cores: str, threads: int = 1, script: str = WORKER,
                 script_name: str = "llamacpp_worker.py"):
        path = REPO_ROOT / ".peers" / script_name
        path.write_text(script)
        script = path
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), LLAMA_CPP_LIB_PATH=str(LIB_DIR))
        cmd = [str(VENV / "bin" / "python"), str(script), gguf, json.dumps(PROMPT_IDS), str(threads)]
        if cores:
            cmd = ["taskset", "-c", cores, *cmd]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for line in self.proc.stdout:
            if line.startswith("READY"):
                return
        raise RuntimeError("the llama.cpp worker exited before it was ready")

    def request(self, line: str) -> dict:
        """Send one request line; the worker's JSON result."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        for out in self.proc.stdout:
            if out.startswith("RESULT "):
                return json.loads(out[7:])
        raise RuntimeError("the llama.cpp worker died")

    def decode_tok_s(self, n: int) -> tuple[float, list[int]]:
        res = self.request(str(n))
        return n / res["seconds"], res["ids"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def setup_peers() -> None:
    """Build llama.cpp (from the llama-cpp-python sdist's vendored sources) and the peer venv; see the docstring."""
    PEERS.mkdir(exist_ok=True)
    sdist = PEERS / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={SDIST_VERSION}", "-d", str(PEERS)], check=True)
    if not SDIST_DIR.exists():
        subprocess.run(["tar", "xzf", str(sdist), "-C", str(PEERS)], check=True)
    if not LLAMA_SERVER.exists():
        src = SDIST_DIR / "vendor" / "llama.cpp"
        subprocess.run(["cmake", "-S", str(src), "-B", str(BUILD), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                        "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON"], check=True)
        subprocess.run(["nice", "cmake", "--build", str(BUILD), "-j", str(os.cpu_count() or 2),
                        "--target", "llama-server"], check=True)
    if not (VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "numpy", "diskcache", "jinja2", "typing-extensions"],
                       check=True)
        site = next((VENV / "lib").glob("python3*/site-packages"))
        (site / "llama_cpp_src.pth").write_text(str(SDIST_DIR) + "\n")  # the sdist's pure-Python llama_cpp
    if not Q8_0_GGUF.exists():
        from scratchlm.defaults import default_model_path

        code = ("import ctypes, sys, llama_cpp as l\n"
                "p = l.llama_model_quantize_default_params()\n"
                "p.ftype = l.LLAMA_FTYPE_MOSTLY_Q8_0\n"
                "p.allow_requantize = True\n"
                "p.nthread = 2\n"
                "rc = l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p))\n"
                "sys.exit(rc)\n")
        env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(LIB_DIR))
        subprocess.run([str(VENV / "bin" / "python"), "-c", code, str(default_model_path()), str(Q8_0_GGUF)],
                       check=True, env=env)


def stream_gbps(buf) -> float:
    """GB/s of one plain streaming read (torch.sum) of `buf`, larger than any cache."""
    t0 = time.perf_counter()
    buf.sum()
    return buf.numel() * buf.element_size() / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup-peers", action="store_true", help="build llama.cpp into .peers and exit")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed per measurement")
    ap.add_argument("--threads", type=int, default=1, help="threads of every contender")
    ap.add_argument("--bind-core", type=int, default=0,
                    help="pin every contender to cores bind_core .. bind_core + threads - 1; -1: no pinning")
    ap.add_argument("--no-fp32", action="store_true", help="leave out the fp32 scratchlm contender")
    args = ap.parse_args(argv)
    if args.setup_peers:
        setup_peers()
        return 0
    set_threads(args.threads)
    cores = ""
    if args.bind_core >= 0:
        core_set = set(range(args.bind_core, args.bind_core + args.threads))
        os.sched_setaffinity(0, core_set)
        cores = ",".join(map(str, sorted(core_set)))
    import torch

    from scratchlm.defaults import default_model_path
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from scratchlm.inference.quantization import load_gguf_packed, quantize_model
    from scratchlm.model import load

    path = default_model_path()
    ref = load(path)
    models = {} if args.no_fp32 else {"scratchlm fp32": ref.model}
    models["scratchlm int8 (per channel)"] = quantize_model(ref.model, "int8")
    models["scratchlm gguf Q4_1 (packed)"] = load_gguf_packed(path).model
    if Q8_0_GGUF.exists():
        models["scratchlm gguf Q8_0 (packed)"] = load_gguf_packed(Q8_0_GGUF).model

    def weight_bytes(m) -> int:  # what a decode step reads: every weight but the embedding table (one row read)
        seen, total = set(), 0
        emb = {id(t) for t in m.tok_embeddings.buffers()} | {id(t) for t in m.tok_embeddings.parameters()}
        head = getattr(m, "output_head", None)
        head_ids = set() if head is None else {id(t) for t in head.buffers()}
        tied = getattr(m, "lm_head", None) is None and head is None
        for t in list(m.parameters()) + list(m.buffers()):
            if t.data_ptr() in seen or (id(t) in emb and id(t) not in head_ids and not tied):
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return total

    mbytes = {n: weight_bytes(m) for n, m in models.items()}
    engines = {n: LLMEngine(m, ref.tokenizer, ref.config, EngineConfig(max_num_seqs=1, kv_cache_memory=64 << 20))
               for n, m in models.items()}
    fused = {n: e.runner.fused_decoder is not None for n, e in engines.items()}
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
    workers = []
    if (VENV / "bin" / "python").exists() and LIB_DIR.exists():
        for label, gguf in (("Q4_1", path), ("Q8_0", Q8_0_GGUF)):
            if not Path(gguf).exists():
                notes.append(f"llama.cpp {label} skipped: {gguf} missing (run --setup-peers)")
                continue
            w = LlamaCppWorker(str(gguf), cores, args.threads)
            workers.append(w)
            contenders[f"llama.cpp {label}"] = lambda w=w: w.decode_tok_s(args.tokens)[0]
            mbytes[f"llama.cpp {label}"] = None
    else:
        notes.append("llama.cpp skipped: no .peers/llamacpp (run with --setup-peers; it builds for ~20 min)")
    for fn in contenders.values():
        fn()  # warm-up
    buf = torch.ones(64 << 20)  # 256 MiB
    rates: dict[str, list[float]] = {n: [] for n in contenders}
    streams: list[float] = []
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        streams.append(stream_gbps(buf))
        for name, fn in contenders.items():
            rates[name].append(fn())
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()), file=sys.stderr)
    for w in workers:
        w.close()
    stream = statistics.median(streams)
    peer_of = {"scratchlm gguf Q4_1 (packed)": "llama.cpp Q4_1", "scratchlm gguf Q8_0 (packed)": "llama.cpp Q8_0",
               "scratchlm int8 (per channel)": "llama.cpp Q8_0", "scratchlm fp32": "llama.cpp Q4_1"}
    rows = []
    for name, rs in rates.items():
        med = statistics.median(rs)
        peer = peer_of.get(name)
        ratio = f"{med / statistics.median(rates[peer]):.2f}x vs {peer}" if peer in rates else ""
        mb = mbytes.get(name)
        gbps = f"{mb * med / 1e9:.1f} ({100 * mb * med / 1e9 / stream:.0f} %)" if mb else ""
        rows.append([name, f"{med:.1f}", f"{max(rs):.1f}", ratio, f"{mb / 2**20:.0f}" if mb else "",
                     gbps, {True: "yes", False: "no"}.get(fused.get(name), "")])
    report = Report("llamacpp_decode", "Batch-1 decode against llama.cpp on the same GGUF", argv or sys.argv[1:])
    report.name = f"llamacpp_decode-{args.threads}t"  # one results file per thread count
    report.add(f"Model `{path.name}` (Q8_0: `{Q8_0_GGUF.name}`, made by llama.cpp's quantizer from it); "
               f"{args.tokens} greedy decode steps after a {len(PROMPT_IDS)}-token prompt; {args.threads} thread(s) "
               f"per contender{f', all pinned to cores {cores}' if cores else ''}; {args.rounds} interleaved rounds. "
               f"Streaming read (torch.sum of 256 MiB) in the same rounds: median {stream:.1f} GB/s "
               f"(best {max(streams):.1f}). Load average during the run: {min(loads):.1f}-{max(loads):.1f}.")
    report.table(["contender", "decode tok/s (median)", "decode tok/s (best)", "ratio (median)",
                  "MiB read / token", "GB/s (% of streaming read)", "fused C++ step"], rows)
    if notes:
        report.add("\n".join(f"- {n}" for n in notes))
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
