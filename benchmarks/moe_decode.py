"""A realistic mixture-of-experts model against llama.cpp on the same GGUF: batch-1 decode (scratchlm's `LLM`
against llama-cpp-python) and the 32-request server workload (`scratchlm serve` against `llama-server`).

    python -m benchmarks.moe_decode --setup-peers   # llama.cpp peers (llamacpp_decode) + the synthetic MoE's GGUFs
    python -m benchmarks.moe_decode [--rounds 5] [--tokens 32] [--isa native avx2] [--formats Q4_K_M Q8_0]
    python -m benchmarks.moe_decode --serve [--isa native avx2] [--repeats 3]   # benchmarks/serve.py on the MoE GGUF
    python -m benchmarks.moe_decode --perf [--formats Q4_K_M] [--isa native]    # where the time goes (Linux perf)

The model (issue 31: "Qwen3-MoE-shaped ~1B total / 0.2B active"): no such checkpoint is published, so --setup-peers
makes one. transformers' own `Qwen3MoeConfig` / `Qwen3MoeForCausalLM` with the shapes of `SHAPE` (hidden 1024,
18 layers, 16 query / 4 key-value heads of 64, 64 experts of 256, top-8 with renormalised weights, untied head:
1.057 B parameters, 0.213 B read per token) and its own random initialisation (seed 0, normal(0, 0.02)), saved in
bf16 with GPT-2's real byte-level BPE vocabulary (../shared/data/tokenizers/gpt2, 50,257 tokens: llama.cpp's
converter recognises its pre-tokenizer as `gpt-2`) into .peers/moe-synth/hf; llama.cpp's own
`convert_hf_to_gguf.py` (the sdist's vendored copy) writes it as a bf16 GGUF (arch `qwen3moe`, the experts stacked as
`ffn_{gate,up,down}_exps`), and `llama-quantize` makes the Q4_K_M and Q8_0 files of the benchmark from that. Every
K (the row length of a weight: 1024 for attention, router, gate/up experts and the head, 256 for the experts' down)
is a multiple of 256, so every tensor gets the K-quant its mix names (no fallback as with SmolLM2's K = 576). The
weights are random: the router spreads tokens over the experts about evenly (a trained router is skewed), and greedy
continuations are runs of near-ties, so the ids of two correct implementations part early; the ids are reported,
not judged.

Decode: the worker processes, rounds and ratios of benchmarks/llamacpp_decode.py (its `measure`, one pinned thread
by default, native and --isa avx2 columns interleaved) on the MoE's files: scratchlm's `LLMEngine` with
`quantization="gguf"` (the packed blocks) against llama.cpp on the same file; target >= 1.2x. The bytes one
decode step reads are counted from the GGUF: every tensor but the embedding table, the expert tensors at
top_k / n_experts of their size. --serve: benchmarks/serve.py (`--model` = the MoE's Q4_K_M GGUF, `--quantization
gguf`, llama-server from the same builds, 32 requests, target >= 2x), written as results/<date>-moe_serve.md.
--perf: `perf record` of each contender's process over its timed part only, the functions' self time (`perf report
--sort dso,symbol`): scratchlm and llama.cpp at batch 1, the 32-request workload through scratchlm's `LLM.generate`
and through llama-server; results/<date>-moe_decode-perf.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import llamacpp_decode as lcd
from benchmarks.common import REPO_ROOT, Report, shared_data_dir

MOE_DIR = lcd.PEERS / "moe-synth"
HF_DIR = MOE_DIR / "hf"
STEM = "qwen3moe-synth-1B-A0.2B"
KINDS = ("Q4_K_M", "Q8_0")  # made by llama-quantize from the bf16 GGUF
TARGET = 1.2  # issue 31: batch-1 decode >= 1.2x llama.cpp
SERVE_TARGET = 2.0  # issue 31: the 32-request server workload >= 2x llama-server
SEED = 0
# Qwen3-30B-A3B's proportions scaled to ~1B total / ~0.2B active (its 128 experts of 768, top-8, 48 layers of
# hidden 2048 -> 64 experts of 256, top-8, 18 layers of hidden 1024); every K a multiple of 256 for the K-quants
SHAPE = dict(vocab_size=50257, hidden_size=1024, num_hidden_layers=18, num_attention_heads=16, num_key_value_heads=4,
             moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
             intermediate_size=3072, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
             bos_token_id=50256, eos_token_id=50256)


def moe_gguf(kind: str) -> Path:
    """The synthetic MoE as a GGUF of `kind` (BF16 from the converter, Q4_K_M / Q8_0 from llama-quantize)."""
    return MOE_DIR / f"{STEM}.{kind}.gguf"


def param_counts(shape: dict = SHAPE) -> dict[str, int]:
    """Parameter counts of the shapes (no model built): per part, the total, and what one token reads (active:
    top_k of the experts, one embedding row; the head in full)."""
    d, n_layers, e, k = shape["hidden_size"], shape["num_hidden_layers"], shape["num_experts"], \
        shape["num_experts_per_tok"]
    head_dim = d // shape["num_attention_heads"]
    attn = d * head_dim * (2 * shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) + 2 * head_dim
    expert = 3 * d * shape["moe_intermediate_size"]
    norms = 2 * d
    parts = {"embedding": shape["vocab_size"] * d, "head": shape["vocab_size"] * d + d,
             "attention": n_layers * (attn + norms), "router": n_layers * e * d, "experts": n_layers * e * expert}
    parts["total"] = sum(parts.values())
    parts["active"] = parts["total"] - parts["embedding"] + d - parts["experts"] + n_layers * k * expert
    return parts


# ------------------------------------------------------------------------------------------ set-up


def write_gpt2_tokenizer(directory: Path) -> None:
    """GPT-2's own byte-level BPE (vocab.json + merges.txt from ../shared/data/tokenizers/gpt2) with a config
    naming it: what `convert_hf_to_gguf.py` reads through AutoTokenizer (its pre-tokenizer hash is `gpt-2`)."""
    src = shared_data_dir() / "tokenizers" / "gpt2"
    shutil.copyfile(src / "encoder.json", directory / "vocab.json")
    shutil.copyfile(src / "vocab.bpe", directory / "merges.txt")
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
              "unk_token": "<|endoftext|>", "model_max_length": SHAPE["max_position_embeddings"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_hf_checkpoint(out: Path = HF_DIR) -> None:
    """The random Qwen3-MoE checkpoint (transformers' config class and initialisation, seed SEED) in bf16."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(SEED)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(tmp)
    del model
    write_gpt2_tokenizer(tmp)
    tmp.rename(out)


def setup_model() -> None:
    """HF checkpoint -> bf16 GGUF (llama.cpp's converter) -> KINDS (llama-quantize); each step skipped when done."""
    MOE_DIR.mkdir(parents=True, exist_ok=True)
    if not (HF_DIR / "config.json").exists():
        print(f"making the synthetic Qwen3-MoE in {HF_DIR} ...", file=sys.stderr)
        make_hf_checkpoint()
    bf16 = moe_gguf("BF16")
    if not bf16.exists():
        tmp = bf16.with_suffix(".tmp")
        convert = lcd.SDIST_DIR / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
        lcd._run(["nice", sys.executable, str(convert), str(HF_DIR), "--outfile", str(tmp), "--outtype", "bf16"])
        tmp.replace(bf16)
    for kind in KINDS:
        if not moe_gguf(kind).exists():
            lcd.quantize_with_llamacpp(bf16, moe_gguf(kind), kind)


def setup_peers() -> None:
    """benchmarks/llamacpp_decode.py's peers (both llama.cpp builds, the peer venv), then the MoE's GGUFs."""
    lcd.setup_peers()
    setup_model()


# ------------------------------------------------------------------------------------------ the decode run


def moe_formats() -> dict[str, tuple[Path, str | None, Path]]:
    """name -> (the GGUF scratchlm loads, its quantization option, the GGUF llama.cpp runs beside it): the same file."""
    return {kind: (moe_gguf(kind), "gguf", moe_gguf(kind)) for kind in KINDS}


def active_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the whole file's tensors, bytes one decode step reads): every tensor but the embedding table (one
    row; the head is untied), the stacked expert tensors (`*_exps`) at expert_used_count / expert_count."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    used, count = (int(reader.fields[f"{arch}.{key}"].parts[-1][0]) for key in ("expert_used_count", "expert_count"))
    total = active = 0
    for t in reader.tensors:
        total += int(t.n_bytes)
        if t.name == "token_embd.weight":
            continue
        active += int(t.n_bytes) * used // count if "_exps" in t.name else int(t.n_bytes)
    return total, active


