"""Gluon (warp-specialised) FP8 paged decode logits: the twin of ``paged_mqa_logits_triton`` for fmt fp8.

Same contract and work items as the Triton kernel (``triton.py``): (request, group of ``ROWS`` draft rows,
split of ``split_tiles * BLOCK_K`` positions), one key tile of ``BLOCK_K = 64`` positions at a time (one wgmma M
tile). A program runs one work item, or, persistent, items ``pid, pid + programs, ...`` (a few programs
per SM), so that the next item's first loads overlap this item's last tiles instead of a new program's
prologue (lengths, block table, first keys: dependent cold reads). What changes is who waits for what:

- A producer partition (one warp, few registers) copies each item's queries into a query slot (two slots
  when persistent, handed back through ``query_empty``), then, per key tile, the block-table entry (one
  tile ahead, in a register), the ``[64, D]`` e4m3 keys and their 64 fp32 scales into a ``NUM_STAGES``
  shared-memory ring whose use count runs on across items: TMA copies (``_fill_tiles_tma``), two a tile
  and one per query row, on the transaction counts of the per-stage ``ready`` and the slot's
  ``query_ready`` mbarriers. The consumer hands each stage back through an ``empty`` mbarrier. Caches
  TMA cannot take (unaligned, a page stride that is not a multiple of a key row, pages smaller than a
  tile, ``D > 128``: ``_tma_pages``) get the cp.async producer instead (``_fill_tiles``: four warps'
  per-thread 16- or 4-byte copies, each thread arriving on ``ready`` when its own copies land; same bytes
  in shared memory, same results). The TMA producer is 1.01-1.12x faster (NOTES_logits.md, session 5
  round 2): fewer instructions and fewer warps competing with the consumers for issue slots.
- The consumer (one warpgroup, the default partition) never waits for memory once the ring is ahead:
  per tile it issues one asynchronous ``[64 keys, D] x [D, BLOCK_H heads]`` wgmma per draft row (keys on
  M, heads on N, both operands from shared memory), then waits for row 0 only and runs its epilogue
  (``(s + |s|) * (w / 2)`` summed over the heads: in-thread adds and two quad shuffles) while row 1's
  wgmma runs, then row 1's.
- Several programs share an SM, so one program's epilogue also overlaps another's wgmma and copies (two
  consumer warpgroups per program on alternate stages, "ping-pong", measured 0.77-0.92x of this:
  NOTES_logits.md, session 4).

The head sum of a row is the reduction over axis 1 of its own ``[64, BLOCK_H]`` accumulator (the
Triton kernel reduces a ``[BLOCK_K, ROWS, BLOCK_H]`` view of one stacked accumulator); results agree
with the reference to fp32 rounding (DESIGN.md §11) and one kernel always returns the same bits.

Gluon does not run under the Triton interpreter: this path needs a CUDA GPU with wgmma (sm_90); the
dispatch (``ops/logits/__init__.py``) sends FP8 decode here where ``gluon_decode_preferred`` says it wins, and
the launcher picks the configuration (programs per SM, persistence) by work size (``gluon_decode_config``).
"""

from __future__ import annotations

import functools
import types
import weakref

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ... import backend as _backend
from ...cache import IndexerKCache
from ...formats import FP8_DTYPE
from .triton import _split_tiles

__all__ = ["paged_mqa_logits_gluon", "gluon_decode_preferred", "gluon_decode_config", "GLUON_DECODE_CONFIG"]

