"""PyTorch references of the DCP merge pieces and of the DCP candidate block scores (any device)."""

from __future__ import annotations

import torch

from ...dcp_positions import MAX_GLOBAL_ID, to_global_int64
from .._order import composite_key, top_ids_ascending
from ..candidates.reference import block_scores


def pack_local_candidates_reference(
    logits: torch.Tensor,
    local_topk: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int,
    starts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores float32 [R, k], global_ids int64 [R, k])`` of ``pack_local_candidates``."""
    width = logits.shape[1]
    local_pos = local_topk.to(torch.int64)
    column = local_pos if starts is None else local_pos + starts.to(torch.int64)[:, None]
    valid = (local_pos >= 0) & (column >= 0) & (column < width)
    if width == 0:
        scores = torch.full(local_pos.shape, float("-inf"), dtype=torch.float32, device=logits.device)
    else:
        scores = logits.gather(1, column.clamp(0, width - 1))
        scores = torch.where(valid, scores, float("-inf"))
    global_ids = torch.where(valid, to_global_int64(local_pos, rank, world_size, interleave), -1)
    return scores, global_ids


def _candidate_keys(scores: torch.Tensor, global_ids: torch.Tensor) -> torch.Tensor:
    """int64 ``composite_key`` of ``(score, id)`` pairs; ids outside ``[0, 2**31)`` are unselectable."""
    valid_id = (global_ids >= 0) & (global_ids <= MAX_GLOBAL_ID)
    return composite_key(torch.where(valid_id, scores, float("-inf")), global_ids.clamp(0, MAX_GLOBAL_ID))


def select_global_topk_reference(
    scores: torch.Tensor, global_ids: torch.Tensor, k: int, out: torch.Tensor | None
) -> torch.Tensor:
    """int32 ``[R, k]`` of ``select_global_topk`` (``global_ids`` int64)."""
    if out is None:
        out = torch.empty((scores.shape[0], k), dtype=torch.int32, device=scores.device)
    return out.copy_(top_ids_ascending(_candidate_keys(scores, global_ids), global_ids, k))


def pack_candidate_keys_reference(
    logits: torch.Tensor,
    local_topk: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int,
    starts: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """int64 ``out [R, k]`` of ``pack_candidate_keys``."""
    scores, global_ids = pack_local_candidates_reference(logits, local_topk, rank, world_size, interleave, starts)
    return out.copy_(_candidate_keys(scores, global_ids))


def pack_scored_keys_reference(
    scores: torch.Tensor,
    local_positions: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """int64 ``out [R, k]`` of ``pack_scored_keys``."""
    global_ids = to_global_int64(local_positions.to(torch.int64), rank, world_size, interleave)
    return out.copy_(_candidate_keys(scores, global_ids))


def select_global_topk_keys_reference(keys: torch.Tensor, k: int, out: torch.Tensor, scratch) -> torch.Tensor:
    """int32 ``out [R, k]`` of ``select_global_topk_keys`` (``scratch`` unused)."""
    world_size, num_rows, width = keys.shape
    row_keys = keys.permute(1, 0, 2).reshape(num_rows, world_size * width)
    ids = 0xFFFFFFFF - (row_keys & 0xFFFFFFFF)
    return out.copy_(top_ids_ascending(row_keys, ids, k))


def dcp_block_scores_reference(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    local_block: int,
    num_blocks: int,
    row_repeat: int,
    global_ends: torch.Tensor,
    global_block: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """float32 ``out [R, num_blocks]`` of ``dcp_block_scores``."""
    num_rows = logits.shape[0]
    scores = block_scores(logits, starts, ends, local_block, num_blocks, row_repeat)
    block_ids = torch.arange(num_blocks, device=logits.device).expand(num_rows, num_blocks)
    bound_index = torch.arange(num_rows, device=logits.device) // row_repeat
    newest = torch.div(global_ends.to(torch.int64)[bound_index] - 1, global_block, rounding_mode="floor")
    return out.copy_(torch.where(block_ids == newest[:, None], float("inf"), scores))
