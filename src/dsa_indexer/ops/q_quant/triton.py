"""Triton kernel of the fused Q RoPE + quantisation, and the exact format helpers it shares with the K cache.

Every helper reproduces ``dsa_indexer.formats`` bit for bit, on the GPU and under Triton's CPU
interpreter. The GPU converts fp32 -> bf16 and fp32 -> e4m3 with round-to-nearest-even (e4m3 also
saturating at ±448, NaN staying NaN: ``cvt.rn.satfinite``), exactly as torch does. The interpreter does
not (it truncates to bf16, and rounds to e4m3 with ties away from zero, losing the exponent carry, and
NaN -> 256), so under it (``INTERPRETER``) both conversions are done explicitly:

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
    the cast converts exactly; NaN is encoded explicitly as ``0x7F``.

e2m1 codes (``e2m1_codes``, one path everywhere: no hardware converts to e2m1 before Blackwell)
    The same trick on ``m = min(|v|, 6)``: with ``k = max(exponent(m), 0)`` the e2m1 grid near ``m`` is
    ``2**(k-1)``, the fp32 ulp of ``M = 1.5 * 2**(k + 22)``, so the integer difference of the bits of
    ``m + M`` and ``M`` is ``q = round(m / 2**(k-1))`` (ties to even), and the code is ``2k + q``
    (0.5 -> 1, 1 -> 2, 1.5 -> 3, 2 -> 4, 3 -> 5, 4 -> 6, 6 -> 7; a carry such as 1.75 -> 4 lands on the
    next code). A negative value has a non-zero code exactly when it is below -0.25; NaN gives +0.

ue8m0 exponents without a division (``fp8_scale_exponent``, ``mxfp4_exponents``)
    The reference takes ``ceil(log2(fp32(amax / c)))`` for ``c = 448 = 1.75 * 2**8`` or
    ``6 = 1.5 * 2**2``. For a normal ``amax = m * 2**E`` (``1 <= m < 2``) the real quotient exceeds
    ``2**(E - 8)`` (resp. ``2**(E - 2)``) exactly when ``m > 1.75`` (``m > 1.5``), so the exponent is
    ``E - 8 + [mantissa bits > 0x600000]`` (``E - 2 + [> 0x400000]``). Rounding the quotient to fp32
    never moves it across a power of two: the smallest fp32 above ``c * 2**j`` gives a quotient more
    than half an ulp above ``2**j``. (Checked against the reference for every fp32 of ten binades
    spanning the range, and every subnormal.) A subnormal ``amax`` (possible only with a subnormal
    floor) gives a subnormal quotient, clamped to -126, or 0 when ``amax <= 1.75 * 2**-142`` (bits
    ``<= 224``) rounds it to zero, whose ``frexp`` exponent is 0.

Dividing by a power-of-two scale ``2**e`` is replaced by multiplying with ``2**-e``: both are one
correctly rounded fp32 operation on the same real quotient (``-e`` stays within the normal range).
Kernels launch with ``enable_fp_fusion=False``, so no product is fused into a sum (the RoPE rounds each
product, as the reference does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backend import interpreter_enabled
from ...formats import FP8_MAX, MXFP4_BLOCK, MXFP4_MAX, Q_AMAX_FLOOR
from .reference import rope_quant_q_reference

MXFP4_AMAX_FLOOR = MXFP4_MAX * 2.0**-126

_FP8_MAX = tl.constexpr(FP8_MAX)
_MXFP4_MAX = tl.constexpr(MXFP4_MAX)
_MXFP4_AMAX_FLOOR = tl.constexpr(MXFP4_AMAX_FLOOR)
_MXFP4_BLOCK = tl.constexpr(MXFP4_BLOCK)
_Q_AMAX_FLOOR = tl.constexpr(Q_AMAX_FLOOR)
_SIGN_BIT = tl.constexpr(-(2**31))

__all__ = ["rope_quant_q_triton"]


@triton.jit
def round_to_bf16(x, INTERPRETER: tl.constexpr):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), returned as fp32."""
    if INTERPRETER:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
        rounded = tl.where(x == x, rounded, x)
    else:
        rounded = x.to(tl.bfloat16).to(tl.float32)
    return rounded


