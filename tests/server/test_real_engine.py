"""The server on the real engine (llama2.c stories260K): the official `openai` client, greedy outputs equal
to the offline `LLM.generate` of a separate engine, 64 concurrent streaming clients, preemption with a
small KV pool, and disconnects that free their blocks."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from scratchlm.server import BackgroundServer, ServerConfig, create_app
from scratchlm.server.metrics import parse_prometheus

inference = pytest.importorskip("scratchlm.inference")
LLM, LLMEngine, EngineConfig, SamplingParams = (inference.LLM, inference.LLMEngine, inference.EngineConfig,
                                                inference.SamplingParams)

MODEL = "stories260K"
PROMPTS = ["Once upon a time", "Lily and Tom went to the park.", "The dog", "One day, a little bird",
           "There was a big red ball", "Sam was sad because", "The sun was shining and", "Mom said"]


@pytest.fixture(scope="module")
def model_path(data_dir):
    return data_dir / "models" / "stories260K" / "stories260K.bin"


@pytest.fixture(scope="module")
def offline(model_path):
    """A separate engine for the reference outputs (never shared with the server's thread)."""
    return LLM(str(model_path), max_num_seqs=64)


def start_server(model_path, server_config: ServerConfig | None = None, **engine_options) -> BackgroundServer:
    engine = LLMEngine.from_pretrained(model_path, EngineConfig(**engine_options))
    app = create_app(engine, server_config or ServerConfig(), model_name=MODEL)
    return BackgroundServer(app, start_timeout_s=60).start()


@pytest.fixture(scope="module")
def server(model_path):
    srv = start_server(model_path, max_num_seqs=64)
    yield srv
    srv.stop()


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def metrics(srv) -> dict[str, float]:
    samples = parse_prometheus(httpx.get(srv.url + "/metrics", timeout=10).text)
    return {k.split("{")[0].removeprefix("scratchlm:"): v for k, v in samples.items() if "_bucket" not in k}


def wait_idle(srv, timeout_s: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(srv)
        if m["num_kv_blocks_free"] == m["num_kv_blocks_total"] and m["num_requests_running"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_openai_completions_greedy_equal_offline(server, offline):
    ref = offline.generate(PROMPTS, greedy(40), use_tqdm=False)
    for prompt, r in zip(PROMPTS, ref):
        res = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        assert res.choices[0].text == r.outputs[0].text
        assert res.choices[0].finish_reason == r.outputs[0].finish_reason
        assert res.usage.prompt_tokens == len(r.prompt_token_ids)
        assert res.usage.completion_tokens == len(r.outputs[0].token_ids)


def test_openai_batch_prompts_n_stop_seed(server, offline):
    res = client(server).completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=24, temperature=0)
    ref = offline.generate(PROMPTS[:3], greedy(24), use_tqdm=False)
    assert [c.text for c in res.choices] == [r.outputs[0].text for r in ref]
    # stop strings: the offline engine with the same stop gives the same truncated text
    [r] = offline.generate([PROMPTS[0]], greedy(60, stop=["."]), use_tqdm=False)
    res = client(server).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=60, temperature=0, stop=".")
    assert res.choices[0].text == r.outputs[0].text and "." not in res.choices[0].text
    assert res.choices[0].finish_reason == r.outputs[0].finish_reason
    # n samples with a seed: reproducible, and equal to the offline engine with the same seed
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=1.0, n=3, seed=1234)
    a = client(server).completions.create(**kw)
    b = client(server).completions.create(**kw)
    assert len(a.choices) == 3 and [c.text for c in a.choices] == [c.text for c in b.choices]
    [r] = offline.generate([PROMPTS[1]], SamplingParams(temperature=1.0, max_tokens=20, n=3, seed=1234),
                           use_tqdm=False)
    assert [c.text for c in a.choices] == [o.text for o in r.outputs]
    assert a.usage.completion_tokens == sum(len(o.token_ids) for o in r.outputs)


def test_openai_chat_and_streaming_equal_offline(server, offline):
    messages = [{"role": "user", "content": "Once upon a time"}]
    prompt = offline.engine.apply_chat_template(messages)
    [r] = offline.generate([prompt], greedy(32), use_tqdm=False)
    res = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    assert res.choices[0].message.content == r.outputs[0].text
    stream = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                                    stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        pieces += [c.delta.content or "" for c in chunk.choices]
    assert "".join(pieces) == r.outputs[0].text
    assert usage.completion_tokens == len(r.outputs[0].token_ids)
    assert usage.prompt_tokens == len(r.prompt_token_ids)


