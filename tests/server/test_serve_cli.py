"""`scratchlm serve`: clear errors for bad options, and a real start-up on stories260K."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.server.serve_process import REPO, serve_process


def serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scratchlm", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_missing_model_is_a_clear_error(tmp_path):
    res = serve(str(tmp_path / "nope.gguf"))
    assert res.returncode == 2
    assert "model not found" in res.stderr and "nope.gguf" in res.stderr


def test_bad_options_are_clear_errors():
    res = serve("--port", "70000", "--log-level", "loud")
    assert res.returncode == 2
    assert "port=70000" in res.stderr and "log_level='loud'" in res.stderr


@pytest.mark.slow
def test_serve_starts_logs_and_answers(data_dir):
    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    with serve_process(str(model), "--api-key", "k", "--threads", "1") as server:
        url = server.url
        r = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer k"}, timeout=60,
                       json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "stories260K"
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 401
    out, port = server.output, server.port
    assert "loading model" in out and f"on http://127.0.0.1:{port}" in out and "API key required" in out
