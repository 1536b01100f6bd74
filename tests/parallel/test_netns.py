"""A multi-host test on one machine: two "hosts" in Linux network namespaces joined by a veth pair.

The test (as root) creates two namespaces, a veth pair with one end in each, and private 10.x addresses
that exist inside those namespaces only; then runs a two-node `torchrun` launch (`--nnodes 2 --node-rank i
--master-addr 10.x.0.1`, `GLOO_SOCKET_IFNAME` = the namespace's veth), one node per namespace. A namespace
has its own loopback, so the ranks can only reach each other through the veth: its byte counters prove the
traffic went there. The namespaces (and with them the veth pair) are always deleted.

- `test_gloo_all_reduce_across_namespaces`: the harness, with a 4 MB gloo all-reduce.
- `test_tp2_across_namespaces_equals_tp1`: TP=2 greedy ids on stories260K equal the TP=1 engine's.

This file is also the worker that torchrun starts (`python test_netns.py allreduce|tp ...`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARK = "NETNS_RESULT "
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park and"]
MAX_TOKENS = 24


@dataclass
class Hosts:
    """Two network namespaces joined by veth: names, device names and addresses, index = node rank."""

    ns: list[str]
    dev: list[str]
    addr: list[str]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


class NetnsUnavailable(Exception):
    """Network namespaces cannot be made here (not Linux, no iproute2, not root, or not permitted)."""


@contextlib.contextmanager
def network_namespaces(subnet: int | None = None):
    """Two namespaces joined by a veth pair with 10.213.`subnet`.1/.2 (only inside them); always deleted.
    Raises NetnsUnavailable with the reason when this machine does not allow it."""
    if sys.platform != "linux" or shutil.which("ip") is None:
        raise NetnsUnavailable("needs Linux and iproute2's `ip` for network namespaces")
    if os.geteuid() != 0:
        raise NetnsUnavailable("needs root to create network namespaces (`ip netns add`)")
    tag = f"{os.getpid() % 100000:05d}"
    subnet = 10 + os.getpid() % 200 if subnet is None else subnet
    hosts = Hosts(ns=[f"slm{tag}n0", f"slm{tag}n1"], dev=[f"slm{tag}v0", f"slm{tag}v1"],
                  addr=[f"10.213.{subnet}.1", f"10.213.{subnet}.2"])
    res = _ip("netns", "add", hosts.ns[0], check=False)
    if res.returncode != 0:
        raise NetnsUnavailable(f"`ip netns add` is not permitted here: {res.stderr.strip()}")
    try:
        _ip("netns", "add", hosts.ns[1])
        _ip("link", "add", hosts.dev[0], "type", "veth", "peer", "name", hosts.dev[1])
        for i in range(2):
            _ip("link", "set", hosts.dev[i], "netns", hosts.ns[i])
            _ip("-n", hosts.ns[i], "addr", "add", f"{hosts.addr[i]}/24", "dev", hosts.dev[i])
            _ip("-n", hosts.ns[i], "link", "set", hosts.dev[i], "up")
            _ip("-n", hosts.ns[i], "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns in hosts.ns:  # deleting a namespace deletes its end of the veth, and with it the pair
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", hosts.dev[0], check=False)


@pytest.fixture
def two_hosts():
    """The two hosts for a test (skips with the reason when namespaces cannot be made)."""
    try:
        with network_namespaces() as hosts:
            yield hosts
    except NetnsUnavailable as e:
        pytest.skip(str(e))
    assert not any(ns in _ip("netns", "list").stdout for ns in hosts.ns)


def tx_bytes(hosts: Hosts, i: int) -> int:
    stats = json.loads(_ip("-n", hosts.ns[i], "-j", "-s", "link", "show", "dev", hosts.dev[i]).stdout)
    return int(stats[0]["stats64"]["tx"]["bytes"])


def run_two_nodes(hosts: Hosts, worker_args: list[str], timeout: float = 300, script: str = __file__) -> dict:
    """torchrun `script` (default: this file) on one node per namespace; returns rank 0's result (a JSON line
    marked NETNS_RESULT)."""
    port = "29517"
    procs = []
    for i in range(2):
        env = ["env", f"GLOO_SOCKET_IFNAME={hosts.dev[i]}", "OMP_NUM_THREADS=1", "PYTHONUNBUFFERED=1"]
        cmd = ["ip", "netns", "exec", hosts.ns[i], *env, sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "1", "--master-addr", hosts.addr[0],
               "--master-port", port, "--max-restarts", "0", script, *worker_args]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    log = "\n".join(f"--- node {i} (exit {p.returncode}) ---\n{o[-3000:]}" for i, (p, o) in enumerate(zip(procs, outs)))
    assert all(p.returncode == 0 for p in procs), log
    lines = [ln for ln in outs[0].splitlines() if MARK in ln]
    assert lines, log
    return json.loads(lines[-1].split(MARK, 1)[1])


@pytest.mark.distributed
def test_gloo_all_reduce_across_namespaces(two_hosts):
    before = [tx_bytes(two_hosts, i) for i in range(2)]
    result = run_two_nodes(two_hosts, ["allreduce"])
    assert result == {"world_size": 2, "sum_ok": True, "ifname": two_hosts.dev[0]}
    sent = [tx_bytes(two_hosts, i) - before[i] for i in range(2)]
    assert min(sent) > 4_000_000, sent  # the 4 MB tensor crossed the veth both ways


def _has_tensor_parallel() -> bool:
    from scratchlm.inference import EngineConfig

    return "tensor_parallel_size" in {f.name for f in dataclasses.fields(EngineConfig)}


@pytest.mark.distributed
def test_tp2_across_namespaces_equals_tp1(two_hosts, data_dir):
    if not _has_tensor_parallel():
        pytest.skip("tensor parallelism (EngineConfig.tensor_parallel_size) has not landed yet")
    import torch

    from scratchlm.inference import LLM, SamplingParams

    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    torch.set_num_threads(1)
    ref = LLM(model).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                              use_tqdm=False)
    before = [tx_bytes(two_hosts, i) for i in range(2)]
    result = run_two_nodes(two_hosts, ["tp", str(model)])
    assert result["ids"] == [o.outputs[0].token_ids for o in ref]
    sent = [tx_bytes(two_hosts, i) - before[i] for i in range(2)]
    assert min(sent) > 10_000, sent  # activations were all-reduced over the veth


@pytest.mark.distributed
def test_tp2_server_across_namespaces_via_the_slurm_rank_wrapper(two_hosts, data_dir):
    """The documented launch: `torchrun --nnodes 2 ... --no-python recipes/slurm/rank.sh serve MODEL
    --tensor-parallel-size 2` in each namespace; a client inside namespace 0 gets the TP=1 greedy text."""
    if not _has_tensor_parallel():
        pytest.skip("tensor parallelism (EngineConfig.tensor_parallel_size) has not landed yet")
    import torch

    from scratchlm.inference import LLM, SamplingParams

    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    torch.set_num_threads(1)
    ref = LLM(model).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                              use_tqdm=False)
    url = f"http://{two_hosts.addr[0]}:8000"
    procs = []
    for i in range(2):
        env = ["env", f"GLOO_SOCKET_IFNAME={two_hosts.dev[i]}", "OMP_NUM_THREADS=1", f"PYTHON={sys.executable}"]
        cmd = ["ip", "netns", "exec", two_hosts.ns[i], *env, sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node", "1", "--master-addr", two_hosts.addr[0],
               "--master-port", "29518", "--max-restarts", "0", "--no-python", str(REPO / "recipes/slurm/rank.sh"),
               "serve", str(model), "--tensor-parallel-size", "2", "--threads", "1", "--host", two_hosts.addr[0],
               "--port", "8000"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO))
    client = f"""
