"""TP ranks under `scratchlm serve`, as a supervisor sees them (server/health.py, parallel/runner.py):
a stopped rank turns `/health` to 503 naming it and the server exits with 4; a rank killed while the engine is
idle ends the server with 3 at once; a killed server (or engine process) takes its ranks with it."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from scratchlm.server.health import EXIT_ENGINE_FAILED, EXIT_ENGINE_HUNG
from tests.server.supervised import alive, served, wait_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process trees from /proc")


def test_stopped_rank_unhealthy_then_server_exits(tmp_path):
    with served(tmp_path, "--tensor-parallel-size", "2", "--heartbeat-timeout-s", "1", "--step-timeout-s",
                "4") as srv:
        (rank,) = srv.ranks()
        os.kill(rank, signal.SIGSTOP)
        t0 = time.monotonic()
        took = wait_for(lambda: srv.health().status_code == 503, 15, "/health 503 after SIGSTOP of rank 1")
        body = srv.health().json()
        print(f"rank 1 stopped -> /health 503 after {took:.2f} s: {body['reason']}")
        assert body["status"] == "unhealthy" and [s["part"] for s in body["stale"]] == ["rank 1"], body
        late = httpx.post(srv.url + "/v1/completions", json={"prompt": "The dog", "max_tokens": 5}, timeout=60)
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_hung", late.text
        code = srv.wait_exit(30)
        print(f"rank 1 stopped -> exit {code} after {time.monotonic() - t0:.2f} s")
        assert code == EXIT_ENGINE_HUNG, srv.output()[-3000:]
        assert "rank 1 sent no heartbeat" in srv.output()
        wait_for(lambda: not alive(rank), 10, "the stopped rank gone")


@pytest.mark.distributed
def test_rank_killed_while_idle_ends_the_server(tmp_path):
    with served(tmp_path, "--tensor-parallel-size", "2") as srv:
        (rank,) = srv.ranks()
        os.kill(rank, signal.SIGKILL)
        t0 = time.monotonic()
        code = srv.wait_exit(30)
        print(f"rank 1 killed (idle) -> exit {code} after {time.monotonic() - t0:.2f} s")
        assert code == EXIT_ENGINE_FAILED, srv.output()[-3000:]
        assert "rank 1" in srv.output() and "exited with code -9" in srv.output()


@pytest.mark.distributed
def test_killed_server_takes_engine_process_and_ranks(tmp_path):
    with served(tmp_path, "--tensor-parallel-size", "2", "--engine-process") as srv:
        child = srv.engine_process()
        (rank,) = srv.ranks(child)
        os.kill(srv.pid, signal.SIGKILL)
        srv.wait_exit(10)
        took = wait_for(lambda: not alive(child) and not alive(rank), 10,
                        "the engine process and its rank gone after the server was killed")
        print(f"server killed -> engine process and rank gone after {took:.2f} s")


@pytest.mark.distributed
def test_killed_server_takes_its_ranks(tmp_path):
    with served(tmp_path, "--tensor-parallel-size", "2") as srv:
        (rank,) = srv.ranks()
        os.kill(srv.pid, signal.SIGKILL)
        srv.wait_exit(10)
        took = wait_for(lambda: not alive(rank), 10, "the rank gone after the server was killed")
        print(f"server killed -> rank gone after {took:.2f} s")


@pytest.mark.distributed
def test_stopped_pipeline_stage_unhealthy_then_server_exits(tmp_path):
    """The issue's case: a stopped last pipeline stage gave 60 s of 200s."""
    with served(tmp_path, "--pipeline-parallel-size", "2", "--heartbeat-timeout-s", "1", "--step-timeout-s",
                "4") as srv:
        (rank,) = srv.ranks()
        os.kill(rank, signal.SIGSTOP)
        took = wait_for(lambda: srv.health().status_code == 503, 15, "/health 503 after SIGSTOP of stage 1")
        print(f"stage 1 stopped -> /health 503 after {took:.2f} s")
        assert srv.wait_exit(30) == EXIT_ENGINE_HUNG, srv.output()[-3000:]
        wait_for(lambda: not alive(rank), 10, "the stopped stage gone")


@pytest.mark.distributed
def test_engine_process_rank_stopped_or_killed_ends_the_server(tmp_path):
    """Under --engine-process the ranks are the child's: their heartbeats reach /health through the child's, and a
    dead rank ends the child and then the server."""
    with served(tmp_path, "--tensor-parallel-size", "2", "--engine-process", "--heartbeat-timeout-s", "1",
                "--step-timeout-s", "4") as srv:
        child = srv.engine_process()
        (rank,) = srv.ranks(child)
        os.kill(rank, signal.SIGSTOP)
        wait_for(lambda: srv.health().status_code == 503, 15, "/health 503 after SIGSTOP of rank 1")
        assert [s["part"] for s in srv.health().json()["stale"]] == ["rank 1"]
        assert srv.wait_exit(30) == EXIT_ENGINE_HUNG, srv.output()[-3000:]
        wait_for(lambda: not alive(rank) and not alive(child), 10, "the engine process and its stopped rank gone")
    with served(tmp_path, "--tensor-parallel-size", "2", "--engine-process") as srv:
        child = srv.engine_process()
        (rank,) = srv.ranks(child)
        os.kill(rank, signal.SIGKILL)
        t0 = time.monotonic()
        assert srv.wait_exit(30) == EXIT_ENGINE_FAILED, srv.output()[-3000:]
        print(f"engine process's rank killed -> server exit 3 after {time.monotonic() - t0:.2f} s")
        assert "the engine process cannot continue" in srv.output() and "rank 1" in srv.output()
