"""Gluon (warp-specialised) MXFP4 paged decode logits: the twin of ``paged_mqa_logits_triton`` for fmt mxfp4.

Same contract, grid and arithmetic as the Triton kernel: programs over (request, group of ``ROWS`` draft rows,
split of ``split_tiles * BLOCK_K`` positions), one key tile of ``BLOCK_K = 64`` positions at a time. A producer
partition (one warp) copies the packed e2m1 bytes and the ue8m0 scale words of each tile into a shared-memory
ring by TMA (``ops/common/gluon``; the cp.async producer where TMA cannot take the cache). The consumer (one
warpgroup) reads a stage into registers, expands it with the Triton kernel's inline PTX
(``ops/common/codecs``: same instructions, same bits) in a layout that is the wgmma register A operand in
``mxfp4_dot_order`` (asserted at compile time), and runs one async wgmma chain per draft row, row 0's epilogue
under row 1's wgmma. Design and measurements: ``README.md``. Needs a CUDA GPU with wgmma (sm_90+) and
``head_dim == 128`` (four scale blocks: one per lane of a quad in the wgmma register operand); Gluon does not
run under the interpreter.
"""

from __future__ import annotations

import functools
import types

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...cache_layout import KCacheLayout
from ...formats import FP8_DTYPE
from ..common.codecs import E2M1_EXPAND_ASM, E4M3_TABLE_ASM, mxfp4_rows
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

__all__ = ["paged_mqa_logits_gluon_mxfp4", "gluon_mxfp4_decode_preferred", "gluon_mxfp4_decode_config",
           "GLUON_MXFP4_DECODE_CONFIG"]

DIM = gl.constexpr(128)  # head_dim this kernel takes: D/32 = 4 scale blocks, one per lane of a quad
# The launches that ship, picked per call by ``gluon_mxfp4_decode_config`` (measurements: README.md). Draft
# rows: three programs per SM (register cap 80: consumer 136 registers with 24 producer registers), TMA.
GLUON_MXFP4_DECODE_CONFIG = GluonDecodeConfig()
# Draft rows where one wave fills its slots (``wave_fills``): the same programs, each row group's tiles in even
# splits of any size that give one wave of three programs a SM.
GLUON_MXFP4_DECODE_CONFIG_WAVE = GluonDecodeConfig(programs_per_sm=3, one_wave=True)
# next_n = 1: four programs per SM (cap 64: consumer 104 registers), TMA.
GLUON_MXFP4_DECODE_CONFIG_ONE_ROW = GluonDecodeConfig(maxnreg=64)
# Smallest ``batch * max_context_len`` the dispatch sends to this kernel (``gluon_mxfp4_decode_preferred``), and
# for draft rows of requests of at least GLUON_MXFP4_MIN_LEN_WAVE keys (whose one wave fills its slots).
GLUON_MXFP4_MIN_KEYS = 1 << 20
GLUON_MXFP4_MIN_KEYS_WAVE = 1 << 17
GLUON_MXFP4_MIN_LEN_WAVE = 1 << 16