def llamacpp_alone(args, isa: str, kind: str) -> dict:
    """llama.cpp's decode tok/s on `kind` alone (`args.rounds` rounds after a warm-up): the peer's figure when
    scratchlm cannot load the file."""
    cores = str(args.bind_core) if args.bind_core >= 0 else ""
    w = lcd.LlamaCppWorker(str(moe_gguf(kind)), cores, 1, lib=lcd.lib_dir(isa), env=lcd.isa_env(isa))
    try:
        w.decode_tok_s(args.tokens)
        return {"theirs": [w.decode_tok_s(args.tokens)[0] for _ in range(args.rounds)], "system_info": w.system_info}
    finally:
        w.close()


def model_rows() -> list[list[str]]:
    counts = param_counts()
    e, k = SHAPE["num_experts"], SHAPE["num_experts_per_tok"]
    return [[part, f"{counts[part] / 1e6:.1f} M", f"{counts[part] * (k / e if part == 'experts' else 1) / 1e6:.1f} M"
             if part != "embedding" else f"{SHAPE['hidden_size'] / 1e6:.3f} M (one row)"]
            for part in ("embedding", "attention", "router", "experts", "head")] + [
        ["**total**", f"**{counts['total'] / 1e9:.3f} B**", f"**{counts['active'] / 1e9:.3f} B**"]]


