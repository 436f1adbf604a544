"""Logits benchmarks: decode ``paged_mqa_logits`` and prefill ``mqa_logits``, FP8 and MXFP4.

Shapes: H=64 heads, D=128, 64-token pages.
- Decode: B in {32, 128} x L in {32K, 128K} x next_n in {1, 2}, plus B=1, L=128K; every request at length L
  with ``context_lens [B, next_n] = [L - 1, L]`` (next_n = 2) or ``[L]``, pages randomly permuted in one
  pool, ``clean=True``. The timed call is the one the library makes (the Triton backend's per-call choice of
  the Gluon or the Triton kernel, recorded as ``kernel`` with its ``config``). Floor: the larger of two
  bounds (``decode_floor``; the row records both and which one binds, ``bound``): the cache bytes read
  (132 B/key FP8, 68 B/key MXFP4, per request) plus the fp32 logits written, at the read bandwidth
  measured in the same run; and the tensor work, 2·H·D flops per (row, key), at the FP8 matmul rate
  measured in the same run (Hopper has no FP4 tensor cores: MXFP4 keys are expanded to e4m3, so the MMA
  work is FP8's, and at next_n = 2 it exceeds the byte time for MXFP4). Times are cold-L2 medians of CUDA
  graph replays (an engine replays decode as a graph): ``us`` cycles through sets of pages, queries and
  outputs whose other sets exceed three L2s (DESIGN.md §12: rotating buffers; ``harness.rotating_graph_us``);
  ``memset_us`` replays after a 256 MB memset, as the anchors' ``do_bench`` does (an L2 full of dirty
  lines, whose write-back the kernel pays: 1-7 µs at B <= 32, benchmarks/devlog/logits.md), with its own %
  (``memset_pct_of_floor``): compare with the anchors' table by ``memset_us``. The eager ``do_bench``
  median (memset, host launch included) is recorded beside them (``eager_us``).
- Prefill: S=2048 queries over SKV in {8K, 32K, 64K} with ks=0, ke=i+SKV-S+1, and a causal 8K prompt
  (ks=0, ke=i+1), ``clean=False``. Floor: 2*H*D flops per valid (query, key) pair at the FP8 matmul rate
  measured in the same run. Timed like decode (graph replays after an L2 flush; eager median beside it).

Before timing, each shape is checked on a subset in two tiers (DESIGN.md §11): against the PyTorch
reference on the same quantised inputs (calc_diff < 5e-6, ``-inf`` masks equal; a miss stops the suite) and
against the unquantised fp32 math (< 1e-3 FP8, < 2e-2 MXFP4; recorded with its verdict, as it measures the
format rather than the kernel). Prefill checks 128 query rows in both tiers. Decode checks the rows of the
first and last request, whose keys are randn quantised by the cache's insert (the rest of the pool is
random bytes); the truth tier takes them over as many draws of fresh queries and weights through the same
call as give ``TRUTH_ROWS`` rows, in one calc_diff (``truth_rows``): one row's calc_diff scatters with its
weights (FP8 on randn data: median 8e-4, 17-21 % of rows above 1e-3; 32 rows: at most 8.0e-4 in 128
samples), and DeepGEMM's test likewise takes one calc_diff over a batch of 64-128 requests. The baseline
``torch`` is that reference (dequantise, matmul, relu, weighted head sum; chunked to bound memory).

``benchmarks/sweeps/logits_decode.py`` times launch variants of the decode kernels on a few shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from dsa_indexer.cache import IndexerKCache
from dsa_indexer.formats import quantize_fp8, quantize_mxfp4
from dsa_indexer.ops.logits import reference
from dsa_indexer.ops.logits import triton as kernels
from dsa_indexer.testing import calc_diff

from . import harness

HEADS, DIM, PAGE = 64, 128, 64
DECODE_SHAPES = [(1, 131072, 1), (1, 131072, 2)] + [
    (b, length, n) for b in (32, 128) for length in (32768, 131072) for n in (1, 2)
]
PREFILL_SHAPES = [(2048, 8192, False), (2048, 32768, False), (2048, 65536, False), (8192, 8192, True)]
TRUTH_BOUND = {"fp8": 1e-3, "mxfp4": 2e-2}
REFERENCE_BOUND = 5e-6
TRUTH_ROWS = 32


def _quantize_q(q: torch.Tensor, weights: torch.Tensor, fmt: str):
    if fmt == "fp8":
        values, scales = quantize_fp8(q, block_size=DIM, amax_floor=1e-10)
        return values, None, weights * scales[..., 0].reshape(weights.shape)
    packed, scales = quantize_mxfp4(q)
    return packed, scales, weights


def _relu_head_sum(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 ``sum_h w[r, h] relu(q[r, h] . k[n])`` for q ``[R, H, D]``, k ``[N, D]``, w ``[R, H]`` -> ``[R, N]``."""
    rows = []
    for start in range(0, q.shape[0], 8):
        scores = torch.einsum("rhd,nd->rhn", q[start : start + 8], k).relu_()
        rows.append(torch.einsum("rhn,rh->rn", scores, w[start : start + 8]))
    return torch.cat(rows)


