"""Triton kernel of the fused Q RoPE + quantisation (FP8 e4m3 with a per-head fp32 scale, or MXFP4).

One program per (token, ``BLOCK_H`` heads): RoPE on the rotated dims (each product rounded as the
reference rounds it: launched with ``enable_fp_fusion=False``), then the quantisation of ``ops/common/codecs``
(bit-exact with ``dsa_indexer.formats`` on the GPU and under the interpreter), and the folded weights.
MXFP4 of a bf16 ``q`` with unit dim stride encodes on bf16 pairs (``quantize_store_bf16_words``); other
inputs take the fp32 path (``load_pairs``, ``mxfp4_pack_pairs``). Derivations: ``README.md``.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ...formats import MXFP4_BLOCK, Q_AMAX_FLOOR, UE8M0_ONE, mxfp4_scale_bytes
from ..common.codecs import (
    bf16x2_block_amax,
    e4m3_bytes,
    finite_amax,
    fp8_scale_exponent,
    load_bf16_words,
    load_pairs,
    mxfp4_pack_pairs,
    pack_bf16_words,
    pair_index,
    pow2,
    quantize_store_bf16_words,
    round_pair_to_bf16,
    round_to_bf16,
    store_mxfp4_rows,
    unpack_bf16_words,
)
from ..common.runtime import interpreting
from .reference import rope_quant_q_reference

_MXFP4_BLOCK = tl.constexpr(MXFP4_BLOCK)
_Q_AMAX_FLOOR = tl.constexpr(Q_AMAX_FLOOR)


@dataclasses.dataclass(frozen=True)
class RopeQuantConfig:
    """Launch of the RoPE + quantisation kernel (defaults: FP8). ``block_heads``: heads a program, a power of
    two (None: all heads, at most 64). ``bf16x2`` (MXFP4): a bf16 ``q`` whose layout allows it is encoded on
    bf16 pairs; False runs the fp32 path (tests, benchmarks); the results are the same."""

    block_heads: int | None = None
    num_warps: int = 8
    bf16x2: bool = True


# MXFP4: 4 warps, the fastest measured on an H200.
MXFP4_ROPE_QUANT_CONFIG = RopeQuantConfig(num_warps=4)


def rope_quant_config(fmt: str) -> RopeQuantConfig:
    """The launch the wrapper uses for ``fmt`` (``"fp8"`` or ``"mxfp4"``)."""
    return MXFP4_ROPE_QUANT_CONFIG if fmt == "mxfp4" else RopeQuantConfig()


__all__ = ["rope_quant_q_triton", "RopeQuantConfig", "rope_quant_config"]


@triton.jit
def _store_mxfp4_pairs(values_ptr, scales_ptr, head_rows, heads_ok, even, odd, START: tl.constexpr,
                       WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, INTERPRETER: tl.constexpr):
    """Quantise and store dims ``[START, START + WIDTH)`` of each head.

    ``even, odd``: those dims as ``load_pairs`` tiles ``[BLOCK_H, NB, 4, 4]``.
    """
    packed, scales = mxfp4_pack_pairs(even, odd, INTERPRETER)
    store_mxfp4_rows(values_ptr + head_rows * (HEAD_DIM // 2) + START // 2,
                     scales_ptr + head_rows * ((HEAD_DIM + 127) // 128 * 4) + START // _MXFP4_BLOCK, heads_ok, packed,
                     scales, WIDTH)


@triton.jit
def _quantize_store_words(values_ptr, scales_ptr, head_rows, heads_ok, words, amax, START: tl.constexpr,
                          WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, FINITE: tl.constexpr, INTERPRETER: tl.constexpr):
    """``quantize_store_bf16_words`` of dims ``[START, START + WIDTH)`` of each head (``words``: those dims)."""
    quantize_store_bf16_words(values_ptr + head_rows * (HEAD_DIM // 2) + START // 2,
                              scales_ptr + head_rows * ((HEAD_DIM + 127) // 128 * 4) + START // _MXFP4_BLOCK, heads_ok,
                              words, amax, WIDTH, FINITE, INTERPRETER)


@triton.jit
def _rope_pairs(x0, x1, cos, sin, PACKED: tl.constexpr, INTERPRETER: tl.constexpr):
    """bf16-rounded ``(x0 cos - x1 sin, x1 cos + x0 sin)``; ``PACKED`` rounds them as a pair on the GPU."""
    r0 = x0 * cos - x1 * sin
    r1 = x1 * cos + x0 * sin
    if PACKED and not INTERPRETER:
        r0, r1 = round_pair_to_bf16(r0, r1)
    else:
        r0 = round_to_bf16(r0, INTERPRETER)
        r1 = round_to_bf16(r1, INTERPRETER)
    return r0, r1


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
    MXFP4: tl.constexpr, BLOCK_H: tl.constexpr, BF16X2: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """One program: token ``program_id(0)``, heads ``[program_id(1) * BLOCK_H, +BLOCK_H)``.

    RoPE works on pairs ``(x0[j], x1[j])``, ``j < ROPE_DIM / 2``: dims ``ROPE_START + j`` and
    ``ROPE_START + ROPE_DIM / 2 + j`` (NeoX) or ``ROPE_START + 2j`` and ``+ 1`` (interleaved, loaded as
    ``[.., j, 2]`` and split). The other ``HEAD_DIM - ROPE_DIM`` dims start at ``PASS_START``.
    MXFP4 keeps every segment as (even dim, odd dim) pairs ``[BLOCK_H, NB, 16]`` from the load to the
    packed bytes, so no tile changes layout: interleaved rope pairs are such pairs already; NeoX
    halves are loaded as pairs of consecutive dims, with ``cos``/``sin`` split the same way; the rotated
    pairs are rounded to bf16 with one packed conversion each. ``BF16X2`` (MXFP4 of bf16 ``q`` with unit dim
    stride and even token and head strides): segments are loaded as bf16 pair words (``load_bf16_words``),
    the rotated pairs rounded into such words, and each segment quantised by ``quantize_store_bf16_words``.
    """
    half: tl.constexpr = ROPE_DIM // 2
    pass_width: tl.constexpr = HEAD_DIM - ROPE_DIM
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    heads_ok = heads < num_heads
    head_rows = token * num_heads + heads  # [BLOCK_H] row of the [T * H] outputs
    q_rows = q_ptr + token * stride_qt + heads.to(tl.int64) * stride_qh  # [BLOCK_H]
    q_heads = q_rows[:, None]  # [BLOCK_H, 1]
    position = tl.load(positions_ptr + token * stride_positions).to(tl.int64)
    table = cos_sin_ptr + position * stride_cs_pos
    weights = tl.load(weights_ptr + token * stride_wt + heads * stride_wh, mask=heads_ok, other=0.0).to(tl.float32)
    softmax = tl.cast(softmax_scale, tl.float32)  # the interpreter passes tiny Python floats as fp64
    head = tl.cast(head_scale, tl.float32)

    if MXFP4 and BF16X2:
        q_words = q_rows.to(tl.pointer_type(tl.uint32), bitcast=True)  # [BLOCK_H]
        if INTERLEAVED:
            rope_nb: tl.constexpr = HALF_BLOCK // 16
            pair = pair_index(rope_nb)  # [1, NB, 4, 4] rope pair j
            cos = tl.load(table + pair * stride_cs_dim, mask=pair < half, other=0.0).to(tl.float32)
            sin = tl.load(table + (pair + half) * stride_cs_dim, mask=pair < half, other=0.0).to(tl.float32)
            pairs = load_bf16_words(q_words, ROPE_START // 2, heads_ok, half, rope_nb)
            x0, x1 = unpack_bf16_words(pairs)
            first = pack_bf16_words(x0 * cos - x1 * sin, x1 * cos + x0 * sin, INTERPRETER)  # [ROPE_START, +ROPE_DIM)
            first_width: tl.constexpr = ROPE_DIM
        else:
            half_nb: tl.constexpr = HALF_BLOCK // 32
            table_row = table + tl.zeros([1], tl.int64)  # [1]: cos/sin split like a row of q
            table_ok = tl.full([1], True, tl.int1)
            cos_even, cos_odd = load_pairs(table_row, 0, stride_cs_dim, table_ok, half // 2, half_nb)
            sin_even, sin_odd = load_pairs(table_row, half, stride_cs_dim, table_ok, half // 2, half_nb)
            x0_even, x0_odd = unpack_bf16_words(load_bf16_words(q_words, ROPE_START // 2, heads_ok, half // 2, half_nb))
            x1_even, x1_odd = unpack_bf16_words(load_bf16_words(q_words, (ROPE_START + half) // 2, heads_ok, half // 2,
                                                                half_nb))
            first = pack_bf16_words(x0_even * cos_even - x1_even * sin_even, x0_odd * cos_odd - x1_odd * sin_odd,
                                    INTERPRETER)  # dims [ROPE_START, +half)
            second = pack_bf16_words(x1_even * cos_even + x0_even * sin_even, x1_odd * cos_odd + x0_odd * sin_odd,
                                     INTERPRETER)  # dims [ROPE_START + half, +half)
            first_width: tl.constexpr = half
        first_amax = bf16x2_block_amax(first, INTERPRETER)  # [BLOCK_H, NB]
        rope_amax = first_amax
        if not INTERLEAVED:
            second_amax = bf16x2_block_amax(second, INTERPRETER)
            rope_amax = tl.maximum(rope_amax, second_amax)
        largest = tl.max(rope_amax)  # one block-wide reduction (per tile shape)
        if pass_width > 0:
            kept = load_bf16_words(q_words, PASS_START // 2, heads_ok, pass_width // 2, PASS_BLOCK // 32)
            kept_amax = bf16x2_block_amax(kept, INTERPRETER)
            if PASS_BLOCK // 32 == rope_amax.shape[1]:
                largest = tl.max(tl.maximum(rope_amax, kept_amax))
            else:
                largest = tl.maximum(largest, tl.max(kept_amax))
        if largest < 0x7F80:  # every value of the program finite
            _quantize_store_words(values_ptr, scales_ptr, head_rows, heads_ok, first, first_amax, ROPE_START,
                                  first_width, HEAD_DIM, True, INTERPRETER)
            if not INTERLEAVED:
                _quantize_store_words(values_ptr, scales_ptr, head_rows, heads_ok, second, second_amax,
                                      ROPE_START + half, half, HEAD_DIM, True, INTERPRETER)
            if pass_width > 0:
                _quantize_store_words(values_ptr, scales_ptr, head_rows, heads_ok, kept, kept_amax, PASS_START,
                                      pass_width, HEAD_DIM, True, INTERPRETER)
        else:
            _quantize_store_words(values_ptr, scales_ptr, head_rows, heads_ok, first, first_amax, ROPE_START,
                                  first_width, HEAD_DIM, False, INTERPRETER)
            if not INTERLEAVED:
                _quantize_store_words(values_ptr, scales_ptr, head_rows, heads_ok, second, second_amax,
                                      ROPE_START + half, half, HEAD_DIM, False, INTERPRETER)
            if pass_width > 0:
                _quantize_store_words(values_ptr, scales_ptr, head_rows, heads_ok, kept, kept_amax, PASS_START,
                                      pass_width, HEAD_DIM, False, INTERPRETER)
        weights_out = (weights * softmax) * head
    elif MXFP4:
        if INTERLEAVED:
            rope_nb: tl.constexpr = HALF_BLOCK // 16
            pair = pair_index(rope_nb)  # [1, NB, 4, 4] rope pair j
            cos = tl.load(table + pair * stride_cs_dim, mask=pair < half, other=0.0).to(tl.float32)
            sin = tl.load(table + (pair + half) * stride_cs_dim, mask=pair < half, other=0.0).to(tl.float32)
            x0, x1 = load_pairs(q_rows, ROPE_START, stride_qd, heads_ok, half, rope_nb)
            r0, r1 = _rope_pairs(x0, x1, cos, sin, True, INTERPRETER)
            _store_mxfp4_pairs(values_ptr, scales_ptr, head_rows, heads_ok, r0, r1, ROPE_START, ROPE_DIM, HEAD_DIM,
                               INTERPRETER)
        else:
            half_nb: tl.constexpr = HALF_BLOCK // 32
            table_row = table + tl.zeros([1], tl.int64)  # [1]: cos/sin split like a row of q
            table_ok = tl.full([1], True, tl.int1)
            cos_even, cos_odd = load_pairs(table_row, 0, stride_cs_dim, table_ok, half // 2, half_nb)
            sin_even, sin_odd = load_pairs(table_row, half, stride_cs_dim, table_ok, half // 2, half_nb)
            x0_even, x0_odd = load_pairs(q_rows, ROPE_START, stride_qd, heads_ok, half // 2, half_nb)
            x1_even, x1_odd = load_pairs(q_rows, ROPE_START + half, stride_qd, heads_ok, half // 2, half_nb)
            r0_even, r1_even = _rope_pairs(x0_even, x1_even, cos_even, sin_even, True, INTERPRETER)
            r0_odd, r1_odd = _rope_pairs(x0_odd, x1_odd, cos_odd, sin_odd, True, INTERPRETER)
            _store_mxfp4_pairs(values_ptr, scales_ptr, head_rows, heads_ok, r0_even, r0_odd, ROPE_START, half,
                               HEAD_DIM, INTERPRETER)
            _store_mxfp4_pairs(values_ptr, scales_ptr, head_rows, heads_ok, r1_even, r1_odd, ROPE_START + half, half,
                               HEAD_DIM, INTERPRETER)
        if pass_width > 0:
            kept_even, kept_odd = load_pairs(q_rows, PASS_START, stride_qd, heads_ok, pass_width // 2,
                                             PASS_BLOCK // 32)
            _store_mxfp4_pairs(values_ptr, scales_ptr, head_rows, heads_ok, kept_even, kept_odd, PASS_START,
                               pass_width, HEAD_DIM, INTERPRETER)
        weights_out = (weights * softmax) * head
    else:
        pair = tl.arange(0, HALF_BLOCK)  # [HALF_BLOCK]
        pair_ok = pair < half
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
        r0, r1 = _rope_pairs(x0, x1, cos, sin, False, INTERPRETER)  # [BLOCK_H, HALF_BLOCK]
        amax = tl.maximum(finite_amax(r0, 1), finite_amax(r1, 1))  # [BLOCK_H]
        if pass_width > 0:
            pass_dim = PASS_START + tl.arange(0, PASS_BLOCK)  # [PASS_BLOCK]
            pass_ok = heads_ok[:, None] & (pass_dim < PASS_START + pass_width)[None, :]
            kept = tl.load(q_heads + pass_dim[None, :] * stride_qd, mask=pass_ok, other=0.0).to(tl.float32)
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
    config: RopeQuantConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Triton twin of ``rope_quant_q_reference`` (same arguments and results, bit for bit).

    MXFP4 with a rope dim that ``mxfp4_kernel_supports`` refuses (not a multiple of 64 for NeoX, of 32
    for interleaved; no DeepSeek model has one) runs the reference instead, with the same results.
    ``config`` overrides ``rope_quant_config(fmt)`` (tests, benchmarks). The bf16-pair encode applies to bf16
    ``q`` with unit dim stride, even token and head strides, 4-byte aligned (other ``q`` take the fp32 path).
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
        # Padding bytes of D/32 % 4 != 0 scale words (D = 64) hold UE8M0_ONE; the kernel writes the D/32 scales.
        scale_shape = (num_tokens, num_heads, mxfp4_scale_bytes(head_dim))
        scales = (torch.empty(scale_shape, dtype=torch.uint8, device=q.device) if head_dim % (4 * MXFP4_BLOCK) == 0
                  else torch.full(scale_shape, UE8M0_ONE, dtype=torch.uint8, device=q.device))
    else:
        values = torch.empty((num_tokens, num_heads, head_dim), dtype=torch.float8_e4m3fn, device=q.device)
        scales = None
    if num_tokens == 0 or num_heads == 0:
        return values, scales, weights_out
    config = config or rope_quant_config(fmt)
    block_heads = config.block_heads or min(64, triton.next_power_of_2(num_heads))
    first = rope_position == "first"
    words_ok = (q.dtype == torch.bfloat16 and q.stride(2) == 1 and q.stride(0) % 2 == 0 and q.stride(1) % 2 == 0
                and q.data_ptr() % 4 == 0)
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
        MXFP4=mxfp4, BLOCK_H=block_heads,
        BF16X2=mxfp4 and config.bf16x2 and words_ok,
        INTERPRETER=interpreting(),
        num_warps=config.num_warps, enable_fp_fusion=False,
    )
    return values, scales, weights_out
