"""PyTorch reference of the sparse logits family: the logits of each row's candidate blocks only.

Column ``j * block + o`` of row ``r`` scores the row-relative position ``blocks[r, j] * block + o``
(prefill: gathered key ``ks[r] + that``; decode: request-local position ``that``). A column is *live*
when its block id is ``>= 0``, greater than the entry before it (a repeat of the previous id is
padding) and its position is inside the row's visible range; every other column is ``-inf``.

The per-logit arithmetic is the dense reference's (``logits.reference.weighted_relu_head_sum``: one
matmul over ``D``, relu, weights, a sum over heads, then the FP8 key scale), on the gathered keys of the
listed blocks. Arguments are assumed validated by the public wrappers in ``__init__.py``.
"""

from __future__ import annotations

import torch

from ...cache_layout import KCacheLayout
from ...formats import FP8_DTYPE, ue8m0_to_fp32
from ..common.logits_checks import decode_row_lengths
from ..logits.reference import (
    INTERMEDIATE_BUDGET_BYTES,
    decode_keys,
    decode_queries,
    weighted_relu_head_sum,
)

_FP32_BYTES = 4


def column_positions(blocks: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks [R, nb]`` int32 -> (int64 ``[R, nb * block_size]`` row-relative position of each column,
    bool ``[R, nb * block_size]`` whether its block entry is live: ``>= 0`` and greater than the previous
    entry of the row)."""
    ids = blocks.long()
    previous = torch.cat([torch.full_like(ids[:, :1], -1), ids[:, :-1]], dim=1)
    live_block = (ids >= 0) & (ids > previous)
    offsets = torch.arange(block_size, device=blocks.device)
    positions = (ids[:, :, None] * block_size + offsets).flatten(1)
    return positions, live_block.repeat_interleave(block_size, dim=1)


def _rows_per_chunk(columns: int, heads: int, dim: int, budget_bytes: int) -> int:
    """Rows whose gathered keys ``[columns, D]`` and scores ``[H, columns]`` fit the budget (>= 1)."""
    per_row = (columns * (dim + heads + 2) + heads * dim) * _FP32_BYTES
    return max(1, budget_bytes // max(per_row, 1))


def sparse_mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
    *,
    budget_bytes: int = INTERMEDIATE_BUDGET_BYTES,
) -> torch.Tensor:
    """Sparse prefill logits into ``out [M, nb * block_size]`` (fp32 or bf16).

    ``q [M, H, D]`` e4m3 / ``[M, H, D/2]`` packed e2m1 (+ ``q_scale``), ``k [N, ...]`` gathered keys with
    ``k_scale``, ``weights [M, H]``; row ``i`` sees keys ``[ks[i], ke[i])``; column ``j * block_size + o``
    scores key ``ks[i] + blocks[i, j] * block_size + o``.
    """
    num_rows, heads = weights.shape
    num_cols = out.shape[1]
    if num_rows == 0 or num_cols == 0:
        return out
    num_keys = k.shape[0]
    dim = q.shape[-1] * (1 if q.dtype == FP8_DTYPE else 2)
    step = _rows_per_chunk(num_cols, heads, dim, budget_bytes)
    for start in range(0, num_rows, step):
        rows = slice(start, min(start + step, num_rows))
        positions, live = column_positions(blocks[rows], block_size)  # [r, C]
        # Windows clamped into [0, num_keys], as in the kernel (unchecked bounds: value checks off).
        first = ks[rows].long().clamp(0, num_keys)[:, None]
        length = ke[rows].long().clamp(max=num_keys)[:, None] - first
        valid = live & (positions >= 0) & (positions < length)
        index = torch.where(valid, first + positions, 0)
        if num_keys == 0:
            out[rows] = float("-inf")
            continue
        keys, key_scales = decode_keys(k[index], k_scale[index])  # [r, C, D], [r, C] | None
        queries = decode_queries(q[rows], None if q_scale is None else q_scale[rows])  # [r, H, D]
        logits = weighted_relu_head_sum(queries[:, None], keys, weights[rows][:, None], key_scales)[:, 0]
        out[rows] = torch.where(valid, logits, float("-inf")).to(out.dtype)
    return out


def sparse_paged_mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    cache: KCacheLayout,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
    *,
    budget_bytes: int = INTERMEDIATE_BUDGET_BYTES,
) -> torch.Tensor:
    """Sparse paged decode logits into ``out [B * next_n, nb * block_size]`` (fp32 or bf16).

    Row ``b * next_n + t`` (``q [B, next_n, H, ...]``, ``weights [B * next_n, H]``) sees request-local
    positions ``p < len[b, t]`` (``decode_row_lengths``); column ``j * block_size + o`` scores position
    ``blocks[row, j] * block_size + o``, read from token ``p % page`` of page ``block_table[b, p // page]``.
    The pages of dead columns are never dereferenced: their gathers go to entry 0 of the row and page 0,
    and are masked.
    """
    batch, next_n = q.shape[:2]
    heads = weights.shape[1]
    num_rows, num_cols = out.shape
    if num_rows == 0 or num_cols == 0:
        return out
    if cache.num_blocks == 0 or block_table.shape[1] == 0:
        return out.fill_(float("-inf"))
    page = cache.block_size
    row_lengths = decode_row_lengths(context_lens, next_n).reshape(-1)  # [B * next_n]
    flat_q = q.reshape(batch * next_n, *q.shape[2:])
    flat_scale = None if q_scale is None else q_scale.reshape(batch * next_n, *q_scale.shape[2:])
    values_pages, scales_pages = cache.values_view(), cache.scales_view()
    step = _rows_per_chunk(num_cols, heads, cache.head_dim, budget_bytes)
    for start in range(0, num_rows, step):
        rows = torch.arange(start, min(start + step, num_rows), device=q.device)
        positions, live = column_positions(blocks[rows], block_size)  # [r, C]
        valid = live & (positions >= 0) & (positions < row_lengths[rows, None])
        # Unchecked metadata (value checks off), as in the kernel: positions past the table's pages are past
        # the row's end, and a page id outside the cache reads as zero bytes.
        valid &= positions < block_table.shape[1] * page
        page_column = torch.where(valid, positions // page, 0)
        pages = torch.where(valid, block_table[rows // next_n].long().gather(1, page_column), -1)
        readable = (pages >= 0) & (pages < cache.num_blocks)
        pages = torch.where(readable, pages, 0)
        slots = torch.where(valid, positions % page, 0)
        value_bytes = values_pages[pages, slots] * readable[..., None]
        scale_bytes = scales_pages[pages, slots] * readable[..., None]
        if cache.fmt == "fp8":
            # Four bytes per token: the little-endian fp32 scale, or four equal ue8m0 bytes (mxfp8).
            if cache.scale_fmt == "mxfp8":
                scale_bytes = ue8m0_to_fp32(scale_bytes[..., 0])
            else:
                scale_bytes = scale_bytes.view(torch.float32)[..., 0]
            value_bytes = value_bytes.view(FP8_DTYPE)
        keys, key_scales = decode_keys(value_bytes, scale_bytes)
        queries = decode_queries(flat_q[rows], None if flat_scale is None else flat_scale[rows])
        logits = weighted_relu_head_sum(queries[:, None], keys, weights[rows][:, None], key_scales)[:, 0]
        out[rows] = torch.where(valid, logits, float("-inf")).to(out.dtype)
    return out


def columns_to_positions(columns: torch.Tensor, blocks: torch.Tensor, block_size: int,
                         out: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, k]`` sparse-logit columns (``-1`` padding) -> int32 row-relative positions
    ``blocks[r, c // block_size] * block_size + c % block_size`` (``-1`` stays ``-1``, and a column of a ``-1``
    entry gives ``-1``), into ``out``."""
    if blocks.shape[1] == 0:
        return out.fill_(-1)
    safe = columns.clamp_min(0).long()
    ids = blocks.long().gather(1, torch.div(safe, block_size, rounding_mode="floor"))
    positions = ids * block_size + safe % block_size
    return out.copy_(torch.where((columns >= 0) & (ids >= 0), positions, -1))
