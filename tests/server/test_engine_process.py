"""The engine in a child process (`scratchlm serve`'s default): same answers as the offline engine, aborts
that free blocks, clean errors, and a clear 503 once the engine process is gone."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from scratchlm.server import BackgroundServer, ServerConfig, create_app

inference = pytest.importorskip("scratchlm.inference")

PROMPTS = ["Once upon a time", "The dog", "Lily and Tom went to the park.", "Mom said"]


@pytest.fixture(scope="module")
def process_server(data_dir):
    from scratchlm.server.engine_process import EngineProcessLoop

    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    loop = EngineProcessLoop(model, inference.EngineConfig(max_num_seqs=16), threads=1, startup_timeout_s=300)
    srv = BackgroundServer(create_app(loop.engine, ServerConfig(), model_name="stories260K", engine_loop=loop))
    srv.start()
    yield srv, loop, model
    srv.stop()


def blocks(srv) -> tuple[float, float]:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("scratchlm:num_kv_blocks")}
    return values["scratchlm:num_kv_blocks_free"], values["scratchlm:num_kv_blocks_total"]


def test_process_engine_equals_offline(process_server):
    srv, _, model = process_server
    offline = inference.LLM(str(model))
    ref = offline.generate(PROMPTS, inference.SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)

    async def run_all():
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
            async def one(p):
                stream = await c.completions.create(model="stories260K", prompt=p, max_tokens=48, temperature=0,
                                                    stream=True)
                return "".join([ch.choices[0].text async for ch in stream if ch.choices])
            return await asyncio.wait_for(asyncio.gather(*[one(p) for p in PROMPTS]), 300)

    assert asyncio.run(run_all()) == [r.outputs[0].text for r in ref]
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    res = client.completions.create(model="stories260K", prompt=PROMPTS[0], max_tokens=48, temperature=0)
    assert res.choices[0].text == ref[0].outputs[0].text
    assert res.usage.completion_tokens == len(ref[0].outputs[0].token_ids)


def test_process_engine_rejection_and_disconnect(process_server):
    srv, _, _ = process_server
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1] * 600, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    body = {"prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as resp:
        events = (line for line in resp.iter_lines() if line)
        for _ in range(3):
            assert next(events).startswith("data: ")
    deadline = time.monotonic() + 30
    while blocks(srv)[0] != blocks(srv)[1] and time.monotonic() < deadline:
        time.sleep(0.05)
    free, total = blocks(srv)
    assert free == total


def test_process_engine_rejection_kinds(process_server):
    """Only the engine's ValueError comes back as a ValueError (the server's 400, its text shown); any other
    failure of add_request comes back as a RuntimeError, which the server answers with its generic error."""
    _, loop, _ = process_server

    async def accept(request_id, prompt, params):
        stream = loop.submit(request_id, prompt, params)
        with pytest.raises(Exception) as info:
            await asyncio.wait_for(stream.accepted, 60)
        return info.value

    bad_value = asyncio.run(accept("too-long", [1] * 600, inference.SamplingParams(max_tokens=1)))
    assert type(bad_value) is ValueError and "max_model_len" in str(bad_value)
    broken = inference.SamplingParams(max_tokens=1)
    object.__setattr__(broken, "temperature", "hot")  # past the server's validation: a bug, not the client's fault
    internal = asyncio.run(accept("internal", "Once", broken))
    assert type(internal) is RuntimeError and "TypeError" in str(internal)


def test_dead_engine_process_gives_503(process_server):
    srv, loop, _ = process_server
    loop._proc.kill()
    loop._proc.join(10)
    deadline = time.monotonic() + 10
    while loop.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
