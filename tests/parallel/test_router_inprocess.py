"""The router in front of two real scratchlm servers on stories260K, all in this process (fast enough for the
default suite; tests/parallel/test_router_dp.py does the same with real `scratchlm serve` processes, --run-slow).

Oracle: greedy completions from a separate single engine (DP=1).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from scratchlm.inference import LLM, EngineConfig, LLMEngine, SamplingParams
from scratchlm.parallel.router import Replica, Router, RouterConfig, create_router_app
from scratchlm.server.app import create_app
from scratchlm.server.background import BackgroundServer
from scratchlm.server.config import ServerConfig

PROMPTS = [f"Once upon a time, {name} went to the" for name in ("Lily", "Tom", "Ben", "Sue", "a cat", "a dog")]
MAX_TOKENS = 24
LONG_TOKENS = 200


@pytest.fixture(scope="module")
def model(data_dir):
    torch.set_num_threads(1)
    return data_dir / "models" / "stories260K" / "stories260K.bin"


@pytest.fixture(scope="module")
def oracle(model) -> dict[tuple[str, int], str]:
    llm = LLM(model)
    out = {}
    for n in (MAX_TOKENS, LONG_TOKENS):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for p, o in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
            out[(p, n)] = o.outputs[0].text
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    for p, o in zip(PROMPTS, llm.generate(PROMPTS, seeded, use_tqdm=False)):
        out[(p, "seeded")] = o.outputs[0].text
    return out


def start_replica(model) -> BackgroundServer:
    engine = LLMEngine.from_pretrained(model, EngineConfig())
    return BackgroundServer(create_app(engine, ServerConfig(), model_name="stories260K")).start()


@pytest.fixture
def cluster(model):
    replicas = [start_replica(model) for _ in range(2)]
    router = Router([Replica(index=i, url=r.url) for i, r in enumerate(replicas)],
                    RouterConfig(health_interval_s=0.2, health_timeout_s=2, unhealthy_after=2))
    front = BackgroundServer(create_router_app(router)).start()
    yield front, router, replicas
    front.stop()
    for r in replicas:
        r.stop()


def test_greedy_through_the_router_equals_one_engine_and_uses_both(cluster, oracle):
    front, router, _ = cluster
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="none", max_retries=0, timeout=120)
    assert client.models.list().data[0].id == "stories260K"

    def ask(p: str, stream: bool) -> str:
        kw = dict(model="stories260K", prompt=p, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        if not stream:
            return client.completions.create(**kw).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)

    with ThreadPoolExecutor(6) as pool:
        for stream in (False, True):
            for p, text in zip(PROMPTS, pool.map(lambda p, s=stream: ask(p, s), PROMPTS)):
                assert text == oracle[(p, MAX_TOKENS)], (p, stream)
    with ThreadPoolExecutor(6) as pool:  # seeded sampling too: the same tokens whichever replica draws them
        seeded = pool.map(lambda p: client.completions.create(
            model="stories260K", prompt=p, max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=7,
            extra_body={"ignore_eos": True}).choices[0].text, PROMPTS)
        for p, text in zip(PROMPTS, seeded):
            assert text == oracle[(p, "seeded")], p
    assert min(r.requests_total for r in router.replicas) > 0, [r.requests_total for r in router.replicas]
    assert sum(r.requests_total for r in router.replicas) == 3 * len(PROMPTS) + 1  # + /v1/models
    assert router.retries_total == 0
    # a streaming client stops reading at `data: [DONE]`, which can be before the router saw the replica's stream
    # end and released the request: give that a moment
    deadline = time.monotonic() + 10
    while any(r.outstanding_tokens for r in router.replicas) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(r.outstanding_tokens == 0 for r in router.replicas), [r.outstanding_tokens for r in router.replicas]
    status, body = router.health()
    assert status == 200 and body["replicas_in_rotation"] == 2
    from scratchlm.server.metrics import parse_prometheus

    m = parse_prometheus(httpx.get(front.url + "/metrics", timeout=10).text)  # both replicas, summed
    assert m['scratchlm:request_success_total{model_name="stories260K",finished_reason="length"}'] == 3 * len(PROMPTS)
    assert m['scratchlm:generation_tokens_total{model_name="stories260K"}'] == 3 * len(PROMPTS) * MAX_TOKENS


def test_replica_stopping_mid_load_loses_no_request(cluster, oracle):
    front, router, replicas = cluster

    def ask(p: str) -> tuple[int, str]:
        r = httpx.post(front.url + "/v1/completions", timeout=120,
                       json={"prompt": p, "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True})
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(ask, p) for p in PROMPTS]
        deadline = time.monotonic() + 30
        while router.replicas[1].outstanding_requests < 2:
            assert time.monotonic() < deadline, "no requests in flight on replica 1"
            time.sleep(0.01)
        victim = replicas[1].server  # dies at once: no graceful wait, its port and its connections go away
        victim.force_exit = victim.should_exit = True
        results = [f.result() for f in futures]
    victim.config.app.state.server.loop.stop()  # (force_exit skipped the app's shutdown)
    for p, (status, text) in zip(PROMPTS, results):
        assert status == 200, text
        assert text == oracle[(p, LONG_TOKENS)], p
    assert router.retries_total >= 1
    # A replica that answers its in-flight requests with 500 while it shuts down leaves rotation through the health
    # checks (every 0.2 s, out after 2 failures), which may not have run yet when the last retry returns.
    deadline = time.monotonic() + 10
    while router.replicas[1].in_rotation:
        assert time.monotonic() < deadline, "replica 1 still in rotation 10 s after it stopped"
        time.sleep(0.05)
