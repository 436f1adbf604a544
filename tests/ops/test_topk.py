"""Top-k family: exactness against independent oracles, views, bounds, destinations, errors."""

from __future__ import annotations

import math

import pytest
import torch

from dsa_indexer.backend import ENV_VAR
from dsa_indexer.ops.topk import indices_to_slots, reference, topk, topk_decode
from dsa_indexer.testing import (
    ADVERSARIAL_GENERATORS,
    assert_topk_exact,
    count_topk_errors,
    with_garbage_past_ends,
)

POISON = -777


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def brute_force_topk(logits: torch.Tensor, k: int, starts=None, ends=None) -> torch.Tensor:
    """Python sort over (-value, column) of each row window: the contract spelled out literally."""
    rows = logits.tolist()
    result = []
    for r, row in enumerate(rows):
        lo = 0 if starts is None else int(starts[r])
        hi = len(row) if ends is None else int(ends[r])
        ranked = sorted((-row[c], c) for c in range(lo, hi) if not math.isnan(row[c]) and row[c] != -math.inf)
        chosen = sorted(c - lo for _, c in ranked[:k])
        result.append(chosen + [-1] * (k - len(chosen)))
    return torch.tensor(result, dtype=torch.int32).reshape(len(rows), k)


def tie_heavy_logits(num_rows: int, width: int, seed: int) -> torch.Tensor:
    """Half-integers in [-2, 2] (many ties, both zero signs) with NaN, +inf and -inf sprinkled in."""
    rng = torch.Generator().manual_seed(seed)
    values = torch.randint(-4, 5, (num_rows, width), generator=rng).float() / 2
    values = torch.where(torch.rand(num_rows, width, generator=rng) < 0.2, -values, values)  # yields -0.0
    special = torch.rand(num_rows, width, generator=rng)
    values[special < 0.05] = math.nan
    values[(special >= 0.05) & (special < 0.08)] = math.inf
    values[(special >= 0.08) & (special < 0.12)] = -math.inf
    return values


def random_bounds(num_rows: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = torch.Generator().manual_seed(seed)
    a = torch.randint(0, width + 1, (num_rows,), generator=rng)
    b = torch.randint(0, width + 1, (num_rows,), generator=rng)
    return torch.minimum(a, b).to(torch.int32), torch.maximum(a, b).to(torch.int32)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "num_rows, width, k",
    [(1, 1, 1), (3, 5, 7), (6, 17, 4), (4, 33, 33), (5, 64, 63), (2, 100, 101), (7, 129, 16)],
)
def test_topk_equals_brute_force_on_tie_heavy_rows(seed, num_rows, width, k):
    logits = tie_heavy_logits(num_rows, width, seed)
    assert torch.equal(topk(logits, k), brute_force_topk(logits, k))


@pytest.mark.parametrize("seed", range(3))
def test_topk_equals_brute_force_with_bounds(seed):
    logits = tie_heavy_logits(9, 40, seed)
    starts, ends = random_bounds(9, 40, seed)
    assert torch.equal(topk(logits, 6, starts=starts, ends=ends), brute_force_topk(logits, 6, starts, ends))


@pytest.mark.parametrize("name", sorted(ADVERSARIAL_GENERATORS))
@pytest.mark.parametrize("width", [1, 63, 64, 65, 1000])
def test_topk_exact_on_adversarial_rows(name, width):
    k = 64
    logits = ADVERSARIAL_GENERATORS[name]((5, width), 11)
    indices = topk(logits, k)
    assert_topk_exact(logits, indices, k)
    if width <= 65:
        assert torch.equal(indices, brute_force_topk(logits, k))


@pytest.mark.parametrize("name", sorted(ADVERSARIAL_GENERATORS))
def test_topk_is_bitwise_deterministic(name):
    logits = ADVERSARIAL_GENERATORS[name]((4, 3000), 5)
    first = topk(logits, 300)
    second = topk(logits.clone(), 300)
    assert torch.equal(first, second)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ADVERSARIAL_GENERATORS))
