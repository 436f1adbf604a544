"""Gluon (warp-specialised) FP8 paged decode logits: the twin of ``paged_mqa_logits_triton`` for fmt fp8.

Same contract, work items and results' tier as the Triton kernel: (request, group of ``ROWS`` draft rows, split
of ``split_tiles * BLOCK_K`` positions), one key tile of ``BLOCK_K = 64`` positions (one wgmma M tile) at a time. A
program runs one work item or, persistent, items ``pid, pid + programs, ...``. A producer partition (one warp)
copies queries, block-table entries, keys and scales into a shared-memory ring by TMA (``ops/common/gluon``:
``fill_tiles_tma``; the cp.async producer where TMA cannot take the cache); the consumer (one warpgroup) issues
one asynchronous ``[64 keys, D] x [D, BLOCK_H heads]`` wgmma per draft row and runs row 0's epilogue under row
1's wgmma. The dispatch (``ops/logits/__init__.py``) sends FP8 decode here where ``gluon_decode_preferred`` says
it wins; ``gluon_decode_config`` picks the launch by work size. Design and measurements: ``README.md``.
Needs a CUDA GPU with wgmma (sm_90); Gluon does not run under the interpreter.
"""

from __future__ import annotations

import functools
import types

import torch
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

from ...cache_layout import KCacheLayout
from ...formats import FP8_DTYPE
from ..common.gluon import (
    BLOCK_K,
    GluonDecodeConfig,
    cp_async_fallback,
    fill_tiles,
    fill_tiles_tma,
    launch_shape,
    page_descriptors,
    row_outputs,
    store_row,
    store_tail,
    wave_fills,
    work_item,
)
from ..common.logits_checks import nothing_to_read
from ..common.runtime import next_pow2, sm_count

__all__ = ["paged_mqa_logits_gluon", "gluon_decode_preferred", "gluon_decode_config", "GLUON_DECODE_CONFIG"]

