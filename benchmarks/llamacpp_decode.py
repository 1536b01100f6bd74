"""Batch-1 decode on the same GGUF: scratchlm (packed GGUF Q4_K_M / Q4_1 / Q8_0, int8) against llama.cpp, side by
side, one pinned thread then two, under the native ISA and under an AVX2 cap.

    python -m benchmarks.llamacpp_decode --setup-peers   # build llama.cpp twice + make the GGUF files (~1 h, 2 cores)
    python -m benchmarks.llamacpp_decode [--rounds 5] [--tokens 64] [--threads 1 2] [--isa native avx2]

--setup-peers downloads the llama-cpp-python sdist (pip, no binary) into .peers/ and builds the llama.cpp sources
it vendors with CMake (CPU only, LLAMA_CURL=OFF, shared libraries) twice:
- .peers/llama-server-build: GGML_NATIVE=ON less AMX (here: AVX-512 + VNNI; NO_AMX says why), targets llama-server and
  llama-quantize;
- .peers/llama-avx2-build: GGML_NATIVE=OFF with AVX, AVX2, FMA, F16C, BMI2 and no AVX-512 / AVX-VNNI: the ggml CPU
  variant an AVX2-only CPU (Zen 2/3, most Intel client CPUs) runs, target llama-server.
.peers/llamacpp becomes a virtual environment whose `llama_cpp` package is the sdist's Python code on either build's
libraries (LLAMA_CPP_LIB_PATH): the batch-1 peer here, llama-server in benchmarks/serve.py. llama.cpp's own
quantizer (`llama-quantize --allow-requantize`) then makes Q8_0, Q4_K_M, Q5_K_M and Q6_K GGUFs of the default model
(a Q4_1 GGUF of SmolLM2-135M-Instruct) in .peers/, and each file's per-tensor type mix is printed: SmolLM2's
d_model is 576, not a multiple of 256, so every tensor whose rows are 576 long falls back from the K-quant to
Q5_0 (Q4_K_M), Q5_1 (Q5_K_M) or Q8_0 (Q6_K); only ffn_down (K = 1536) gets Q4_K / Q5_K / Q6_K.

Contenders, per format: scratchlm's `LLMEngine` on the GGUF with `quantization="gguf"` (Q4_K_M, Q4_1, Q8_0, and
--formats Q5_K_M Q6_K) or `"int8"` (per-channel int8 of the Q4_1 model, against llama.cpp's Q8_0), against llama.cpp
(llama-cpp-python's `Llama.eval`, one token at a time, argmax of its logits) on the same file. Every contender is a
long-lived worker process pinned (taskset) to the same cores with `--threads` threads; each times `--tokens` greedy
decode steps after the same 16-token prompt, wall and process CPU time (the machine is shared: a neighbour can take
the pinned core). The ISA columns: `native` (no cap; llama.cpp's native build) and `avx2`
(scratchlm under SCRATCHLM_ISA=avx2 with torch's ATen, oneDNN and MKL capped to AVX2, benchmarks/common.py
ISA_CAP_ENV; llama.cpp = the AVX2 build via LLAMA_CPP_LIB_PATH). Both columns' workers run at the same time,
interleaved: every round times each pair scratchlm then llama.cpp (llama.cpp first on odd rounds), native then avx2;
the ratio is the median of the per-round ratios. A plain streaming read (torch.sum of 256 MiB) is timed in every
round so each contender's GB/s (bytes of weights one decode step reads x tok/s) can be read against it. Greedy ids
are compared with llama.cpp's on the same file (same numbers, different kernels: a near-tie can flip a token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from benchmarks.common import REPO_ROOT, Report, isa_env, set_threads

# resolved: the builds' RPATH and the venv's .pth get real paths, also through a symlinked .peers (a worktree's)
PEERS = (REPO_ROOT / ".peers").resolve()
VENV = PEERS / "llamacpp"
SDIST_VERSION = "0.3.36"
SDIST_DIR = PEERS / f"llama_cpp_python-{SDIST_VERSION}"
BUILD = PEERS / "llama-server-build"
LIB_DIR = BUILD / "bin"
LLAMA_SERVER = LIB_DIR / "llama-server"
LLAMA_QUANTIZE = LIB_DIR / "llama-quantize"
AVX2_BUILD = PEERS / "llama-avx2-build"
AVX2_LIB_DIR = AVX2_BUILD / "bin"
COMMON_CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON"]
# -march=native without AMX: on an AMX machine (Intel Sapphire/Granite Rapids) ggml's AMX kernels (amx/mmq.cpp, for
# Q4_0/Q4_1/Q8_0/K-quant weights) faulted in this VM (SIGILL at tilezero, general protection at ldtilecfg, in
# prompt processing and decode alike) while oneDNN's AMX matmuls ran fine in the same VM; explicit -mno-amx-* win
# over -march=native in GCC whatever their order, so the build keeps every other native feature (AVX-512, VNNI)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NATIVE_CMAKE = ["-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
AVX2_CMAKE = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
              "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_VBMI=OFF",
              "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF"]
MODEL_STEM = "SmolLM2-135M-Instruct"
QUANTIZED = ("Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K")  # made by llama.cpp's quantizer from the default Q4_1 GGUF
# "Once upon a time, in a small village by the sea, there lived an" in SmolLM2's vocabulary: real text, so greedy
# continuations are not a run of near-ties (random ids gave top-2 logits 0.02 apart)
PROMPT_IDS = [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 411, 260, 3426, 28, 665, 4161, 354]
TARGET = 1.2  # issue 29: batch-1 decode >= 1.2x llama.cpp on both ISAs


def peer_gguf(kind: str) -> Path:
    """The GGUF of the default model in `kind` (Q8_0, Q4_K_M, ...) that --setup-peers makes in .peers/."""
    return PEERS / f"{MODEL_STEM}.{kind}.gguf"


Q8_0_GGUF = peer_gguf("Q8_0")


def lib_dir(isa: str) -> Path:
    """The llama.cpp build of an ISA column: native -> .peers/llama-server-build, avx2 -> .peers/llama-avx2-build."""
    return {"native": LIB_DIR, "avx2": AVX2_LIB_DIR}[isa]


def llama_server_binary(isa: str) -> Path:
    return lib_dir(isa) / "llama-server"


WORKER = r'''
import json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama
threads = int(sys.argv[3])
llm = Llama(model_path=sys.argv[1], n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
prompt = json.loads(sys.argv[2])
n_vocab = llm.n_vocab()
def greedy():  # the last token's logits (llm.scores holds them only with logits_all since 0.3.x)
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))))
print("READY " + json.dumps({"system_info": llama_cpp.llama_print_system_info().decode()}), flush=True)
for line in sys.stdin:
    n = int(line)
    llm.reset()
    llm.eval(prompt)
    tok = greedy()
    ids = [tok]
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        llm.eval([tok])
        tok = greedy()
        ids.append(tok)
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                                  "ids": ids}), flush=True)
'''


class Worker:
    """A long-lived benchmark process: one ``READY [json]`` line when loaded, then one ``RESULT {json}`` line per
    request line on stdin. Lines before READY are kept (`preamble`): a peer's start-up log."""

    def __init__(self, cmd: list[str], env: dict[str, str], cores: str = "", what: str = "worker"):
        if cores:
            cmd = ["taskset", "-c", cores, *cmd]
        self.what = what
        self.preamble: list[str] = []
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for line in self.proc.stdout:
            if line.startswith("READY"):
                rest = line[5:].strip()
                self.info = json.loads(rest) if rest else {}
                return
            self.preamble.append(line.rstrip())
        raise RuntimeError(f"{what} exited (code {self.proc.wait()}) before it was ready: {self.preamble[-5:]}")

    def request(self, line: str) -> dict:
        """Send one request line; the worker's JSON result."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        for out in self.proc.stdout:
            if out.startswith("RESULT "):
                return json.loads(out[7:])
        raise RuntimeError(f"{self.what} died (code {self.proc.wait()})")

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class LlamaCppWorker(Worker):
    """llama.cpp in .peers/llamacpp on `lib` (a build's bin/), timing `n` decode steps per request on stdin (or what
    `script` times: benchmarks/quant_speed.py's prompt processing). `cores` pins it ("" = no pinning)."""

    def __init__(self, gguf: str, cores: str, threads: int = 1, script: str = WORKER,
                 script_name: str = "llamacpp_worker.py", lib: Path = LIB_DIR, env: dict[str, str] | None = None):
        path = PEERS / script_name
        path.write_text(script)
        env = dict(env if env is not None else os.environ, OMP_NUM_THREADS=str(threads), LLAMA_CPP_LIB_PATH=str(lib))
        super().__init__([str(VENV / "bin" / "python"), str(path), gguf, json.dumps(PROMPT_IDS), str(threads)],
                         env, cores, what=f"the llama.cpp worker ({Path(gguf).name}, {lib})")
        self.system_info = self.info.get("system_info", "")

    def decode_tok_s(self, n: int) -> tuple[float, list[int]]:
        res = self.request(str(n))
        return n / res["seconds"], res["ids"]


# ------------------------------------------------------------------------------------------ set-up


def _run(cmd: list[str], **kw) -> None:
    print("+ " + " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, **kw)


def build_llamacpp(build: Path, flags: list[str], targets: list[str]) -> None:
    """Configure and build `targets` of the vendored llama.cpp into `build`, under nice (shared cores). CMake runs
    every time (seconds): changed flags rebuild what they touch, unchanged ones nothing."""
    src = SDIST_DIR / "vendor" / "llama.cpp"
    _run(["cmake", "-S", str(src), "-B", str(build), *COMMON_CMAKE, *flags], stdout=subprocess.DEVNULL)
    _run(["nice", "cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *targets])


def quantize_with_llamacpp(src: Path, dst: Path, kind: str) -> None:
    """`llama-quantize --allow-requantize src dst kind` (the source is already Q4_1: its blocks are requantized)."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(LIB_DIR))
    tmp = dst.with_suffix(".tmp")
    _run(["nice", str(LLAMA_QUANTIZE), "--allow-requantize", str(src), str(tmp), kind, str(os.cpu_count() or 2)],
         env=env, stdout=subprocess.DEVNULL)
    tmp.replace(dst)


def type_mix(path: Path) -> tuple[Counter, dict[str, Counter]]:
    """A GGUF's tensor types (gguf-py's reader): the count per type, and per tensor kind (blk.N.ffn_down -> ffn_down)
    the count per (type, K) where K is the row length."""
    from gguf import GGUFReader

    total, by_kind = Counter(), defaultdict(Counter)
    for t in GGUFReader(str(path)).tensors:
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.removesuffix(".weight")
        total[t.tensor_type.name] += 1
        by_kind[kind][(t.tensor_type.name, int(t.shape[0]))] += 1
    return total, dict(by_kind)


def type_mix_rows(paths: dict[str, Path]) -> list[list[str]]:
    """Table rows: file, then per tensor kind its types with K (e.g. `Q6_K x14, Q4_K x16 (K=1536)`)."""
    rows = []
    for label, path in paths.items():
        if not path.exists():
            rows.append([label, "missing (run --setup-peers)", ""])
            continue
        total, by_kind = type_mix(path)
        kinds = "; ".join(
            f"{kind}: " + ", ".join(f"{t} x{n} (K={k})" for (t, k), n in sorted(c.items()))
            for kind, c in by_kind.items() if not kind.endswith("norm"))
        rows.append([label, ", ".join(f"{t} x{n}" for t, n in total.most_common()), kinds])
    return rows


def llamacpp_version() -> str:
    """`llama-server --version` of the native build (the vendored llama.cpp's version and commit)."""
    try:
        out = subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, LD_LIBRARY_PATH=str(LIB_DIR)))
        version = next((x for x in (out.stdout + out.stderr).splitlines() if x.startswith("version")), "?")
    except OSError:
        version = "not built"
    return f"llama-cpp-python {SDIST_VERSION} sdist's vendored llama.cpp, {version}"


def system_info(isa: str) -> str:
    """llama.cpp's system_info line of a build (which ggml CPU features it was compiled for)."""
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(lib_dir(isa)))
    out = subprocess.run([str(VENV / "bin" / "python"), "-c",
                          "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
                         env=env, capture_output=True, text=True, timeout=120)
    return out.stdout.strip() or f"(failed: {out.stderr.strip()[-300:]})"


def setup_peers() -> None:
    """Build llama.cpp twice (native, AVX2), the peer venv and the quantized GGUFs; see the docstring."""
    from scratchlm.defaults import default_model_path

    PEERS.mkdir(exist_ok=True)
    sdist = PEERS / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if not sdist.exists():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={SDIST_VERSION}", "-d", str(PEERS)])
    if not SDIST_DIR.exists():
        _run(["tar", "xzf", str(sdist), "-C", str(PEERS)])
    build_llamacpp(BUILD, NATIVE_CMAKE, ["llama-server", "llama-quantize"])
    build_llamacpp(AVX2_BUILD, AVX2_CMAKE, ["llama-server"])
    if not (VENV / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(VENV)])
        _run([str(VENV / "bin" / "pip"), "install", "numpy", "diskcache", "jinja2", "typing-extensions"])
        site = next((VENV / "lib").glob("python3*/site-packages"))
        (site / "llama_cpp_src.pth").write_text(str(SDIST_DIR) + "\n")  # the sdist's pure-Python llama_cpp
    source = default_model_path()
    for kind in QUANTIZED:
        if not peer_gguf(kind).exists():
            quantize_with_llamacpp(source, peer_gguf(kind), kind)
    report = Report("llamacpp_peers", "The llama.cpp peers and the GGUF files its quantizer made", ["--setup-peers"])
    report.machine["llama.cpp"] = llamacpp_version()
    report.table(["build", "CMake flags (besides " + " ".join(COMMON_CMAKE) + ")", "system_info"],
                 [[f"{isa} ({lib_dir(isa).relative_to(REPO_ROOT)})", " ".join(flags), f"`{system_info(isa)}`"]
                  for isa, flags in (("native", NATIVE_CMAKE), ("avx2", AVX2_CMAKE))],
                 caption="llama.cpp builds (the ggml CPU features each was compiled for)")
    files = {source.name: source} | {peer_gguf(k).name: peer_gguf(k) for k in QUANTIZED}
    report.table(["file", "tensor types", "per tensor kind (type x count, K = row length)"], type_mix_rows(files),
                 caption=f"The GGUF files: the default model, and what `llama-quantize --allow-requantize "
                         f"{source.name} OUT TYPE` made of it (gguf-py's reader)")
    report.add("K-quants need rows of a multiple of 256 weights. SmolLM2-135M's d_model is 576, so every tensor whose "
               "rows are 576 long falls back (llama-quantize: \"180 of 272 tensor(s) required fallback "
               "quantization\"): Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0. Only ffn_down (K = 1536) is a K-quant; "
               "Q4_K_M and Q5_K_M make 14 of its 30 layers (and attn_v there) one step finer (Q6_K, Q8_0) as the _M "
               "mixes do. token_embd stays Q8_0 (the source's), and it is also the output head (tied).")
    report.write()


def missing_peers(isas: list[str]) -> list[str]:
    """Why the llama.cpp side cannot run ([] when it can)."""
    why = []
    if not (VENV / "bin" / "python").exists():
        why.append(f"no {VENV.relative_to(REPO_ROOT)} virtual environment")
    for isa in isas:
        if not (lib_dir(isa) / "libllama.so").exists():
            why.append(f"no llama.cpp {isa} build in {lib_dir(isa).relative_to(REPO_ROOT)}")
    return why


# ------------------------------------------------------------------------------------------ scratchlm worker


def formats() -> dict[str, tuple[Path, str | None, Path]]:
    """name -> (the GGUF scratchlm loads, its quantization option, the GGUF llama.cpp runs beside it)."""
    from scratchlm.defaults import default_model_path

    q41 = default_model_path()
    out = {"Q4_1": (q41, "gguf", q41), "Q8_0": (Q8_0_GGUF, "gguf", Q8_0_GGUF), "int8": (q41, "int8", Q8_0_GGUF),
           "fp32": (q41, None, q41)}
    for kind in ("Q4_K_M", "Q5_K_M", "Q6_K"):
        out[kind] = (peer_gguf(kind), "gguf", peer_gguf(kind))
    return out


def weight_bytes(m) -> int:
    """Bytes a decode step reads: every weight but the embedding table (one row read), unless the head is tied."""
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


def scratchlm_worker(names: list[str], threads: int, table: dict | None = None) -> int:
    """The scratchlm side as a worker process (its ISA cap comes from its environment): loads one engine per
    format (of `table`, default `formats()`), prints READY {per format: weight bytes, fused step, or the load
    error}, then answers `decode NAME N` (wall and process CPU seconds of N decode steps, greedy ids) and `stream`
    (GB/s of a plain streaming read)."""
    set_threads(threads)
    import torch

    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams

    engines, info = {}, {}
    table = table or formats()
    for name in names:
        path, quant, _ = table[name]
        try:
            t0 = time.perf_counter()
            e = LLMEngine.from_pretrained(path, EngineConfig(max_num_seqs=1, kv_cache_memory=64 << 20,
                                                             quantization=quant))
            engines[name] = e
            info[name] = {"bytes": weight_bytes(e.runner.model), "fused": e.runner.fused_decoder is not None,
                          "load_s": time.perf_counter() - t0}
        except Exception as exc:  # reported beside the table, the other formats still run
            info[name] = {"error": f"LLMEngine.from_pretrained({path.name!r}, quantization={quant!r}): "
                                   f"{type(exc).__name__}: {exc}"}
    from scratchlm.inference.cpp_extensions import load_engine_kernels

    kernels = load_engine_kernels()
    info["_cap"] = {"quant_best_path": kernels.quant_best_path() if kernels is not None else None,
                    "aten": torch.backends.cpu.get_cpu_capability()}
    print("READY " + json.dumps(info), flush=True)
    buf = torch.ones(64 << 20)  # 256 MiB, beyond every cache
    counter = iter(range(10**9))
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "stream":
            t0 = time.perf_counter()
            buf.sum()
            print("RESULT " + json.dumps({"gbps": buf.numel() * 4 / (time.perf_counter() - t0) / 1e9}), flush=True)
            continue
        engine, n = engines[cmd[1]], int(cmd[2])
        rid = str(next(counter))
        engine.add_request(rid, PROMPT_IDS, SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True))
        ids = [list(o.outputs[0].token_ids) for o in engine.step()]  # prefill + first token (untimed)
        t0, c0 = time.perf_counter(), time.process_time()
        while engine.has_unfinished_requests():
            ids = [list(o.outputs[0].token_ids) for o in engine.step()] or ids
        ids = ids[0] if ids else []
        print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                                      "ids": ids}), flush=True)
    return 0


