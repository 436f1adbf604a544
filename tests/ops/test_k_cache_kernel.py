"""K cache insert/gather: the Triton kernels against the PyTorch reference, byte for byte.

Caches live inside 0xA5-poisoned storage with padded pages and a storage offset, so every byte a
kernel must not touch (other slots, page padding, bytes around the buffer) is checked too. The only
bytes compared loosely are e4m3 NaN values, whose sign the contract leaves unspecified (the reference
itself keeps it on the CPU and loses it on CUDA). Runs on CUDA (``scripts/gpu-check``) and on Triton's
CPU interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsa_indexer.backend import ENV_VAR
from dsa_indexer.cache import IndexerKCache, bytes_per_token
from dsa_indexer.ops.k_cache import gather_k, insert_k

pytest.importorskip("triton", reason="Triton kernel tests need triton (make test installs it)")

from dsa_indexer.ops.k_cache import triton as k_kernels  # noqa: E402  (needs triton)

POISON = 0xA5
NAN = float("nan")
INF = float("inf")


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


class PoisonedCache:
    """A cache whose pages sit ``page_padding`` bytes apart inside 0xA5-filled storage, ``offset`` bytes in."""

    def __init__(self, num_blocks, block_size, fmt, *, device, page_padding=24, offset=8, head_dim=128, scale_fmt=None):
        row_bytes = bytes_per_token(fmt, head_dim)
        page_stride = block_size * row_bytes + page_padding
        self.storage = torch.full((offset + num_blocks * page_stride + 16,), POISON, dtype=torch.uint8, device=device)
        buffer = self.storage.as_strided((num_blocks, block_size, row_bytes), (page_stride, row_bytes, 1), offset)
        self.cache = IndexerKCache(num_blocks, block_size=block_size, head_dim=head_dim, fmt=fmt, scale_fmt=scale_fmt,
                                   buffer=buffer)

    def canonical_storage(self) -> torch.Tensor:
        """The storage bytes on the CPU, every e4m3 NaN value byte made 0x7F (NaN signs are unspecified)."""
        storage = self.storage.cpu().clone()
        if self.cache.fmt == "fp8":
            values = self.cache.values_view()
            region = torch.zeros_like(storage, dtype=torch.bool)
            region.as_strided(values.shape, values.stride(), values.storage_offset()).fill_(True)
            storage[region & ((storage & 0x7F) == 0x7F)] = 0x7F
        return storage

    def twin(self, device=None) -> PoisonedCache:
        """An identical cache in separate storage (on ``device``, default the same)."""
        other = object.__new__(PoisonedCache)
        other.storage = self.storage.to(device or self.storage.device, copy=True)
        buffer = self.cache.buffer
        view = other.storage.as_strided(buffer.shape, buffer.stride(), buffer.storage_offset())
        other.cache = IndexerKCache(self.cache.num_blocks, block_size=self.cache.block_size,
                                    head_dim=self.cache.head_dim, fmt=self.cache.fmt, scale_fmt=self.cache.scale_fmt,
                                    buffer=view)
        return other


def random_k(rows, seed, *, dtype=torch.bfloat16, head_dim=128):
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-3, 3, 7)[torch.randint(0, 7, (rows, 1), generator=gen)]
    return (torch.randn(rows, head_dim, generator=gen) * magnitudes).to(dtype)


def strided_rows(k: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "contiguous":
        return k
    if layout == "row_padded":
        wide = torch.zeros(k.shape[0], k.shape[1] + 40, dtype=k.dtype, device=k.device)
        view = wide[:, 40:]
    else:
        wide = torch.zeros(k.shape[0], k.shape[1] * 2, dtype=k.dtype, device=k.device)
        view = wide[:, ::2]
    view.copy_(k)
    return view


def random_slots(poisoned: PoisonedCache, count: int, seed: int, *, padding_rows=(2, 7, 11)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(poisoned.cache.num_slots, generator=gen)[:count]
    slots[[r for r in padding_rows if r < count]] = -1
    return slots


def insert_both(poisoned: PoisonedCache, k, slots, **options) -> None:
    """Insert with the kernel into ``poisoned`` and with the reference into a twin; storages must match.

    FP8 with ``scale_fmt="fp32"`` is compared with the reference computed on the CPU: on CUDA, torch
    computes the reference's ``amax / 448`` as ``amax * (1 / 448)`` (a CPU-scalar division shortcut),
    which is not the IEEE division the contract specifies and the kernel performs.
    """
    on_cpu = options.get("scale_fmt") == "fp32" and poisoned.storage.device.type == "cuda"
    twin = poisoned.twin("cpu" if on_cpu else None)
    insert_k(k, poisoned.cache, slots, backend="triton", **options)
    insert_k(k.cpu() if on_cpu else k, twin.cache, slots.cpu() if on_cpu else slots, backend="reference", **options)
    got, expected = poisoned.canonical_storage(), twin.canonical_storage()
    assert torch.equal(got, expected), f"bytes differ at {(got != expected).nonzero().flatten()[:8].tolist()}"


@pytest.mark.parametrize("layout", ["contiguous", "row_padded", "element_strided"])
@pytest.mark.parametrize("block_size", [64, 16, 1])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_insert_matches_reference(kernel_device, fmt, block_size, layout):
    poisoned = PoisonedCache(max(2, 80 // block_size), block_size, fmt, device=kernel_device)
    slots = random_slots(poisoned, 45, seed=block_size).to(kernel_device)
    k = strided_rows(random_k(45, seed=block_size).to(kernel_device), layout)
    insert_both(poisoned, k, slots)


@pytest.mark.parametrize("fmt, scale_fmt, head_dim, k_dtype", [
    ("fp8", "mxfp8", 128, torch.bfloat16), ("fp8", "mxfp8", 32, torch.float32), ("fp8", None, 64, torch.float32),
    ("mxfp4", None, 64, torch.bfloat16), ("mxfp4", None, 64, torch.float32), ("mxfp4", None, 32, torch.bfloat16)])
def test_insert_and_gather_scale_words_and_small_head_dims(kernel_device, fmt, scale_fmt, head_dim, k_dtype):
    """mxfp8 scale words, MXFP4 scale bytes padded to a word (D = 64, 32) and small FP8 rows, byte for byte."""
    poisoned = PoisonedCache(3, 16, fmt, device=kernel_device, head_dim=head_dim, scale_fmt=scale_fmt)
    slots = random_slots(poisoned, 29, seed=14).to(kernel_device)
    insert_both(poisoned, random_k(29, seed=15, dtype=k_dtype, head_dim=head_dim).to(kernel_device), slots)
    block_table = torch.tensor([[2, 0, 1], [1, 2, 0]], dtype=torch.int32, device=kernel_device)
    cu_seq_lens = torch.tensor([0, 37, 50], dtype=torch.int32, device=kernel_device)
    got = gather_k(poisoned.cache, block_table, cu_seq_lens, num_tokens=53, backend="triton")
    expected = gather_k(poisoned.cache, block_table, cu_seq_lens, num_tokens=53, backend="reference")
    assert got[1].dtype == expected[1].dtype
    for a, b in zip(got, expected):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("amax_floor", [1e-4, 1.0, 1e-30])
@pytest.mark.parametrize("block_size", [64, 16, 1])
def test_insert_fp32_scales_and_floors(kernel_device, block_size, amax_floor):
    poisoned = PoisonedCache(max(2, 80 // block_size), block_size, "fp8", device=kernel_device)
    slots = random_slots(poisoned, 37, seed=3).to(kernel_device)
    k = random_k(37, seed=4).to(kernel_device)
    k[5] = 1e-6
    insert_both(poisoned, k, slots, scale_fmt="fp32", amax_floor=amax_floor)
    again = PoisonedCache(max(2, 80 // block_size), block_size, "fp8", device=kernel_device)
    insert_both(again, k, slots, scale_fmt="ue8m0", amax_floor=amax_floor)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("k_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_insert_every_k_and_slot_dtype(kernel_device, fmt, k_dtype, slot_dtype):
    poisoned = PoisonedCache(3, 16, fmt, device=kernel_device)
    slots = random_slots(poisoned, 21, seed=5).to(slot_dtype).to(kernel_device)
    slots = torch.stack((slots, torch.zeros_like(slots)), dim=1)[:, 0]  # strided slot_mapping
    assert slots.stride(0) == 2
    insert_both(poisoned, random_k(21, seed=6, dtype=k_dtype).to(kernel_device), slots)


E4M3_VALUES = torch.arange(0, 0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_MIDPOINTS = (E4M3_VALUES[1:] + E4M3_VALUES[:-1]) / 2


def edge_rows(dtype: torch.dtype) -> torch.Tensor:
    rows = torch.randn(12, 128)
    rows[0, 3] = NAN
    rows[1] = NAN
    rows[2, 0], rows[2, 9] = INF, -INF
    rows[3] = 0.0
    rows[4] = -0.0
    rows[5] = 448.0
    rows[5, 1::2] = -448.0
    rows[6, 0] = 448.0  # scale 1 under ue8m0: the other entries are the 126 e4m3 midpoints (and 1)
    rows[6, 1:127] = E4M3_MIDPOINTS
    rows[7, 0] = -448.0 * 8
    rows[7, 1:127] = -E4M3_MIDPOINTS * 8
    thresholds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    rows[8] = thresholds[torch.arange(128) % 8] * torch.where(torch.arange(128) % 3 == 0, -1.0, 1.0)
    rows[9] = 1e-30 * torch.randn(128)
    rows[10] = 3e4 * torch.randn(128)
    rows[11] = 2.0**-20
    rows = rows.to(dtype)
    if dtype == torch.float32:
        rows[9, :4] = torch.tensor([3e38, -3e38, 1e-40, -1e-45])
    return rows


@pytest.mark.parametrize("amax_floor", [1e-4, 1e-38])
@pytest.mark.parametrize("k_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt, scale_fmt", [("fp8", "ue8m0"), ("fp8", "fp32"), ("mxfp4", "ue8m0")])
def test_insert_edge_rows(kernel_device, fmt, scale_fmt, k_dtype, amax_floor):
    poisoned = PoisonedCache(2, 16, fmt, device=kernel_device)
    k = edge_rows(k_dtype).to(kernel_device)
    slots = torch.tensor([0, 5, 17, 3, 30, 31, 16, 1, 2, 9, 10, 11], device=kernel_device)
    options = dict(scale_fmt=scale_fmt, amax_floor=amax_floor) if fmt == "fp8" else {}
    insert_both(poisoned, k, slots, **options)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_insert_single_page_cache_and_all_padding(kernel_device, fmt):
    poisoned = PoisonedCache(1, 64, fmt, device=kernel_device, page_padding=0)
    insert_both(poisoned, random_k(9, seed=9).to(kernel_device), torch.arange(9, device=kernel_device) * 7)
    insert_both(poisoned, random_k(5, seed=10).to(kernel_device), torch.full((5,), -1, device=kernel_device))
    insert_both(poisoned, random_k(0, seed=11).to(kernel_device), torch.zeros(0, dtype=torch.int64,
                                                                                device=kernel_device))


@pytest.mark.parametrize("block_tokens, num_warps", [(1, 1), (8, 2), (128, 8)])
def test_insert_launch_knobs_do_not_change_results(kernel_device, block_tokens, num_warps):
    for fmt in ("fp8", "mxfp4"):
        poisoned = PoisonedCache(3, 16, fmt, device=kernel_device)
        twin = poisoned.twin()
        slots = random_slots(poisoned, 29, seed=12).to(kernel_device)
        k = random_k(29, seed=13).to(kernel_device)
        k_kernels.insert_k_triton(k, poisoned.cache, slots, scale_fmt="ue8m0", amax_floor=1e-4,
                                  config=k_kernels.InsertConfig(block_tokens=block_tokens, num_warps=num_warps))
        insert_k(k, twin.cache, slots, backend="reference")
        assert torch.equal(poisoned.storage, twin.storage)


# Both MXFP4 encodes of bf16 keys, explicitly whatever the default: on bf16 pairs (also
# with the sweep's other launch, 64 tokens / 4 warps), and the fp32 path that other dtypes and strides take.
MXFP4_LAYOUTS = {
    "bf16x2": dict(config=k_kernels.MXFP4_INSERT_CONFIG),
    "bf16x2_64_tokens_4_warps": dict(config=k_kernels.InsertConfig(block_tokens=64, num_warps=4)),
    "fp32_path": dict(config=replace(k_kernels.MXFP4_INSERT_CONFIG, bf16x2=False)),
}
BF16X2_LAYOUTS = [name for name in MXFP4_LAYOUTS if name.startswith("bf16x2")]


def insert_mxfp4_layout(poisoned: PoisonedCache, k, slots, layout: str) -> None:
    """Insert with the kernel in ``layout`` into ``poisoned``, with the reference into a twin; storages must match."""
    twin = poisoned.twin()
    k_kernels.insert_k_triton(k, poisoned.cache, slots, scale_fmt="ue8m0", amax_floor=1e-4, **MXFP4_LAYOUTS[layout])
    insert_k(k, twin.cache, slots, backend="reference")
    assert torch.equal(poisoned.storage, twin.storage), \
        f"bytes differ at {(poisoned.storage != twin.storage).nonzero().flatten()[:8].tolist()}"


@pytest.mark.parametrize("layout", list(MXFP4_LAYOUTS))
@pytest.mark.parametrize("block_size", [64, 16, 1])
def test_insert_mxfp4_layouts_match_reference(kernel_device, block_size, layout):
    poisoned = PoisonedCache(max(2, 80 // block_size), block_size, "mxfp4", device=kernel_device)
    k = torch.cat((edge_rows(torch.bfloat16), random_k(33, seed=14))).to(kernel_device)
    slots = random_slots(poisoned, 45, seed=block_size + 1).to(kernel_device)
    insert_mxfp4_layout(poisoned, strided_rows(k, "element_strided" if block_size == 16 else "contiguous"), slots,
                        layout)


def every_scaled_bf16_rows() -> torch.Tensor:
    """bf16 rows of 32-value blocks: for every MXFP4 exponent ``e`` in [-126, 126], every bf16 ``v`` with
    ``2**-4 <= |v| <= 6`` (and some smaller, and zeros) appears as ``v * 2**e`` in a block whose largest value
    fixes the exponent at ``e`` (``6 * 2**e``, or bf16's largest finite value for ``e = 126``)."""
    bits = torch.arange(0, 0x10000, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    small = bits[(bits.abs() <= 6) & (bits.abs() >= 2.0**-4)]
    tiny = torch.tensor([0.0, -0.0, 2.0**-5, -(2.0**-5), 0.1, -0.1, 2.0**-20, -(2.0**-30), 1e-38, -1e-40])
    values = torch.cat((small, tiny))
    values = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(31))]
    values = torch.cat((values, values[: (-values.numel()) % 31])).reshape(-1, 31)  # [blocks, 31]
    rows = []
    for exponent in range(-126, 127):
        largest = 6.0 * 2.0**exponent if exponent < 126 else 3.3895313892515355e38
        scaled = (values * 2.0**exponent).clamp(-largest, largest).to(torch.bfloat16).float()
        block = torch.cat((torch.full((values.shape[0], 1), largest), scaled), dim=1)  # [blocks, 32]
        block[1::2, 0] = -largest
        rows.append(block)
    blocks = torch.cat(rows)
    blocks = torch.cat((blocks, blocks[: (-blocks.shape[0]) % 4]))
    return blocks.reshape(-1, 128).to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", BF16X2_LAYOUTS)