@triton.jit
def finite_abs(x):
    """``|x|`` where ``x`` is finite, 0 where it is NaN or infinite (they never set a scale)."""
    magnitude = tl.abs(x)
    return tl.where(magnitude < float("inf"), magnitude, 0.0)


@triton.jit
def finite_amax(x, axis: tl.constexpr):
    """Largest finite ``|x|`` along ``axis``, 0 where there is none."""
    return tl.max(finite_abs(x), axis=axis)


@triton.jit
def fp8_scale_exponent(amax):
    """``clamp(ceil(log2(fp32(amax / 448))), -126, 127)`` (int32) of fp32 ``amax > 0``, from its bits."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = bits >> 23
    exponent = biased - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    exponent = tl.where(biased == 0, tl.where(bits <= 224, 0, -126), exponent)
    return tl.minimum(tl.maximum(exponent, -126), 127)


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
def e4m3_bytes(scaled, INTERPRETER: tl.constexpr):
    """e4m3fn bytes (uint8) of already-scaled fp32 values: clamp to ±448, nearest-even; NaN -> 0x7F."""
    if INTERPRETER:
        clamped = tl.minimum(tl.maximum(scaled, -_FP8_MAX), _FP8_MAX)
        code = round_to_e4m3(clamped).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        code = tl.where(scaled == scaled, code, tl.full(code.shape, 0x7F, tl.uint8))
    else:
        code = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return code


@triton.jit
def e2m1_codes(scaled):
    """4-bit e2m1 codes (int32, sign in bit 3) of already-scaled fp32 values; ties to even, NaN -> +0."""
    magnitude = tl.minimum(tl.abs(scaled), _MXFP4_MAX)
    power = (magnitude.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    unit = tl.maximum(power, 1.0)  # 2**k, k = max(exponent, 0) in {0, 1, 2}: the grid is unit / 2
    magic = unit * 6291456.0  # 1.5 * 2**22 * unit, whose fp32 ulp is unit / 2
    steps = (magnitude + magic).to(tl.int32, bitcast=True) - magic.to(tl.int32, bitcast=True)
    code = steps + (unit.to(tl.int32, bitcast=True) >> 22) - 254  # steps + 2 * k
    code = code | tl.where(scaled < -0.25, 8, 0)
    return tl.where(scaled == scaled, code, 0)


@triton.jit
def mxfp4_exponents(block_amax):
    """Unbiased ue8m0 exponents ``ceil(log2(fp32(max(amax, 6 * 2**-126) / 6)))`` (int32) of 32-element blocks."""
    bits = tl.maximum(block_amax, _MXFP4_AMAX_FLOOR).to(tl.int32, bitcast=True)
    return (bits >> 23) - 129 + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)


@triton.jit
def mxfp4_pack(x, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """MXFP4 of ``x [ROWS, WIDTH]`` (WIDTH a multiple of 32).

    Returns ``(packed uint8 [ROWS, WIDTH/2], scales uint8 [ROWS, WIDTH/32])``.
    """
    blocks = tl.reshape(x, [ROWS, WIDTH // _MXFP4_BLOCK, _MXFP4_BLOCK])
    exponent = mxfp4_exponents(finite_amax(blocks, 2))  # [ROWS, WIDTH/32]
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
    HALF_BLOCK: tl.constexpr, PASS_START: tl.constexpr, PASS_BLOCK: tl.constexpr,
    MXFP4: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """One program: token ``program_id(0)``, heads ``[program_id(1) * BLOCK_H, +BLOCK_H)``.

    RoPE works on pairs ``(x0[j], x1[j])``, ``j < ROPE_DIM / 2``: dims ``ROPE_START + j`` and
    ``ROPE_START + ROPE_DIM / 2 + j`` (NeoX) or ``ROPE_START + 2j`` and ``+ 1`` (interleaved, loaded as
    ``[.., j, 2]`` and split). The other ``HEAD_DIM - ROPE_DIM`` dims start at ``PASS_START``.
    """
    half: tl.constexpr = ROPE_DIM // 2
    pass_width: tl.constexpr = HEAD_DIM - ROPE_DIM
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    heads_ok = heads < num_heads
    head_rows = token * num_heads + heads  # [BLOCK_H] row of the [T * H] outputs
    q_heads = q_ptr + token * stride_qt + heads.to(tl.int64)[:, None] * stride_qh  # [BLOCK_H, 1]
    position = tl.load(positions_ptr + token * stride_positions).to(tl.int64)

    pair = tl.arange(0, HALF_BLOCK)  # [HALF_BLOCK]
    pair_ok = pair < half
    table = cos_sin_ptr + position * stride_cs_pos
    cos = tl.load(table + pair * stride_cs_dim, mask=pair_ok, other=0.0).to(tl.float32)[None, :]  # [1, HALF_BLOCK]
    sin = tl.load(table + (half + pair) * stride_cs_dim, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
    pairs_ok = heads_ok[:, None] & pair_ok[None, :]  # [BLOCK_H, HALF_BLOCK]
    if INTERLEAVED:
        pair_dims = ROPE_START + 2 * pair[:, None] + tl.arange(0, 2)[None, :]  # [HALF_BLOCK, 2]
        x = tl.load(q_heads[:, :, None] + pair_dims[None, :, :] * stride_qd, mask=pairs_ok[:, :, None], other=0.0)
        x0, x1 = tl.split(x.to(tl.float32))  # [BLOCK_H, HALF_BLOCK] each
    else:
        x0 = tl.load(q_heads + (ROPE_START + pair)[None, :] * stride_qd, mask=pairs_ok, other=0.0).to(tl.float32)
        x1 = tl.load(q_heads + (ROPE_START + half + pair)[None, :] * stride_qd, mask=pairs_ok, other=0.0)
        x1 = x1.to(tl.float32)
    r0 = round_to_bf16(x0 * cos - x1 * sin, INTERPRETER)  # [BLOCK_H, HALF_BLOCK]
    r1 = round_to_bf16(x1 * cos + x0 * sin, INTERPRETER)

    if pass_width > 0:
        pass_dim = PASS_START + tl.arange(0, PASS_BLOCK)  # [PASS_BLOCK]
        pass_ok = heads_ok[:, None] & (pass_dim < PASS_START + pass_width)[None, :]
        kept = tl.load(q_heads + pass_dim[None, :] * stride_qd, mask=pass_ok, other=0.0).to(tl.float32)

    weights = tl.load(weights_ptr + token * stride_wt + heads * stride_wh, mask=heads_ok, other=0.0).to(tl.float32)
    softmax = tl.cast(softmax_scale, tl.float32)  # the interpreter passes tiny Python floats as fp64
    head = tl.cast(head_scale, tl.float32)
    if MXFP4:
        if INTERLEAVED:
            rotated = tl.reshape(tl.join(r0, r1), [BLOCK_H, 2 * HALF_BLOCK])  # natural dim order
            _store_mxfp4(values_ptr, scales_ptr, head_rows, heads_ok, rotated, ROPE_START, ROPE_DIM,
                         2 * HALF_BLOCK, BLOCK_H, HEAD_DIM)
        else:
            _store_mxfp4(values_ptr, scales_ptr, head_rows, heads_ok, r0, ROPE_START, half, HALF_BLOCK,
                         BLOCK_H, HEAD_DIM)
            _store_mxfp4(values_ptr, scales_ptr, head_rows, heads_ok, r1, ROPE_START + half, half, HALF_BLOCK,
                         BLOCK_H, HEAD_DIM)
        if pass_width > 0:
            _store_mxfp4(values_ptr, scales_ptr, head_rows, heads_ok, kept, PASS_START, pass_width, PASS_BLOCK,
                         BLOCK_H, HEAD_DIM)
        weights_out = (weights * softmax) * head
    else:
        amax = tl.maximum(finite_amax(r0, 1), finite_amax(r1, 1))  # [BLOCK_H]
        if pass_width > 0:
            amax = tl.maximum(amax, finite_amax(kept, 1))
        exponent = fp8_scale_exponent(tl.maximum(amax, _Q_AMAX_FLOOR))  # [BLOCK_H]
        inverse = pow2(-exponent)[:, None]  # [BLOCK_H, 1]
        rows = values_ptr + head_rows[:, None] * HEAD_DIM  # [BLOCK_H, 1]
        if INTERLEAVED:
            codes = e4m3_bytes(tl.join(r0, r1) * inverse[:, :, None], INTERPRETER)  # [BLOCK_H, HALF_BLOCK, 2]
            tl.store(rows[:, :, None] + pair_dims[None, :, :], codes, mask=pairs_ok[:, :, None])
        else:
            tl.store(rows + (ROPE_START + pair)[None, :], e4m3_bytes(r0 * inverse, INTERPRETER), mask=pairs_ok)
            tl.store(rows + (ROPE_START + half + pair)[None, :], e4m3_bytes(r1 * inverse, INTERPRETER),
                     mask=pairs_ok)
        if pass_width > 0:
            tl.store(rows + pass_dim[None, :], e4m3_bytes(kept * inverse, INTERPRETER), mask=pass_ok)
        weights_out = ((weights * pow2(exponent)) * softmax) * head
    tl.store(weights_out_ptr + head_rows, weights_out, mask=heads_ok)


def mxfp4_kernel_supports(rope_dim: int, rope_style: str) -> bool:
    """The kernel quantises MXFP4 heads whose rope dims (and their NeoX halves) are whole 32-blocks."""
    return rope_dim % (2 * MXFP4_BLOCK if rope_style == "neox" else MXFP4_BLOCK) == 0


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
    block_heads: int | None = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Triton twin of ``rope_quant_q_reference`` (same arguments and results, bit for bit).

    MXFP4 with a rope dim that ``mxfp4_kernel_supports`` refuses (not a multiple of 64 for NeoX, of 32
    for interleaved; no DeepSeek model has one) runs the reference instead, with the same results.
    ``block_heads`` (a power of two; default all heads, at most 64) and ``num_warps`` tune the launch.
    No host synchronisation.
    """
    num_tokens, num_heads, head_dim = q.shape
    rope_dim = cos_sin.shape[1]
    mxfp4 = fmt == "mxfp4"
    if mxfp4 and not mxfp4_kernel_supports(rope_dim, rope_style):
        return rope_quant_q_reference(q, positions, cos_sin, weights, softmax_scale, head_scale,
                                      rope_style=rope_style, rope_position=rope_position, fmt=fmt)
    weights_out = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    if mxfp4:
        values = torch.empty((num_tokens, num_heads, head_dim // 2), dtype=torch.uint8, device=q.device)
        scales = torch.empty((num_tokens, num_heads, head_dim // MXFP4_BLOCK), dtype=torch.uint8, device=q.device)
    else:
        values = torch.empty((num_tokens, num_heads, head_dim), dtype=torch.float8_e4m3fn, device=q.device)
        scales = None
    if num_tokens == 0 or num_heads == 0:
        return values, scales, weights_out
    if block_heads is None:
        block_heads = min(64, triton.next_power_of_2(num_heads))
    first = rope_position == "first"
    grid = (num_tokens, triton.cdiv(num_heads, block_heads))
    _rope_quant_q_kernel[grid](
        q, positions, cos_sin, weights, values.view(torch.uint8), values if scales is None else scales, weights_out,
        num_heads,
        q.stride(0), q.stride(1), q.stride(2), positions.stride(0),
        cos_sin.stride(0), cos_sin.stride(1),
        weights.stride(0), weights.stride(1),
        softmax_scale, head_scale,
        HEAD_DIM=head_dim, ROPE_DIM=rope_dim, ROPE_START=0 if first else head_dim - rope_dim,
        INTERLEAVED=rope_style == "interleaved", HALF_BLOCK=triton.next_power_of_2(rope_dim // 2),
        PASS_START=rope_dim if first else 0, PASS_BLOCK=triton.next_power_of_2(max(head_dim - rope_dim, 1)),
        MXFP4=mxfp4, BLOCK_H=block_heads, INTERPRETER=interpreter_enabled(),
        num_warps=num_warps, enable_fp_fusion=False,
    )
    return values, scales, weights_out
