"""The planner's predictions against figures measured in the same run, then projections on paper.

    python -m benchmarks.plan_validation              # calibrate, measure, compare, project (~10 min)
    python -m benchmarks.plan_validation --quick      # fewer points (a smoke run)

1. Calibrate this machine (`scratchlm.plan.calibrate`) at each measured model's shapes: the linear curve
   (weight elements/s against rows), attention, elementwise and overhead rates in thread CPU time (the
   work, which the other users of this shared machine do not inflate as much as wall time), activation
   memory per token / per score element, gloo all-reduce in wall time.
2. Sequence-parallel prefill (the sequence benchmark's configurations, measured here): T tokens on P
   ranks, ring (SmolLM2-135M) and Ulysses (stories260K), against `predict(..., Layout(cp=P))`: the busiest
   rank's CPU time vs the predicted work, KV and peak memory per rank; wall time as info.
3. The parallelism issue's engine configurations (benchmarks/parallel.py, benchmarks/router.py): the real
   `LLMEngine` with TP=1, TP=2, PP=2 (one thread per rank) and DP=2 (two TP=1 engines, the router's
   replicas, each with half of the requests), batch 1 and 32 requests of 16-token prompts and 16 greedy
   tokens: CPU time per decode step of every rank against the predicted work of that rank, the
   32-request throughput per busiest-rank CPU second against the prediction without communication, and
   communication per step (`comm_stats` on rank 0) against the alpha-beta prediction. Wall figures as info.
4. Projections: a 16-node CPU cluster on 25 GbE, 8 x H100 NVLink, 1,000 H100s; the best layouts, and
   where communication overtakes compute.

    python -m benchmarks.plan_validation --moe       # the mixture-of-experts validation only (~10 min)

`--moe`: a Qwen3-MoE-shaped model with random weights (`MOE_MODEL`: 8 blocks, 32 experts of width 256, top-4,
109M parameters, 21M active) saved here, the machine calibrated at its shapes (with the MoE block's per-expert
and routing overheads), then the real `LLMEngine` with one rank, expert parallelism EP=2 (two data-parallel
attention replicas sharing the experts, `EngineConfig.expert_parallel_size`) and EP=2 x TP=2, at 1 and 8 requests
(the EP runs: 16): every rank's CPU time per decode step and the batched prefill's against the predicted work,
and the all-to-alls per step on rank 0 against the alpha-beta prediction (info: wall, includes waiting); then
DeepSeek-V3 and Kimi K2 projected on 1, 2 and 4 nodes of 8 x H100 and on the 16-node CPU cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import REPO_ROOT, Report, set_threads, shared_data_dir

CLUSTERS = REPO_ROOT / "recipes" / "clusters"
ENGINE_LAYOUTS = {"TP=1": (1, 1), "TP=2": (2, 1), "PP=2": (1, 2)}  # name: (tp, pp); DP=2 is two TP=1 engines


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of the main thread of process `pid` (gloo's transport threads, which partly
    spin while waiting for the peer, left out: as rank 0's `time.thread_time`)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _engine_client(conn, model: str | None, tp: int, pp: int, prompt_len: int, gen: int,
                   batches: list[int], start=None, ep: int = 1, warm_all: bool = False) -> None:
    """One engine (TP x PP (x EP) ranks; workers spawned by the engine) in its own process: for each batch size, the
    prefill step and every decode step timed on rank 0 (thread CPU, wall), the workers' process CPU over the
    decode steps, and rank 0's communication. Warm-up: one request, or (`warm_all`) every batch size once (the
    engine's linears choose their kernel per shape class at its first use, which a timed prefill must not
    include)."""
    import torch

    torch.set_num_threads(1)
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(model, EngineConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                           expert_parallel_size=ep, max_num_seqs=32,
                                                           max_num_batched_tokens=1024))
    runner = engine.runner
    procs = list(getattr(runner, "procs", []))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    out = {}
    n = 0
    if start is not None:
        start.wait()  # DP: the replicas run side by side
    warmups = list(batches) if warm_all else [1]
    for rep, batch in enumerate(warmups + batches):  # the first runs warm up
        for _ in range(batch):
            n += 1
            engine.add_request(f"v{n}", torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), params)
        if hasattr(runner, "comm"):
            runner.comm.reset_stats()
        c0, t0 = time.thread_time(), time.perf_counter()
        engine.step()  # the prompts' prefill (one step: batch x prompt_len <= max_num_batched_tokens)
        prefill = {"cpu": time.thread_time() - c0, "wall": time.perf_counter() - t0}
        comm_prefill = runner.comm_stats() if hasattr(runner, "comm_stats") else {}
        if hasattr(runner, "comm"):
            runner.comm.reset_stats()
        workers0 = [_proc_cpu(p.pid) for p in procs]
        cpus, walls = [], []
        while engine.has_unfinished_requests():  # rank 0: main-thread CPU, as the workers'
            c0, t0 = time.thread_time(), time.perf_counter()
            engine.step()
            cpus.append(time.thread_time() - c0)
            walls.append(time.perf_counter() - t0)
        steps = len(cpus)
        workers = [(_proc_cpu(p.pid) - w0) / steps for p, w0 in zip(procs, workers0)]
        comm = runner.comm_stats() if hasattr(runner, "comm_stats") else {}
        comm_bytes = dict(runner.comm.bytes) if hasattr(runner, "comm") else {}
        if rep >= len(warmups):
            out[batch] = {"prefill": prefill, "step_cpu": statistics.median(cpus),
                          "step_wall": statistics.median(walls), "decode_cpu_total": sum(cpus),
                          "decode_wall_total": sum(walls), "steps": steps, "workers_step_cpu": workers,
                          "comm": {k: (v[0] / steps, v[1] / steps) for k, v in comm.items()},
                          "comm_prefill": comm_prefill, "load": os.getloadavg()[0],
                          "comm_bytes": {k: v / steps for k, v in comm_bytes.items()}}
    if hasattr(runner, "shutdown"):
        runner.shutdown()
    conn.send(out)


def _run_engines(specs: list[tuple], model: str | None, prompt_len: int, gen: int, batches: list[list[int]],
                 warm_all: bool = False):
    """Run one client per spec (tp, pp[, ep]) at once (DP) or a single one; returns their results."""
    ctx = mp.get_context("spawn")
    start = ctx.Event() if len(specs) > 1 else None
    pipes, procs = [], []
    for spec, b in zip(specs, batches):
        tp, pp, ep = (*spec, 1)[:3]
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_engine_client, args=(child, model, tp, pp, prompt_len, gen, b, start, ep, warm_all))
        p.start()
        pipes.append(parent)
        procs.append(p)
    if start is not None:
        time.sleep(1.0)
        start.set()  # the clients wait after loading; loading happens before
    res = [c.recv() for c in pipes]
    for p in procs:
        p.join(60)
    return res


def _seq_worker(rank: int, world: int, model_path: str, seq_len: int, backend: str) -> dict:
    from benchmarks.sequence_parallel import _worker

    return _worker(rank, world, model_path, seq_len, backend)


CALIBRATION_HEADERS = ["shapes of", "GEMV (M=1)", "GEMM GFLOP/s (M=512)", "linear GFLOP/s by rows M",
                       "softmax (in cache / beyond)", "elementwise", "layer overhead", "engine step / seq",
                       "ring step", "comm CPU / call", "act. per token / score"]


def calibration_row(s) -> list[str]:
    """A ClusterSpec's calibrated figures for the report."""
    return [f"{s.linear_rate[0] * 4 / 1e9:.2f} GB/s", f"{2 * s.linear_rows[-1] * s.linear_rate[-1] / 1e9:.1f}",
            " ".join(f"{m}:{2 * m * r / 1e9:.1f}" for m, r in zip(s.linear_rows, s.linear_rate)),
            f"{s.softmax_rate_cached / 1e6:.0f} / {s.softmax_rate / 1e6:.0f} M/s",
            f"{s.elementwise_rate / 1e6:.0f} M/s", f"{s.layer_overhead * 1e6:.0f} us",
            f"{s.step_overhead * 1e6:.0f} / {s.seq_overhead * 1e6:.0f} us", f"{s.ring_step_overhead * 1e6:.0f} us",
            f"{s.comm_cpu * 1e6:.0f} us", f"{s.token_bytes / 1024:.1f} KiB / {s.score_bytes:.2f} B"]


