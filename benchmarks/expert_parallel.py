"""Expert parallelism (EP=2, gloo) against one process on the same MoE model and requests, with the time of a step
split into route, dispatch (all-to-all), experts, combine and the rest, and the all-to-all bytes per step.

    python -m benchmarks.expert_parallel                     # a synthetic Qwen3-MoE-shaped model (random weights)
    python -m benchmarks.expert_parallel --repeats 5 --layers 8

Contenders, each in its own warm client process, run interleaved (A B C D A B C D ...), medians reported:
one process with 1 thread, one process with 2 threads, TP=2 (the MoE split by hidden unit, 1 thread per rank)
and EP=2 (experts split in two ranges, data-parallel attention, 1 thread per rank). Workloads: batch-1 decode
and 32 requests at once.

The split of a step (rank 0, median over rounds, per engine step):
- EP: `route` (router GEMM, top-k, the rows' order), `dispatch` (the counts' all-gather + the rows' all-to-all),
  `experts` (the rank's experts on the rows it received), `combine` (the reverse all-to-all + the weighted sum),
  `kv exchange` (data-parallel attention: the new K/V rows to and from the other replica) and `rest` (attention, dense
  layers, head, sampling, the scheduler). An all-to-all's time on rank 0 includes waiting for the other rank to
  reach it (its share of the step's imbalance);
- one process: `moe` (the model's MoE layers, by forward hooks: route + experts + combine) and `rest`; a step the
  fused C++ step runs (every layer in one call, csrc/moe.h: the default for a MoE model on the CPU) cannot be
  split that way, so there the whole step is `rest`. The fused step is what one process runs, so it is the
  baseline; EP's and TP's ranks run the Python step (layer by layer: the fused step does not take a sharded
  layer), so "1 process, Python step" (`runner.fused_decoder = None`) is the like-for-like reference.
The all-to-all bytes are what rank 0 sends to the other rank (`Comm.bytes`); they are also written as JSON
(results/DATE-expert_parallel.json) for the planner's validation (scratchlm/plan/cost.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import Report, interleaved_clients, set_threads

LAYOUTS = {  # name: (ep, tp, threads per rank, Python step)
    "1 process, 1 thread": (1, 1, 1, False),
    "1 process, 1 thread, Python step": (1, 1, 1, True),
    "TP=2 (1 thread/rank)": (1, 2, 1, True),
    "EP=2 (1 thread/rank)": (2, 1, 1, True),
}
TWO_THREADS = {"1 process, 2 threads": (1, 1, 2, False)}  # --two-threads (its OpenMP barriers stall on a loaded host)
BASELINE = "1 process, 1 thread"
PYTHON_STEP = "1 process, 1 thread, Python step"


def model_config(args):
    from scratchlm.model.config import ModelConfig, MoEFeatures

    return ModelConfig(vocab_size=4096, d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                       d_ff=4 * args.d_model, max_seq_len=512, tie_embeddings=False,
                       moe=MoEFeatures(n_experts=args.experts, top_k=args.top_k, d_expert=args.d_expert))


def _client(conn, path: str, ep: int, tp: int, threads: int, python_step: bool, prompt_len: int, gen: int) -> None:
    import torch

    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from scratchlm.model.moe import MoE

    torch.set_num_threads(threads)
    engine = LLMEngine.from_pretrained(path, EngineConfig(expert_parallel_size=ep, tensor_parallel_size=tp,
                                                          max_num_seqs=32, max_num_batched_tokens=1024,
                                                          enable_prefix_caching=False))  # every round: whole prompts
    runner = engine.runner
    if ep * tp == 1 and python_step:
        runner.fused_decoder = None  # the Python step, layer by layer: what the EP and TP ranks run
    moe_s = [0.0]
    if ep * tp == 1:  # one process: time the model's MoE layers with forward hooks
        starts: list[float] = []
        for m in engine.executor.model.modules():
            if isinstance(m, MoE):
                m.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))
                m.register_forward_hook(lambda *_: moe_s.__setitem__(0, moe_s[0] + time.perf_counter()
                                                                      - starts.pop()))
    n_moe = sum(engine.model_config.is_moe_layer(i) for i in range(engine.model_config.n_layers))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    conn.send("ready")
    n = 0
    while (cmd := conn.recv()) is not None:
        if hasattr(runner, "comm"):
            runner.comm.reset_stats()
        if hasattr(runner, "reset_expert_stats"):
            runner.reset_expert_stats()
        moe_s[0] = 0.0
        steps = tokens = 0
        outs: dict[str, list[int]] = {}
        t0 = time.perf_counter()
        rid = {}
        for i, p in enumerate(prompts[: 1 if cmd == "batch1" else 32]):
            n += 1
            rid[f"q{n}"] = i
            engine.add_request(f"q{n}", p, params)
        if ep > 1:
            runner.trace_command(True)  # the other ranks record their exchanges (kind, start, end, bytes)
        per_step = []  # (seconds, {kind: (seconds, bytes)}, tokens forwarded) of each step
        while engine.has_unfinished_requests():
            ts = time.perf_counter()
            before, rows_before = _exchanges(runner), _routed_rows(runner)
            for r in engine.step():
                if r.finished:
                    outs[r.request_id] = r.outputs[0].token_ids
            after = _exchanges(runner)
            per_step.append((time.perf_counter() - ts, {k: (after[k][0] - before.get(k, (0.0, 0))[0],
                                                            after[k][1] - before.get(k, (0.0, 0))[1]) for k in after},
                             (_routed_rows(runner) - rows_before) // engine.model_config.moe.top_k))
            steps += 1
        wall = time.perf_counter() - t0
        others = _per_step_of_rank1(runner.trace_command(False), steps, n_moe) if ep > 1 else None
        tokens = sum(len(v) for v in outs.values())
        comm = {k: (runner.comm.seconds[k], runner.comm.calls[k], runner.comm.bytes[k])
                for k in runner.comm.seconds} if hasattr(runner, "comm") else {}
        expert = runner.expert_seconds() if hasattr(runner, "expert_seconds") else {}
        load = runner.expert_load() if hasattr(runner, "expert_load") else None
        conn.send({"wall": wall, "steps": steps, "tokens": tokens, "comm": comm, "expert": expert,
                   "moe": moe_s[0], "ids": [outs[k] for k in sorted(outs, key=rid.get)], "load": load,
                   "per_step": per_step, "rank1_per_step": others})
    if hasattr(runner, "shutdown"):
        runner.shutdown()


def _exchanges(runner) -> dict[str, tuple[float, int]]:
    """{kind: (seconds, bytes sent)} of rank 0's EP exchanges so far."""
    comm = getattr(runner, "comm", None)
    if comm is None:
        return {}
    return {k: (comm.seconds[k], comm.bytes[k]) for k in ("ep_counts", "ep_dispatch", "ep_combine", "ep_kv")}


