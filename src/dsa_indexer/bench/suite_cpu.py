"""A small CPU version of the benchmarks: the reference ops on modest shapes, so ``dsa-indexer bench``
shows something meaningful (and checks the plumbing) on a machine without a GPU.

Times are medians of wall-clock runs; floors use the copy bandwidth and fp32 matmul rate measured in
the same run.
"""

from __future__ import annotations

import statistics
import time

import torch

from .. import IndexerKCache, mqa_logits, paged_mqa_logits, quantize_fp8, rope_quant_q, topk
from . import harness


def _median_us(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure_ceilings() -> dict[str, float]:
    n = 1 << 27
    src = torch.randint(0, 255, (n,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_us = _median_us(lambda: dst.copy_(src))
    read_us = _median_us(lambda: src.view(torch.int32).max())
    size = 1024
    a, b = torch.randn(size, size), torch.randn(size, size)
    mm_us = _median_us(lambda: a @ b)
    return {"copy_tbs": 2 * n / copy_us / 1e6, "read_tbs": n / read_us / 1e6, "fp8_tflops": 2 * size**3 / mm_us / 1e6}


def run(ceilings: dict[str, float]) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    copy_bytes_per_us = ceilings["copy_tbs"] * 1e6
    flops_per_us = ceilings["fp8_tflops"] * 1e6

    x = torch.randn(8192, 128, generator=gen)
    us = _median_us(lambda: quantize_fp8(x))
    moved = x.numel() * 4 + x.numel() + x.shape[0] * 4
    rows.append(harness.record("quantize_fp8", {"T": 8192, "D": 128}, us, moved / copy_bytes_per_us, tbs=moved / us / 1e6))

    q = torch.randn(512, 64, 128, generator=gen).bfloat16()
    positions = torch.arange(512)
    cos_sin = torch.randn(512, 64, generator=gen)
    weights = torch.randn(512, 64, generator=gen)
    us = _median_us(lambda: rope_quant_q(q, positions, cos_sin, weights, 128**-0.5, 64**-0.5))
    moved = q.numel() * 3 + weights.numel() * 8
    rows.append(harness.record("rope_quant_q", {"T": 512, "H": 64, "D": 128}, us, moved / copy_bytes_per_us,
                               tbs=moved / us / 1e6))

    q8, _, w8 = rope_quant_q(q[:128], positions[:128], cos_sin, weights[:128], 128**-0.5, 64**-0.5)
    k8, k_scale = quantize_fp8(torch.randn(2048, 128, generator=gen))
    ks = torch.zeros(128, dtype=torch.int32)
    ke = torch.arange(1920, 2048, dtype=torch.int32)
    pairs = int((ke - ks).sum())
    us = _median_us(lambda: mqa_logits(q8, None, k8, k_scale.squeeze(1), w8, ks, ke))
    flops = 2 * 64 * 128 * pairs
    rows.append(harness.record("mqa_logits", {"S": 128, "SKV": 2048, "causal": False, "fmt": "fp8"}, us,
                               flops / flops_per_us, tflops=flops / us / 1e6))

    cache = IndexerKCache(4 * 32, block_size=64)
    cache.insert(torch.randn(4 * 2048, 128, generator=gen), torch.arange(4 * 2048))
    table = torch.randperm(128, generator=gen).to(torch.int32).view(4, 32)
    lens = torch.full((4,), 2048, dtype=torch.int32)
    us = _median_us(lambda: paged_mqa_logits(q8[:4].view(4, 1, 64, 128), None, cache, w8[:4], lens, table, 2048))
    moved = 4 * 2048 * 132 + 4 * 2048 * 4
    rows.append(harness.record("paged_mqa_logits", {"B": 4, "L": 2048, "next_n": 1, "fmt": "fp8"}, us,
                               moved / copy_bytes_per_us, tbs=moved / us / 1e6))

    logits = torch.randn(16, 16384, generator=gen)
    us = _median_us(lambda: topk(logits, 512))
    torch_us = _median_us(lambda: torch.topk(logits, 512, dim=1))
    moved = logits.numel() * 4
    rows.append(harness.record("topk", {"rows": 16, "L": 16384, "k": 512, "data": "random"}, us,
                               moved / copy_bytes_per_us, tbs=moved / us / 1e6, baselines={"torch.topk": torch_us}))
    return rows
