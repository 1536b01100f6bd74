"""Load time and resident memory of a GGUF model: scratchlm (`LLM(path, quantization="gguf")`) against llama.cpp
(llama-cpp-python's `Llama(path)`), each in a fresh process, interleaved.

    python -m benchmarks.gguf_load [--model .peers/SmolLM2-135M-Instruct.Q4_K_M.gguf] [--rounds 3] [--tokens 16]

Per round, one fresh process of each (scratchlm first on even rounds, llama.cpp first on odd ones; an untimed
warm-up round first, so both read the file from the page cache), pinned to `--bind-core`, one thread. Each process
reads /proc/self/status three times: after its imports (torch + scratchlm, or llama_cpp + numpy), after the load,
and after a short greedy generation (`--tokens` tokens after a 16-token prompt):
- VmHWM (peak resident set), VmRSS = RssAnon (private memory) + RssFile (file pages mapped: the shared libraries'
  touched pages, and llama.cpp's weights, as it mmaps the GGUF) + RssShmem;
- the model's own share: VmHWM after the generation minus VmRSS after the imports (what loading and running this
  model added to the process, without the libraries' fixed cost).
Load time = the constructor's wall seconds (scratchlm's includes loading its compiled kernels from the cache, both
include the tokenizer). Same context for both: llama.cpp n_ctx = `--ctx` with its default F16 K/V; scratchlm gets
the same KV bytes (`kv_cache_memory`, fp32 K/V: half the tokens) and max_model_len = `--ctx`. Target (issue 29): the
resident memory of the Q4_K_M model <= 1.2x llama.cpp's, judged on the peak (VmHWM) and on the model's share.

The llama.cpp side needs .peers/llamacpp and the Q4_K_M file (`python -m benchmarks.llamacpp_decode --setup-peers`);
without them scratchlm alone is measured, with a note.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import REPO_ROOT, Report, isa_env
from benchmarks.llamacpp_decode import LIB_DIR, PROMPT_IDS, VENV, llamacpp_version, missing_peers, peer_gguf

TARGET = 1.2

STATUS = r'''
def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(rest.split()[0]) * 1024
    return out
'''

SCRATCHLM = STATUS + r'''
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(1)
from scratchlm.inference import LLM, SamplingParams
imports = time.perf_counter() - t0
path, prompt, n, kv = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ctx = int(sys.argv[5])
res = {"import_s": imports, "after_import": status()}
t0 = time.perf_counter()
llm = LLM(path, quantization="gguf", kv_cache_memory=kv, max_model_len=ctx)
res["load_s"] = time.perf_counter() - t0
res["after_load"] = status()
t0 = time.perf_counter()
out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
res["generate_s"] = time.perf_counter() - t0
res["after_generate"] = status()
res["ids"] = list(out[0].outputs[0].token_ids)
res["fused"] = llm.engine.runner.fused_decoder is not None
print("RESULT " + json.dumps(res), flush=True)
'''

LLAMACPP = STATUS + r'''
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import llama_cpp
from llama_cpp import Llama
imports = time.perf_counter() - t0
path, prompt, n, ctx = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
res = {"import_s": imports, "after_import": status()}
t0 = time.perf_counter()
llm = Llama(model_path=path, n_ctx=ctx, n_threads=1, n_threads_batch=1, verbose=False)
res["load_s"] = time.perf_counter() - t0
res["after_load"] = status()
n_vocab = llm.n_vocab()
t0 = time.perf_counter()
llm.eval(prompt)
ids = []
for _ in range(n):
    tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))))
    ids.append(tok)
    if len(ids) < n:
        llm.eval([tok])
res["generate_s"] = time.perf_counter() - t0
res["after_generate"] = status()
res["ids"] = ids
print("RESULT " + json.dumps(res), flush=True)
'''


def kv_bytes_f16(path: Path, ctx: int) -> int:
    """Bytes of llama.cpp's default F16 K/V for `ctx` tokens of the GGUF's model (layers x 2 x kv heads x dim)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def field(name: str) -> int:
        return int(r.fields[f"{arch}.{name}"].parts[-1][0])

    heads, kv_heads = field("attention.head_count"), field("attention.head_count_kv")
    dim = field("embedding_length") // heads
    return 2 * field("block_count") * kv_heads * dim * ctx * 2


