"""IndexerKCache: byte layout, views over packed and strided page buffers, constructor checks."""

from __future__ import annotations

import pytest
import torch

from dsa_indexer.backend import ENV_VAR
from dsa_indexer.cache import IndexerKCache, bytes_per_token, scale_bytes_per_token, value_bytes_per_token
from dsa_indexer.formats import quantize_fp8, quantize_mxfp4

POISON = 0xA5


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.mark.parametrize(
    "fmt, head_dim, value_bytes, scale_bytes",
    [("fp8", 128, 128, 4), ("mxfp4", 128, 64, 4), ("fp8", 64, 64, 4), ("mxfp4", 64, 32, 4), ("mxfp4", 32, 16, 4),
     ("mxfp4", 256, 128, 8)],
)
def test_bytes_per_token_follow_the_layout(fmt, head_dim, value_bytes, scale_bytes):
    assert value_bytes_per_token(fmt, head_dim) == value_bytes
    assert scale_bytes_per_token(fmt, head_dim) == scale_bytes
    assert bytes_per_token(fmt, head_dim) == value_bytes + scale_bytes
    cache = IndexerKCache(3, block_size=8, head_dim=head_dim, fmt=fmt)
    assert (cache.value_bytes, cache.scale_bytes) == (value_bytes, scale_bytes)
    assert cache.bytes_per_token == value_bytes + scale_bytes


@pytest.mark.parametrize("fmt, per_token", [("fp8", 132), ("mxfp4", 68)])
def test_default_buffer_is_zeroed_packed_uint8(fmt, per_token):
    cache = IndexerKCache(5, fmt=fmt)
    assert cache.buffer.dtype == torch.uint8 and cache.buffer.shape == (5, 64, per_token)
    assert cache.buffer.is_contiguous() and cache.buffer.eq(0).all()
    assert cache.block_size == 64 and cache.head_dim == 128 and cache.device == torch.device("cpu")
    assert cache.num_slots == 320 and cache.page_stride == 64 * per_token


def strided_buffer(num_blocks: int, block_size: int, per_token: int, page_stride: int, offset: int):
    storage = torch.full((offset + num_blocks * page_stride + 32,), POISON, dtype=torch.uint8)
    buffer = storage.as_strided((num_blocks, block_size, per_token), (page_stride, per_token, 1), offset)
    return storage, buffer


@pytest.mark.parametrize("page_padding, offset", [(0, 0), (52, 0), (8, 12)])
@pytest.mark.parametrize("block_size", [64, 16, 1])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_views_address_the_layout_bytes_of_every_slot(fmt, block_size, page_padding, offset):
    value_bytes, scale_bytes = (128, 4) if fmt == "fp8" else (64, 4)
    page_stride = block_size * (value_bytes + scale_bytes) + page_padding
    num_blocks = 3
    storage, buffer = strided_buffer(num_blocks, block_size, value_bytes + scale_bytes, page_stride, offset)
    cache = IndexerKCache(num_blocks, block_size=block_size, fmt=fmt, buffer=buffer)
    assert cache.buffer is buffer and cache.page_stride == page_stride
    values, scales = cache.values_view(), cache.scales_view()
    assert values.shape == (num_blocks, block_size, value_bytes)
    assert scales.shape == (num_blocks, block_size, scale_bytes)
    slots = num_blocks * block_size
    # Tag every byte with (slot, byte index, which region), then read it back at hand-computed offsets.
    value_tags = (torch.arange(slots * value_bytes) % 251).to(torch.uint8).reshape(values.shape)
    scale_tags = (torch.arange(slots * scale_bytes) % 241 + 3).to(torch.uint8).reshape(scales.shape)
    values.copy_(value_tags)
    scales.copy_(scale_tags)
    expected = torch.full_like(storage, POISON)
    for slot in range(slots):
        page, token = divmod(slot, block_size)
        base = offset + page * page_stride
        start = base + token * value_bytes
        expected[start : start + value_bytes] = value_tags[page, token]
        start = base + block_size * value_bytes + token * scale_bytes
        expected[start : start + scale_bytes] = scale_tags[page, token]
    assert torch.equal(storage, expected)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_deepgemm_view_is_the_4d_alias_of_the_pages(fmt):
    per_token = 132 if fmt == "fp8" else 68
    page_stride = 16 * per_token + 64
    storage, buffer = strided_buffer(4, 16, per_token, page_stride, 4)
    cache = IndexerKCache(4, block_size=16, fmt=fmt, buffer=buffer)
    view = cache.deepgemm_view()
    assert view.shape == (4, 16, 1, per_token)
    assert view.stride() == (page_stride, per_token, per_token, 1)
    assert view.data_ptr() == buffer.data_ptr()
    view[2, 5, 0, 7] = 0x11
    assert storage[4 + 2 * page_stride + 5 * per_token + 7].item() == 0x11


def test_single_page_buffer_reports_the_packed_page_stride():
    storage = torch.zeros(2 * 16 * 132, dtype=torch.uint8)
    buffer = storage.as_strided((1, 16, 132), (5000, 132, 1))
    cache = IndexerKCache(1, block_size=16, buffer=buffer)
    assert cache.page_stride == 16 * 132
    assert cache.values_view().stride() == (16 * 132, 128, 1)


