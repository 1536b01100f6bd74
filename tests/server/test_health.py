"""`/health` tells the truth and the server's processes live and die together (server/health.py).

In process (the fake engine, no model): an idle engine keeps beating; a step stuck past `step_timeout_s` fails
the stream in flight with an error event, turns `/health` to 503 "hung" and asks the server to exit (code 4).
As a supervisor sees it (real `scratchlm serve --engine-process` subprocesses on stories260K, small bounds by
flag): a stopped (SIGSTOP) engine process makes `/health` 503 naming it, then fails the requests in flight and
the server exits with 4; a killed engine process ends the server with 3; a killed server takes its engine
process with it; SIGTERM stops everything with 0.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from scratchlm.server import BackgroundServer, ServerConfig, create_app
from scratchlm.server.health import EXIT_ENGINE_FAILED, EXIT_ENGINE_HUNG, EXIT_OK
from tests.server.fake_engine import FakeEngine, FakeEngineConfig, FakeSamplingParams
from tests.server.supervised import alive, served, wait_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process trees from /proc")


def _fake_app(engine: FakeEngine, **bounds: float):
    return create_app(engine, ServerConfig(**bounds), model_name="fake-echo", sampling_params_cls=FakeSamplingParams)


def test_idle_engine_keeps_beating():
    """An engine waiting for work is alive: /health stays 200 long past the heartbeat timeout."""
    engine = FakeEngine(FakeEngineConfig())
    with BackgroundServer(_fake_app(engine, heartbeat_timeout_s=0.3), start_timeout_s=30) as srv:
        deadline = time.monotonic() + 1.5  # five heartbeat timeouts without a request
        while time.monotonic() < deadline:
            r = httpx.get(srv.url + "/health", timeout=5)
            assert r.status_code == 200, r.text
            assert r.json()["status"] == "ok" and "engine loop" in r.json()["heartbeat_age_s"]
            time.sleep(0.1)


def test_stuck_step_fails_the_stream_and_stops_the_server():
    engine = FakeEngine(FakeEngineConfig(step_delay_s=0.01))
    app = _fake_app(engine, heartbeat_timeout_s=0.3, step_timeout_s=1.0)
    failures: list[tuple[str, int]] = []
    app.state.server.loop.failure_callbacks.append(lambda message, code: failures.append((message, code)))
    with BackgroundServer(app, start_timeout_s=30) as srv:
        body = {"model": "fake-echo", "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "choices" in first
            engine.config.step_delay_s = 8.0  # the next step sleeps: stuck, as far as a 1 s bound is concerned
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        error = events[-1].get("error")
        assert error is not None, events[-3:]
        assert error["code"] == "engine_hung" and "hung" in error["message"], error
        health = httpx.get(srv.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "hung", health.text
        assert failures and failures[0][1] == EXIT_ENGINE_HUNG and "step" in failures[0][0]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "fake-echo", "prompt": "hi"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_hung", r.text


def _stream(url: str, result: dict) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                if line:
                    result["lines"].append(line)
    except httpx.HTTPError as e:
        result["lines"].append(repr(e))


def test_stopped_engine_process_unhealthy_then_fails_requests_and_exits(tmp_path):
    with served(tmp_path, "--engine-process", "--max-num-seqs", "1", "--heartbeat-timeout-s", "1",
                "--step-timeout-s", "4") as srv:
        child = srv.engine_process()
        # 4 long streams, one running at a time (--max-num-seqs 1): some are still in flight when it stops
        results = [{"status": None, "lines": []} for _ in range(4)]
        threads = [threading.Thread(target=_stream, args=(srv.url, r)) for r in results]
        for t in threads:
            t.start()
        wait_for(lambda: any(r["lines"] for r in results), 30, "a first streamed token")
        os.kill(child, signal.SIGSTOP)
        t_stop = time.monotonic()
        took = wait_for(lambda: srv.health().status_code == 503, 15, "/health 503 after SIGSTOP")
        body = srv.health().json()
        print(f"SIGSTOP -> /health 503 after {took:.2f} s: {body['reason']}")
        assert body["status"] == "unhealthy" and "engine process" in [s["part"] for s in body["stale"]], body
        late = httpx.post(srv.url + "/v1/completions", json={"prompt": "The dog", "max_tokens": 5}, timeout=60)
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_hung", late.text
        code = srv.wait_exit(30)
        print(f"SIGSTOP -> exit {code} after {time.monotonic() - t_stop:.2f} s")
        assert code == EXIT_ENGINE_HUNG, srv.output()[-3000:]
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        ended = [r["lines"] for r in results if r["status"] == 200]
        assert all(lines[-1] == "data: [DONE]" for lines in ended), results  # no stream cut off or hanging
        errors = [lines[-2] for lines in ended if len(lines) > 1 and '"error"' in lines[-2]]
        assert errors and all('"engine_hung"' in e for e in errors), [lines[-2:] for lines in ended]
        wait_for(lambda: not alive(child), 10, "the stopped engine process gone")
        assert "stopping the server (exit status 4)" in srv.output()


def test_killed_engine_process_ends_the_server(tmp_path):
    with served(tmp_path, "--engine-process") as srv:
        child = srv.engine_process()
        os.kill(child, signal.SIGKILL)
        t0 = time.monotonic()
        code = srv.wait_exit(30)
        print(f"engine process killed -> server exit {code} after {time.monotonic() - t0:.2f} s")
        assert code == EXIT_ENGINE_FAILED
        assert "the engine process died (exit code -9)" in srv.output()


def test_killed_server_takes_its_engine_process(tmp_path):
    with served(tmp_path, "--engine-process") as srv:
        child = srv.engine_process()
        os.kill(srv.pid, signal.SIGKILL)
        srv.wait_exit(10)
        took = wait_for(lambda: not alive(child), 10, "the engine process gone after its server was killed")
        print(f"server killed -> engine process gone after {took:.2f} s")


def test_sigterm_stops_children_and_exits_zero(tmp_path):
    with served(tmp_path, "--engine-process") as srv:
        child = srv.engine_process()
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert srv.wait_exit(30) == EXIT_OK, srv.output()[-3000:]
        print(f"SIGTERM -> exit 0 after {time.monotonic() - t0:.2f} s")
        wait_for(lambda: not alive(child), 10, "the engine process gone after SIGTERM")


def test_bounds_each_part_and_the_first_step():
    """The rules, on hand-picked looks: stale past the heartbeat timeout (503, may recover), hung past the step
    timeout, the first step judged by its own (longer) bound."""
    from scratchlm.server.health import HealthConfig, assess

    config = HealthConfig(heartbeat_timeout_s=5, step_timeout_s=120, first_step_timeout_s=600)
    report, hung = assess(config, {"engine loop": 0.05, "rank 1": 0.4}, None, steps=3)
    assert (report.status, hung) == ("ok", None)
    report, hung = assess(config, {"engine process": 6.0, "rank 1": 0.4}, None, steps=3)
    assert report.status == "unhealthy" and report.stale == [("engine process", 6.0)] and hung is None
    report, hung = assess(config, {"rank 1": 121.0}, None, steps=3)
    assert report.status == "hung" and "rank 1 sent no heartbeat for 121.0 s" in hung
    report, hung = assess(config, {}, 300.0, steps=0)  # the first step may build kernels: 300 s is fine
    assert (report.status, hung) == ("ok", None)
    report, hung = assess(config, {}, 601.0, steps=0)
    assert report.status == "hung" and "--first-step-timeout-s 600" in hung
    report, hung = assess(config, {}, 121.0, steps=1)
    assert report.status == "hung" and "--step-timeout-s 120" in hung
    body = assess(config, {"engine process": 6.0}, None, steps=3)[0].body(config)
    assert body["stale"] == [{"part": "engine process", "seconds": 6.0}] and body["error"]["code"] == "engine_unhealthy"