def test_logprobs_match_offline(server, offline):
    [r] = offline.generate([PROMPTS[2]], greedy(5, logprobs=2), use_tqdm=False)
    res = client(server).completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=5, temperature=0, logprobs=2)
    got = res.choices[0].logprobs.token_logprobs
    want = [lp[t] for t, lp in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)]
    assert got == pytest.approx(want, abs=1e-4)


async def _stream_one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, str | None, int]:
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    text, finish, tokens = "", None, -1
    async for chunk in stream:
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, finish, tokens


def test_64_concurrent_streaming_clients(server, offline):
    """64 streams of mixed lengths at once: each completes, equals its offline greedy output, and the KV pool
    is empty afterwards."""
    jobs = [(f"{PROMPTS[i % len(PROMPTS)]} {'and then' * (i % 5)}".strip(), 8 + (i * 7) % 90) for i in range(64)]
    ref = offline.generate([p for p, _ in jobs], [greedy(m) for _, m in jobs], use_tqdm=False)

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.wait_for(asyncio.gather(*[_stream_one(aclient, p, m) for p, m in jobs]), 600)

    before = metrics(server)
    results = asyncio.run(run_all())
    for (text, finish, tokens), r in zip(results, ref):
        assert text == r.outputs[0].text
        assert finish == r.outputs[0].finish_reason
        assert tokens == len(r.outputs[0].token_ids)
    after = wait_idle(server)
    assert after["num_kv_blocks_free"] == after["num_kv_blocks_total"]
    assert after["num_requests_active"] == 0
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == sum(t for _, _, t in results)


def test_disconnect_aborts_and_frees_blocks(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    before = metrics(server)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        events = (line for line in r.iter_lines() if line)
        for _ in range(4):
            assert next(events).startswith("data: ")
        assert metrics(server)["num_kv_blocks_free"] < metrics(server)["num_kv_blocks_total"]
    after = wait_idle(server)
    assert after["num_kv_blocks_free"] == after["num_kv_blocks_total"]
    assert after["request_aborted_by_client_total"] == before["request_aborted_by_client_total"] + 1
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 400


def test_preemption_with_small_kv_pool(model_path, offline):
    """A KV pool of 24 blocks for 16 concurrent requests: the scheduler preempts, every answer is still exact."""
    per_block = 5 * 2 * 4 * 8 * 16 * 4  # layers * (k, v) * kv_heads * head_dim * block_size * fp32 bytes
    srv = start_server(model_path, ServerConfig(max_queue=64), max_num_seqs=16, kv_cache_memory=24 * per_block)
    try:
        assert metrics(srv)["num_kv_blocks_total"] <= 25
        jobs = [(PROMPTS[i % len(PROMPTS)], 40 + 5 * i) for i in range(16)]
        ref = offline.generate([p for p, _ in jobs], [greedy(m) for _, m in jobs], use_tqdm=False)
        with ThreadPoolExecutor(16) as pool:
            texts = list(pool.map(lambda j: client(srv).completions.create(
                model=MODEL, prompt=j[0], max_tokens=j[1], temperature=0).choices[0].text, jobs))
        assert texts == [r.outputs[0].text for r in ref]
        m = wait_idle(srv)
        assert m["num_preemptions_total"] > 0
        assert m["num_kv_blocks_free"] == m["num_kv_blocks_total"]
    finally:
        srv.stop()


@pytest.mark.slow
def test_full_queue_429_on_real_engine(model_path):
    srv = start_server(model_path, ServerConfig(max_queue=0), max_num_seqs=2)
    try:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True}
        with ThreadPoolExecutor(6) as pool:
            codes = sorted(pool.map(lambda _: httpx.post(srv.url + "/v1/completions", json=body,
                                                         timeout=120).status_code, range(6)))
        assert codes.count(200) >= 2 and 429 in codes and set(codes) <= {200, 429}
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=60).status_code == 200
    finally:
        srv.stop()


@pytest.mark.slow
def test_default_model_chat_equal_offline(default_model_path):
    """SmolLM2-135M-Instruct (GGUF, ChatML template): the server's greedy chat equals the offline `LLM.chat`."""
    engine = LLMEngine.from_pretrained(default_model_path, EngineConfig(max_num_seqs=4))
    offline_llm = LLM.from_engine(LLMEngine(engine.runner.model, engine.tokenizer, engine.model_config,
                                            EngineConfig(max_num_seqs=4)))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    [r] = offline_llm.chat(messages, greedy(16), use_tqdm=False)
    with BackgroundServer(create_app(engine, ServerConfig(), model_name="smollm2")) as srv:
        smol = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)
        res = smol.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0)
        assert res.choices[0].message.content == r.outputs[0].text
        assert "Paris" in res.choices[0].message.content
        tok = httpx.post(srv.url + "/tokenize", json={"messages": messages}, timeout=60).json()
        assert tok["count"] == res.usage.prompt_tokens
