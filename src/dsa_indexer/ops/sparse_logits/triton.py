"""Triton kernel of the sparse logits family: the logits of each row's candidate blocks only.

One kernel serves prefill (gathered keys) and paged decode (keys in the cache's pages). Programs cover (row,
split of ``TILES * BLOCK_K`` sparse columns); a tile gathers the keys of its live candidate blocks and scores
them with the dense decode kernel's tile arithmetic at one draft row (``ops/logits``: one tensor-core dot, the
relu-weighted head sum, the key multiplier), MXFP4 expanded by the codecs of ``ops/common/codecs``. Dead
columns read nothing and store ``-inf``. Details: ``README.md``.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ...cache_layout import KCacheLayout
from ...formats import FP8_DTYPE
from ..common.codecs import (
    dot_operand,
    key_block_depth,
    mxfp4_dot_order,
    mxfp4_dot_order_source,
    mxfp4_halves,
    mxfp4_halves_e4m3,
    mxfp4_rows,
    ue8m0_word_to_fp32,
    unit_last_stride,
    use_upcast,
)
from ..common.runtime import interpreting, next_pow2
from ..common.splits import split_tiles

__all__ = ["sparse_mqa_logits_triton", "sparse_paged_mqa_logits_triton"]


@dataclasses.dataclass(frozen=True)
class SparseLogitsConfig:
    """Launch of the sparse logits kernel (defaults: FP8 keys on GPUs): ``block_k`` columns a tile,
    ``programs_per_sm`` aimed at by ``split_tiles`` with ``[min_split_tiles, max_split_tiles]`` tiles a split. The
    dense decode kernel's tile shapes (``logits.triton.decode_config``) at one draft row."""

    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 8
    min_split_tiles: int = 1
    max_split_tiles: int = 16


MXFP4_SPARSE_CONFIG = SparseLogitsConfig(block_k=64, max_split_tiles=32)
# Two tiles a split keep the interpreter's small test shapes running the multi-tile loop (it plans for 132 SMs).
SPARSE_INTERPRETER_CONFIG = SparseLogitsConfig(block_k=16, num_stages=1, programs_per_sm=2, min_split_tiles=2,
                                               max_split_tiles=2)


def sparse_logits_config(fmt: str) -> SparseLogitsConfig:
    """The launch this process runs for keys in ``fmt`` (``"fp8"`` or ``"mxfp4"``)."""
    if interpreting():
        return SPARSE_INTERPRETER_CONFIG
    return MXFP4_SPARSE_CONFIG if fmt == "mxfp4" else SparseLogitsConfig()


