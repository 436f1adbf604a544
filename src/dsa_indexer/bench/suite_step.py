"""The decode indexer step end to end: paged logits, then top-k (B=32, L=128K, next_n=2).

One CUDA graph holds both launches as an engine replays them (value checks skipped during capture),
timed after a 256 MB memset that evicts the L2, median of 100 replays; each op's own graph is timed
the same way beside it. Every shape runs with fp32 logits and with bf16 logits (half the bytes the top-k
reads; the picks are those of the bf16 values). Lengths are ``L - next_n + 1 + t`` for draft row ``t`` (every request at the
full context), keys are random bytes of the format (finite), queries and weights Gaussian, so the
logits are the indexer's ReLU-weighted sums. Floor: the cache bytes, the logits written once and
read once (4 or 2 bytes each), at the measured read bandwidth. Before timing, the picks are checked bitwise
against the reference top-k of the kernel's own logits.
"""

from __future__ import annotations

import torch

import dsa_indexer as dsa

from ..formats import mxfp4_scale_bytes
from . import harness

PAGE, HEADS, DIM = 64, 64, 128
SHAPES = [(32, 131072, 2, 2048, "fp8"), (32, 131072, 2, 2048, "mxfp4"), (32, 131072, 1, 2048, "fp8")]
BYTES_PER_KEY = {"fp8": 132, "mxfp4": 68}
LOGITS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def decode_inputs(batch: int, length: int, next_n: int, fmt: str, gen: torch.Generator, heads: int = HEADS):
    """(q, q_scale, cache, weights, context_lens, block_table) of a decode step on the GPU: ``batch`` requests at
    the full context ``length`` (row ``t`` sees ``length - next_n + 1 + t`` positions) on randomly permuted
    64-token pages, keys random finite bytes of ``fmt``, queries (``heads`` x 128, quantised) and weights
    Gaussian from ``gen``."""
    pages = length // PAGE
    cache = dsa.IndexerKCache(batch * pages, block_size=PAGE, head_dim=DIM, fmt=fmt, device="cuda")
    values, scales = cache.values_view(), cache.scales_view()
    raw = torch.randint(0, 254, values.shape, dtype=torch.uint8, device="cuda")
    if fmt == "fp8":
        values.copy_(raw + (raw >= 0x7F).to(torch.uint8))
        scale = torch.rand(scales.shape[:2], device="cuda") * 1e-2 + 1e-3
        scales.copy_(scale.view(torch.uint8).view(scales.shape))
    else:
        values.copy_(raw)
        scales.copy_(torch.randint(125, 130, scales.shape, dtype=torch.uint8, device="cuda"))
    del raw
    table = torch.randperm(batch * pages, generator=gen).view(batch, pages).int().cuda()
    lens = torch.tensor([length - next_n + 1 + t for t in range(next_n)], dtype=torch.int32).repeat(batch, 1).cuda()
    q = torch.randn(batch * next_n, heads, DIM, generator=gen).cuda()
    weights = torch.randn(batch * next_n, heads, generator=gen).cuda()
    if fmt == "fp8":
        q_stored, q_scale = dsa.quantize_fp8(q.view(-1, DIM), scale_fmt="ue8m0")
        weights = weights * q_scale.view(batch * next_n, heads)
        q_stored, q_scale = q_stored.view(batch, next_n, heads, DIM), None
    else:
        q_stored, q_scale = dsa.quantize_mxfp4(q.view(-1, DIM))
        q_stored = q_stored.view(batch, next_n, heads, DIM // 2)
        q_scale = q_scale.view(batch, next_n, heads, mxfp4_scale_bytes(DIM))
    return q_stored, q_scale, cache, weights.contiguous(), lens, table


def run(ceilings: dict[str, float]) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch, length, next_n, k, fmt in SHAPES:
        q, q_scale, cache, weights, lens, table = decode_inputs(batch, length, next_n, fmt, gen)
        for name, dtype in LOGITS_DTYPES.items():
            rows.append(_step_row(q, q_scale, cache, weights, lens, table, batch, length, next_n, k, fmt, name, dtype,
                                  ceilings))
        del cache, q, q_scale, weights
        torch.cuda.empty_cache()
    return rows


def _step_row(q, q_scale, cache, weights, lens, table, batch, length, next_n, k, fmt, name, dtype, ceilings) -> dict:
    logits = torch.empty(batch * next_n, length, dtype=dtype, device="cuda")
    picks = torch.empty(batch * next_n, k, dtype=torch.int32, device="cuda")

    def logits_step():
        dsa.paged_mqa_logits(q, q_scale, cache, weights, lens, table, length, out=logits, logits_dtype=dtype)

    def topk_step():
        dsa.topk_decode(logits, lens, next_n, k, out=picks)

    def step():
        logits_step()
        topk_step()

    step()
    expected = dsa.topk_decode(logits, lens, next_n, k, backend="reference")
    if not torch.equal(picks, expected):
        raise AssertionError(f"decode step {fmt} {name} B={batch} L={length} next_n={next_n}: top-k differs from the "
                             "reference")
    step_us = harness.cold_graph_us(step)
    logits_us = harness.cold_graph_us(logits_step)
    topk_us = harness.cold_graph_us(topk_step)
    valid = int(lens.sum())
    moved = batch * length * BYTES_PER_KEY[fmt] + batch * next_n * length * logits.element_size() + valid * 4
    return harness.record(
        "decode_step", {"B": batch, "L": length, "next_n": next_n, "k": k, "fmt": fmt, "logits": name}, step_us,
        moved / (ceilings["read_tbs"] * 1e6), tbs=moved / step_us / 1e6,
        logits_us=round(logits_us, 2), topk_us=round(topk_us, 2),
    )
