"""No request can harm another (issue 16), on the real engine (stories260K): a request whose sampling raises
fails alone (a 500 / an in-band error event) while its neighbours finish with exactly their offline greedy text;
overflowing or tiny sampling parameters are 400s or greedy; a 4 MB prompt is refused before it is tokenized and
never stalls /health; `n` samples count against the queue; and the "bad neighbour" run: 16 greedy streams
complete exactly while every bad request of the issue is sent, with /health never stalling for over 1 s."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from scratchlm.inference.sampler import Sampler
from scratchlm.server import BackgroundServer, ServerConfig, create_app

inference = pytest.importorskip("scratchlm.inference")
LLM, LLMEngine, EngineConfig, SamplingParams = (inference.LLM, inference.LLMEngine, inference.EngineConfig,
                                                inference.SamplingParams)

MODEL = "stories260K"
FAULT_SEED = 4242  # the fault-injecting sampler raises for rows of requests with this seed
PROMPTS = ["Once upon a time", "Lily and Tom went to the park.", "The dog", "One day, a little bird",
           "There was a big red ball", "Sam was sad because", "The sun was shining and", "Mom said"]


class FaultySampler(Sampler):
    """Raises when the batch holds a row of a request seeded FAULT_SEED (as the overflowing top_k did)."""

    def __call__(self, logits, rows):
        if any(r.params.seed == FAULT_SEED for r in rows):
            raise OverflowError("injected fault: Python int too large to convert to C long")
        return super().__call__(logits, rows)


@pytest.fixture(scope="module")
def model_path(data_dir):
    return data_dir / "models" / "stories260K" / "stories260K.bin"


@pytest.fixture(scope="module")
def offline(model_path):
    return LLM(str(model_path), max_num_seqs=64)


def start(model_path, server_config: ServerConfig | None = None, **engine_options) -> BackgroundServer:
    engine = LLMEngine.from_pretrained(model_path, EngineConfig(**engine_options))
    engine.sampler = FaultySampler()
    app = create_app(engine, server_config or ServerConfig(), model_name=MODEL)
    return BackgroundServer(app, start_timeout_s=60).start()


@pytest.fixture(scope="module")
def server(model_path):
    srv = start(model_path, max_num_seqs=32)
    yield srv
    srv.stop()


def reference(offline, prompts: list[str], max_tokens: int) -> list[str]:
    outs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
    return [o.outputs[0].text for o in outs]


async def stream_text(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, list[dict]]:
    """(concatenated text, error events) of one streamed completion."""
    text, errors = "", []
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
            else:
                text += "".join(c["text"] for c in event["choices"])
    return text, errors


class HealthMonitor:
    """Polls /health every 50 ms in a thread; `worst` is the slowest answer (seconds)."""

    def __init__(self, url: str):
        self.url, self.worst, self.failures, self._stop = url, 0.0, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = c.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.worst = max(self.worst, time.monotonic() - t0)
                self.failures += not ok
                time.sleep(0.05)

    def __enter__(self) -> HealthMonitor:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join(30)


def test_fault_injected_request_fails_alone(server, offline):
    """Before: engine.step() raised and the loop failed every request in flight (10 of 10 in the issue)."""
    want = reference(offline, PROMPTS[:6], 48)

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            good = [stream_text(c, server.url, {"prompt": p, "max_tokens": 48, "temperature": 0, "ignore_eos": True})
                    for p in PROMPTS[:6]]
            bad_stream = stream_text(c, server.url, {"prompt": "Bad", "max_tokens": 8, "seed": FAULT_SEED})
            bad_plain = c.post(server.url + "/v1/completions", json={"prompt": "Bad", "max_tokens": 8,
                                                                     "seed": FAULT_SEED})
            return await asyncio.gather(*good, bad_stream, bad_plain)

    *good, (bad_text, bad_errors), plain = asyncio.run(run())
    assert [t for t, _ in good] == want and not any(e for _, e in good)
    assert bad_errors and bad_errors[0]["code"] == "engine_request_failed"
    message = bad_errors[0]["message"]
    assert "Error id err-" in message and "injected" not in message  # the exception's text is in the log only
    assert plain.status_code == 500 and plain.json()["error"]["code"] == "engine_request_failed"
    assert httpx.get(server.url + "/health").status_code == 200


def test_numeric_bounds_name_the_field(server, offline):
    url = server.url + "/v1/completions"
    cases = [({"top_k": 100000000000000000000}, "top_k"), ({"top_k": 513}, "top_k"),
             ({"repetition_penalty": 1e-300}, "repetition_penalty"), ({"temperature": 1e300}, "temperature"),
             ({"min_p": 2}, "min_p"), ({"top_p": 0}, "top_p"), ({"presence_penalty": -1e9}, "presence_penalty"),
             ({"frequency_penalty": 3}, "frequency_penalty"), ({"logprobs": 21}, "logprobs"), ({"n": 0}, "n"),
             ({"n": 10**30}, "n"), ({"best_of": 3}, "best_of"), ({"seed": 2**64}, "seed"),
             ({"max_tokens": 10**30}, "max_tokens"), ({"min_tokens": 10**30}, "min_tokens")]
    for fields, param in cases:
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 4, **fields}, timeout=60)
        assert r.status_code == 400, (fields, r.text)
        error = r.json()["error"]
        assert param is None or error["param"] == param, (fields, error)
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 4, "top_k": 513}, timeout=60)
    assert "[1, 512]" in r.json()["error"]["message"]  # the allowed range
    # a temperature of 1e-39 (it overflowed float32 to a junk token) is greedy, as vLLM
    r = httpx.post(url, json={"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 1e-39, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(offline, PROMPTS[:1], 24)[0]
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 4, "top_k": 512, "repetition_penalty": 0.01,
                              "seed": -(2**63)}, timeout=60)
    assert r.status_code == 200


def test_huge_prompt_refused_before_tokenizing(server):
    """Before: a 4 MB prompt was tokenized on the event loop, blocking /health and every stream for 6-17 s."""
    big = "Once upon a time " * 235_000  # ~4 MB, under the 4 MiB body limit
    with HealthMonitor(server.url) as health:
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": big, "max_tokens": 4}, timeout=60)
        took = time.monotonic() - t0
        r2 = httpx.post(server.url + "/tokenize", json={"prompt": big}, timeout=60)
        r3 = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": big}]},
                        timeout=60)
    for resp in (r, r2, r3):
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
    assert "no text longer than 4096 characters can fit" in r.json()["error"]["message"]
    assert took < 2.0 and health.worst < 1.0 and health.failures == 0
    # just under the bound: tokenized (in the worker thread), then refused by its token count
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a b " * 1000, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]


def test_n_samples_count_against_the_queue(model_path):
    """Before: admission counted requests, so n forks went past max_num_seqs + max_queue (512 against 64)."""
    srv = start(model_path, ServerConfig(max_queue=2, max_n=8), max_num_seqs=4)
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "temperature": 1.0}

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                first = asyncio.create_task(c.post(srv.url + "/v1/completions", json={**body, "n": 4}))
                await asyncio.sleep(0.3)  # admitted and running: 4 of the 6 sequence slots
                second = await c.post(srv.url + "/v1/completions", json={**body, "n": 3, "max_tokens": 2})
                third = await c.post(srv.url + "/v1/completions", json={**body, "n": 2, "max_tokens": 2})
                return await first, second, third

        first, second, third = asyncio.run(run())
        assert first.status_code == 200 and len(first.json()["choices"]) == 4
        assert second.status_code == 429 and second.json()["error"]["code"] == "queue_full"
        assert "this request adds 3" in second.json()["error"]["message"]
        assert third.status_code == 200
        r = httpx.post(srv.url + "/v1/completions", json={**body, "n": 5, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "--max-num-seqs 4" in r.text
    finally:
        srv.stop()


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "top_k": 100000000000000000000}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": 1e-39}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "repetition_penalty": 1e-300}),
    ("/v1/completions", {"prompt": "hi \ud800", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}], "max_tokens": 4}),
    ("/tokenize", {"prompt": "\ud800"}),
    ("/v1/completions", {"prompt": "Once upon a time " * 235_000, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop": [f"s{i}" for i in range(10_000)]}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "n": 10_000}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "n": 33, "best_of": 33}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "seed": FAULT_SEED}),  # fails inside the engine
    ("/v1/completions", {"prompt": [[10**20]], "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [-1]}),
]


def test_bad_neighbour(server, offline):
    """16 greedy streams complete with exactly their offline greedy text while each bad request is sent."""
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(16)]
    want = reference(offline, prompts, 64)

    async def run():
        async with httpx.AsyncClient(timeout=180) as c:
            good = [asyncio.create_task(stream_text(c, server.url, {"prompt": p, "max_tokens": 64, "temperature": 0,
                                                                    "ignore_eos": True})) for p in prompts]
            statuses = []
            for path, body in BAD_REQUESTS:
                raw = json.dumps(body).encode()  # json.dumps keeps lone surrogates as \ud800 escapes
                r = await c.post(server.url + path, content=raw, headers={"Content-Type": "application/json"})
                assert "error" in r.json() or r.status_code == 200, r.text[:300]
                statuses.append(r.status_code)
            return await asyncio.gather(*good), statuses

    with HealthMonitor(server.url) as health:
        results, statuses = asyncio.run(run())
    assert [t for t, _ in results] == want and not any(e for _, e in results)
    assert statuses[1] == 200  # the tiny temperature is greedy
    assert statuses[10] == 500  # the engine failed that request alone
    assert all(400 <= s < 500 for i, s in enumerate(statuses) if i not in (1, 10)), statuses
    assert health.worst < 1.0 and health.failures == 0, health.worst


def test_errored_output_raises_in_its_stream_only():
    """Both engine homes (thread and process) hand outputs to RequestStream._put: an output with `error` set
    becomes a RequestFailedError for that stream, and its admission slot is released."""
    from scratchlm.inference.outputs import CompletionOutput, RequestOutput
    from scratchlm.server.engine_loop import RequestFailedError, RequestStream, TimedOutput

    async def run():
        loop = asyncio.get_running_loop()
        bad, good = RequestStream("bad", loop), RequestStream("good", loop)
        released = []
        bad.on_done = lambda: released.append("bad")
        for s in (bad, good):
            s._accept(None)
        out = RequestOutput("bad", None, [1], [CompletionOutput(0, "", [], "error")], True, error="boom")
        bad._put(TimedOutput(out, 0.0))
        good._put(TimedOutput(RequestOutput("good", None, [1], [CompletionOutput(0, "a", [5], "length")], True), 0))
        with pytest.raises(RequestFailedError, match="boom"):
            async for _ in bad:
                pass
        return [item.output.outputs[0].text async for item in good], released

    texts, released = asyncio.run(run())
    assert texts == ["a"] and released == ["bad"]
