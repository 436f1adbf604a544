"""Triton kernels of the DCP merge: the pack step (a rank's local top-k as ``(score, global id)``
pairs) and the select step (the global top-k of the gathered pairs, in one launch)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ops.topk.triton import NONE, _kth_largest, _order_keys

MAX_GLOBAL_ID = tl.constexpr(2**31 - 1)
# The select kernel holds a row in registers and counts in 16-bit fields (``_kth_largest``).
SELECT_MAX_CANDIDATES = 16384


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


@triton.jit(do_not_specialize=["width", "k"])
def _select_global_topk_kernel(
    scores_ptr, scores_row_stride, ids_ptr, ids_row_stride, width,
    out_ptr, out_row_stride, k,
    BLOCK: tl.constexpr,
):
    """One program per row: the row's ``width`` candidates sorted by id (``tl.sort`` of ``id << 32 | key``),
    so that position order is id order; then the k-th largest order key ``T`` and an ordered emit of
    the keys ``> T`` and the first ties ``== T`` (lowest ids), ``-1`` after the taken ids."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    inside = offsets < width
    ids = tl.load(ids_ptr + row * ids_row_stride + offsets, mask=inside, other=-1)
    scores = tl.load(scores_ptr + row * scores_row_stride + offsets, mask=inside, other=float("-inf"))
    valid = (ids >= 0) & (ids <= MAX_GLOBAL_ID)
    keys = _order_keys(scores, valid)
    sort_ids = tl.where(valid, ids, MAX_GLOBAL_ID + 1)
    by_id = tl.sort((sort_ids << 32) | (keys.to(tl.int64) & 0xFFFFFFFF))
    ids = (by_id >> 32).to(tl.int32)
    keys = by_id.to(tl.int32)
    selectable = tl.sum((keys != NONE).to(tl.int32), axis=0)
    if selectable > k:
        threshold, reaching = _kth_largest(keys, k, k - 1)
        greater = keys > threshold
        ties = k - tl.sum(greater.to(tl.int32), axis=0)
        equal = keys == threshold
        taken = greater | (equal & (tl.cumsum(equal.to(tl.int32), axis=0) <= ties))
    else:
        taken = keys != NONE
    positions = tl.cumsum(taken.to(tl.int32), axis=0) - 1
    out_row = out_ptr + row * out_row_stride
    tl.store(out_row + positions, ids, mask=taken)
    tl.store(out_row + offsets, -1, mask=(offsets < k) & (offsets >= tl.minimum(selectable, k)))


def select_global_topk_triton(
    scores: torch.Tensor, global_ids: torch.Tensor, k: int, out: torch.Tensor
) -> torch.Tensor:
    """Triton twin of the reference select for rows of at most ``SELECT_MAX_CANDIDATES`` candidates:
    ``scores`` ``[R, M]`` float32, ``global_ids`` ``[R, M]`` int64, ``out`` ``[R, k]`` int32 (written)."""
    num_rows, width = scores.shape
    if num_rows == 0:
        return out
    block = max(16, triton.next_power_of_2(max(width, k)))
    scores_rows = scores if scores.stride(1) == 1 else scores.contiguous()
    ids_rows = global_ids if global_ids.stride(1) == 1 else global_ids.contiguous()
    out_rows = out if out.stride(1) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
    _select_global_topk_kernel[(num_rows,)](
        scores_rows, scores_rows.stride(0), ids_rows, ids_rows.stride(0), width,
        out_rows, out_rows.stride(0), k,
        BLOCK=block, num_warps=8 if block >= 4096 else 4,
    )
    return out if out_rows is out else out.copy_(out_rows)
