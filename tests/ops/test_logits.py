"""Logits (prefill ragged and decode paged) against float64 oracles written independently.

Two tiers, as DeepGEMM tests its kernels: (a) on the dequantised inputs the op must agree with
float64 math (calc_diff < 1e-9); (b) against the unquantised fp32 inputs the quantisation error stays
below 1e-3 (FP8) / 2e-2 (MXFP4). Masks are compared exactly. The paged oracle decodes keys from the
raw page bytes (``cache.buffer``) with explicit loops, not through the cache's views.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import pytest
import torch
from ragged_ranges import causal_ranges, varied_ranges

from dsa_indexer.cache import IndexerKCache
from dsa_indexer.formats import dequantize_mxfp4, quantize_fp8, quantize_mxfp4
from dsa_indexer.ops.logits import mqa_logits, paged_mqa_logits, reference

NEG_INF = float("-inf")
POISON = -777.0
# 0xFF bytes: e4m3 NaN values, NaN fp32 scales, and -6 * 2**128 (= -inf) for MXFP4. Any leak of an
# unreferenced or stale cache byte into a valid logit shows up as NaN or inf.
POISON_BYTE = 0xFF
FORMATS = ("fp8", "mxfp4")


def calc_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``1 - 2<x, y> / (|x|^2 + |y|^2)`` in float64 over the entries where ``expected`` is finite,
    after checking that both have ``-inf`` at the same places and ``actual`` is finite elsewhere."""
    actual, expected = actual.double(), expected.double()
    assert torch.equal(actual == NEG_INF, expected == NEG_INF), "-inf masks differ"
    finite = torch.isfinite(expected)
    assert torch.isfinite(actual[finite]).all(), "non-finite value where a finite one is expected"
    x, y = actual[finite], expected[finite]
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def quantize_q(q: torch.Tensor, weights: torch.Tensor, fmt: str):
    """``q [..., H, D]`` fp32 -> (stored q, q_scale | None, weights with the FP8 Q scale folded in)."""
    if fmt == "fp8":
        values, scales = quantize_fp8(q, block_size=q.shape[-1], amax_floor=1e-10)
        return values, None, weights * scales[..., 0].reshape(weights.shape)
    packed, scales = quantize_mxfp4(q)
    return packed, scales, weights


def quantize_k(k: torch.Tensor, fmt: str):
    """``k [N, D]`` fp32 -> (stored values, k_scale): fp32 ``[N]`` for FP8, ue8m0 ``[N, D/32]`` for MXFP4."""
    if fmt == "fp8":
        values, scales = quantize_fp8(k, block_size=k.shape[-1])
        return values, scales[:, 0]
    return quantize_mxfp4(k)


def dequantized_q64(q_stored: torch.Tensor, q_scale: torch.Tensor | None) -> torch.Tensor:
    """What the op should see: e4m3 values as is (their scale is in the weights), or MXFP4 decoded."""
    return q_stored.double() if q_scale is None else dequantize_mxfp4(q_stored, q_scale).double()


def relu_head_sum64(q64: torch.Tensor, k64: torch.Tensor, w64: torch.Tensor) -> torch.Tensor:
    """float64 ``sum_h w[m, h] * relu(q[m, h] . k[n])`` for ``q [M, H, D]``, ``k [N, D]`` -> ``[M, N]``."""
    return torch.einsum("mhn,mh->mn", torch.einsum("mhd,nd->mhn", q64, k64).clamp_min(0), w64)


@dataclass
class PrefillCase:
    fmt: str
    q: torch.Tensor
    q_scale: torch.Tensor | None
    k: torch.Tensor
    k_scale: torch.Tensor
    weights: torch.Tensor
    ks: torch.Tensor
    ke: torch.Tensor
    truth: torch.Tensor  # float64 [M, N] from the unquantised inputs, -inf outside [ks, ke)

    def args(self):
        return (self.q, self.q_scale, self.k, self.k_scale, self.weights, self.ks, self.ke)


def masked_rows(full: torch.Tensor, ks: list[int], ke: list[int]) -> torch.Tensor:
    expected = torch.full_like(full, NEG_INF)
    for row, (start, end) in enumerate(zip(ks, ke)):
        expected[row, start:end] = full[row, start:end]
    return expected


def make_prefill(fmt, num_rows, num_keys, heads, dim, ranges, seed=0) -> PrefillCase:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_rows, heads, dim, generator=gen)
    k = torch.randn(num_keys, dim, generator=gen)
    weights = torch.randn(num_rows, heads, generator=gen)
    q_stored, q_scale, weights_folded = quantize_q(q, weights, fmt)
    k_stored, k_scale = quantize_k(k, fmt)
    ks = [start for start, _ in ranges]
    ke = [end for _, end in ranges]
    truth = masked_rows(relu_head_sum64(q.double(), k.double(), weights.double()), ks, ke)
    return PrefillCase(
        fmt,
        q_stored,
        q_scale,
        k_stored,
        k_scale,
        weights_folded,
        torch.tensor(ks, dtype=torch.int32),
        torch.tensor(ke, dtype=torch.int32),
        truth,
    )