def test_topk_exact_on_131072_column_rows(name):
    width, k = 131072, 2048
    logits = ADVERSARIAL_GENERATORS[name]((2, width), 3)
    starts = int32([0, 1000])
    ends = int32([width, width - 7])
    indices = topk(with_garbage_past_ends(logits, ends, starts=starts), k, starts=starts, ends=ends)
    assert count_topk_errors(logits, indices, k, starts=starts, ends=ends) == 0


@pytest.mark.slow
def test_topk_on_512_expanded_rows_of_131072_columns():
    width, k = 131072, 2048
    row = ADVERSARIAL_GENERATORS["one_bin"]((1, width), 9)
    indices = topk(row.expand(512, width), k)
    assert_topk_exact(row, indices[:1], k)
    assert torch.equal(indices, indices[:1].expand(512, k))


@pytest.mark.parametrize("max_chunk_elements", [1, 20, 30, 69, 70, 71, 10**9])
def test_row_chunking_does_not_change_the_result(max_chunk_elements):
    logits = tie_heavy_logits(7, 10, 0)
    starts, ends = random_bounds(7, 10, 1)
    expected = brute_force_topk(logits, 4, starts, ends)
    out = torch.full((7, 4), POISON, dtype=torch.int32)
    reference.topk(logits, 4, starts, ends, out, max_chunk_elements=max_chunk_elements)
    assert torch.equal(out, expected)


def _views(base: torch.Tensor) -> dict[str, torch.Tensor]:
    """Strided, offset, transposed and stride-0 views holding the same values as ``base [R, C]``."""
    num_rows, width = base.shape
    strided = torch.full((num_rows, 3 * width), 1e20)
    strided[:, ::3] = base
    offset = torch.full((num_rows + 3, width + 5), 1e20)
    offset[2 : 2 + num_rows, 1 : 1 + width] = base
    transposed = base.t().contiguous().t()
    return {
        "column_strided": strided[:, ::3],
        "offset": offset[2 : 2 + num_rows, 1 : 1 + width],
        "transposed": transposed,
    }


@pytest.mark.parametrize("view", ["column_strided", "offset", "transposed"])
def test_topk_reads_views_through_their_strides(view):
    base = ADVERSARIAL_GENERATORS["few_distinct"]((6, 37), 2)
    logits = _views(base)[view]
    assert not logits.is_contiguous()
    starts, ends = random_bounds(6, 37, 3)
    assert torch.equal(topk(logits, 9), brute_force_topk(base, 9))
    assert torch.equal(topk(logits, 9, starts=starts, ends=ends), brute_force_topk(base, 9, starts, ends))


def test_topk_on_expanded_rows_with_stride_zero():
    row = ADVERSARIAL_GENERATORS["relu_sum"]((1, 50), 4)
    logits = row.expand(5, 50)
    assert logits.stride(0) == 0
    starts = int32([0, 3, 10, 25, 50])
    ends = int32([50, 40, 10, 50, 50])
    assert torch.equal(topk(logits, 8, starts=starts, ends=ends), brute_force_topk(logits, 8, starts, ends))


@pytest.mark.parametrize("garbage", [(math.nan,), (1e30,), (math.inf,), (math.nan, 1e30, -math.inf)])
def test_topk_ignores_garbage_outside_bounds(garbage):
    logits = ADVERSARIAL_GENERATORS["tiny_difference"]((8, 90), 6)
    starts, ends = random_bounds(8, 90, 7)
    dirty = with_garbage_past_ends(logits, ends, garbage, starts=starts)
    indices = topk(dirty, 20, starts=starts, ends=ends)
    assert torch.equal(indices, topk(logits, 20, starts=starts, ends=ends))
    assert count_topk_errors(logits, indices, 20, starts=starts, ends=ends) == 0


def test_topk_with_only_ends_or_only_starts():
    logits = tie_heavy_logits(4, 30, 8)
    ends = int32([30, 0, 5, 17])
    starts = int32([0, 30, 5, 12])
    assert torch.equal(topk(logits, 7, ends=ends), brute_force_topk(logits, 7, None, ends))
    assert torch.equal(topk(logits, 7, starts=starts), brute_force_topk(logits, 7, starts, None))


