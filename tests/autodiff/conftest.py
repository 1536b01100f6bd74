"""Autodiff tests run on one torch thread: the CI machine has 2 shared cores, and small ops oversubscribed
across threads run many times slower."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
