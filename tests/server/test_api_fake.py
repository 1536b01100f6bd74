"""The HTTP layer against the deterministic fake engine: OpenAI client, streaming, metrics, queueing,
disconnects and bad input. Expected texts are computed independently by `expected_text`."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from scratchlm.server import ServerConfig
from scratchlm.server.metrics import parse_prometheus
from tests.server.conftest import fake_server
from tests.server.fake_engine import FakeEngineConfig, chat_prompt, expected_text

MODEL = "fake-echo"


def client(srv, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=api_key, max_retries=0, timeout=30)


def metric(srv, name: str) -> float:
    samples = parse_prometheus(httpx.get(srv.url + "/metrics", timeout=10).text)
    return samples[f'scratchlm:{name}{{model_name="{MODEL}"}}']


def wait_until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_completion_openai_client(fake):
    srv, _ = fake
    res = client(srv).completions.create(model=MODEL, prompt="Hello there", max_tokens=7, temperature=0)
    text, reason = expected_text("Hello there", 7)
    assert res.choices[0].text == text
    assert res.choices[0].finish_reason == reason
    assert res.usage.prompt_tokens == 1 + len(b"Hello there")  # BOS + bytes
    assert res.usage.completion_tokens == 7
    assert res.usage.total_tokens == res.usage.prompt_tokens + 7
    assert res.model == MODEL and res.id.startswith("cmpl-")


def test_completion_n_and_stop(fake):
    srv, _ = fake
    res = client(srv).completions.create(model=MODEL, prompt="abcdefgh", max_tokens=6, n=3)
    assert [c.index for c in res.choices] == [0, 1, 2]
    for c in res.choices:
        assert c.text == expected_text("abcdefgh", 6, index=c.index)[0]
    assert res.usage.completion_tokens == 18
    res = client(srv).completions.create(model=MODEL, prompt="one two three", max_tokens=12, stop=["two"])
    text, reason = expected_text("one two three", 12, stop=["two"])
    assert (res.choices[0].text, res.choices[0].finish_reason, reason) == (text, "stop", "stop")
    assert text == "one "


def test_completion_batch_of_prompts_and_token_ids(fake):
    srv, _ = fake
    res = client(srv).completions.create(model=MODEL, prompt=["ab", "xyz"], max_tokens=4, n=2)
    assert [c.index for c in res.choices] == [0, 1, 2, 3]
    assert res.choices[0].text == expected_text("ab", 4, 0)[0]
    assert res.choices[3].text == expected_text("xyz", 4, 1)[0]
    ids = [256, *b"hey"]
    res = client(srv).completions.create(model=MODEL, prompt=ids, max_tokens=3)
    assert res.choices[0].text == "hey" and res.usage.prompt_tokens == 4


def test_completion_logprobs(fake):
    srv, _ = fake
    res = client(srv).completions.create(model=MODEL, prompt="lp", max_tokens=3, logprobs=1)
    lp = res.choices[0].logprobs
    assert lp.tokens == list(expected_text("lp", 3)[0])
    assert lp.token_logprobs == [-0.25] * 3
    assert lp.text_offset == [0, 1, 2]
    assert all(len(t) == 2 for t in lp.top_logprobs)


def test_chat_uses_engine_template_and_streams(fake):
    srv, _ = fake
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = chat_prompt(messages)
    res = client(srv).chat.completions.create(model=MODEL, messages=messages, max_tokens=9)
    assert res.choices[0].message.content == expected_text(prompt, 9)[0]
    assert res.choices[0].message.role == "assistant"
    assert res.usage.completion_tokens == 9

    stream = client(srv).chat.completions.create(model=MODEL, messages=messages, max_tokens=9, stream=True,
                                                 stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == expected_text(prompt, 9)[0]
    assert finish == "length"
    assert usage.completion_tokens == 9 and usage.prompt_tokens == res.usage.prompt_tokens


def test_chat_logprobs(fake):
    srv, _ = fake
    res = client(srv).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                              max_tokens=2, logprobs=True, top_logprobs=2)
    content = res.choices[0].logprobs.content
    assert len(content) == 2 and content[0].logprob == -0.25
    assert [t.logprob for t in content[0].top_logprobs] == [-0.25, -1.5]


def test_stream_raw_sse_ends_with_done(fake):
    srv, _ = fake
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 5, "stream": True, "n": 2,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    texts = {0: "", 1: ""}
    for ch in chunks[:-1]:
        for c in ch["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {i: expected_text("stream me", 5, i)[0] for i in (0, 1)}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_models_health_tokenize(fake):
    srv, _ = fake
    models = client(srv).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    r = httpx.post(srv.url + "/tokenize", json={"prompt": "hé"})
    assert r.json()["tokens"] == [256, *"hé".encode()]
    assert r.json()["count"] == 4 and r.json()["max_model_len"] == 256
    r = httpx.post(srv.url + "/detokenize", json={"tokens": list("hé".encode())})
    assert r.json() == {"prompt": "hé"}
    r = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": "q"}]})
    assert r.json()["tokens"][1:] == list(chat_prompt([{"role": "user", "content": "q"}]).encode())


def test_playground_page_served(fake):
    srv, _ = fake
    r = httpx.get(srv.url + "/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "/v1/chat/completions" in r.text and 'id="temperature"' in r.text


def test_continuous_batching_across_connections(fake):
    """Concurrent requests from separate connections share engine steps (batch size > 1)."""
    srv, engine = fake
    engine.step_batches.clear()
    prompts = [f"request number {i}" for i in range(8)]

    def one(p: str) -> str:
        return client(srv).completions.create(model=MODEL, prompt=p, max_tokens=20).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, prompts))
    assert texts == [expected_text(p, 20)[0] for p in prompts]
    assert max(engine.step_batches) > 1


def test_metrics_counts_and_histograms(fake):
    srv, _ = fake
    before = metric(srv, "generation_tokens_total")
    client(srv).completions.create(model=MODEL, prompt="metrics", max_tokens=4)
    assert wait_until(lambda: metric(srv, "generation_tokens_total") == before + 4)
    text = httpx.get(srv.url + "/metrics").text
    samples = parse_prometheus(text)
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert f"# TYPE scratchlm:{name} histogram" in text
        assert samples[f'scratchlm:{name}_count{{model_name="{MODEL}"}}'] >= 1
        assert samples[f'scratchlm:{name}_bucket{{model_name="{MODEL}",le="+Inf"}}'] == \
            samples[f'scratchlm:{name}_count{{model_name="{MODEL}"}}']
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "prefix_cache_hits_total", "prefix_cache_queries_total"):
        assert f'scratchlm:{name}{{model_name="{MODEL}"}}' in samples
    assert samples[f'scratchlm:request_success_total{{model_name="{MODEL}",finished_reason="length"}}'] >= 1


def test_stream_disconnect_aborts_and_frees_blocks():
    """A client that drops mid-stream gets its request aborted; the KV pool is empty afterwards."""
    with fake_server(FakeEngineConfig(step_delay_s=0.02)) as (srv, engine):
        body = {"model": MODEL, "prompt": "a long story", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert got[0].startswith("data: ")
            assert metric(srv, "num_kv_blocks_free") < metric(srv, "num_kv_blocks_total")
        assert wait_until(lambda: len(engine.aborted) == 1)
        assert wait_until(lambda: metric(srv, "num_kv_blocks_free") == metric(srv, "num_kv_blocks_total"))
        assert metric(srv, "request_aborted_by_client_total") == 1
        assert engine.generation_tokens < 200
        # still serving
        assert client(srv).completions.create(model=MODEL, prompt="ok", max_tokens=2).choices[0].text == "ok"


def test_non_stream_disconnect_aborts():
    with fake_server(FakeEngineConfig(step_delay_s=0.02)) as (srv, engine):
        body = {"model": MODEL, "prompt": "never read", "max_tokens": 200}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=body, timeout=0.3)
        assert wait_until(lambda: len(engine.aborted) == 1)
        assert wait_until(lambda: metric(srv, "num_kv_blocks_free") == metric(srv, "num_kv_blocks_total"))


def test_preemption_with_small_kv_pool():
    """A pool too small for the whole batch preempts sequences; every output is still exact."""
    with fake_server(FakeEngineConfig(num_blocks=24, block_size=4, max_num_seqs=8)) as (srv, engine):
        prompts = [f"prompt {i}" for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda p: client(srv).completions.create(
                model=MODEL, prompt=p, max_tokens=24).choices[0].text, prompts))
        assert texts == [expected_text(p, 24)[0] for p in prompts]
        assert engine.preemptions > 0
        assert metric(srv, "num_preemptions_total") == engine.preemptions
        assert wait_until(lambda: metric(srv, "num_kv_blocks_free") == 24)


def test_full_queue_answers_429_with_retry_after():
    cfg = ServerConfig(max_queue=1, retry_after_s=2)
    with fake_server(FakeEngineConfig(max_num_seqs=1, step_delay_s=0.02), cfg) as (srv, _):
        results: list[httpx.Response] = []

        def slow() -> None:
            results.append(httpx.post(srv.url + "/v1/completions", timeout=30,
                                      json={"model": MODEL, "prompt": "hold", "max_tokens": 40}))

        threads = [threading.Thread(target=slow) for _ in range(2)]
        for t in threads:
            t.start()
        assert wait_until(lambda: metric(srv, "num_requests_active") == 2)
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 429
        assert r.headers["retry-after"] == "2"
        assert r.json()["error"]["type"] == "rate_limit_error"
        for t in threads:
            t.join(30)
        assert [x.status_code for x in results] == [200, 200]
        assert metric(srv, "request_rejected_queue_full_total") == 1
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200


BAD_INPUTS = [
    # (what, body bytes or dict, path, status, words the message must contain)
    ("invalid JSON", b'{"prompt": "x",', "/v1/completions", 400, ["not valid JSON"]),
    ("wrong type", {"prompt": "x", "max_tokens": "ten"}, "/v1/completions", 400, ["max_tokens", "integer"]),
    ("wrong type of prompt", {"prompt": 12}, "/v1/completions", 400, ["prompt"]),
    ("missing prompt", {"max_tokens": 3}, "/v1/completions", 400, ["prompt", "required"]),
    ("unknown model", {"model": "gpt-99", "prompt": "x"}, "/v1/completions", 404, ["gpt-99", "does not exist"]),
    ("negative max_tokens", {"prompt": "x", "max_tokens": -3}, "/v1/completions", 400, ["max_tokens", "0"]),
    ("zero max_tokens", {"prompt": "x", "max_tokens": 0}, "/v1/completions", 400, ["max_tokens", "echo"]),
    ("huge max_tokens", {"prompt": "x", "max_tokens": 10**9}, "/v1/completions", 400,
     ["maximum context length", "256"]),
    ("prompt longer than the context", {"prompt": "y" * 300}, "/v1/completions", 400,
     ["maximum context length", "prompt"]),
    ("n above the limit", {"prompt": "x", "n": 17}, "/v1/completions", 400, ["n=17", "limit"]),
    ("n below 1", {"prompt": "x", "n": 0}, "/v1/completions", 400, ["n"]),
    ("temperature out of range", {"prompt": "x", "temperature": 9}, "/v1/completions", 400, ["temperature"]),
    ("top_p zero", {"prompt": "x", "top_p": 0}, "/v1/completions", 400, ["top_p"]),
    ("empty prompt list", {"prompt": []}, "/v1/completions", 400, ["prompt", "empty"]),
    ("token id out of vocab", {"prompt": [1, 999999]}, "/v1/completions", 400, ["999999", "vocabulary"]),
    ("empty stop string", {"prompt": "x", "stop": [""]}, "/v1/completions", 400, ["stop"]),
    ("empty messages", {"messages": []}, "/v1/chat/completions", 400, ["messages", "empty"]),
    ("missing messages", {"max_tokens": 3}, "/v1/chat/completions", 400, ["messages", "required"]),
    ("bad role", {"messages": [{"role": "wizard", "content": "x"}]}, "/v1/chat/completions", 400, ["role"]),
    ("chat prompt too long", {"messages": [{"role": "user", "content": "z" * 400}]}, "/v1/chat/completions", 400,
     ["maximum context length"]),
    ("invalid UTF-8", b'{"prompt": "caf\xe9"}', "/v1/completions", 400, ["UTF-8"]),
    ("detokenize bad ids", {"tokens": [-1]}, "/detokenize", 400, ["vocabulary"]),
    ("tokenize neither", {}, "/tokenize", 400, ["prompt", "messages"]),
]


@pytest.mark.parametrize("what,body,path,status,words", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_openai_error(fake, what, body, path, status, words):
    srv, _ = fake
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(srv.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word.lower() in error["message"].lower(), (word, error["message"])
    assert httpx.get(srv.url + "/health").status_code == 200


def test_bad_input_through_openai_client(fake):
    srv, _ = fake
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client(srv).completions.create(model=MODEL, prompt="x", max_tokens=100000)
    with pytest.raises(openai.NotFoundError):
        client(srv).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_body_size_limit():
    with fake_server(server_config=ServerConfig(max_body_bytes=1000)) as (srv, _):
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x" * 2000})
        assert r.status_code == 413
        assert "limit is 1000 bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit is enforced while reading
            yield b'{"prompt": "'
            for _ in range(20):
                yield b"y" * 100
            yield b'"}'

        r = httpx.post(srv.url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_api_key_and_cors_off_by_default():
    with fake_server(server_config=ServerConfig(api_key="s3cret")) as (srv, _):
        with pytest.raises(openai.AuthenticationError):
            client(srv, api_key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert client(srv, api_key="s3cret").completions.create(model=MODEL, prompt="x", max_tokens=1).choices
        assert httpx.get(srv.url + "/health").status_code == 200  # health stays open
        r = httpx.options(srv.url + "/v1/models", headers={"Origin": "http://evil.example",
                                                          "Access-Control-Request-Method": "GET"})
        assert "access-control-allow-origin" not in r.headers
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://evil.example",
                                                      "Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_when_enabled():
    with fake_server(server_config=ServerConfig(cors_origins=["http://app.example"])) as (srv, _):
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://app.example"})
        assert r.headers["access-control-allow-origin"] == "http://app.example"


def test_server_config_rejects_bad_values():
    with pytest.raises(ValueError, match="port=70000"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="max_n=0"):
        ServerConfig(max_n=0)


def test_default_max_tokens_caps_a_request_that_sends_none():
    """Without max_tokens a completion runs to the end of the context (vLLM's default); --default-max-tokens caps it."""
    body = {"model": MODEL, "prompt": "no cap given"}
    with fake_server(server_config=ServerConfig(default_max_tokens=5)) as (srv, _):
        capped = httpx.post(srv.url + "/v1/completions", json=body, timeout=30).json()
        assert capped["usage"]["completion_tokens"] == 5, capped
        asked = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 9}, timeout=30).json()
        assert asked["usage"]["completion_tokens"] == 9, asked  # a request's own max_tokens still wins
    with fake_server() as (srv, engine):
        uncapped = httpx.post(srv.url + "/v1/completions", json=body, timeout=30).json()
        usage = uncapped["usage"]
        assert usage["completion_tokens"] == engine.config.max_model_len - usage["prompt_tokens"], usage
    with pytest.raises(ValueError, match="default_max_tokens=0"):
        ServerConfig(default_max_tokens=0)