def test_topk_pads_with_minus_one_after_ascending_columns():
    nan, inf = math.nan, math.inf
    logits = torch.tensor(
        [
            [nan, nan, nan, nan, nan],
            [-inf, 2.0, nan, -1.0, -inf],
            [0.0, -0.0, 0.0, -0.0, 0.0],
            [inf, 1.0, inf, 3.0, -inf],
        ]
    )
    expected = int32(
        [
            [-1, -1, -1, -1, -1, -1],
            [1, 3, -1, -1, -1, -1],
            [0, 1, 2, 3, 4, -1],
            [0, 1, 2, 3, -1, -1],
        ]
    )
    assert torch.equal(topk(logits, 6), expected)
    assert torch.equal(topk(logits, 3), int32([[-1, -1, -1], [1, 3, -1], [0, 1, 2], [0, 2, 3]]))


def test_topk_breaks_signed_zero_ties_by_column_not_by_sign():
    logits = torch.tensor([[-0.0, 0.0, -0.0, 0.0, -1.0]])
    assert torch.equal(topk(logits, 2), int32([[0, 1]]))
    assert torch.equal(topk(logits, 2, starts=int32([1]), ends=int32([5])), int32([[0, 1]]))


def test_topk_indices_are_relative_to_starts():
    logits = torch.arange(10, dtype=torch.float32).repeat(2, 1)
    assert torch.equal(topk(logits, 3, starts=int32([4, 0]), ends=int32([8, 3])), int32([[1, 2, 3], [0, 1, 2]]))


@pytest.mark.parametrize("num_rows, width", [(0, 10), (3, 0), (0, 0)])
def test_topk_handles_zero_sized_logits(num_rows, width):
    logits = torch.empty(num_rows, width)
    out = torch.full((num_rows, 4), POISON, dtype=torch.int32)
    zeros = torch.zeros(num_rows, dtype=torch.int32)
    result = topk(logits, 4, starts=zeros, ends=zeros, out=out)
    assert result is out
    assert torch.equal(out, torch.full((num_rows, 4), -1, dtype=torch.int32))


def test_topk_handles_empty_rows_among_full_ones():
    logits = tie_heavy_logits(4, 12, 9)
    starts = int32([0, 5, 12, 3])
    ends = int32([0, 5, 12, 12])
    indices = topk(logits, 5, starts=starts, ends=ends)
    assert torch.equal(indices[:3], torch.full((3, 5), -1, dtype=torch.int32))
    assert torch.equal(indices, brute_force_topk(logits, 5, starts, ends))


def test_topk_writes_every_entry_of_out_and_returns_it():
    logits = tie_heavy_logits(5, 20, 10)
    out = torch.full((5, 25), POISON, dtype=torch.int32)
    assert topk(logits, 25, out=out) is out
    assert torch.equal(out, brute_force_topk(logits, 25))


def test_topk_writes_only_its_window_of_a_larger_out_buffer():
    logits = tie_heavy_logits(4, 30, 11)
    storage = torch.full((6, 12), POISON, dtype=torch.int32)
    out = storage[1:5, 2:9]
    topk(logits, 7, out=out)
    assert torch.equal(out, brute_force_topk(logits, 7))
    untouched = torch.ones_like(storage, dtype=torch.bool)
    untouched[1:5, 2:9] = False
    assert bool((storage[untouched] == POISON).all())


def test_topk_writes_a_transposed_out():
    logits = tie_heavy_logits(4, 30, 12)
    out = torch.full((7, 4), POISON, dtype=torch.int32).t()
    topk(logits, 7, out=out)
    assert torch.equal(out, brute_force_topk(logits, 7))


def test_topk_backend_reference_matches_auto():
    logits = tie_heavy_logits(3, 50, 13)
    assert torch.equal(topk(logits, 10, backend="reference"), topk(logits, 10))