def test_empty_cache():
    cache = IndexerKCache(0, block_size=16, fmt="mxfp4")
    assert cache.num_slots == 0 and cache.buffer.shape == (0, 16, 68)
    assert cache.values_view().shape == (0, 16, 64) and cache.scales_view().shape == (0, 16, 4)


def test_repr_names_the_configuration():
    text = repr(IndexerKCache(2, block_size=32, head_dim=64, fmt="mxfp4"))
    for part in ("num_blocks=2", "block_size=32", "head_dim=64", "fmt='mxfp4'", "device=cpu"):
        assert part in text


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_insert_and_gather_methods_run_the_ops(fmt):
    cache = IndexerKCache(3, block_size=16, fmt=fmt)
    k = torch.randn(20, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    slots = torch.cat((torch.arange(32, 48), torch.arange(4, 8)))  # page 2 then page 0
    cache.insert(k, slots)
    block_table = torch.tensor([[2, 0]], dtype=torch.int32)
    values, scales = cache.gather(block_table, torch.tensor([0, 20], dtype=torch.int32))
    if fmt == "fp8":
        expected_values, expected_scales = quantize_fp8(k, block_size=128)
        assert torch.equal(values.view(torch.uint8)[:16], expected_values.view(torch.uint8)[:16])
        assert torch.equal(scales[:16], expected_scales[:16, 0])
    else:
        expected_values, expected_scales = quantize_mxfp4(k)
        assert torch.equal(values[:16], expected_values[:16]) and torch.equal(scales[:16], expected_scales[:16])
    # Positions 16..19 read page 0 tokens 0..3, which were never written: zeros of the fresh cache.
    assert values.view(torch.uint8)[16:].eq(0).all()
    out = (torch.empty_like(values), torch.empty_like(scales))
    returned = cache.gather(block_table, torch.tensor([0, 16], dtype=torch.int32), out=out)
    assert returned[0] is out[0] and returned[1] is out[1]
    sized = cache.gather(block_table, torch.tensor([0, 3], dtype=torch.int32), num_tokens=5)
    assert sized[0].shape[0] == 5


def packed_buffer(num_blocks=2, block_size=16, per_token=132, dtype=torch.uint8):
    return torch.zeros(num_blocks, block_size, per_token, dtype=dtype)


def token_major_buffer():
    return torch.zeros(16, 2, 132, dtype=torch.uint8).transpose(0, 1)  # token stride 264


def byte_strided_buffer():
    return torch.zeros(2, 16, 264, dtype=torch.uint8)[:, :, ::2]


def overlapping_pages_buffer(storage=None):
    storage = torch.zeros(17 * 132, dtype=torch.uint8) if storage is None else storage
    return storage.as_strided((2, 16, 132), (132, 132, 1))  # page 1 starts at token 1 of page 0


CONSTRUCTOR_ERRORS = [
    # (positional num_blocks, keyword arguments, exception, match)
    (-1, {}, ValueError, "num_blocks must be >= 0"),
    (2.0, {}, TypeError, "num_blocks must be an int"),
    (True, {}, TypeError, "num_blocks must be an int"),
    (2, dict(block_size=0), ValueError, "block_size must be >= 1"),
    (2, dict(block_size="64"), TypeError, "block_size must be an int"),
    (2, dict(head_dim=0), ValueError, "head_dim must be >= 1"),
    (2, dict(fmt="fp4"), ValueError, "fmt must be one of"),
    (2, dict(fmt="mxfp4", head_dim=48), ValueError, "head_dim must be a multiple of 32"),
    (2, dict(block_size=16, buffer=packed_buffer(dtype=torch.int8)), TypeError, "buffer must have dtype uint8"),
    (2, dict(block_size=16, buffer=packed_buffer(per_token=68)), ValueError, "buffer must have shape"),
    (2, dict(block_size=16, buffer=packed_buffer(num_blocks=3)), ValueError, "buffer must have shape"),
    (2, dict(block_size=16, buffer=token_major_buffer()), ValueError, "buffer must have token stride 132"),
    (2, dict(block_size=16, buffer=byte_strided_buffer()), ValueError, "token stride 132 and byte stride 1"),
    (2, dict(block_size=16, buffer=overlapping_pages_buffer()), ValueError, "buffer page stride must be >= 2112"),
]


@pytest.mark.parametrize("num_blocks, kwargs, error, match", CONSTRUCTOR_ERRORS)
def test_constructor_rejects_bad_arguments(num_blocks, kwargs, error, match):
    with pytest.raises(error, match=match):
        IndexerKCache(num_blocks, **kwargs)


def test_constructor_leaves_a_rejected_buffer_untouched():
    storage = torch.full((17 * 132,), POISON, dtype=torch.uint8)
    with pytest.raises(ValueError, match="buffer page stride"):
        IndexerKCache(2, block_size=16, buffer=overlapping_pages_buffer(storage))
    assert storage.eq(POISON).all()


@pytest.mark.parametrize("page_padding, offset, match", [(6, 0, "multiple of 4"), (0, 2, "4-byte aligned")])
def test_constructor_rejects_unaligned_pages(page_padding, offset, match):
    page_stride = 16 * 132 + page_padding
    _, buffer = strided_buffer(3, 16, 132, page_stride, offset)
    with pytest.raises(ValueError, match=match):
        IndexerKCache(3, block_size=16, buffer=buffer)


def test_constructor_rejects_a_buffer_on_another_device():
    with pytest.raises(ValueError, match="device"):
        IndexerKCache(2, block_size=4, buffer=torch.zeros(2, 4, 132, dtype=torch.uint8), device="meta")


def test_slots_for_maps_unallocated_pages_and_padding_to_minus_one():
    cache = IndexerKCache(5, block_size=16)
    row = torch.tensor([3, -1, 4, -1], dtype=torch.int32)  # pages 1 and 3 not allocated
    positions = torch.tensor([0, 16, 17, 31, 33, 63, -1, 47])
    assert cache.slots_for(row, positions).tolist() == [48, -1, -1, -1, 65, -1, -1, 79]
    assert cache.slots_for(torch.zeros(0, dtype=torch.int32), torch.tensor([-1])).tolist() == [-1]


@pytest.mark.parametrize(
    "row, positions, error, match",
    [
        ([3, 0], torch.tensor([1.7]), TypeError, "positions must have dtype"),
        ([3, 0], torch.tensor([0, 32]), ValueError, "positions must be -1 or in \\[0, 32\\).*positions\\[1\\] = 32"),
        ([3, 0], torch.tensor([5, -2]), ValueError, "positions\\[1\\] = -2"),
        ([3, 5], torch.tensor([0, 17]), ValueError, "block_table_row entries must be < num_blocks = 5.*\\[1\\] = 5"),
        ([[3, 0]], torch.tensor([0]), ValueError, "block_table_row must have 1 dimensions"),
        ([3, 0], torch.tensor([[0]]), ValueError, "positions must have 1 dimensions"),
    ],
)
def test_slots_for_checks_positions_and_page_ids(row, positions, error, match):
    cache = IndexerKCache(5, block_size=16)
    with pytest.raises(error, match=match):
        cache.slots_for(torch.tensor(row, dtype=torch.int32), positions)


def test_slots_for_without_value_checks_gives_minus_one_for_out_of_range(monkeypatch):
    monkeypatch.setenv("DSA_INDEXER_SKIP_VALUE_CHECKS", "1")
    cache = IndexerKCache(5, block_size=16)
    row = torch.tensor([3, 5], dtype=torch.int32)
    assert cache.slots_for(row, torch.tensor([1, 17, 32, -7, 10**12])).tolist() == [49, -1, -1, -1, -1]


def test_slot_helpers_and_capacity_accounting():
    cache = IndexerKCache(5, block_size=4, fmt="mxfp4")
    assert cache.nbytes == 5 * 4 * 68 and cache.num_slots == 20
    assert IndexerKCache.blocks_for(9, block_size=4) == 3
    row = torch.tensor([3, 0, 4], dtype=torch.int32)
    positions = torch.tensor([0, 3, 4, 9, -1])
    assert cache.slots_for(row, positions).tolist() == [12, 15, 0, 17, -1]
    storage = torch.zeros(3 * 300 + 8, dtype=torch.uint8)
    padded = storage.as_strided((3, 2, 132), (300, 132, 1), 8)
    assert IndexerKCache(3, block_size=2, buffer=padded).nbytes == 2 * 300 + 2 * 132


def test_scale_formats_default_and_unknown_ones_are_refused():
    assert IndexerKCache(1, block_size=4).scale_fmt == "fp32"
    assert IndexerKCache(1, block_size=4, fmt="mxfp4").scale_fmt == "ue8m0"
    cache = IndexerKCache(1, block_size=4, scale_fmt="mxfp8")
    assert (cache.scale_fmt, cache.bytes_per_token) == ("mxfp8", 132)
    assert "scale_fmt='mxfp8'" in repr(cache)
    with pytest.raises(ValueError, match=r"scale_fmt must be one of \('fp32', 'mxfp8'\) for fmt='fp8', got 'ue8m0'"):
        IndexerKCache(1, block_size=4, scale_fmt="ue8m0")
    with pytest.raises(ValueError, match=r"scale_fmt must be one of \('ue8m0',\) for fmt='mxfp4', got 'mxfp8'"):
        IndexerKCache(1, block_size=4, fmt="mxfp4", scale_fmt="mxfp8")


def test_gather_without_num_tokens_is_the_same_with_value_checks_off(monkeypatch):
    cache = IndexerKCache(3, block_size=4)
    cache.insert(torch.randn(12, 128), torch.arange(12))
    table = torch.tensor([[2, 0, 1], [1, 2, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    checked = cache.gather(table, cu)
    monkeypatch.setenv("DSA_INDEXER_SKIP_VALUE_CHECKS", "1")
    unchecked = cache.gather(table, cu)
    for a, b in zip(checked, unchecked):
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
