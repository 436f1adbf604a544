"""Q preparation: RoPE on part of each head, then FP8 or MXFP4 quantisation (DESIGN.md §4)."""

from __future__ import annotations

import math
import numbers

import torch

from ... import backend as _backend
from ..._validation import (
    check_choice,
    check_index_tensor,
    check_same_device,
    check_tensor,
    value_checks_enabled,
)
from ...formats import FP8_DTYPE, MXFP4_BLOCK, mxfp4_scale_bytes
from ..common.registration import registered_op
from .reference import rope_quant_q_reference

ROPE_STYLES = ("neox", "interleaved")
ROPE_POSITIONS = ("first", "trailing")
Q_FORMATS = ("fp8", "mxfp4")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

__all__ = ["rope_quant_q"]


def _rope_quant_q_triton(*args, **kwargs):
    from .triton import rope_quant_q_triton

    return rope_quant_q_triton(*args, **kwargs)


def _check_finite_scalar(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def rope_quant_q(
    q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    weights: torch.Tensor,
    softmax_scale: float,
    head_scale: float,
    *,
    rope_style: str = "neox",
    rope_position: str = "first",
    fmt: str = "fp8",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Apply RoPE to ``q`` and quantise it per (token, head); fold what can be folded into the weights.

    Args:
        q: ``[T, H, D]`` bf16 (fp16 and fp32 accepted), any strides.
        positions: ``[T]`` int32/int64, each in ``[0, max_pos)``; row of ``cos_sin`` for token ``t``.
        cos_sin: ``[max_pos, rope_dim]`` fp32/bf16/fp16, each row ``[cos (rope_dim/2) | sin (rope_dim/2)]``;
            ``rope_dim`` is even and at most ``D`` (64 for DeepSeek).
        weights: ``[T, H]`` bf16/fp16/fp32 per-head index weights.
        softmax_scale, head_scale: finite reals (DeepSeek: ``D ** -0.5`` and ``H ** -0.5``).
        rope_style: ``"neox"`` (pairs ``x[i]``, ``x[i + rope_dim/2]``) or ``"interleaved"``
            (pairs ``x[2i]``, ``x[2i+1]``).
        rope_position: ``"first"`` rotates dims ``[0, rope_dim)`` (V3.2), ``"trailing"`` rotates
            ``[D - rope_dim, D)`` (V4, V4.1).
        fmt: ``"fp8"`` or ``"mxfp4"`` (``D`` a multiple of 32).

    Returns:
        FP8: ``(q_quant float8_e4m3fn [T, H, D], None, weights_out float32 [T, H])`` where
        ``weights_out = ((weights * q_scale) * softmax_scale) * head_scale`` in fp32 and ``q_scale`` is
        the per-(token, head) ue8m0 scale (floor 1e-10).
        MXFP4: ``(q_quant uint8 [T, H, D/2], q_scale uint8 [T, H, D/32],
        weights_out = (weights * softmax_scale) * head_scale)``.

    The rotated values are rounded to bf16 before quantisation. Non-finite input follows the format
    rules: a NaN in a rotated pair makes both elements of the pair NaN, NaN encodes as an e4m3 NaN
    (sign unspecified) or MXFP4 +0, and no NaN or inf changes a scale. The position range check reads
    ``positions``' min and max on the host (one device synchronisation on CUDA).
    """
    q_quant, q_scale, weights_out = _rope_quant_q_op(
        q, positions, cos_sin, weights, softmax_scale, head_scale, rope_style, rope_position, fmt, backend
    )
    return q_quant, None if fmt == "fp8" else q_scale, weights_out


def _rope_quant_q_shapes(q, positions, cos_sin, weights, softmax_scale, head_scale, rope_style, rope_position, fmt,
                         backend):
    tokens, heads, dim = q.shape
    weights_out = q.new_empty((tokens, heads), dtype=torch.float32)
    if fmt == "fp8":
        return q.new_empty(q.shape, dtype=FP8_DTYPE), q.new_empty((0,), dtype=torch.uint8), weights_out
    return (
        q.new_empty((tokens, heads, dim // 2), dtype=torch.uint8),
        q.new_empty((tokens, heads, mxfp4_scale_bytes(dim)), dtype=torch.uint8),
        weights_out,
    )


@registered_op("rope_quant_q", fake=_rope_quant_q_shapes)
def _rope_quant_q_op(
    q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    weights: torch.Tensor,
    softmax_scale: float,
    head_scale: float,
    rope_style: str,
    rope_position: str,
    fmt: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rope_quant_q`` with an empty uint8 ``q_scale`` for FP8 (an op returns tensors only)."""
    q_quant, q_scale, weights_out = _rope_quant_q(
        q, positions, cos_sin, weights, softmax_scale, head_scale, rope_style, rope_position, fmt, backend
    )
    return q_quant, q.new_empty((0,), dtype=torch.uint8) if q_scale is None else q_scale, weights_out


def _rope_quant_q(q, positions, cos_sin, weights, softmax_scale, head_scale, rope_style, rope_position, fmt, backend):
    """``rope_quant_q`` with every argument given: its checks, then the backend's implementation."""
    check_tensor("q", q, dtype=FLOAT_DTYPES, ndim=3)
    num_tokens, num_heads, head_dim = q.shape
    check_index_tensor("positions", positions, shape=(num_tokens,))
    check_tensor("cos_sin", cos_sin, dtype=FLOAT_DTYPES, ndim=2)
    check_tensor("weights", weights, dtype=FLOAT_DTYPES, shape=(num_tokens, num_heads))
    check_same_device(q=q, positions=positions, cos_sin=cos_sin, weights=weights)
    softmax_scale = _check_finite_scalar("softmax_scale", softmax_scale)
    head_scale = _check_finite_scalar("head_scale", head_scale)
    check_choice("rope_style", rope_style, ROPE_STYLES)
    check_choice("rope_position", rope_position, ROPE_POSITIONS)
    check_choice("fmt", fmt, Q_FORMATS)
    max_pos, rope_dim = cos_sin.shape
    if rope_dim < 2 or rope_dim % 2 or rope_dim > head_dim:
        raise ValueError(
            f"cos_sin must have an even, non-zero rope_dim of at most q's head dim {head_dim}, "
            f"got shape {list(cos_sin.shape)}"
        )
    if fmt == "mxfp4" and head_dim % MXFP4_BLOCK:
        raise ValueError(f"q's head dim must be a multiple of {MXFP4_BLOCK} for fmt='mxfp4', got {head_dim}")
    if num_tokens and value_checks_enabled():
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= max_pos:
            raise ValueError(f"positions must lie in [0, {max_pos}) (cos_sin rows), got values in [{low}, {high}]")
    implementation = _backend.dispatch(
        rope_quant_q_reference, _rope_quant_q_triton if _backend.triton_available() else None, backend, q.device
    )
    return implementation(
        q,
        positions,
        cos_sin,
        weights,
        softmax_scale,
        head_scale,
        rope_style=rope_style,
        rope_position=rope_position,
        fmt=fmt,
    )
