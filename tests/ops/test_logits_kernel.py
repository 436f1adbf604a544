"""Triton logits kernels (``ops/logits/triton.py``) against the PyTorch reference on the same inputs.

Tier (DESIGN.md §11): ``calc_diff < 5e-6`` against the reference on the same quantised inputs, with the
``-inf`` masks equal exactly (``dsa_indexer.testing.calc_diff`` asserts that). Outputs are poisoned and
written through padded row strides: the padding must keep its poison, and with ``clean=False`` the
kernels write the valid ranges only. The paged cache lives inside a larger allocation poisoned with
0xFF bytes (e4m3 NaN, an infinite MXFP4 scale), so a read of any byte the kernel should not use shows up.
Interpreter shapes are tiny; ``gpu`` tests use realistic ones and check 20 reruns for identical bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from ragged_ranges import causal_ranges, varied_ranges

from dsa_indexer.backend import ENV_VAR
from dsa_indexer.cache import IndexerKCache, bytes_per_token
from dsa_indexer.formats import quantize_fp8, quantize_mxfp4
from dsa_indexer.ops.logits import mqa_logits, paged_mqa_logits
from dsa_indexer.testing import calc_diff

NEG_INF = float("-inf")
POISON = -777.0
POISON_BYTE = 0xFF
TIER = 5e-6
FORMATS = ("fp8", "mxfp4")
FORCE_UPCAST_ENV = "DSA_INDEXER_FORCE_UPCAST"


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv(FORCE_UPCAST_ENV, raising=False)


def quantized_queries(q: torch.Tensor, weights: torch.Tensor, fmt: str):
    """fp32 ``q [..., H, D]`` -> (stored q, q_scale | None, weights with the FP8 Q scale folded in)."""
    if fmt == "fp8":
        values, scales = quantize_fp8(q, block_size=q.shape[-1], amax_floor=1e-10)
        return values, None, weights * scales[..., 0].reshape(weights.shape)
    packed, scales = quantize_mxfp4(q)
    return packed, scales, weights


@dataclass
class PrefillInputs:
    q: torch.Tensor
    q_scale: torch.Tensor | None
    k: torch.Tensor
    k_scale: torch.Tensor
    weights: torch.Tensor
    ks: torch.Tensor
    ke: torch.Tensor

    def args(self):
        return (self.q, self.q_scale, self.k, self.k_scale, self.weights, self.ks, self.ke)


def prefill_inputs(fmt, ranges, num_keys, heads, dim, device, seed=0) -> PrefillInputs:
    gen = torch.Generator().manual_seed(seed)
    num_rows = len(ranges)
    q = torch.randn(num_rows, heads, dim, generator=gen)
    k = torch.randn(num_keys, dim, generator=gen)
    weights = torch.randn(num_rows, heads, generator=gen)
    q_stored, q_scale, weights_out = quantized_queries(q, weights, fmt)
    if fmt == "fp8":
        k_values, k_scales = quantize_fp8(k, block_size=dim)
        k_scales = k_scales[:, 0]
    else:
        k_values, k_scales = quantize_mxfp4(k)
    ks = torch.tensor([start for start, _ in ranges], dtype=torch.int32).reshape(num_rows)
    ke = torch.tensor([end for _, end in ranges], dtype=torch.int32).reshape(num_rows)
    moved = [None if t is None else t.to(device) for t in (q_stored, q_scale, k_values, k_scales, weights_out, ks, ke)]
    return PrefillInputs(*moved)


def run_prefill(inputs: PrefillInputs, backend: str, clean: bool, pad: int) -> torch.Tensor:
    """The op into a poisoned ``[M, N + pad]`` allocation through an ``[M, N]`` view; returns the allocation."""
    num_rows, num_keys = inputs.q.shape[0], inputs.k.shape[0]
    storage = torch.full((num_rows, num_keys + pad), POISON, device=inputs.q.device)
    out = storage[:, :num_keys]
    result = mqa_logits(*inputs.args(), clean=clean, out=out, backend=backend)
    assert result.data_ptr() == out.data_ptr() and result.stride() == out.stride()
    return storage


def check_against_reference(triton_storage, reference_storage, width: int, clean: bool) -> None:
    """Tier check of the ``[:, :width]`` region, padding untouched, and with ``clean=False`` nothing
    written outside the valid entries (the reference marks them ``-inf``)."""
    assert (triton_storage[:, width:] == POISON).all(), "padded row stride was written"
    result, expected = triton_storage[:, :width], reference_storage[:, :width]
    if clean:
        assert calc_diff(result, expected) < TIER
        return
    valid = expected != NEG_INF
    assert calc_diff(result[valid], expected[valid]) < TIER
    assert (result[~valid] == POISON).all(), "clean=False wrote outside the valid ranges"


def check_prefill(inputs: PrefillInputs, clean: bool, pad: int = 5) -> torch.Tensor:
    expected = run_prefill(inputs, "reference", True, pad)
    result = run_prefill(inputs, "triton", clean, pad)
    check_against_reference(result, expected, inputs.k.shape[0], clean)
    return result


@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_kernel_matches_reference_on_ragged_rows(kernel_device, fmt, clean):
    inputs = prefill_inputs(fmt, varied_ranges(37, 70, seed=1), 70, 3, 128, kernel_device, seed=2)
    check_prefill(inputs, clean)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_kernel_causal_small_head_dim(kernel_device, fmt):
    inputs = prefill_inputs(fmt, causal_ranges(20, 45), 45, 2, 64, kernel_device, seed=3)
    check_prefill(inputs, clean=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_kernel_upcast_path(kernel_device, fmt, monkeypatch):
    monkeypatch.setenv(FORCE_UPCAST_ENV, "1")
    inputs = prefill_inputs(fmt, varied_ranges(19, 40, seed=4), 40, 2, 128, kernel_device, seed=5)
    check_prefill(inputs, clean=True)
    check_prefill(inputs, clean=False)


def test_prefill_kernel_int64_ranges_and_strided_inputs(kernel_device):
    inputs = prefill_inputs("fp8", causal_ranges(9, 33), 33, 4, 64, kernel_device, seed=6)
    expected = run_prefill(inputs, "reference", True, 0)
    q_strided = torch.empty((9, 8, 64), dtype=inputs.q.dtype, device=kernel_device)[:, ::2]
    q_strided.copy_(inputs.q)
    w_strided = torch.empty((4, 9), device=kernel_device).t()
    w_strided.copy_(inputs.weights)
    strided = PrefillInputs(q_strided, None, inputs.k, inputs.k_scale, w_strided, inputs.ks.long(), inputs.ke.long())
    check_against_reference(run_prefill(strided, "triton", True, 0), expected, 33, True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_kernel_zero_rows_or_keys(kernel_device, fmt):
    no_rows = prefill_inputs(fmt, [], 12, 2, 64, kernel_device)
    assert mqa_logits(*no_rows.args(), backend="triton").shape == (0, 12)
    no_keys = prefill_inputs(fmt, [(0, 0)] * 3, 0, 2, 64, kernel_device)
    assert mqa_logits(*no_keys.args(), backend="triton").shape == (3, 0)


@dataclass
class DecodeInputs:
    q: torch.Tensor
    q_scale: torch.Tensor | None
    cache: IndexerKCache
    weights: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    max_context_len: int

    def args(self):
        return (self.q, self.q_scale, self.cache, self.weights, self.context_lens, self.block_table,
                self.max_context_len)


def row_lengths(lengths: list, next_n: int) -> list[list[int]]:
    if lengths and isinstance(lengths[0], list):
        return lengths
    return [[max(length - next_n + t + 1, 0) for t in range(next_n)] for length in lengths]


def decode_inputs(fmt, lengths: list, next_n: int, device, *, heads=4, dim=128, block_size=16, extra_width=3,
                  page_padding=40, spare_pages=3, first_page=0, seed=0, scale_fmt=None) -> DecodeInputs:
    """Requests of the given lengths (1-D: request lengths; 2-D: per-row lengths) whose pages sit,
    randomly permuted, in a cache inside a 0xFF-poisoned allocation with a padded page stride; table
    entries past each request's pages are garbage (-1 and huge ids). Pages below ``first_page`` are
    never used (large byte offsets)."""
    gen = torch.Generator().manual_seed(seed)
    extents = [max(row, default=0) for row in row_lengths(lengths, next_n)]
    pages_needed = [math.ceil(extent / block_size) for extent in extents]
    num_blocks = first_page + sum(pages_needed) + spare_pages
    token_bytes = bytes_per_token(fmt, dim)
    page_stride = block_size * token_bytes + page_padding
    storage = torch.full((num_blocks * page_stride + 24,), POISON_BYTE, dtype=torch.uint8, device=device)
    buffer = torch.as_strided(storage, (num_blocks, block_size, token_bytes), (page_stride, token_bytes, 1), 24)
    cache = IndexerKCache(num_blocks, block_size=block_size, head_dim=dim, fmt=fmt, scale_fmt=scale_fmt, buffer=buffer)

    batch = len(lengths)
    max_blocks = max(pages_needed, default=0) + 2
    block_table = torch.empty((batch, max_blocks), dtype=torch.int32)
    block_table[:, 0::2] = -1
    block_table[:, 1::2] = 10**6
    order = (first_page + torch.randperm(num_blocks - first_page, generator=gen)).tolist()
    slots = []
    for request, count in enumerate(pages_needed):
        block_table[request, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
        slots += [int(block_table[request, p // block_size]) * block_size + p % block_size
                  for p in range(extents[request])]
    keys = torch.randn(len(slots), dim, generator=gen)
    cache.insert(keys.to(device), torch.tensor(slots, dtype=torch.int64, device=device), backend="reference")

    q = torch.randn(batch, next_n, heads, dim, generator=gen)
    weights = torch.randn(batch * next_n, heads, generator=gen)
    q_stored, q_scale, weights_out = quantized_queries(q, weights, fmt)
    return DecodeInputs(
        q_stored.to(device),
        None if q_scale is None else q_scale.to(device),
        cache,
        weights_out.to(device),
        torch.tensor(lengths, dtype=torch.int32, device=device),
        block_table.to(device),
        max(extents, default=0) + extra_width,
    )


def run_decode(inputs: DecodeInputs, backend: str, clean: bool, pad: int) -> torch.Tensor:
    rows = inputs.q.shape[0] * inputs.q.shape[1]
    storage = torch.full((rows, inputs.max_context_len + pad), POISON, device=inputs.q.device)
    out = storage[:, : inputs.max_context_len]
    result = paged_mqa_logits(*inputs.args(), clean=clean, out=out, backend=backend)
    assert result.data_ptr() == out.data_ptr() and result.stride() == out.stride()
    return storage


def check_decode(inputs: DecodeInputs, clean: bool, pad: int = 4) -> torch.Tensor:
    expected = run_decode(inputs, "reference", True, pad)
    result = run_decode(inputs, "triton", clean, pad)
    check_against_reference(result, expected, inputs.max_context_len, clean)
    return result


DECODE_LENGTHS = {
    # 1-D request lengths (row t sees L - next_n + t + 1) and 2-D per-row lengths.
    (1, "1d"): [5, 40, 0, 33, 16],
    (2, "1d"): [1, 37, 0, 17],
    (2, "2d"): [[3, 4], [20, 21], [0, 0], [17, 9], [0, 32]],
    (4, "1d"): [2, 50, 31],
    (4, "2d"): [[1, 0, 7, 3], [16, 16, 16, 16], [33, 32, 31, 30]],
    (5, "1d"): [3, 29],
    (5, "2d"): [[9, 0, 4, 16, 1], [0, 0, 0, 0, 17]],
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("next_n, lens", sorted(DECODE_LENGTHS))
def test_decode_kernel_matches_reference(kernel_device, fmt, next_n, lens):
    inputs = decode_inputs(fmt, DECODE_LENGTHS[next_n, lens], next_n, kernel_device, seed=next_n)
    check_decode(inputs, clean=True)
    check_decode(inputs, clean=False)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_kernel_odd_heads_small_dim_and_page_size(kernel_device, fmt):
    inputs = decode_inputs(fmt, [13, 0, 40], 2, kernel_device, heads=3, dim=64, block_size=8, seed=7)
    check_decode(inputs, clean=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_kernel_upcast_path(kernel_device, fmt, monkeypatch):
    monkeypatch.setenv(FORCE_UPCAST_ENV, "1")
    inputs = decode_inputs(fmt, [[7, 26], [0, 19]], 2, kernel_device, seed=8)
    check_decode(inputs, clean=True)
    check_decode(inputs, clean=False)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_kernel_degenerate_batches(kernel_device, fmt):
    all_empty = decode_inputs(fmt, [0, 0], 2, kernel_device, extra_width=20, seed=9)
    result = run_decode(all_empty, "triton", True, 2)
    assert (result[:, :20] == NEG_INF).all() and (result[:, 20:] == POISON).all()
    assert (run_decode(all_empty, "triton", False, 2) == POISON).all()
    no_requests = decode_inputs(fmt, [], 1, kernel_device, extra_width=5)
    assert paged_mqa_logits(*no_requests.args(), backend="triton").shape == (0, 5)
    check_decode(decode_inputs(fmt, [1, 2], 3, kernel_device, extra_width=0, seed=10), clean=True)


@pytest.mark.parametrize("fmt, scale_fmt, heads, dim", [("fp8", "mxfp8", 4, 128), ("fp8", None, 8, 32),
                                                       ("mxfp4", None, 8, 64), ("mxfp4", None, 16, 32)])
def test_kernels_mxfp8_caches_small_heads_and_dims(kernel_device, fmt, scale_fmt, heads, dim):
    check_decode(decode_inputs(fmt, [13, 0, 40], 2, kernel_device, heads=heads, dim=dim, seed=11, scale_fmt=scale_fmt),
                 clean=True)
    if scale_fmt is None:
        check_prefill(prefill_inputs(fmt, varied_ranges(9, 30, seed=12), 30, heads, dim, kernel_device, seed=13),
                      clean=True)


def bf16_variants(inputs, run):
    """``run(inputs)`` with bf16 weights and fp32 logits, and with bf16 weights and bf16 logits."""
    inputs.weights = inputs.weights.bfloat16()
    return run(inputs, torch.float32), run(inputs, torch.bfloat16)


def check_bf16_logits(inputs, call) -> torch.Tensor:
    """bf16 logits of the kernel are its fp32 logits rounded to nearest even, bit for bit (bf16 weights), and
    within the tier of the reference's."""
    fp32, bf16 = bf16_variants(inputs, lambda i, dtype: call(i, "triton", dtype))
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, fp32.bfloat16())
    assert calc_diff(bf16.float(), call(inputs, "reference", torch.bfloat16).float()) < TIER
    return bf16