def run_child(which: str, model: Path, tokens: int, kv: int, ctx: int, core: int) -> dict:
    """One fresh process of `which` ("scratchlm" or "llama.cpp"); its RESULT json."""
    args = [str(model), json.dumps(PROMPT_IDS), str(tokens), str(kv), str(ctx)]
    env = dict(isa_env("native"), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if which == "scratchlm":
        cmd = [sys.executable, "-c", SCRATCHLM, *args]
        env["PYTHONPATH"] = str(REPO_ROOT)
    else:
        cmd = [str(VENV / "bin" / "python"), "-c", LLAMACPP, *args]
        env["LLAMA_CPP_LIB_PATH"] = str(LIB_DIR)
    if core >= 0:
        cmd = ["taskset", "-c", str(core), *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"{which} on {model.name} failed (code {out.returncode}): {out.stderr.strip()[-800:]}")
    return json.loads(line[7:])


def mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(peer_gguf("Q4_K_M")), help="the GGUF (default: the Q4_K_M of SmolLM2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens generated after the load")
    ap.add_argument("--ctx", type=int, default=2048, help="context tokens (llama.cpp n_ctx; scratchlm max_model_len)")
    ap.add_argument("--bind-core", type=int, default=0, help="pin each process to this core; -1: no pinning")
    ap.add_argument("--setup-peers", action="store_true",
                    help="build llama.cpp and the GGUF files (= benchmarks.llamacpp_decode --setup-peers), exit")
    args = ap.parse_args(argv)
    if args.setup_peers:
        from benchmarks.llamacpp_decode import setup_peers

        setup_peers()
        return 0
    model = Path(args.model)
    if not model.exists():
        print(f"{model} is missing: python -m benchmarks.llamacpp_decode --setup-peers makes it", file=sys.stderr)
        return 2
    notes = []
    missing = missing_peers(["native"])
    sides = ["scratchlm"] if missing else ["scratchlm", "llama.cpp"]
    if missing:
        notes.append("llama.cpp skipped: " + "; ".join(missing) + " (python -m benchmarks.llamacpp_decode "
                     "--setup-peers)")
        print("llama.cpp peer missing: " + "; ".join(missing) + "; measuring scratchlm alone", file=sys.stderr)
    kv = kv_bytes_f16(model, args.ctx)
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(-1, args.rounds):  # round -1: warm-up (page cache, compiled kernels), not counted
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            res = run_child(side, model, args.tokens, kv, args.ctx, args.bind_core)
            if r >= 0:
                runs[side].append(res)
            print(f"round {r + 1}/{args.rounds} {side}: load {res['load_s']:.2f} s, peak "
                  f"{mib(res['after_generate']['VmHWM'])} MiB" + (" (warm-up)" if r < 0 else ""), file=sys.stderr)

    def med(side: str, f) -> float:
        return statistics.median(f(x) for x in runs[side])

    def share(x: dict) -> int:
        return x["after_generate"]["VmHWM"] - x["after_import"]["VmRSS"]

    rows = []
    for side in sides:
        rows.append([side, f"{med(side, lambda x: x['import_s']):.2f}", f"{med(side, lambda x: x['load_s']):.2f}",
                     f"{min(x['load_s'] for x in runs[side]):.2f}",
                     mib(med(side, lambda x: x["after_import"]["VmRSS"])),
                     mib(med(side, lambda x: x["after_load"]["VmHWM"])),
                     mib(med(side, lambda x: x["after_load"]["VmRSS"])),
                     mib(med(side, lambda x: x["after_generate"]["VmHWM"])),
                     mib(med(side, lambda x: x["after_generate"]["RssAnon"])),
                     mib(med(side, lambda x: x["after_generate"]["RssFile"])),
                     mib(med(side, share))])
    report = Report("gguf_load", "Load time and resident memory of a GGUF model against llama.cpp",
                    sys.argv[1:] if argv is None else argv)
    report.machine["torch threads"] = "1 per process (the coordinator computes nothing)"
    report.machine["llama.cpp"] = llamacpp_version()
    report.name = "gguf_load" + ("" if model == peer_gguf("Q4_K_M") else f"-{model.stem}")
    report.add(f"Model `{model.name}` ({mib(model.stat().st_size)} MiB file); {args.rounds} interleaved rounds of one "
               f"fresh process each after a warm-up round, pinned to core {args.bind_core}, 1 thread; "
               f"{args.tokens} greedy tokens after a {len(PROMPT_IDS)}-token prompt. Context {args.ctx} tokens: "
               f"llama.cpp n_ctx={args.ctx} (F16 K/V, {mib(kv)} MiB), scratchlm kv_cache_memory={kv} "
               f"({mib(kv)} MiB of fp32 K/V) and max_model_len={args.ctx}. Medians over rounds; MiB = 2^20 bytes.")
    report.table(["contender", "imports (s)", "load (s, median)", "load (s, best)", "RSS after imports",
                  "peak after load (VmHWM)", "RSS after load", "peak after generation (VmHWM)",
                  "private (RssAnon) after generation", "file-backed (RssFile) after generation",
                  "model's share: peak - RSS after imports"], rows,
                 caption="Load time (s) and resident memory (MiB)")
    if "llama.cpp" in runs:
        peak = med("scratchlm", lambda x: x["after_generate"]["VmHWM"]) / \
            med("llama.cpp", lambda x: x["after_generate"]["VmHWM"])
        own = med("scratchlm", share) / med("llama.cpp", share)
        load = med("scratchlm", lambda x: x["load_s"]) / med("llama.cpp", lambda x: x["load_s"])
        ours_ids, their_ids = runs["scratchlm"][0]["ids"], runs["llama.cpp"][0]["ids"]
        same = next((i for i, (a, b) in enumerate(zip(ours_ids, their_ids)) if a != b), len(ours_ids))
        report.table(["measure", "scratchlm / llama.cpp", f"target <= {TARGET}x"], [
            ["peak resident memory (VmHWM after generation)", f"{peak:.2f}x", "met" if peak <= TARGET else "MISSED"],
            ["the model's share (peak - RSS after imports)", f"{own:.2f}x", "met" if own <= TARGET else "MISSED"],
            ["load time", f"{load:.2f}x", "(no target)"],
        ], caption="Ratios (medians)")
        notes.append(f"greedy ids equal to llama.cpp's for the first {same}/{len(ours_ids)} tokens; scratchlm's fused "
                     f"C++ step: {'yes' if runs['scratchlm'][0].get('fused') else 'no'}")
    if notes:
        report.add("\n".join(f"- {n}" for n in notes))
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
