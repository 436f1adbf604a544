"""Gluon pieces shared by the two warp-specialised paged decode kernels (``ops.logits.gluon_decode`` for FP8 keys,
``ops.logits.gluon_decode_mxfp4`` for MXFP4): the launch configuration, the work items (request, group of draft
rows, split of key tiles), the producer side of the shared-memory ring (cp.async or TMA page copies), the
epilogue stores and the TMA page descriptors of a cache.

A page of the cache holds ``BLOCK_SIZE`` key rows of ``ROW_BYTES`` bytes, then their 32-bit scale words; the ring
holds ``BLOCK_K = 64`` keys a stage (one wgmma M tile). Gluon does not run under the Triton interpreter.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, mbarrier, tma

from ...cache_layout import KCacheLayout
from .runtime import sm_count
from .splits import split_tiles, wave_split

BLOCK_K = gl.constexpr(64)  # positions per key tile: one wgmma M tile
# The one-wave split is taken only where its items fill at least this share of the wave's slots (``wave_fills``).
GLUON_WAVE_MIN_FILL = 0.8


@dataclasses.dataclass(frozen=True)
class GluonDecodeConfig:
    """Launch of a Gluon decode kernel; the defaults are the FP8 kernel's for draft rows at large work sizes.

    ``num_stages``: ring stages. ``programs_per_sm``: work items per SM aimed at, with ``[min_split_tiles,
    max_split_tiles]`` key tiles a split (power-of-two splits, ``split_tiles``) unless ``one_wave`` (splits of any
    size that fill one wave of ``programs_per_sm`` programs a SM, ``wave_split``). ``max_rows``: draft rows a work
    item (1 or 2). ``producer_warps`` and ``producer_regs``: the producer partition. ``maxnreg``: the register cap
    a thread at launch; warp specialisation rounds the warps up to whole warpgroups (4 consumer + 1 or 4
    producer warps = 256 threads), so it decides the programs per SM: 128 gives two, 80 three, 64 four.
    ``persistent_per_sm``: persistent programs a SM (0: one program per work item; FP8 only). ``early_table``:
    each item's first block-table entry is read beside its lengths (FP8 only). ``tma_pages``: TMA page copies
    where the cache allows them, else the cp.async producer with four warps."""

    num_stages: int = 4
    programs_per_sm: int = 8
    min_split_tiles: int = 2
    max_split_tiles: int = 32
    max_rows: int = 2
    producer_warps: int = 1
    producer_regs: int = 24
    maxnreg: int = 80
    persistent_per_sm: int = 0
    early_table: bool = False
    tma_pages: bool = True
    one_wave: bool = False


def cp_async_fallback(config: GluonDecodeConfig) -> GluonDecodeConfig:
    """The launch a cache that TMA cannot take runs instead of ``config``: the cp.async producer with four warps'
    copies, in the same registers (the producer partition is a whole warpgroup either way)."""
    return dataclasses.replace(config, producer_warps=4, tma_pages=False)


@gluon.jit
def _row_length(lens_ptr, stride_lb, stride_lt, request, t, next_n, one_d):
    """Positions row ``t`` of ``request`` sees (0 for a row past ``next_n``)."""
    present = t < next_n
    stored = gl.load(lens_ptr + request.to(gl.int64) * stride_lb + t * stride_lt, mask=present, other=0)
    return gl.where(present, gl.maximum(stored + one_d * (t + 1 - next_n), 0), 0)


@gluon.jit
def work_item(lens_ptr, stride_lb, stride_lt, work, next_n, one_d, max_context_len, num_splits, num_groups,
               ROWS: gl.constexpr, split_tiles, table_positions):
    """Work item ``work`` (request, split, row group fastest, as in the Triton kernel's program ids): the
    request, its first draft row ``t0``, the rows' lengths, the split ``[split_start, split_end)``, where
    reading stops (``read_end``: the longer row's length inside the split, at most ``table_positions``, the
    block table's columns times the page size, so unchecked lengths never read past the table) and the
    tiles read."""
    request_split = work // num_groups
    split = request_split % num_splits
    request = request_split // num_splits
    t0 = (work % num_groups) * ROWS
    length0 = _row_length(lens_ptr, stride_lb, stride_lt, request, t0, next_n, one_d)
    if ROWS == 2:
        length1 = _row_length(lens_ptr, stride_lb, stride_lt, request, t0 + 1, next_n, one_d)
        extent = gl.maximum(length0, length1)
    else:
        length1 = length0
        extent = length0
    split_start = split * (split_tiles * BLOCK_K)
    split_end = gl.minimum(split_start + split_tiles * BLOCK_K, max_context_len)
    read_end = gl.minimum(gl.minimum(split_end, extent), table_positions)
    num_tiles = (gl.maximum(read_end - split_start, 0) + BLOCK_K - 1) // BLOCK_K
    return request, t0, length0, length1, split_start, split_end, read_end, num_tiles


@gluon.jit
def _split_first_page(table_row, split_start, read_end, first_page, BLOCK_SIZE: gl.constexpr,
                      EARLY_TABLE: gl.constexpr):
    """The block-table entry of a split's first tile (pages a multiple of a tile): ``first_page``, already
    loaded beside the lengths with ``EARLY_TABLE``, else loaded here (0 for a split without positions)."""
    if EARLY_TABLE:
        page = first_page
    else:
        page = gl.load(table_row + split_start // BLOCK_SIZE, mask=split_start < read_end, other=0)
    return page


@gluon.jit
def _next_tile_page(table_row, tile_start, read_end, BLOCK_SIZE: gl.constexpr):
    """The block-table entry of the tile after the one at ``tile_start`` (0 past ``read_end``), loaded a tile
    ahead of its copies."""
    ahead = tile_start + BLOCK_K
    return gl.load(table_row + ahead // BLOCK_SIZE, mask=ahead < read_end, other=0)


@gluon.jit
def fill_tiles(values_ptr, cache_ptr, page_units, num_blocks, table_row, key_ring, scale_ring, ready, empty,
                split_start, read_end, first_use, num_fills, first_page, key, column, scale_key, ROW_BYTES: gl.constexpr,
                BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr, COPY_ALIGN: gl.constexpr,
                EARLY_TABLE: gl.constexpr):
    """Producer side of the ring, shared by the FP8 and MXFP4 kernels: tiles ``0 .. num_fills - 1`` of a
    split (``[BLOCK_K, ROW_BYTES]`` key rows and ``[BLOCK_K]`` 32-bit scales, positions ``>= read_end``
    zero-filled) into ring uses ``first_use + tile``. A page holds ``BLOCK_SIZE`` key rows, then their
    scales; pages start every ``page_units * COPY_ALIGN`` bytes and the cache is ``COPY_ALIGN``-byte aligned,
    so the copies move ``COPY_ALIGN`` bytes (16 or 4) each. ``key``/``column``/``scale_key``: the aranges
    over a tile's keys, a row's bytes and the scales in the copy layouts; ``first_page`` (with
    ``EARLY_TABLE``): the split's first table entry, already loaded. A page id outside ``[0, num_blocks)``
    (unchecked metadata) is not read: its keys and scales are zero-filled and its address is page 0's."""
    scale_base = BLOCK_SIZE * ROW_BYTES  # the page's scales follow its key rows
    if BLOCK_SIZE % BLOCK_K == 0:
        # A tile lies in one page: one block-table entry per tile, loaded a tile ahead (its latency hides
        # under this tile's wait and copies).
        next_page = _split_first_page(table_row, split_start, read_end, first_page, BLOCK_SIZE, EARLY_TABLE)
        for tile in range(num_fills):
            stage = (first_use + tile) % NUM_STAGES
            tile_start = split_start + tile * BLOCK_K
            readable = next_page.to(gl.uint32) < num_blocks.to(gl.uint32)
            page_start = gl.where(readable, next_page, 0).to(gl.int64) * page_units * COPY_ALIGN
            next_page = _next_tile_page(table_row, tile_start, read_end, BLOCK_SIZE)
            # A fresh barrier has completed no phase; waiting on parity 1 passes, so the first round is free.
            mbarrier.wait(empty.index(stage), (((first_use + tile) // NUM_STAGES) & 1) ^ 1)
            slot = tile_start % BLOCK_SIZE + key  # [BLOCK_K]
            key_ptrs = values_ptr + page_start + slot[:, None] * ROW_BYTES + column[None, :]
            scale_slot = tile_start % BLOCK_SIZE + scale_key
            scale_ptrs = (cache_ptr + page_start + scale_base + scale_slot * 4).to(gl.pointer_type(scale_ring.dtype))
            if COPY_ALIGN == 4:  # the cache guarantees 4-byte alignment; the compiler cannot see it
                key_ptrs = gl.multiple_of(key_ptrs, [4, 4])
                scale_ptrs = gl.multiple_of(scale_ptrs, [4])
            async_copy.async_copy_global_to_shared(key_ring.index(stage), key_ptrs,
                                                   mask=((tile_start + key < read_end) & readable)[:, None])
            async_copy.async_copy_global_to_shared(scale_ring.index(stage), scale_ptrs,
                                                   mask=(tile_start + scale_key < read_end) & readable)
            async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)
    else:
        for tile in range(num_fills):
            stage = (first_use + tile) % NUM_STAGES
            positions = split_start + tile * BLOCK_K + key  # [BLOCK_K]
            live = positions < read_end
            page = gl.load(table_row + positions.to(gl.uint32) // BLOCK_SIZE, mask=live, other=0)
            live = live & (page.to(gl.uint32) < num_blocks.to(gl.uint32))
            page = gl.where(live, page, 0)
            scale_positions = split_start + tile * BLOCK_K + scale_key
            scale_live = scale_positions < read_end
            scale_page = gl.load(table_row + scale_positions.to(gl.uint32) // BLOCK_SIZE, mask=scale_live, other=0)
            scale_live = scale_live & (scale_page.to(gl.uint32) < num_blocks.to(gl.uint32))
            scale_page = gl.where(scale_live, scale_page, 0)
            mbarrier.wait(empty.index(stage), (((first_use + tile) // NUM_STAGES) & 1) ^ 1)
            slot = (positions.to(gl.uint32) % BLOCK_SIZE).to(gl.int32)
            key_rows = values_ptr + page.to(gl.int64) * page_units * COPY_ALIGN + slot * ROW_BYTES  # [BLOCK_K]
            key_ptrs = key_rows[:, None] + column[None, :]
            scale_slot = (scale_positions.to(gl.uint32) % BLOCK_SIZE).to(gl.int32)
            scale_bytes = scale_page.to(gl.int64) * page_units * COPY_ALIGN + scale_base + scale_slot * 4
            scale_ptrs = (cache_ptr + scale_bytes).to(gl.pointer_type(scale_ring.dtype))
            if COPY_ALIGN == 4:
                key_ptrs = gl.multiple_of(key_ptrs, [4, 4])
                scale_ptrs = gl.multiple_of(scale_ptrs, [4])
            async_copy.async_copy_global_to_shared(key_ring.index(stage), key_ptrs, mask=live[:, None])
            async_copy.async_copy_global_to_shared(scale_ring.index(stage), scale_ptrs, mask=scale_live)
            async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)


@gluon.jit
def fill_tiles_tma(key_desc, scale_desc, page_rows, num_blocks, table_row, key_ring, scale_ring, ready, empty,
                    split_start, read_end, first_use, num_fills, first_page, ROW_BYTES: gl.constexpr,
                    BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr, EARLY_TABLE: gl.constexpr):
    """``fill_tiles`` (pages a multiple of a tile) by TMA: per tile one copy of the ``[BLOCK_K, ROW_BYTES]``
    key rows and one of the ``BLOCK_K`` 32-bit scales (as ``[4 * BLOCK_K / ROW_BYTES, ROW_BYTES]`` bytes), on
    the ``ready`` barrier's transaction count: a few instructions a tile instead of address arithmetic and a
    cp.async per thread and 16 bytes. The cache is viewed as rows of ``ROW_BYTES``
    (``key_desc``/``scale_desc``, block shapes as above, the rings' layouts); a page is ``page_rows`` of them:
    its ``BLOCK_SIZE`` key rows, then its scales. Positions ``>= read_end`` are not zero-filled: they read
    page 0 (masked table entries) or the page's own slots, whose logits are never stored. A page id outside
    ``[0, num_blocks)`` (unchecked metadata) becomes ``num_blocks`` before the coordinate is formed: its boxes
    lie past the descriptor's rows, which TMA fills with zeros, and the coordinate cannot overflow."""
    key_stages = key_ring._reinterpret(key_ring.dtype, [NUM_STAGES, BLOCK_K, ROW_BYTES], key_desc.layout)
    scale_stages = scale_ring._reinterpret(gl.uint8, [NUM_STAGES, 4 * BLOCK_K // ROW_BYTES, ROW_BYTES],
                                           scale_desc.layout)
    next_page = _split_first_page(table_row, split_start, read_end, first_page, BLOCK_SIZE, EARLY_TABLE)
    for tile in range(num_fills):
        stage = (first_use + tile) % NUM_STAGES
        tile_start = split_start + tile * BLOCK_K
        page_row = gl.where(next_page.to(gl.uint32) < num_blocks.to(gl.uint32), next_page, num_blocks) * page_rows
        next_page = _next_tile_page(table_row, tile_start, read_end, BLOCK_SIZE)
        slot = tile_start % BLOCK_SIZE
        # A fresh barrier has completed no phase; waiting on parity 1 passes, so the first round is free.
        mbarrier.wait(empty.index(stage), (((first_use + tile) // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), BLOCK_K * (ROW_BYTES + 4))
        tma.async_copy_global_to_shared(key_desc, [page_row + slot, 0], ready.index(stage), key_stages.index(stage))
        tma.async_copy_global_to_shared(scale_desc, [page_row + BLOCK_SIZE + slot * 4 // ROW_BYTES, 0],
                                        ready.index(stage), scale_stages.index(stage))


@gluon.jit
def store_row(acc, half_w, key_mul, out_row, positions, live, length, present, CLEAN: gl.constexpr):
    """Head sum of one draft row's ``[BLOCK_K, BLOCK_H]`` scores, scaled per key, stored (or ``-inf``)."""
    logits = gl.sum((acc + gl.abs(acc)) * half_w[None, :], axis=1) * key_mul  # [BLOCK_K]
    inside = positions < length
    if CLEAN:
        gl.store(out_row + positions, gl.where(inside, logits, float("-inf")), mask=live & present)
    else:
        gl.store(out_row + positions, logits, mask=live & inside)


@gluon.jit
def row_outputs(w_ptr, stride_wr, stride_wh, out_ptr, stride_or, request, t0, next_n, head, HEADS: gl.constexpr,
                 ROWS: gl.constexpr):
    """For draft rows ``t0`` and ``t0 + 1`` of ``request``: whether each is present (``< next_n``), its
    ``[BLOCK_H]`` weights halved (``head``: the arange over heads in the accumulator's column layout; 0 for
    absent heads and rows) and its output row pointer. With ``ROWS = 1`` row 1's entries repeat row 0's."""
    first_row = request.to(gl.int64) * next_n + t0
    present0 = t0 < next_n
    present1 = t0 + 1 < next_n
    half_w0 = gl.load(w_ptr + first_row * stride_wr + head * stride_wh, mask=(head < HEADS) & present0,
                      other=0.0).to(gl.float32) * 0.5  # [BLOCK_H] (bf16 weights widen exactly)
    out_row0 = out_ptr + first_row * stride_or
    if ROWS == 2:
        half_w1 = gl.load(w_ptr + (first_row + 1) * stride_wr + head * stride_wh, mask=(head < HEADS) & present1,
                          other=0.0).to(gl.float32) * 0.5
        out_row1 = out_row0 + stride_or
    else:
        half_w1 = half_w0
        out_row1 = out_row0
    return present0, present1, half_w0, half_w1, out_row0, out_row1


@gluon.jit
def store_tail(out_row0, out_row1, present0, present1, split_start, split_end, read_end, key, ROWS: gl.constexpr):
    """``-inf`` at the split's positions past what was read (``[max(split_start, read_end), split_end)``),
    64 keys at a time (``key``: arange over ``BLOCK_K``)."""
    masked = gl.full([BLOCK_K], float("-inf"), gl.float32, layout=key.type.layout)
    for first in range(gl.maximum(split_start, read_end), split_end, BLOCK_K):
        positions = first + key
        gl.store(out_row0 + positions, masked, mask=(positions < split_end) & present0)
        if ROWS == 2:
            gl.store(out_row1 + positions, masked, mask=(positions < split_end) & present1)


# Per cache object: (the buffer's address, shape and page stride, its descriptors by builder). The
# descriptors reference the buffer, not the cache, so an entry goes when its cache does.
_PAGE_DESCRIPTORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def page_descriptors(cache: KCacheLayout, build) -> tuple:
    """``build(cache)`` (TMA descriptors over the cache's pages), built once per cache and buffer: building
    them costs more host time than launching the kernel."""
    buffer = cache.buffer
    identity = (buffer.data_ptr(), tuple(buffer.shape), cache.page_stride)
    memo = _PAGE_DESCRIPTORS.get(cache)
    if memo is None or memo[0] != identity:
        memo = (identity, {})
        _PAGE_DESCRIPTORS[cache] = memo
    built = memo[1].get(build)
    if built is None:
        built = memo[1][build] = build(cache)
    return built


def wave_fills(config: GluonDecodeConfig, batch: int, next_n: int, max_context_len: int, sms: int) -> bool:
    """Whether the one-wave split of ``config`` (``programs_per_sm`` a SM, ``max_rows`` draft rows a program)
    takes at least ``GLUON_WAVE_MIN_FILL`` of its wave's slots for this call (host integers only)."""
    row_groups = batch * triton.cdiv(next_n, config.max_rows)
    fill = wave_split(row_groups, triton.cdiv(max_context_len, BLOCK_K.value), config.programs_per_sm, sms)[1]
    return fill >= GLUON_WAVE_MIN_FILL


def launch_shape(q: torch.Tensor, cache: KCacheLayout, max_context_len: int,
                 config: GluonDecodeConfig) -> tuple[int, int, int, int, int]:
    """(draft rows per work item: 1 or 2, row groups, splits per row group, key tiles per split, copy width
    in bytes) of a call, shared by the FP8 and MXFP4 launchers."""
    batch, next_n = q.shape[:2]
    rows = 1 if min(next_n, config.max_rows) == 1 else 2
    num_groups = triton.cdiv(next_n, rows)
    key_tiles = triton.cdiv(max_context_len, BLOCK_K)
    if config.one_wave:
        tiles = wave_split(batch * num_groups, key_tiles, config.programs_per_sm, sm_count(q.device))[0]
    else:
        tiles = split_tiles(batch * num_groups, key_tiles, q.device, config.programs_per_sm, config.min_split_tiles,
                            config.max_split_tiles)
    # 16-byte copies when the cache allows them; the cache guarantees 4-byte alignment (cp.async's minimum).
    copy_align = 16 if cache.buffer.data_ptr() % 16 == 0 and cache.page_stride % 16 == 0 else 4
    return rows, num_groups, triton.cdiv(key_tiles, tiles), tiles, copy_align