@gluon.jit
def _producer(values_ptr, cache_ptr, page_units, num_blocks, key_desc, scale_desc, page_rows, table_row, key_ring,
              scale_ring, ready, empty, split_start, read_end, num_fills,
              BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr, TMA_PAGES: gl.constexpr, COPY_ALIGN: gl.constexpr,
              COPY_LAYOUT: gl.constexpr, SCALE_LAYOUT: gl.constexpr):
    """Per tile ``[BLOCK_K, D/2]`` packed bytes and ``[BLOCK_K]`` scale words into the ring, ``num_fills``
    tiles: two TMA copies a tile with ``TMA_PAGES`` (``fill_tiles_tma``: the cache as rows of ``D/2`` bytes,
    ``page_rows`` a page), else cp.async (``fill_tiles``; positions ``>= read_end`` are zero-filled: code 0
    in a block of exponent 0 expands to +0). A page id outside ``[0, num_blocks)`` reads as zeros too."""
    if TMA_PAGES:
        fill_tiles_tma(key_desc, scale_desc, page_rows, num_blocks, table_row, key_ring, scale_ring, ready, empty,
                        split_start, read_end, 0, num_fills, 0, DIM // 2, BLOCK_SIZE, NUM_STAGES, False)
    else:
        key = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, COPY_LAYOUT))
        byte = gl.arange(0, DIM // 2, layout=gl.SliceLayout(0, COPY_LAYOUT))
        scale_key = gl.arange(0, BLOCK_K, layout=SCALE_LAYOUT)
        fill_tiles(values_ptr, cache_ptr, page_units, num_blocks, table_row, key_ring, scale_ring, ready, empty,
                    split_start, read_end, 0, num_fills, 0, key, byte, scale_key, DIM // 2, BLOCK_SIZE, NUM_STAGES,
                    COPY_ALIGN, False)


@gluon.jit
def _load_queries(q_ptr, stride_qb, stride_qt, stride_qh, query_smem, request, t0, next_n,
                  HEADS: gl.constexpr, BLOCK_H: gl.constexpr, ROWS: gl.constexpr, QUERY_LAYOUT: gl.constexpr):
    """De-interleaved e4m3 queries ``[ROWS, BLOCK_H, D]`` -> shared memory in ``mxfp4_dot_order`` (position
    ``16i + 4b + j`` of each half holds half element ``16b + 4i + j``), zero for absent heads and rows."""
    head = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, QUERY_LAYOUT))
    position = gl.arange(0, DIM, layout=gl.SliceLayout(0, QUERY_LAYOUT))
    within = position % (DIM // 2)
    source = (position // (DIM // 2)) * (DIM // 2) + 16 * ((within // 4) % 4) + 4 * (within // 16) + within % 4
    for r in gl.static_range(ROWS):
        t = t0 + r
        rows = q_ptr + request.to(gl.int64) * stride_qb + t * stride_qt + head * stride_qh  # [BLOCK_H]
        values = gl.load(rows[:, None] + source[None, :], mask=((head < HEADS) & (t < next_n))[:, None], other=0.0)
        query_smem.index(r).store(values)


@gluon.jit
def _expand_tile(key_ring, scale_ring, stage, ROW_BYTES_LAYOUT: gl.constexpr, PACKED_LAYOUT: gl.constexpr,
                 A_LAYOUT: gl.constexpr, ROW_LAYOUT: gl.constexpr):
    """One stage's packed keys -> (e4m3 ``[BLOCK_K, D]`` in the wgmma A register layout, contraction in
    ``mxfp4_dot_order``: even half then odd half; fp32 ``[BLOCK_K]`` ``2**e_max`` per key in ``ROW_LAYOUT``;
    ``e_max``: the max over the quad's four blocks, two shuffles)."""
    block_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(3, PACKED_LAYOUT))  # [BLOCK_K, 4 blocks]
    # Byte 16q + 4k + j of a key row (block q, word k, byte j) read as [key, k, q, j]: a thread's 16 bytes
    # of one block and row are contiguous (one 16-byte shared load), its block is its lane's index in the quad.
    packed = key_ring.index(stage).load(ROW_BYTES_LAYOUT)  # [BLOCK_K, D/2]
    packed = gl.permute(gl.reshape(packed, [BLOCK_K, 4, 4, 4]), (0, 2, 1, 3))
    packed = gl.convert_layout(packed, PACKED_LAYOUT, assert_trivial=True)
    words = scale_ring.index(stage).load(gl.SliceLayout(1, block_layout))  # [BLOCK_K] ue8m0 x4 (block b: byte b)
    block = gl.arange(0, 4, layout=gl.SliceLayout(0, block_layout))
    exponents = (words[:, None] >> (8 * block[None, :])) & 0xFF  # [BLOCK_K, 4]: this lane's block only
    top = gl.max(exponents, axis=1)  # [BLOCK_K]
    # The Triton path's block multiplier 2**(14 + e_b - e_max) as fp16 exponent field (0: block dropped).
    scale_pair = gl.maximum(29 - (top[:, None] - exponents), 0) * 0x04000400  # fp16x2 bits
    table_low, table_high = gl.inline_asm_elementwise(
        E4M3_TABLE_ASM, "=r,=r,r", [scale_pair], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    even, odd = gl.inline_asm_elementwise(
        E2M1_EXPAND_ASM, "=r,=r,r,r,r,r,r,r,r,r,r",
        [packed, gl.expand_dims(gl.expand_dims(table_low, 1), 3), gl.expand_dims(gl.expand_dims(table_high, 1), 3)],
        dtype=(gl.float8e4nv, gl.float8e4nv), is_pure=True, pack=4)  # [BLOCK_K, 4 k, 4 q, 4 j] each
    # Column 64h + 16k + 4q + j of the A operand: half h, word k of block q, byte j.
    keys = gl.reshape(gl.permute(gl.join(even, odd), (0, 4, 1, 2, 3)), [BLOCK_K, DIM])
    keys = gl.convert_layout(keys, A_LAYOUT, assert_trivial=True)
    key_mul = gl.convert_layout((top << 23).to(gl.float32, bitcast=True), ROW_LAYOUT, assert_trivial=True)
    return keys, key_mul


@gluon.jit
def _take_tile(key_ring, scale_ring, ready, tile, stage, NUM_STAGES: gl.constexpr, ROW_BYTES_LAYOUT: gl.constexpr,
               PACKED_LAYOUT: gl.constexpr, A_LAYOUT: gl.constexpr, ROW_LAYOUT: gl.constexpr):
    """Wait for ``tile``'s ``stage`` and expand it into registers (``_expand_tile``). The caller hands the stage
    back once the tile's wgmmas are done: neither a thread barrier nor the mbarrier arrive waits for a shared
    load's data to return, and the producer's TMA write (async proxy) is not ordered after a pending load; the
    wgmmas consume the loaded bytes, so once they are done every load has landed."""
    mbarrier.wait(ready.index(stage), (tile // NUM_STAGES) & 1)
    return _expand_tile(key_ring, scale_ring, stage, ROW_BYTES_LAYOUT, PACKED_LAYOUT, A_LAYOUT, ROW_LAYOUT)


@gluon.jit
def _consumer(q_ptr, stride_qb, stride_qt, stride_qh, w_ptr, stride_wr, stride_wh, out_ptr, stride_or,
              key_ring, scale_ring, query_smem, ready, empty,
              request, t0, next_n, length0, length1, split_start, split_end, read_end, num_tiles,
              HEADS: gl.constexpr, BLOCK_H: gl.constexpr, ROWS: gl.constexpr, NUM_STAGES: gl.constexpr,
              CLEAN: gl.constexpr, ROW_BYTES_LAYOUT: gl.constexpr, PACKED_LAYOUT: gl.constexpr,
              QUERY_LAYOUT: gl.constexpr):
    """Queries once; per tile: expand, one async wgmma per row, row 0's epilogue under row 1's wgmma; then the
    ``-inf`` tail."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_H, 32])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=4)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    _load_queries(q_ptr, stride_qb, stride_qt, stride_qh, query_smem, request, t0, next_n,
                  HEADS, BLOCK_H, ROWS, QUERY_LAYOUT)
    fence_async_shared()  # generic-proxy stores, read by wgmma through the async proxy
    gl.thread_barrier()
    head = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, mma_layout))
    key = gl.arange(0, BLOCK_K, layout=row_layout)
    present0, present1, half_w0, half_w1, out_row0, out_row1 = row_outputs(
        w_ptr, stride_wr, stride_wh, out_ptr, stride_or, request, t0, next_n, head, HEADS, ROWS)
    zero = gl.zeros([BLOCK_K, BLOCK_H], gl.float32, layout=mma_layout)
    for tile in range(num_tiles):
        stage = tile % NUM_STAGES
        keys, key_mul = _take_tile(key_ring, scale_ring, ready, tile, stage, NUM_STAGES, ROW_BYTES_LAYOUT,
                                   PACKED_LAYOUT, a_layout, row_layout)
        acc0 = warpgroup_mma(keys, query_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        if ROWS == 2:
            acc1 = warpgroup_mma(keys, query_smem.index(1).permute((1, 0)), zero, use_acc=False, is_async=True)
        positions = split_start + tile * BLOCK_K + key
        live = positions < read_end
        if ROWS == 2:
            acc0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, ))
            store_row(acc0, half_w0, key_mul, out_row0, positions, live, length0, present0, CLEAN)
            acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, ))
            gl.thread_barrier()  # every warp's wgmmas of this tile are done, so its loads of the stage are too
            mbarrier.arrive(empty.index(stage), count=1)
            store_row(acc1, half_w1, key_mul, out_row1, positions, live, length1, present1, CLEAN)
        else:
            acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, ))
            gl.thread_barrier()
            mbarrier.arrive(empty.index(stage), count=1)
            store_row(acc0, half_w0, key_mul, out_row0, positions, live, length0, present0, CLEAN)
    if CLEAN:
        store_tail(out_row0, out_row1, present0, present1, split_start, split_end, read_end, key, ROWS)


@gluon.jit(do_not_specialize=["num_blocks", "table_columns", "next_n", "one_d", "max_context_len", "num_splits",
                              "num_groups", "split_tiles"])
def _paged_mqa_logits_mxfp4_ws_kernel(
    q_ptr, stride_qb, stride_qt, stride_qh,
    w_ptr, stride_wr, stride_wh,
    values_ptr, cache_ptr, page_units, num_blocks,
    lens_ptr, stride_lb, stride_lt,
    table_ptr, stride_tb, table_columns,
    out_ptr, stride_or,
    next_n, one_d, max_context_len, num_splits, num_groups, split_tiles, key_desc, scale_desc, page_rows,
    HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    ROWS: gl.constexpr, NUM_STAGES: gl.constexpr, CLEAN: gl.constexpr,
    TMA_PAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    COPY_ALIGN: gl.constexpr,
    QUERY_SMEM_LAYOUT: gl.constexpr, COPY_LAYOUT: gl.constexpr, SCALE_LAYOUT: gl.constexpr,
    ROW_BYTES_LAYOUT: gl.constexpr, PACKED_LAYOUT: gl.constexpr, QUERY_LAYOUT: gl.constexpr,
):
    """Draft rows ``[t0, t0 + ROWS)`` of one request over one split of ``split_tiles * BLOCK_K`` positions
    (program ids: request, split, row group fastest, as in the Triton kernel; ``split_tiles`` is a runtime
    value, so a one-wave split of any size compiles once). ``key_desc``, ``scale_desc``,
    ``page_rows``: ``fill_tiles_tma``'s arguments with ``TMA_PAGES``, None otherwise."""
    request, t0, length0, length1, split_start, split_end, read_end, num_tiles = work_item(
        lens_ptr, stride_lb, stride_lt, gl.program_id(0), next_n, one_d, max_context_len, num_splits, num_groups, ROWS,
        split_tiles, table_columns * BLOCK_SIZE)
    table_row = table_ptr + request.to(gl.int64) * stride_tb

    key_ring = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, BLOCK_K, DIM // 2],
                                         gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    scale_ring = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, BLOCK_K], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    query_smem = gl.allocate_shared_memory(gl.float8e4nv, [ROWS, BLOCK_H, DIM], QUERY_SMEM_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1 if TMA_PAGES else 32 * PRODUCER_WARPS)
        mbarrier.init(empty.index(s), count=1)

    gl.warp_specialize([
        (_consumer, (q_ptr, stride_qb, stride_qt, stride_qh, w_ptr, stride_wr, stride_wh, out_ptr, stride_or,
                     key_ring, scale_ring, query_smem, ready, empty,
                     request, t0, next_n, length0, length1, split_start, split_end, read_end, num_tiles,
                     HEADS, BLOCK_H, ROWS, NUM_STAGES, CLEAN, ROW_BYTES_LAYOUT, PACKED_LAYOUT, QUERY_LAYOUT)),
        (_producer, (values_ptr, cache_ptr, page_units, num_blocks, key_desc, scale_desc, page_rows, table_row, key_ring,
                     scale_ring, ready, empty, split_start, read_end, num_tiles, BLOCK_SIZE, NUM_STAGES, TMA_PAGES,
                     COPY_ALIGN, COPY_LAYOUT, SCALE_LAYOUT)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


@functools.lru_cache(maxsize=256)
def kernel_constants(heads: int, block_size: int, rows: int, clean: bool, copy_align: int,
                     config: GluonDecodeConfig, tma_pages: bool = False) -> types.MappingProxyType:
    """The kernel's compile-time arguments (launcher and ahead-of-time compilation share them); ``tma_pages``:
    whether the launch takes the TMA producer (``_tma_pages``). Cached, read-only: building the layouts
    costs more host time than the launch."""
    num_stages, producer_warps, producer_regs = config.num_stages, config.producer_warps, config.producer_regs
    if heads > 128:
        raise ValueError(f"the Gluon MXFP4 decode kernel takes at most 128 heads, got {heads}")
    lanes_per_row = (DIM.value // 2) // copy_align  # copy_align bytes a thread, a packed row is D/2 bytes
    return types.MappingProxyType(dict(
        HEADS=heads, BLOCK_H=next_pow2(heads, 16), BLOCK_SIZE=block_size, ROWS=rows,
        NUM_STAGES=num_stages, CLEAN=clean, TMA_PAGES=int(tma_pages), PRODUCER_WARPS=producer_warps,
        PRODUCER_REGS=producer_regs, COPY_ALIGN=copy_align,
        QUERY_SMEM_LAYOUT=gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2),
        COPY_LAYOUT=gl.BlockedLayout([1, copy_align], [32 // lanes_per_row, lanes_per_row], [producer_warps, 1],
                                     [1, 0]),
        SCALE_LAYOUT=gl.BlockedLayout([1], [32], [producer_warps], [0]),
        # [key, byte 16q + 4k + j of its row]: the same distribution before the reshape to PACKED_LAYOUT.
        ROW_BYTES_LAYOUT=gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]], lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK_K.value, DIM.value // 2]),
        # [key, word k, block q, byte j]: bytes and words in registers (byte fastest: one packed word per
        # four registers), q on lane % 4, keys on lane / 4, register 16 (+8) and the warps as in the
        # wgmma accumulator and A operand.
        PACKED_LAYOUT=gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 1, 0, 0], [0, 2, 0, 0], [8, 0, 0, 0]],
            lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
            warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[BLOCK_K.value, 4, 4, 4]),
        QUERY_LAYOUT=gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]),
    ))


