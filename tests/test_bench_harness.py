"""The benchmark harness's timing of decode-sized kernels (``dsa_indexer.bench.harness``): which graphs a
timing replays and when its flush runs, and how many buffer sets a rotating timing asks for. CUDA graphs: GPU
only."""

from __future__ import annotations

import pytest
import torch

from dsa_indexer.bench import harness


@pytest.mark.gpu
def test_rotating_graph_us_replays_each_set_in_turn():
    """Each call runs once eagerly (before capture), once in the untimed round and then every
    ``len(calls)``-th timed replay; the median is a positive time."""
    counters = torch.zeros(3, dtype=torch.int64, device="cuda")
    calls = [lambda i=i: counters[i].add_(1) for i in range(3)]
    us = harness.rotating_graph_us(calls, reps=12)
    torch.cuda.synchronize()
    assert us > 0
    assert counters.tolist() == [1 + 1 + 4] * 3


@pytest.mark.gpu
def test_cold_graph_us_runs_the_flush_before_each_replay():
    counters = torch.zeros(2, dtype=torch.int64, device="cuda")
    us = harness.cold_graph_us(lambda: counters[0].add_(1), reps=7, before=lambda: counters[1].add_(1))
    torch.cuda.synchronize()
    assert us > 0
    assert counters.tolist() == [1 + 7, 7]


@pytest.mark.gpu
@pytest.mark.parametrize("bytes_per_call", [1, 17 << 20, 138 << 20, 2 << 30])
def test_rotation_count_puts_three_l2s_between_uses(bytes_per_call):
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    count = harness.rotation_count(bytes_per_call)
    assert count >= 2
    assert (count - 1) * bytes_per_call >= 3 * l2_bytes
    assert count == 2 or (count - 2) * bytes_per_call < 3 * l2_bytes