# The launches that ship, picked per call by ``gluon_decode_config`` (measurements: README.md). Draft rows at
# ``batch * max_context_len >= GLUON_LARGE_KEYS``: three programs per SM, one work item each.
GLUON_DECODE_CONFIG = GluonDecodeConfig()
# Draft rows below that: two persistent programs per SM (the next item's loads hide its prologue), 4 items
# per SM aimed at (long splits: fewer per-item query copies and first-entry chains), each item's first table
# entry read beside its lengths.
GLUON_DECODE_CONFIG_SMALL = GluonDecodeConfig(programs_per_sm=4, maxnreg=128, persistent_per_sm=2, early_table=True)
# Draft rows below GLUON_LARGE_KEYS where one wave fills at least GLUON_WAVE_MIN_FILL of its slots: three one-item
# programs per SM, each row group's tiles in even splits of any size that fill one wave.
GLUON_DECODE_CONFIG_WAVE = GluonDecodeConfig(programs_per_sm=3, early_table=True, one_wave=True)
# next_n = 1: four persistent programs per SM (one accumulator: 104 consumer registers, no spills).
GLUON_DECODE_CONFIG_ONE_ROW = GluonDecodeConfig(max_rows=1, maxnreg=64, persistent_per_sm=4)
GLUON_LARGE_KEYS = 1 << 22
# Smallest ``batch * max_context_len`` the dispatch sends to the Gluon kernel, by draft rows (see
# ``gluon_decode_preferred``).
GLUON_MIN_KEYS_ONE_ROW = 1 << 20
GLUON_MIN_KEYS_DRAFT_ROWS = 1 << 16


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
    per tile ``[BLOCK_K, DIM]`` keys and ``[BLOCK_K]`` scales into the ring (``fill_tiles``). The ring's use
    count runs on across work items, so the next item's first tiles load while the consumer still works on
    this one. ``EARLY_TABLE`` (pages a multiple of a tile only): an item's first table entry is read before
    its lengths. ``TMA_PAGES``: the tiles by ``fill_tiles_tma`` (``key_desc``, ``scale_desc``, ``page_rows``)
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
        request, t0, _, _, split_start, _, read_end, num_tiles = work_item(
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
            fill_tiles_tma(key_desc, scale_desc, page_rows, num_blocks, table_row, key_ring, scale_ring, ready, empty,
                            split_start, read_end, uses, num_tiles, first_page, DIM, BLOCK_SIZE, NUM_STAGES,
                            EARLY_TABLE)
        else:
            fill_tiles(values_ptr, cache_ptr, page_units, num_blocks, table_row, key_ring, scale_ring, ready, empty,
                        split_start, read_end, uses, num_tiles, first_page, key, dim, scale_key, DIM, BLOCK_SIZE,
                        NUM_STAGES, COPY_ALIGN, EARLY_TABLE)
        uses += num_tiles
        done += 1


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
        request, t0, length0, length1, split_start, split_end, read_end, num_tiles = work_item(
            lens_ptr, stride_lb, stride_lt, work, next_n, one_d, max_context_len, num_splits, num_groups, ROWS,
            split_tiles, table_positions)
        present0, present1, half_w0, half_w1, out_row0, out_row1 = row_outputs(
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
                store_row(acc0, half_w0, key_mul, out_row0, positions, live, length0, present0, CLEAN)
                acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, ))
                gl.thread_barrier()  # every warp's wgmmas read the stage, and row 0's epilogue used its key_mul
                mbarrier.arrive(empty.index(stage), count=1)
                store_row(acc1, half_w1, key_mul, out_row1, positions, live, length1, present1, CLEAN)
            else:
                acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, ))
                # key_mul is used before the stage goes back: neither the barrier nor the arrive waits for a
                # shared load's data, and the TMA refill is not ordered after a pending load.
                store_row(acc0, half_w0, key_mul, out_row0, positions, live, length0, present0, CLEAN)
                gl.thread_barrier()
                mbarrier.arrive(empty.index(stage), count=1)
        # Every wgmma of this item has been waited for. The barrier also keeps a warp from falling a whole
        # item behind (an item without tiles has no other): a slot is refilled only after every warp has
        # passed its wait for the current fill, so no wait can see the parity of a later fill.
        gl.thread_barrier()
        mbarrier.arrive(query_empty.index(query_slot), count=1)
        if CLEAN:
            store_tail(out_row0, out_row1, present0, present1, split_start, split_end, read_end, key, ROWS)
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
def kernel_constants(heads: int, dim: int, block_size: int, rows: int, clean: bool, copy_align: int,
                     config: GluonDecodeConfig, query_slots: int = 1, tma_pages: bool = False) -> types.MappingProxyType:
    """The kernel's compile-time arguments (launcher and ahead-of-time compilation share them); ``config``
    the launch, ``query_slots`` 2 when a program runs several work items,
    ``tma_pages`` whether the launch copies the tiles by TMA (``_tma_pages``). Cached, read-only: building
    the layouts is host time on every decode call otherwise."""
    num_stages, producer_warps, producer_regs = config.num_stages, config.producer_warps, config.producer_regs
    if dim & (dim - 1) or not 32 <= dim <= 512:
        raise ValueError(f"the Gluon decode kernel needs a power-of-two head_dim in [32, 512], got {dim}")
    if heads > 128:
        raise ValueError(f"the Gluon decode kernel takes at most 128 heads, got {heads}")
    lanes_per_row = dim // 16
    return types.MappingProxyType(dict(
        HEADS=heads, BLOCK_H=next_pow2(heads, 16), DIM=dim, BLOCK_SIZE=block_size, ROWS=rows,
        NUM_STAGES=num_stages, QUERY_SLOTS=query_slots, CLEAN=clean, PRODUCER_WARPS=producer_warps,
        PRODUCER_REGS=producer_regs, COPY_ALIGN=copy_align,
        KEY_SMEM_LAYOUT=gl.NVMMASharedLayout(swizzle_byte_width=min(128, dim), element_bitwidth=8, rank=2),
        COPY_LAYOUT=gl.BlockedLayout([1, 16], [32 // lanes_per_row, lanes_per_row], [producer_warps, 1], [1, 0])
        if lanes_per_row <= 32 else None,
        SCALE_LAYOUT=gl.BlockedLayout([1], [32], [producer_warps], [0]),
        EARLY_TABLE=config.early_table and block_size % BLOCK_K.value == 0,
        TMA_PAGES=tma_pages,
    ))


def _tma_pages(cache: KCacheLayout, config: GluonDecodeConfig) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """The key and scale descriptors of ``fill_tiles_tma`` when ``config`` asks for TMA page copies
    (``tma_pages``) and the cache allows them: 16-byte aligned, pages of whole 64-key tiles, a page stride that is a
    multiple of a key row, ``head_dim <= 128`` (a key row within one 128-byte swizzle span, as the key ring's
    layout needs); None otherwise (the cp.async producer runs)."""
    buffer = cache.buffer
    row_bytes = cache.head_dim  # one e4m3 key row = one descriptor row
    if (not config.tma_pages or buffer.data_ptr() % 16 or cache.page_stride % row_bytes
            or cache.block_size % BLOCK_K.value or row_bytes > 128):
        return None
    return page_descriptors(cache, _build_page_descriptors)


def _build_page_descriptors(cache: KCacheLayout) -> tuple[TensorDescriptor, TensorDescriptor]:
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
    """Whether the Gluon kernel beats the Triton one for this call (host integers only): draft rows
    (``next_n >= 2``) from ``GLUON_MIN_KEYS_DRAFT_ROWS`` keys (``batch * max_context_len``) up, one row from
    ``GLUON_MIN_KEYS_ONE_ROW`` up (measurements: README.md)."""
    keys = batch * max_context_len
    return keys >= (GLUON_MIN_KEYS_ONE_ROW if next_n == 1 else GLUON_MIN_KEYS_DRAFT_ROWS)


def gluon_decode_config(batch: int, next_n: int, max_context_len: int, sms: int) -> GluonDecodeConfig:
    """The launcher's default configuration for this call (host integers only; ``sms``: the GPU's SM count):
    ``GLUON_DECODE_CONFIG_ONE_ROW`` at next_n = 1; with draft rows ``GLUON_DECODE_CONFIG`` from
    ``GLUON_LARGE_KEYS`` keys up (more programs per SM), below it ``GLUON_DECODE_CONFIG_WAVE`` where its one
    wave is well filled (``wave_split``), else ``GLUON_DECODE_CONFIG_SMALL`` (persistent: fewer, longer-lived
    programs)."""
    if next_n == 1:
        return GLUON_DECODE_CONFIG_ONE_ROW
    if batch * max_context_len >= GLUON_LARGE_KEYS:
        return GLUON_DECODE_CONFIG
    if wave_fills(GLUON_DECODE_CONFIG_WAVE, batch, next_n, max_context_len, sms):
        return GLUON_DECODE_CONFIG_WAVE
    return GLUON_DECODE_CONFIG_SMALL


def paged_mqa_logits_gluon(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    cache: KCacheLayout,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    clean: bool,
    out: torch.Tensor,
    *,
    config: GluonDecodeConfig | None = None,
) -> torch.Tensor:
    """Gluon twin of ``paged_mqa_logits_triton`` for FP8 caches (same arguments, validated by the public
    wrapper; CUDA with sm_90 only). ``config`` overrides ``gluon_decode_config``'s choice (benchmarks, tests)."""
    if cache.fmt != "fp8" or q_scale is not None:
        raise ValueError(f"the Gluon decode kernel takes FP8 caches only, got fmt {cache.fmt!r}")
    batch, next_n = q.shape[:2]
    heads = weights.shape[1]
    if nothing_to_read(cache, block_table, batch, max_context_len, clean, out):
        return out
    config = config or gluon_decode_config(batch, next_n, max_context_len, sm_count(q.device))
    rows, num_groups, num_splits, tiles, copy_align = launch_shape(q, cache, max_context_len, config)
    num_works = batch * num_groups * num_splits
    programs = num_works
    if config.persistent_per_sm:
        programs = min(num_works, config.persistent_per_sm * sm_count(q.device))
    buffer = cache.buffer
    descriptors = _tma_pages(cache, config)
    if descriptors is None and config.tma_pages:
        config = cp_async_fallback(config)
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
        **constants, num_warps=4, maxnreg=config.maxnreg,
    )
    return out