@triton.jit(do_not_specialize=["next_n", "one_d", "num_cols", "num_splits"])
def _sparse_logits_kernel(
    q_ptr, stride_qr, stride_qh,
    w_ptr, stride_wr, stride_wh,
    blocks_ptr, stride_br,
    values_ptr, stride_vn, scales_ptr, stride_sn,
    cache_ptr, page_stride,
    ks_ptr, ke_ptr, num_keys,
    lens_ptr, stride_lb, stride_lt,
    table_ptr, stride_tb, table_columns, num_blocks,
    out_ptr, stride_or,
    next_n, one_d, num_cols, num_splits,
    HEADS: tl.constexpr, BLOCK_H: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    CAND: tl.constexpr, PAGE: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr, NUM_STAGES: tl.constexpr,
    PAGED: tl.constexpr, MXFP4: tl.constexpr, MXFP8: tl.constexpr, UPCAST: tl.constexpr, EXPAND_PTX: tl.constexpr,
):
    """Columns ``[split * TILES * BLOCK_K, +TILES * BLOCK_K)`` of one row.

    Program ids run over (request, split, draft row), draft rows fastest (prefill: one row per "request"):
    a request's rows read their candidate blocks close together in time, so where their lists overlap the
    second read hits the L2.
    """
    pid = tl.program_id(0)
    group = next_n if PAGED else 1
    request_split = pid // group
    split = request_split % num_splits
    row = (request_split // num_splits) * group + pid % group
    row64 = row.to(tl.int64)
    head = tl.arange(0, BLOCK_H)
    head_ok = head < HEADS
    half_w = tl.load(w_ptr + row64 * stride_wr + head * stride_wh, mask=head_ok, other=0.0).to(tl.float32) * 0.5  # [BLOCK_H]
    query_rows = q_ptr + row64 * stride_qr + head * stride_qh  # [BLOCK_H]
    if MXFP4:
        half = mxfp4_dot_order_source(BLOCK_D)
        half_ok = head_ok[:, None] & (half < DIM // 2)[None, :]
        q_even = dot_operand(tl.load(query_rows[:, None] + half[None, :], mask=half_ok, other=0.0))
        q_odd = dot_operand(tl.load(query_rows[:, None] + DIM // 2 + half[None, :], mask=half_ok, other=0.0))
    else:
        dim = tl.arange(0, BLOCK_D)
        queries = tl.load(query_rows[:, None] + dim[None, :], mask=head_ok[:, None] & (dim < DIM)[None, :],
                          other=0.0)  # [BLOCK_H, BLOCK_D]
        queries = dot_operand(queries)
    if PAGED:
        request = row // next_n
        t = row % next_n
        stored = tl.load(lens_ptr + request.to(tl.int64) * stride_lb + t * stride_lt)
        # Positions past the table's pages are past the row's end (unchecked lengths: value checks off).
        length = tl.minimum(tl.maximum(stored + one_d * (t + 1 - next_n), 0), table_columns * PAGE)
        table_row = table_ptr + request.to(tl.int64) * stride_tb
        key_base = 0
    else:
        # Windows clamped into [0, num_keys] (unchecked bounds: value checks off).
        key_base = tl.minimum(tl.maximum(tl.load(ks_ptr + row), 0), num_keys)
        length = tl.minimum(tl.load(ke_ptr + row), num_keys) - key_base
    block_row = blocks_ptr + row64 * stride_br
    out_row = out_ptr + row64 * stride_or
    split_start = split * (TILES * BLOCK_K)
    for tile in tl.range(0, TILES, num_stages=NUM_STAGES):
        cols = split_start + tile * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        col_ok = cols < num_cols
        entry = cols // CAND
        block_id = tl.load(block_row + entry, mask=col_ok, other=-1)
        previous = tl.load(block_row + entry - 1, mask=col_ok & (entry > 0), other=-1)
        positions = block_id.to(tl.int64) * CAND + cols % CAND  # int64: no wrap for any int32 id
        live = col_ok & (block_id >= 0) & (block_id > previous) & (positions >= 0) & (positions < length)
        if PAGED:
            unsigned = positions.to(tl.uint32)
            # Unchecked metadata (value checks off) reads nothing outside the cache: a page id outside
            # [0, num_blocks) reads as zero bytes (every load below is masked by `readable`; a select of the
            # page id here made Triton 3.6's layout passes fail on the MXFP4 path).
            page = tl.load(table_row + unsigned // PAGE, mask=live, other=-1)
            readable = live & (page >= 0) & (page < num_blocks)
            slot = (unsigned % PAGE).to(tl.int32)
            page_start = page.to(tl.int64) * page_stride
            if MXFP4:
                value_row = page_start + slot * (DIM // 2)
                scale_bytes_per_key: tl.constexpr = (DIM + 127) // 128 * 4  # D/32 bytes padded to whole words
                scale_row = page_start + PAGE * (DIM // 2) + slot * scale_bytes_per_key
            else:
                value_row = page_start + slot * DIM
                scale_words = cache_ptr + page_start + PAGE * DIM + slot * 4  # [BLOCK_K]
        else:
            readable = live
            key = (key_base + positions).to(tl.int64)
            value_row = key * stride_vn
            scale_row = key * stride_sn
            if not MXFP4:
                scale_words = scales_ptr + scale_row
        if MXFP4:
            block = tl.arange(0, BLOCK_D // 32)
            byte = tl.arange(0, 16)
            block_ok = block < DIM // 32
            packed = tl.load(values_ptr + value_row[:, None, None] + block[None, :, None] * 16 + byte[None, None, :],
                             mask=readable[:, None, None] & block_ok[None, :, None], other=0)  # [BLOCK_K, BLOCK_D/32, 16]
            scale_bytes = tl.load(scales_ptr + scale_row[:, None] + block[None, :],
                                  mask=readable[:, None] & block_ok[None, :], other=0)  # [BLOCK_K, BLOCK_D/32]
            if EXPAND_PTX:
                k_even, k_odd, key_mul = mxfp4_halves_e4m3(packed, scale_bytes)
            else:
                k_even, k_odd, key_mul = mxfp4_halves(packed, scale_bytes, BLOCK_K, BLOCK_D)
                if not UPCAST:
                    k_even = k_even.to(tl.float8e4nv)
                    k_odd = k_odd.to(tl.float8e4nv)
            k_even = mxfp4_dot_order(k_even, BLOCK_K, BLOCK_D)
            k_odd = mxfp4_dot_order(k_odd, BLOCK_K, BLOCK_D)
            scores = tl.dot(k_even, tl.trans(q_even))
            scores = tl.dot(k_odd, tl.trans(q_odd), scores)  # [BLOCK_K, BLOCK_H]
        else:
            keys = tl.load(values_ptr + value_row[:, None] + dim[None, :],
                           mask=readable[:, None] & (dim < DIM)[None, :], other=0.0)  # [BLOCK_K, BLOCK_D]
            scores = tl.dot(dot_operand(keys), tl.trans(queries))  # [BLOCK_K, BLOCK_H]
            if MXFP8:
                # Four equal ue8m0 bytes: the low byte (little-endian) is the exponent field.
                word = tl.load(scale_words.to(tl.pointer_type(tl.int32)), mask=readable, other=0)
                key_mul = ue8m0_word_to_fp32(word)
            else:
                key_mul = tl.load(scale_words.to(tl.pointer_type(tl.float32)), mask=readable, other=0.0)  # [BLOCK_K]
        weighted = (scores + tl.abs(scores)) * half_w[None, :]
        logits = tl.sum(weighted, axis=1) * key_mul  # [BLOCK_K]
        logits = tl.where(live, logits, float("-inf"))
        tl.store(out_row + cols, logits.to(out_ptr.dtype.element_ty), mask=col_ok)


def _launch(q_rows, q_scale_rows, weights, blocks, block_size, out, fmt, keys, paged):
    """Shared launch: ``q_rows [R, H, D or D/2]``, ``keys`` = (values, scales) or a decode tuple."""
    num_rows, num_cols = out.shape
    heads = weights.shape[1]
    upcast = use_upcast(q_rows.device)
    mxfp4 = fmt == "mxfp4"
    if mxfp4:
        q_values, q_mul = mxfp4_rows(q_rows, q_scale_rows, torch.float16 if upcast else FP8_DTYPE)
        w = weights * q_mul
    else:
        q_values, w = unit_last_stride(q_rows), weights
        if upcast:
            q_values = q_values.view(torch.uint8)
    config = sparse_logits_config(fmt)
    block_k = config.block_k
    expand_ptx = mxfp4 and not (interpreting() or upcast)
    key_tiles = triton.cdiv(num_cols, block_k)
    tiles = split_tiles(num_rows, key_tiles, q_rows.device, config.programs_per_sm, config.min_split_tiles,
                        config.max_split_tiles)
    num_splits = triton.cdiv(key_tiles, tiles)
    dim = q_values.shape[-1]
    mxfp8 = False
    if paged:
        cache, context_lens, block_table, next_n = keys
        mxfp8 = cache.scale_fmt == "mxfp8"
        buffer = cache.buffer
        values = buffer if (mxfp4 or upcast) else buffer.view(FP8_DTYPE)
        scales, stride_vn, stride_sn = buffer, 0, 0
        page_stride, page = cache.page_stride, cache.block_size
        one_d = context_lens.dim() == 1
        lens, stride_lb, stride_lt = context_lens, context_lens.stride(0), 0 if one_d else context_lens.stride(1)
        table, stride_tb, table_columns, num_blocks = block_table, block_table.stride(0), block_table.shape[1], cache.num_blocks
        ks = ke = blocks
        num_keys = 0
    else:
        values, scales, ks, ke = keys
        values = unit_last_stride(values)
        if upcast and not mxfp4:
            values = values.view(torch.uint8)
        buffer, page_stride, page, next_n, one_d = values, 0, 1, 1, False
        num_keys = values.shape[0]
        stride_vn, stride_sn = values.stride(0), scales.stride(0)
        lens, stride_lb, stride_lt, table, stride_tb, table_columns, num_blocks = ks, 0, 0, ks, 0, 0, 0
    grid = (num_rows * num_splits,)
    _sparse_logits_kernel[grid](
        q_values, q_values.stride(0), q_values.stride(1),
        w, w.stride(0), w.stride(1),
        blocks, blocks.stride(0),
        values, stride_vn, scales, stride_sn,
        buffer, page_stride,
        ks, ke, num_keys,
        lens, stride_lb, stride_lt,
        table, stride_tb, table_columns, num_blocks,
        out, out.stride(0),
        next_n, int(one_d), num_cols, num_splits,
        HEADS=heads, BLOCK_H=next_pow2(heads, 16), DIM=dim, BLOCK_D=key_block_depth(dim, mxfp4),
        CAND=block_size, PAGE=page, BLOCK_K=block_k, TILES=tiles, NUM_STAGES=config.num_stages,
        PAGED=paged, MXFP4=mxfp4, MXFP8=mxfp8, UPCAST=upcast, EXPAND_PTX=expand_ptx,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def sparse_mqa_logits_triton(q, q_scale, k, k_scale, weights, ks, ke, blocks, block_size, out):
    """Triton twin of ``reference.sparse_mqa_logits`` (same arguments, validated by the public wrapper)."""
    if out.shape[0] == 0 or out.shape[1] == 0:
        return out
    if k.shape[0] == 0:
        return out.fill_(float("-inf"))
    fmt = "fp8" if q.dtype == FP8_DTYPE else "mxfp4"
    return _launch(q, q_scale, weights, blocks, block_size, out, fmt, (k, k_scale, ks, ke), paged=False)


def sparse_paged_mqa_logits_triton(q, q_scale, cache: KCacheLayout, weights, context_lens, block_table, blocks,
                                   block_size, out):
    """Triton twin of ``reference.sparse_paged_mqa_logits`` (same arguments, validated by the public wrapper)."""
    batch, next_n = q.shape[:2]
    if out.shape[0] == 0 or out.shape[1] == 0:
        return out
    if cache.num_blocks == 0 or block_table.shape[1] == 0:
        return out.fill_(float("-inf"))
    q_rows = q.reshape(batch * next_n, *q.shape[2:])
    q_scale_rows = None if q_scale is None else q_scale.reshape(batch * next_n, *q_scale.shape[2:])
    return _launch(q_rows, q_scale_rows, weights, blocks, block_size, out, cache.fmt,
                   (cache, context_lens, block_table, next_n), paged=True)


@triton.jit(do_not_specialize=["num_rows", "k"])
def _columns_to_positions_kernel(
    columns_ptr, stride_cr, blocks_ptr, stride_br, out_ptr, stride_or, num_rows, k,
    CAND: tl.constexpr, BLOCK: tl.constexpr,
):
    """``BLOCK`` picks of one row: column ``c`` -> ``blocks[row, c // CAND] * CAND + c % CAND``; -1 stays -1,
    and so does a column of a ``-1`` entry."""
    row = tl.program_id(0).to(tl.int64)
    picks = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = picks < k
    columns = tl.load(columns_ptr + row * stride_cr + picks, mask=inside, other=-1)
    live = columns >= 0
    block_id = tl.load(blocks_ptr + row * stride_br + columns // CAND, mask=inside & live, other=0)
    # A padding entry (-1) that a caller's garbage logits made selectable still maps to -1, never to a
    # negative position.
    positions = tl.where(live & (block_id >= 0), block_id * CAND + columns % CAND, -1)
    tl.store(out_ptr + row * stride_or + picks, positions, mask=inside)


def columns_to_positions_triton(columns: torch.Tensor, blocks: torch.Tensor, block_size: int,
                                out: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``reference.columns_to_positions`` (one launch), into ``out``."""
    num_rows, k = columns.shape
    if num_rows == 0 or k == 0:
        return out
    block = min(1024, triton.next_power_of_2(k))
    _columns_to_positions_kernel[(num_rows, triton.cdiv(k, block))](
        columns, columns.stride(0), blocks, blocks.stride(0), out, out.stride(0), num_rows, k,
        CAND=block_size, BLOCK=block, num_warps=4,
    )
    return out