def _check(result: torch.Tensor, truth: torch.Tensor, expected: torch.Tensor, fmt: str, what: str) -> dict:
    """Both tiers; a kernel that misses the reference tier is not timed. The truth tier measures the
    format's quantisation error on these random inputs and is recorded with its verdict. ``expected`` (the
    reference) covers the first ``expected.shape[0]`` rows of ``result``, ``truth`` all of them."""
    truth_diff = calc_diff(result, truth)
    reference_diff = calc_diff(result[: expected.shape[0]], expected)
    if not reference_diff < REFERENCE_BOUND:
        raise AssertionError(f"{what}: calc_diff {reference_diff:.2e} vs the reference (bound {REFERENCE_BOUND})")
    return {
        "calc_diff_truth": float(f"{truth_diff:.3g}"),
        "truth_tier_ok": truth_diff < TRUTH_BOUND[fmt],
        "truth_rows": result.shape[0],
        "calc_diff_reference": float(f"{reference_diff:.3g}"),
    }


def _decode_pool(fmt: str, num_pages: int) -> IndexerKCache:
    """A cache of random but finite keys (no e4m3 NaN bytes, positive scales)."""
    cache = IndexerKCache(num_pages, block_size=PAGE, head_dim=DIM, fmt=fmt, device="cuda")
    values, scales = cache.values_view(), cache.scales_view()
    for start in range(0, num_pages, 16384):
        chunk = slice(start, start + 16384)
        if fmt == "fp8":
            raw = torch.randint(0, 254, values[chunk].shape, dtype=torch.uint8, device="cuda")
            values[chunk] = raw + (raw >= 0x7F).to(torch.uint8)
            scale = torch.rand(scales[chunk].shape[:2], device="cuda") * 1e-2 + 1e-3
            scales[chunk] = scale.view(torch.uint8).view(scales[chunk].shape)
        else:
            values[chunk] = torch.randint(0, 256, values[chunk].shape, dtype=torch.uint8, device="cuda")
            scales[chunk] = torch.randint(125, 130, scales[chunk].shape, dtype=torch.uint8, device="cuda")
    return cache


def _decode_inputs(cache: IndexerKCache, batch: int, length: int, next_n: int, gen: torch.Generator):
    """One decode call over ``batch`` requests of ``length`` positions on random pages of the pool:
    (queries ``[B, next_n, H, D]`` and weights ``[B * next_n, H]`` unquantised, the call's arguments)."""
    pages = length // PAGE
    table = torch.randperm(cache.num_blocks, generator=gen)[: batch * pages].view(batch, pages).int().cuda()
    lens = torch.tensor([length - next_n + 1 + t for t in range(next_n)], dtype=torch.int32)
    context_lens = lens.repeat(batch, 1).cuda()
    q = torch.randn(batch, next_n, HEADS, DIM, generator=gen).cuda()
    weights = torch.randn(batch * next_n, HEADS, generator=gen).cuda()
    q_stored, q_scale, w = _quantize_q(q, weights, cache.fmt)
    return q, weights, (q_stored, q_scale, cache, w, context_lens, table, length)


