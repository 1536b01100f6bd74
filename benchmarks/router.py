"""Data parallelism behind the router: DP=2 against DP=1, and the router's own overhead.

Two replica processes (one torch thread each), a third with two threads, and two
router processes (`scratchlm serve --router-replica-urls ...`), one in front of replica 0 alone and one in
front of both. Contenders, interleaved:

- `DP=1 direct`: the client talks to replica 0 itself;
- `DP=1 via router`: the same replica behind the router (the proxy's cost);
- `DP=2 via router`: both replicas behind the router;
- `DP=1 2 threads direct`: a third replica with two torch threads (the same two cores as DP=2, in one engine).

Workloads: 32 concurrent greedy requests (throughput), and one request alone (batch-1 latency).

    python -m benchmarks.router [--model PATH] [--requests 32] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.common import REPO_ROOT, Report, compare, shared_data_dir


def start(args: list[str], port: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "scratchlm", "serve", *args, "--port", str(port),
                             "--log-level", "warning"], cwd=REPO_ROOT, env=env)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} not healthy within {timeout} s")


def load(url: str, prompts: list[str], max_tokens: int) -> int:
    """Send all prompts at once; returns the completion tokens."""

    async def go() -> int:
        async with httpx.AsyncClient(timeout=600) as client:
            async def one(p: str) -> int:
                r = await client.post(url + "/v1/completions", json={
                    "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]

            return sum(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: stories260K from the shared data")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    model = args.model or str(shared_data_dir() / "models" / "stories260K" / "stories260K.bin")
    from scratchlm.parallel.router import free_ports

    ports = free_ports(5)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [start([model, "--threads", "1"], ports[0]), start([model, "--threads", "1"], ports[1]),
             start([model, "--threads", "2"], ports[4])]
    try:
        for u, p in zip(urls[:2] + urls[4:], procs):
            wait_healthy(u, p)
        procs.append(start(["--router-replica-urls", urls[0]], ports[2]))
        procs.append(start(["--router-replica-urls", urls[0], urls[1]], ports[3]))
        for u, p in zip(urls[2:4], procs[3:]):
            wait_healthy(u, p)
        prompts = [f"Once upon a time, there was a {w} who" for w in
                   ("cat", "dog", "girl", "boy", "king", "bird", "frog", "tree")] * (args.requests // 8 + 1)
        prompts = prompts[: args.requests]
        targets = {"DP=1 direct": urls[0], "DP=1 via router": urls[2], "DP=2 via router": urls[3],
                   "DP=1 2 threads direct": urls[4]}
        work = args.requests * args.max_tokens
        report = Report("router", "Data-parallel router: DP=2 vs DP=1 on one machine", argv=sys.argv[1:])
        report.add(f"Model `{Path(model).name}`, replicas with `--threads 1` each (OMP_NUM_THREADS=1), greedy, "
                   f"`ignore_eos`, {args.max_tokens} tokens per request; every contender runs on the same "
                   f"replica processes, interleaved, {args.repeats} repeats after a warm-up. CPU load from other "
                   f"users at start: {os.getloadavg()[0]:.1f}.")
        res = compare({n: (lambda u=u: load(u, prompts, args.max_tokens)) for n, u in targets.items()},
                      warmup=1, repeats=args.repeats)
        report.table(res.headers("tokens"), res.rows(work, "tokens"),
                     caption=f"{args.requests} concurrent requests (throughput)")
        one = compare({n: (lambda u=u: load(u, prompts[:1], args.max_tokens)) for n, u in targets.items()},
                      warmup=1, repeats=args.repeats * 2)
        report.table(one.headers("tokens"), one.rows(args.max_tokens, "tokens"),
                     caption="one request alone (batch-1 latency)")
        report.add(f"DP=2 / DP=1 throughput (median): {res.ratio('DP=1 direct', 'DP=2 via router'):.2f}x; "
                   f"DP=2 / DP=1 with 2 threads: {res.ratio('DP=1 2 threads direct', 'DP=2 via router'):.2f}x; "
                   f"router overhead at batch 1: {one.ratio('DP=1 via router', 'DP=1 direct'):.3f}x the direct time.")
        report.write()
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
