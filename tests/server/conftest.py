"""Fixtures: uvicorn servers on free loopback ports, around the fake engine or a real one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from scratchlm.server import BackgroundServer, ServerConfig, create_app
from tests.server.fake_engine import FakeEngine, FakeEngineConfig, FakeSamplingParams


@contextlib.contextmanager
def fake_server(engine_config: FakeEngineConfig | None = None,
                server_config: ServerConfig | None = None) -> Iterator[tuple[BackgroundServer, FakeEngine]]:
    """A real uvicorn server on a free port around a fresh FakeEngine."""
    engine = FakeEngine(engine_config)
    app = create_app(engine, server_config or ServerConfig(), model_name="fake-echo",
                     sampling_params_cls=FakeSamplingParams)
    with BackgroundServer(app, start_timeout_s=30) as srv:
        yield srv, engine


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[BackgroundServer, FakeEngine]]:
    with fake_server() as pair:
        yield pair