def test_bf16x2_encode_of_every_scaled_bf16(kernel_device, layout):
    k = every_scaled_bf16_rows().to(kernel_device)
    block_size = 64
    poisoned = PoisonedCache(-(-k.shape[0] // block_size), block_size, "mxfp4", device=kernel_device)
    slots = torch.randperm(poisoned.cache.num_slots, generator=torch.Generator().manual_seed(32))[: k.shape[0]]
    insert_mxfp4_layout(poisoned, k, slots.to(kernel_device), layout)


@pytest.mark.parametrize("layout", BF16X2_LAYOUTS)
def test_bf16x2_finite_edge_rows(kernel_device, layout):
    """The edge rows without inf and NaN, in programs of their own (the encode for all-finite programs)."""
    rows = edge_rows(torch.bfloat16)[3:]
    poisoned = PoisonedCache(1, 64, "mxfp4", device=kernel_device)
    k = torch.cat((rows, -rows, rows * 2.0**-100, rows * 2.0**80)).to(kernel_device)  # 36 rows
    slots = torch.randperm(poisoned.cache.num_slots, generator=torch.Generator().manual_seed(33))[: k.shape[0]]
    insert_mxfp4_layout(poisoned, k, slots.to(kernel_device), layout)


def random_filled_cache(num_blocks, block_size, fmt, *, device, seed) -> PoisonedCache:
    """A poisoned cache whose slot bytes are random (gather is a copy: any bytes will do)."""
    poisoned = PoisonedCache(num_blocks, block_size, fmt, device=device)
    gen = torch.Generator().manual_seed(seed)
    buffer = poisoned.cache.buffer
    buffer.copy_(torch.randint(0, 256, tuple(buffer.shape), generator=gen, dtype=torch.uint8).to(device))
    return poisoned


def gather_tables(lengths, block_size, num_blocks, *, seed, extra_columns=2, index_dtype=torch.int32):
    """``(block_table, cu_seq_lens)``: distinct random pages per request, garbage past each request's pages."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in lengths]
    columns = max(pages, default=0) + extra_columns
    table = torch.full((len(lengths), columns), 10**6, dtype=torch.int64)
    permutation = torch.randperm(num_blocks, generator=gen)
    used = 0
    for b, count in enumerate(pages):
        table[b, :count] = permutation[used: used + count]
        used += count
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return table.to(index_dtype), cu.to(index_dtype)


def poisoned_outputs(cache: IndexerKCache, rows: int, device):
    if cache.fmt == "fp8":
        values = torch.full((rows, cache.head_dim), POISON, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
        scales = torch.full((rows,), -777.0, device=device)
    else:
        values = torch.full((rows, cache.value_bytes), POISON, dtype=torch.uint8, device=device)
        scales = torch.full((rows, cache.scale_bytes), POISON, dtype=torch.uint8, device=device)
    return values, scales


def assert_same_bytes(got, expected):
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype and g.stride() == e.stride()
        g_bytes, e_bytes = g.contiguous().view(torch.uint8), e.contiguous().view(torch.uint8)
        assert torch.equal(g_bytes, e_bytes), f"rows differ: {(g_bytes != e_bytes).nonzero()[:8, 0].unique().tolist()}"


LENGTHS = {
    "mixed": [5, 0, 13, 64, 1, 0, 65, 128, 3],
    "one_request": [150],
    "all_empty": [0, 0, 0],
    "many": [(7 * b) % 23 for b in range(37)],
}


@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("block_size", [64, 16, 1])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_gather_matches_reference(kernel_device, fmt, block_size, lengths):
    lengths = LENGTHS[lengths]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    poisoned = random_filled_cache(num_blocks, block_size, fmt, device=kernel_device, seed=block_size)
    table, cu = gather_tables(lengths, block_size, num_blocks, seed=len(lengths))
    table, cu = table.to(kernel_device), cu.to(kernel_device)
    total = sum(lengths)
    for rows in (total, total + 7):
        got = gather_k(poisoned.cache, table, cu, out=poisoned_outputs(poisoned.cache, rows, kernel_device),
                       backend="triton")
        expected = gather_k(poisoned.cache, table, cu, out=poisoned_outputs(poisoned.cache, rows, kernel_device),
                            backend="reference")
        assert_same_bytes(got, expected)
    fresh = gather_k(poisoned.cache, table, cu, num_tokens=total + 3, backend="triton")
    assert_same_bytes(fresh, gather_k(poisoned.cache, table, cu, num_tokens=total + 3, backend="reference"))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_gather_strided_tables_and_destinations(kernel_device, fmt):
    lengths = [9, 0, 40, 17]
    poisoned = random_filled_cache(12, 16, fmt, device=kernel_device, seed=2)
    table, cu = gather_tables(lengths, 16, 12, seed=3, index_dtype=torch.int64)
    table, cu = table.to(kernel_device), cu.to(kernel_device)
    strided_table = table.t().contiguous().t()  # column-major
    strided_cu = torch.stack((cu, cu), dim=1)[:, 0]
    assert strided_table.stride() == (1, table.shape[0]) and strided_cu.stride(0) == 2
    rows = sum(lengths) + 5
    cache = poisoned.cache
    width = cache.head_dim if fmt == "fp8" else cache.value_bytes
    wide_values = torch.full((rows, width + 16), POISON, dtype=torch.uint8, device=kernel_device)
    if fmt == "fp8":
        values = wide_values[:, 16:].view(torch.float8_e4m3fn)
        wide_scales = torch.full((rows, 2), -777.0, device=kernel_device)
        scales = wide_scales[:, 1]
    else:
        values = wide_values[:, 16:]
        wide_scales = torch.full((rows, cache.scale_bytes * 2), POISON, dtype=torch.uint8, device=kernel_device)
        scales = wide_scales[:, ::2]
    reference_values, reference_scales = wide_values.clone(), wide_scales.clone()
    gather_k(cache, strided_table, strided_cu, out=(values, scales), backend="triton")
    reference_out = (reference_values[:, 16:].view(values.dtype),
                     reference_scales[:, 1] if fmt == "fp8" else reference_scales[:, ::2])
    gather_k(cache, table, cu, out=reference_out, backend="reference")
    assert torch.equal(wide_values, reference_values)
    assert torch.equal(wide_scales.view(torch.uint8), reference_scales.view(torch.uint8))


def test_gather_with_no_requests(kernel_device):
    poisoned = random_filled_cache(2, 16, "fp8", device=kernel_device, seed=4)
    table = torch.zeros((0, 3), dtype=torch.int32, device=kernel_device)
    cu = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    values, scales = gather_k(poisoned.cache, table, cu, out=poisoned_outputs(poisoned.cache, 4, kernel_device),
                              backend="triton")
    assert bool((values.view(torch.uint8) == POISON).all()) and bool((scales == -777.0).all())


@pytest.mark.parametrize("block_rows, num_warps", [pytest.param(1, 1, marks=pytest.mark.slow), (16, 2), (256, 8)])
def test_gather_launch_knobs_do_not_change_results(kernel_device, block_rows, num_warps):
    lengths = LENGTHS["mixed"]
    for fmt in ("fp8", "mxfp4"):
        poisoned = random_filled_cache(30, 16, fmt, device=kernel_device, seed=5)
        table, cu = (t.to(kernel_device) for t in gather_tables(lengths, 16, 30, seed=6))
        got = poisoned_outputs(poisoned.cache, sum(lengths) + 3, kernel_device)
        k_kernels.gather_k_triton(poisoned.cache, table, cu, *got,
                                  config=k_kernels.GatherConfig(block_rows=block_rows, num_warps=num_warps))
        expected = gather_k(poisoned.cache, table, cu, out=poisoned_outputs(poisoned.cache, sum(lengths) + 3,
                                                                             kernel_device), backend="reference")
        assert_same_bytes(got, expected)


def test_public_cache_methods_use_the_kernels(kernel_device):
    poisoned = PoisonedCache(4, 16, "mxfp4", device=kernel_device)
    twin = poisoned.twin()
    k = random_k(30, seed=7).to(kernel_device)
    slots = random_slots(poisoned, 30, seed=8).to(kernel_device)
    poisoned.cache.insert(k, slots, backend="triton")
    twin.cache.insert(k, slots, backend="reference")
    assert torch.equal(poisoned.storage, twin.storage)
    table, cu = (t.to(kernel_device) for t in gather_tables([20, 0, 31], 16, 4, seed=9))
    assert_same_bytes(poisoned.cache.gather(table, cu, backend="triton"),
                      twin.cache.gather(table, cu, backend="reference"))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_large_insert_gather_and_reruns_are_bitwise_equal(kernel_device, fmt):
    block_size, num_blocks = 64, 2048
    poisoned = PoisonedCache(num_blocks, block_size, fmt, device=kernel_device)
    gen = torch.Generator().manual_seed(21)
    pages = torch.randperm(num_blocks, generator=gen)
    slots = (pages[:, None] * block_size + torch.arange(block_size)).flatten()[: 100_000].to(kernel_device)
    slots[::97] = -1
    k = random_k(slots.numel(), seed=22).to(kernel_device)
    insert_both(poisoned, k, slots)
    first = poisoned.storage.clone()
    for _ in range(20):
        insert_k(k, poisoned.cache, slots, backend="triton")
        assert torch.equal(poisoned.storage, first)

    lengths = torch.randint(0, 9000, (24,), generator=gen).tolist()
    table, cu = (t.to(kernel_device) for t in gather_tables(lengths, block_size, num_blocks, seed=23))
    rows = sum(lengths) + 100
    expected = gather_k(poisoned.cache, table, cu, out=poisoned_outputs(poisoned.cache, rows, kernel_device),
                        backend="reference")
    for _ in range(20):
        got = gather_k(poisoned.cache, table, cu, out=poisoned_outputs(poisoned.cache, rows, kernel_device),
                       backend="triton")
        assert_same_bytes(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(MXFP4_LAYOUTS))
def test_large_mxfp4_insert_in_every_layout(kernel_device, layout):
    block_size, num_blocks = 64, 2048
    poisoned = PoisonedCache(num_blocks, block_size, "mxfp4", device=kernel_device)
    gen = torch.Generator().manual_seed(24)
    pages = torch.randperm(num_blocks, generator=gen)
    slots = (pages[:, None] * block_size + torch.arange(block_size)).flatten()[: 100_000].to(kernel_device)
    slots[::89] = -1
    insert_mxfp4_layout(poisoned, random_k(slots.numel(), seed=25).to(kernel_device), slots, layout)


@pytest.mark.gpu
def test_cuda_graph_replay_with_changed_lengths_and_slots(kernel_device):
    block_size, num_blocks = 64, 64
    poisoned = PoisonedCache(num_blocks, block_size, "fp8", device=kernel_device)
    twin = poisoned.twin()
    k = random_k(512, seed=31).to(kernel_device)
    slots = torch.arange(512, device=kernel_device)
    table, cu = (t.to(kernel_device) for t in gather_tables([100, 200, 212], block_size, num_blocks, seed=32,
                                                               extra_columns=8))
    out = poisoned_outputs(poisoned.cache, 1024, kernel_device)

    def step():
        k_kernels.insert_k_triton(k, poisoned.cache, slots, scale_fmt="ue8m0", amax_floor=1e-4)
        k_kernels.gather_k_triton(poisoned.cache, table, cu, *out)

    step()
    insert_k(k, twin.cache, slots, backend="reference")  # the eager run before capture wrote these slots
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_table, new_cu = gather_tables([300, 0, 500], block_size, num_blocks, seed=33, extra_columns=0)
    table[:, : new_table.shape[1]].copy_(new_table)
    cu.copy_(new_cu)
    slots.copy_(torch.randperm(num_blocks * block_size, device=kernel_device)[:512])
    k.copy_(random_k(512, seed=34))
    out[0].view(torch.uint8).fill_(POISON)
    out[1].fill_(-777.0)
    graph.replay()
    torch.cuda.synchronize()
    insert_k(k, twin.cache, slots, backend="reference")
    assert torch.equal(poisoned.storage, twin.storage)
    expected = gather_k(twin.cache, table, cu, out=poisoned_outputs(twin.cache, 1024, kernel_device),
                        backend="reference")
    assert_same_bytes(out, expected)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_insert_with_unchecked_slots_past_the_cache_writes_nothing_for_them(kernel_device, fmt, monkeypatch):
    monkeypatch.setenv("DSA_INDEXER_SKIP_VALUE_CHECKS", "1")
    poisoned = PoisonedCache(3, 16, fmt, device=kernel_device)
    k = random_k(6, 21).to(kernel_device)
    slots = torch.tensor([5, poisoned.cache.num_slots, 47, 10**12, -5, 2**31], device=kernel_device)
    insert_both(poisoned, k, slots)  # the kernel's bytes equal the reference's, poison around the pages included
    padded = PoisonedCache(3, 16, fmt, device=kernel_device)
    insert_k(k, padded.cache, torch.where((slots >= 0) & (slots < 48), slots, -1), backend="reference")
    assert torch.equal(poisoned.canonical_storage(), padded.canonical_storage())


def gathered_oracle(cache: IndexerKCache, table, cu, rows: int):
    """Row by row: position ``p`` of request ``b`` from its page when the table lists a page of the cache there,
    zero bytes otherwise; rows past ``min(cu[-1], rows)`` keep the poison."""
    values, scales = (t.cpu().clone() for t in poisoned_outputs(cache, rows, "cpu"))
    value_bytes, scale_bytes = values.view(torch.uint8), scales.view(torch.uint8).view(rows, -1)
    pages_v, pages_s = cache.values_view().cpu(), cache.scales_view().cpu()
    table, cu = table.tolist(), cu.tolist()
    for b in range(len(table)):
        for row in range(cu[b], min(cu[b + 1], rows)):
            p = row - cu[b]
            page = table[b][p // cache.block_size] if p // cache.block_size < len(table[b]) else -1
            if 0 <= page < cache.num_blocks:
                value_bytes[row], scale_bytes[row] = pages_v[page, p % cache.block_size], pages_s[page, p % cache.block_size]
            else:
                value_bytes[row], scale_bytes[row] = 0, 0
    return values, scales


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_gather_with_unchecked_wild_pages_reads_zeros_and_stops_at_the_destination(kernel_device, fmt, monkeypatch):
    monkeypatch.setenv("DSA_INDEXER_SKIP_VALUE_CHECKS", "1")
    poisoned = random_filled_cache(6, 4, fmt, device=kernel_device, seed=5)
    # Positions 8, 9 of request 0 and 8, 9 of request 1 lie past the 2-column table; cu[-1] = 22 passes the 20 rows.
    table = torch.tensor([[3, 10**6], [-5, 2]], dtype=torch.int32)
    cu = torch.tensor([0, 10, 22], dtype=torch.int32)
    expected = gathered_oracle(poisoned.cache, table, cu, 20)
    for backend in ("reference", "triton"):
        out = poisoned_outputs(poisoned.cache, 20, kernel_device)
        got = gather_k(poisoned.cache, table.to(kernel_device), cu.to(kernel_device), out=out, backend=backend)
        assert_same_bytes(tuple(t.cpu() for t in got), expected)