def expected_decode_ends(seq_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    if seq_lens.dim() == 2:
        return seq_lens.reshape(-1)
    return int32([max(int(length) - next_n + t + 1, 0) for length in seq_lens for t in range(next_n)])


@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_topk_decode_with_request_lengths(next_n):
    seq_lens = int32([0, 1, 3, 10, 57, 60])
    width, k = 60, 9
    ends = expected_decode_ends(seq_lens, next_n)
    logits = ADVERSARIAL_GENERATORS["one_bin"]((len(seq_lens) * next_n, width), next_n)
    dirty = with_garbage_past_ends(logits, ends)
    out = torch.full((len(seq_lens) * next_n, k), POISON, dtype=torch.int32)
    assert topk_decode(dirty, seq_lens, next_n, k, out=out) is out
    assert torch.equal(out, brute_force_topk(logits, k, None, ends))


@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_topk_decode_with_per_row_lengths(next_n):
    rng = torch.Generator().manual_seed(next_n)
    seq_lens = torch.randint(0, 41, (5, next_n), generator=rng, dtype=torch.int32)
    logits = ADVERSARIAL_GENERATORS["relu_sum"]((5 * next_n, 40), next_n)
    dirty = with_garbage_past_ends(logits, seq_lens.reshape(-1))
    indices = topk_decode(dirty, seq_lens, next_n, 12)
    assert torch.equal(indices, brute_force_topk(logits, 12, None, seq_lens.reshape(-1)))


def test_topk_decode_clamps_rows_of_requests_shorter_than_next_n():
    logits = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8)
    indices = topk_decode(logits, int32([2, 6]), 4, 8)
    visible = (indices >= 0).sum(dim=1)
    assert visible.tolist() == [0, 0, 1, 2, 3, 4, 5, 6]
    assert torch.equal(indices[5], int32([0, 1, 2, 3, -1, -1, -1, -1]))


def test_topk_decode_handles_zero_requests():
    assert topk_decode(torch.empty(0, 16), torch.empty(0, dtype=torch.int32), 2, 4).shape == (0, 4)


