"""Property-based fuzzing of every route in the app's own OpenAPI schema (schemathesis strategies driven
by hypothesis, positive and negative cases): no input gives a 5xx, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from scratchlm.server import ServerConfig, create_app
from tests.server.conftest import fake_server
from tests.server.fake_engine import FakeEngine, FakeEngineConfig, FakeSamplingParams

ENGINE = FakeEngineConfig(max_model_len=96, step_delay_s=0.0)


@pytest.fixture(scope="module")
def fuzz_server():
    with fake_server(ENGINE, ServerConfig(max_n=4, max_queue=512)) as (srv, _):
        yield srv


def operations():
    app = create_app(FakeEngine(ENGINE), ServerConfig(), model_name="fake-echo",
                     sampling_params_cls=FakeSamplingParams)
    schema = schemathesis.openapi.from_dict(app.openapi())
    return [result.ok() for result in schema.get_all_operations()]


OPERATIONS = operations()
# Negative cases (schema-violating bodies) exist only for operations that take a body.
CASES = [(op, mode) for op in OPERATIONS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode is GenerationMode.POSITIVE or op.method.upper() == "POST"]


@pytest.mark.parametrize("operation,mode", CASES, ids=[f"{op.label} {mode.value}" for op, mode in CASES])
def test_no_server_errors(fuzz_server, operation, mode):
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case):
        response = case.call(base_url=fuzz_server.url, timeout=30)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if response.status_code >= 400:
            assert "error" in response.json(), response.text[:300]

    check()
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200


def test_schema_lists_every_route():
    labels = {op.label for op in OPERATIONS}
    for route in ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health",
                  "GET /metrics", "POST /tokenize", "POST /detokenize"):
        assert route in labels
