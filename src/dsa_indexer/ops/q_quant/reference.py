"""PyTorch reference of the fused Q RoPE + quantisation (DESIGN.md §4); runs on any device."""

from __future__ import annotations

import torch

from ...formats import Q_AMAX_FLOOR, quantize_fp8, quantize_mxfp4


def apply_rope_bf16(
    q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rope_style: str, rope_position: str
) -> torch.Tensor:
    """Rotate ``rope_dim = cos_sin.shape[1]`` dims of every head of ``q [T, H, D]`` -> fp32 ``[T, H, D]``.

    ``cos_sin [max_pos, rope_dim]`` holds ``[cos | sin]`` halves; row ``positions[t]`` rotates token
    ``t``. The rotated dims are the first ``rope_dim`` (``rope_position="first"``) or the last
    (``"trailing"``). ``"neox"`` pairs ``x[i]`` with ``x[i + rope_dim/2]``, ``"interleaved"`` pairs
    ``x[2i]`` with ``x[2i+1]``. Each pair becomes ``r0 = x0*cos - x1*sin``, ``r1 = x1*cos + x0*sin``:
    every product and every sum is one correctly rounded fp32 operation (no fused multiply-add), and
    ``r0``, ``r1`` are then rounded to bf16, as an unfused bf16 RoPE would produce them. The other
    dims keep their input values, converted to fp32.
    """
    head_dim = q.shape[-1]
    rope_dim = cos_sin.shape[1]
    half = rope_dim // 2
    x = q.float()
    if rope_position == "first":
        rope_part, pass_part = x[..., :rope_dim], x[..., rope_dim:]
    else:
        pass_part, rope_part = x[..., : head_dim - rope_dim], x[..., head_dim - rope_dim :]
    table = cos_sin.index_select(0, positions).float()
    cos = table[:, None, :half]  # [T, 1, rope_dim/2]
    sin = table[:, None, half:]  # [T, 1, rope_dim/2]
    if rope_style == "neox":
        x0, x1 = rope_part[..., :half], rope_part[..., half:]
    else:
        x0, x1 = rope_part[..., 0::2], rope_part[..., 1::2]
    r0 = (x0 * cos - x1 * sin).to(torch.bfloat16).float()
    r1 = (x1 * cos + x0 * sin).to(torch.bfloat16).float()
    if rope_style == "neox":
        rotated = torch.cat((r0, r1), dim=-1)
    else:
        rotated = torch.stack((r0, r1), dim=-1).flatten(-2)
    parts = (rotated, pass_part) if rope_position == "first" else (pass_part, rotated)
    return torch.cat(parts, dim=-1)


def rope_quant_q_reference(
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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """RoPE (``apply_rope_bf16``) then quantisation of each whole head vector of ``q [T, H, D]``.

    FP8: ``(values float8_e4m3fn [T, H, D], None, weights_out float32 [T, H])`` with one ue8m0 scale
    per (token, head), floor 1e-10, folded into the weights as
    ``((weights * q_scale) * softmax_scale) * head_scale``: fp32 multiplies in that order, the Python
    scalars rounded to fp32 first (what torch and Triton do with a float argument).
    MXFP4: ``(packed uint8 [T, H, D/2], scales uint8 [T, H, D/32],
    weights_out = (weights * softmax_scale) * head_scale)``.
    """
    rotated = apply_rope_bf16(q, positions, cos_sin, rope_style, rope_position)
    if fmt == "fp8":
        values, scales = quantize_fp8(rotated, block_size=q.shape[-1], scale_fmt="ue8m0", amax_floor=Q_AMAX_FLOOR)
        q_scale = scales.squeeze(-1)  # [T, H], a power of two
        return values, None, weights.float() * q_scale * softmax_scale * head_scale
    packed, scales = quantize_mxfp4(rotated)
    return packed, scales, weights.float() * softmax_scale * head_scale