def _routed_rows(runner) -> int:
    """Rows routed so far in the first MoE layer, every replica's (EP: rank 0 counts them; else 0): top_k a token."""
    load = runner.expert_load() if hasattr(runner, "expert_load") else {}
    return sum(load[min(load)]) if load else 0


def _per_step_of_rank1(traced: dict, steps: int, n_moe: int) -> list[dict[str, tuple[float, int]]]:
    """Rank 1's {kind: (seconds, bytes)} per step, from its traced calls: every step makes `n_moe` calls of each EP
    kind (one per MoE layer; ep_kv one per layer, every layer here being MoE), so the i-th chunk is step i."""
    calls = traced.get(1, [])
    out: list[dict[str, tuple[float, int]]] = [{} for _ in range(steps)]
    for kind in ("ep_counts", "ep_dispatch", "ep_combine", "ep_kv"):
        mine = [c for c in calls if c[0] == kind]
        for i in range(steps):
            chunk = mine[i * n_moe:(i + 1) * n_moe]
            out[i][kind] = (sum(c[2] - c[1] for c in chunk), sum(c[3] for c in chunk))
    return out


def _split(res: dict, ep: int) -> dict[str, float]:
    """Seconds per step of each part on rank 0 (see the module docstring)."""
    steps, comm, ex = res["steps"], res["comm"], res["expert"]
    c = {k: v[0] for k, v in comm.items()}
    if ep == 1 and not ex:
        parts = {"moe (hooks: Python-step layers only)": res["moe"]}
    else:
        parts = {"route": ex.get("route", 0.0), "dispatch": c.get("ep_counts", 0.0) + c.get("ep_dispatch", 0.0),
                 "experts": ex.get("experts", 0.0), "combine": c.get("ep_combine", 0.0) + ex.get("combine", 0.0),
                 "kv exchange": c.get("ep_kv", 0.0), "all-reduce (TP)": c.get("all_reduce", 0.0)}
    parts["rest"] = res["wall"] - sum(parts.values())
    return {k: v / steps for k, v in parts.items()}


