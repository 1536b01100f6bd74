"""The inspector's event stream over HTTP (scratchlm/server/inspector.py): subscribes only while watched, carries
every step in order with the engine's own counters, drops for slow consumers, needs the API key, and crosses the
process boundary with --engine-process."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from scratchlm.server import BackgroundServer, ServerConfig, create_app
from scratchlm.server.metrics import parse_prometheus

inference = pytest.importorskip("scratchlm.inference")
KEY = "inspector-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def read_sse(url: str, stop: threading.Event, out: list[dict], headers: dict | None = None,
             timeout_s: float = 120.0) -> None:
    """Collect SSE messages from `url` until `stop` is set (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    with httpx.stream("GET", url, headers=headers or {}, timeout=httpx.Timeout(timeout_s, read=2.0)) as r:
        r.raise_for_status()
        buf = ""
        it = r.iter_text()
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                buf += next(it)
            except (httpx.ReadTimeout, StopIteration):
                if stop.is_set():
                    break
                continue
            while "\n\n" in buf:
                chunk, buf = buf.split("\n\n", 1)
                if chunk.startswith("data: "):
                    out.append(json.loads(chunk[6:]))


async def _load(url: str, n: int, headers: dict) -> list[dict]:
    async with httpx.AsyncClient(timeout=120, headers=headers) as client:
        prefix = "Once upon a time, there was a little girl named Lily. She loved to play"
        jobs = [client.post(url + "/v1/completions", json={
            "model": "stories260K", "prompt": f"{prefix} {i}", "max_tokens": 40 + 2 * i, "temperature": 0,
            "ignore_eos": True, "n": 2 if i == 0 else 1}) for i in range(8)]
        return [r.json() for r in await asyncio.gather(*jobs)]


def metrics(url: str) -> dict[str, float]:
    samples = parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)
    return {k.split("{")[0].removeprefix("scratchlm:"): v for k, v in samples.items() if "{" in k}


@pytest.fixture(scope="module")
def engine(data_dir):
    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    import torch

    from scratchlm.inference.kv_cache import bytes_per_block

    # 14 blocks of 16 tokens for 9 sequences of 60-80 tokens: the pool runs out, so it preempts
    cfg = inference.EngineConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                 kv_cache_memory=14 * bytes_per_block(5, 4, 8, 16, torch.float32))
    engine = inference.LLMEngine.from_pretrained(model, cfg)
    # every step carries the pool map: the assertions on fork-shared blocks must not depend on whether a
    # 50 ms detail tick happened to land on a step where the n=2 request's samples shared their prompt
    engine.events.detail_interval_s = 0.0
    return engine


def test_events_follow_the_engine_and_agree_with_metrics(engine):
    app = create_app(engine, ServerConfig(api_key=KEY), model_name="stories260K")
    hub = app.state.inspector
    with BackgroundServer(app) as srv:
        assert httpx.get(srv.url + "/inspector/events", timeout=10).status_code == 401
        assert httpx.get(srv.url + "/inspector/snapshot", timeout=10).status_code == 401
        assert httpx.get(srv.url + "/inspector", timeout=10).status_code == 200  # the page holds no data
        assert engine.events.num_listeners == 0
        stop, got = threading.Event(), []
        reader = threading.Thread(target=read_sse, args=(srv.url + "/inspector/events", stop, got, AUTH))
        reader.start()
        deadline = time.monotonic() + 30
        while engine.events.num_listeners == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.events.num_listeners == 1 and hub.num_clients == 1
        steps_before = engine.events.steps
        answers = asyncio.run(_load(srv.url, 8, AUTH))
        assert all(len(a["choices"]) >= 1 for a in answers)
        deadline = time.monotonic() + 30
        while [g.get("step") for g in got if g["type"] == "step"][-1:] != [engine.events.steps] \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        reader.join(30)
        m = metrics(srv.url)
        snap = httpx.get(srv.url + "/inspector/snapshot", headers=AUTH, timeout=10).json()
        deadline = time.monotonic() + 10
        while engine.events.num_listeners and time.monotonic() < deadline:  # the disconnect unsubscribes
            time.sleep(0.05)
        assert engine.events.num_listeners == 0
    steps = [g for g in got if g["type"] == "step"]
    assert got[0]["type"] == "hello" and got[0]["model"] == "stories260K"
    numbers = [s["step"] for s in steps]
    assert numbers == list(range(steps_before + 1, engine.events.steps + 1))  # every step, in order, no drops
    assert all(s["dropped"] == 0 for s in steps)
    last = steps[-1]["totals"]
    stats = engine.stats()
    assert last["generation_tokens"] == stats.generation_tokens_total == m["generation_tokens_total"]
    assert last["prompt_tokens"] == stats.prompt_tokens_total == m["prompt_tokens_total"]
    assert last["prefix_cache_hits"] == stats.prefix_cache_hits == m["prefix_cache_hits_total"]
    assert last["preemptions"] == stats.num_preemptions == m["num_preemptions_total"]
    assert steps[-1]["pool"]["free"] == stats.num_free_blocks == m["num_kv_blocks_free"]
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # the load exercised both
    assert sum(s["generated_tokens"] for s in steps) == sum(a["usage"]["completion_tokens"] for a in answers)
    assert sum(len(s["preempted"]) for s in steps) == stats.num_preemptions
    assert any(s["pool"]["shared_fork"] for s in steps if s["pool"]["map"] is not None)  # the n=2 request
    assert snap["event"]["step"] == engine.events.steps and snap["stats"]["num_preemptions"] == stats.num_preemptions


def test_a_slow_consumer_loses_old_events_not_the_engine(engine):
    from scratchlm.server import inspector

    app = create_app(engine, ServerConfig(), model_name="stories260K")
    hub = app.state.inspector

    async def scenario() -> tuple[int, int]:
        client = hub.add()
        try:
            for i in range(inspector.QUEUE_SIZE + 50):  # nobody reads: the engine thread must never block
                hub.publish({"step": i})
            await asyncio.sleep(0.2)
            return client.dropped, len(client.items)
        finally:
            hub.remove(client)

    hub._set_watching = lambda on: None  # no engine thread in this test: publish by hand
    dropped, kept = asyncio.run(scenario())
    assert (dropped, kept) == (50, inspector.QUEUE_SIZE)


def test_engine_process_carries_events(data_dir):
    from scratchlm.server.engine_process import EngineProcessLoop

    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    loop = EngineProcessLoop(model, inference.EngineConfig(max_num_seqs=8), threads=1, startup_timeout_s=300)
    app = create_app(loop.engine, ServerConfig(), model_name="stories260K", engine_loop=loop)
    with BackgroundServer(app) as srv:
        stop, got = threading.Event(), []
        reader = threading.Thread(target=read_sse, args=(srv.url + "/inspector/events", stop, got))
        reader.start()
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the child has the "inspect" message before the requests
        answers = asyncio.run(_load(srv.url, 8, {}))
        deadline = time.monotonic() + 30
        want = sum(a["usage"]["completion_tokens"] for a in answers)
        while sum(g.get("generated_tokens", 0) for g in got) < want and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        reader.join(30)
        m = metrics(srv.url)
    steps = [g for g in got if g["type"] == "step"]
    assert steps and sum(s["generated_tokens"] for s in steps) == want
    assert steps[-1]["totals"]["generation_tokens"] == m["generation_tokens_total"]
    assert [s["step"] for s in steps] == list(range(steps[0]["step"], steps[0]["step"] + len(steps)))
