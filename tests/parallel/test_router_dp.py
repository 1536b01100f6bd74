"""`scratchlm serve --data-parallel-size 2` on stories260K: two real replica processes behind the router.

Oracle: the same greedy requests on a single in-process engine (DP=1). Checks, in order on one server:
greedy output equal through the official `openai` client (plain and streaming) and both replicas used;
a stopped (SIGSTOP) replica leaves the rotation and comes back; a replica killed (SIGKILL) mid-load loses
none of the accepted requests. Starting three processes on a 2-core machine is most of the time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow  # ~1-2 min on a loaded 2-core machine; test_router_inprocess.py is the fast twin
REPO = Path(__file__).resolve().parents[2]
PROMPTS = [f"Once upon a time, {name} went to the" for name in
           ("Lily", "Tom", "Ben", "Sue", "a cat", "a dog", "the king", "Mia")]
MAX_TOKENS = 32
LONG_TOKENS = 300


@pytest.fixture(scope="module")
def model(data_dir) -> Path:
    return data_dir / "models" / "stories260K" / "stories260K.bin"


@pytest.fixture(scope="module")
def oracle(model) -> dict[tuple[str, int], str]:
    """Greedy completions of PROMPTS on one in-process engine (the DP=1 reference)."""
    import torch

    from scratchlm.inference import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model)
    out = {}
    for n, ignore_eos in ((MAX_TOKENS, False), (LONG_TOKENS, True)):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos)
        for p, o in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
            out[(p, n)] = o.outputs[0].text
    return out


@pytest.fixture(scope="module")
def dp_server(model, tmp_path_factory):
    """(url, process) of `scratchlm serve --data-parallel-size 2` on stories260K."""
    from scratchlm.parallel.router import free_port

    port = free_port()
    log_path = tmp_path_factory.mktemp("router") / "serve.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "scratchlm", "serve", str(model), "--data-parallel-size", "2", "--port", str(port),
             "--threads", "1", "--router-health-interval-s", "0.25", "--router-health-timeout-s", "2",
             "--router-unhealthy-after", "2"], stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "router not healthy in 180 s:\n" + log_path.read_text()
            time.sleep(0.3)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(log_path.read_text()[-4000:])


@pytest.fixture(scope="module")
def router_url(dp_server) -> str:
    return dp_server[0]


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=5).json()


def wait_for(pred, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_dp2_greedy_equals_dp1_through_openai_client_on_both_replicas(router_url, oracle):
    from openai import OpenAI

    client = OpenAI(base_url=router_url + "/v1", api_key="none", max_retries=0)
    model_id = client.models.list().data[0].id
    assert model_id == "stories260K"

    def plain(p: str) -> str:
        r = client.completions.create(model=model_id, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0].text

    def streamed(p: str) -> str:
        chunks = client.completions.create(model=model_id, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(6) as pool:
        plain_out = list(pool.map(plain, PROMPTS))
        stream_out = list(pool.map(streamed, PROMPTS))
    for p, a, b in zip(PROMPTS, plain_out, stream_out):
        assert a == oracle[(p, MAX_TOKENS)], p
        assert b == oracle[(p, MAX_TOKENS)], p
    per_replica = [r["requests_total"] for r in health(router_url)["replicas"]]
    assert sum(per_replica) >= 2 * len(PROMPTS) and min(per_replica) > 0, per_replica
    from scratchlm.server.metrics import parse_prometheus

    m = parse_prometheus(httpx.get(router_url + "/metrics", timeout=10).text)
    assert m['scratchlm:request_success_total{model_name="stories260K",finished_reason="length"}'] >= 2 * len(PROMPTS)
    assert m["scratchlm:router_retries_total"] == 0


def test_unhealthy_replica_leaves_rotation_and_returns(router_url, oracle):
    victim = health(router_url)["replicas"][0]
    os.kill(victim["pid"], signal.SIGSTOP)  # alive but not answering: its /health times out
    try:
        wait_for(lambda: not health(router_url)["replicas"][0]["healthy"], "replica 0 to leave rotation")
        for p in PROMPTS[:4]:
            r = httpx.post(router_url + "/v1/completions", timeout=60,
                           json={"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0})
            assert r.status_code == 200 and r.headers["x-scratchlm-replica"] == "1"
            assert r.json()["choices"][0]["text"] == oracle[(p, MAX_TOKENS)]
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
    wait_for(lambda: health(router_url)["replicas"][0]["healthy"], "replica 0 to come back")


def test_killed_replica_loses_no_accepted_request(router_url, oracle):
    before = health(router_url)
    victim = before["replicas"][1]

    def ask(p: str) -> tuple[int, str]:
        r = httpx.post(router_url + "/v1/completions", timeout=120,
                       json={"prompt": p, "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True})
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(ask, p) for p in PROMPTS]
        wait_for(lambda: health(router_url)["replicas"][1]["outstanding_requests"] >= 2,
                 "requests in flight on replica 1")
        os.kill(victim["pid"], signal.SIGKILL)
        results = [f.result() for f in futures]
    for p, (status, text) in zip(PROMPTS, results):
        assert status == 200, text
        assert text == oracle[(p, LONG_TOKENS)], p
    after = health(router_url)
    assert after["replicas"][1]["dead"] or not after["replicas"][1]["healthy"]
    assert after["replicas"][1]["failures_total"] >= 1 and after["replicas_in_rotation"] == 1
    wait_for(lambda: health(router_url)["replicas"][1]["dead"], "replica 1 to be seen dead")


def test_router_exits_nonzero_when_every_replica_died(dp_server):
    router_url, proc = dp_server
    for r in health(router_url)["replicas"]:
        if not r["dead"]:
            os.kill(r["pid"], signal.SIGKILL)
    assert proc.wait(timeout=60) == 1
