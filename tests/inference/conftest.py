"""Engine tests run single-threaded: their tensors are tiny, and on a shared 2-core machine two
OpenMP threads spin against the neighbours (measured: 5-30x slower). Restored after each module."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