import httpx, json, time
deadline = time.monotonic() + 240
while True:
    try:
        if httpx.get("{url}/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    assert time.monotonic() < deadline, "the TP=2 server did not come up"
    time.sleep(0.5)
texts = [httpx.post("{url}/v1/completions", timeout=240, json={{"prompt": p, "max_tokens": {MAX_TOKENS},
         "temperature": 0, "ignore_eos": True}}).json()["choices"][0]["text"] for p in {PROMPTS!r}]
print("{MARK}" + json.dumps(texts))
"""
    try:
        res = subprocess.run(["ip", "netns", "exec", two_hosts.ns[0], sys.executable, "-c", client],
                             capture_output=True, text=True, timeout=300)
    finally:
        for p in procs:
            p.terminate()
        outs = [p.communicate(timeout=60)[0] for p in procs]
    log = "\n".join(f"--- node {i} ---\n{o[-3000:]}" for i, o in enumerate(outs))
    assert res.returncode == 0 and MARK in res.stdout, res.stdout + res.stderr + log
    texts = json.loads(res.stdout.split(MARK, 1)[1])
    assert texts == [o.outputs[0].text for o in ref], log


# ----- the worker torchrun starts in each namespace -------------------------------------------------------------


def _worker_allreduce() -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((1 << 20,), float(rank + 1))  # 4 MB
    dist.all_reduce(t)
    ok = bool((t == world * (world + 1) / 2).all())
    dist.destroy_process_group()
    return {"world_size": world, "sum_ok": ok, "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}


def _worker_tp(model: str) -> dict:
    import torch

    from scratchlm.inference import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model, tensor_parallel_size=2)  # ranks other than 0 serve the steps and exit inside
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    result = {"ids": [o.outputs[0].token_ids for o in outs]}
    shutdown = getattr(llm.engine, "shutdown", None) or getattr(llm.engine, "close", None)
    if shutdown is not None:
        shutdown()
    return result


if __name__ == "__main__":
    mode = sys.argv[1]
    out = _worker_allreduce() if mode == "allreduce" else _worker_tp(sys.argv[2])
    if int(os.environ.get("RANK", "0")) == 0:
        print(MARK + json.dumps(out), flush=True)
