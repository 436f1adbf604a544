"""Triton kernel of the fused Q RoPE + quantisation, and the exact format helpers it shares with the K cache.

Every helper reproduces ``dsa_indexer.formats`` bit for bit, on the GPU and under Triton's CPU
interpreter alike. Both conversions the hardware would do for us are done explicitly, because the
interpreter does them differently (it truncates fp32 -> bf16, and converts fp32 -> e4m3 with ties away
from zero, losing the exponent carry, and NaN -> 256):

bf16 rounding (``round_to_bf16``)
    Adding ``0x7FFF + lsb`` to the fp32 bits, with ``lsb`` the lowest kept bit, carries into bit 16
    exactly when the dropped half-word is above one half, or equal to it with ``lsb = 1``: round to
    nearest, ties to even, overflowing to ``inf`` as it should. NaN is passed through unchanged.

e4m3 rounding (``round_to_e4m3``)
    For ``|v| <= 448`` let ``e = max(exponent(v), -6)``: e4m3 values near ``v`` are the multiples of
    ``2**(e - 3)`` (``-6`` covers the subnormals). ``M = 1.5 * 2**(e + 20)`` (``2**exponent(v)``, taken
    from the exponent bits, times ``1.5 * 2**20``, and at least ``1.5 * 2**14``) has an fp32 ulp of
    ``2**(e - 3)``, and ``|v| < 2**(e + 1)`` keeps ``v + M`` in M's binade, so the fp32 sum rounds ``v``
    to that grid (to nearest, ties to even: ``M / 2**(e-3) = 3 * 2**22`` is even) and ``- M`` is exact.
    The sign bit of ``v`` is put back so that zeros keep their sign. The result is an e4m3 value, which
    the cast then converts exactly on every backend; NaN (which the interpreter converts to 256) is
    encoded explicitly as ``0x7F``.

ue8m0 exponents (``ceil_log2``)
    ``ceil(log2(x))`` of a positive fp32 from its bits: the unbiased exponent, plus one unless the
    mantissa is zero (a power of two). Subnormals give ``-126`` (every caller clamps there) and zero
    gives 0, which is what ``torch.frexp`` yields for the reference.

Dividing by a power-of-two scale ``2**e`` is replaced by multiplying with ``2**-e``: both are one
correctly rounded fp32 operation on the same real quotient (``-e`` stays within the normal range).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...formats import FP8_MAX, MXFP4_BLOCK, MXFP4_MAX, Q_AMAX_FLOOR

MXFP4_AMAX_FLOOR = MXFP4_MAX * 2.0**-126

_FP8_MAX = tl.constexpr(FP8_MAX)
_MXFP4_MAX = tl.constexpr(MXFP4_MAX)
_MXFP4_AMAX_FLOOR = tl.constexpr(MXFP4_AMAX_FLOOR)
_MXFP4_BLOCK = tl.constexpr(MXFP4_BLOCK)
_Q_AMAX_FLOOR = tl.constexpr(Q_AMAX_FLOOR)
_SIGN_BIT = tl.constexpr(-(2**31))

__all__ = ["rope_quant_q_triton"]


@triton.jit
def round_to_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), returned as fp32."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x == x, rounded.to(tl.float32, bitcast=True), x)


@triton.jit
def finite_abs(x):
    """``|x|`` where ``x`` is finite, 0 where it is NaN or infinite (they never set a scale)."""
    magnitude = tl.abs(x)
    return tl.where(magnitude < float("inf"), magnitude, 0.0)


@triton.jit
def ceil_log2(x):
    """Exact ``ceil(log2(x))`` of fp32 ``x >= 0`` as int32 (see the module docstring for 0 and subnormals)."""
    bits = x.to(tl.int32, bitcast=True)
    biased = bits >> 23
    has_mantissa = (bits & 0x7FFFFF) != 0
    normal = biased - 127 + has_mantissa.to(tl.int32)
    return tl.where(biased == 0, tl.where(has_mantissa, -126, 0), normal)


@triton.jit
def pow2(exponent):
    """``2.0 ** exponent`` as fp32, built from the bits (int32 exponent in [-126, 127])."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3(v):
    """fp32 ``v`` (``|v| <= 448``) rounded to the nearest e4m3 value, ties to even, as fp32 (NaN stays NaN)."""
    bits = v.to(tl.int32, bitcast=True)
    power = (bits & 0x7F800000).to(tl.float32, bitcast=True)  # 2**exponent(v), 0 for zeros and subnormals
    magic = tl.maximum(power * 1572864.0, 24576.0)  # 1.5 * 2**(e + 20) with e = max(exponent(v), -6)
    rounded = ((v + magic) - magic).to(tl.int32, bitcast=True)
    return (rounded | (bits & _SIGN_BIT)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bytes(scaled):
    """e4m3fn bytes (uint8) of already-scaled fp32 values: clamp to ±448, nearest-even; NaN -> 0x7F."""
    clamped = tl.minimum(tl.maximum(scaled, -_FP8_MAX), _FP8_MAX)
    code = round_to_e4m3(clamped).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return tl.where(scaled == scaled, code, tl.full(code.shape, 0x7F, tl.uint8))


@triton.jit
def e2m1_codes(scaled):
    """4-bit e2m1 codes (int32, sign in bit 3) of already-scaled fp32 values; ties to even, NaN -> +0."""
    magnitude = tl.abs(scaled)
    code = (
        (magnitude > 0.25).to(tl.int32)
        + (magnitude >= 0.75).to(tl.int32)
        + (magnitude > 1.25).to(tl.int32)
        + (magnitude >= 1.75).to(tl.int32)
        + (magnitude > 2.5).to(tl.int32)
        + (magnitude >= 3.5).to(tl.int32)
        + (magnitude > 5.0).to(tl.int32)
    )
    negative = (scaled < 0) & (code != 0)
    return code | (negative.to(tl.int32) << 3)


@triton.jit
def mxfp4_exponents(block_amax):
    """Unbiased ue8m0 exponents (int32) of 32-element blocks from their finite amax."""
    return ceil_log2(tl.div_rn(tl.maximum(block_amax, _MXFP4_AMAX_FLOOR), _MXFP4_MAX))


@triton.jit
def mxfp4_pack(x, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """MXFP4 of ``x [ROWS, WIDTH]`` (WIDTH a multiple of 32) -> (packed uint8 [ROWS, WIDTH/2], scales uint8 [ROWS, WIDTH/32])."""
    blocks = tl.reshape(x, [ROWS, WIDTH // _MXFP4_BLOCK, _MXFP4_BLOCK])
    exponent = mxfp4_exponents(tl.max(finite_abs(blocks), axis=2))  # [ROWS, WIDTH/32]
    codes = e2m1_codes(blocks * pow2(-exponent)[:, :, None])  # [ROWS, WIDTH/32, 32]
    low, high = tl.split(tl.reshape(codes, [ROWS, WIDTH // 2, 2]))
    return (low | (high << 4)).to(tl.uint8), (exponent + 127).to(tl.uint8)


@triton.jit
def _store_mxfp4(values_ptr, scales_ptr, head_rows, heads_ok, x, START: tl.constexpr, WIDTH: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Quantise dims ``[START, START + WIDTH)`` of each head (``x [BLOCK_H, BLOCK]``) and store them."""
    packed, scales = mxfp4_pack(x, BLOCK_H, BLOCK)
    pair = tl.arange(0, BLOCK // 2)
    tl.store(
        values_ptr + head_rows[:, None] * (HEAD_DIM // 2) + (pair + START // 2)[None, :],
        packed,
        mask=heads_ok[:, None] & (pair < WIDTH // 2)[None, :],
    )
    block = tl.arange(0, BLOCK // _MXFP4_BLOCK)
    tl.store(
        scales_ptr + head_rows[:, None] * (HEAD_DIM // _MXFP4_BLOCK) + (block + START // _MXFP4_BLOCK)[None, :],
        scales,
        mask=heads_ok[:, None] & (block < WIDTH // _MXFP4_BLOCK)[None, :],
    )


@triton.jit(do_not_specialize=["num_heads"])
def _rope_quant_q_kernel(
    q_ptr, positions_ptr, cos_sin_ptr, weights_ptr, values_ptr, scales_ptr, weights_out_ptr,
    num_heads,
    stride_qt, stride_qh, stride_qd, stride_positions,
    stride_cs_pos, stride_cs_dim,
    stride_wt, stride_wh,
    softmax_scale, head_scale,
    HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_START: tl.constexpr, INTERLEAVED: tl.constexpr,
    ROT_START: tl.constexpr, ROT_WIDTH: tl.constexpr, ROT_BLOCK: tl.constexpr,
    PASS_START: tl.constexpr, PASS_WIDTH: tl.constexpr, PASS_BLOCK: tl.constexpr,
    MXFP4: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """One program: token ``program_id(0)``, heads ``[program_id(1) * BLOCK_H, +BLOCK_H)``.

    The head is split into two windows of dims: the rotated window ``[ROT_START, +ROT_WIDTH)`` holds the
    rope dims (for MXFP4 widened to whole 32-blocks) and the pass window ``[PASS_START, +PASS_WIDTH)``
    the rest.
    """
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    heads_ok = heads < num_heads
    head_rows = token * num_heads + heads  # [BLOCK_H] row of the [T * H] outputs
    q_heads = q_ptr + token * stride_qt + heads.to(tl.int64)[:, None] * stride_qh  # [BLOCK_H, 1]
    position = tl.load(positions_ptr + token * stride_positions).to(tl.int64)

    half: tl.constexpr = ROPE_DIM // 2
    dim = ROT_START + tl.arange(0, ROT_BLOCK)  # [ROT_BLOCK]
    in_window = dim < ROT_START + ROT_WIDTH
    offset = dim - ROPE_START
    in_rope = (offset >= 0) & (offset < ROPE_DIM)
    if INTERLEAVED:
        first = offset % 2 == 0
        pair = offset // 2
        partner = tl.where(first, dim + 1, dim - 1)
    else:
        first = offset < half
        pair = tl.where(first, offset, offset - half)
        partner = tl.where(first, dim + half, dim - half)
    table = cos_sin_ptr + position * stride_cs_pos
    cos = tl.load(table + pair * stride_cs_dim, mask=in_rope, other=0.0).to(tl.float32)  # [ROT_BLOCK]
    sin = tl.load(table + (half + pair) * stride_cs_dim, mask=in_rope, other=0.0).to(tl.float32)
    signed_sin = tl.where(first, -sin, sin)
    x = tl.load(q_heads + dim[None, :] * stride_qd, mask=heads_ok[:, None] & in_window[None, :], other=0.0)
    x = x.to(tl.float32)  # [BLOCK_H, ROT_BLOCK]
    x_partner = tl.load(q_heads + partner[None, :] * stride_qd, mask=heads_ok[:, None] & in_rope[None, :], other=0.0)
    rotated = round_to_bf16(x * cos[None, :] + x_partner.to(tl.float32) * signed_sin[None, :])
    rotated = tl.where(in_rope[None, :], rotated, x)  # [BLOCK_H, ROT_BLOCK]

    if PASS_WIDTH > 0:
        pass_dim = PASS_START + tl.arange(0, PASS_BLOCK)  # [PASS_BLOCK]
        pass_ok = pass_dim < PASS_START + PASS_WIDTH
        kept = tl.load(q_heads + pass_dim[None, :] * stride_qd, mask=heads_ok[:, None] & pass_ok[None, :], other=0.0)
        kept = kept.to(tl.float32)  # [BLOCK_H, PASS_BLOCK]

    weights = tl.load(weights_ptr + token * stride_wt + heads * stride_wh, mask=heads_ok, other=0.0).to(tl.float32)
    if MXFP4:
        _store_mxfp4(values_ptr, scales_ptr, head_rows, heads_ok, rotated, ROT_START, ROT_WIDTH, ROT_BLOCK,
                     BLOCK_H, HEAD_DIM)
        if PASS_WIDTH > 0:
            _store_mxfp4(values_ptr, scales_ptr, head_rows, heads_ok, kept, PASS_START, PASS_WIDTH, PASS_BLOCK,
                         BLOCK_H, HEAD_DIM)
        weights_out = (weights * softmax_scale) * head_scale
    else:
        amax = tl.max(finite_abs(rotated), axis=1)  # [BLOCK_H]
        if PASS_WIDTH > 0:
            amax = tl.maximum(amax, tl.max(finite_abs(kept), axis=1))
        quotient = tl.div_rn(tl.maximum(amax, _Q_AMAX_FLOOR), _FP8_MAX)
        exponent = tl.minimum(tl.maximum(ceil_log2(quotient), -126), 127)  # [BLOCK_H]
        inverse = pow2(-exponent)[:, None]
        rows = values_ptr + head_rows[:, None] * HEAD_DIM  # [BLOCK_H, 1]
        tl.store(rows + dim[None, :], e4m3_bytes(rotated * inverse), mask=heads_ok[:, None] & in_window[None, :])
        if PASS_WIDTH > 0:
            tl.store(rows + pass_dim[None, :], e4m3_bytes(kept * inverse), mask=heads_ok[:, None] & pass_ok[None, :])
        weights_out = ((weights * pow2(exponent)) * softmax_scale) * head_scale
    tl.store(weights_out_ptr + head_rows, weights_out, mask=heads_ok)


def _windows(head_dim: int, rope_dim: int, rope_position: str, align: int) -> tuple[int, int, int, int]:
    """``(rot_start, rot_width, pass_start, pass_width)``: the rope dims widened to ``align``, and the rest."""
    if rope_position == "first":
        rot_width = min(head_dim, -(-rope_dim // align) * align)
        return 0, rot_width, rot_width, head_dim - rot_width
    rot_start = (head_dim - rope_dim) // align * align
    return rot_start, head_dim - rot_start, 0, rot_start


def rope_quant_q_triton(
    q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    weights: torch.Tensor,
    softmax_scale: float,
    head_scale: float,
    *,
    rope_style: str,
    rope_position: str,
    fmt: str,
    block_heads: int = 16,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Triton twin of ``rope_quant_q_reference`` (same arguments and results, bit for bit).

    ``block_heads`` (a power of two) and ``num_warps`` are launch tuning knobs. No host synchronisation.
    """
    num_tokens, num_heads, head_dim = q.shape
    rope_dim = cos_sin.shape[1]
    mxfp4 = fmt == "mxfp4"
    weights_out = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    if mxfp4:
        values = torch.empty((num_tokens, num_heads, head_dim // 2), dtype=torch.uint8, device=q.device)
        scales = torch.empty((num_tokens, num_heads, head_dim // MXFP4_BLOCK), dtype=torch.uint8, device=q.device)
    else:
        values = torch.empty((num_tokens, num_heads, head_dim), dtype=torch.float8_e4m3fn, device=q.device)
        scales = None
    if num_tokens == 0 or num_heads == 0:
        return values, scales, weights_out
    rope_start = 0 if rope_position == "first" else head_dim - rope_dim
    rot_start, rot_width, pass_start, pass_width = _windows(head_dim, rope_dim, rope_position,
                                                            MXFP4_BLOCK if mxfp4 else 1)
    grid = (num_tokens, triton.cdiv(num_heads, block_heads))
    _rope_quant_q_kernel[grid](
        q, positions, cos_sin, weights, values.view(torch.uint8), values if scales is None else scales, weights_out,
        num_heads,
        q.stride(0), q.stride(1), q.stride(2), positions.stride(0),
        cos_sin.stride(0), cos_sin.stride(1),
        weights.stride(0), weights.stride(1),
        softmax_scale, head_scale,
        HEAD_DIM=head_dim, ROPE_DIM=rope_dim, ROPE_START=rope_start, INTERLEAVED=rope_style == "interleaved",
        ROT_START=rot_start, ROT_WIDTH=rot_width, ROT_BLOCK=triton.next_power_of_2(rot_width),
        PASS_START=pass_start, PASS_WIDTH=pass_width, PASS_BLOCK=triton.next_power_of_2(max(pass_width, 1)),
        MXFP4=mxfp4, BLOCK_H=block_heads,
        num_warps=num_warps, enable_fp_fusion=False,
    )
    return values, scales, weights_out
