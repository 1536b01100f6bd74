"""A request that could never be served is a 400 saying why, with the numbers; one that only has to wait for others
is a 429 with Retry-After, as before.

- More sequences (prompts x n) than the server ever holds (max-num-seqs + max-queue): before, a 429 with
  Retry-After that no retry could ever satisfy.
- More tokens than the KV cache holds (the engine lowers max_model_len to the cache): the 400 says that the cache
  is the limit and how large it is (stories260K, a 9-block cache).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from scratchlm.server import BackgroundServer, ServerConfig, create_app
from scratchlm.server.metrics import parse_prometheus
from tests.server.conftest import fake_server
from tests.server.fake_engine import FakeEngineConfig

MODEL = "fake-echo"


def active(srv) -> float:
    return parse_prometheus(httpx.get(srv.url + "/metrics", timeout=10).text)[
        f'scratchlm:num_requests_active{{model_name="{MODEL}"}}']


def test_more_sequences_than_the_server_holds_is_a_400_while_a_full_queue_is_a_429():
    cfg = ServerConfig(max_queue=1, retry_after_s=2)
    with fake_server(FakeEngineConfig(max_num_seqs=2, step_delay_s=0.02), cfg) as (srv, _):  # holds 2 + 1
        url = srv.url + "/v1/completions"
        r = httpx.post(url, json={"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 2}, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and "retry-after" not in r.headers, r.text
        assert error["code"] == "request_too_large" and error["param"] == "prompt"
        assert "needs 4 sequences (2 prompt(s) x n=2)" in error["message"] and ": 3 (" in error["message"]
        r = httpx.post(url, json={"model": MODEL, "prompt": "a", "n": 2, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200  # 2 sequences fit an idle server
        held: list[httpx.Response] = []
        hold = threading.Thread(target=lambda: held.append(httpx.post(
            url, json={"model": MODEL, "prompt": "hold", "n": 2, "max_tokens": 60}, timeout=60)))
        hold.start()
        try:
            deadline = time.monotonic() + 30  # until the hold request is admitted (2 of the 3 sequences)
            while active(srv) < 1:
                assert time.monotonic() < deadline, "the hold request was not admitted within 30 s"
                time.sleep(0.02)
            r = httpx.post(url, json={"model": MODEL, "prompt": "a", "n": 2, "max_tokens": 2}, timeout=30)
            assert r.status_code == 429 and r.headers["retry-after"] == "2"  # it only has to wait
            assert r.json()["error"]["code"] == "queue_full"
        finally:
            hold.join(60)
        assert held and held[0].status_code == 200


@pytest.fixture(scope="module")
def small_cache_server(data_dir):
    import torch

    from scratchlm.inference import EngineConfig, LLMEngine

    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(data_dir / "models" / "stories260K" / "stories260K.bin",
                                       EngineConfig(kv_cache_memory=200_000, max_num_seqs=4))
    assert engine.block_manager.num_usable_blocks == 9 and engine.max_model_len == 144  # 9 blocks x 16 tokens
    with BackgroundServer(create_app(engine, ServerConfig(), model_name="stories260K")) as srv:
        yield srv


def test_more_tokens_than_the_kv_cache_holds_is_a_400_naming_the_cache(small_cache_server):
    url = small_cache_server.url + "/v1/completions"
    r = httpx.post(url, json={"prompt": [1, 300, 301, 302], "max_tokens": 200}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and "retry-after" not in r.headers, r.text
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert "you requested 204 tokens" in error["message"]
    assert "the whole KV cache holds 9 blocks of 16 tokens = 144 tokens" in error["message"], error["message"]
    assert "--kv-cache-memory" in error["message"]
    r = httpx.post(url, json={"prompt": [1, 300, 301, 302], "max_tokens": 140, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 140  # what fits is served
