"""PyTorch reference of the V4.1 two-level candidate blocks (any device, DESIGN §9).

Row ``r`` reads its bounds at ``r // row_repeat``, with ``0 <= starts <= ends <= C`` (the public
wrappers check it). Block ``b`` of a row covers the row-relative positions
``[b * block_size, (b + 1) * block_size)``, i.e. columns ``starts + b * block_size ...`` clipped to
``ends``.
"""

from __future__ import annotations

import torch

from .._order import composite_key, selectable, top_ids_ascending


def row_bounds(
    starts: torch.Tensor | None, ends: torch.Tensor, num_rows: int, row_repeat: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(first column, length)``, both int64 ``[R]``, the window clamped into ``[0, width]`` as
    the kernels clamp it (validated bounds are unchanged; unchecked ones read nothing outside the row)."""
    bound_index = torch.arange(num_rows, device=ends.device) // row_repeat  # [R]
    row_ends = ends[bound_index].to(torch.int64)
    row_starts = torch.zeros_like(row_ends) if starts is None else starts[bound_index].to(torch.int64).clamp(0, width)
    row_ends = torch.maximum(row_ends, row_starts).clamp(max=width)
    return row_starts, row_ends - row_starts


def block_scores(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    block_size: int,
    num_blocks: int,
    row_repeat: int,
) -> torch.Tensor:
    """float32 ``[R, num_blocks]``: the max selectable logit of each block of each row (``-inf`` if
    none; blocks past the row, or past the logits' width, score ``-inf``). No block is pinned."""
    num_rows, width = logits.shape
    scores = torch.full((num_rows, num_blocks), float("-inf"), dtype=torch.float32, device=logits.device)
    if num_rows == 0 or num_blocks == 0 or width == 0:
        return scores
    row_starts, row_lengths = row_bounds(starts, ends, num_rows, row_repeat, width)
    # A row holds at most C positions: scoring only those keeps memory O(R x C) for any block size.
    position = torch.arange(min(width, num_blocks * block_size), device=logits.device)  # [P], row-relative
    in_row = position[None, :] < row_lengths[:, None]  # [R, P]
    column = (row_starts[:, None] + position[None, :]).clamp(max=width - 1)
    values = logits.gather(1, column)
    values = torch.where(in_row & selectable(values), values, float("-inf"))
    block = torch.div(position, block_size, rounding_mode="floor").expand(num_rows, -1)  # [R, P], < NB
    return scores.scatter_reduce_(1, block, values, reduce="amax")


def select_candidate_blocks_reference(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    num_blocks_k: int,
    block_size: int,
    row_repeat: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top ``num_blocks_k`` blocks per row of ``logits [R, C]`` -> int32 ``[R, num_blocks_k]``.

    Block score = max of the selectable logits in the block (``-inf`` if none); the newest block
    ``(length - 1) // block_size`` is pinned to ``+inf``; blocks are ranked by (score descending,
    block id ascending) and those scoring ``-inf`` are never chosen. Output: chosen ids ascending,
    then ``-1``.
    """
    num_rows, width = logits.shape
    if out is None:
        out = torch.empty((num_rows, num_blocks_k), dtype=torch.int32, device=logits.device)
    num_blocks = -(-width // block_size)
    if num_rows == 0 or num_blocks == 0:
        return out.fill_(-1)
    scores = block_scores(logits, starts, ends, block_size, num_blocks, row_repeat)  # [R, NB]
    _, row_lengths = row_bounds(starts, ends, num_rows, row_repeat, width)
    block_ids = torch.arange(num_blocks, device=logits.device).expand(num_rows, num_blocks)
    # A row without context has newest block -1, which matches no block.
    newest_block = torch.div(row_lengths - 1, block_size, rounding_mode="floor")
    scores = torch.where(block_ids == newest_block[:, None], float("inf"), scores)
    chosen = top_ids_ascending(composite_key(scores, block_ids), block_ids, num_blocks_k)
    return out.copy_(chosen)


def apply_candidate_mask_reference(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    candidate_blocks: torch.Tensor,
    block_size: int,
    row_repeat: int,
) -> None:
    """In place: ``-inf`` in every column of ``logits [R, C]`` outside ``[starts, ends)`` or outside
    the blocks listed in ``candidate_blocks [R, K]`` (negative ids and ids past the row are ignored).
    """
    num_rows, width = logits.shape
    if num_rows == 0 or width == 0:
        return
    row_starts, row_lengths = row_bounds(starts, ends, num_rows, row_repeat, width)
    num_blocks = -(-width // block_size)
    ids = candidate_blocks.to(torch.int64)
    # Ids that name no block of the logits land in the spare flag slot num_blocks, never read.
    flag_slot = torch.where((ids >= 0) & (ids < num_blocks), ids, num_blocks)
    listed = torch.zeros((num_rows, num_blocks + 1), dtype=torch.bool, device=logits.device)
    listed.scatter_(1, flag_slot, True)
    relative = torch.arange(width, device=logits.device)[None, :] - row_starts[:, None]  # [R, C]
    in_row = (relative >= 0) & (relative < row_lengths[:, None])
    block = torch.div(relative.clamp_min(0), block_size, rounding_mode="floor")
    keep = in_row & listed.gather(1, block)
    logits.masked_fill_(~keep, float("-inf"))