BLOCK_K = gl.constexpr(64)  # positions per key tile: one wgmma M tile
# (cp.async ring stages, work items per SM aimed at, key tiles per split min/max, draft rows per program at
# most (1 or 2), producer warps, producer registers per thread, register cap per thread at launch,
# persistent programs per SM: 0 = one program per work item, and optionally whether each item's first
# table entry is read beside its lengths: 0/1, 0 when absent, TMA page copies: 0/1, 0 when absent (the
# cp.async producer), see ``_fill_tiles_tma``, taken where the cache allows: ``_tma_pages``; the defaults set
# it, and one wave: 0/1, 0 when absent, splits of any size that give about ``per_sm`` items a SM, ``_wave_split``,
# instead of the power-of-two split between the min and max). Warp specialisation rounds the producer up to a
# whole warpgroup (4 consumer warps + 1 or 4 producer warps = 256 threads), so the cap decides the programs per
# SM: 128 gives two, 80 three, 64 four (the consumer gets 2 * cap - producer registers).
# Measured winners (H200, cold-L2 graph replays, NOTES_logits.md runs 6 and 9, session 5 round 2, session 11),
# picked per call by ``gluon_decode_config``; all four take keys, scales and queries by TMA from one producer warp
# (two copies a tile, one per query row; session 5 round 2: 1.01-1.12x against four cp.async warps). Draft rows
# at ``batch * max_context_len >= GLUON_LARGE_KEYS``: three programs per SM, one work item each (168.5 vs 187.8 µs
# at B = 32, L = 128K, next_n = 2).
GLUON_DECODE_CONFIG = (4, 8, 2, 32, 2, 1, 24, 80, 0, 0, 1)
# Draft rows below that: two persistent programs per SM (the next item's loads hide its prologue), 4 items
# per SM aimed at (long splits: fewer per-item query copies and first-entry chains), each item's first table
# entry read beside its lengths (``persist2-coarse-early-tma``: 13.95 µs at B = 1, L = 128K, 51.5 at B = 32,
# L = 32K).
GLUON_DECODE_CONFIG_SMALL = (4, 4, 2, 32, 2, 1, 24, 128, 2, 1, 1)
# Draft rows below 4M keys where one wave fills at least GLUON_WAVE_MIN_FILL of its slots: three one-item
# programs per SM (cap 80), each row group's tiles in even splits of any size, so that the items fill one wave
# (field 11; ``_wave_split``), first table entry beside the lengths (session 11, rotating buffers: 43.8 against
# 46.7 µs at B = 32, L = 32K; equal at B = 1, L = 128K and from 4M keys).
GLUON_DECODE_CONFIG_WAVE = (4, 3, 2, 32, 2, 1, 24, 80, 0, 1, 1, 1)
GLUON_WAVE_MIN_FILL = 0.8
# next_n = 1: four persistent programs per SM (one accumulator: 104 consumer registers, no spills).
GLUON_DECODE_CONFIG_ONE_ROW = (4, 8, 2, 32, 1, 1, 24, 64, 4, 0, 1)
GLUON_LARGE_KEYS = 1 << 22
# Configurations timed by the benchmark sweep (each is tested against the reference and the default's bits):
# the defaults, their cp.async twins (four producer warps: the defaults until session 5, and the path a
# cache that TMA cannot take runs) and the steps from the session-3 small-shape default to the current one (the
# variants that lost in runs 5-9 and in session 5 are recorded in NOTES_logits.md, not kept here). Consumer
# registers: 232 at cap 128 (216 with the cp.async twin's 40 producer registers), 136 at cap 80 (128 with 32;
# no spills at next_n = 2), 104 at cap 64 (no spills at next_n = 1 only). Shared memory per program at
# next_n = 2: ~50 KB, ~67 KB with two query slots (persistent), +8.4 KB a stage.
GLUON_SWEEP_CONFIGS = {
    "cta3": GLUON_DECODE_CONFIG,
    "persist4-one-row": GLUON_DECODE_CONFIG_ONE_ROW,
    "persist2-coarse-early": GLUON_DECODE_CONFIG_SMALL,
    "cta3-copies": (4, 8, 2, 32, 2, 4, 32, 80, 0),
    "persist4-one-row-copies": (4, 8, 2, 32, 1, 4, 24, 64, 4),
    # The small-shape default until session 4: 8 items per SM aimed at, the first table entry after the lengths.
    "persist2": (4, 8, 2, 32, 2, 4, 40, 128, 2),
    # The first table entry beside the lengths: one cold read less in the chain before the first keys.
    "persist2-early": (4, 8, 2, 32, 2, 4, 40, 128, 2, 1),
    # Twice the tiles a split (4 items per SM aimed at): half the items, so half the per-item query copies
    # (16 KB each at next_n = 2, as much as a 2-tile item's keys) and first-entry chains at small shapes.
    "persist2-coarse-early-copies": (4, 4, 2, 32, 2, 4, 40, 128, 2, 1),
    "wave3-early": GLUON_DECODE_CONFIG_WAVE,
    # The one-wave default without the early table entry.
    "wave3": GLUON_DECODE_CONFIG_WAVE[:9] + (0,) + GLUON_DECODE_CONFIG_WAVE[10:],
}
# Smallest ``batch * max_context_len`` the dispatch sends to the Gluon kernel, by draft rows (see
# ``gluon_decode_preferred``).
GLUON_MIN_KEYS_ONE_ROW = 1 << 20
GLUON_MIN_KEYS_DRAFT_ROWS = 1 << 16


@gluon.jit
def _row_length(lens_ptr, stride_lb, stride_lt, request, t, next_n, one_d):
    """Positions row ``t`` of ``request`` sees (0 for a row past ``next_n``)."""
    present = t < next_n
    stored = gl.load(lens_ptr + request.to(gl.int64) * stride_lb + t * stride_lt, mask=present, other=0)
    return gl.where(present, gl.maximum(stored + one_d * (t + 1 - next_n), 0), 0)


