"""`scratchlm serve` start-up: a taken port fails before the model loads; a model without a tokenizer is served
for token-id prompts and answers text prompts with a 400 that says why (issue 17, items 2 and 4)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from scratchlm.server import BackgroundServer, ServerConfig, create_app
from scratchlm.server.cli import bind_port

REPO = Path(__file__).resolve().parents[2]


def test_bind_port_names_the_taken_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"cannot listen on 127\.0\.0\.1:{port}: .*--port N"):
            bind_port("127.0.0.1", port)
    sock = bind_port("127.0.0.1", 0)
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


def test_taken_port_fails_before_the_model_loads(data_dir):
    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "scratchlm", "serve", str(model), "--port", str(port),
                              "--threads", "1"], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert res.returncode == 2, res.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in res.stderr and "Address already in use" in res.stderr
    assert "loading model" not in res.stderr and "serving" not in res.stderr  # nothing loaded, nothing claimed


@pytest.fixture(scope="module")
def tokenless(data_dir):
    """A server on stories260K's HF export, which has config.json + safetensors but no tokenizer.json."""
    from scratchlm.inference import EngineConfig, LLMEngine

    engine = LLMEngine.from_pretrained(data_dir / "models" / "stories260K" / "hf", EngineConfig(max_num_seqs=4))
    assert engine.tokenizer is None
    srv = BackgroundServer(create_app(engine, ServerConfig(), model_name="stories260K-hf"), start_timeout_s=60)
    yield srv.start()
    srv.stop()


def test_no_tokenizer_serves_token_ids_and_refuses_text_clearly(tokenless, data_dir):
    from scratchlm.inference import LLM, SamplingParams

    url = tokenless.url
    r = httpx.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "no_tokenizer" and "token ids" in err["message"] and "--tokenizer" in err["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_tokenizer", r.text
    assert httpx.post(url + "/tokenize", json={"prompt": "hi"}, timeout=30).status_code == 400

    # token-id prompts work: the generated ids come back as vLLM's "token_id:N" logprob tokens
    ids = LLM(str(data_dir / "models" / "stories260K" / "stories260K.bin")).tokenizer.encode("Once upon a time")
    ids = [1, *ids]
    r = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0, "logprobs": 0},
                   timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    got = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    reference = LLM(str(data_dir / "models" / "stories260K" / "stories260K.bin"))
    [want] = reference.generate([ids], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert got == list(want.outputs[0].token_ids)
    assert r.json()["usage"]["completion_tokens"] == 8


def test_tokenizer_flag_supplies_one(data_dir):
    from scratchlm.inference import LLM, SamplingParams

    root = data_dir / "models" / "stories260K"
    llm = LLM(str(root / "hf"), tokenizer=str(root / "tok512.bin"))
    reference = LLM(str(root / "stories260K.bin"))
    params = SamplingParams(temperature=0, max_tokens=12)
    [a] = llm.generate(["Once upon a time"], params, use_tqdm=False)
    [b] = reference.generate(["Once upon a time"], params, use_tqdm=False)
    assert a.outputs[0].text == b.outputs[0].text and a.outputs[0].text


def test_generate_without_tokenizer_says_where_it_looked(data_dir):
    model = data_dir / "models" / "stories260K" / "hf"
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "scratchlm", "generate", "--model", str(model), "--threads", "1",
                          "Once upon a time"], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert res.returncode == 2, res.stderr
    assert "has no tokenizer" in res.stderr and str(model / "tokenizer.json") in res.stderr
    assert "--tokenizer PATH" in res.stderr and "Traceback" not in res.stderr, time.monotonic() - t0
