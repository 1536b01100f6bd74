"""The planner's predictions against measured figures on this machine, then projections on paper.

    python -m benchmarks.sequence_parallel            # first: the measured prefill figures (JSON in results/)
    python -m benchmarks.plan_validation              # calibrate, measure decode, compare, project

1. Calibrate this machine (`scratchlm.plan.calibrate`): GEMM FLOP/s, GEMV bandwidth and softmax rate in
   thread CPU time (the work, which the shared machine's load does not inflate), gloo all-reduce in wall time.
2. Prefill: every point of the latest results/*-sequence_parallel*.json (T tokens on P ranks, ring or
   Ulysses) against `predict(..., Layout(cp=P))`: rank CPU time vs the predicted compute + memory time,
   wall time vs the prediction with P ranks sharing the cores, KV and peak memory per rank.
3. Decode: greedy decode steps from a sharded KV cache (P = 1, 2, 4), measured here, against the
   predicted decode step.
4. Parallelism benchmark figures (results/*-parallel.json from benchmarks/parallel.py), when present.
5. Projections: a 16-node CPU cluster on 25 GbE, 8 x H100 NVLink, 1,000 H100s; the best layouts, and
   where communication overtakes compute.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import REPO_ROOT, RESULTS_DIR, Report, set_threads

CLUSTERS = REPO_ROOT / "recipes" / "clusters"


def _decode_worker(rank: int, world: int, model_path: str, prompt_len: int, steps: int) -> dict:
    import torch

    from scratchlm.model import load
    from scratchlm.parallel.sequence import ContextParallelLM

    model = load(model_path).model.eval()
    ids = torch.randint(3, model.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    cp = ContextParallelLM(model, "ring")
    tok = int(cp.logits(cp.prefill(ids)[-1]).argmax())
    walls, cpus = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        tok = int(cp.decode_step(tok).argmax())
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    return {"wall_s": statistics.median(walls[1:]), "cpu_s": statistics.median(cpus[1:])}


def _latest(pattern: str) -> list[Path]:
    return sorted(RESULTS_DIR.glob(pattern))


def _verdict(pred: float, meas: float) -> tuple[str, str, bool]:
    r = pred / meas if meas else float("nan")
    ok = 0.7 <= r <= 1.3
    return f"{r:.2f}", "yes" if ok else "no", ok


def main(argv: list[str] | None = None) -> int:
    from scratchlm.defaults import default_model_path
    from scratchlm.model.config import ModelConfig
    from scratchlm.parallel.sequence import spawn_gloo
    from scratchlm.plan import Layout, Workload, load_cluster, plan, predict
    from scratchlm.plan.calibrate import calibrate
    from scratchlm.plan.cli import format_table, load_model_config
    from scratchlm.plan.cost import explain

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode-prompt", type=int, default=256, help="prompt length before the timed decode steps")
    ap.add_argument("--decode-steps", type=int, default=9)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--skip-measure", action="store_true", help="no decode measurement (projections only)")
    args = ap.parse_args(argv)
    set_threads(1)
    report = Report("plan_validation", "Planner: predicted vs measured, then projections",
                    argv if argv is not None else sys.argv[1:])

    # 1. calibration
    local = calibrate(clock="thread_cpu")
    cores = local.devices_per_node
    report.table(["figure", "value"], [
        ["GEMM (1 thread, thread CPU time)", f"{local.flops / 1e9:.1f} GFLOP/s"],
        ["GEMV bandwidth (1 thread)", f"{local.mem_bw / 1e9:.2f} GB/s"],
        ["attention softmax rate", f"{local.softmax_rate / 1e6:.0f} M score elements/s"],
        ["gloo all-reduce latency (2 ranks, loopback)", f"{local.intra_latency * 1e6:.0f} us"],
        ["gloo all-reduce bandwidth", f"{local.intra_bw / 1e9:.2f} GB/s"],
        ["cores (ranks without oversubscription)", str(cores)],
    ], "Calibration of this machine")

    rows, n_ok, n_all = [], 0, 0
    # 2. prefill figures from the sequence benchmark
    for path in _latest("*-sequence_parallel*.json"):
        data = json.loads(path.read_text())
        cfg = ModelConfig.from_dict(data["config"]) if hasattr(ModelConfig, "from_dict") else ModelConfig(
            **data["config"])
        for p in data["points"]:
            w = Workload(prompt_len=p["seq_len"], output_len=1, concurrency=1)
            lay = Layout(cp=p["world"])
            pr = predict(cfg, w, local, lay, ranks_per_node=cores, cp_kind=p["backend"])  # no oversubscription
            work = max(pr.prefill.compute, pr.prefill.memory)
            r, ok_s, ok = _verdict(work, p["cpu_s"])
            n_ok += ok
            n_all += 1
            label = f"{data['model']} prefill T={p['seq_len']} {p['backend']} CP={p['world']}"
            rows.append([label, "rank CPU s", f"{work:.2f}", f"{p['cpu_s']:.2f}", r, ok_s])
            pw = predict(cfg, w, local, lay, ranks_per_node=max(cores, p["world"]), cp_kind=p["backend"])
            r, ok_s, _ = _verdict(pw.prefill.total, p["wall_s"])
            rows.append([label, "wall s (info)", f"{pw.prefill.total:.2f}", f"{p['wall_s']:.2f}", r, ok_s])
            r, ok_s, ok = _verdict(pr.kv_bytes / 2**20, p["kv_mib"])
            n_ok += ok
            n_all += 1
            rows.append([label, "KV MiB / rank", f"{pr.kv_bytes / 2**20:.1f}", f"{p['kv_mib']:.1f}", r, ok_s])
            mem = (pr.kv_bytes + pr.activation_bytes) / 2**20
            r, ok_s, ok = _verdict(mem, p["peak_mib"])
            n_ok += ok
            n_all += 1
            rows.append([label, "peak MiB / rank (KV + activations)", f"{mem:.0f}", f"{p['peak_mib']:.0f}", r, ok_s])

    # 3. decode steps
    model_path = str(default_model_path())
    cfg = load_model_config(model_path)
    if not args.skip_measure:
        for world in [int(x) for x in args.worlds.split(",")]:
            print(f"[plan validation] decode P={world} load {os.getloadavg()[0]:.1f}", file=sys.stderr)
            res = spawn_gloo(_decode_worker, world, model_path, args.decode_prompt, args.decode_steps)
            cpu = max(r["cpu_s"] for r in res)
            wall = max(r["wall_s"] for r in res)
            w = Workload(prompt_len=args.decode_prompt, output_len=2, concurrency=1)
            pr = predict(cfg, w, local, Layout(cp=world), ranks_per_node=cores)
            work = max(pr.decode.compute, pr.decode.memory)
            r, ok_s, ok = _verdict(work, cpu)
            n_ok += ok
            n_all += 1
            label = f"SmolLM2-135M decode step, prompt {args.decode_prompt}, CP={world}"
            rows.append([label, "rank CPU s", f"{work * 1e3:.1f} ms", f"{cpu * 1e3:.1f} ms", r, ok_s])
            pw = predict(cfg, w, local, Layout(cp=world), ranks_per_node=max(cores, world))
            r, ok_s, _ = _verdict(pw.decode.total, wall)
            rows.append([label, "wall s (info)", f"{pw.decode.total * 1e3:.1f} ms", f"{wall * 1e3:.1f} ms", r, ok_s])

    # 4. the parallelism benchmark's figures (benchmarks/parallel.py: engine, batch-1 and 32 requests, wall time)
    wall_spec = None
    for path in _latest("*-parallel.md"):
        text = path.read_text()
        m = re.search(r"--model (\S+)", text)
        pm = re.search(r"prompts of (\d+) random tokens, (\d+) greedy tokens", text)
        if pm is None:
            continue
        bench_cfg = load_model_config(m.group(1) if m else None)
        prompt_len, gen = int(pm.group(1)), int(pm.group(2))
        if wall_spec is None:
            wall_spec = calibrate(clock="wall")
        for row in re.finditer(r"^\| ((?:TP|PP)=\d[^|]*?) \| ([\d.]+) ms \| [^|]+ \| ([\d.]+) tok/s \|", text, re.M):
            name, ms, tps = row.group(1), float(row.group(2)), float(row.group(3))
            if "2 threads" in name:
                continue  # one rank with two threads: not a layout of the model
            tp = int(re.search(r"TP=(\d)", name).group(1)) if "TP=" in name else 1
            pp = int(re.search(r"PP=(\d)", name).group(1)) if "PP=" in name else 1
            lay = Layout(tp=tp, pp=pp)
            one = predict(bench_cfg, Workload(prompt_len, gen, 1), wall_spec, lay, ranks_per_node=cores)
            per_tok = one.total_s / gen
            r, ok_s, ok = _verdict(per_tok, ms / 1e3)
            n_ok += ok
            n_all += 1
            label = f"{path.stem}: {Path(m.group(1)).name if m else 'default'} engine {lay}"
            rows.append([label, "batch-1 time / token (wall)", f"{per_tok * 1e3:.1f} ms", f"{ms:.1f} ms", r, ok_s])
            many = predict(bench_cfg, Workload(prompt_len, gen, 32), wall_spec, lay, ranks_per_node=cores)
            r, ok_s, ok = _verdict(many.throughput, tps)
            n_ok += ok
            n_all += 1
            rows.append([label, "32 requests: tok/s (wall)", f"{many.throughput:.0f}", f"{tps:.0f}", r, ok_s])

    report.table(["configuration", "figure", "predicted", "measured", "predicted / measured", "within +-30 %"],
                 rows, f"Predicted vs measured: {n_ok} of {n_all} checked figures within +-30 % "
                 "(rows marked 'info' are wall times on a shared, oversubscribed machine and are not counted)")

    # 5. projections on paper
    projections = [
        ("cpu16_25gbe.toml", "llama3-8b.toml", Workload(prompt_len=2048, output_len=256, concurrency=32)),
        ("h100x8_nvlink.toml", "llama3-70b.toml", Workload(prompt_len=4096, output_len=512, concurrency=64)),
        ("gpu1000_ib.toml", "llama3-70b.toml", Workload(prompt_len=8192, output_len=512, concurrency=2000)),
    ]
    for cluster_file, model_file, w in projections:
        cluster = load_cluster(CLUSTERS / cluster_file)
        mcfg = load_model_config(str(CLUSTERS / "models" / model_file))
        ranked = plan(mcfg, w, cluster)
        report.add(f"### {cluster.name}: {model_file[:-5]}, prompt {w.prompt_len}, output {w.output_len}, "
                   f"concurrency {w.concurrency}\n\n```\n{format_table(ranked, 6)}\n```\n\n{explain(ranked)}")
        report.add(crossover_text(mcfg, cluster))
    report.write()
    return 0


def crossover_text(cfg, cluster) -> str:
    """Where communication overtakes compute: TP in a decode step, ring CP in a prefill."""
    from scratchlm.plan import Layout, Workload, predict

    lines = []
    w = Workload(prompt_len=1024, output_len=128, concurrency=8)
    tps = [t for t in (1, 2, 4, 8, 16) if t <= cfg.n_kv_heads and t <= cluster.devices]
    cells = []
    for tp in tps:
        p = predict(cfg, w, cluster, Layout(tp=tp))
        cells.append(f"TP{tp}: {max(p.decode.compute, p.decode.memory) * 1e3:.2f} ms work + "
                     f"{p.decode.network * 1e3:.2f} ms network")
    over = next((tp for tp in tps if predict(cfg, w, cluster, Layout(tp=tp)).decode.network
                 > max(predict(cfg, w, cluster, Layout(tp=tp)).decode.compute,
                       predict(cfg, w, cluster, Layout(tp=tp)).decode.memory)), None)
    lines.append("Decode step, batch 8, context ~1K, by TP degree: " + "; ".join(cells) + ". " +
                 (f"Communication overtakes the work at TP={over}." if over else
                  "Communication stays below the work up to the largest TP tried."))
    cps = [c for c in (2, 4, 8, 16, 32) if c <= cluster.devices]
    cells = []
    for cp in cps:
        t_cross = None
        for t in [2**k for k in range(4, 21)]:
            p = predict(cfg, Workload(prompt_len=t, output_len=1, concurrency=1), cluster, Layout(cp=cp))
            if p.prefill.compute >= p.prefill.overlapped_network:
                t_cross = t
                break
        cells.append(f"CP{cp}: {t_cross if t_cross else '> 1M'}")
        # ring K/V traffic per step ~ T/cp, the block's compute ~ (T/cp)^2: long prompts hide the ring
    lines.append("Ring-attention prefill: shortest prompt (power of two) at which a rank's compute hides its K/V "
                 "transfers -- " + ", ".join(cells) + ". Shorter prompts are network-bound: there splitting the "
                 "sequence costs more in communication than it saves.")
    return "\n\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
