"""Model tests run torch on one thread: the models here are tiny, and on a shared 2-core machine a
second intra-op thread mostly waits for a core (the stories260K greedy test went from ~150 s to a few
seconds under load)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
