"""One rule for failures that are not the client's (server/app.py `internal_error`): the response, streamed or not,
carries a generic message, a code and an error id; the exception's text (a dead rank's gloo address, pids,
source paths) is logged under that id and never returned.

The engine is the fake echo engine (tests/server/fake_engine.py) made to fail the way a dead rank makes the real
one fail: `step()` raises the executor's error text. Each case gets its own server: a failed engine stays failed.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

import httpx
import pytest

from scratchlm.server import BackgroundServer, ServerConfig, create_app
from tests.server.fake_engine import FakeEngine, FakeSamplingParams, RequestOutput

# what rank 0 reports when a peer rank dies mid-collective (shape of the report)
SECRET = ("ParallelWorkerError: rank 1 (pid 31337) exited with code -9; gloo: [/opt/build/gloo/transport/tcp/"
          "pair.cc:534] Connection closed by peer [10.20.30.40]:29533 (File \"/home/operator/scratchlm/parallel/"
          "runner.py\", line 412)")
LEAKS = ("10.20.30.40", "29533", "31337", "/home/operator", "pair.cc", "runner.py", "gloo", "ParallelWorkerError")


@dataclass
class FailedOutput(RequestOutput):
    error: str | None = None


class FailingEngine(FakeEngine):
    """The echo engine, failing on demand: `fail` is 'step' (the whole engine: a dead rank), 'add' (add_request
    raises something that is not a bad input) or 'request' (one request's output carries an error)."""

    fail: str | None = None

    def add_request(self, request_id, prompt, params) -> None:
        if self.fail == "add":
            raise RuntimeError(SECRET)
        super().add_request(request_id, prompt, params)

    def step(self):
        if self.fail == "step":
            raise RuntimeError(SECRET)
        outputs = super().step()
        if self.fail == "request":
            return [FailedOutput(o.request_id, o.prompt, o.prompt_token_ids, o.outputs, True, error=SECRET)
                    for o in outputs]
        return outputs


@pytest.fixture
def server():
    engine = FailingEngine()
    app = create_app(engine, ServerConfig(), model_name="fake-echo", sampling_params_cls=FakeSamplingParams)
    with BackgroundServer(app, start_timeout_s=30) as srv:
        yield srv, engine


def check(error: dict, code: str, caplog) -> None:
    """`error` (an OpenAI error object) names no internals, and its error id leads to a log line that has them."""
    text = json.dumps(error)
    assert not [leak for leak in LEAKS if leak in text], text
    assert error["code"] == code, error
    found = re.search(r"err-[0-9a-f]{12}", error["message"])
    assert found, error
    lines = [r.getMessage() for r in caplog.records if found.group() in r.getMessage()]
    assert lines and SECRET in lines[0], [r.getMessage() for r in caplog.records][-5:]


def test_dead_engine_mid_stream_error_event_names_no_internals(server, caplog):
    caplog.set_level(logging.INFO, logger="scratchlm")
    srv, engine = server
    events = []
    body = {"prompt": "Once upon a time", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                engine.fail = "step"  # the rank dies after the first chunk went out
    assert "error" in events[-1] and len(events) > 1
    check(events[-1]["error"], "engine_unavailable", caplog)


def test_dead_engine_plain_request_is_a_generic_503(server, caplog):
    srv, engine = server
    engine.fail = "step"
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 8}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    check(r.json()["error"], "engine_unavailable", caplog)


def test_one_failed_request_is_a_generic_500(server, caplog):
    srv, engine = server
    engine.fail = "request"
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    assert r.status_code == 500
    check(r.json()["error"], "engine_request_failed", caplog)


def test_unexpected_exception_is_a_generic_500(server, caplog):
    srv, engine = server
    engine.fail = "add"  # not a ValueError (the engine's "bad input"), so not the client's
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 8}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_server_error"
    check(r.json()["error"], "internal_error", caplog)
    engine.fail = None  # the server goes on
    assert httpx.post(srv.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 8}).status_code == 200


GENERIC = re.compile(r"^[A-Z][^:]*\. Error id err-[0-9a-f]{12}: the server log has the details\.$")


@pytest.mark.distributed
def test_killed_tensor_parallel_rank_error_event_is_generic(data_dir, caplog):
    """The issue's case on the real engine: tensor-parallel size 2, rank 1 SIGKILLed mid-stream. The error event is
    the generic text alone (nothing of the executor's message), and the log line with its id has the message."""
    import os
    import signal

    import torch

    from scratchlm.inference import EngineConfig, LLMEngine

    caplog.set_level(logging.INFO, logger="scratchlm")
    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(data_dir / "models" / "stories260K" / "stories260K.bin",
                                       EngineConfig(tensor_parallel_size=2, parallel_timeout_s=60, max_num_seqs=4))
    try:
        with BackgroundServer(create_app(engine, ServerConfig(), model_name="stories260K"), start_timeout_s=60) as srv:
            events = []
            body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        if len(events) == 1:
                            killed = engine.runner.procs[0].pid
                            os.kill(killed, signal.SIGKILL)
            error = events[-1]["error"]
            assert GENERIC.match(error["message"]), error
            assert error["code"] == "engine_unavailable"
            error_id = re.search(r"err-[0-9a-f]{12}", error["message"]).group()
            lines = [r.getMessage() for r in caplog.records if error_id in r.getMessage()]
            # the log keeps what the body must not: which rank died and its pid (seen by the step that failed,
            # or first by rank 0's heartbeat watcher)
            assert lines and "rank 1" in lines[0] and f"pid {killed}" in lines[0], lines
            assert f"pid {killed}" not in error["message"]
    finally:
        engine.runner.shutdown()