def _measured(runs: list[dict], kind: str, args) -> dict:
    """Prefill steps' and decode steps' exchanges (median seconds and bytes per kind, each rank) over the rounds. A
    step's tokens are counted from the routed rows (rank 0's load / top_k); a decode step forwards one token per
    request, a step with more tokens holds prefill chunks (the scheduler may split the prompts over steps)."""
    nreq = 1 if kind == "batch1" else 32
    kinds = ("ep_counts", "ep_dispatch", "ep_combine", "ep_kv")
    out = {"expert_load": runs[0]["load"], "steps": runs[0]["steps"]}
    for phase in ("prefill", "decode"):
        pairs = [(r0, r1) for x in runs for r0, r1 in zip(x["per_step"], x["rank1_per_step"])
                 if (r0[2] > nreq) == (phase == "prefill")]
        if not pairs:
            continue
        out[phase] = {"steps_per_round": len(pairs) / len(runs),
                      "tokens": statistics.median(r0[2] for r0, _ in pairs),
                      "step_seconds": statistics.median(r0[0] for r0, _ in pairs),
                      "seconds": {k: statistics.median(r0[1][k][0] for r0, _ in pairs) for k in kinds},
                      "bytes": {k: statistics.median(r0[1][k][1] for r0, _ in pairs) for k in kinds},
                      "rank1_seconds": {k: statistics.median(r1[k][0] for _, r1 in pairs) for k in kinds},
                      "rank1_bytes": {k: statistics.median(r1[k][1] for _, r1 in pairs) for k in kinds}}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--d-expert", type=int, default=384)
    ap.add_argument("--two-threads", action="store_true", help="also one process with 2 threads (the same cores as "
                    "EP=2; on a host loaded by other work its 2 OpenMP threads wait on each other: minutes per round)")
    args = ap.parse_args(argv)
    layouts = {**LAYOUTS, **(TWO_THREADS if args.two_threads else {})}
    set_threads(1)
    import torch

    from scratchlm.model.loading.checkpoint import save_model
    from scratchlm.model.transformer import TransformerLM

    cfg = model_config(args)
    tmp = tempfile.TemporaryDirectory(prefix="ep-bench-")
    path = Path(tmp.name) / "moe.pt"
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    save_model(path, model)
    total = sum(p.numel() for p in model.parameters())
    per_layer_experts = sum(p.numel() for p in model.layers[0].ffn.experts.parameters())
    del model
    try:
        results = interleaved_clients(
            _client, {name: (str(path), ep, tp, threads, python_step, args.prompt_len, args.gen)
                      for name, (ep, tp, threads, python_step) in layouts.items()}, ("batch1", "batch32"), args.repeats)
    finally:
        tmp.cleanup()
    for kind in ("batch1", "batch32"):  # every contender generated the same greedy ids
        ref = results[BASELINE][kind][0]["ids"]
        same = {name: all(x["ids"] == ref for x in results[name][kind]) for name in layouts}
        print(f"{kind}: greedy ids equal to {BASELINE}: {same}", file=sys.stderr)
    load = os.getloadavg()
    rep = Report("expert_parallel", "Expert parallelism (EP=2, gloo) vs one process on a MoE model (CPU)",
                 argv or sys.argv[1:])
    f = cfg.moe
    rep.add(f"Model: synthetic Qwen3-MoE-shaped, random weights (std 0.02), fp32: {cfg.n_layers} layers, d_model "
            f"{cfg.d_model}, {cfg.n_heads} heads / {cfg.n_kv_heads} KV heads, {f.n_experts} experts of width "
            f"{cfg.d_expert}, top-{f.top_k} (softmax, normalised), every layer MoE; {total / 1e6:.0f} M parameters "
            f"({per_layer_experts * cfg.n_layers / 1e6:.0f} M in experts). Prompts of {args.prompt_len} random "
            f"tokens, {args.gen} greedy tokens each; median of {args.repeats} interleaved rounds after a warm-up "
            f"round. Load average at the end: {load[0]:.2f} / {load[1]:.2f} (2 cores, shared with other work). "
            f"EP=2 and TP=2 use both cores, the 1-thread process one"
            + (", the 2-thread process both." if args.two_threads else
               "; a 2-thread process (`--two-threads`) is left out: on this loaded host its OpenMP threads stall "
               "on each other (measured 25x slower than 1 thread in a first run), which measures the host, not "
               "the engine."))
    same_text = []
    for kind in ("batch1", "batch32"):
        ref = results[BASELINE][kind][0]["ids"]
        ok = [name for name in layouts if all(x["ids"] == ref for x in results[name][kind])]
        same_text.append(f"{kind}: {len(ok)}/{len(layouts)} contenders generated exactly the greedy ids of "
                         f"'{BASELINE}'" + ("" if len(ok) == len(layouts) else f" (only {ok})"))
    rep.add("Agreement: " + "; ".join(same_text) + ".")
    def wall(name: str, kind: str) -> float:
        return statistics.median(x["wall"] for x in results[name][kind])

    rows = []
    for name in layouts:
        b1, b32 = wall(name, "batch1"), wall(name, "batch32")
        tok1, tok32 = results[name]["batch1"][0]["tokens"], results[name]["batch32"][0]["tokens"]
        rows.append([name, f"{b1 / tok1 * 1e3:.1f} ms", f"{wall(BASELINE, 'batch1') / b1:.2f}x",
                     f"{wall(PYTHON_STEP, 'batch1') / b1:.2f}x", f"{tok32 / b32:.1f} tok/s",
                     f"{wall(BASELINE, 'batch32') / b32:.2f}x", f"{wall(PYTHON_STEP, 'batch32') / b32:.2f}x"])
    rep.table(["layout", "batch-1 time / token", "vs 1 process", "vs Python step", "32 requests: throughput",
               "vs 1 process", "vs Python step"], rows,
              f"Latency and throughput (ratios: speed-up over '{BASELINE}' (the fused C++ step) and over "
              f"'{PYTHON_STEP}', same model and requests)")
    srows, measured = [], {}
    for name, (ep, tp, _, _) in layouts.items():
        if tp > 1:
            continue
        for kind in ("batch1", "batch32"):
            runs = results[name][kind]
            splits = [_split(x, ep) for x in runs]
            parts = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
            step = statistics.median(x["wall"] / x["steps"] for x in runs)
            srows.append([name, kind, f"{step * 1e3:.2f} ms",
                          ", ".join(f"{k} {v * 1e3:.2f} ms ({v / step:.0%})" for k, v in parts.items() if v)])
            if ep > 1:
                measured[kind] = _measured(runs, kind, args)
    rep.table(["layout", "workload", "step time", "per step on rank 0 (share of the step)"], srows,
              "Where a step's time goes (rank 0; an all-to-all includes waiting for the other rank)")
    brow = []
    for kind, m in measured.items():
        for phase in ("prefill", "decode"):
            if phase not in m:
                continue
            ph = m[phase]
            for k in ("ep_dispatch", "ep_combine", "ep_counts", "ep_kv"):
                sec, nbytes = ph["seconds"][k], ph["bytes"][k]
                sec1, nbytes1 = ph["rank1_seconds"][k], ph["rank1_bytes"][k]
                brow.append([kind, f"{phase} ({ph['steps_per_round']:.0f} a round)", f"{ph['tokens']:.0f}", k,
                             f"{nbytes / 1e3:.1f} / {nbytes1 / 1e3:.1f} kB",
                             f"{sec * 1e3:.3f} / {sec1 * 1e3:.3f} ms"])
    rep.table(["workload", "step", "tokens in the step", "exchange", "bytes sent / step (rank 0 / rank 1)",
               "time / step (rank 0 / rank 1)"], brow,
              "EP=2 exchanges per engine step, measured on each rank (medians; prefill: the steps with prompt "
              "chunks, decode: the steps of one token per request; tokens: those the step forwards, from the routed "
              f"rows); {cfg.n_layers} MoE layers, one call of each per layer")
    imb = []
    for kind, m in measured.items():
        if m["expert_load"]:
            from scratchlm.server.metrics import expert_imbalance

            vals = [expert_imbalance(c) for c in m["expert_load"].values()]
            imb.append(f"{kind}: max/mean per layer {min(vals):.2f}..{max(vals):.2f}")
    if imb:
        rep.add("Expert load imbalance (routed rows, max / mean, over the layers): " + "; ".join(imb) + ".")
    data = {"model": cfg.to_dict(), "prompt_len": args.prompt_len, "gen": args.gen, "ep": 2, "tp": 1,
            "threads_per_rank": 1, "backend": "gloo", "elem_bytes": 4, "measured": measured,
            "note": "bytes: what rank 0 sends to the other rank per engine step (Comm.bytes); ep_dispatch and "
                    "ep_combine: the all_to_all_single of the token rows (tokens x top_k x d_model x 4 x (ep-1)/ep "
                    "on average), ep_counts: the per-expert counts' all-gather, ep_kv: the data-parallel "
                    "attention's new K/V rows sent to the other replica (all_to_all_single)"}
    rep.add("Machine-readable (also in the .json next to this file): per-step all-to-all bytes and times, "
            "for the planner's validation:\n\n```json\n" + json.dumps(data["measured"], indent=1, default=str)[:6000]
            + "\n```")
    out = rep.write()
    out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