def _tma_pages(cache: KCacheLayout, config: GluonDecodeConfig) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """The key and scale descriptors of ``fill_tiles_tma`` when ``config`` asks for TMA page copies and the
    cache allows them (16-byte aligned base, 64-byte multiple page stride, pages of whole 64-key tiles);
    None otherwise (the cp.async producer runs)."""
    if (not config.tma_pages or cache.buffer.data_ptr() % 16 or cache.page_stride % 64
            or cache.block_size % BLOCK_K.value):
        return None
    return page_descriptors(cache, _build_page_descriptors)


def _build_page_descriptors(cache: KCacheLayout) -> tuple[TensorDescriptor, TensorDescriptor]:
    """``_tma_pages``'s descriptors: the cache as rows of one packed key row (``D/2`` bytes)."""
    buffer = cache.buffer
    row_bytes = DIM.value // 2  # one packed key row = one descriptor row
    rows = ((buffer.shape[0] - 1) * cache.page_stride + cache.block_size * (row_bytes + 4)) // row_bytes
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    return (TensorDescriptor(buffer, [rows, row_bytes], [row_bytes, 1], [BLOCK_K.value, row_bytes], layout),
            TensorDescriptor(buffer, [rows, row_bytes], [row_bytes, 1], [BLOCK_K.value // 16, row_bytes], layout))


def gluon_mxfp4_decode_preferred(batch: int, next_n: int, max_context_len: int) -> bool:
    """Whether this kernel beats the Triton one for the call (host integers only). Measured (H200, cold-L2 graph
    replays, benchmarks/devlog/logits.md): 1.09-1.12x from B = 32, L = 32K (1M keys) up at next_n = 1 and 2 with the cp.async
    producer, 1.10-1.38x with TMA (45.3 vs 60.1 µs at B = 32, L = 32K, next_n = 1); slower at B = 1, L = 128K,
    next_n = 1 (20.8 vs 16.4-18.2 µs); draft rows in one filled wave also from 128K keys (20.6 vs 21.9 µs at B = 1,
    L = 128K, next_n = 2, where the power-of-two split took 27.7).

    The rule is monotone: more requests, longer requests or more draft rows never turn Gluon into Triton. Below
    1M keys, draft rows take Gluon only for requests of at least ``GLUON_MXFP4_MIN_LEN_WAVE`` keys, so fewer than
    16 requests: few row groups, which the one-wave split fills (``gluon_mxfp4_decode_config`` still checks). A
    fill test on the batch itself would flip the choice back and forth as the batch grows."""
    keys = batch * max_context_len
    if keys >= GLUON_MXFP4_MIN_KEYS:
        return True
    return next_n > 1 and keys >= GLUON_MXFP4_MIN_KEYS_WAVE and max_context_len >= GLUON_MXFP4_MIN_LEN_WAVE


def gluon_mxfp4_decode_config(batch: int, next_n: int, max_context_len: int, sms: int) -> GluonDecodeConfig:
    """The launcher's default configuration for this call (host integers only; ``sms``: the GPU's SM count):
    ``GLUON_MXFP4_DECODE_CONFIG_ONE_ROW`` at next_n = 1; with draft rows ``GLUON_MXFP4_DECODE_CONFIG_WAVE``
    where its one wave is well filled (``wave_fills``), else ``GLUON_MXFP4_DECODE_CONFIG``."""
    if next_n == 1:
        return GLUON_MXFP4_DECODE_CONFIG_ONE_ROW
    if wave_fills(GLUON_MXFP4_DECODE_CONFIG_WAVE, batch, next_n, max_context_len, sms):
        return GLUON_MXFP4_DECODE_CONFIG_WAVE
    return GLUON_MXFP4_DECODE_CONFIG


def paged_mqa_logits_gluon_mxfp4(
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
    """Gluon twin of ``paged_mqa_logits_triton`` for MXFP4 caches with ``head_dim == 128`` (same arguments,
    validated by the public wrapper; CUDA with sm_90+ only). ``config`` overrides
    ``gluon_mxfp4_decode_config``'s choice (benchmarks)."""
    if cache.fmt != "mxfp4" or q_scale is None:
        raise ValueError(f"the Gluon MXFP4 decode kernel takes MXFP4 caches only, got fmt {cache.fmt!r}")
    if cache.head_dim != DIM.value:
        raise ValueError(f"the Gluon MXFP4 decode kernel needs head_dim {DIM.value}, got {cache.head_dim}")
    batch, next_n = q.shape[:2]
    heads = weights.shape[1]
    if nothing_to_read(cache, block_table, batch, max_context_len, clean, out):
        return out
    q_values, q_mul = mxfp4_rows(q, q_scale, FP8_DTYPE)  # [B, next_n, H, D] de-interleaved e4m3
    w = weights * q_mul.view(batch * next_n, heads)
    config = config or gluon_mxfp4_decode_config(batch, next_n, max_context_len,
                                                 sm_count(q.device))
    if config.persistent_per_sm or config.early_table:
        raise ValueError("the Gluon MXFP4 decode kernel runs one work item per program, its first table entry "
                         "after the lengths (persistent_per_sm = 0, early_table = False)")
    rows, num_groups, num_splits, tiles, copy_align = launch_shape(q, cache, max_context_len, config)
    buffer = cache.buffer
    descriptors = _tma_pages(cache, config)
    if descriptors is None and config.tma_pages:
        config = cp_async_fallback(config)
    constants = kernel_constants(heads, cache.block_size, rows, clean, copy_align, config,
                                 tma_pages=descriptors is not None)
    key_desc, scale_desc = descriptors or (None, None)
    one_d = context_lens.dim() == 1
    _paged_mqa_logits_mxfp4_ws_kernel[(batch * num_groups * num_splits,)](
        q_values, q_values.stride(0), q_values.stride(1), q_values.stride(2),
        w, w.stride(0), w.stride(1),
        buffer, buffer, cache.page_stride // copy_align, cache.num_blocks,
        context_lens, context_lens.stride(0), 0 if one_d else context_lens.stride(1),
        block_table, block_table.stride(0), block_table.shape[1],
        out, out.stride(0),
        next_n, int(one_d), max_context_len, num_splits, num_groups, tiles, key_desc, scale_desc,
        cache.page_stride // (DIM.value // 2) if descriptors else None,
        **constants, num_warps=4, maxnreg=config.maxnreg,
    )
    return out