@contextlib.contextmanager
def _mmap_threshold(nbytes: int = 65536):
    """Processes spawned inside get glibc's mmap threshold fixed at `nbytes` (see benchmarks/sequence_parallel.py:
    their RSS then follows their live tensors)."""
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(nbytes)
    try:
        yield
    finally:
        if old is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old


class Checks:
    """Rows of predicted vs measured; counted rows must fall within +-30 %."""

    def __init__(self) -> None:
        self.rows: list[list[str]] = []
        self.n_ok = self.n_all = 0

    def add(self, label: str, figure: str, pred: float, meas: float, fmt: str, counted: bool = True) -> None:
        r = pred / meas if meas else float("nan")
        ok = 0.7 <= r <= 1.3
        if counted:
            self.n_ok += ok
            self.n_all += 1
        verdict = ("yes" if ok else "no") if counted else "(info)"
        self.rows.append([label, figure, fmt.format(pred), fmt.format(meas), f"{r:.2f}", verdict])



def checks_tables(report: Report, checks, comm_rows: list[list[str]]) -> None:
    """The predicted-vs-measured table and the communication-per-step table of a validation part."""
    report.table(["configuration", "figure", "predicted", "measured", "predicted / measured", "within +-30 %"],
                 checks.rows, f"Predicted vs measured: {checks.n_ok} of {checks.n_all} checked figures within "
                 "+-30 % (rows marked (info) are wall times on a shared, oversubscribed machine, or communication "
                 "times that include waiting for the peer rank; they are not counted)")
    report.table(["configuration", "load", "measured comm per decode step (rank 0)", "predicted network"],
                 comm_rows, "Communication per decode step: measured on rank 0 (wall, includes waiting for "
                 "the peer) vs the alpha-beta prediction")

