"""PyTorch reference of the top-k family (DESIGN.md §6): the definition every backend must match.

Selection ranks each entry by its int64 composite key (``ops/_order.py``): value descending, then
column ascending, NaN and ``-inf`` unselectable. Selectable keys are unique within a row, so
``torch.topk`` over them picks exactly the contract's set, whatever its internal tie handling.
Arguments are assumed validated by the public wrappers in ``__init__.py``.
"""

from __future__ import annotations

import torch

from .._order import UNSELECTABLE, composite_key

# Rows are processed in chunks holding at most this many int64 keys (128 MiB), so the working set
# stays bounded for [2048, 131072]-sized calls; one row is always processed whole.
KEY_ELEMENTS_PER_CHUNK = 1 << 24


def topk(
    logits: torch.Tensor,
    k: int,
    starts: torch.Tensor | None,
    ends: torch.Tensor | None,
    out: torch.Tensor,
    *,
    max_chunk_elements: int = KEY_ELEMENTS_PER_CHUNK,
) -> torch.Tensor:
    """Exact per-row top-k of ``logits [R, C]`` fp32 (any strides) into ``out [R, k]`` int32.

    Row ``r`` considers columns ``[starts[r], ends[r])`` (``None``: ``0`` and ``C``); ``out[r]``
    receives the selected columns minus ``starts[r]``, ascending, then ``-1`` up to ``k``.
    Columns outside the window only ever meet a mask, so their contents cannot change the result.
    Bounds are clamped into ``[0, width]`` as the kernels clamp them (validated bounds are unchanged).
    """
    num_rows, width = logits.shape
    if starts is not None:
        starts = starts.clamp(0, width)
    if ends is not None:
        ends = ends.clamp(0, width) if starts is None else torch.maximum(ends, starts).clamp(max=width)
    picks_per_row = min(k, width)
    out[:, picks_per_row:] = -1
    if picks_per_row == 0 or num_rows == 0:
        return out
    columns = torch.arange(width, device=logits.device)
    rows_per_chunk = max(1, max_chunk_elements // width)
    for first in range(0, num_rows, rows_per_chunk):
        last = min(first + rows_per_chunk, num_rows)
        keys = composite_key(logits[first:last], columns)  # [n, C] int64
        row_starts = 0
        if starts is not None:
            row_starts = starts[first:last, None]  # [n, 1]
            keys.masked_fill_(columns < row_starts, UNSELECTABLE)
        if ends is not None:
            keys.masked_fill_(columns >= ends[first:last, None], UNSELECTABLE)
        top_keys, top_columns = torch.topk(keys, picks_per_row, dim=1, sorted=False)  # [n, picks]
        # Unselectable picks become `width`, which sorts after every real column and marks padding.
        chosen = torch.where(top_keys != UNSELECTABLE, top_columns, width).sort(dim=1).values
        out[first:last, :picks_per_row] = torch.where(chosen < width, chosen - row_starts, -1)
    return out


def decode_row_ends(seq_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """int32 ``[B * next_n]`` visible lengths of the decode rows.

    1-D ``seq_lens [B]`` holds request lengths ``L_b``: row ``t`` of request ``b`` sees
    ``max(L_b - next_n + t + 1, 0)`` positions. 2-D ``seq_lens [B, next_n]`` gives each row's length.
    """
    if seq_lens.dim() == 2:
        return seq_lens.reshape(-1).to(torch.int32)
    offsets = torch.arange(1 - next_n, 1, device=seq_lens.device, dtype=torch.int64)  # [next_n]
    ends = (seq_lens.to(torch.int64)[:, None] + offsets).clamp_min(0)  # [B, next_n]
    return ends.reshape(-1).to(torch.int32)


def topk_decode(
    logits: torch.Tensor, seq_lens: torch.Tensor, next_n: int, k: int, out: torch.Tensor
) -> torch.Tensor:
    """``topk`` of decode rows ``logits [B * next_n, C]`` with ``starts = 0`` and ends from ``seq_lens``."""
    return topk(logits, k, None, decode_row_ends(seq_lens, next_n), out)


def indices_to_slots(
    indices: torch.Tensor, block_table: torch.Tensor, block_size: int, row_to_request: torch.Tensor
) -> torch.Tensor:
    """Map request-local positions ``indices [R, k]`` to physical cache slots, int32 ``[R, k]``.

    Position ``p`` of row ``r`` lives in page ``block_table[row_to_request[r], p // block_size]`` at
    offset ``p % block_size``; ``-1`` stays ``-1``. Every other result is ``-1`` or a slot in
    ``[0, 2**31)``: a negative (unallocated) page id, a slot past the int32 range and, left unchecked
    (value checks off), a position past the table or a request outside it give ``-1`` without a read.
    """
    num_requests, max_blocks = block_table.shape
    positions = indices.to(torch.int64)
    requests = row_to_request.to(torch.int64)[:, None]  # [R, 1]
    page_index = positions // block_size
    readable = (positions >= 0) & (page_index < max_blocks) & (requests >= 0) & (requests < num_requests)  # [R, k]
    if max_blocks == 0 or num_requests == 0:
        return torch.full_like(indices, -1)
    pages = block_table.to(torch.int64)[torch.where(readable, requests, 0), torch.where(readable, page_index, 0)]
    slots = pages * block_size + positions % block_size
    return torch.where(readable & (pages >= 0) & (slots < 2**31), slots, -1).to(torch.int32)


def topk_decode_slots(
    logits: torch.Tensor, seq_lens: torch.Tensor, next_n: int, k: int, block_table: torch.Tensor, block_size: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """``topk_decode`` then ``indices_to_slots`` with row ``r`` of request ``r // next_n``, into ``out``."""
    positions = topk_decode(logits, seq_lens, next_n, k, torch.empty_like(out))
    requests = torch.arange(logits.shape[0], device=logits.device, dtype=torch.int32) // next_n
    return out.copy_(indices_to_slots(positions, block_table, block_size, requests))
