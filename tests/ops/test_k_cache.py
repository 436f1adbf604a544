"""K cache insert/gather: raw bytes at independently computed offsets of poisoned, strided page buffers."""

from __future__ import annotations

import struct

import pytest
import torch

from dsa_indexer.backend import ENV_VAR
from dsa_indexer.cache import IndexerKCache
from dsa_indexer.formats import quantize_fp8, quantize_mxfp4
from dsa_indexer.ops.k_cache import gather_k, insert_k
from dsa_indexer.ops.k_cache.reference import rows_to_write

POISON = 0xA5
HEAD_DIM = 128


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def token_layout(fmt: str, head_dim: int = HEAD_DIM) -> tuple[int, int]:
    """(value bytes, scale bytes) of one token, from DESIGN.md §3."""
    return (head_dim, 4) if fmt == "fp8" else (head_dim // 2, -(-head_dim // 128) * 4)


class PoisonedCache:
    """A cache whose pages sit ``page_padding`` bytes apart inside a 0xA5-filled storage, at ``offset``."""

    def __init__(self, num_blocks: int, block_size: int, fmt: str, *, page_padding: int = 24, offset: int = 8):
        self.value_bytes, self.scale_bytes = token_layout(fmt)
        self.block_size = block_size
        self.page_stride = block_size * (self.value_bytes + self.scale_bytes) + page_padding
        self.offset = offset
        self.storage = torch.full((offset + num_blocks * self.page_stride + 16,), POISON, dtype=torch.uint8)
        buffer = self.storage.as_strided(
            (num_blocks, block_size, self.value_bytes + self.scale_bytes),
            (self.page_stride, self.value_bytes + self.scale_bytes, 1),
            offset,
        )
        self.cache = IndexerKCache(num_blocks, block_size=block_size, fmt=fmt, buffer=buffer)

    def value_range(self, slot: int) -> slice:
        page, token = divmod(slot, self.block_size)
        start = self.offset + page * self.page_stride + token * self.value_bytes
        return slice(start, start + self.value_bytes)

    def scale_range(self, slot: int) -> slice:
        page, token = divmod(slot, self.block_size)
        start = self.offset + page * self.page_stride + self.block_size * self.value_bytes + token * self.scale_bytes
        return slice(start, start + self.scale_bytes)


def quantized_row_bytes(k: torch.Tensor, fmt: str, **fp8_options) -> tuple[list[bytes], list[bytes]]:
    """Per row: (value bytes, scale bytes) from the formats module; FP8 scales packed with struct."""
    if fmt == "fp8":
        values, scales = quantize_fp8(k, block_size=k.shape[1], **fp8_options)
        value_rows = [bytes(row) for row in values.view(torch.uint8).tolist()]
        return value_rows, [struct.pack("<f", scale) for scale in scales[:, 0].tolist()]
    packed, scales = quantize_mxfp4(k)
    return [bytes(row) for row in packed.tolist()], [bytes(row) for row in scales.tolist()]


def expected_after_insert(poisoned: PoisonedCache, before: torch.Tensor, slots: list[int], rows) -> torch.Tensor:
    """``before`` with each row's bytes written at its slot, rows in order (a later row overwrites)."""
    expected = before.clone()
    value_rows, scale_rows = rows
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        expected[poisoned.value_range(slot)] = torch.tensor(list(value_rows[row]), dtype=torch.uint8)
        expected[poisoned.scale_range(slot)] = torch.tensor(list(scale_rows[row]), dtype=torch.uint8)
    return expected


def random_k(rows: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-3, 3, 7)[torch.randint(0, 7, (rows, 1), generator=gen)]
    return (torch.randn(rows, HEAD_DIM, generator=gen) * magnitudes).to(dtype)


def strided_rows(k: torch.Tensor, layout: str) -> torch.Tensor:
    """``k`` copied into a non-contiguous layout with the same values."""
    if layout == "contiguous":
        return k
    if layout == "row_padded":
        wide = torch.zeros(k.shape[0], k.shape[1] + 40, dtype=k.dtype)
        view = wide[:, 40:]
    else:
        wide = torch.zeros(k.shape[0], k.shape[1] * 2, dtype=k.dtype)
        view = wide[:, ::2]
    view.copy_(k)
    return view


@pytest.mark.parametrize("layout", ["contiguous", "row_padded", "element_strided"])
@pytest.mark.parametrize("block_size", [64, 16, 1])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_insert_writes_each_row_at_its_slot_and_nothing_else(fmt, block_size, layout):
    num_blocks = max(2, 40 // block_size)
    poisoned = PoisonedCache(num_blocks, block_size, fmt)
    gen = torch.Generator().manual_seed(block_size)
    slots = torch.randperm(poisoned.cache.num_slots, generator=gen)[:20]
    slots[[2, 7, 11]] = -1
    k = random_k(20, seed=block_size)
    before = poisoned.storage.clone()
    insert_k(strided_rows(k, layout), poisoned.cache, slots)
    expected = expected_after_insert(poisoned, before, slots.tolist(), quantized_row_bytes(k, fmt))
    assert torch.equal(poisoned.storage, expected)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("k_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_insert_accepts_every_k_and_slot_dtype(fmt, k_dtype, slot_dtype):
    poisoned = PoisonedCache(3, 16, fmt)
    k = random_k(9, seed=4, dtype=k_dtype)
    slots = torch.tensor([5, 0, 47, -3, 16, 31, 32, 1, -1], dtype=slot_dtype)
    before = poisoned.storage.clone()
    insert_k(k, poisoned.cache, slots)
    expected = expected_after_insert(poisoned, before, slots.tolist(), quantized_row_bytes(k, fmt))
    assert torch.equal(poisoned.storage, expected)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_insert_with_only_padding_slots_touches_nothing(fmt):
    poisoned = PoisonedCache(2, 16, fmt)
    before = poisoned.storage.clone()
    insert_k(random_k(4, seed=1), poisoned.cache, torch.tensor([-1, -1, -7, -(2**40)]))
    insert_k(random_k(0, seed=1), poisoned.cache, torch.empty(0, dtype=torch.int64))
    assert torch.equal(poisoned.storage, before)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_insert_duplicate_slots_keep_the_last_row(fmt):
    poisoned = PoisonedCache(2, 16, fmt)
    k = random_k(5, seed=2)
    slots = [3, 9, 3, -1, 3]
    before = poisoned.storage.clone()
    insert_k(k, poisoned.cache, torch.tensor(slots))
    expected = expected_after_insert(poisoned, before, slots, quantized_row_bytes(k, fmt))
    assert torch.equal(poisoned.storage, expected)
    assert expected[poisoned.value_range(3)].tolist() != list(quantized_row_bytes(k[:1], fmt)[0][0])


def test_rows_to_write_keeps_the_last_row_of_each_slot_and_drops_padding():
    # Checked directly: on CPU, index_put_ happens to apply duplicates in order, so the bytes alone
    # cannot show whether the reference resolves duplicates itself (CUDA gives no order).
    rows = rows_to_write(torch.tensor([3, 9, 3, -1, 3, 0, -1, 9], dtype=torch.int32))
    assert rows.dtype == torch.int64 and rows.tolist() == [5, 4, 7]


def test_insert_fp8_scale_options_reach_the_quantiser():
    poisoned = PoisonedCache(1, 16, "fp8")
    k = random_k(4, seed=3) * 1e-3
    slots = [0, 1, 2, 3]
    options = dict(scale_fmt="fp32", amax_floor=0.5)
    before = poisoned.storage.clone()
    insert_k(k, poisoned.cache, torch.tensor(slots), **options)
    expected = expected_after_insert(poisoned, before, slots, quantized_row_bytes(k, "fp8", **options))
    assert torch.equal(poisoned.storage, expected)
    default = expected_after_insert(poisoned, before, slots, quantized_row_bytes(k, "fp8"))
    assert not torch.equal(expected, default), "the options must change the bytes for this test to mean anything"


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_insert_nonfinite_rows_store_the_format_encoding(fmt):
    poisoned = PoisonedCache(1, 4, fmt)
    k = random_k(3, seed=5).float()
    k[0, 3], k[1, 0], k[1, 77], k[2] = float("nan"), float("inf"), float("-inf"), float("nan")
    before = poisoned.storage.clone()
    insert_k(k, poisoned.cache, torch.tensor([2, 0, 1]))
    expected = expected_after_insert(poisoned, before, [2, 0, 1], quantized_row_bytes(k, fmt))
    assert torch.equal(poisoned.storage, expected)


def layout_requests(lengths: list[int], block_size: int, num_blocks: int, seed: int):
    """Give each request distinct pages in a shuffled order; return (block_table int32, cu int32, slots per request)."""
    gen = torch.Generator().manual_seed(seed)
    pages_needed = [-(-length // block_size) for length in lengths]
    max_blocks = max(pages_needed + [1]) + 1
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    assert sum(pages_needed) <= num_blocks
    table = [[-1] * max_blocks for _ in lengths]  # unused entries stay -1: they must never be read
    request_slots = []
    for request, (length, pages) in enumerate(zip(lengths, pages_needed)):
        for column in range(pages):
            table[request][column] = pool.pop()
        request_slots.append([table[request][p // block_size] * block_size + p % block_size for p in range(length)])
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    return torch.tensor(table, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32), request_slots


def gather_oracle(poisoned: PoisonedCache, block_table: torch.Tensor, cu_seq_lens: torch.Tensor):
    """Rows of (value bytes, scale bytes) read from the raw storage, request after request."""
    values, scales = [], []
    cu = cu_seq_lens.tolist()
    for request in range(len(cu) - 1):
        for position in range(cu[request + 1] - cu[request]):
            page = int(block_table[request, position // poisoned.block_size])
            slot = page * poisoned.block_size + position % poisoned.block_size
            values.append(poisoned.storage[poisoned.value_range(slot)].tolist())
            scales.append(poisoned.storage[poisoned.scale_range(slot)].tolist())
    return values, scales


def as_row_bytes(values: torch.Tensor, scales: torch.Tensor) -> tuple[list, list]:
    if values.dtype == torch.float8_e4m3fn:
        # Bytes through integer views: random bytes may spell NaNs whose payload a float round trip would change.
        return values.view(torch.uint8).tolist(), scales.contiguous().view(torch.uint8).reshape(-1, 4).tolist()
    return values.tolist(), scales.tolist()


@pytest.mark.parametrize("block_size", [64, 16, 1])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_insert_then_gather_returns_quantized_rows_in_request_order(fmt, block_size):
    lengths = [5, 0, 2 * block_size + 3, 1, block_size]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    poisoned = PoisonedCache(num_blocks, block_size, fmt)
    block_table, cu_seq_lens, request_slots = layout_requests(lengths, block_size, num_blocks, seed=block_size)
    k = random_k(sum(lengths), seed=7)
    slots = torch.tensor([slot for slots in request_slots for slot in slots], dtype=torch.int64)
    shuffle = torch.randperm(len(slots), generator=torch.Generator().manual_seed(0))
    padded_k = torch.cat((k[shuffle], random_k(3, seed=8)))
    padded_slots = torch.cat((slots[shuffle], torch.full((3,), -1)))
    insert_k(padded_k, poisoned.cache, padded_slots)
    values, scales = gather_k(poisoned.cache, block_table, cu_seq_lens)
    if fmt == "fp8":
        expected_values, expected_scales = quantize_fp8(k, block_size=HEAD_DIM)
        assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
        assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))
        assert torch.equal(scales, expected_scales[:, 0])
    else:
        expected_values, expected_scales = quantize_mxfp4(k)
        assert torch.equal(values, expected_values) and torch.equal(scales, expected_scales)


@pytest.mark.parametrize("block_size", [64, 16, 1])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_gather_copies_raw_bytes_of_permuted_pages(fmt, block_size):
    lengths = [3, block_size + 1, 0, 0, 2 * block_size]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 2
    poisoned = PoisonedCache(num_blocks, block_size, fmt)
    poisoned.storage.copy_(torch.randint(0, 256, poisoned.storage.shape, generator=torch.Generator().manual_seed(1)))
    block_table, cu_seq_lens, _ = layout_requests(lengths, block_size, num_blocks, seed=3)
    before = poisoned.storage.clone()
    values, scales = gather_k(poisoned.cache, block_table, cu_seq_lens)
    assert as_row_bytes(values, scales) == gather_oracle(poisoned, block_table, cu_seq_lens)
    assert torch.equal(poisoned.storage, before)


def poisoned_out(fmt: str, rows: int, *, wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Destinations filled with 0xA5 bytes; ``wide`` gives the values a padded row stride."""
    value_bytes, scale_bytes = token_layout(fmt)
    values_dtype = torch.float8_e4m3fn if fmt == "fp8" else torch.uint8
    width = value_bytes + (24 if wide else 0)
    values = torch.full((rows, width), POISON, dtype=torch.uint8).view(values_dtype)[:, :value_bytes]
    if fmt == "fp8":
        scales = torch.full((rows, 4), POISON, dtype=torch.uint8).view(torch.float32)[:, 0]
    else:
        scales = torch.full((rows, scale_bytes), POISON, dtype=torch.uint8)
    return values, scales


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_gather_into_larger_out_writes_only_the_valid_rows(fmt, wide):
    block_size = 16
    lengths = [7, 0, 20]
    poisoned = PoisonedCache(6, block_size, fmt)
    poisoned.storage.copy_(torch.randint(0, 256, poisoned.storage.shape, generator=torch.Generator().manual_seed(2)))
    block_table, cu_seq_lens, _ = layout_requests(lengths, block_size, 6, seed=4)
    values, scales = poisoned_out(fmt, sum(lengths) + 9, wide=wide)
    result = gather_k(poisoned.cache, block_table, cu_seq_lens, out=(values, scales))
    assert result[0] is values and result[1] is scales
    got_values, got_scales = as_row_bytes(values, scales)
    expected_values, expected_scales = gather_oracle(poisoned, block_table, cu_seq_lens)
    total = sum(lengths)
    assert got_values[:total] == expected_values and got_scales[:total] == expected_scales
    assert all(byte == POISON for row in got_values[total:] + got_scales[total:] for byte in row)
    if wide:
        backing = values.view(torch.uint8).as_strided((values.shape[0], values.stride(0)), (values.stride(0), 1))
        assert backing[:, HEAD_DIM if fmt == "fp8" else HEAD_DIM // 2 :].eq(POISON).all()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_gather_num_tokens_sizes_the_result_with_zero_tail(fmt):
    poisoned = PoisonedCache(3, 16, fmt)
    block_table, cu_seq_lens, _ = layout_requests([4, 9], 16, 3, seed=5)
    values, scales = gather_k(poisoned.cache, block_table, cu_seq_lens, num_tokens=20)
    assert values.shape[0] == 20 and scales.shape[0] == 20
    got_values, got_scales = as_row_bytes(values, scales)
    expected_values, expected_scales = gather_oracle(poisoned, block_table, cu_seq_lens)
    assert got_values[:13] == expected_values and got_scales[:13] == expected_scales
    assert all(byte == 0 for row in got_values[13:] + got_scales[13:] for byte in row)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_gather_of_empty_batches(fmt):
    poisoned = PoisonedCache(2, 16, fmt)
    before = poisoned.storage.clone()
    value_bytes, scale_bytes = token_layout(fmt)
    empty_scales_shape = (0,) if fmt == "fp8" else (0, scale_bytes)
    no_requests = gather_k(poisoned.cache, torch.zeros(0, 3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    all_empty = gather_k(poisoned.cache, torch.full((3, 2), -1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    for values, scales in (no_requests, all_empty):
        assert values.shape == (0, value_bytes) and scales.shape == empty_scales_shape
    out = poisoned_out(fmt, 5)
    gather_k(poisoned.cache, torch.zeros(0, 3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), out=out)
    assert all(byte == POISON for rows in as_row_bytes(*out) for row in rows for byte in row)
    assert torch.equal(poisoned.storage, before)


def test_gather_from_empty_cache_with_empty_requests():
    cache = IndexerKCache(0, block_size=16)
    values, scales = gather_k(cache, torch.zeros(2, 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    assert values.shape == (0, HEAD_DIM) and scales.shape == (0,)


def test_gather_accepts_int64_tables():
    poisoned = PoisonedCache(4, 16, "fp8")
    poisoned.storage.copy_(torch.randint(0, 256, poisoned.storage.shape, generator=torch.Generator().manual_seed(6)))
    block_table, cu_seq_lens, _ = layout_requests([17, 3], 16, 4, seed=6)
    values, scales = gather_k(poisoned.cache, block_table.long(), cu_seq_lens.long())
    assert as_row_bytes(values, scales) == gather_oracle(poisoned, block_table, cu_seq_lens)


def insert_args(fmt: str = "fp8", **overrides):
    poisoned = PoisonedCache(2, 16, fmt)
    args = dict(k=random_k(4, seed=9), cache=poisoned.cache, slot_mapping=torch.tensor([0, 5, -1, 31]))
    args.update(overrides)
    return poisoned, args


INSERT_ERRORS = [
    # (cache format, argument overrides, keyword options, exception, match)
    ("fp8", dict(k=[[0.0] * 128]), {}, TypeError, "k must be a torch.Tensor"),
    ("fp8", dict(k=torch.zeros(4, 128, dtype=torch.int32)), {}, TypeError, "k must have dtype"),
    ("fp8", dict(k=torch.zeros(4, 128).to(torch.float8_e4m3fn)), {}, TypeError, "k must have dtype"),
    ("fp8", dict(k=torch.zeros(4, 64)), {}, ValueError, r"k must have shape \[\*, 128\]"),
    ("mxfp4", dict(k=torch.zeros(4, 96)), {}, ValueError, r"k must have shape \[\*, 128\]"),
    ("fp8", dict(k=torch.zeros(4, 1, 128)), {}, ValueError, "k must have shape"),
    ("fp8", dict(k=torch.zeros(4, 128, device="meta")), {}, ValueError, "k is on meta"),
    ("fp8", dict(cache=torch.zeros(2, 16, 132, dtype=torch.uint8)), {}, TypeError, "cache must be an IndexerKCache"),
    ("fp8", dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0, 3.0])), {}, TypeError, "slot_mapping must have dtype"),
    ("fp8", dict(slot_mapping=torch.tensor([0, 1, 2])), {}, ValueError, "slot_mapping must have shape"),
    ("fp8", dict(slot_mapping=torch.tensor([0, 1, 32, 3])), {}, ValueError, "slot_mapping entries must be < "),
    ("mxfp4", dict(slot_mapping=torch.tensor([0, 1, 2, 10**9])), {}, ValueError, "slot_mapping entries must be < "),
    ("fp8", {}, dict(scale_fmt="e8m0"), ValueError, "scale_fmt must be one of"),
    ("mxfp4", {}, dict(scale_fmt="fp32"), ValueError, "scale_fmt must be 'ue8m0'"),
    ("fp8", {}, dict(amax_floor=0.0), ValueError, "amax_floor must be finite and > 0"),
    ("fp8", {}, dict(amax_floor=float("nan")), ValueError, "amax_floor must be finite and > 0"),
    ("fp8", {}, dict(amax_floor=float("inf")), ValueError, "amax_floor must be finite and > 0"),
    ("fp8", {}, dict(amax_floor="1e-4"), TypeError, "amax_floor must be a real number"),
    ("fp8", {}, dict(backend="cpu"), ValueError, "backend must be one of"),
    ("fp8", {}, dict(backend="triton"), ValueError, "backend='triton'"),
]


@pytest.mark.parametrize("fmt, overrides, options, error, match", INSERT_ERRORS)
@pytest.mark.usefixtures("without_interpreter")
def test_insert_rejects_bad_arguments_before_writing(fmt, overrides, options, error, match):
    poisoned, args = insert_args(fmt, **overrides)
    before = poisoned.storage.clone()
    with pytest.raises(error, match=match):
        insert_k(args["k"], args["cache"], args["slot_mapping"], **options)
    assert torch.equal(poisoned.storage, before)


def gather_args(fmt: str = "fp8", **overrides):
    poisoned = PoisonedCache(4, 16, fmt)
    block_table, cu_seq_lens, _ = layout_requests([17, 0, 5], 16, 4, seed=10)
    args = dict(cache=poisoned.cache, block_table=block_table, cu_seq_lens=cu_seq_lens)
    args.update(overrides)
    return poisoned, args


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


GATHER_ERRORS = [
    # (cache format, argument overrides, keyword options, exception, match)
    ("fp8", dict(cache="cache"), {}, TypeError, "cache must be an IndexerKCache"),
    ("fp8", dict(block_table=torch.zeros(3, 3)), {}, TypeError, "block_table must have dtype"),
    ("fp8", dict(block_table=int32([0, 1, 2])), {}, ValueError, "block_table must have 2 dimensions"),
    ("fp8", dict(cu_seq_lens=torch.tensor([0.0, 17.0, 17.0, 22.0])), {}, TypeError, "cu_seq_lens must have dtype"),
    ("fp8", dict(cu_seq_lens=int32([0, 17, 22])), {}, ValueError, r"cu_seq_lens must have shape \[4\]"),
    ("fp8", dict(cu_seq_lens=int32([1, 17, 17, 22])), {}, ValueError, "cu_seq_lens must start at 0"),
    ("fp8", dict(cu_seq_lens=int32([0, 17, 16, 22])), {}, ValueError, "cu_seq_lens must be non-decreasing"),
    ("fp8", dict(cu_seq_lens=int32([0, 17, 17, 22]).to("meta")), {}, ValueError, "cu_seq_lens is on meta"),
    ("fp8", dict(cu_seq_lens=int32([0, 49, 49, 54])), {}, ValueError, "block_table must have at least 4 columns"),
    ("fp8", dict(block_table=int32([[0, 4, -1], [-1, -1, -1], [2, -1, -1]])), {}, ValueError, r"in \[0, 4\)"),
    ("mxfp4", dict(block_table=int32([[0, 1, -1], [-1, -1, -1], [-2, -1, -1]])), {}, ValueError, "block_table entries"),
    ("fp8", {}, dict(num_tokens=21), ValueError, "num_tokens must be >= cu_seq_lens"),
    ("fp8", {}, dict(num_tokens=-1), ValueError, "num_tokens must be >= 0"),
    ("fp8", {}, dict(num_tokens=22.0), TypeError, "num_tokens must be an int"),
    ("fp8", {}, dict(backend="gpu"), ValueError, "backend must be one of"),
]


@pytest.mark.parametrize("fmt, overrides, options, error, match", GATHER_ERRORS)
@pytest.mark.usefixtures("without_interpreter")
def test_gather_rejects_bad_arguments(fmt, overrides, options, error, match):
    poisoned, args = gather_args(fmt, **overrides)
    before = poisoned.storage.clone()
    with pytest.raises(error, match=match):
        gather_k(args["cache"], args["block_table"], args["cu_seq_lens"], **options)
    assert torch.equal(poisoned.storage, before)


def bad_out(fmt: str, case: str):
    values, scales = poisoned_out(fmt, 22)
    if case == "single_tensor":
        return values
    if case == "triple":
        return (values, scales, scales)
    if case == "values_dtype":
        return values.view(torch.uint8) if fmt == "fp8" else values.view(torch.int8), scales
    if case == "values_width":
        return values[:, :-1], scales
    if case == "scales_dtype":
        return values, (scales.view(torch.int32) if fmt == "fp8" else scales.view(torch.int8))
    if case == "scales_rows":
        return values, scales[:-1]
    if case == "too_few_rows":
        return values[:21], scales[:21]
    if case == "scales_device":
        return values, torch.empty(scales.shape, dtype=scales.dtype, device="meta")
    raise AssertionError(case)


OUT_ERRORS = [
    ("single_tensor", TypeError, "out must be a"),
    ("triple", TypeError, "out must be a"),
    ("values_dtype", TypeError, r"out\[0\] \(values\) must have dtype"),
    ("values_width", ValueError, r"out\[0\] \(values\) must have shape"),
    ("scales_dtype", TypeError, r"out\[1\] \(scales\) must have dtype"),
    ("scales_rows", ValueError, r"out\[1\] \(scales\) must have shape"),
    ("too_few_rows", ValueError, "out rows must be >= cu_seq_lens"),
    ("scales_device", ValueError, r"out\[1\] \(scales\) must be on device"),
]


@pytest.mark.parametrize("case, error, match", OUT_ERRORS)
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_gather_rejects_bad_out_without_writing(fmt, case, error, match):
    poisoned, args = gather_args(fmt)
    out = bad_out(fmt, case)
    tensors = [t for t in (out if isinstance(out, tuple) else (out,)) if t.device.type == "cpu"]
    snapshots = [t.clone() for t in tensors]
    with pytest.raises(error, match=match):
        gather_k(args["cache"], args["block_table"], args["cu_seq_lens"], out=out)
    for tensor, snapshot in zip(tensors, snapshots):
        assert torch.equal(tensor.view(torch.uint8), snapshot.view(torch.uint8))


def test_gather_rejects_num_tokens_together_with_out():
    poisoned, args = gather_args("fp8")
    out = poisoned_out("fp8", 22)
    with pytest.raises(ValueError, match="num_tokens must be None when out is given"):
        gather_k(args["cache"], args["block_table"], args["cu_seq_lens"], num_tokens=22, out=out)
    assert all(byte == POISON for rows in as_row_bytes(*out) for row in rows for byte in row)


def test_mxfp8_cache_stores_four_exponent_bytes_and_gathers_them_raw():
    """The same rows in an fp32-scale and an mxfp8 cache: equal value bytes; each mxfp8 scale word is four
    copies of the power-of-two fp32 scale's exponent field; gather returns those words as they are."""
    k = random_k(11, seed=21) * torch.logspace(-4, 4, 11)[:, None]
    slots = torch.tensor([3, 0, 9, -1, 12, 15, 1, 2, 8, 7, 4])
    fp32_cache = IndexerKCache(2, block_size=8)
    mxfp8_cache = IndexerKCache(2, block_size=8, scale_fmt="mxfp8")
    insert_k(k, fp32_cache, slots)
    insert_k(k, mxfp8_cache, slots)
    assert torch.equal(fp32_cache.values_view(), mxfp8_cache.values_view())
    fp32_scales = fp32_cache.scales_view().contiguous().view(torch.int32)  # [2, 8, 1]
    exponent_bytes = ((fp32_scales >> 23) & 0xFF).to(torch.uint8).expand(2, 8, 4)
    assert torch.equal(mxfp8_cache.scales_view(), exponent_bytes)
    block_table = torch.tensor([[1, 0]], dtype=torch.int32)
    values, words = gather_k(mxfp8_cache, block_table, torch.tensor([0, 13], dtype=torch.int32))
    fp32_values, fp32_words = gather_k(fp32_cache, block_table, torch.tensor([0, 13], dtype=torch.int32))
    assert words.dtype == torch.uint8 and words.shape == (13, 4)
    assert torch.equal(values.view(torch.uint8), fp32_values.view(torch.uint8))
    assert torch.equal(words, ((fp32_words.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)[:, None].expand(13, 4))


def test_mxfp8_cache_refuses_fp32_scales_before_writing():
    cache = IndexerKCache(2, block_size=8, scale_fmt="mxfp8")
    with pytest.raises(ValueError, match="scale_fmt must be 'ue8m0' for a cache storing mxfp8"):
        insert_k(random_k(2, seed=22), cache, torch.tensor([0, 1]), scale_fmt="fp32")
    assert not cache.buffer.any()


def test_mxfp4_head_dim_64_rows_are_36_bytes_with_a_padded_scale_word():
    cache = IndexerKCache(1, block_size=4, head_dim=64, fmt="mxfp4")
    k = random_k(4, seed=23)[:, :64]
    insert_k(k, cache, torch.arange(4))
    packed, scales = quantize_mxfp4(k)
    assert cache.bytes_per_token == 36
    assert torch.equal(cache.values_view()[0], packed)
    assert torch.equal(cache.scales_view()[0], scales)
    assert (cache.scales_view()[0, :, 2:] == 127).all()