def main(argv: list[str] | None = None) -> int:
    from scratchlm.defaults import default_model_path
    from scratchlm.model import load
    from scratchlm.parallel.sequence import spawn_gloo
    from scratchlm.plan import Layout, Workload, load_cluster, plan, predict
    from scratchlm.plan.calibrate import calibrate, measure_comm_cpu
    from scratchlm.plan.cli import format_table, load_model_config
    from scratchlm.plan.cost import explain

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer prefill points (a smoke run)")
    ap.add_argument("--skip-measure", action="store_true", help="projections only")
    ap.add_argument("--prompt-len", type=int, default=16, help="engine runs: prompt tokens")
    ap.add_argument("--gen", type=int, default=16, help="engine runs: greedy tokens per request")
    ap.add_argument("--moe", action="store_true", help="the mixture-of-experts validation and projections only")
    ap.add_argument("--ep-json", default=None, help="with --moe: benchmarks/expert_parallel.py's JSON to predict "
                    "(default: the newest in benchmarks/results/)")
    args = ap.parse_args(argv)
    if args.moe:
        return moe_main(args, argv)
    set_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    report = Report("plan_validation", "Planner: predicted vs measured (same run), then projections",
                    argv if argv is not None else sys.argv[1:])
    load0 = os.getloadavg()
    smol_path = str(default_model_path())
    stories_path = str(shared_data_dir() / "models" / "stories260K" / "stories260K.bin")
    checks = Checks()
    log = lambda s: print(f"[plan validation {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {s}",  # noqa: E731
                          file=sys.stderr, flush=True)

    if not args.skip_measure:
        # 1. calibration at each model's shapes
        smol = load(smol_path)
        smol_cfg, smol_tok = smol.config, smol.tokenizer
        cal = {}
        log("calibrating at SmolLM2-135M's shapes")
        cal["smol"] = calibrate(clock="thread_cpu", model=smol.config, tokenizer=smol.tokenizer, log=log)
        stories_cfg = load_model_config(stories_path)
        log("calibrating at stories260K's shapes")
        cal["stories"] = calibrate(clock="thread_cpu", model=stories_cfg, network=False, log=log)
        del smol
        cores = cal["smol"].devices_per_node
        rows = [[name, *calibration_row(spec)] for name, spec in cal.items()]
        report.table(CALIBRATION_HEADERS, rows, "Calibration of this machine (thread CPU time, one thread)")
        net = cal["smol"]
        report.add(f"gloo all-reduce over loopback (2 ranks, wall): latency {net.intra_latency * 1e6:.0f} us, "
                   f"bandwidth {net.intra_bw / 1e9:.2f} GB/s. Cores: {cores}. Load average at the start: "
                   f"{load0[0]:.2f} / {load0[1]:.2f} / {load0[2]:.2f}.")
        for name in cal:  # the network figures of the stories calibration were skipped
            cal[name].intra_latency = cal[name].inter_latency = net.intra_latency
            cal[name].intra_bw = cal[name].inter_bw = net.intra_bw
            cal[name].comm_cpu = net.comm_cpu

        def refresh(key: str) -> None:
            """Re-measure the compute rates just before a group of measurements (the machine's speed drifts
            with its load over the run); memory and network figures are kept."""
            cfg = smol_cfg if key == "smol" else stories_cfg
            log(f"re-calibrating the compute rates at {key}'s shapes")
            new = calibrate(clock="thread_cpu", model=cfg, network=False, memory=False,
                            tokenizer=smol_tok if key == "smol" else None)
            for f in ("flops", "mem_bw", "softmax_rate", "softmax_rate_cached", "elementwise_rate",
                      "layer_overhead", "step_overhead", "seq_overhead", "ring_step_overhead", "linear_rate"):
                setattr(cal[key], f, getattr(new, f))
            if key == "smol":  # before the engine runs: the CPU cost of a collective call drifts with the load
                cal[key].comm_cpu = measure_comm_cpu()
            refreshed.append([key, *calibration_row(cal[key])])

        refreshed: list[list[str]] = []
        # 2. sequence-parallel prefill, measured here
        points = [(smol_path, "smol", "ring", t) for t in ((512,) if args.quick else (512, 1024))]
        points += [(stories_path, "stories", "ulysses", t) for t in ((1024,) if args.quick else (1024, 2048))]
        for i, (path, key, backend, t) in enumerate(points):
            if i and key != points[i - 1][1]:
                refresh(key)
            cfg = load_model_config(path)
            for world in (1, 2, 4):
                log(f"prefill {Path(path).name} {backend} T={t} P={world}")
                # Time and memory from two runs: peak memory needs glibc's mmap threshold at 64 KiB (every
                # tensor its own mapping, freed ones leave the RSS), which makes every allocation page-fault
                # and inflates the CPU time (measured: 3.1 s -> 4.5 s at T=512); time runs with the default.
                res = spawn_gloo(_seq_worker, world, path, t, backend)
                with _mmap_threshold():
                    mem = spawn_gloo(_seq_worker, world, path, t, backend)
                cpu = max(r["cpu_s"] for r in res)
                wall = max(r["wall_s"] for r in res)
                w = Workload(prompt_len=t, output_len=1, concurrency=1)
                lay = Layout(cp=world)
                pr = predict(cfg, w, cal[key], lay, ranks_per_node=cores, cp_kind=backend)
                label = f"{Path(path).stem} prefill T={t} {backend} CP={world}"
                checks.add(label, "rank CPU s", pr.prefill.work, cpu, "{:.2f}")
                pw = predict(cfg, w, cal[key], lay, ranks_per_node=max(cores, world), cp_kind=backend)
                checks.add(label, "wall s", pw.prefill.total, wall, "{:.2f}", counted=False)
                checks.add(label, "KV MiB / rank", pr.kv_bytes / 2**20, max(r["kv_mib"] for r in mem), "{:.1f}")
                checks.add(label, "peak MiB / rank (KV + activations)", (pr.kv_bytes + pr.activation_bytes) / 2**20,
                           max(r["peak_mib"] for r in mem), "{:.0f}")

        # 3. the engine: TP / PP / DP
        s = cal["smol"]
        runs = {}
        for name, (tp, pp) in ENGINE_LAYOUTS.items():
            refresh("smol")
            log(f"engine {name}")
            runs[name] = _run_engines([(tp, pp)], None, args.prompt_len, args.gen, [[1, 32]])[0]
        refresh("smol")
        log("engine DP=2 (two TP=1 replicas, 16 requests each, side by side)")
        dp = _run_engines([(1, 1), (1, 1)], None, args.prompt_len, args.gen, [[16], [16]])
        comm_rows = []
        for name, res in [*runs.items(), ("DP=2", None)]:
            tp, pp = ENGINE_LAYOUTS.get(name, (1, 1))
            lay = Layout(dp=2) if name == "DP=2" else Layout(tp=tp, pp=pp)
            for batch in (1, 32):
                if name == "DP=2" and batch == 1:
                    continue
                w = Workload(args.prompt_len, args.gen, batch)
                pr = predict(smol_cfg, w, s, lay, ranks_per_node=cores)
                label = f"SmolLM2-135M engine {name}, batch {batch}"
                if name == "DP=2":
                    r = max((x[16] for x in dp), key=lambda x: x["step_cpu"])
                    ranks = [("replica (busiest)", r["step_cpu"], pr.decode_rank.work)]
                else:
                    r = res[1 if batch == 1 else 32]
                    m = pr.microbatches
                    stage_of = [i // tp for i in range(tp * pp)]  # rank -> pipeline stage (TP innermost)
                    meas = [r["step_cpu"], *r["workers_step_cpu"]]
                    bcast = 2 * s.comm_cpu if lay.world > 1 else 0.0  # the step command
                    ranks = [(f"rank {i}", meas[i], m * pr.decode_stages[stage_of[i]].work + bcast
                              + (pr.engine_overhead if i == 0 else 0.0)) for i in range(len(meas))]
                for who, meas_cpu, pred_cpu in ranks:
                    checks.add(label, f"decode step CPU, {who}", pred_cpu * 1e3, meas_cpu * 1e3, "{:.1f} ms")
                pw = predict(smol_cfg, w, s, lay, ranks_per_node=max(cores, lay.world))
                checks.add(label, "decode step wall", pw.decode.total * 1e3, r["step_wall"] * 1e3, "{:.1f} ms",
                           counted=False)
                if batch > 1:
                    if name == "DP=2":
                        busiest = max(x[16]["prefill"]["cpu"] + x[16]["decode_cpu_total"] for x in dp)
                        walls = max(x[16]["prefill"]["wall"] + x[16]["decode_wall_total"] for x in dp)
                    else:
                        per_rank = [r["prefill"]["cpu"] + r["decode_cpu_total"]]
                        busiest = max(per_rank[0], max((c * r["steps"] for c in r["workers_step_cpu"]), default=0.0)
                                      + r["prefill"]["cpu"])  # workers: prefill taken as rank 0's
                        walls = r["prefill"]["wall"] + r["decode_wall_total"]
                    tokens = 32 * args.gen
                    pred_work = pr.batch_prefill.work + args.gen * pr.decode_rank.work
                    checks.add(label, "32 requests: tok/s per busiest-rank CPU s", tokens / pred_work,
                               tokens / busiest, "{:.0f}")
                    checks.add(label, "32 requests: tok/s (wall)", pw.throughput, tokens / walls, "{:.0f}",
                               counted=False)
                if name == "DP=2" or lay.world == 1:
                    continue
                comm = r["comm"]
                keys = ["all_reduce", "all_gather", "broadcast"] if tp > 1 else ["broadcast", "send"]
                meas_net = sum(comm.get(k, (0.0, 0))[0] for k in keys)
                checks.add(label, "comm / step, rank 0 (" + " + ".join(keys) + ")", pr.decode.network * 1e3,
                           meas_net * 1e3, "{:.2f} ms", counted=False)
                comm_rows.append([label, f"{r['load']:.1f}", ", ".join(f"{k} {v[0] * 1e3:.2f} ms ({v[1]:.0f} calls)"
                                                                         for k, v in sorted(comm.items())),
                                  f"{pr.decode.network * 1e3:.2f} ms"])
        report.table(["shapes of", *CALIBRATION_HEADERS[1:]], refreshed,
                     "The compute rates re-measured before each group of measurements (the predictions of a group "
                     "use its own; in order: SmolLM2 prefill, stories260K prefill, engine TP=1, TP=2, PP=2, DP=2)")
        checks_tables(report, checks, comm_rows)

    # 4. projections on paper
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


MOE_MODEL = dict(vocab_size=4096, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=1024, max_seq_len=1024,
                 tie_embeddings=True, attn={"qk_norm": "head"}, moe={"n_experts": 32, "top_k": 4, "d_expert": 256})
MOE_LAYOUTS = {"one rank": (1, 1, 1), "EP=2": (1, 1, 2), "EP=2 x TP=2": (2, 1, 2)}  # name: (tp, pp, ep)
MOE_PROJECTIONS = [  # (cluster file, nodes, model, (prompt, output, concurrency))
    *[("h100x8_ib_fp8.toml", n, m, (2048, 512, 256)) for m in ("deepseek-v3", "kimi-k2") for n in (1, 2, 4)],
    *[("cpu16_25gbe.toml", 16, m, (2048, 256, 64)) for m in ("deepseek-v3", "kimi-k2")],
]


def moe_main(args, argv) -> int:
    """The mixture-of-experts validation (see the module docstring, `--moe`)."""
    import tempfile

    import torch

    from scratchlm.model.config import ModelConfig
    from scratchlm.model.loading.checkpoint import save_model
    from scratchlm.model.transformer import TransformerLM
    from scratchlm.plan import Layout, Workload, predict
    from scratchlm.plan.calibrate import calibrate, measure_comm_cpu

    set_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    report = Report("plan_validation_moe", "Planner on mixture-of-experts models: predicted vs measured (same run), "
                    "then DeepSeek-V3 and Kimi K2 projections", argv if argv is not None else sys.argv[1:])
    log = lambda s: print(f"[plan validation moe {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {s}",  # noqa: E731
                          file=sys.stderr, flush=True)
    if not args.skip_measure:
        cfg = ModelConfig(**MOE_MODEL)
        tmp = tempfile.mkdtemp(prefix="plan_moe_")
        path = str(Path(tmp) / "moe.pt")
        torch.manual_seed(0)
        save_model(path, TransformerLM(cfg))
        report.add(f"Model: `ModelConfig(**MOE_MODEL)` (Qwen3-MoE-shaped: {cfg.n_layers} blocks, d_model "
                   f"{cfg.d_model}, {cfg.moe.n_experts} experts of width {cfg.d_expert}, top-{cfg.moe.top_k}, "
                   f"q/k-norm), random weights (seed 0), float32: {cfg.num_parameters() / 1e6:.1f}M parameters, "
                   f"{cfg.active_parameters() / 1e6:.1f}M active per token. Prompts of {args.prompt_len} random "
                   f"tokens, {args.gen} greedy tokens each.")
        log("calibrating at the MoE model's shapes")
        cal = calibrate(clock="thread_cpu", model=cfg, log=log)
        cores = cal.devices_per_node
        checks = Checks()
        cal_rows = []

        def cal_row(name: str) -> None:
            cal_rows.append([name, *calibration_row(cal), " ".join(
                f"{m}:{2 * m * r / 1e9:.1f}" for m, r in zip(cal.linear_rows, cal.expert_linear_rate)),
                f"{cal.moe_overhead * 1e6:.0f} / {cal.expert_overhead * 1e6:.0f} / "
                f"{cal.ep_layer_overhead * 1e6:.0f} us"])

        cal_row("start")
        comm_rows = []
        for name, (tp, pp, ep) in MOE_LAYOUTS.items():
            if name != "one rank":  # the compute rates drift with the machine's load: re-measured per layout
                log("re-calibrating the compute rates")
                new = calibrate(clock="thread_cpu", model=cfg, network=False, memory=False)
                for f in ("flops", "mem_bw", "softmax_rate", "softmax_rate_cached", "elementwise_rate",
                          "layer_overhead", "step_overhead", "seq_overhead", "linear_rate", "moe_overhead",
                          "expert_overhead", "expert_linear_rate"):
                    setattr(cal, f, getattr(new, f))
                cal.comm_cpu = measure_comm_cpu()
                cal_row(f"before {name}")
            batches = [1 * ep, 8 * ep]  # 1 and 8 sequences per replica
            log(f"engine {name}")
            res = _run_engines([(tp, pp, ep)], path, args.prompt_len, args.gen, [batches], warm_all=True)[0]
            lay = Layout(dp=ep, tp=tp, ep=ep)
            for batch in batches:
                w = Workload(args.prompt_len, args.gen, batch)
                pr = predict(cfg, w, cal, lay, ranks_per_node=cores)
                pw = predict(cfg, w, cal, lay, ranks_per_node=max(cores, lay.world))
                r = res[batch]
                label = f"MoE engine {name}, {batch} request{'s' if batch > 1 else ''}"
                bcast = 2 * cal.comm_cpu if lay.world > 1 else 0.0  # the step command
                meas = [r["step_cpu"], *r["workers_step_cpu"]]
                for i, m in enumerate(meas):
                    pred_cpu = pr.decode_stages[0].work + bcast + (pr.engine_overhead if i == 0 else 0.0)
                    checks.add(label, f"decode step CPU, rank {i}", pred_cpu * 1e3, m * 1e3, "{:.1f} ms")
                checks.add(label, "decode step wall", pw.decode.total * 1e3, r["step_wall"] * 1e3, "{:.1f} ms",
                           counted=False)
                checks.add(label, "prefill step CPU, rank 0", pr.batch_prefill.work * 1e3,
                           r["prefill"]["cpu"] * 1e3, "{:.1f} ms")
                if ep > 1:
                    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
                    rows = batch // ep
                    sent = 2 * n_moe * rows * cfg.moe.top_k * cfg.d_model * 4 * (ep - 1) / ep  # to the other ranks
                    got = sum(r["comm_bytes"].get(k, 0.0) for k in ("ep_dispatch", "ep_combine"))
                    checks.add(label, "all-to-all bytes per step, rank 0 (dispatch + combine)", sent / 1e3,
                               got / 1e3, "{:.1f} kB")
                    a2a = sum(r["comm"].get(k, (0.0, 0))[0] for k in ("ep_dispatch", "ep_combine"))
                    checks.add(label, "all-to-all time per step, rank 0", pr.decode_a2a_s * 1e3, a2a * 1e3,
                               "{:.2f} ms", counted=False)
                    comm_rows.append([label, f"{r['load']:.1f}", ", ".join(
                        f"{k} {v[0] * 1e3:.2f} ms ({v[1]:.0f} calls)" for k, v in sorted(r["comm"].items())),
                        f"{pr.decode.network * 1e3:.2f} ms (all-to-alls {pr.decode_a2a_s * 1e3:.2f} ms)"])
        report.table(["when", *CALIBRATION_HEADERS[1:], "expert GFLOP/s by rows M",
                             "overhead: MoE block / expert / EP block"],
                     cal_rows,
                     "Calibration of this machine at the MoE model's shapes (thread CPU time, one thread); the "
                     "compute rates re-measured before each engine layout")
        checks_tables(report, checks, comm_rows)
    report.add(ep_benchmark_section(args.ep_json, log))
    report.add(moe_projections())
    report.write()
    return 0


def _newest_ep_json() -> Path | None:
    found = sorted((REPO_ROOT / "benchmarks" / "results").glob("*-expert_parallel.json"))
    return found[-1] if found else None


def ep_benchmark_section(path: str | None, log) -> str:
    """Predict the runs of `benchmarks/expert_parallel.py` (its JSON: the model, EP=2 over gloo, batch 1 and 32
    requests; rank 0's exchanges per step): this machine calibrated at that model's shapes, the all-to-all and K/V
    bytes rank 0 sends per prefill and decode step (counted) and its decode step's wall time (info: the two ranks
    share this machine's cores with the benchmark's other load)."""
    import json

    from scratchlm.model.config import ModelConfig
    from scratchlm.plan import Layout, Workload, predict
    from scratchlm.plan.calibrate import calibrate

    p = Path(path) if path else _newest_ep_json()
    if p is None or not p.exists():
        return ("### benchmarks/expert_parallel.py runs\n\nNot predicted: no "
                "`benchmarks/results/*-expert_parallel.json` (run `python -m benchmarks.expert_parallel` first).")
    data = json.loads(p.read_text())
    cfg = ModelConfig.from_dict(data["model"])
    ep, tp = int(data.get("ep", 2)), int(data.get("tp", 1))
    log(f"calibrating at the shapes of {p.name}'s model")
    cal = calibrate(clock="wall", model=cfg)
    checks = Checks()
    lay = Layout(dp=ep, tp=tp, ep=ep)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    e, k, d = int(data.get("elem_bytes", 4)), cfg.moe.top_k, cfg.d_model
    kv_row = 2 * cfg.n_kv_heads * cfg.head_dim * e
    for kind, meas in data["measured"].items():
        nreq = 1 if kind == "batch1" else 32
        w = Workload(int(data["prompt_len"]), int(data["gen"]), nreq)
        pr = predict(cfg, w, cal, lay, ranks_per_node=max(cal.devices_per_node, lay.world))
        for phase in ("prefill", "decode"):
            m = meas[phase]
            if phase == "prefill":  # the engine's token budget and split decide the rows: read off the K/V bytes
                rows = round(m["bytes"]["ep_kv"] / (cfg.n_layers * kv_row * (ep - 1)))
                others = round(m["rank1_bytes"]["ep_kv"] / (cfg.n_layers * kv_row * (ep - 1)))
            else:
                rows = -(-nreq // ep)  # rank 0's replica's sequences (the engine splits them evenly)
                others = nreq - rows  # the other replicas' (none at one request: replica 1 idles)
            # dispatch: rank 0's token copies for the other ranks' experts; combine: the outputs of its experts for
            # the other replicas' token copies (each expert on a rank with probability 1/ep)
            a2a = n_moe * k * d * e * (rows * (ep - 1) / ep + others / ep)
            label = f"expert_parallel.py EP={ep}, {nreq} request{'s' if nreq > 1 else ''}, {phase}"
            checks.add(label, "all-to-all bytes, rank 0 (dispatch + combine)", a2a / 1e3,
                       (m["bytes"]["ep_dispatch"] + m["bytes"]["ep_combine"]) / 1e3, "{:.1f} kB")
            checks.add(label, "K/V rows sent, rank 0", cfg.n_layers * rows * kv_row * (ep - 1) / 1e3,
                       m["bytes"]["ep_kv"] / 1e3, "{:.1f} kB", counted=phase == "decode")
            if phase == "decode":
                checks.add(label, "step wall", pr.decode.total * 1e3, m["step_seconds"] * 1e3, "{:.1f} ms",
                           counted=False)
    head = ["configuration", "figure", "predicted", "measured", "predicted / measured", "within +-30 %"]
    rows_md = "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *checks.rows])
    return (f"### benchmarks/expert_parallel.py runs ({p.name})\n\n{checks.n_ok} of {checks.n_all} checked figures "
            f"within +-30 % (the step wall times are info: measured on the shared, loaded cores; a prefill step's "
            f"rows per replica are read off its K/V bytes, since the engine's token budget and split decide them, so "
            f"that row is info too). This machine calibrated (wall clock) at that model's shapes.\n\n{rows_md}")


def moe_projections(top: int = 4) -> str:
    """DeepSeek-V3 and Kimi K2 on 1, 2, 4 nodes of 8 x H100 (fp8 weights) and on the 16-node CPU cluster: a summary
    of the best layouts (scratchlm's EP with its replicated KV pool, and DeepSeek's sharded one), then the first
    `top` layouts of each, as markdown."""
    from scratchlm.plan import Workload, load_cluster, plan
    from scratchlm.plan.cli import format_table, load_model_config

    summary, parts = [], []
    for cluster_file, nodes, model, (prompt, out, conc) in MOE_PROJECTIONS:
        cluster = load_cluster(CLUSTERS / cluster_file)
        cluster.nodes = nodes
        mcfg = load_model_config(str(CLUSTERS / "models" / f"{model}.toml"))
        w = Workload(prompt_len=prompt, output_len=out, concurrency=conc)
        for ep_kv in ("replicated", "sharded"):
            ranked = plan(mcfg, w, cluster, ep_kv=ep_kv)
            b = ranked[0]
            where = f"{cluster_file[:-5]} x {nodes}"
            if not b.feasible:
                least = min(p.memory_bytes for p in ranked) / 2**30
                summary.append([model, where, ep_kv, "none fits", f"{least:.0f} at least", "", "", "", "", ""])
            else:
                summary.append([model, where, ep_kv, str(b.layout), f"{b.memory_bytes / 2**30:.1f}",
                                f"{b.tpot_s * 1e3:.1f}", f"{w.concurrency / b.tpot_s:.0f}", f"{b.throughput:.0f}",
                                f"{b.decode_a2a_s / b.tpot_s:.0%} / {b.prefill_a2a_s / b.prefill.total:.0%}",
                                b.bottleneck])
            parts.append(f"### {model} on {cluster.name}, {nodes} node(s) ({cluster.devices} ranks), KV {ep_kv}: "
                         f"prompt {prompt}, output {out}, concurrency {conc}\n\n```\n{format_table(ranked, top)}\n```")
    head = ["model", "cluster x nodes", "EP KV", "best layout", "GiB / rank", "TPOT ms", "decode tok/s",
            "tok/s (with prefill)", "all-to-all share decode / prefill", "bottleneck"]
    rows = "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *summary])
    return ("### Summary: the best layout of each (workloads: H100, prompt 2048, output 512, 256 requests; CPU "
            "cluster, prompt 2048, output 256, 64 requests)\n\n" + rows + "\n\n" + "\n\n".join(parts))


def crossover_text(cfg, cluster) -> str:
    """Where communication overtakes compute: TP in a decode step, ring CP in a prefill."""
    from scratchlm.plan import Layout, Workload, predict

    lines = []
    w = Workload(prompt_len=1024, output_len=128, concurrency=8)
    tps = [t for t in (1, 2, 4, 8, 16) if t <= cfg.n_kv_heads and t <= cluster.devices]
    cells = []
    over = None
    for tp in tps:
        p = predict(cfg, w, cluster, Layout(tp=tp))
        work = p.decode.compute + p.decode.memory + p.decode.overhead
        cells.append(f"TP{tp}: {work * 1e3:.2f} ms work + {p.decode.network * 1e3:.2f} ms network")
        if over is None and p.decode.network > work:
            over = tp
    lines.append("Decode step, batch 8, context ~1K, by TP degree: " + "; ".join(cells) + ". " +
                 (f"Communication overtakes the work at TP={over}." if over else
                  "Communication stays below the work up to the largest TP tried."))
    cps = [c for c in (2, 4, 8, 16, 32) if c <= cluster.devices]
    cells = []
    for cp in cps:
        t_cross = None
        for t in [2**k for k in range(4, 21)]:
            p = predict(cfg, Workload(prompt_len=t, output_len=1, concurrency=1), cluster, Layout(cp=cp))
            if p.prefill.compute + p.prefill.memory >= p.prefill.overlapped_network:
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
