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
             errors: list | None = None) -> None:
    """Collect SSE messages from `url` until `stop` is set. The server writes at least every `KEEPALIVE_S` (its
    counters when no step happens), so each line wakes this reader to check `stop`, and the read timeout is far
    above that period: a timeout is a failure (kept in `errors`), never a way to poll. (It was 2 s, the keepalive
    period itself: one late keepalive under load raised ReadTimeout, which closes httpx's line iterator, and the
    reader then silently collected nothing more: the 1-in-16 failure.)"""
    from scratchlm.server.inspector import KEEPALIVE_S

    try:
        with httpx.stream("GET", url, headers=headers or {}, timeout=httpx.Timeout(30 + 10 * KEEPALIVE_S)) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(json.loads(line[6:]))
                if stop.is_set():
                    return
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
        if errors is None:
            raise
        errors.append(e)


def wait_for(condition, what: str, timeout_s: float = 120.0) -> None:
    """Wait until `condition()` (on the engine's or the reader's own counters) holds; fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.02)


PREFIX = "Once upon a time, there was a little girl named Lily. She loved to play"


def fork_prompt(tokenizer) -> list[int]:
    """The n=2 request's prompt: exactly 2 blocks of 16 tokens, the second unique to it. Its samples fork with
    both blocks shared and no partial block to copy (so the fork never waits for a free block), and the second
    block is held by this request alone: the fork-shared block the inspector must show on the fork's step. (A
    text prompt of 22 tokens shared only block 0, which the other requests' prefix hits also hold, so whether
    a step showed a fork-only block depended on timing: the rare failure of the fork assertion under load.)"""
    head = tokenizer.encode(PREFIX)[:16]
    tail = tokenizer.encode(" and a big red dog who ran to the park every day with a ball")[:16]
    assert len(head) == len(tail) == 16
    return head + tail


async def _load(url: str, n: int, headers: dict, first: list[int] | None = None) -> list[dict]:
    async with httpx.AsyncClient(timeout=120, headers=headers) as client:
        jobs = [client.post(url + "/v1/completions", json={
            "model": "stories260K", "prompt": first if i == 0 and first else f"{PREFIX} {i}", "max_tokens": 40 + 2 * i,
            "temperature": 0, "ignore_eos": True, "n": 2 if i == 0 else 1}) for i in range(n)]
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
        stop, got, errors = threading.Event(), [], []
        reader = threading.Thread(target=read_sse, args=(srv.url + "/inspector/events", stop, got, AUTH, errors))
        reader.start()
        wait_for(lambda: engine.events.num_listeners == 1 or errors, "the inspector to subscribe")
        assert not errors and engine.events.num_listeners == 1 and hub.num_clients == 1
        steps_before = engine.events.steps
        answers = asyncio.run(_load(srv.url, 8, AUTH, fork_prompt(engine.tokenizer)))
        assert all(len(a["choices"]) >= 1 for a in answers)
        # the engine's own step count is final (the load is over): wait until the page's stream has that step
        wait_for(lambda: errors or [g.get("step") for g in got if g["type"] == "step"][-1:] == [engine.events.steps],
                 f"step {engine.events.steps} on the event stream")
        assert not errors, errors
        stop.set()
        reader.join(60)
        assert not reader.is_alive() and not errors, errors
        m = metrics(srv.url)
        snap = httpx.get(srv.url + "/inspector/snapshot", headers=AUTH, timeout=10).json()
        wait_for(lambda: engine.events.num_listeners == 0, "the disconnect to unsubscribe the inspector")
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
    # the n=2 request: on the step its samples forked, its second block is held by both samples and nobody else
    assert all(s["pool"]["map"] is not None for s in steps)  # detail_interval_s = 0: every step has the map
    assert any(s["pool"]["shared_fork"] for s in steps)
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
        stop, got, errors = threading.Event(), [], []
        reader = threading.Thread(target=read_sse, args=(srv.url + "/inspector/events", stop, got, None, errors))
        reader.start()
        # the hello comes after the hub put "inspect" on the child's inbox, which is FIFO: the child watches
        # before it sees the first request below
        wait_for(lambda: got or errors, "the stream's hello")
        answers = asyncio.run(_load(srv.url, 8, {}, fork_prompt(loop.engine.tokenizer)))
        want = sum(a["usage"]["completion_tokens"] for a in answers)
        # the child's counters in its newest event (the newest is never the one dropped: the outbox keeps them)
        wait_for(lambda: errors or [g["totals"]["generation_tokens"] for g in got if g["type"] == "step"][-1:]
                 == [want], f"the event whose totals count all {want} generated tokens")
        assert not errors, errors
        stop.set()
        reader.join(60)
        assert not reader.is_alive() and not errors, errors
        m = metrics(srv.url)
    steps = [g for g in got if g["type"] == "step"]
    assert steps[-1]["totals"]["generation_tokens"] == m["generation_tokens_total"] == want
    numbers, dropped = [s["step"] for s in steps], steps[-1]["outbox_dropped"] - steps[0]["outbox_dropped"]
    # every step in order: delivered, or dropped by the child's bounded outbox and counted (a loaded parent)
    assert numbers == sorted(set(numbers)) and numbers[-1] - numbers[0] + 1 == len(numbers) + dropped
    if steps[-1]["outbox_dropped"] == 0:
        assert sum(s["generated_tokens"] for s in steps) == want