def _decode_case(cache: IndexerKCache, batch: int, length: int, next_n: int, gen: torch.Generator):
    q, weights, args = _decode_inputs(cache, batch, length, next_n, gen)
    table = args[5]
    # Real keys for the checked requests (first and last), inserted over the random pool bytes.
    checked = sorted({0, batch - 1})
    keys = torch.randn(len(checked), length, DIM, generator=gen).cuda()
    positions = torch.arange(length, device="cuda")
    for i, b in enumerate(checked):
        slots = table[b, positions // PAGE].long() * PAGE + positions % PAGE
        cache.insert(keys[i], slots, backend="reference")
    return q, weights, keys, checked, args


def _decode_check(args, q, weights, keys, checked, next_n, gen, decode=kernels.paged_mqa_logits_triton):
    """Both tiers for ``decode`` (a function of the decode arguments, ``clean`` and ``out``) on the rows of the
    ``checked`` requests (keys ``keys [len(checked), L, D]``, unquantised): the timed queries ``q
    [B, next_n, H, D]`` and ``weights [B * next_n, H]`` first, then fresh draws of both from ``gen`` through
    the same call until ``TRUTH_ROWS`` rows are gathered for the truth tier (one calc_diff over all of them;
    the reference tier checks the timed draw)."""
    q_stored, q_scale, cache, w, context_lens, table, length = args
    fmt, device = cache.fmt, q_stored.device
    rows = torch.tensor([b * next_n + t for b in checked for t in range(next_n)], device=device)
    idx = torch.tensor(checked, device=device)
    valid = torch.arange(length, device=device) < context_lens[idx].reshape(-1, 1)
    out = torch.empty((q_stored.shape[0] * next_n, length), device=device)
    expected = reference.paged_mqa_logits(
        q_stored[idx], None if q_scale is None else q_scale[idx], cache, w[rows], context_lens[idx], table[idx],
        length, True, torch.empty((len(rows), length), device=device))
    results, truths = [], []
    for draw in range(-(-TRUTH_ROWS // len(rows))):
        if draw:
            q = torch.randn(q.shape, generator=gen).to(device)
            weights = torch.randn(weights.shape, generator=gen).to(device)
            q_stored, q_scale, w = _quantize_q(q, weights, fmt)
        decode(q_stored, q_scale, cache, w, context_lens, table, length, True, out)
        results.append(out[rows])
        truth = torch.cat([_relu_head_sum(q[b], keys[i], weights[b * next_n : (b + 1) * next_n])
                           for i, b in enumerate(checked)])
        truths.append(torch.where(valid, truth, float("-inf")))
    return _check(torch.cat(results), torch.cat(truths), expected, fmt,
                  f"decode {fmt} {tuple(q_stored.shape[:2])} L={length}")


def decode_floor(fmt: str, batch: int, length: int, next_n: int, ceilings: dict[str, float]) -> dict:
    """The decode floor of every request at length ``length``: ``floor_us`` = max(bytes moved / read
    bandwidth, MMA flops / FP8 matmul rate), both ceilings measured in the same run, with both bounds
    (``byte_floor_us``, ``tensor_floor_us``), which binds (``bound``: "memory" or "tensor") and the bytes
    moved. MXFP4 keys are expanded to e4m3 before the MMA (no FP4 tensor cores on Hopper), so both formats
    do FP8's 2·H·D flops per (row, key)."""
    moved = batch * length * (132 if fmt == "fp8" else 68) + batch * next_n * length * 4
    byte_us = moved / (ceilings["read_tbs"] * 1e6)
    tensor_us = 2 * HEADS * DIM * batch * next_n * length / (ceilings["fp8_tflops"] * 1e6)
    return {"floor_us": max(byte_us, tensor_us), "byte_floor_us": byte_us, "tensor_floor_us": tensor_us,
            "bound": "memory" if byte_us >= tensor_us else "tensor", "moved": moved}


def _dispatched_decode(args) -> tuple[str, dict]:
    """The kernel the library runs for these decode arguments (``"gluon"`` or ``"triton"``) and its
    launch configuration's fields."""
    from dsa_indexer.ops.logits import decode_kernel

    q, cache, length = args[0], args[2], args[6]
    batch, next_n = q.shape[:2]
    kernel = decode_kernel(q, cache, length)
    if kernel == "triton":
        return kernel, dataclasses.asdict(kernels.decode_config(cache.fmt))
    from dsa_indexer.ops.common.runtime import sm_count
    from dsa_indexer.ops.logits.gluon_decode import gluon_decode_config
    from dsa_indexer.ops.logits.gluon_decode_mxfp4 import gluon_mxfp4_decode_config

    choose = gluon_decode_config if cache.fmt == "fp8" else gluon_mxfp4_decode_config
    return kernel, dataclasses.asdict(choose(batch, next_n, length, sm_count(q.device)))


def _rotation(args, out: torch.Tensor, count: int) -> list[tuple]:
    """``count`` (arguments, output) sets of one decode shape for ``harness.rotating_graph_us``: the timed
    call's, then calls on fresh random pages of the same pool with their own queries and outputs (their own
    generator, so the suite's other draws do not move)."""
    q_stored, _, cache, _, _, _, length = args
    batch, next_n = q_stored.shape[:2]
    gen = torch.Generator().manual_seed(batch * length + next_n)
    sets = [(args, out)]
    for _ in range(count - 1):
        sets.append((_decode_inputs(cache, batch, length, next_n, gen)[2], torch.empty_like(out)))
    return sets


def _decode_rows(fmt: str, ceilings: dict[str, float], gen: torch.Generator) -> list[dict]:
    from dsa_indexer.ops.logits import paged_mqa_logits_triton_dispatch as dispatched  # the triton backend's call

    cache = _decode_pool(fmt, max(b * length for b, length, _ in DECODE_SHAPES) // PAGE + 64)
    rows = []
    for batch, length, next_n in DECODE_SHAPES:
        q, weights, keys, checked, args = _decode_case(cache, batch, length, next_n, gen)
        checks = _decode_check(args, q, weights, keys, checked, next_n, gen, dispatched)
        del q, weights, keys
        out = torch.empty((batch * next_n, length), device="cuda")
        floor = decode_floor(fmt, batch, length, next_n, ceilings)
        rotation = _rotation(args, out, harness.rotation_count(floor["moved"]))
        us = harness.rotating_graph_us([functools.partial(dispatched, *a, True, o) for a, o in rotation])
        memset_us = harness.cold_graph_us(lambda: dispatched(*args, True, out))
        eager_us = harness.median_us(lambda: dispatched(*args, True, out))
        triton_us = harness.rotating_graph_us(
            [functools.partial(kernels.paged_mqa_logits_triton, *a, True, o) for a, o in rotation])
        del rotation
        torch_us = harness.median_us(lambda: reference.paged_mqa_logits(*args, True, out), warmup_ms=1, rep_ms=50)
        kernel, config = _dispatched_decode(args)
        rows.append(harness.record(
            "paged_mqa_logits", {"B": batch, "L": length, "next_n": next_n, "fmt": fmt}, us,
            floor["floor_us"], tbs=floor["moved"] / us / 1e6,
            tflops=2 * HEADS * DIM * batch * next_n * length / us / 1e6,
            baselines={"torch": torch_us, "triton_kernel": triton_us}, memset_us=round(memset_us, 2),
            memset_pct_of_floor=round(100 * floor["floor_us"] / memset_us, 1), eager_us=round(eager_us, 2),
            bound=floor["bound"], byte_floor_us=round(floor["byte_floor_us"], 2),
            tensor_floor_us=round(floor["tensor_floor_us"], 2), kernel=kernel, config=config, **checks,
        ))
    del cache
    torch.cuda.empty_cache()
    return rows


def _prefill_case(fmt: str, num_rows: int, num_keys: int, causal: bool, gen: torch.Generator):
    q = torch.randn(num_rows, HEADS, DIM, generator=gen).cuda()
    k = torch.randn(num_keys, DIM, generator=gen).cuda()
    weights = torch.randn(num_rows, HEADS, generator=gen).cuda()
    q_stored, q_scale, w = _quantize_q(q, weights, fmt)
    if fmt == "fp8":
        k_values, k_scales = quantize_fp8(k, block_size=DIM)
        k_scales = k_scales[:, 0]
    else:
        k_values, k_scales = quantize_mxfp4(k)
    offset = 0 if causal else num_keys - num_rows
    ke = torch.arange(1, num_rows + 1, dtype=torch.int32, device="cuda") + offset
    ks = torch.zeros_like(ke)
    return q, weights, k, (q_stored, q_scale, k_values, k_scales, w, ks, ke)


def _prefill_check(args, q, weights, k, fmt):
    q_stored, q_scale, k_values, k_scales, w, ks, ke = args
    num_rows, num_keys = q_stored.shape[0], k_values.shape[0]
    out = torch.empty((num_rows, num_keys), device="cuda")
    kernels.mqa_logits_triton(*args, True, out)
    idx = torch.cat([torch.arange(64), torch.arange(num_rows - 64, num_rows)]).cuda()
    sub_args = (q_stored[idx], None if q_scale is None else q_scale[idx], k_values, k_scales, w[idx], ks[idx], ke[idx])
    expected = reference.mqa_logits(*sub_args, True, torch.empty((len(idx), num_keys), device="cuda"))
    columns = torch.arange(num_keys, device="cuda")
    valid = (columns >= ks[idx, None]) & (columns < ke[idx, None])
    truth = torch.where(valid, _relu_head_sum(q[idx], k, weights[idx]), float("-inf"))
    return _check(out[idx], truth, expected, fmt, f"prefill {fmt} S={num_rows} SKV={num_keys}")


def _prefill_rows(fmt: str, ceilings: dict[str, float], gen: torch.Generator) -> list[dict]:
    rows = []
    for num_rows, num_keys, causal in PREFILL_SHAPES:
        q, weights, k, args = _prefill_case(fmt, num_rows, num_keys, causal, gen)
        checks = _prefill_check(args, q, weights, k, fmt)
        del q, weights, k
        out = torch.empty((num_rows, num_keys), device="cuda")
        us = harness.cold_graph_us(lambda: kernels.mqa_logits_triton(*args, False, out), reps=20)
        eager_us = harness.median_us(lambda: kernels.mqa_logits_triton(*args, False, out))
        torch_us = harness.median_us(lambda: reference.mqa_logits(*args, False, out), warmup_ms=1, rep_ms=50)
        pairs = int((args[6] - args[5]).sum())
        flops = 2 * HEADS * DIM * pairs
        rows.append(harness.record(
            "mqa_logits", {"S": num_rows, "SKV": num_keys, "causal": causal, "fmt": fmt}, us,
            flops / (ceilings["fp8_tflops"] * 1e6), tflops=flops / us / 1e6, baselines={"torch": torch_us},
            eager_us=round(eager_us, 2), config=dataclasses.asdict(kernels.prefill_config()), **checks,
        ))
    return rows


def run(ceilings: dict[str, float]) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for fmt in ("fp8", "mxfp4"):
        rows += _decode_rows(fmt, ceilings, gen)
    for fmt in ("fp8", "mxfp4"):
        rows += _prefill_rows(fmt, ceilings, gen)
    return rows
