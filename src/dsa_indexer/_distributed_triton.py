"""Triton kernel of the DCP merge's pack step: a rank's local top-k as ``(score, global id)`` pairs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pack_local_candidates_kernel(
    logits_ptr, logits_row_stride, logits_col_stride, width,
    topk_ptr, topk_row_stride, k,
    starts_ptr,
    scores_ptr, ids_ptr,
    rank, world_size, interleave,
    HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    in_k = offsets < k
    local = tl.load(topk_ptr + row * topk_row_stride + offsets, mask=in_k, other=-1).to(tl.int64)
    column = local
    if HAS_STARTS:
        column = local + tl.load(starts_ptr + row).to(tl.int64)
    valid = in_k & (local >= 0) & (column >= 0) & (column < width)
    score = tl.load(
        logits_ptr + row * logits_row_stride + column * logits_col_stride, mask=valid, other=float("-inf")
    )
    span = interleave * world_size
    global_id = (local // interleave) * span + rank * interleave + local % interleave
    global_id = tl.where(valid, global_id, -1)
    tl.store(scores_ptr + row * k + offsets, score, mask=in_k)
    tl.store(ids_ptr + row * k + offsets, global_id, mask=in_k)


def pack_local_candidates_triton(
    logits: torch.Tensor,
    local_topk: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int,
    starts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of the reference pack: ``(scores float32 [R, k], global_ids int64 [R, k])``."""
    num_rows, k = local_topk.shape
    scores = torch.empty((num_rows, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((num_rows, k), dtype=torch.int64, device=logits.device)
    if num_rows == 0 or k == 0:
        return scores, ids
    block = min(1024, triton.next_power_of_2(k))
    topk_rows = local_topk if local_topk.stride(1) == 1 else local_topk.contiguous()
    grid = (num_rows, triton.cdiv(k, block))
    _pack_local_candidates_kernel[grid](
        logits, logits.stride(0), logits.stride(1), logits.shape[1],
        topk_rows, topk_rows.stride(0), k,
        starts if starts is not None else topk_rows,
        scores, ids,
        rank, world_size, interleave,
        HAS_STARTS=starts is not None, BLOCK=block,
    )
    return scores, ids