def slots_by_loop(indices, block_table, block_size, row_to_request) -> torch.Tensor:
    result = []
    for r, row in enumerate(indices.tolist()):
        table = block_table[int(row_to_request[r])].tolist()
        result.append([-1 if p == -1 else table[p // block_size] * block_size + p % block_size for p in row])
    return torch.tensor(result, dtype=torch.int32).reshape(indices.shape)


@pytest.mark.parametrize("block_size", [1, 3, 64])
def test_indices_to_slots_matches_a_python_loop(block_size):
    rng = torch.Generator().manual_seed(block_size)
    num_requests, max_blocks, num_rows, k = 3, 5, 7, 6
    block_table = torch.randperm(40, generator=rng)[: num_requests * max_blocks].reshape(num_requests, max_blocks)
    block_table = block_table.to(torch.int32)
    row_to_request = torch.randint(0, num_requests, (num_rows,), generator=rng, dtype=torch.int32)
    indices = torch.randint(-1, max_blocks * block_size, (num_rows, k), generator=rng, dtype=torch.int32)
    expected = slots_by_loop(indices, block_table, block_size, row_to_request)
    assert torch.equal(indices_to_slots(indices, block_table, block_size, row_to_request), expected)


def test_indices_to_slots_keeps_padding_and_handles_empty_tables():
    no_pages = torch.empty(2, 0, dtype=torch.int32)
    indices = torch.full((3, 4), -1, dtype=torch.int32)
    assert torch.equal(indices_to_slots(indices, no_pages, 64, int32([0, 1, 1])), indices)
    empty = torch.empty(0, 4, dtype=torch.int32)
    assert indices_to_slots(empty, no_pages, 64, torch.empty(0, dtype=torch.int32)).shape == (0, 4)


def test_indices_to_slots_maps_the_last_position_of_the_last_page():
    block_table = int32([[5, 9]])
    slots = indices_to_slots(int32([[127, 64, 63]]), block_table, 64, int32([0]))
    assert slots.tolist() == [[9 * 64 + 63, 9 * 64, 5 * 64 + 63]]


LOGITS = torch.zeros(3, 8)


def topk_call(**overrides):
    arguments = {"logits": LOGITS, "k": 2, "starts": None, "ends": None}
    arguments.update(overrides)
    logits, k = arguments.pop("logits"), arguments.pop("k")
    return lambda out: topk(logits, k, out=out, **arguments)


TOPK_ERRORS = [
    ("logits_not_tensor", topk_call(logits=[[1.0]]), TypeError, "logits"),
    ("logits_float16", topk_call(logits=LOGITS.half()), TypeError, "logits"),
    ("logits_1d", topk_call(logits=torch.zeros(8)), ValueError, "logits"),
    ("logits_3d", topk_call(logits=torch.zeros(3, 8, 1)), ValueError, "logits"),
    ("k_zero", topk_call(k=0), ValueError, "k"),
    ("k_float", topk_call(k=2.0), TypeError, "k"),
    ("k_bool", topk_call(k=True), TypeError, "k"),
    ("k_past_int32", topk_call(k=10**12), ValueError, "k must be <= 2\\*\\*31 - 1"),
    ("k_just_past_int32", topk_call(k=2**31), ValueError, "k must be <= 2\\*\\*31 - 1"),
    ("starts_int16", topk_call(starts=torch.zeros(3, dtype=torch.int16)), TypeError, "starts"),
    ("starts_length", topk_call(starts=torch.zeros(4, dtype=torch.int32)), ValueError, "starts"),
    ("starts_2d", topk_call(starts=torch.zeros(3, 1, dtype=torch.int32)), ValueError, "starts"),
    ("starts_negative", topk_call(starts=int32([0, -1, 0])), ValueError, "starts"),
    ("starts_past_ends", topk_call(starts=int32([0, 5, 0]), ends=int32([8, 4, 8])), ValueError, "ends"),
    ("starts_past_width", topk_call(starts=int32([0, 9, 0])), ValueError, "starts"),
    ("ends_int16", topk_call(ends=torch.zeros(3, dtype=torch.int16)), TypeError, "ends"),
    ("ends_length", topk_call(ends=torch.zeros(2, dtype=torch.int32)), ValueError, "ends"),
    ("ends_past_width", topk_call(ends=int32([8, 9, 8])), ValueError, "ends"),
    ("ends_negative", topk_call(ends=int32([8, -1, 8])), ValueError, "ends"),
    ("starts_other_device", topk_call(starts=torch.zeros(3, dtype=torch.int32, device="meta")), ValueError, "starts"),
    ("backend_unknown", topk_call(backend="cuda"), ValueError, "backend"),
    ("backend_triton_on_cpu", topk_call(backend="triton"), ValueError, "backend"),
]


@pytest.mark.parametrize("call, error, match", [c[1:] for c in TOPK_ERRORS], ids=[c[0] for c in TOPK_ERRORS])
@pytest.mark.usefixtures("without_interpreter")
def test_topk_rejects_bad_arguments_without_writing(call, error, match):
    out = torch.full((3, 2), POISON, dtype=torch.int32)
    with pytest.raises(error, match=match):
        call(out)
    assert bool((out == POISON).all())


@pytest.mark.parametrize(
    "out",
    [
        torch.full((3, 2), POISON, dtype=torch.int64),
        torch.full((3, 3), POISON, dtype=torch.int32),
        torch.full((4, 2), POISON, dtype=torch.int32),
        torch.full((6,), POISON, dtype=torch.int32),
        torch.full((3, 2), POISON, dtype=torch.int32, device="meta"),
    ],
    ids=["int64", "over_allocated_columns", "over_allocated_rows", "flat", "other_device"],
)
def test_topk_rejects_bad_out_without_writing(out):
    with pytest.raises((TypeError, ValueError), match="out"):
        topk(LOGITS, 2, out=out)
    if out.device.type != "meta":
        assert bool((out == POISON).all())


DECODE_LOGITS = torch.zeros(4, 8)
DECODE_SEQ_LENS = int32([3, 8])


def decode_call(logits=DECODE_LOGITS, seq_lens=DECODE_SEQ_LENS, next_n=2, k=2, **kwargs):
    return lambda out: topk_decode(logits, seq_lens, next_n, k, out=out, **kwargs)


DECODE_ERRORS = [
    ("logits_float64", decode_call(logits=DECODE_LOGITS.double()), TypeError, "logits"),
    ("logits_rows", decode_call(seq_lens=int32([3, 8, 1])), ValueError, "logits"),
    ("seq_lens_float", decode_call(seq_lens=torch.tensor([3.0, 8.0])), TypeError, "seq_lens"),
    ("seq_lens_3d", decode_call(seq_lens=torch.zeros(2, 2, 1, dtype=torch.int32)), ValueError, "seq_lens"),
    ("seq_lens_2d_width", decode_call(seq_lens=torch.zeros(2, 3, dtype=torch.int32)), ValueError, "seq_lens"),
    ("seq_lens_past_width", decode_call(seq_lens=int32([3, 9])), ValueError, "seq_lens"),
    ("seq_lens_2d_past_width", decode_call(seq_lens=int32([[1, 2], [9, 3]])), ValueError, "seq_lens"),
    ("seq_lens_negative", decode_call(seq_lens=int32([-1, 8])), ValueError, "seq_lens"),
    ("seq_lens_other_device", decode_call(seq_lens=int32([3, 8]).to("meta")), ValueError, "seq_lens"),
    ("next_n_zero", decode_call(next_n=0), ValueError, "next_n"),
    ("next_n_float", decode_call(next_n=2.0), TypeError, "next_n"),
    ("k_zero", decode_call(k=0), ValueError, "k"),
    ("k_past_int32", decode_call(k=2**31), ValueError, "k must be <="),
    ("backend_unknown", decode_call(backend="fast"), ValueError, "backend"),
]


@pytest.mark.parametrize("call, error, match", [c[1:] for c in DECODE_ERRORS], ids=[c[0] for c in DECODE_ERRORS])
def test_topk_decode_rejects_bad_arguments_without_writing(call, error, match):
    out = torch.full((4, 2), POISON, dtype=torch.int32)
    with pytest.raises(error, match=match):
        call(out)
    assert bool((out == POISON).all())


def test_topk_decode_rejects_over_allocated_out_without_writing():
    out = torch.full((5, 2), POISON, dtype=torch.int32)
    with pytest.raises(ValueError, match="out"):
        decode_call()(out)
    assert bool((out == POISON).all())


SLOT_INDICES = int32([[0, 5, -1], [3, -1, -1]])
SLOT_TABLE = int32([[7, 2], [4, 9]])
SLOT_ROWS = int32([0, 1])

SLOT_ERRORS = [
    ("indices_int16", dict(indices=SLOT_INDICES.short()), TypeError, "indices"),
    ("indices_1d", dict(indices=SLOT_INDICES[0]), ValueError, "indices"),
    ("indices_below_minus_one", dict(indices=int32([[0, -2, -1], [3, -1, -1]])), ValueError, "indices"),
    ("indices_past_table", dict(indices=int32([[0, 8, -1], [3, -1, -1]])), ValueError, "indices"),
    ("block_table_int16", dict(block_table=SLOT_TABLE.short()), TypeError, "block_table"),
    ("block_table_1d", dict(block_table=SLOT_TABLE[0]), ValueError, "block_table"),
    ("block_table_other_device", dict(block_table=SLOT_TABLE.to("meta")), ValueError, "block_table"),
    ("block_size_zero", dict(block_size=0), ValueError, "block_size"),
    ("block_size_float", dict(block_size=4.0), TypeError, "block_size"),
    ("row_to_request_length", dict(row_to_request=int32([0])), ValueError, "row_to_request"),
    ("row_to_request_int16", dict(row_to_request=SLOT_ROWS.short()), TypeError, "row_to_request"),
    ("row_to_request_past_table", dict(row_to_request=int32([0, 2])), ValueError, "row_to_request"),
    ("row_to_request_negative", dict(row_to_request=int32([-1, 0])), ValueError, "row_to_request"),
    ("backend_unknown", dict(backend="gpu"), ValueError, "backend"),
]


@pytest.mark.parametrize("overrides, error, match", [c[1:] for c in SLOT_ERRORS], ids=[c[0] for c in SLOT_ERRORS])
def test_indices_to_slots_rejects_bad_arguments(overrides, error, match):
    arguments = dict(indices=SLOT_INDICES, block_table=SLOT_TABLE, block_size=4, row_to_request=SLOT_ROWS)
    arguments.update(overrides)
    backend = arguments.pop("backend", "auto")
    with pytest.raises(error, match=match):
        indices_to_slots(**arguments, backend=backend)


def test_indices_to_slots_accepts_the_largest_in_table_position():
    assert indices_to_slots(int32([[7, -1, -1], [0, -1, -1]]), SLOT_TABLE, 4, SLOT_ROWS).tolist() == [
        [2 * 4 + 3, -1, -1],
        [4 * 4, -1, -1],
    ]
