"""Triton kernels of the logits family: ragged prefill ``mqa_logits`` and paged decode ``paged_mqa_logits``.

Both compute, for a query row ``i`` and a key ``j`` (DESIGN.md §5)::

    logits[i, j] = (sum_h w[i, h] * relu(q[i, h, :] . k[j, :])) * key_mul[j]

with the dot products on tensor cores (e4m3 x e4m3, fp32 accumulation) and the head sum in fp32.

Epilogue. ``relu(s) * w == (s + |s|) * (w / 2)`` exactly: ``s + |s|`` is ``2 * relu(s)`` (no rounding, a
power-of-two scaling), and halving ``w`` is exact for normal ``w``, so the product is the same fp32
number. The right-hand side is one add (with an absolute-value operand) and one fused multiply-add into
the accumulator per (row, key, head), both full-rate on the FP32 pipe, where ``max`` runs at half rate.
The head sum is accumulated in a different order than the reference's ``sum``; the results agree to
fp32 rounding (DESIGN.md §11, calc_diff tier), and one kernel always returns the same bits.

MXFP4. An e2m1 code ``s e1 e0 m`` placed at bits 15 / 11..10 / 9 of an fp16 word (``(code & 8) << 12 |
(code & 7) << 9``) reads as the e2m1 value times ``2**-14``: the two exponent bits land in the low
bits of the fp16 exponent (bias 15 instead of e2m1's bias 1) and the e2m1 subnormal 0.5 (``e = 0,
m = 1``) becomes the fp16 subnormal ``2**-15`` with the same ratio to the normals. A 32-element block
with exponent ``e_b`` in a vector whose largest block exponent is ``e_max`` is then multiplied by the
fp16 power of two ``2**(14 + e_b - e_max)``: the product is the dequantised value divided by
``2**e_max``, exact in fp16, and exact in e4m3 whenever ``e_max - e_b <= 8`` (e4m3 reaches the e2m1
grid scaled down by 2**8: its smallest subnormal is 2**-9 = 0.5 * 2**-8). Larger spreads round to the
e4m3 grid (relative error below 2**-10 of the largest block's scale, far inside the §11 tier) and
spreads above 29 drop the block (its contribution is below 2**-29 of the vector's). The per-vector
``2**e_max`` is folded back outside the dot: for queries into the weights (``w * 2**eq_max``), for keys
into ``key_mul``; both are positive, so they commute with the relu. A dot product does not depend on the
order of its terms, so the expanded vectors are kept de-interleaved, even elements (low nibbles) first,
which spares an interleave: ``_mxfp4_rows_kernel`` writes query rows (and, for prefill, the gathered
keys, which then run through the FP8 kernel) that way, and decode expands each key tile in registers into
its two halves, contracted by two half-depth dots.

MXFP4 decode expansion on GPUs (``_mxfp4_halves_e4m3``, inline PTX; the Triton operations above stay
the interpreter's and the upcast path's, and give the same bits). The value of an e2m1 code in a block
depends on its three magnitude bits and the block's multiplier only, and the sign commutes with the
round-to-nearest conversions. So each (key, block) gets an 8-entry e4m3 table (the eight magnitudes
through the same ``mul.rn.f16x2`` and ``cvt.rn.satfinite.e4m3x2.f16x2`` as the Triton path), and each
packed 32-bit word (8 codes) becomes two words of e4m3 (its 4 even, its 4 odd values) with 9
instructions: a mask, a shift, two ``prmt`` table lookups (a nibble of the selector picks one of 8
bytes), two ``prmt`` that de-interleave, and the sign bits OR-ed in. The contraction order of the
decode dot is permuted (``_dot_order``, the queries alike) so that each thread's share of a key row in
the wgmma register operand is the four words of one scale block: one table per thread and row.

Upcast path. GPUs without FP8 tensor cores (compute capability < 8.9), or any GPU when the environment
variable ``DSA_INDEXER_FORCE_UPCAST=1`` is set, read the e4m3 bytes as integers and rebuild fp16 values:
the seven magnitude bits shifted left by 7 read as fp16 ``value * 2**-8`` (exponent bias 15 instead of
7, subnormals included), times 256 is exact; ``0x7F`` is NaN. fp16 holds every e4m3 value, so the
fp16 dot with fp32 accumulation sees the same products.

Prefill schedule. One program per (``BLOCK_Q`` rows, ``BLOCK_K`` keys) tile. The key tile is loaded once
and reused by every head; the head loop streams ``[BLOCK_Q, D]`` query slices through a software
pipeline. A tile outside every row's ``[ks, ke)`` range does no arithmetic: it writes ``-inf`` when
``clean`` and nothing otherwise (most of a causal triangle).

Decode schedule. Programs cover (request, group of ``ROWS`` draft rows, key split); a split is
``TILES * BLOCK_K`` consecutive positions, ``TILES`` a compile-time power of two picked from host integers
(``max_context_len``, the batch size, the SM count) so that the grid holds several programs per SM and
nothing is read back from the device. ``ROWS`` is ``next_n`` rounded up to a power of two, at most the
configured rows per program (a larger ``next_n`` runs in groups of rows, each group reading K; a
request's groups of one split have consecutive program ids, so the later reads mostly hit the L2).
Each program stacks its rows' queries into one ``[ROWS * H, D]`` operand loaded once, then streams
``BLOCK_K`` positions at a time through a software pipeline: the block-table entries, the key bytes and
scales, one dot for all rows (so K is read once for all of them), the relu-weighted head sum as a
reduction over the last axis of the ``[BLOCK_K, ROWS, H]`` view of the scores (in registers: within a
thread, then across the four lanes of a quad), and the logits. It reads positions below its rows'
longest length only (a tile past it is fully masked and touches no memory); a split past that length
writes ``-inf`` (``clean``) or nothing.
The page size is a compile-time constant, so position -> (page, slot) is a shift and a mask for the
usual powers of two. MXFP4 scale bytes (two per thread, too few for a cp.async the pipeliner could
stage) are loaded one tile ahead into registers, their pages two tiles ahead.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ... import backend as _backend
from ...cache import IndexerKCache
from ...formats import FP8_DTYPE

__all__ = ["mqa_logits_triton", "paged_mqa_logits_triton", "FORCE_UPCAST_ENV"]

FORCE_UPCAST_ENV = "DSA_INDEXER_FORCE_UPCAST"
# Decode score tile ``[BLOCK_K, ROWS * BLOCK_H]``: BLOCK_K shrinks (not below 64, one warpgroup's wgmma
# rows) to keep it within this many fp32 elements; stacking two rows of 64 heads at 128 keys took 220
# registers a thread and measured slower than 64 keys (B=32, L=128K, next_n=2 on the H200).
_MAX_SCORE_TILE = 128 * 64


@triton.jit
def _e4m3_bits_to_fp16(x):
    """uint8 e4m3 bit patterns -> fp16 values (exact; ``0x7F``/``0xFF`` -> NaN)."""
    bits = x.to(tl.int16)
    magnitude = ((bits & 0x7F) << 7).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    value = tl.where((bits & 0x80) != 0, -magnitude, magnitude)
    return tl.where((bits & 0x7F) == 0x7F, float("nan"), value).to(tl.float16)


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


@triton.jit
def _dot_operand(x):
    """A tile as the tensor cores take it: e4m3 and fp16 as they are, raw e4m3 bytes rebuilt as fp16."""
    if x.dtype == tl.uint8:
        operand = _e4m3_bits_to_fp16(x)
    else:
        operand = x
    return operand


@triton.jit
def _mxfp4_block_scales(scale_bytes):
    """ue8m0 bytes ``[ROWS, BLOCK_D/32]`` (any integer type) -> (int32 ``[ROWS, BLOCK_D/32]``: the fp16
    exponent field of each block's multiplier ``2**(14 + e_b - e_max)``, 0 for a dropped block
    (multiplier +0); fp32 ``[ROWS]`` ``2**e_max``)."""
    exponent_bytes = scale_bytes.to(tl.int32)
    top_byte = tl.max(exponent_bytes, axis=1)  # [ROWS]
    scale_field = tl.maximum(29 - (top_byte[:, None] - exponent_bytes), 0)
    row_mul = (top_byte << 23).to(tl.float32, bitcast=True)
    return scale_field, row_mul


@triton.jit
def _mxfp4_halves(packed, scale_bytes, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Packed e2m1 ``[ROWS, BLOCK_D/32, 16]`` uint8 and ue8m0 bytes ``[ROWS, BLOCK_D/32]`` -> (even
    elements, odd elements: fp16 ``[ROWS, BLOCK_D/2]`` each, divided by ``2**e_max``; fp32 ``[ROWS]``
    ``2**e_max``). Element ``2i`` is the low nibble of byte ``i``."""
    scale_field, row_mul = _mxfp4_block_scales(scale_bytes)
    block_scale = (scale_field << 10).to(tl.int16).to(tl.float16, bitcast=True)[:, :, None]  # [ROWS, BLOCK_D/32, 1]
    bits = packed.to(tl.int32)  # [ROWS, BLOCK_D/32, 16]
    even = (((bits << 12) & 0x8000) | ((bits << 9) & 0x0E00)).to(tl.int16).to(tl.float16, bitcast=True)
    odd = (((bits << 8) & 0x8000) | ((bits << 5) & 0x0E00)).to(tl.int16).to(tl.float16, bitcast=True)
    return (tl.reshape(even * block_scale, (ROWS, BLOCK_D // 2)), tl.reshape(odd * block_scale, (ROWS, BLOCK_D // 2)),
            row_mul)


# Per block: e4m3 of the eight e2m1 magnitudes (fp16 ``code << 9``, codes 0..7) times the block's fp16x2
# multiplier ``$2``, with the instructions of the Triton path (``mul.rn.f16x2``, ``cvt.rn.satfinite``),
# so each entry has the bits that path gives: ``$0`` holds codes 0..3 (byte i: code i), ``$1`` codes 4..7.
_E4M3_TABLE_ASM = tl.constexpr("""
{
.reg .b32 c<4>, h<4>;
.reg .b16 e<4>;
mov.b32 c0, 0x02000000;
mov.b32 c1, 0x06000400;
mov.b32 c2, 0x0A000800;
mov.b32 c3, 0x0E000C00;
mul.rn.f16x2 h0, c0, $2;
mul.rn.f16x2 h1, c1, $2;
mul.rn.f16x2 h2, c2, $2;
mul.rn.f16x2 h3, c3, $2;
cvt.rn.satfinite.e4m3x2.f16x2 e0, h0;
cvt.rn.satfinite.e4m3x2.f16x2 e1, h1;
cvt.rn.satfinite.e4m3x2.f16x2 e2, h2;
cvt.rn.satfinite.e4m3x2.f16x2 e3, h3;
mov.b32 $0, {e0, e1};
mov.b32 $1, {e2, e3};
}
""")
# One packed word ``$2`` (four bytes of one block, low nibble = even element) -> its four even and four
# odd e4m3 values (``$0``, ``$1``; byte i from byte i): the three magnitude bits of each nibble index the
# block's table (``$3``, ``$7``: bytes 0..7) through ``prmt``, the two results are de-interleaved by
# byte, and each nibble's sign bit is OR-ed into bit 7 (the tables round to nearest, which is symmetric
# in the sign, -0 included). Nine instructions for eight values.
_E2M1_EXPAND_ASM = tl.constexpr("""
{
.reg .b32 m, mh, p0, p1, sl;
and.b32 m, $2, 0x77777777;
shr.b32 mh, m, 16;
prmt.b32 p0, $3, $7, m;
prmt.b32 p1, $3, $7, mh;
prmt.b32 $0, p0, p1, 0x6420;
prmt.b32 $1, p0, p1, 0x7531;
shl.b32 sl, $2, 4;
lop3.b32 $0, $0, sl, 0x80808080, 0xF8;
lop3.b32 $1, $1, $2, 0x80808080, 0xF8;
}
""")


@triton.jit
def _mxfp4_halves_e4m3(packed, scale_bytes):
    """GPU twin of ``_mxfp4_halves`` followed by the e4m3 conversion, bit for bit, in inline PTX: packed
    ``[ROWS, BLOCK_D/32, 16]`` uint8 -> (even, odd: e4m3 ``[ROWS, BLOCK_D/32, 16]``; fp32 ``[ROWS]``)."""
    scale_field, row_mul = _mxfp4_block_scales(scale_bytes)
    scale_pair = scale_field * 0x04000400  # [ROWS, BLOCK_D/32] fp16x2 bits (multiplier, multiplier)
    table_low, table_high = tl.inline_asm_elementwise(
        _E4M3_TABLE_ASM, "=r,=r,r", [scale_pair], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    even, odd = tl.inline_asm_elementwise(
        _E2M1_EXPAND_ASM, "=r,=r,r,r,r,r,r,r,r,r,r",
        [packed, table_low[:, :, None], table_high[:, :, None]],
        dtype=(tl.float8e4nv, tl.float8e4nv), is_pure=True, pack=4)
    return even, odd, row_mul


@triton.jit
def _dot_order(x, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """De-interleaved half ``[ROWS, BLOCK_D/2]`` (or ``[ROWS, BLOCK_D/32, 16]``) -> the same values in
    the contraction order of the decode dot: position ``16i + 4b + j`` (``i`` < 4, ``j`` < 4, ``b`` < the
    block count) holds half element ``16b + 4i + j``."""
    blocks = tl.reshape(x, (ROWS, BLOCK_D // 32, 4, 4))
    return tl.reshape(tl.permute(blocks, (0, 2, 1, 3)), (ROWS, BLOCK_D // 2))


@triton.jit
def _dot_order_source(BLOCK_D: tl.constexpr):
    """``[BLOCK_D/2]``: the de-interleaved half element at each position of ``_dot_order``."""
    position = tl.arange(0, BLOCK_D // 2)
    return 16 * ((position // 4) % (BLOCK_D // 32)) + 4 * (position // (BLOCK_D // 8)) + position % 4


@triton.jit(do_not_specialize=["num_rows"])
def _mxfp4_rows_kernel(
    packed_ptr, stride_packed, scales_ptr, stride_scales, out_ptr, stride_out, mul_ptr,
    num_rows,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Rows ``[program_id(0) * BLOCK_R, +BLOCK_R)`` of packed MXFP4 -> ``out`` (e4m3 or fp16; even elements
    in columns ``[0, D/2)``, odd ones in ``[D/2, D)``) and ``mul``."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_ok = rows < num_rows
    block = tl.arange(0, BLOCK_D // 32)
    byte = tl.arange(0, 16)
    block_ok = block < DIM // 32
    packed = tl.load(packed_ptr + rows[:, None, None] * stride_packed + block[None, :, None] * 16 + byte[None, None, :],
                     mask=row_ok[:, None, None] & block_ok[None, :, None], other=0)  # [BLOCK_R, BLOCK_D/32, 16]
    scale_bytes = tl.load(scales_ptr + rows[:, None] * stride_scales + block[None, :],
                          mask=row_ok[:, None] & block_ok[None, :], other=0)  # [BLOCK_R, BLOCK_D/32]
    even, odd, row_mul = _mxfp4_halves(packed, scale_bytes, BLOCK_R, BLOCK_D)
    half = tl.arange(0, BLOCK_D // 2)
    out_rows = out_ptr + rows[:, None] * stride_out + half[None, :]  # [BLOCK_R, BLOCK_D/2]
    half_ok = row_ok[:, None] & (half < DIM // 2)[None, :]
    tl.store(out_rows, even, mask=half_ok)
    tl.store(out_rows + DIM // 2, odd, mask=half_ok)
    tl.store(mul_ptr + rows, row_mul, mask=row_ok)


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
        keys = _dot_operand(keys)
        q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qm + dim[None, :]  # [BLOCK_Q, BLOCK_D], head 0
        w_rows = w_ptr + rows.to(tl.int64) * stride_wm  # [BLOCK_Q]
        acc = tl.zeros((BLOCK_Q, BLOCK_K), dtype=tl.float32)
        for head in tl.range(0, HEADS, num_stages=NUM_STAGES):
            q = tl.load(q_rows + head * stride_qh, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_Q, BLOCK_D]
            half_w = tl.load(w_rows + head * stride_wh, mask=row_ok, other=0.0).to(tl.float32) * 0.5  # [BLOCK_Q]
            scores = tl.dot(_dot_operand(q), tl.trans(keys))  # [BLOCK_Q, BLOCK_K]
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
    put in ``_dot_order`` (with ``EXPAND_PTX``, each thread's share of a key row is one scale block).
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
        half = _dot_order_source(BLOCK_D)
        half_ok = query_ok[:, None] & (half < DIM // 2)[None, :]
        q_even = _dot_operand(tl.load(query_rows[:, None] + half[None, :], mask=half_ok, other=0.0))
        q_odd = _dot_operand(tl.load(query_rows[:, None] + DIM // 2 + half[None, :], mask=half_ok, other=0.0))
    else:
        dim = tl.arange(0, BLOCK_D)
        queries = tl.load(query_rows[:, None] + dim[None, :], mask=query_ok[:, None] & (dim < DIM)[None, :],
                          other=0.0)  # [ROWS * BLOCK_H, BLOCK_D]
        queries = _dot_operand(queries)

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
                    k_even, k_odd, key_mul = _mxfp4_halves_e4m3(packed, scale_bytes)
                else:
                    k_even, k_odd, key_mul = _mxfp4_halves(packed, scale_bytes, BLOCK_K, BLOCK_D)
                    if not UPCAST:
                        k_even = k_even.to(tl.float8e4nv)
                        k_odd = k_odd.to(tl.float8e4nv)
                k_even = _dot_order(k_even, BLOCK_K, BLOCK_D)
                k_odd = _dot_order(k_odd, BLOCK_K, BLOCK_D)
                scores = tl.dot(k_even, tl.trans(q_even))
                scores = tl.dot(k_odd, tl.trans(q_odd), scores)  # [BLOCK_K, ROWS * BLOCK_H]
            else:
                keys = tl.load(values_ptr + page_start[:, None] + slot[:, None] * DIM + dim[None, :],
                               mask=readable[:, None] & (dim < DIM)[None, :], other=0.0)  # [BLOCK_K, BLOCK_D]
                scores = tl.dot(_dot_operand(keys), tl.trans(queries))  # [BLOCK_K, ROWS * BLOCK_H]
                scale_words = cache_ptr + page_start + BLOCK_SIZE * DIM + slot * 4  # [BLOCK_K]
                if MXFP8:
                    # Four equal ue8m0 bytes: the low byte (little-endian) is the exponent field.
                    word = tl.load(scale_words.to(tl.pointer_type(tl.int32)), mask=readable, other=0)
                    key_mul = ((word & 0xFF) << 23).to(tl.float32, bitcast=True)
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


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def use_upcast(device: torch.device) -> bool:
    """fp16 dots instead of e4m3 ones: forced by ``DSA_INDEXER_FORCE_UPCAST=1``, automatic on CUDA
    devices of compute capability below 8.9 (no FP8 tensor cores)."""
    if os.environ.get(FORCE_UPCAST_ENV, "0") == "1":
        return True
    return device.type == "cuda" and _capability(_device_index(device)) < (8, 9)


def _next_pow2(n: int, minimum: int) -> int:
    return max(minimum, triton.next_power_of_2(n))


def _interpreting() -> bool:
    return _backend.interpreter_enabled()


# (BLOCK_Q, BLOCK_K, num_warps, num_stages, register cap per thread) of the prefill kernel on GPUs, and
# on the interpreter. The cap lets three programs share an SM (their epilogues overlap each other's
# tensor-core work); ptxas then keeps only values that are dead during the head loop in local memory.
PREFILL_CONFIG = (64, 128, 4, 3, 168)
_PREFILL_INTERPRETER_CONFIG = (16, 32, 4, 1, None)
# (BLOCK_K, num_warps, num_stages, programs per SM aimed at, key tiles per split min/max, register cap,
# draft rows per program at most: a power of two) of the decode kernel on GPUs by key format, and on the
# interpreter. MXFP4 tiles are 64 keys: at 128 (4 warps) the expanded keys reach the tensor cores through a
# byte-wise shared-memory relayout (~500 extra instructions a tile). MXFP4 key bytes come one cp.async
# buffer per two stages past the first three (SASS, Triton 3.6): 3-4 stages keep one buffer, loaded one tile
# ahead and awaited at the top of the next tile (the load latency exposed every tile); 5-6 stages two
# tiles ahead, 7-8 three, 9 four; registers stay at 96 (next_n = 1). Measured (H200, Run 5): 5 stages best at
# next_n = 2 (241 vs 295 µs at B=32, L=128K) and at B=1 (16.4 vs 16.9 / 17.9 µs with 3 / 9 stages), within 7 %
# of the best (9 stages) at next_n = 1 with large batches, which run the Gluon kernel on Hopper anyway.
DECODE_CONFIG = {"fp8": (128, 4, 3, 8, 2, 16, None, 4), "mxfp4": (64, 4, 5, 8, 4, 32, None, 4)}
_DECODE_INTERPRETER_CONFIG = (16, 4, 1, 2, 1, 2, None, 4)


def _mxfp4_rows(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 ``[..., D/2]`` with ue8m0 ``[..., D/32]`` -> (``dtype`` ``[..., D]`` values / 2**e_max,
    de-interleaved: even elements, then odd ones; fp32 ``[...]`` 2**e_max)."""
    lead = packed.shape[:-1]
    dim = packed.shape[-1] * 2
    packed_rows = packed.reshape(-1, packed.shape[-1])
    scale_rows = scales.reshape(-1, scales.shape[-1])
    num_rows = packed_rows.shape[0]
    values = torch.empty((num_rows, dim), dtype=dtype, device=packed.device)
    row_mul = torch.empty((num_rows,), dtype=torch.float32, device=packed.device)
    if num_rows:
        block_r = 16 if _interpreting() else 64
        _mxfp4_rows_kernel[(triton.cdiv(num_rows, block_r),)](
            packed_rows, packed_rows.stride(0), scale_rows, scale_rows.stride(0), values, values.stride(0), row_mul,
            num_rows, DIM=dim, BLOCK_D=_next_pow2(dim, 32), BLOCK_R=block_r, num_warps=4,
        )
    return values.view(*lead, dim), row_mul.view(lead)


def _round_bf16(out: torch.Tensor) -> bool:
    """Whether the kernel rounds bf16 logits itself (the interpreter only; see ``_output``)."""
    return out.dtype == torch.bfloat16 and _interpreting()


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


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
    config: tuple[int, int, int, int, int | None] | None = None,
) -> torch.Tensor:
    """Triton twin of ``reference.mqa_logits`` (same arguments, validated by the public wrapper).

    ``config`` overrides ``PREFILL_CONFIG`` (benchmarks).
    """
    num_rows, heads = weights.shape
    num_keys = k.shape[0]
    if num_rows == 0 or num_keys == 0:
        return out
    upcast = use_upcast(q.device)
    if q.dtype == FP8_DTYPE:
        q_values, k_values, key_mul, w = _unit_last_stride(q), _unit_last_stride(k), k_scale, weights
        if upcast:
            q_values, k_values = q_values.view(torch.uint8), k_values.view(torch.uint8)
    else:
        dtype = torch.float16 if upcast else FP8_DTYPE
        q_values, q_mul = _mxfp4_rows(q, q_scale, dtype)
        k_values, key_mul = _mxfp4_rows(k, k_scale, dtype)
        w = weights * q_mul
    dim = q_values.shape[-1]
    block_q, block_k, num_warps, num_stages, maxnreg = config or (
        _PREFILL_INTERPRETER_CONFIG if _interpreting() else PREFILL_CONFIG
    )
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
        HEADS=heads, DIM=dim, BLOCK_D=_next_pow2(dim, 32),
        BLOCK_Q=block_q, BLOCK_K=block_k, NUM_STAGES=num_stages, CLEAN=clean,
        ROUND_BF16=_round_bf16(out),
        num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg,
    )
    return out


def _split_tiles(work_groups: int, key_tiles: int, device: torch.device, per_sm: int, lo: int, hi: int) -> int:
    """Key tiles per split, a power of two: about ``per_sm`` programs per SM over the whole call, within
    ``[lo, hi]`` and no more than one request needs."""
    sms = 4 if _interpreting() else _backend.multiprocessor_count(device)
    tiles = min(hi, triton.next_power_of_2(key_tiles), max(lo, triton.cdiv(work_groups * key_tiles, sms * per_sm)))
    return triton.next_power_of_2(tiles)


def paged_mqa_logits_triton(
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
    config: tuple[int, int, int, int, int, int, int | None, int] | None = None,
    expand_ptx: bool | None = None,
) -> torch.Tensor:
    """Triton twin of ``reference.paged_mqa_logits`` (same arguments, validated by the public wrapper).

    ``config`` overrides ``DECODE_CONFIG`` (benchmarks). ``expand_ptx`` picks the MXFP4 key expansion:
    inline PTX (True; e4m3 dots on a GPU only) or Triton operations (False); the default is PTX wherever
    it can run. Both give the same bits.
    """
    batch, next_n = q.shape[:2]
    heads = weights.shape[1]
    if batch == 0 or max_context_len == 0:
        return out
    if cache.num_blocks == 0 or block_table.shape[1] == 0:
        # The wrapper has checked that no row can then see a position.
        if clean:
            out.fill_(float("-inf"))
        return out
    upcast = use_upcast(q.device)
    mxfp4 = cache.fmt == "mxfp4"
    dim = cache.head_dim
    buffer = cache.buffer
    if mxfp4:
        q_values, q_mul = _mxfp4_rows(q, q_scale, torch.float16 if upcast else FP8_DTYPE)
        w = weights * q_mul.view(batch * next_n, heads)
        values = buffer
    else:
        q_values, w = _unit_last_stride(q), weights
        values = buffer if upcast else buffer.view(FP8_DTYPE)
        if upcast:
            q_values = q_values.view(torch.uint8)
    block_k, num_warps, num_stages, per_sm, lo, hi, maxnreg, max_rows = config or (
        _DECODE_INTERPRETER_CONFIG if _interpreting() else DECODE_CONFIG[cache.fmt]
    )
    if expand_ptx is None:
        expand_ptx = not (_interpreting() or upcast)
    if expand_ptx and (_interpreting() or upcast):
        raise ValueError("the PTX expansion needs a GPU with e4m3 dots (not the interpreter, not the upcast path)")
    rows = triton.next_power_of_2(min(next_n, max_rows))
    num_groups = triton.cdiv(next_n, rows)
    block_h = _next_pow2(heads, 16)
    block_k = min(block_k, max(64, _MAX_SCORE_TILE // (rows * block_h)))
    key_tiles = triton.cdiv(max_context_len, block_k)
    tiles = _split_tiles(batch * num_groups, key_tiles, q.device, per_sm, lo, hi)
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
        HEADS=heads, BLOCK_H=block_h, DIM=dim, BLOCK_D=_next_pow2(dim, 32),
        BLOCK_SIZE=cache.block_size, ROWS=rows, BLOCK_K=block_k, TILES=tiles, NUM_STAGES=num_stages,
        CLEAN=clean, MXFP4=mxfp4, MXFP8=cache.scale_fmt == "mxfp8", UPCAST=upcast, EXPAND_PTX=mxfp4 and expand_ptx,
        ROUND_BF16=_round_bf16(out),
        num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg,
    )
    return out