def start_scratchlm(names: list[str], threads: int, cores: str, isa: str,
                    module: str = "benchmarks.llamacpp_decode") -> Worker:
    """`python -m module --worker NAMES --threads N`: the scratchlm worker of `module` (this one, or a benchmark
    that runs `scratchlm_worker` on its own table of formats)."""
    env = dict(isa_env(isa), PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", module, "--worker", *names, "--threads", str(threads)]
    return Worker(cmd, env, cores, what=f"the scratchlm worker ({isa})")


# ------------------------------------------------------------------------------------------ the run


def measure(args, threads: int, isas: list[str], notes: list[str], table: dict | None = None,
            module: str = "benchmarks.llamacpp_decode") -> dict:
    """One interleaved run at `threads` threads, every ISA column at once; per ISA, per format: tok/s of
    scratchlm and llama.cpp per round, bytes per token, fused, ids. `table` (default `formats()`) and the worker's
    `module`: another benchmark's files (benchmarks/moe_decode.py)."""
    cores = ""
    if args.bind_core >= 0:
        cores = ",".join(str(c) for c in range(args.bind_core, args.bind_core + threads))
    table = table or formats()
    peers_ok = not missing_peers(isas)
    ours: dict[str, Worker] = {}
    theirs: dict[tuple[str, Path], LlamaCppWorker] = {}
    res: dict = {"cores": cores, "isa": {}}
    try:
        for isa in isas:
            print(f"[{threads} thread(s), {isa}] loading scratchlm {' '.join(args.formats)} ...", file=sys.stderr)
            w = ours[isa] = start_scratchlm(args.formats, threads, cores, isa, module)
            col = res["isa"][isa] = {"formats": {}, "stream": [], "system_info": "", "cap": w.info.get("_cap", {})}
            for name in args.formats:
                peer_file = table[name][2]
                entry = col["formats"][name] = dict(w.info[name], ours=[], theirs=[], ratios=[], ours_cpu=[],
                                                  cpu_ratios=[], peer=peer_file.name)
                if "error" in entry:
                    notes.append(f"scratchlm {name} ({isa}, {threads}t) failed to load: {entry['error']}")
                if "error" in entry or not peers_ok or not peer_file.exists():
                    continue
                if (isa, peer_file) not in theirs:
                    theirs[isa, peer_file] = LlamaCppWorker(str(peer_file), cores, threads, lib=lib_dir(isa),
                                                            env=isa_env(isa))
                col["system_info"] = theirs[isa, peer_file].system_info
        pairs = [(isa, name) for isa in isas for name in args.formats
                 if "error" not in res["isa"][isa]["formats"][name]]

        def ours_once(isa, name):  # (tok/s wall, tok per CPU s, ids)
            r = ours[isa].request(f"decode {name} {args.tokens}")
            return args.tokens / r["seconds"], args.tokens / r["cpu_s"], r["ids"]

        def theirs_once(isa, name):
            w = theirs.get((isa, table[name][2]))
            if w is None:
                return None, None, None
            r = w.request(str(args.tokens))
            return args.tokens / r["seconds"], args.tokens / r["cpu_s"], r["ids"]

        for isa, name in pairs:  # warm-up, and the greedy ids of each side
            entry = res["isa"][isa]["formats"][name]
            entry["ids"] = ours_once(isa, name)[2]
            entry["peer_ids"] = theirs_once(isa, name)[2]
        for r in range(args.rounds):
            line = []
            for isa in isas:
                res["isa"][isa]["stream"].append(ours[isa].request("stream")["gbps"])
            for isa, name in pairs:
                entry = res["isa"][isa]["formats"][name]
                if r % 2 == 0:
                    a, b = ours_once(isa, name), theirs_once(isa, name)
                else:
                    b, a = theirs_once(isa, name), ours_once(isa, name)
                entry["ours"].append(a[0])
                entry["ours_cpu"].append(a[1])
                if b[0] is not None:
                    entry["theirs"].append(b[0])
                    entry["ratios"].append(a[0] / b[0])
                    entry["cpu_ratios"].append(a[1] / b[1])
                a, b = a[0], b[0]
                line.append(f"{isa} {name} {a:.1f}" + (f"/{b:.1f}" if b else ""))
            print(f"[{threads}t] round {r + 1}/{args.rounds}: " + ", ".join(line) +
                  f"; load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    finally:
        for w in [*ours.values(), *theirs.values()]:
            w.close()
    return res


def leading_equal(a: list[int] | None, b: list[int] | None) -> str:
    if not a or not b:
        return ""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{n}/{min(len(a), len(b))}"


def write_report(args, runs: dict[int, dict], notes: list[str], argv: list[str]) -> None:
    isas, threads = args.isa, args.threads
    report = Report("llamacpp_decode", "Batch-1 decode against llama.cpp on the same GGUF, native and AVX2-capped",
                    argv)
    default_run = sorted(args.formats) == sorted(["Q4_K_M", "Q4_1", "Q8_0", "int8"]) and args.rounds >= 5
    report.machine["torch threads"] = "per contender: " + ", ".join(map(str, threads)) + " (one run each)"
    report.machine["llama.cpp"] = llamacpp_version()
    report.name = "llamacpp_decode" + ("" if default_run else "-" + "-".join(
        [*(f"{t}t" for t in threads), *isas]))
    report.add(f"{args.tokens} greedy decode steps after a {len(PROMPT_IDS)}-token prompt; {args.rounds} interleaved "
               f"rounds per thread count; every contender a worker process pinned to the same cores. ISA columns: "
               f"native = no cap, llama.cpp's GGML_NATIVE build; avx2 = scratchlm under SCRATCHLM_ISA=avx2 with "
               f"ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2, llama.cpp's AVX2 "
               f"build (.peers/llama-avx2-build). Ratio = median over rounds of scratchlm tok/s / llama.cpp tok/s "
               f"in the same round (best / best: each side's fastest round); target >= {TARGET}x everywhere. "
               f"The machine is shared (load average in the "
               f"machine lines): a neighbour can take the pinned core for part of a measurement, so the ratio of "
               f"tokens per process CPU second (time.process_time of each worker: only the time it ran) is given "
               f"beside the wall-clock one; with 2 threads CPU time includes the workers' spin-waits.")
    cols = [(t, isa) for t in threads for isa in isas]
    rows, verdict = [], []
    for name in args.formats:
        row = [name, formats()[name][2].name]
        for t, isa in cols:
            e = runs[t]["isa"][isa]["formats"][name]
            if "error" in e:
                row.append("load failed")
            elif not e["ratios"]:
                row.append("no peer")
            else:
                ratio = statistics.median(e["ratios"])
                ok = ratio >= TARGET
                verdict.append(ok)
                best = max(e["ours"]) / max(e["theirs"])
                row.append(f"**{ratio:.2f}x** {'met' if ok else 'MISSED'} (CPU time "
                           f"{statistics.median(e['cpu_ratios']):.2f}x; best / best {best:.2f}x)")
        rows.append(row)
    report.table(["scratchlm format", "llama.cpp file", *(f"{isa}, {t} thread{'s' * (t > 1)}" for t, isa in cols)],
                 rows, caption=f"scratchlm / llama.cpp decode tok/s (median of per-round ratios; target >= {TARGET}x)")
    if verdict:
        report.add(f"**Targets met: {sum(verdict)}/{len(verdict)} columns x formats.**")
    for t in threads:
        for isa in isas:
            col = runs[t]["isa"][isa]
            stream = statistics.median(col["stream"]) if col["stream"] else float("nan")
            rows = []
            for name in args.formats:
                e = col["formats"][name]
                if "error" in e:
                    rows.append([name, "load failed", "", "", "", "", "", "", ""])
                    continue
                med = statistics.median(e["ours"])
                gb = e["bytes"] * med / 1e9
                peer = f"{statistics.median(e['theirs']):.1f}" if e["theirs"] else "-"
                ratios = ", ".join(f"{x:.2f}" for x in e["ratios"]) + " (CPU time: " + ", ".join(
                    f"{x:.2f}" for x in e["cpu_ratios"]) + ")"
                rows.append([name, f"{med:.1f}", f"{max(e['ours']):.1f}", peer, ratios, f"{e['bytes'] / 2**20:.0f}",
                             f"{gb:.1f} ({100 * gb / stream:.0f} %)", "yes" if e["fused"] else "no",
                             leading_equal(e.get("ids"), e.get("peer_ids"))])
            report.table(["format", "scratchlm tok/s (median)", "(best)", "llama.cpp tok/s (median)",
                          "per-round ratios (wall; process CPU time)", "MiB read / token",
                          "GB/s (% of streaming read)", "fused C++ step",
                          "greedy ids equal to llama.cpp's (leading)"], rows,
                         caption=f"{isa}, {t} thread(s), cores {runs[t]['cores'] or 'unpinned'}: streaming read "
                                 f"median {stream:.1f} GB/s")
    infos = {isa: next((runs[t]["isa"][isa]["system_info"] for t in threads if runs[t]["isa"][isa]["system_info"]),
                       "") for isa in isas}
    paths = {0: "scalar", 1: "AVX2", 2: "VNNI"}
    report.add("What the scratchlm workers ran: " + "; ".join(
        f"{isa}: quantized kernels' path {paths.get(c.get('quant_best_path'), c.get('quant_best_path'))}, ATen "
        f"{c.get('aten')}" for isa in isas for c in [runs[threads[0]]["isa"][isa]["cap"]]) + ".")
    report.add("llama.cpp builds (llama-cpp-python " + SDIST_VERSION + " sdist's vendored llama.cpp), system_info:\n"
               + "\n".join(f"- {isa} ({lib_dir(isa).relative_to(REPO_ROOT)}): `{info or 'not run'}`"
                           for isa, info in infos.items()))
    files = {formats()[n][2].name: formats()[n][2] for n in args.formats}
    report.table(["file", "tensor types", "per tensor kind (type x count, K = row length)"], type_mix_rows(files),
                 caption="The GGUF files (gguf-py's reader). K-quants need K % 256 == 0: SmolLM2's K = 576 tensors "
                         "fall back (Q4_K_M -> Q5_0, Q5_K_M -> Q5_1, Q6_K -> Q8_0, as llama-quantize reports), "
                         "only ffn_down (K = 1536) is Q4_K / Q5_K / Q6_K")
    if notes:
        report.add("\n".join(f"- {n}" for n in notes))
    report.write()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup-peers", action="store_true", help="build llama.cpp and the GGUF files into .peers, exit")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed per measurement")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts, one run each")
    ap.add_argument("--isa", nargs="+", default=["native", "avx2"], choices=["native", "avx2"],
                    help="ISA columns (run at the same time, interleaved)")
    ap.add_argument("--formats", nargs="+", default=["Q4_K_M", "Q4_1", "Q8_0", "int8"],
                    choices=["Q4_K_M", "Q5_K_M", "Q6_K", "Q4_1", "Q8_0", "int8", "fp32"])
    ap.add_argument("--bind-core", type=int, default=0,
                    help="pin every contender to cores bind_core .. bind_core + threads - 1; -1: no pinning")
    ap.add_argument("--worker", nargs="+", default=None, metavar="FORMAT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return scratchlm_worker(args.worker, args.threads[0])
    if args.setup_peers:
        setup_peers()
        return 0
    notes = []
    missing = missing_peers(args.isa)
    if missing:
        print("llama.cpp peer missing: " + "; ".join(missing) +
              " -- run `python -m benchmarks.llamacpp_decode --setup-peers`; scratchlm alone is measured",
              file=sys.stderr)
        notes.append("llama.cpp skipped: " + "; ".join(missing) + " (python -m benchmarks.llamacpp_decode "
                     "--setup-peers)")
    for name in args.formats:
        peer_file = formats()[name][2]
        if not peer_file.exists():
            notes.append(f"{name}: {peer_file.name} missing (python -m benchmarks.llamacpp_decode --setup-peers)")
    runs = {t: measure(args, t, args.isa, notes) for t in args.threads}
    write_report(args, runs, notes, sys.argv[1:] if argv is None else argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