def write_report(args, runs: dict[int, dict], alone: dict, notes: list[str], argv: list[str]) -> None:
    isas, threads = args.isa, args.threads
    report = Report("moe_decode", "Batch-1 decode of a Qwen3-MoE-shaped model (1.06 B total / 0.21 B active) "
                    "against llama.cpp on the same GGUF", argv)
    report.machine["torch threads"] = ", ".join(map(str, threads)) + " per contender"
    report.machine["llama.cpp"] = lcd.llamacpp_version()
    default = sorted(args.formats) == sorted(KINDS) and args.rounds >= 5 and threads == [1]
    report.name = "moe_decode" + ("" if default else "-" + "-".join([*(f"{t}t" for t in threads), *isas]))
    shape = ", ".join(f"{k}={v}" for k, v in SHAPE.items() if k not in ("rope_parameters", "bos_token_id",
                                                                          "eos_token_id", "intermediate_size"))
    report.add(f"The model: transformers' `Qwen3MoeConfig({shape})`, rope theta 1e6, `Qwen3MoeForCausalLM` with its "
               f"own random initialisation (seed {SEED}), bf16, GPT-2's byte-level BPE vocabulary; llama.cpp's "
               f"`convert_hf_to_gguf.py` -> `{moe_gguf('BF16').name}`, `llama-quantize` -> Q4_K_M and Q8_0 "
               f"(`python -m benchmarks.moe_decode --setup-peers`).")
    report.table(["part", "parameters", "read per token"], model_rows(), caption="Parameter counts (from the shapes; "
                 "the total equals transformers' count of the model)")
    report.add(f"{args.tokens} greedy decode steps after a {len(lcd.PROMPT_IDS)}-token prompt, {args.rounds} "
               f"interleaved rounds (benchmarks/llamacpp_decode.py's `measure`: one worker process per contender, "
               f"pinned to the same core(s); scratchlm then llama.cpp, llama.cpp first on odd rounds); scratchlm = "
               f"`LLMEngine` on the GGUF with `quantization=\"gguf\"`, llama.cpp = llama-cpp-python's `Llama.eval` "
               f"on the same file. Ratio = median of the per-round ratios of tok/s; target >= {TARGET}x. ISA columns: "
               f"native = no cap, llama.cpp's GGML_NATIVE build; avx2 = scratchlm under SCRATCHLM_ISA=avx2 "
               f"(ATen, oneDNN, MKL capped too), llama.cpp's AVX2 build. Shared machine: the ratio of tokens per "
               f"process CPU second is given beside the wall-clock one.")
    sizes = {k: active_bytes(moe_gguf(k)) for k in args.formats if moe_gguf(k).exists()}
    cols = [(t, isa) for t in threads for isa in isas]
    rows = []
    for name in args.formats:
        row = [name]
        for t, isa in cols:
            e = runs[t]["isa"][isa]["formats"][name]
            if "error" in e:
                row.append("scratchlm failed to load")
            elif not e["ratios"]:
                row.append("no peer")
            else:
                ratio = statistics.median(e["ratios"])
                row.append(f"**{ratio:.2f}x** {'met' if ratio >= TARGET else 'MISSED'} (CPU time "
                           f"{statistics.median(e['cpu_ratios']):.2f}x; best / best "
                           f"{max(e['ours']) / max(e['theirs']):.2f}x)")
        rows.append(row)
    report.table(["format", *(f"{isa}, {t} thread{'s' * (t > 1)}" for t, isa in cols)], rows,
                 caption=f"scratchlm / llama.cpp decode tok/s (median of per-round ratios; target >= {TARGET}x)")
    for t, isa in cols:
        col = runs[t]["isa"][isa]
        stream = statistics.median(col["stream"]) if col["stream"] else float("nan")
        rows = []
        for name in args.formats:
            e = col["formats"][name]
            theirs = e.get("theirs") or alone.get((isa, name), {}).get("theirs", [])
            peer = f"{statistics.median(theirs):.1f}" if theirs else "-"
            read = sizes.get(name, (0, 0))[1]
            if "error" in e:
                rows.append([name, "load failed", "", peer, "", f"{read / 2**20:.0f}", "", "", ""])
                continue
            med = statistics.median(e["ours"])
            ratios = ", ".join(f"{x:.2f}" for x in e["ratios"]) + " (CPU time: " + ", ".join(
                f"{x:.2f}" for x in e["cpu_ratios"]) + ")"
            gbps = ", ".join(f"{read * x / 1e9:.1f}" for x in (med, *(theirs and [statistics.median(theirs)])))
            rows.append([name, f"{med:.1f}", f"{max(e['ours']):.1f}", peer, ratios, f"{read / 2**20:.0f}",
                         f"{gbps} (streaming read {stream:.1f})", "yes" if e["fused"] else "no",
                         lcd.leading_equal(e.get("ids"), e.get("peer_ids"))])
        report.table(["format", "scratchlm tok/s (median)", "(best)", "llama.cpp tok/s (median)",
                      "per-round ratios (wall; process CPU time)", "MiB read / token",
                      "GB/s scratchlm, llama.cpp", "fused C++ step", "greedy ids equal to llama.cpp's (leading)"],
                     rows, caption=f"{isa}, {t} thread(s), cores {runs[t]['cores'] or 'unpinned'}")
    infos = {isa: next((runs[t]["isa"][isa]["system_info"] for t in threads if runs[t]["isa"][isa]["system_info"]),
                       "") or next((a["system_info"] for (i, _), a in alone.items() if i == isa), "") for isa in isas}
    report.add("llama.cpp builds, system_info:\n" + "\n".join(
        f"- {isa} ({lcd.lib_dir(isa).relative_to(REPO_ROOT)}): `{info or 'not run'}`" for isa, info in infos.items()))
    files = {moe_gguf(k).name: moe_gguf(k) for k in args.formats}
    report.table(["file", "tensor types", "per tensor kind (type x count, K = row length)"], lcd.type_mix_rows(files),
                 caption="The GGUF files (gguf-py's reader; MiB read per token above: every tensor but token_embd, "
                         "the `_exps` tensors at top_k / n_experts)")
    report.add("Greedy ids: random weights make every step's top logits near-ties, so two correct implementations "
               "part after a few tokens (reported, not judged); issue 31's correctness tests compare logits with HF.")
    if notes:
        report.add("\n".join(f"- {n}" for n in notes))
    report.write()