def prefill_call(inputs, backend, dtype):
    return mqa_logits(*inputs.args(), backend=backend, logits_dtype=dtype)


def decode_call(inputs, backend, dtype):
    return paged_mqa_logits(*inputs.args(), backend=backend, logits_dtype=dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_bf16_logits_and_weights(kernel_device, fmt):
    check_bf16_logits(prefill_inputs(fmt, varied_ranges(11, 33, seed=14), 33, 3, 64, kernel_device, seed=15),
                      prefill_call)
    check_bf16_logits(decode_inputs(fmt, [[3, 30], [0, 19]], 2, kernel_device, seed=16), decode_call)


def unchecked_decode_inputs(fmt, lengths: list[list[int]], device, *, wild_pages=((0, 1, 10**6), (1, 0, -5)),
                            wild_lengths=((0, 1, 10**6),), **kwargs):
    """``(wild, oracle)``: the decode inputs of 2-D ``lengths`` with block-table entries set to page ids
    outside the cache (``wild_pages``: ``(request, column, page)``) and lengths past the width and the
    table (``wild_lengths``: ``(request, row, length)``), and the inputs that describe what an unchecked
    call must compute: every unreadable page id replaced by a page of zero bytes, every length clamped
    to the width and the table's positions (what value checks would have refused)."""
    inputs = decode_inputs(fmt, lengths, len(lengths[0]), device, **kwargs)
    cache, table, lens = inputs.cache, inputs.block_table.clone(), inputs.context_lens.clone()
    for request, column, page in wild_pages:
        table[request, column] = page
    for request, row, length in wild_lengths:
        lens[request, row] = length
    listed = set(table.flatten().tolist())
    zero_page = next(p for p in range(cache.num_blocks) if p not in listed)
    cache.buffer[zero_page] = 0
    readable = (table >= 0) & (table < cache.num_blocks)
    limit = min(inputs.max_context_len, table.shape[1] * cache.block_size)
    oracle = replace(inputs, block_table=torch.where(readable, table, zero_page), context_lens=lens.clamp(max=limit))
    return replace(inputs, block_table=table, context_lens=lens), oracle


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_kernel_with_unchecked_wild_pages_and_lengths(kernel_device, fmt, monkeypatch):
    # Request 0: page 1 is 10**6 and row 1's length passes the width (a 98-wide output) and the table's 5
    # pages (entries past the request's 3 full pages are 10**6 and -1); request 1: page 0 is -5.
    wild, oracle = unchecked_decode_inputs(fmt, [[20, 48], [40, 17]], kernel_device, extra_width=50, seed=11)
    assert wild.max_context_len > wild.block_table.shape[1] * wild.cache.block_size
    expected = run_decode(oracle, "reference", True, 4)
    monkeypatch.setenv("DSA_INDEXER_SKIP_VALUE_CHECKS", "1")
    assert torch.equal(run_decode(wild, "reference", True, 4), expected)
    for clean in (True, False):
        check_against_reference(run_decode(wild, "triton", clean, 4), expected, wild.max_context_len, clean)


# Page ids outside the cache (2**31 - 1: its TMA coordinate would overflow int32 unclamped) and lengths past the
# width and the table; the rows with a wild length fill whole pages (no unwritten, poisoned slot is read).
WILD_PAGES = ((0, 1, 10**6), (1, 0, -5), (2, 2, 2**31 - 1), (3, 7, 10**6))
WILD_LENGTHS = ((0, 1, 10**7), (3, 0, 10**6))
WILD_REQUESTS = [[704, 640], [0, 64], [300, 17], [5120, 4990]]


def check_unchecked_call(fmt: str, run, device, block_size: int, aligned=None) -> None:
    """``run(inputs, clean)`` (a GPU launcher into a poisoned allocation), value checks off, on wild pages and
    lengths: within the tier of the reference on the oracle inputs (wild pages read as zero pages, lengths
    clamped to the width and the table), nothing written outside the valid entries when not clean, and the
    Triton kernel on the same wild inputs within the tier too. ``aligned``: a copy of the inputs on another
    cache (the TMA condition), or None."""
    from dsa_indexer.ops.logits.triton import paged_mqa_logits_triton

    wild, oracle = unchecked_decode_inputs(fmt, WILD_REQUESTS, device, heads=64, block_size=block_size,
                                           extra_width=300, seed=48, wild_pages=WILD_PAGES, wild_lengths=WILD_LENGTHS)
    if aligned is not None:
        wild = aligned(wild)
        oracle = replace(oracle, cache=wild.cache)
    assert wild.max_context_len > wild.block_table.shape[1] * block_size
    width = wild.max_context_len
    expected = run_decode(oracle, "reference", True, 8)[:, :width]
    triton_out = torch.full_like(expected, POISON)
    paged_mqa_logits_triton(*wild.args(), True, triton_out)
    assert calc_diff(triton_out, expected) < TIER
    for clean in (True, False):
        result = run(wild, clean)
        assert (result[:, width:] == POISON).all(), "padded row stride was written"
        got = result[:, :width]
        valid = expected != NEG_INF
        assert calc_diff(got[valid], expected[valid]) < TIER
        assert (got[~valid] == (NEG_INF if clean else POISON)).all()


def assert_reruns_identical(run, first: torch.Tensor, times: int = 20) -> None:
    for _ in range(times):
        assert torch.equal(run().view(torch.int32), first.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [64, 16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_kernel_unchecked_wild_pages_and_lengths_gpu(kernel_device, fmt, block_size, monkeypatch):
    """The Triton decode kernel (forced: Hopper would pick Gluon for some calls) on wild pages and lengths with
    value checks off, at 64 heads and thousands of keys."""
    monkeypatch.setenv("DSA_INDEXER_SKIP_VALUE_CHECKS", "1")
    monkeypatch.setenv("DSA_INDEXER_DECODE_KERNEL", "triton")

    def run(inputs, clean):
        return run_decode(inputs, "triton", clean, 8)

    check_unchecked_call(fmt, run, kernel_device, block_size)


@pytest.mark.gpu
@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_kernel_realistic_sizes_gpu(kernel_device, fmt, clean):
    num_keys = 4100
    ranges = causal_ranges(150, num_keys) + varied_ranges(150, num_keys, seed=11)
    inputs = prefill_inputs(fmt, ranges, num_keys, 64, 128, kernel_device, seed=12)
    first = check_prefill(inputs, clean, pad=16)
    assert_reruns_identical(lambda: run_prefill(inputs, "triton", clean, 16), first)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("next_n, lens", [(1, "1d"), (2, "2d"), (4, "1d")])
def test_decode_kernel_realistic_sizes_gpu(kernel_device, fmt, next_n, lens):
    request_lengths = [0, 1, 63, 64, 65, 4999, 12345]
    lengths = request_lengths if lens == "1d" else [[max(0, n - 7 * t) for t in range(next_n)] for n in request_lengths]
    inputs = decode_inputs(fmt, lengths, next_n, kernel_device, heads=64, block_size=64, seed=13)
    check_decode(inputs, clean=False, pad=8)
    first = check_decode(inputs, clean=True, pad=8)
    assert_reruns_identical(lambda: run_decode(inputs, "triton", True, 8), first)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_upcast_path_realistic_sizes_gpu(kernel_device, fmt, monkeypatch):
    monkeypatch.setenv(FORCE_UPCAST_ENV, "1")
    ranges = varied_ranges(200, 3000, seed=14)
    check_prefill(prefill_inputs(fmt, ranges, 3000, 64, 128, kernel_device, seed=15), clean=True)
    lengths = [[3000, 3001], [0, 77], [640, 64]]
    check_decode(decode_inputs(fmt, lengths, 2, kernel_device, heads=64, block_size=64, seed=16), clean=True)


@pytest.mark.gpu
@pytest.mark.parametrize("next_n", [1, 2, 5])
def test_decode_mxfp4_ptx_expansion_matches_triton_expansion_gpu(kernel_device, next_n):
    """The inline-PTX e2m1 expansion gives the bits of the Triton one: random packed bytes (every
    code, both signs) and block exponents spread over 0..60 (exact, rounded and dropped blocks)."""
    from dsa_indexer.ops.logits.triton import paged_mqa_logits_triton

    inputs = decode_inputs("mxfp4", [0, 1, 65, 700, 3001], next_n, kernel_device, heads=64, block_size=64, seed=21)
    gen = torch.Generator(device=kernel_device).manual_seed(22)
    values, scales = inputs.cache.values_view(), inputs.cache.scales_view()
    values.copy_(torch.randint(0, 256, values.shape, generator=gen, device=kernel_device, dtype=torch.uint8))
    scales.copy_(torch.randint(70, 131, scales.shape, generator=gen, device=kernel_device, dtype=torch.uint8))
    results = []
    for expand_ptx in (True, False):
        out = torch.full((5 * next_n, inputs.max_context_len), POISON, device=kernel_device)
        paged_mqa_logits_triton(*inputs.args(), True, out, expand_ptx=expand_ptx)
        results.append(out)
    assert torch.equal(results[0].view(torch.int32), results[1].view(torch.int32))
    assert calc_diff(results[0], run_decode(inputs, "reference", True, 0)) < TIER


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("next_n", [1, 2, 5])
def test_decode_kernel_shipped_config_gpu(kernel_device, fmt, next_n):
    """The shipped decode launch of each key format (``decode_config``), passed explicitly, matches the reference
    and gives the default call's bits (one and several row groups a request)."""
    from dsa_indexer.ops.logits.triton import decode_config, paged_mqa_logits_triton

    lengths = [[max(0, n - 7 * t) for t in range(next_n)] for n in (0, 1, 63, 64, 65, 4999, 12345)]
    inputs = decode_inputs(fmt, lengths, next_n, kernel_device, heads=64, block_size=64, seed=23)
    outs = []
    for config in (decode_config(fmt), None):
        out = torch.full((7 * next_n, inputs.max_context_len), POISON, device=kernel_device)
        paged_mqa_logits_triton(*inputs.args(), True, out, config=config)
        outs.append(out)
    assert calc_diff(outs[0], run_decode(inputs, "reference", True, 0)) < TIER
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))


@pytest.mark.gpu
def test_decode_kernel_pages_beyond_two_gib_gpu(kernel_device):
    """Pages whose byte offset exceeds 2**31: the page address arithmetic must be 64-bit."""
    page_bytes = 64 * bytes_per_token("fp8", 128) + 40
    first_page = (1 << 31) // page_bytes + 1
    inputs = decode_inputs("fp8", [300, 1000], 2, kernel_device, heads=64, block_size=64, first_page=first_page,
                           spare_pages=0, seed=17)
    check_decode(inputs, clean=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_replay_in_a_cuda_graph_with_changed_lengths_gpu(kernel_device, fmt):
    """The Triton path reads nothing back to the host: captured once, replayed after the lengths (decode)
    and the row ranges (prefill) change in place, it matches the reference on the new values."""
    from dsa_indexer.ops.logits.triton import mqa_logits_triton, paged_mqa_logits_triton

    inputs = decode_inputs(fmt, [[900, 901], [0, 64], [300, 17]], 2, kernel_device, heads=64, block_size=64, seed=18)
    out = torch.full((6, inputs.max_context_len), POISON, device=kernel_device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_mqa_logits_triton(*inputs.args(), True, out)
    inputs.context_lens.copy_(torch.tensor([[5, 640], [63, 0], [300, 299]], dtype=torch.int32))
    graph.replay()
    assert calc_diff(out, run_decode(inputs, "reference", True, 0)) < TIER

    prefill = prefill_inputs(fmt, varied_ranges(70, 500, seed=19), 500, 64, 128, kernel_device, seed=20)
    result = torch.full((70, 500), POISON, device=kernel_device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mqa_logits_triton(*prefill.args(), True, result)
    new_ranges = causal_ranges(70, 500)
    prefill.ks.copy_(torch.tensor([a for a, _ in new_ranges], dtype=torch.int32))
    prefill.ke.copy_(torch.tensor([b for _, b in new_ranges], dtype=torch.int32))
    graph.replay()
    assert calc_diff(result, run_prefill(prefill, "reference", True, 0)) < TIER


GPU_SHAPES = [("fp8", None, heads, dim) for heads in (8, 16, 32, 64) for dim in (32, 64, 128)]
GPU_SHAPES += [("fp8", "mxfp8", heads, 128) for heads in (32, 64)]
GPU_SHAPES += [("mxfp4", None, heads, dim) for heads in (8, 16, 32, 64) for dim in (64, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, scale_fmt, heads, dim", GPU_SHAPES)
def test_kernels_head_counts_dims_and_scale_words_gpu(kernel_device, fmt, scale_fmt, heads, dim):
    """DeepGEMM's head counts and dims, mxfp8 caches: both ops within the tier of the reference, repeatable."""
    lengths = [[n, max(0, n - 9)] for n in (0, 1, 64, 65, 4999, 9000)]
    inputs = decode_inputs(fmt, lengths, 2, kernel_device, heads=heads, dim=dim, block_size=64, seed=heads + dim,
                           scale_fmt=scale_fmt)
    first = check_decode(inputs, clean=True)
    assert_reruns_identical(lambda: run_decode(inputs, "triton", True, 4), first)
    if scale_fmt is None:
        ranges = causal_ranges(100, 3000) + varied_ranges(60, 3000, seed=17)
        prefill = prefill_inputs(fmt, ranges, 3000, heads, dim, kernel_device, seed=18)
        first = check_prefill(prefill, clean=True, pad=16)
        assert_reruns_identical(lambda: run_prefill(prefill, "triton", True, 16), first)


@pytest.mark.gpu
@pytest.mark.parametrize("decode_kernel", ["triton", "gluon"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_bf16_logits_and_weights_gpu(kernel_device, fmt, decode_kernel, monkeypatch):
    """bf16 logits are the fp32 logits rounded once, bit for bit, on both decode kernels; repeatable."""
    monkeypatch.setenv("DSA_INDEXER_DECODE_KERNEL", decode_kernel)
    request_lengths = [0, 1, 63, 64, 65, 4999, 12345] * 8
    inputs = decode_inputs(fmt, request_lengths, 2, kernel_device, heads=64, block_size=64, seed=19)
    first = check_bf16_logits(inputs, decode_call)
    for _ in range(20):
        assert torch.equal(decode_call(inputs, "triton", torch.bfloat16).view(torch.int16), first.view(torch.int16))
    prefill = prefill_inputs(fmt, causal_ranges(150, 4100), 4100, 64, 128, kernel_device, seed=20)
    check_bf16_logits(prefill, prefill_call)


def check_draft_rows_repeat(kernel_device, fmt, next_n, logits_dtype, requests, heads, reruns, aligned=False):
    """Random per-row lengths (any order, zeros included), bf16 weights, unclean rows: every visible position
    is written (two poisons agree there), within the tier of the reference, and reruns give the same bits.
    ``aligned``: DeepGEMM's layouts: the cache unpadded and 16-byte aligned (the Gluon kernels' TMA page copies),
    the logits rows padded past the width (as ``compat.deep_gemm`` allocates them)."""
    gen = torch.Generator().manual_seed(23)
    lengths = [[int(length * torch.rand((), generator=gen)) for _ in range(next_n - 1)] + [int(length)]
               for length in requests]
    inputs = decode_inputs(fmt, lengths, next_n, kernel_device, heads=heads, block_size=64, seed=24,
                           page_padding=0 if aligned else 40)
    if aligned:
        cache = inputs.cache
        cache = IndexerKCache(cache.num_blocks, block_size=cache.block_size, head_dim=cache.head_dim, fmt=fmt,
                              buffer=cache.buffer.contiguous())
        inputs = replace(inputs, cache=cache)
    inputs = replace(inputs, weights=inputs.weights.bfloat16())
    visible = torch.arange(inputs.max_context_len, device=kernel_device)[None, :] < inputs.context_lens.view(-1, 1)

    def run(poison: float) -> torch.Tensor:
        width = inputs.max_context_len
        out = torch.full((inputs.weights.shape[0], width + (67 if aligned else 0)), poison, dtype=logits_dtype,
                         device=kernel_device)[:, :width]
        paged_mqa_logits(*inputs.args(), clean=False, out=out, logits_dtype=logits_dtype, backend="triton")
        return out[visible].float()

    first = run(1.0)
    assert torch.equal(first, run(-2.0)), "a visible position was not written"
    expected = paged_mqa_logits(*inputs.args(), logits_dtype=logits_dtype, backend="reference")[visible].float()
    assert calc_diff(first, expected) < TIER
    for poison in range(reruns):
        assert torch.equal(run(float(poison)).view(torch.int32), first.view(torch.int32))


@pytest.mark.parametrize("fmt,aligned", [("fp8", False), ("mxfp4", False), ("fp8", True)])
def test_decode_draft_rows_not_a_power_of_two(kernel_device, fmt, aligned):
    """next_n 6: a partial group of stacked draft rows (also on DeepGEMM's cache and logits layouts)."""
    check_draft_rows_repeat(kernel_device, fmt, 6, torch.bfloat16, [70, 150, 5], heads=8, reruns=1, aligned=aligned)


@pytest.mark.gpu
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("decode_kernel", ["triton", "gluon"])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("next_n", [3, 6])
def test_decode_draft_rows_not_a_power_of_two_repeat_gpu(kernel_device, fmt, next_n, logits_dtype, decode_kernel,
                                                         aligned, monkeypatch):
    """DeepGEMM's SM100 case list shape (its paged test failed its 20-rerun check here on an H100): next_n 6,
    64 heads, many requests of 5K-11K keys (2M keys: the size the dispatch gives the Gluon kernel), on both
    decode kernels and both cache layouts (the aligned one takes the Gluon kernels' TMA page copies)."""
    monkeypatch.setenv("DSA_INDEXER_DECODE_KERNEL", decode_kernel)
    requests = torch.randint(5000, 11000, (256,), generator=torch.Generator().manual_seed(22)).tolist()
    check_draft_rows_repeat(kernel_device, fmt, next_n, logits_dtype, requests, heads=64, reruns=20, aligned=aligned)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("next_n", [3, 6])
@pytest.mark.parametrize("clean", [True, False])
def test_decode_programs_write_disjoint_outputs(kernel_device, fmt, next_n, clean):
    """Under the GPU's launch configuration (pipelining aside), no two programs of the decode kernel write the same
    logit: a partial group of stacked draft rows must not spill into the next request's rows."""
    if kernel_device != "cpu":
        pytest.skip("records the CPU interpreter's stores: the GPU runs these kernels compiled")
    from dsa_indexer.ops.logits import triton as kernels
    from program_writes import conflicting_writes, recorded_program_writes

    gen = torch.Generator().manual_seed(31)
    lengths = [[int(n * torch.rand((), generator=gen)) for _ in range(next_n - 1)] + [n] for n in (300, 650, 5)]
    inputs = decode_inputs(fmt, lengths, next_n, kernel_device, heads=8, block_size=64, seed=32)
    shipped = kernels.MXFP4_DECODE_CONFIG if fmt == "mxfp4" else kernels.DecodeConfig()
    config = replace(shipped, num_stages=1)
    out = torch.full((inputs.weights.shape[0], inputs.max_context_len), POISON, device=kernel_device)
    with recorded_program_writes() as writes:
        kernels.paged_mqa_logits_triton(*inputs.args(), clean, out, config=config, expand_ptx=False)
    assert not conflicting_writes(writes, out)
    expected = paged_mqa_logits(*inputs.args(), backend="reference")
    visible = expected != NEG_INF
    assert calc_diff(out[visible], expected[visible]) < TIER
