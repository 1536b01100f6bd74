"""Shared test set-up: the ../shared/data location, and the `slow` / `distributed` markers.

CI has ../shared/data next to the repository; the skip below is only a safety net for a checkout
without it. Nothing is ever downloaded in a test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def shared_data_path() -> Path:
    env = os.environ.get("SCRATCHLM_DATA")
    return Path(env) if env else REPO_ROOT.parent / "shared" / "data"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")
    parser.addoption("--run-distributed", action="store_true", help="also run tests marked distributed")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker in ("slow", "distributed"):
        if config.getoption(f"--run-{marker}"):
            continue
        skip = pytest.mark.skip(reason=f"{marker} test: run with --run-{marker}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """../shared/data (or $SCRATCHLM_DATA); skips with the reason when it is absent."""
    path = shared_data_path()
    if not path.is_dir():
        pytest.skip(f"shared test data not found at {path} (set SCRATCHLM_DATA)")
    return path


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model's GGUF (SmolLM2-135M-Instruct Q4_1), installed by the set-up."""
    from scratchlm.defaults import default_model_path as find

    try:
        return find()
    except FileNotFoundError as e:
        pytest.skip(str(e))