# ------------------------------------------------------------------------------------------ --perf: where the time goes

PERF_WORKER = "perf-worker"


def perf_worker(kind: str) -> int:
    """The scratchlm side of --perf: loads `kind` once, prints READY, then per request line times `decode N` (batch
    1, as the decode run) or `serve SEED` (benchmarks/serve.py's 32-request workload through `LLM.generate`)."""
    from benchmarks import serve
    from scratchlm.inference import LLM, SamplingParams

    llm = LLM(str(moe_gguf(kind)), max_num_seqs=32, quantization="gguf")
    print("READY " + json.dumps({"fused": llm.engine.runner.fused_decoder is not None}), flush=True)
    for line in sys.stdin:
        what, n = line.split()
        if what == "decode":
            prompts, params = [lcd.PROMPT_IDS], [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True)]
        else:
            jobs = serve.make_workload(32, SHAPE["vocab_size"], int(n), (16, 256), (16, 128))
            prompts = [j.prompt_ids for j in jobs]
            params = [SamplingParams(temperature=0, max_tokens=j.max_tokens, ignore_eos=True) for j in jobs]
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                                      "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}), flush=True)
    return 0


def perf_top(pid: int, run, top: int) -> tuple[object, list[tuple[float, str, str]]]:
    """`perf record` of process `pid` while `run()` runs; its result and the `top` (share %, library, symbol) rows
    of `perf report --sort dso,symbol` (self time)."""
    import signal
    import tempfile

    data = Path(tempfile.mkdtemp()) / "perf.data"
    rec = subprocess.Popen(["perf", "record", "-F", "999", "-p", str(pid), "-o", str(data)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # perf attaches
    try:
        result = run()
    finally:
        rec.send_signal(signal.SIGINT)
        rec.wait(60)
    out = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,symbol", "--stdio"],
                         capture_output=True, text=True).stdout
    shutil.rmtree(data.parent, ignore_errors=True)
    rows = []
    for line in out.splitlines():
        parts = line.split(None, 3)  # share, library, [.], symbol
        if len(parts) == 4 and parts[0].endswith("%") and not line.startswith("#"):
            rows.append((float(parts[0][:-1]), parts[1], re.split(r"\s{2,}", parts[3].strip())[0][:110]))
    return result, rows[:top]


def run_perf(args) -> int:
    """--perf: where each contender's time goes on the Q4_K_M file (perf's self time per symbol): batch-1 decode of
    scratchlm and llama.cpp, and the 32-request workload through scratchlm's `LLM.generate` and llama-server."""
    import asyncio

    from benchmarks import serve

    if shutil.which("perf") is None:
        raise SystemExit("--perf needs Linux perf (perf record / perf report) on PATH")
    kind, isa, cores = args.formats[0], args.isa[0], str(max(args.bind_core, 0))
    report = Report("moe_decode-perf", f"Where the time goes: scratchlm and llama.cpp on the MoE's {kind} file "
                    f"(perf)", sys.argv[1:])
    report.machine["llama.cpp"] = lcd.llamacpp_version()
    report.add(f"Each contender pinned to core {cores}, 1 thread, {isa}; `perf record -F 999 -p PID` over the timed "
               f"part only (model loading and warm-up excluded), `perf report --no-children --sort dso,symbol`: "
               f"self time per function. Decode: {args.tokens} greedy tokens at batch 1 after the 16-token prompt. "
               f"Server workload: benchmarks/serve.py's 32 requests (seed 1) through `LLM.generate` (the engine "
               f"`scratchlm serve` runs) and through llama-server (--parallel 32).")
    env = dict(lcd.isa_env(isa), PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    ours = lcd.Worker([sys.executable, "-m", "benchmarks.moe_decode", "--" + PERF_WORKER, kind], env, cores,
                      what="the scratchlm perf worker")
    theirs = lcd.LlamaCppWorker(str(moe_gguf(kind)), cores, 1, lib=lcd.lib_dir(isa), env=lcd.isa_env(isa))
    sections = []
    try:
        ours.request("decode 8"), theirs.request("8")
        for name, w, line in (("scratchlm, batch-1 decode", ours, f"decode {args.tokens}"),
                              ("llama.cpp, batch-1 decode", theirs, str(args.tokens)),
                              ("scratchlm, 32 requests (LLM.generate)", ours, "serve 1")):
            res, rows = perf_top(w.proc.pid, lambda w=w, line=line: w.request(line), args.perf_top)
            n = res.get("tokens", args.tokens)
            sections.append((name, f"{n} tokens, {1e3 * res['cpu_s'] / n:.1f} ms CPU per output token", rows))
    finally:
        ours.close(), theirs.close()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "llama-server-moe-perf.log"
    proc, url = serve.start_llama_server(lcd.llama_server_binary(isa), str(moe_gguf(kind)), 1, 32, 400, cores, log,
                                         env=lcd.isa_env(isa))
    try:
        asyncio.run(serve.drive(url, "bench", serve.make_workload(4, SHAPE["vocab_size"], 99, (16, 64), (4, 8)), 32,
                                math.inf, 0))  # warm-up
        jobs = serve.make_workload(32, SHAPE["vocab_size"], 1, (16, 256), (16, 128))
        cpu0 = serve.process_cpu_seconds(proc.pid)
        (duration, results), rows = perf_top(proc.pid, lambda: asyncio.run(
            serve.drive(url, "bench", jobs, 32, math.inf, 0)), args.perf_top)
        n = sum(r.output_tokens for r in results if r.ok)
        cpu = serve.process_cpu_seconds(proc.pid) - cpu0
        sections.append(("llama-server, 32 requests", f"{n} tokens, {1e3 * cpu / n:.1f} ms CPU per output token",
                         rows))
    finally:
        serve.stop(proc)
    for name, what, rows in sections:
        report.table(["self %", "library", "function"], [[f"{p:.2f}", lib, f"`{sym}`"] for p, lib, sym in rows],
                     caption=f"{name}: {what}")
    report.write()
    return 0


def run_serve(args) -> int:
    """benchmarks/serve.py on the MoE's GGUF (scratchlm serve with the packed blocks against llama-server)."""
    from benchmarks import serve

    argv = ["--model", str(moe_gguf(args.serve_format)), "--quantization", "gguf", "--isa", *args.isa,
            "--threads", str(args.threads[0]), "--bind-core", str(args.bind_core), "--repeats", str(args.repeats),
            "--no-vllm", "--results-name", "moe_serve" + ("" if args.serve_format == "Q4_K_M" else
                                                           f"-{args.serve_format}")
            + ("" if sorted(args.isa) == ["avx2", "native"] else "-" + "-".join(args.isa))]
    return serve.main(argv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup-peers", action="store_true", help="build llama.cpp and the MoE's GGUF files, exit")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed per measurement")
    ap.add_argument("--threads", type=int, nargs="+", default=[1], help="thread counts, one run each")
    ap.add_argument("--isa", nargs="+", default=["native", "avx2"], choices=["native", "avx2"],
                    help="ISA columns (run at the same time, interleaved)")
    ap.add_argument("--formats", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--bind-core", type=int, default=0,
                    help="pin every contender to cores bind_core .. bind_core + threads - 1; -1: no pinning")
    ap.add_argument("--serve", action="store_true",
                    help="instead: the 32-request server workload (benchmarks/serve.py)")
    ap.add_argument("--serve-format", default="Q4_K_M", choices=list(KINDS), help="the GGUF --serve runs")
    ap.add_argument("--repeats", type=int, default=3, help="--serve: interleaved repeats")
    ap.add_argument("--perf", action="store_true",
                    help="instead: where the time goes (Linux perf), scratchlm and llama.cpp on the first --formats "
                         "file under the first --isa, batch-1 decode and the 32-request workload")
    ap.add_argument("--perf-top", type=int, default=15, help="--perf: functions listed per contender")
    ap.add_argument("--worker", nargs="+", default=None, metavar="FORMAT", help=argparse.SUPPRESS)
    ap.add_argument("--" + PERF_WORKER, default=None, metavar="FORMAT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return lcd.scratchlm_worker(args.worker, args.threads[0], moe_formats())
    if args.perf_worker:
        return perf_worker(args.perf_worker)
    if args.setup_peers:
        setup_peers()
        return 0
    missing = [str(moe_gguf(k).relative_to(REPO_ROOT)) for k in (KINDS if args.serve else args.formats)
               if not moe_gguf(k).exists()] + lcd.missing_peers(args.isa)
    if missing:
        raise SystemExit("missing: " + "; ".join(missing) + " (python -m benchmarks.moe_decode --setup-peers)")
    if args.serve:
        return run_serve(args)
    if args.perf:
        return run_perf(args)
    notes: list[str] = []
    runs = {t: lcd.measure(args, t, args.isa, notes, moe_formats(), "benchmarks.moe_decode") for t in args.threads}
    alone = {}
    for isa in args.isa:
        for name in args.formats:
            if "error" in runs[args.threads[0]]["isa"][isa]["formats"][name]:
                print(f"[{isa}] scratchlm cannot load {name}: llama.cpp alone ...", file=sys.stderr)
                alone[isa, name] = llamacpp_alone(args, isa, name)
    write_report(args, runs, alone, notes, sys.argv[1:] if argv is None else argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
