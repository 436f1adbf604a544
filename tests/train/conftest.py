"""The training tests run tiny float64 shapes: one intra-op thread (restored afterwards) avoids thread
synchronisation costing more than the arithmetic on a busy 2-core machine."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
