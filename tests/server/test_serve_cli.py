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


def _tiny_run_checkpoint(run_dir):
    """A scratchlm training checkpoint as the trainer names it: RUN/ckpt.pt."""
    import torch

    from scratchlm.model import ModelConfig, TransformerLM
    from scratchlm.training import AdamW, save_checkpoint

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32))
    run_dir.mkdir(parents=True)
    save_checkpoint(model, AdamW(model.parameters()), 1, run_dir / "ckpt.pt")
    return run_dir / "ckpt.pt"


def test_a_served_checkpoint_is_named_after_its_run(tmp_path):
    from scratchlm.inference import EngineConfig
    from scratchlm.server import ServerConfig
    from scratchlm.server.cli import build_app

    ckpt = _tiny_run_checkpoint(tmp_path / "runs" / "shakespeare")
    app = build_app(str(ckpt), ServerConfig(), EngineConfig(max_num_seqs=1))
    assert app.state.server.model_name == "shakespeare"
    named = build_app(str(ckpt), ServerConfig(served_model_name="bard"), EngineConfig(max_num_seqs=1))
    assert named.state.server.model_name == "bard"


def test_serve_trace_is_valid_json_after_sigterm(data_dir, tmp_path):
    """uvicorn re-raises SIGTERM after shutting down, which skips exit functions: the trace is closed before."""
    import json

    trace = tmp_path / "t.json"
    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    with serve_process(str(model), "--threads", "1", "--trace", str(trace)) as server:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
    events = json.loads(trace.read_text())  # the context manager's exit sent SIGTERM and waited for the exit
    assert any(str(e.get("name")).startswith("step ") for e in events), events[:5]


def test_serving_a_model_without_a_chat_template_warns_at_start_up(data_dir, caplog):
    from scratchlm.inference import EngineConfig
    from scratchlm.server import ServerConfig
    from scratchlm.server.cli import build_app

    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    with caplog.at_level("WARNING", logger="scratchlm.server"):
        build_app(str(model), ServerConfig(), EngineConfig(max_num_seqs=1))
    warnings = [r.getMessage() for r in caplog.records if "no chat template" in r.getMessage()]
    assert len(warnings) == 1 and "/v1/chat/completions" in warnings[0], warnings
