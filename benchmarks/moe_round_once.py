"""The fused MoE step's activation rounding: h rounded to int8 once per layer (moe.h, `round_once`, the default)
against each chosen expert's GEMMs rounding their gathered rows of h again (top_k times per token).

A GGUF MoE (default: the Q4_K_M synthetic Qwen3-MoE of benchmarks/moe_decode.py, experts kept in their K-quant
blocks: `LLM(path, quantization="gguf")`), every sparse layer's `MoELayer` (the fused step's) on the same random
rows h, both ways in interleaved rounds, thread CPU seconds (the machine's other load deschedules this process,
which wall time would count); outputs checked torch.equal between the two (the same bits, so no accuracy column).

    python -m benchmarks.moe_round_once                 # 1 thread, 1 and 32 rows
    python -m benchmarks.moe_round_once --rows 4 32 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import Report, set_threads

DEFAULT_GGUF = Path(__file__).resolve().parents[1] / ".peers/moe-synth/qwen3moe-synth-1B-A0.2B.Q4_K_M.gguf"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32], help="rows of h per step")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--calls", type=int, default=3, help="steps (all sparse layers) timed per round and side")
    args = ap.parse_args(argv)
    threads = set_threads(args.threads)

    from scratchlm.inference import LLM
    from scratchlm.inference.cpp_extensions import load_engine_kernels
    from scratchlm.inference.runner import _moe_layer
    from scratchlm.model.moe import MoE

    ext = load_engine_kernels()
    model = LLM(args.gguf, quantization="gguf", kv_cache_memory=32 << 20, max_model_len=256).engine.runner.model
    c = model.config
    layers = [_moe_layer(ext, b.ffn, c) for b in model.layers if isinstance(b.ffn, MoE)]
    assert layers and all(layer is not None for layer in layers), "the model's MoE layers do not take the fused step"
    g = torch.Generator().manual_seed(0)
    inputs = {b: torch.randn(b, c.d_model, generator=g) for b in args.rows}

    def step(h: torch.Tensor, once: bool) -> list[torch.Tensor]:
        return [layer.forward(h, True, once) for layer in layers]

    def cpu_s(h: torch.Tensor, once: bool) -> float:
        t0 = time.thread_time()
        for _ in range(args.calls):
            step(h, once)
        return (time.thread_time() - t0) / args.calls

    for b, h in inputs.items():  # warm-up, and the two sides' outputs bit-equal
        assert all(torch.equal(x, y) for x, y in zip(step(h, True), step(h, False), strict=True)), b
    secs = {(b, once): [] for b in inputs for once in (False, True)}
    for r in range(args.repeats):
        for b, h in inputs.items():
            for once in ((False, True) if r % 2 == 0 else (True, False)):
                secs[(b, once)].append(cpu_s(h, once))
    report = Report("moe_round_once", "The fused MoE step: h rounded to int8 once per layer vs once per expert",
                    argv if argv is not None else sys.argv[1:])
    report.add(f"Model: `{args.gguf.name}` ({c.n_layers} layers, {len(layers)} sparse, {c.moe.n_experts} experts, "
               f"top_k {c.moe.top_k}, d_model {c.d_model}, d_expert {c.d_expert}), experts in their GGUF blocks. "
               f"Threads: {threads}. Outputs torch.equal between the two ways at every row count.")
    rows = []
    for b in inputs:
        before, after = statistics.median(secs[(b, False)]), statistics.median(secs[(b, True)])
        rows.append([b, f"{before * 1e3:.2f}", f"{after * 1e3:.2f}", f"{before / after:.2f}x"])
    report.table(["rows of h", "per expert: CPU ms (all MoE layers)", "once per layer: CPU ms", "speed-up"], rows,
                 caption=f"MoELayer.forward over every sparse layer, medians of {args.repeats} interleaved rounds of "
                         f"{args.calls} calls each, thread CPU time")
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