def prefill_oracle(case: PrefillCase) -> torch.Tensor:
    """float64 logits on the dequantised inputs, masked row by row."""
    if case.fmt == "fp8":
        keys, key_scales = case.k.double(), case.k_scale.double()
    else:
        keys = dequantize_mxfp4(case.k, case.k_scale).double()
        key_scales = torch.ones(case.k.shape[0], dtype=torch.float64)
    full = relu_head_sum64(dequantized_q64(case.q, case.q_scale), keys, case.weights.double()) * key_scales
    return masked_rows(full, case.ks.tolist(), case.ke.tolist())


def context_parallel_ranges(num_rows: int, num_keys: int) -> list[tuple[int, int]]:
    """DeepGEMM's CP layout: two half-chunks per rank, ``ke`` non-monotone across the halves."""
    half = num_rows // 2
    return [(0, min(num_keys, half + i + 1)) for i in range(half)] + [
        (0, min(num_keys, num_keys - half + i + 1)) for i in range(num_rows - half)
    ]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "num_rows, num_keys, heads, dim, layout",
    [
        (16, 40, 8, 128, "causal"),
        (12, 33, 1, 128, "varied"),
        (7, 19, 64, 128, "varied"),
        (10, 24, 8, 64, "context_parallel"),
        (9, 70, 8, 32, "varied"),
    ],
)
def test_prefill_matches_float64_on_dequantised_inputs(fmt, num_rows, num_keys, heads, dim, layout):
    ranges = {
        "causal": causal_ranges(num_rows, num_keys),
        "varied": varied_ranges(num_rows, num_keys, seed=num_rows),
        "context_parallel": context_parallel_ranges(num_rows, num_keys),
    }[layout]
    case = make_prefill(fmt, num_rows, num_keys, heads, dim, ranges, seed=heads)
    out = torch.full((num_rows, num_keys), float("nan"))
    result = mqa_logits(*case.args(), out=out)
    assert result.data_ptr() == out.data_ptr()
    assert calc_diff(result, prefill_oracle(case)) < 1e-9


@pytest.mark.parametrize("fmt, bound", [("fp8", 1e-3), ("mxfp4", 2e-2)])
def test_prefill_quantisation_error_against_unquantised_truth(fmt, bound):
    case = make_prefill(fmt, 48, 96, 16, 128, causal_ranges(48, 96), seed=7)
    result = mqa_logits(*case.args())
    diff = calc_diff(result, case.truth)
    assert 0 < diff < bound


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_padded_row_stride_keeps_pad_poison(fmt):
    num_rows, num_keys = 6, 21
    case = make_prefill(fmt, num_rows, num_keys, 4, 64, varied_ranges(num_rows, num_keys, seed=3))
    storage = torch.full((num_rows, num_keys + 11), POISON)
    out = storage[:, :num_keys]
    result = mqa_logits(*case.args(), out=out)
    assert result.data_ptr() == out.data_ptr() and result.stride() == (num_keys + 11, 1)
    assert (storage[:, num_keys:] == POISON).all()
    assert calc_diff(result, prefill_oracle(case)) < 1e-9


def test_prefill_writes_every_entry_of_a_poisoned_destination():
    case = make_prefill("fp8", 8, 17, 4, 64, varied_ranges(8, 17, seed=5))
    out = torch.full((8, 17), float("nan"))
    mqa_logits(*case.args(), out=out)
    assert not out.isnan().any()
    assert ((out == NEG_INF) == (prefill_oracle(case) == NEG_INF)).all()


def test_prefill_clean_false_agrees_inside_ranges():
    case = make_prefill("mxfp4", 8, 30, 8, 64, varied_ranges(8, 30, seed=9))
    clean = mqa_logits(*case.args())
    unclean = mqa_logits(*case.args(), clean=False)
    inside = prefill_oracle(case) != NEG_INF
    assert same_bits(clean[inside], unclean[inside])


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_repeated_calls_are_bitwise_equal(fmt):
    case = make_prefill(fmt, 10, 50, 8, 128, causal_ranges(10, 50))
    first = mqa_logits(*case.args())
    for _ in range(4):
        assert same_bits(mqa_logits(*case.args()), first)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_with_zero_rows_or_zero_keys(fmt):
    empty_rows = make_prefill(fmt, 0, 12, 4, 64, [])
    assert mqa_logits(*empty_rows.args()).shape == (0, 12)
    no_keys = make_prefill(fmt, 3, 0, 4, 64, [(0, 0)] * 3)
    assert mqa_logits(*no_keys.args()).shape == (3, 0)


