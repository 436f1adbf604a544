"""Triton kernels of the logits family: ragged prefill ``mqa_logits`` and paged decode ``paged_mqa_logits``.

Both compute, for a query row ``i`` and a key ``j`` (DESIGN.md §5)::

    logits[i, j] = (sum_h w[i, h] * relu(q[i, h, :] . k[j, :])) * key_mul[j]

with the dot products on tensor cores (e4m3 x e4m3, fp32 accumulation; fp16 on the upcast path) and the head
sum in fp32, as ``(s + |s|) * (w / 2)`` (exactly ``relu(s) * w``). MXFP4 operands are expanded to e4m3 scaled
by a per-vector power of two (``ops/common/codecs``), folded back into the weights and the key multiplier.
Prefill: one program per (``BLOCK_Q`` rows, ``BLOCK_K`` keys) tile, the head loop pipelined. Decode: programs
over (request, group of draft rows, split of ``TILES * BLOCK_K`` positions), one dot for all of a group's rows
per key tile. Launches are picked from host integers (``prefill_config``, ``decode_config``, ``split_tiles``):
nothing is read back from the device. The derivations and the schedule are in ``README.md``.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ...cache_layout import KCacheLayout
from ...formats import FP8_DTYPE
from ..common.codecs import (
    FORCE_UPCAST_ENV,
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
from ..common.logits_checks import nothing_to_read
from ..common.runtime import interpreting, next_pow2
from ..common.splits import split_tiles

__all__ = ["mqa_logits_triton", "paged_mqa_logits_triton", "FORCE_UPCAST_ENV", "PrefillConfig", "DecodeConfig",
           "prefill_config", "decode_config"]

# Decode score tile ``[BLOCK_K, ROWS * BLOCK_H]``: BLOCK_K shrinks (not below 64, one warpgroup's wgmma
# rows) to keep it within this many fp32 elements; stacking two rows of 64 heads at 128 keys took 220
# registers a thread and measured slower than 64 keys (B=32, L=128K, next_n=2 on the H200).
_MAX_SCORE_TILE = 128 * 64


@triton.jit
def _output(x, ROUND_BF16: tl.constexpr):
    """fp32 logits as stored: with ``ROUND_BF16`` rounded to bf16 to nearest even from the bits (the
    interpreter's own fp32 -> bf16 store truncates; GPUs round to nearest even, so they store ``x``);
    NaN stays NaN."""
    if ROUND_BF16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
        rounded = tl.where(x != x, ((bits >> 16) | 0x40).to(tl.int16), rounded)
        value = rounded.to(tl.bfloat16, bitcast=True)
    else:
        value = x
    return value


@triton.jit(do_not_specialize=["num_rows", "num_keys", "num_key_tiles"])
def _mqa_logits_kernel(
    q_ptr, stride_qm, stride_qh,
    k_ptr, stride_kn,
    key_mul_ptr,
    w_ptr, stride_wm, stride_wh,
    ks_ptr, ke_ptr,
    out_ptr, stride_om,
    num_rows, num_keys, num_key_tiles,
    HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, CLEAN: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """One (``BLOCK_Q`` rows, ``BLOCK_K`` keys) tile of the ragged prefill logits."""
    pid = tl.program_id(0)
    row_tile = pid // num_key_tiles
    key_tile = pid % num_key_tiles
    rows = row_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)  # [BLOCK_Q]
    cols = key_tile * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    dim = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    col_ok = cols < num_keys
    dim_ok = dim < DIM
    starts = tl.load(ks_ptr + rows, mask=row_ok, other=2147483647)  # [BLOCK_Q]
    ends = tl.load(ke_ptr + rows, mask=row_ok, other=0)  # [BLOCK_Q]
    first_key = key_tile * BLOCK_K
    if (first_key < tl.max(ends, axis=0)) & (first_key + BLOCK_K > tl.min(starts, axis=0)):
        keys = tl.load(k_ptr + cols.to(tl.int64)[:, None] * stride_kn + dim[None, :],
                       mask=col_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_D]
        keys = dot_operand(keys)
        q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qm + dim[None, :]  # [BLOCK_Q, BLOCK_D], head 0
        w_rows = w_ptr + rows.to(tl.int64) * stride_wm  # [BLOCK_Q]
        acc = tl.zeros((BLOCK_Q, BLOCK_K), dtype=tl.float32)
        for head in tl.range(0, HEADS, num_stages=NUM_STAGES):
            q = tl.load(q_rows + head * stride_qh, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_Q, BLOCK_D]
            half_w = tl.load(w_rows + head * stride_wh, mask=row_ok, other=0.0).to(tl.float32) * 0.5  # [BLOCK_Q]
            scores = tl.dot(dot_operand(q), tl.trans(keys))  # [BLOCK_Q, BLOCK_K]
            acc += (scores + tl.abs(scores)) * half_w[:, None]
        key_mul = tl.load(key_mul_ptr + cols, mask=col_ok, other=0.0)  # [BLOCK_K]
        logits = acc * key_mul[None, :]
        valid = (cols[None, :] >= starts[:, None]) & (cols[None, :] < ends[:, None])  # [BLOCK_Q, BLOCK_K]
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]  # [BLOCK_Q, BLOCK_K]
        inside = row_ok[:, None] & col_ok[None, :]
        if CLEAN:
            tl.store(out_ptrs, _output(tl.where(valid, logits, float("-inf")), ROUND_BF16), mask=inside)
        else:
            tl.store(out_ptrs, _output(logits, ROUND_BF16), mask=valid & inside)
    else:
        if CLEAN:
            out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]  # [BLOCK_Q, BLOCK_K]
            tl.store(out_ptrs, tl.full((BLOCK_Q, BLOCK_K), float("-inf"), tl.float32),
                     mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _mxfp4_scales_at(cache_ptr, page, page_stride, positions, live, DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr):
    """ue8m0 bytes ``[BLOCK_K, BLOCK_D/32]`` of the keys at ``positions`` (their pages ``page``; 0 where
    not ``live``)."""
    block = tl.arange(0, BLOCK_D // 32)
    slot = (positions.to(tl.uint32) % BLOCK_SIZE).to(tl.int32)
    scale_bytes: tl.constexpr = (DIM + 127) // 128 * 4  # D/32 bytes padded to whole words
    scale_row = page.to(tl.int64) * page_stride + BLOCK_SIZE * (DIM // 2) + slot * scale_bytes  # [BLOCK_K]
    if DIM == BLOCK_D:
        mask = live[:, None]
    else:
        mask = live[:, None] & (block < DIM // 32)[None, :]
    return tl.load(cache_ptr + scale_row[:, None] + block[None, :], mask=mask, other=0)


@triton.jit
def _readable(page, live, num_blocks):
    """``live`` positions whose page id lies in ``[0, num_blocks)`` (one unsigned compare): only those are read;
    the others read as zero bytes, so a block-table entry outside the cache never moves a read out of it."""
    return live & (page.to(tl.uint32) < num_blocks.to(tl.uint32))


@triton.jit
def _mxfp4_tile_scales(table_row, cache_ptr, page_stride, num_blocks, first, read_end, DIM: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):
    """``_mxfp4_scales_at`` for the tile of positions ``[first, first + BLOCK_K)``, its pages read here."""
    positions = first + tl.arange(0, BLOCK_K)
    live = positions < read_end
    page = tl.load(table_row + positions.to(tl.uint32) // BLOCK_SIZE, mask=live, other=0)
    return _mxfp4_scales_at(cache_ptr, page, page_stride, positions, _readable(page, live, num_blocks), DIM,
                            BLOCK_D, BLOCK_SIZE)


@triton.jit(do_not_specialize=["num_blocks", "table_columns", "next_n", "one_d", "max_context_len", "num_splits",
                              "num_groups"])
def _paged_mqa_logits_kernel(
    q_ptr, stride_qb, stride_qt, stride_qh,
    w_ptr, stride_wr, stride_wh,
    values_ptr, cache_ptr, page_stride, num_blocks,
    lens_ptr, stride_lb, stride_lt,
    table_ptr, stride_tb, table_columns,
    out_ptr, stride_or,
    next_n, one_d, max_context_len, num_splits, num_groups,
    HEADS: tl.constexpr, BLOCK_H: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    CLEAN: tl.constexpr, MXFP4: tl.constexpr, MXFP8: tl.constexpr, UPCAST: tl.constexpr, EXPAND_PTX: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Draft rows ``[t0, t0 + ROWS)`` of one request over one split of ``TILES * BLOCK_K`` positions.

    The rows' queries are stacked into one ``[ROWS * BLOCK_H, D]`` operand: one dot per key tile gives
    every (key, row, head) score, and the head sum is a reduction over the last axis of its
    ``[BLOCK_K, ROWS, BLOCK_H]`` view. MXFP4 queries come de-interleaved (``_mxfp4_rows_kernel``) and the
    key tile is expanded the same way, so the dot is two half-depth dots accumulating; both operands are
    put in ``mxfp4_dot_order`` (with ``EXPAND_PTX``, each thread's share of a key row is one scale block).
    Program ids run over (request, split, row group), row groups fastest: a request's row groups read
    the same keys close together in time (the second reads hit the L2).

    Unchecked metadata stays inside the buffers: reads stop at the table's ``table_columns * BLOCK_SIZE``
    positions (as at a row's end) and a page id outside ``[0, num_blocks)`` is not read (its keys are zeros).
    """
    pid = tl.program_id(0)
    request_split = pid // num_groups
    split = request_split % num_splits
    request = request_split // num_splits
    t0 = (pid % num_groups) * ROWS
    stacked = tl.arange(0, ROWS * BLOCK_H)
    stacked_t = t0 + stacked // BLOCK_H  # [ROWS * BLOCK_H] draft row of each stacked query
    head = stacked % BLOCK_H
    query_ok = (stacked_t < next_n) & (head < HEADS)
    query_rows = q_ptr + request.to(tl.int64) * stride_qb + stacked_t * stride_qt + head * stride_qh  # [ROWS * BLOCK_H]
    half_w = tl.load(w_ptr + (request.to(tl.int64) * next_n + stacked_t) * stride_wr + head * stride_wh,
                     mask=query_ok, other=0.0).to(tl.float32) * 0.5  # [ROWS * BLOCK_H]
    t = t0 + tl.arange(0, ROWS)  # [ROWS]
    present = t < next_n
    stored = tl.load(lens_ptr + request.to(tl.int64) * stride_lb + t * stride_lt, mask=present, other=0)
    lengths = tl.where(present, tl.maximum(stored + one_d * (t + 1 - next_n), 0), 0)  # [ROWS]
    extent = tl.max(lengths, axis=0)
    out_rows = out_ptr + (request.to(tl.int64) * next_n + t) * stride_or  # [ROWS]
    if MXFP4:
        half = mxfp4_dot_order_source(BLOCK_D)
        half_ok = query_ok[:, None] & (half < DIM // 2)[None, :]
        q_even = dot_operand(tl.load(query_rows[:, None] + half[None, :], mask=half_ok, other=0.0))
        q_odd = dot_operand(tl.load(query_rows[:, None] + DIM // 2 + half[None, :], mask=half_ok, other=0.0))
    else:
        dim = tl.arange(0, BLOCK_D)
        queries = tl.load(query_rows[:, None] + dim[None, :], mask=query_ok[:, None] & (dim < DIM)[None, :],
                          other=0.0)  # [ROWS * BLOCK_H, BLOCK_D]
        queries = dot_operand(queries)

    split_start = split * (TILES * BLOCK_K)
    split_end = tl.minimum(split_start + TILES * BLOCK_K, max_context_len)
    read_end = tl.minimum(tl.minimum(split_end, extent), table_columns * BLOCK_SIZE)
    table_row = table_ptr + request.to(tl.int64) * stride_tb
    if split_start < read_end:
        if MXFP4:
            # Scale bytes are 2 per thread, too few for a cp.async the pipeliner could stage: they are
            # loaded one tile ahead into registers (and their page two tiles ahead), off the critical path.
            next_scales = _mxfp4_tile_scales(table_row, cache_ptr, page_stride, num_blocks, split_start, read_end,
                                             DIM, BLOCK_D, BLOCK_SIZE, BLOCK_K)
            next_positions = split_start + BLOCK_K + tl.arange(0, BLOCK_K)
            next_page = tl.load(table_row + next_positions.to(tl.uint32) // BLOCK_SIZE,
                                mask=next_positions < read_end, other=0)
        for tile in tl.range(0, TILES, num_stages=NUM_STAGES):
            positions = split_start + tile * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            live = positions < read_end
            unsigned = positions.to(tl.uint32)  # non-negative: page and slot without sign fix-ups
            page = tl.load(table_row + unsigned // BLOCK_SIZE, mask=live, other=0)  # [BLOCK_K]
            readable = _readable(page, live, num_blocks)
            slot = (unsigned % BLOCK_SIZE).to(tl.int32)  # [BLOCK_K]
            page_start = page.to(tl.int64) * page_stride  # [BLOCK_K] byte offset of the page
            if MXFP4:
                block = tl.arange(0, BLOCK_D // 32)
                byte = tl.arange(0, 16)
                block_ok = block < DIM // 32
                row_bytes = page_start + slot * (DIM // 2)  # [BLOCK_K]
                packed = tl.load(cache_ptr + row_bytes[:, None, None] + block[None, :, None] * 16 + byte[None, None, :],
                                 mask=readable[:, None, None] & block_ok[None, :, None], other=0)  # [BLOCK_K, BLOCK_D/32, 16]
                scale_bytes = next_scales
                ahead = positions + BLOCK_K
                next_scales = _mxfp4_scales_at(cache_ptr, next_page, page_stride, ahead,
                                               _readable(next_page, ahead < read_end, num_blocks), DIM, BLOCK_D,
                                               BLOCK_SIZE)
                ahead = positions + 2 * BLOCK_K
                next_page = tl.load(table_row + ahead.to(tl.uint32) // BLOCK_SIZE, mask=ahead < read_end, other=0)
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
                scores = tl.dot(k_odd, tl.trans(q_odd), scores)  # [BLOCK_K, ROWS * BLOCK_H]
            else:
                keys = tl.load(values_ptr + page_start[:, None] + slot[:, None] * DIM + dim[None, :],
                               mask=readable[:, None] & (dim < DIM)[None, :], other=0.0)  # [BLOCK_K, BLOCK_D]
                scores = tl.dot(dot_operand(keys), tl.trans(queries))  # [BLOCK_K, ROWS * BLOCK_H]
                scale_words = cache_ptr + page_start + BLOCK_SIZE * DIM + slot * 4  # [BLOCK_K]
                if MXFP8:
                    # Four equal ue8m0 bytes: the low byte (little-endian) is the exponent field.
                    word = tl.load(scale_words.to(tl.pointer_type(tl.int32)), mask=readable, other=0)
                    key_mul = ue8m0_word_to_fp32(word)
                else:
                    key_mul = tl.load(scale_words.to(tl.pointer_type(tl.float32)), mask=readable, other=0.0)  # [BLOCK_K]
            weighted = tl.reshape((scores + tl.abs(scores)) * half_w[None, :], (BLOCK_K, ROWS, BLOCK_H))
            logits = tl.sum(weighted, axis=2) * key_mul[:, None]  # [BLOCK_K, ROWS]
            ptrs = out_rows[None, :] + positions[:, None]  # [BLOCK_K, ROWS]
            inside = positions[:, None] < lengths[None, :]
            if CLEAN:
                tl.store(ptrs, _output(tl.where(inside, logits, float("-inf")), ROUND_BF16),
                         mask=live[:, None] & present[None, :])
            else:
                tl.store(ptrs, _output(logits, ROUND_BF16), mask=live[:, None] & inside)
    if CLEAN:
        masked = tl.full((BLOCK_K, ROWS), float("-inf"), tl.float32)
        first = tl.maximum(split_start, read_end)
        while first < split_end:  # a while loop: the interpreter cannot range() over a runtime int
            positions = first + tl.arange(0, BLOCK_K)
            tl.store(out_rows[None, :] + positions[:, None], masked,
                     mask=(positions < split_end)[:, None] & present[None, :])
            first += BLOCK_K


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Launch of the prefill kernel: ``[block_q, block_k]`` tiles. The register cap lets three programs share an
    SM (their epilogues overlap each other's tensor-core work); ptxas then keeps only values that are dead
    during the head loop in local memory."""

    block_q: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    maxnreg: int | None = 168


# Small tiles for Triton's CPU interpreter, which runs the tests' tiny shapes.
PREFILL_INTERPRETER_CONFIG = PrefillConfig(block_q=16, block_k=32, num_stages=1, maxnreg=None)


def prefill_config() -> PrefillConfig:
    """The prefill launch this process runs: the interpreter's or the shipped GPU one."""
    return PREFILL_INTERPRETER_CONFIG if interpreting() else PrefillConfig()


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch of the paged decode kernel (defaults: FP8 keys on GPUs). ``block_k`` positions a tile (shrunk to
    keep the score tile within ``_MAX_SCORE_TILE``), ``programs_per_sm`` aimed at by the split rule
    (``split_tiles``) with ``[min_split_tiles, max_split_tiles]`` tiles a split, at most ``max_rows`` draft rows
    (a power of two) a program."""

    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 8
    min_split_tiles: int = 2
    max_split_tiles: int = 16
    maxnreg: int | None = None
    max_rows: int = 4


# MXFP4 keys: 64-key tiles and five stages (README.md, "Triton decode schedule").
MXFP4_DECODE_CONFIG = DecodeConfig(block_k=64, num_stages=5, min_split_tiles=4, max_split_tiles=32)
# The interpreter plans for INTERPRETER_SMS (132) SMs; two tiles a split keep its small test shapes running the
# multi-tile loop and several splits a request.
DECODE_INTERPRETER_CONFIG = DecodeConfig(block_k=16, num_stages=1, programs_per_sm=2, min_split_tiles=2,
                                         max_split_tiles=2)


def decode_config(fmt: str) -> DecodeConfig:
    """The decode launch this process runs for keys in ``fmt`` (``"fp8"`` or ``"mxfp4"``)."""
    if interpreting():
        return DECODE_INTERPRETER_CONFIG
    return MXFP4_DECODE_CONFIG if fmt == "mxfp4" else DecodeConfig()


def _round_bf16(out: torch.Tensor) -> bool:
    """Whether the kernel rounds bf16 logits itself (the interpreter only; see ``_output``)."""
    return out.dtype == torch.bfloat16 and interpreting()


def mqa_logits_triton(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    clean: bool,
    out: torch.Tensor,
    *,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Triton twin of ``reference.mqa_logits`` (same arguments, validated by the public wrapper).

    ``config`` overrides ``prefill_config()`` (benchmarks, tests).
    """
    num_rows, heads = weights.shape
    num_keys = k.shape[0]
    if num_rows == 0 or num_keys == 0:
        return out
    upcast = use_upcast(q.device)
    if q.dtype == FP8_DTYPE:
        q_values, k_values, key_mul, w = unit_last_stride(q), unit_last_stride(k), k_scale, weights
        if upcast:
            q_values, k_values = q_values.view(torch.uint8), k_values.view(torch.uint8)
    else:
        dtype = torch.float16 if upcast else FP8_DTYPE
        q_values, q_mul = mxfp4_rows(q, q_scale, dtype)
        k_values, key_mul = mxfp4_rows(k, k_scale, dtype)
        w = weights * q_mul
    dim = q_values.shape[-1]
    config = config or prefill_config()
    block_q, block_k = config.block_q, config.block_k
    num_key_tiles = triton.cdiv(num_keys, block_k)
    grid = (triton.cdiv(num_rows, block_q) * num_key_tiles,)
    _mqa_logits_kernel[grid](
        q_values, q_values.stride(0), q_values.stride(1),
        k_values, k_values.stride(0),
        key_mul,
        w, w.stride(0), w.stride(1),
        ks, ke,
        out, out.stride(0),
        num_rows, num_keys, num_key_tiles,
        HEADS=heads, DIM=dim, BLOCK_D=next_pow2(dim, 32),
        BLOCK_Q=block_q, BLOCK_K=block_k, NUM_STAGES=config.num_stages, CLEAN=clean,
        ROUND_BF16=_round_bf16(out),
        num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=config.maxnreg,
    )
    return out


def paged_mqa_logits_triton(
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
    config: DecodeConfig | None = None,
    expand_ptx: bool | None = None,
) -> torch.Tensor:
    """Triton twin of ``reference.paged_mqa_logits`` (same arguments, validated by the public wrapper).

    ``config`` overrides ``decode_config(cache.fmt)`` (benchmarks, tests). ``expand_ptx`` picks the MXFP4 key expansion:
    inline PTX (True; e4m3 dots on a GPU only) or Triton operations (False); the default is PTX wherever
    it can run. Both give the same bits.
    """
    batch, next_n = q.shape[:2]
    heads = weights.shape[1]
    if nothing_to_read(cache, block_table, batch, max_context_len, clean, out):
        return out
    upcast = use_upcast(q.device)
    mxfp4 = cache.fmt == "mxfp4"
    dim = cache.head_dim
    buffer = cache.buffer
    if mxfp4:
        q_values, q_mul = mxfp4_rows(q, q_scale, torch.float16 if upcast else FP8_DTYPE)
        w = weights * q_mul.view(batch * next_n, heads)
        values = buffer
    else:
        q_values, w = unit_last_stride(q), weights
        values = buffer if upcast else buffer.view(FP8_DTYPE)
        if upcast:
            q_values = q_values.view(torch.uint8)
    config = config or decode_config(cache.fmt)
    if expand_ptx is None:
        expand_ptx = not (interpreting() or upcast)
    if expand_ptx and (interpreting() or upcast):
        raise ValueError("the PTX expansion needs a GPU with e4m3 dots (not the interpreter, not the upcast path)")
    rows = triton.next_power_of_2(min(next_n, config.max_rows))
    num_groups = triton.cdiv(next_n, rows)
    block_h = next_pow2(heads, 16)
    block_k = min(config.block_k, max(64, _MAX_SCORE_TILE // (rows * block_h)))
    key_tiles = triton.cdiv(max_context_len, block_k)
    tiles = split_tiles(batch * num_groups, key_tiles, q.device, config.programs_per_sm, config.min_split_tiles,
                        config.max_split_tiles)
    num_splits = triton.cdiv(key_tiles, tiles)
    one_d = context_lens.dim() == 1
    grid = (batch * num_groups * num_splits,)
    _paged_mqa_logits_kernel[grid](
        q_values, q_values.stride(0), q_values.stride(1), q_values.stride(2),
        w, w.stride(0), w.stride(1),
        values, buffer, cache.page_stride, cache.num_blocks,
        context_lens, context_lens.stride(0), 0 if one_d else context_lens.stride(1),
        block_table, block_table.stride(0), block_table.shape[1],
        out, out.stride(0),
        next_n, int(one_d), max_context_len, num_splits, num_groups,
        HEADS=heads, BLOCK_H=block_h, DIM=dim, BLOCK_D=key_block_depth(dim, mxfp4),
        BLOCK_SIZE=cache.block_size, ROWS=rows, BLOCK_K=block_k, TILES=tiles, NUM_STAGES=config.num_stages,
        CLEAN=clean, MXFP4=mxfp4, MXFP8=cache.scale_fmt == "mxfp8", UPCAST=upcast, EXPAND_PTX=mxfp4 and expand_ptx,
        ROUND_BF16=_round_bf16(out),
        num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=config.maxnreg,
    )
    return out