@gluon.jit
def _work_item(lens_ptr, stride_lb, stride_lt, work, next_n, one_d, max_context_len, num_splits, num_groups,
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
def _fill_tiles(values_ptr, cache_ptr, page_units, num_blocks, table_row, key_ring, scale_ring, ready, empty,
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
def _fill_tiles_tma(key_desc, scale_desc, page_rows, num_blocks, table_row, key_ring, scale_ring, ready, empty,
                    split_start, read_end, first_use, num_fills, first_page, ROW_BYTES: gl.constexpr,
                    BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr, EARLY_TABLE: gl.constexpr):
    """``_fill_tiles`` (pages a multiple of a tile) by TMA: per tile one copy of the ``[BLOCK_K, ROW_BYTES]``
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
def _producer(q_ptr, stride_qb, stride_qt, stride_qh, values_ptr, cache_ptr, page_units, num_blocks, table_ptr,
              stride_tb, table_columns, lens_ptr, stride_lb, stride_lt, key_desc, scale_desc, page_rows, query_desc,
              key_ring, scale_ring, query_ring, ready, empty, query_ready, query_empty,
              next_n, one_d, max_context_len, num_splits, num_groups, num_works, split_tiles,
              HEADS: gl.constexpr, BLOCK_H: gl.constexpr, DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
              ROWS: gl.constexpr, NUM_STAGES: gl.constexpr, QUERY_SLOTS: gl.constexpr,
              COPY_ALIGN: gl.constexpr, COPY_LAYOUT: gl.constexpr, SCALE_LAYOUT: gl.constexpr,
              EARLY_TABLE: gl.constexpr, TMA_PAGES: gl.constexpr):
    """Per work item of this program: the group's queries ``[ROWS, BLOCK_H, DIM]`` into a query slot, then
    per tile ``[BLOCK_K, DIM]`` keys and ``[BLOCK_K]`` scales into the ring (``_fill_tiles``). The ring's use
    count runs on across work items, so the next item's first tiles load while the consumer still works on
    this one. ``EARLY_TABLE`` (pages a multiple of a tile only): an item's first table entry is read before
    its lengths. ``TMA_PAGES``: the tiles by ``_fill_tiles_tma`` (``key_desc``, ``scale_desc``, ``page_rows``)
    and each query row by one TMA copy of ``[BLOCK_H, DIM]`` from ``query_desc`` (the queries as
    ``[batch * next_n * HEADS, DIM]`` rows; with ``BLOCK_H > HEADS`` or a row past ``next_n`` it reads other
    queries' values, or zeros past the tensor: their weights are 0 and their outputs never stored, so the
    logits keep their bits); None otherwise."""
    head = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, COPY_LAYOUT))
    dim = gl.arange(0, DIM, layout=gl.SliceLayout(0, COPY_LAYOUT))
    key = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, COPY_LAYOUT))
    scale_key = gl.arange(0, BLOCK_K, layout=SCALE_LAYOUT)
    uses = 0  # ring stages filled so far (over all work items)
    done = 0  # work items done by this program
    for work in range(gl.program_id(0), num_works, gl.num_programs(0)):
        if EARLY_TABLE:
            # The entry depends on the item's index only: read beside the lengths, not after them (two cold
            # reads in parallel instead of a chain). Past the request's length it may be garbage; then no tile
            # of the item is read, so it is never used.
            first_column = (work // num_groups % num_splits) * (split_tiles * BLOCK_K) // BLOCK_SIZE
            first_page = gl.load(table_ptr + (work // num_groups // num_splits).to(gl.int64) * stride_tb + first_column,
                                 mask=first_column < table_columns, other=0)
        else:
            first_page = 0  # unused: the first entry is read after the lengths
        request, t0, _, _, split_start, _, read_end, num_tiles = _work_item(
            lens_ptr, stride_lb, stride_lt, work, next_n, one_d, max_context_len, num_splits, num_groups, ROWS,
            split_tiles, table_columns * BLOCK_SIZE)
        table_row = table_ptr + request.to(gl.int64) * stride_tb
        query_slot = done % QUERY_SLOTS
        # A fresh barrier has completed no phase; waiting on parity 1 passes, so the first round is free.
        mbarrier.wait(query_empty.index(query_slot), ((done // QUERY_SLOTS) & 1) ^ 1)
        if TMA_PAGES:
            mbarrier.expect(query_ready.index(query_slot), ROWS * BLOCK_H * DIM)
            for r in gl.static_range(ROWS):
                tma.async_copy_global_to_shared(query_desc, [(request * next_n + t0 + r) * HEADS, 0],
                                                query_ready.index(query_slot), query_ring.index(query_slot * ROWS + r))
        else:
            for r in gl.static_range(ROWS):
                t = t0 + r
                query_rows = q_ptr + request.to(gl.int64) * stride_qb + t * stride_qt + head * stride_qh  # [BLOCK_H]
                async_copy.async_copy_global_to_shared(query_ring.index(query_slot * ROWS + r),
                                                       query_rows[:, None] + dim[None, :],
                                                       mask=((head < HEADS) & (t < next_n))[:, None])
            async_copy.mbarrier_arrive(query_ready.index(query_slot), increment_count=False)
        if TMA_PAGES:
            _fill_tiles_tma(key_desc, scale_desc, page_rows, num_blocks, table_row, key_ring, scale_ring, ready, empty,
                            split_start, read_end, uses, num_tiles, first_page, DIM, BLOCK_SIZE, NUM_STAGES,
                            EARLY_TABLE)
        else:
            _fill_tiles(values_ptr, cache_ptr, page_units, num_blocks, table_row, key_ring, scale_ring, ready, empty,
                        split_start, read_end, uses, num_tiles, first_page, key, dim, scale_key, DIM, BLOCK_SIZE,
                        NUM_STAGES, COPY_ALIGN, EARLY_TABLE)
        uses += num_tiles
        done += 1


@gluon.jit
def _store_row(acc, half_w, key_mul, out_row, positions, live, length, present, CLEAN: gl.constexpr):
    """Head sum of one draft row's ``[BLOCK_K, BLOCK_H]`` scores, scaled per key, stored (or ``-inf``)."""
    logits = gl.sum((acc + gl.abs(acc)) * half_w[None, :], axis=1) * key_mul  # [BLOCK_K]
    inside = positions < length
    if CLEAN:
        gl.store(out_row + positions, gl.where(inside, logits, float("-inf")), mask=live & present)
    else:
        gl.store(out_row + positions, logits, mask=live & inside)


@gluon.jit
def _row_outputs(w_ptr, stride_wr, stride_wh, out_ptr, stride_or, request, t0, next_n, head, HEADS: gl.constexpr,
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
def _store_tail(out_row0, out_row1, present0, present1, split_start, split_end, read_end, key, ROWS: gl.constexpr):
    """``-inf`` at the split's positions past what was read (``[max(split_start, read_end), split_end)``),
    64 keys at a time (``key``: arange over ``BLOCK_K``)."""
    masked = gl.full([BLOCK_K], float("-inf"), gl.float32, layout=key.type.layout)
    for first in range(gl.maximum(split_start, read_end), split_end, BLOCK_K):
        positions = first + key
        gl.store(out_row0 + positions, masked, mask=(positions < split_end) & present0)
        if ROWS == 2:
            gl.store(out_row1 + positions, masked, mask=(positions < split_end) & present1)


@gluon.jit
def _consumer(w_ptr, stride_wr, stride_wh, out_ptr, stride_or, lens_ptr, stride_lb, stride_lt,
              key_ring, scale_ring, query_ring, ready, empty, query_ready, query_empty,
              next_n, one_d, max_context_len, num_splits, num_groups, num_works,
              split_tiles, table_positions, HEADS: gl.constexpr, BLOCK_H: gl.constexpr, ROWS: gl.constexpr,
              NUM_STAGES: gl.constexpr, QUERY_SLOTS: gl.constexpr, CLEAN: gl.constexpr, TMA_PAGES: gl.constexpr):
    """Per work item, per tile: one async wgmma per row, row 0's epilogue under row 1's wgmma; then the
    item's ``-inf`` tail. Query slot and ring stages go back to the producer as soon as they are read."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_H, 32])
    head = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, mma_layout))
    key = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, mma_layout))
    zero = gl.zeros([BLOCK_K, BLOCK_H], gl.float32, layout=mma_layout)
    uses = 0  # ring stages consumed so far (over all work items)
    done = 0  # work items done by this program
    for work in range(gl.program_id(0), num_works, gl.num_programs(0)):
        request, t0, length0, length1, split_start, split_end, read_end, num_tiles = _work_item(
            lens_ptr, stride_lb, stride_lt, work, next_n, one_d, max_context_len, num_splits, num_groups, ROWS,
            split_tiles, table_positions)
        present0, present1, half_w0, half_w1, out_row0, out_row1 = _row_outputs(
            w_ptr, stride_wr, stride_wh, out_ptr, stride_or, request, t0, next_n, head, HEADS, ROWS)
        query_slot = done % QUERY_SLOTS
        mbarrier.wait(query_ready.index(query_slot), (done // QUERY_SLOTS) & 1)
        for tile in range(num_tiles):
            stage = (uses + tile) % NUM_STAGES
            mbarrier.wait(ready.index(stage), ((uses + tile) // NUM_STAGES) & 1)
            if not TMA_PAGES:  # TMA writes through the async proxy, as wgmma reads
                fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async one
            keys = key_ring.index(stage)
            acc0 = warpgroup_mma(keys, query_ring.index(query_slot * ROWS).permute((1, 0)), zero, use_acc=False,
                                 is_async=True)
            if ROWS == 2:
                acc1 = warpgroup_mma(keys, query_ring.index(query_slot * ROWS + 1).permute((1, 0)), zero,
                                     use_acc=False, is_async=True)
            key_mul = scale_ring.index(stage).load(gl.SliceLayout(1, mma_layout))  # [BLOCK_K]
            positions = split_start + tile * BLOCK_K + key
            live = positions < read_end
            if ROWS == 2:
                acc0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, ))
                _store_row(acc0, half_w0, key_mul, out_row0, positions, live, length0, present0, CLEAN)
                acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, ))
                gl.thread_barrier()  # every warp is past its reads of this stage
                mbarrier.arrive(empty.index(stage), count=1)
                _store_row(acc1, half_w1, key_mul, out_row1, positions, live, length1, present1, CLEAN)
            else:
                acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, ))
                gl.thread_barrier()
                mbarrier.arrive(empty.index(stage), count=1)
                _store_row(acc0, half_w0, key_mul, out_row0, positions, live, length0, present0, CLEAN)
        # Every wgmma of this item has been waited for. The barrier also keeps a warp from falling a whole
        # item behind (an item without tiles has no other): a slot is refilled only after every warp has
        # passed its wait for the current fill, so no wait can see the parity of a later fill.
        gl.thread_barrier()
        mbarrier.arrive(query_empty.index(query_slot), count=1)
        if CLEAN:
            _store_tail(out_row0, out_row1, present0, present1, split_start, split_end, read_end, key, ROWS)
        uses += num_tiles
        done += 1


@gluon.jit(do_not_specialize=["num_blocks", "table_columns", "next_n", "one_d", "max_context_len", "num_splits",
                              "num_groups", "num_works", "split_tiles"])
def _paged_mqa_logits_ws_kernel(
    q_ptr, stride_qb, stride_qt, stride_qh,
    w_ptr, stride_wr, stride_wh,
    values_ptr, cache_ptr, page_units, num_blocks,
    lens_ptr, stride_lb, stride_lt,
    table_ptr, stride_tb, table_columns,
    out_ptr, stride_or,
    next_n, one_d, max_context_len, num_splits, num_groups, num_works, split_tiles, key_desc, scale_desc, page_rows,
    query_desc,
    HEADS: gl.constexpr, BLOCK_H: gl.constexpr, DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    ROWS: gl.constexpr, NUM_STAGES: gl.constexpr, QUERY_SLOTS: gl.constexpr,
    CLEAN: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, COPY_ALIGN: gl.constexpr,
    KEY_SMEM_LAYOUT: gl.constexpr, COPY_LAYOUT: gl.constexpr, SCALE_LAYOUT: gl.constexpr, EARLY_TABLE: gl.constexpr,
    TMA_PAGES: gl.constexpr,
):
    """Work items ``pid, pid + programs, ...`` of ``num_works`` (draft rows ``[t0, t0 + ROWS)`` of one
    request over one split of ``split_tiles * BLOCK_K`` positions each; one item per program unless persistent;
    ``split_tiles`` is a runtime value, so a one-wave split of any size compiles once).
    ``key_desc``, ``scale_desc``, ``page_rows``, ``query_desc``: the TMA copies' arguments (``_producer``) with
    ``TMA_PAGES``, None otherwise."""
    key_ring = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, BLOCK_K, DIM], KEY_SMEM_LAYOUT)
    scale_ring = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_K],
                                           gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    query_ring = gl.allocate_shared_memory(gl.float8e4nv, [QUERY_SLOTS * ROWS, BLOCK_H, DIM], KEY_SMEM_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    query_ready = gl.allocate_shared_memory(gl.int64, [QUERY_SLOTS, 1], mbarrier.MBarrierLayout())
    query_empty = gl.allocate_shared_memory(gl.int64, [QUERY_SLOTS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1 if TMA_PAGES else 32 * PRODUCER_WARPS)
        mbarrier.init(empty.index(s), count=1)
    for s in gl.static_range(QUERY_SLOTS):
        mbarrier.init(query_ready.index(s), count=1 if TMA_PAGES else 32 * PRODUCER_WARPS)
        mbarrier.init(query_empty.index(s), count=1)

    gl.warp_specialize([
        (_consumer, (w_ptr, stride_wr, stride_wh, out_ptr, stride_or, lens_ptr, stride_lb, stride_lt,
                     key_ring, scale_ring, query_ring, ready, empty, query_ready, query_empty,
                     next_n, one_d, max_context_len, num_splits, num_groups, num_works, split_tiles,
                     table_columns * BLOCK_SIZE, HEADS, BLOCK_H, ROWS, NUM_STAGES, QUERY_SLOTS, CLEAN, TMA_PAGES)),
        (_producer, (q_ptr, stride_qb, stride_qt, stride_qh, values_ptr, cache_ptr, page_units, num_blocks, table_ptr,
                     stride_tb, table_columns, lens_ptr, stride_lb, stride_lt, key_desc, scale_desc, page_rows,
                     query_desc, key_ring, scale_ring, query_ring, ready, empty, query_ready, query_empty, next_n,
                     one_d, max_context_len, num_splits, num_groups, num_works, split_tiles, HEADS, BLOCK_H, DIM,
                     BLOCK_SIZE, ROWS, NUM_STAGES, QUERY_SLOTS, COPY_ALIGN, COPY_LAYOUT, SCALE_LAYOUT, EARLY_TABLE,
                     TMA_PAGES)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


@functools.lru_cache(maxsize=256)
def kernel_constants(heads: int, dim: int, block_size: int, rows: int, clean: bool, copy_align: int, config: tuple,
                     query_slots: int = 1, tma_pages: bool = False) -> types.MappingProxyType:
    """The kernel's compile-time arguments (launcher and ahead-of-time compilation share them); ``config``
    is a ``GLUON_DECODE_CONFIG``-like tuple, ``query_slots`` 2 when a program runs several work items,
    ``tma_pages`` whether the launch copies the tiles by TMA (``_tma_pages``). Cached, read-only: building
    the layouts is host time on every decode call otherwise."""
    num_stages, producer_warps, producer_regs = config[0], config[5], config[6]
    if dim & (dim - 1) or not 32 <= dim <= 512:
        raise ValueError(f"the Gluon decode kernel needs a power-of-two head_dim in [32, 512], got {dim}")
    if heads > 128:
        raise ValueError(f"the Gluon decode kernel takes at most 128 heads, got {heads}")
    lanes_per_row = dim // 16
    return types.MappingProxyType(dict(
        HEADS=heads, BLOCK_H=max(16, triton.next_power_of_2(heads)), DIM=dim, BLOCK_SIZE=block_size, ROWS=rows,
        NUM_STAGES=num_stages, QUERY_SLOTS=query_slots, CLEAN=clean, PRODUCER_WARPS=producer_warps,
        PRODUCER_REGS=producer_regs, COPY_ALIGN=copy_align,
        KEY_SMEM_LAYOUT=gl.NVMMASharedLayout(swizzle_byte_width=min(128, dim), element_bitwidth=8, rank=2),
        COPY_LAYOUT=gl.BlockedLayout([1, 16], [32 // lanes_per_row, lanes_per_row], [producer_warps, 1], [1, 0])
        if lanes_per_row <= 32 else None,
        SCALE_LAYOUT=gl.BlockedLayout([1], [32], [producer_warps], [0]),
        EARLY_TABLE=bool(len(config) > 9 and config[9]) and block_size % BLOCK_K.value == 0,
        TMA_PAGES=tma_pages,
    ))


def _tma_pages(cache: IndexerKCache, config: tuple) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """The key and scale descriptors of ``_fill_tiles_tma`` when ``config`` asks for TMA page copies (field
    10) and the cache allows them: 16-byte aligned, pages of whole 64-key tiles, a page stride that is a
    multiple of a key row, ``head_dim <= 128`` (a key row within one 128-byte swizzle span, as the key ring's
    layout needs); None otherwise (the cp.async producer runs)."""
    buffer = cache.buffer
    row_bytes = cache.head_dim  # one e4m3 key row = one descriptor row
    if (len(config) < 11 or not config[10] or buffer.data_ptr() % 16 or cache.page_stride % row_bytes
            or cache.block_size % BLOCK_K.value or row_bytes > 128):
        return None
    return page_descriptors(cache, _build_page_descriptors)


# Per cache object: (the buffer's address, shape and page stride, its descriptors by builder). The
# descriptors reference the buffer, not the cache, so an entry goes when its cache does.
_PAGE_DESCRIPTORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def page_descriptors(cache: IndexerKCache, build) -> tuple:
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


def _build_page_descriptors(cache: IndexerKCache) -> tuple[TensorDescriptor, TensorDescriptor]:
    """``_tma_pages``'s descriptors: the cache as rows of one e4m3 key row (``head_dim`` bytes)."""
    buffer = cache.buffer
    row_bytes = cache.head_dim
    rows = ((buffer.shape[0] - 1) * cache.page_stride + cache.block_size * (row_bytes + 4)) // row_bytes
    key_layout = gl.NVMMASharedLayout(swizzle_byte_width=row_bytes, element_bitwidth=8, rank=2)
    scale_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    return (TensorDescriptor(buffer.view(FP8_DTYPE), [rows, row_bytes], [row_bytes, 1], [BLOCK_K.value, row_bytes],
                             key_layout),
            TensorDescriptor(buffer, [rows, row_bytes], [row_bytes, 1], [4 * BLOCK_K.value // row_bytes, row_bytes],
                             scale_layout))


def gluon_decode_preferred(batch: int, next_n: int, max_context_len: int) -> bool:
    """Whether the Gluon kernel beats the Triton one for this call (host integers only). Measured (H200,
    cold-L2 graph replays, NOTES_logits.md run 6 and session 5 round 2): draft rows (``next_n >= 2``) win
    from B = 1, L = 128K up (1.25-1.37x with cp.async; 1.45x with TMA in the session 5 suite: 14.4 vs
    21.0 µs); one row wins from B = 32, L = 32K (1M keys, 49.1 vs 51.7 µs) up, loses at B = 1, L = 128K
    (13.44 with TMA vs 13.25 µs)."""
    keys = batch * max_context_len
    return keys >= (GLUON_MIN_KEYS_ONE_ROW if next_n == 1 else GLUON_MIN_KEYS_DRAFT_ROWS)


def gluon_decode_config(batch: int, next_n: int, max_context_len: int, sms: int) -> tuple:
    """The launcher's default configuration for this call (host integers only; ``sms``: the GPU's SM count):
    ``GLUON_DECODE_CONFIG_ONE_ROW`` at next_n = 1; with draft rows ``GLUON_DECODE_CONFIG`` from
    ``GLUON_LARGE_KEYS`` keys up (more programs per SM), below it ``GLUON_DECODE_CONFIG_WAVE`` where its one
    wave is well filled (``_wave_split``), else ``GLUON_DECODE_CONFIG_SMALL`` (persistent: fewer, longer-lived
    programs)."""
    if next_n == 1:
        return GLUON_DECODE_CONFIG_ONE_ROW
    if batch * max_context_len >= GLUON_LARGE_KEYS:
        return GLUON_DECODE_CONFIG
    if wave_fills(GLUON_DECODE_CONFIG_WAVE, batch, next_n, max_context_len, sms):
        return GLUON_DECODE_CONFIG_WAVE
    return GLUON_DECODE_CONFIG_SMALL


def wave_fills(config: tuple, batch: int, next_n: int, max_context_len: int, sms: int) -> bool:
    """Whether the one-wave split of ``config`` (fields 1 and 4: programs a SM, draft rows a program) takes at
    least ``GLUON_WAVE_MIN_FILL`` of its wave's slots for this call (host integers only)."""
    row_groups = batch * triton.cdiv(next_n, config[4])
    fill = _wave_split(row_groups, triton.cdiv(max_context_len, BLOCK_K.value), config[1], sms)[1]
    return fill >= GLUON_WAVE_MIN_FILL


def _nothing_to_read(cache: IndexerKCache, block_table: torch.Tensor, batch: int, max_context_len: int, clean: bool,
                     out: torch.Tensor) -> bool:
    """Whether a call reads no key (no rows or positions, an empty cache or table), shared by the FP8 and
    MXFP4 launchers; with an empty cache or table and ``clean`` it fills ``out`` with ``-inf`` here."""
    if batch == 0 or max_context_len == 0:
        return True
    if cache.num_blocks == 0 or block_table.shape[1] == 0:
        if clean:
            out.fill_(float("-inf"))
        return True
    return False


def _wave_split(work_groups: int, key_tiles: int, per_sm: int, sms: int) -> tuple[int, float]:
    """One wave of one-item programs, ``per_sm`` a SM: (key tiles per split, any count: each row group's tiles
    in as many even splits as the wave's slots allow; the share of the slots of the waves the items take, so
    more row groups than slots, which need a second, partly empty wave, count as a poor fill)."""
    slots = per_sm * sms
    tiles = triton.cdiv(key_tiles, max(1, slots // work_groups))
    items = work_groups * triton.cdiv(key_tiles, tiles)
    return tiles, items / (triton.cdiv(items, slots) * slots)


def _launch_shape(q: torch.Tensor, cache: IndexerKCache, max_context_len: int, config: tuple,
                  one_wave: bool) -> tuple:
    """(draft rows per work item: 1 or 2, row groups, splits per row group, key tiles per split, copy width
    in bytes) of a call, shared by the FP8 and MXFP4 launchers; ``config`` fields 1-4 as in
    ``GLUON_DECODE_CONFIG`` (work items per SM aimed at, tiles per split min/max, draft rows at most);
    ``one_wave``: splits of any size that fill one wave (``_wave_split``), else power-of-two ones."""
    batch, next_n = q.shape[:2]
    per_sm, lo, hi, max_rows = config[1:5]
    rows = 1 if min(next_n, max_rows) == 1 else 2
    num_groups = triton.cdiv(next_n, rows)
    key_tiles = triton.cdiv(max_context_len, BLOCK_K)
    if one_wave:
        tiles = _wave_split(batch * num_groups, key_tiles, per_sm, _backend.multiprocessor_count(q.device))[0]
    else:
        tiles = _split_tiles(batch * num_groups, key_tiles, q.device, per_sm, lo, hi)
    # 16-byte copies when the cache allows them; the cache guarantees 4-byte alignment (cp.async's minimum).
    copy_align = 16 if cache.buffer.data_ptr() % 16 == 0 and cache.page_stride % 16 == 0 else 4
    return rows, num_groups, triton.cdiv(key_tiles, tiles), tiles, copy_align


def paged_mqa_logits_gluon(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    cache: IndexerKCache,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    clean: bool,
    out: torch.Tensor,
    *,
    config: tuple | None = None,
) -> torch.Tensor:
    """Gluon twin of ``paged_mqa_logits_triton`` for FP8 caches (same arguments, validated by the public
    wrapper; CUDA with sm_90 only). ``config`` overrides ``gluon_decode_config``'s choice (benchmarks; an
    8-entry tuple means one work item per program)."""
    if cache.fmt != "fp8" or q_scale is not None:
        raise ValueError(f"the Gluon decode kernel takes FP8 caches only, got fmt {cache.fmt!r}")
    batch, next_n = q.shape[:2]
    heads = weights.shape[1]
    if _nothing_to_read(cache, block_table, batch, max_context_len, clean, out):
        return out
    config = config or gluon_decode_config(batch, next_n, max_context_len, _backend.multiprocessor_count(q.device))
    maxnreg = config[7]
    persistent_per_sm = config[8] if len(config) > 8 else 0
    rows, num_groups, num_splits, tiles, copy_align = _launch_shape(q, cache, max_context_len, config,
                                                                    len(config) > 11 and bool(config[11]))
    num_works = batch * num_groups * num_splits
    programs = num_works
    if persistent_per_sm:
        programs = min(num_works, persistent_per_sm * _backend.multiprocessor_count(q.device))
    buffer = cache.buffer
    descriptors = _tma_pages(cache, config)
    if descriptors is None and len(config) > 10 and config[10]:
        # The cp.async producer instead: four warps' copies, in the same registers (the producer partition is
        # a whole warpgroup either way).
        config = config[:5] + (4,) + config[6:]
    constants = kernel_constants(heads, cache.head_dim, cache.block_size, rows, clean, copy_align, config,
                                 query_slots=1 if programs == num_works else 2, tma_pages=descriptors is not None)
    key_desc, scale_desc = descriptors or (None, None)
    q_values = q
    if (q.data_ptr() % 16 or q.stride(3) != 1 or any(stride % 16 for stride in q.stride()[:3])
            or descriptors and not q.is_contiguous()):
        # 16-byte cp.async of each query row; TMA: the queries as [batch * next_n * heads, D] rows
        q_values = q.clone(memory_format=torch.contiguous_format)
    query_desc = None
    if descriptors:
        query_desc = TensorDescriptor(q_values, [batch * next_n * heads, cache.head_dim], [cache.head_dim, 1],
                                      [constants["BLOCK_H"], cache.head_dim], constants["KEY_SMEM_LAYOUT"])
    one_d = context_lens.dim() == 1
    _paged_mqa_logits_ws_kernel[(programs,)](
        q_values, q_values.stride(0), q_values.stride(1), q_values.stride(2),
        weights, weights.stride(0), weights.stride(1),
        buffer.view(FP8_DTYPE), buffer, cache.page_stride // copy_align, cache.num_blocks,
        context_lens, context_lens.stride(0), 0 if one_d else context_lens.stride(1),
        block_table, block_table.stride(0), block_table.shape[1],
        out, out.stride(0),
        next_n, int(one_d), max_context_len, num_splits, num_groups, num_works, tiles, key_desc, scale_desc,
        cache.page_stride // cache.head_dim if descriptors else None, query_desc,
        **constants, num_warps=4, maxnreg=maxnreg,
    )
    return out