def test_prefill_accepts_int64_ranges():
    case = make_prefill("fp8", 5, 12, 2, 64, causal_ranges(5, 12))
    expected = mqa_logits(*case.args())
    result = mqa_logits(case.q, None, case.k, case.k_scale, case.weights, case.ks.long(), case.ke.long())
    assert same_bits(result, expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_reference_chunks_stay_within_budget(fmt, monkeypatch):
    budget = 64 << 10
    case = make_prefill(fmt, 40, 150, 8, 128, varied_ranges(40, 150, seed=11))
    score_bytes = []
    matmul = torch.matmul

    def recording_matmul(a, b):
        product = matmul(a, b)
        score_bytes.append(product.numel() * product.element_size())
        return product

    monkeypatch.setattr(torch, "matmul", recording_matmul)
    out = torch.full((40, 150), float("nan"))
    reference.mqa_logits(*case.args(), True, out, budget_bytes=budget, keys_per_chunk=32)
    monkeypatch.undo()
    assert len(score_bytes) > 5 and max(score_bytes) <= budget
    assert calc_diff(out, prefill_oracle(case)) < 1e-9


def test_chunk_plan_bounds_a_2048_by_32768_call_with_64_heads():
    heads, dim, budget = 64, 128, reference.INTERMEDIATE_BUDGET_BYTES
    keys = min(32768, reference.KEYS_PER_CHUNK)
    rows = reference.rows_per_chunk(heads, dim, keys, budget)
    assert 1 <= rows < 2048
    assert (rows * heads * (keys + dim) + keys * dim) * 4 <= budget
    requests = reference.requests_per_chunk(2, heads, dim, keys, budget)
    assert 1 <= requests and requests * (2 * heads * (keys + dim) + keys * dim) * 4 <= budget


@dataclass
class DecodeCase:
    fmt: str
    q: torch.Tensor  # stored [B, next_n, H, D | D/2]
    q_scale: torch.Tensor | None
    cache: IndexerKCache
    weights: torch.Tensor  # [B * next_n, H], FP8 Q scale folded in
    context_lens: torch.Tensor
    block_table: torch.Tensor
    max_context_len: int
    row_lengths: list[list[int]]  # [B][next_n], computed in Python
    truth: torch.Tensor  # float64 [B * next_n, max_context_len] from the unquantised inputs
    storage: torch.Tensor  # the allocation the cache's pages live in

    def args(self):
        return (
            self.q,
            self.q_scale,
            self.cache,
            self.weights,
            self.context_lens,
            self.block_table,
            self.max_context_len,
        )


def expected_row_lengths(lengths: list, next_n: int) -> list[list[int]]:
    if lengths and isinstance(lengths[0], list):
        return lengths
    return [[max(length - next_n + t + 1, 0) for t in range(next_n)] for length in lengths]


def make_decode(
    fmt,
    lengths: list,
    next_n: int,
    *,
    heads=4,
    head_dim=128,
    block_size=16,
    spare_pages=3,
    extra_width=3,
    page_padding=40,
    seed=0,
    scale_fmt=None,
) -> DecodeCase:
    """Requests of the given lengths (1-D: request lengths; 2-D: per-row lengths) in a cache whose
    pages sit, randomly permuted, inside a larger poisoned allocation (page stride > packed page).
    Block-table entries past each request's pages hold garbage (-1 and huge ids)."""
    gen = torch.Generator().manual_seed(seed)
    rows = expected_row_lengths(lengths, next_n)
    batch = len(rows)
    extents = [max(row) for row in rows]
    pages_needed = [math.ceil(extent / block_size) for extent in extents]
    num_blocks = sum(pages_needed) + spare_pages
    probe = IndexerKCache(1, block_size=block_size, head_dim=head_dim, fmt=fmt)
    token_bytes = probe.bytes_per_token
    page_stride = block_size * token_bytes + page_padding
    storage = torch.full((num_blocks * page_stride + 24,), POISON_BYTE, dtype=torch.uint8)
    buffer = torch.as_strided(storage, (num_blocks, block_size, token_bytes), (page_stride, token_bytes, 1), 24)
    cache = IndexerKCache(num_blocks, block_size=block_size, head_dim=head_dim, fmt=fmt, scale_fmt=scale_fmt,
                          buffer=buffer)

    max_blocks = max(pages_needed, default=0) + 2
    block_table = torch.empty((batch, max_blocks), dtype=torch.int32)
    block_table[:, 0::2] = -1
    block_table[:, 1::2] = 10**6
    page_order = torch.randperm(num_blocks, generator=gen).tolist()
    keys = []
    for request, count in enumerate(pages_needed):
        block_table[request, :count] = torch.tensor(page_order[:count], dtype=torch.int32)
        page_order = page_order[count:]
        keys.append(torch.randn(extents[request], head_dim, generator=gen))

    all_keys = torch.cat(keys) if keys else torch.empty(0, head_dim)
    positions = [(b, p) for b in range(batch) for p in range(extents[b])]
    pages = torch.tensor([int(block_table[b, p // block_size]) for b, p in positions], dtype=torch.long)
    offsets = torch.tensor([p % block_size for _, p in positions], dtype=torch.long)
    if fmt == "fp8":
        values, scales = quantize_fp8(all_keys, block_size=head_dim)
        value_bytes, scale_bytes = values.view(torch.uint8), scales.view(torch.uint8)
        if scale_fmt == "mxfp8":  # four copies of the power-of-two scale's exponent field
            scale_bytes = ((scales.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).expand(-1, 4)
    else:
        value_bytes, scale_bytes = quantize_mxfp4(all_keys)
    cache.values_view()[pages, offsets] = value_bytes
    cache.scales_view()[pages, offsets] = scale_bytes

    q = torch.randn(batch, next_n, heads, head_dim, generator=gen)
    weights = torch.randn(batch * next_n, heads, generator=gen)
    q_stored, q_scale, weights_folded = quantize_q(q, weights, fmt)
    max_context_len = max(extents, default=0) + extra_width
    truth = torch.full((batch * next_n, max_context_len), NEG_INF, dtype=torch.float64)
    for b in range(batch):
        full = relu_head_sum64(q[b].double(), keys[b].double(), weights.view(batch, next_n, heads)[b].double())
        for t in range(next_n):
            truth[b * next_n + t, : rows[b][t]] = full[t, : rows[b][t]]
    return DecodeCase(
        fmt,
        q_stored,
        q_scale,
        cache,
        weights_folded,
        torch.tensor(lengths, dtype=torch.int32),
        block_table,
        max_context_len,
        rows,
        truth,
        storage,
    )


def key_from_page_bytes(cache: IndexerKCache, page: int, offset: int) -> tuple[torch.Tensor, float]:
    """float64 key ``[D]`` and its post-head-sum scale, decoded from the raw bytes of one page."""
    page_bytes = cache.buffer[page].reshape(-1)
    value_width = cache.head_dim if cache.fmt == "fp8" else cache.head_dim // 2
    scale_width = 4 if cache.fmt == "fp8" else -(-cache.head_dim // 128) * 4  # MXFP4: D/32 padded to words
    values = page_bytes[offset * value_width : (offset + 1) * value_width]
    scale_start = cache.block_size * value_width + offset * scale_width
    scale_bytes = page_bytes[scale_start : scale_start + scale_width]
    if cache.scale_fmt == "mxfp8":
        exponent_bytes = scale_bytes.tolist()
        assert len(set(exponent_bytes)) == 1, exponent_bytes
        return values.view(torch.float8_e4m3fn).double(), 2.0 ** (exponent_bytes[0] - 127)
    if cache.fmt == "fp8":
        return values.view(torch.float8_e4m3fn).double(), struct.unpack("<f", bytes(scale_bytes.tolist()))[0]
    return dequantize_mxfp4(values, scale_bytes).double(), 1.0


def decode_oracle(case: DecodeCase) -> torch.Tensor:
    """float64 logits on the dequantised stored inputs, keys read position by position."""
    batch, next_n, heads = case.q.shape[0], case.q.shape[1], case.weights.shape[1]
    block_size = case.cache.block_size
    expected = torch.full((batch * next_n, case.max_context_len), NEG_INF, dtype=torch.float64)
    queries = dequantized_q64(case.q, case.q_scale)
    for b in range(batch):
        extent = max(case.row_lengths[b])
        decoded = [
            key_from_page_bytes(case.cache, int(case.block_table[b, p // block_size]), p % block_size)
            for p in range(extent)
        ]
        if not decoded:
            continue
        keys = torch.stack([key for key, _ in decoded])
        key_scales = torch.tensor([scale for _, scale in decoded], dtype=torch.float64)
        weights = case.weights.view(batch, next_n, heads)[b].double()
        full = relu_head_sum64(queries[b], keys, weights) * key_scales
        for t in range(next_n):
            length = case.row_lengths[b][t]
            expected[b * next_n + t, :length] = full[t, :length]
    return expected


def page_edge_lengths(block_size: int) -> list[int]:
    return [0, 1, block_size, block_size + 1, 2 * block_size + 5]


def per_row_lengths(block_size: int, next_n: int, seed: int) -> list[list[int]]:
    """2-D lengths: the last row is the request length, earlier rows random (not monotone), plus an
    all-zero request and one whose rows hit the page edges."""
    gen = torch.Generator().manual_seed(seed)
    rows = [[0] * next_n]
    for length in (1, block_size, block_size + 1, 3 * block_size - 2):
        earlier = torch.randint(0, length + 1, (next_n - 1,), generator=gen).tolist()
        rows.append(earlier + [length])
    return rows


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("next_n", [1, 2, 4])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("lens_rank", [1, 2])
def test_decode_matches_float64_on_dequantised_inputs(fmt, next_n, block_size, lens_rank):
    lengths = page_edge_lengths(block_size) if lens_rank == 1 else per_row_lengths(block_size, next_n, seed=next_n)
    case = make_decode(fmt, lengths, next_n, block_size=block_size, seed=block_size + next_n)
    before = case.storage.clone()
    out = torch.full((case.q.shape[0] * next_n, case.max_context_len), float("nan"))
    result = paged_mqa_logits(*case.args(), out=out)
    assert result.data_ptr() == out.data_ptr()
    assert calc_diff(result, decode_oracle(case)) < 1e-9
    assert torch.equal(case.storage, before), "the op modified the cache"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads, head_dim", [(1, 128), (8, 64), (64, 128)])
def test_decode_head_counts_and_dims(fmt, heads, head_dim):
    case = make_decode(fmt, [5, 17, 40], 2, heads=heads, head_dim=head_dim, seed=heads)
    result = paged_mqa_logits(*case.args())
    assert calc_diff(result, decode_oracle(case)) < 1e-9


@pytest.mark.parametrize("fmt, scale_fmt, heads, head_dim", [("fp8", "mxfp8", 4, 128), ("fp8", None, 16, 32),
                                                              ("mxfp4", None, 8, 64), ("mxfp4", None, 32, 32)])
def test_decode_mxfp8_caches_and_small_heads_and_dims(fmt, scale_fmt, heads, head_dim):
    """mxfp8 scale words decode as 2**(byte - 127); MXFP4 at D = 64 and 32 reads its padded scale words."""
    case = make_decode(fmt, [5, 17, 40], 2, heads=heads, head_dim=head_dim, seed=heads, scale_fmt=scale_fmt)
    assert calc_diff(paged_mqa_logits(*case.args()), decode_oracle(case)) < 1e-9


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_logits_round_the_fp32_logits_once_and_bf16_weights_widen(fmt):
    """bf16 output: the fp32 result rounded to nearest even, bit for bit; bf16 weights: the fp32 result of
    the same weights widened (so the two options compose)."""
    case = make_decode(fmt, [5, 17, 40], 2, seed=7)
    bf16_weights = case.weights.bfloat16()
    widened = (*case.args()[:3], bf16_weights.float(), *case.args()[4:])
    with_bf16 = (*case.args()[:3], bf16_weights, *case.args()[4:])
    fp32 = paged_mqa_logits(*widened)
    assert torch.equal(paged_mqa_logits(*with_bf16), fp32)
    rounded = paged_mqa_logits(*with_bf16, logits_dtype=torch.bfloat16)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, fp32.bfloat16())
    prefill = make_prefill(fmt, 5, 19, 4, 128, [(0, 19), (3, 7), (0, 0), (18, 19), (2, 12)])
    q, q_scale, k, k_scale, weights, ks, ke = prefill.args()
    fp32 = mqa_logits(q, q_scale, k, k_scale, weights.bfloat16().float(), ks, ke)
    rounded = mqa_logits(q, q_scale, k, k_scale, weights.bfloat16(), ks, ke, logits_dtype=torch.bfloat16)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, fp32.bfloat16())


def test_prefill_takes_mxfp8_scale_words_as_their_power_of_two():
    case = make_prefill("fp8", 4, 11, 4, 128, [(0, 11), (2, 5), (0, 0), (10, 11)])
    q, q_scale, k, k_scale, weights, ks, ke = case.args()
    words = ((k_scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)[:, None].expand(-1, 4).contiguous()
    assert torch.equal(mqa_logits(q, q_scale, k, words, weights, ks, ke), mqa_logits(*case.args()))


@pytest.mark.parametrize("fmt, bound", [("fp8", 1e-3), ("mxfp4", 2e-2)])
def test_decode_quantisation_error_against_unquantised_truth(fmt, bound):
    case = make_decode(fmt, [70, 33, 129, 64, 100, 90, 1, 128], 2, heads=16, block_size=64, seed=5)
    diff = calc_diff(paged_mqa_logits(*case.args()), case.truth)
    assert 0 < diff < bound


def test_decode_masks_follow_each_row_length_exactly():
    next_n = 4
    case = make_decode("fp8", [0, 1, 2, 3, 4, 16, 17], next_n, block_size=16)
    result = paged_mqa_logits(*case.args())
    columns = torch.arange(case.max_context_len)
    for b, lengths in enumerate(case.row_lengths):
        for t, length in enumerate(lengths):
            row = result[b * next_n + t]
            assert torch.equal(row == NEG_INF, columns >= length), (b, t)
    assert case.row_lengths[1] == [0, 0, 0, 1] and case.row_lengths[3] == [0, 1, 2, 3]


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_padded_row_stride_keeps_pad_poison(fmt):
    case = make_decode(fmt, [3, 20, 0], 2, block_size=16)
    rows, width = case.q.shape[0] * 2, case.max_context_len
    storage = torch.full((rows, width + 9), POISON)
    out = storage[:, :width]
    result = paged_mqa_logits(*case.args(), out=out)
    assert result.data_ptr() == out.data_ptr()
    assert (storage[:, width:] == POISON).all()
    assert calc_diff(result, decode_oracle(case)) < 1e-9


def test_decode_clean_false_agrees_inside_lengths():
    case = make_decode("mxfp4", per_row_lengths(16, 2, seed=1), 2, block_size=16)
    clean = paged_mqa_logits(*case.args())
    unclean = paged_mqa_logits(*case.args(), clean=False)
    inside = decode_oracle(case) != NEG_INF
    assert same_bits(clean[inside], unclean[inside])


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_with_zero_requests(fmt):
    case = make_decode(fmt, [], 2, spare_pages=2, extra_width=5)
    assert paged_mqa_logits(*case.args()).shape == (0, 5)


def test_decode_all_lengths_zero_and_an_empty_cache():
    case = make_decode("fp8", [0, 0], 3, spare_pages=0, extra_width=4)
    assert case.cache.num_blocks == 0
    result = paged_mqa_logits(*case.args())
    assert result.shape == (6, 4) and (result == NEG_INF).all()


def test_decode_zero_width_output():
    case = make_decode("fp8", [0, 0], 1, extra_width=0)
    assert paged_mqa_logits(*case.args()).shape == (2, 0)


def test_decode_one_dimensional_lengths_equal_their_two_dimensional_expansion():
    next_n = 3
    case = make_decode("fp8", [0, 2, 5, 33], next_n, block_size=16)
    expanded = torch.tensor(case.row_lengths, dtype=torch.int32)
    one_d = paged_mqa_logits(*case.args())
    two_d = paged_mqa_logits(
        case.q, None, case.cache, case.weights, expanded, case.block_table, case.max_context_len
    )
    assert same_bits(one_d, two_d)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_reference_chunks_stay_within_budget(fmt, monkeypatch):
    budget = 96 << 10
    case = make_decode(fmt, [40, 75, 3, 0, 52], 2, heads=8, block_size=16, seed=2)
    score_bytes = []
    matmul = torch.matmul

    def recording_matmul(a, b):
        product = matmul(a, b)
        score_bytes.append(product.numel() * product.element_size())
        return product

    monkeypatch.setattr(torch, "matmul", recording_matmul)
    out = torch.full((10, case.max_context_len), float("nan"))
    reference.paged_mqa_logits(*case.args(), True, out, budget_bytes=budget, keys_per_chunk=11)
    monkeypatch.undo()
    assert len(score_bytes) > 5 and max(score_bytes) <= budget
    assert calc_diff(out, decode_oracle(case)) < 1e-9


def poisoned(shape) -> torch.Tensor:
    return torch.full(shape, POISON)


def assert_rejected(call, out, error, name):
    before = out.clone()
    with pytest.raises(error, match=name):
        call()
    assert same_bits(out, before), "out was modified by a rejected call"


def prefill_mutations(case: PrefillCase):
    """(label, changes to the keyword arguments, error, argument name in the message)."""
    num_rows, num_keys = case.q.shape[0], case.k.shape[0]
    bad_ks = case.ks.clone()
    bad_ks[1] = -1
    late_ks = case.ke.clone() + 1
    late_ke = case.ke.clone()
    late_ke[-1] = num_keys + 1
    return [
        ("q dtype", {"q": case.q.to(torch.bfloat16)}, TypeError, "q"),
        ("q rank", {"q": case.q[0]}, ValueError, "q"),
        ("q width zero", {"q": case.q[..., :0]}, ValueError, "q"),
        ("q_scale given for fp8", {"q_scale": torch.ones(num_rows, 4)}, TypeError, "q_scale"),
        ("k format", {"k": case.k.view(torch.uint8)}, TypeError, "k"),
        ("k width", {"k": case.k[:, :32]}, ValueError, "k"),
        ("k rank", {"k": case.k[None]}, ValueError, "k"),
        ("k_scale dtype", {"k_scale": case.k_scale.double()}, TypeError, "k_scale"),
        ("k_scale shape", {"k_scale": case.k_scale[:-1]}, ValueError, "k_scale"),
        ("k_scale mxfp8 word width", {"k_scale": torch.zeros(case.k.shape[0], 3, dtype=torch.uint8)}, ValueError,
         "k_scale"),
        ("weights dtype", {"weights": case.weights.half()}, TypeError, "weights"),
        ("weights shape", {"weights": case.weights[:, :-1]}, ValueError, "weights"),
        ("weights device", {"weights": case.weights.to("meta")}, ValueError, "weights"),
        ("ks dtype", {"ks": case.ks.float()}, TypeError, "ks"),
        ("ks shape", {"ks": case.ks[:-1]}, ValueError, "ks"),
        ("ke dtype", {"ke": case.ke.to(torch.int16)}, TypeError, "ke"),
        ("ks negative", {"ks": bad_ks}, ValueError, "ks"),
        ("ks after ke", {"ks": late_ks}, ValueError, "ks"),
        ("ke past keys", {"ke": late_ke}, ValueError, "ke"),
        ("clean type", {"clean": 1}, TypeError, "clean"),
        ("backend name", {"backend": "cuda"}, ValueError, "backend"),
        ("triton on cpu", {"backend": "triton"}, ValueError, "backend"),
    ]


def small_prefill_case() -> PrefillCase:
    return make_prefill("fp8", 4, 9, 4, 64, causal_ranges(4, 9))


@pytest.mark.parametrize("label", [m[0] for m in prefill_mutations(small_prefill_case())])
@pytest.mark.usefixtures("without_interpreter")
def test_prefill_rejects_bad_argument_without_writing(label):
    case = small_prefill_case()
    _, changes, error, name = next(m for m in prefill_mutations(case) if m[0] == label)
    kwargs = dict(zip(("q", "q_scale", "k", "k_scale", "weights", "ks", "ke"), case.args()))
    kwargs.update(changes)
    out = poisoned((4, 9))
    assert_rejected(lambda: mqa_logits(**kwargs, out=out), out, error, name)


@pytest.mark.parametrize(
    "label, error, name",
    [
        ("q_scale missing", TypeError, "q_scale"),
        ("q_scale shape", ValueError, "q_scale"),
        ("q_scale dtype", TypeError, "q_scale"),
        ("k fp8 with mxfp4 q", TypeError, "k"),
        ("k_scale fp32 with mxfp4 q", TypeError, "k_scale"),
        ("k_scale blocks", ValueError, "k_scale"),
        ("q width not a block multiple", ValueError, "q"),
    ],
)
def test_prefill_rejects_inconsistent_mxfp4_arguments(label, error, name):
    case = make_prefill("mxfp4", 4, 9, 4, 64, causal_ranges(4, 9))
    kwargs = dict(zip(("q", "q_scale", "k", "k_scale", "weights", "ks", "ke"), case.args()))
    kwargs.update(
        {
            "q_scale missing": {"q_scale": None},
            "q_scale shape": {"q_scale": case.q_scale[:, :, :1]},
            "q_scale dtype": {"q_scale": case.q_scale.int()},
            "k fp8 with mxfp4 q": {"k": case.k.view(torch.float8_e4m3fn)},
            "k_scale fp32 with mxfp4 q": {"k_scale": torch.ones(9)},
            "k_scale blocks": {"k_scale": case.k_scale[:, :1]},
            "q width not a block multiple": {"q": case.q[..., :8]},
        }[label]
    )
    out = poisoned((4, 9))
    assert_rejected(lambda: mqa_logits(**kwargs, out=out), out, error, name)


@pytest.mark.parametrize(
    "label, make_out, error",
    [
        ("dtype", lambda: torch.full((4, 9), POISON, dtype=torch.float64), TypeError),
        ("shape", lambda: poisoned((4, 10)), ValueError),
        ("column stride", lambda: poisoned((9, 4)).t(), ValueError),
        ("overlapping rows", lambda: torch.as_strided(poisoned((64,)), (4, 9), (5, 1)), ValueError),
    ],
)
def test_prefill_rejects_bad_out_without_writing(label, make_out, error):
    case = make_prefill("fp8", 4, 9, 4, 64, causal_ranges(4, 9))
    out = make_out()
    assert_rejected(lambda: mqa_logits(*case.args(), out=out), out, error, "out")


def decode_mutations(case: DecodeCase):
    batch, next_n = case.q.shape[:2]
    read_page_negative = case.block_table.clone()
    read_page_negative[1, 0] = -1
    read_page_past_cache = case.block_table.clone()
    read_page_past_cache[2, 1] = case.cache.num_blocks
    mxfp4_cache = IndexerKCache(2, block_size=case.cache.block_size, fmt="mxfp4")
    wide_lens = torch.zeros(batch, next_n + 1, dtype=torch.int32)
    short_width = int(case.context_lens.max()) - 1
    return [
        ("cache type", {"cache": case.cache.buffer}, TypeError, "cache"),
        ("cache format", {"cache": mxfp4_cache}, ValueError, "cache"),
        ("q dtype", {"q": case.q.float()}, TypeError, "q"),
        ("q rank", {"q": case.q[0]}, ValueError, "q"),
        ("q head_dim", {"q": case.q[..., :64]}, ValueError, "q"),
        ("q next_n zero", {"q": case.q[:, :0]}, ValueError, "q"),
        ("q_scale given for fp8", {"q_scale": torch.ones(1)}, TypeError, "q_scale"),
        ("weights shape", {"weights": case.weights[:-1]}, ValueError, "weights"),
        ("weights dtype", {"weights": case.weights.half()}, TypeError, "weights"),
        ("context_lens dtype", {"context_lens": case.context_lens.float()}, TypeError, "context_lens"),
        ("context_lens shape", {"context_lens": case.context_lens[:-1]}, ValueError, "context_lens"),
        ("context_lens 2-D shape", {"context_lens": wide_lens}, ValueError, "context_lens"),
        ("context_lens rank", {"context_lens": case.context_lens[:, None, None]}, ValueError, "context_lens"),
        ("context_lens negative", {"context_lens": case.context_lens - 100}, ValueError, "context_lens"),
        ("block_table dtype", {"block_table": case.block_table.float()}, TypeError, "block_table"),
        ("block_table rows", {"block_table": case.block_table[:-1]}, ValueError, "block_table"),
        ("block_table too narrow", {"block_table": case.block_table[:, :1]}, ValueError, "block_table"),
        ("block_table read page negative", {"block_table": read_page_negative}, ValueError, "block_table"),
        ("block_table read page past cache", {"block_table": read_page_past_cache}, ValueError, "block_table"),
        ("block_table device", {"block_table": case.block_table.to("meta")}, ValueError, "block_table"),
        ("max_context_len type", {"max_context_len": float(case.max_context_len)}, TypeError, "max_context_len"),
        ("max_context_len negative", {"max_context_len": -1}, ValueError, "max_context_len"),
        ("max_context_len short", {"max_context_len": short_width}, ValueError, "max_context_len"),
        ("clean type", {"clean": None}, TypeError, "clean"),
        ("backend name", {"backend": "fast"}, ValueError, "backend"),
    ]


def small_decode_case() -> DecodeCase:
    return make_decode("fp8", [5, 20, 40], 2, block_size=16, extra_width=0)


@pytest.mark.parametrize("label", [m[0] for m in decode_mutations(small_decode_case())])
def test_decode_rejects_bad_argument_without_writing(label):
    case = small_decode_case()
    _, changes, error, name = next(m for m in decode_mutations(case) if m[0] == label)
    names = ("q", "q_scale", "cache", "weights", "context_lens", "block_table", "max_context_len")
    kwargs = dict(zip(names, case.args()))
    kwargs.update(changes)
    out = poisoned((6, case.max_context_len))
    assert_rejected(lambda: paged_mqa_logits(**kwargs, out=out), out, error, name)


@pytest.mark.parametrize(
    "label, make_out, error",
    [
        ("dtype", lambda width: torch.full((6, width), POISON, dtype=torch.float16), TypeError),
        ("shape", lambda width: poisoned((6, width + 1)), ValueError),
        ("overlapping rows", lambda w: torch.as_strided(poisoned((400,)), (6, w), (w - 1, 1)), ValueError),
    ],
)
def test_decode_rejects_bad_out_without_writing(label, make_out, error):
    case = small_decode_case()
    out = make_out(case.max_context_len)
    assert_rejected(lambda: paged_mqa_logits(*case.args(), out=out), out, error, "out")


@pytest.mark.parametrize("label, error", [("missing", TypeError), ("shape", ValueError), ("dtype", TypeError)])
def test_decode_rejects_bad_mxfp4_q_scale_without_writing(label, error):
    case = make_decode("mxfp4", [5, 20, 40], 2, block_size=16, extra_width=0)
    q_scale = {"missing": None, "shape": case.q_scale[..., :1], "dtype": case.q_scale.view(torch.int8)}[label]
    out = poisoned((6, case.max_context_len))
    args = (case.q, q_scale, *case.args()[2:])
    assert_rejected(lambda: paged_mqa_logits(*args, out=out), out, error, "q_scale")


def test_decode_rejects_mxfp4_q_against_fp8_cache():
    fp8 = small_decode_case()
    fp4 = make_decode("mxfp4", [5, 20, 40], 2, block_size=16, extra_width=0)
    out = poisoned((6, fp8.max_context_len))
    args = (fp4.q, fp4.q_scale, *fp8.args()[2:])
    assert_rejected(lambda: paged_mqa_logits(*args, out=out), out, ValueError, "cache")


def test_logits_dtype_and_out_dtype_are_checked_before_writing():
    case = small_prefill_case()
    out = poisoned((case.q.shape[0], case.k.shape[0]))
    assert_rejected(lambda: mqa_logits(*case.args(), logits_dtype=torch.float16), out, TypeError, "logits_dtype")
    assert_rejected(lambda: mqa_logits(*case.args(), out=out, logits_dtype=torch.bfloat16), out, TypeError, "out")
    decode = make_decode("fp8", [5, 9], 1)
    out = poisoned((2, decode.max_context_len))
    assert_rejected(lambda: paged_mqa_logits(*decode.args(), out=out, logits_dtype=torch.bfloat16), out, TypeError,
                    "out")
