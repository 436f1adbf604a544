"""Argument checks shared by the dense (``ops.logits``) and sparse (``ops.sparse_logits``) logits ops."""

from __future__ import annotations

import torch

from ..._validation import check_tensor
from ...cache_layout import KCacheLayout
from ...formats import FP8_DTYPE


def decode_row_lengths(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """Per-row visible lengths ``[B, next_n]`` int64 from ``context_lens [B]`` (request length
    ``L``: row ``t`` sees ``max(L - next_n + t + 1, 0)``) or ``[B, next_n]`` (taken as is)."""
    lengths = context_lens.long()
    if lengths.dim() == 2:
        return lengths
    offsets = torch.arange(1 - next_n, 1, device=lengths.device)
    return (lengths[:, None] + offsets).clamp_min(0)


def key_format(q) -> str:
    """``"fp8"`` or ``"mxfp4"`` from the dtype of ``q`` (float8_e4m3fn or uint8)."""
    check_tensor("q", q, dtype=(FP8_DTYPE, torch.uint8))
    return "fp8" if q.dtype == FP8_DTYPE else "mxfp4"


def check_q_scale(q_scale, fmt: str, expected_shape: tuple[int, ...]) -> None:
    """FP8: ``q_scale`` is None (folded into the weights); MXFP4: uint8 of ``expected_shape``."""
    if fmt == "fp8":
        if q_scale is not None:
            raise TypeError(
                "q_scale must be None for FP8 q (the Q scale is folded into weights), "
                f"got {type(q_scale).__name__}"
            )
        return
    check_tensor("q_scale", q_scale, dtype=torch.uint8, shape=expected_shape)


def check_decode_lengths(
    context_lens: torch.Tensor, block_table: torch.Tensor, next_n: int, max_context_len: int, cache
) -> None:
    """Lengths are non-negative, fit ``max_context_len`` and the block table, and every page a row
    reads is a page of the cache; one host synchronisation."""
    row_lengths = decode_row_lengths(context_lens, next_n)  # [B, next_n]
    max_blocks = block_table.shape[1]
    table_capacity = max_blocks * cache.block_size
    pages_read = -(-row_lengths.amax(dim=1, keepdim=True) // cache.block_size)  # [B, 1], ceil division
    read = torch.arange(max_blocks, device=block_table.device) < pages_read  # [B, max_blocks]
    outside_cache = read & ((block_table < 0) | (block_table >= cache.num_blocks))
    violations = torch.stack(
        [
            (context_lens < 0).any(),
            (row_lengths > max_context_len).any(),
            (row_lengths > table_capacity).any(),
            outside_cache.any(),
        ]
    ).tolist()
    if violations[0]:
        raise ValueError(f"context_lens must be >= 0, got minimum {int(context_lens.min())}")
    if violations[1]:
        raise ValueError(
            f"max_context_len must be >= every row's context length, got {max_context_len} "
            f"< {int(row_lengths.max())}"
        )
    if violations[2]:
        raise ValueError(
            f"block_table has {max_blocks} pages per request ({table_capacity} positions with block_size "
            f"{cache.block_size}), but context_lens reaches {int(row_lengths.max())}"
        )
    if violations[3]:
        request, column = (int(i) for i in torch.nonzero(outside_cache)[0])
        raise ValueError(
            f"block_table entries read must be in [0, {cache.num_blocks}) (the cache's pages), "
            f"got block_table[{request}, {column}] = {int(block_table[request, column])}"
        )


def nothing_to_read(cache: KCacheLayout, block_table: torch.Tensor, batch: int, max_context_len: int, clean: bool,
                     out: torch.Tensor) -> bool:
    """Whether a paged decode call reads no key (no rows or positions, an empty cache or table), shared by the
    Triton and Gluon launchers; with an empty cache or table and ``clean`` it fills ``out`` with ``-inf`` here
    (the public wrapper has checked that no row can then see a position)."""
    if batch == 0 or max_context_len == 0:
        return True
    if cache.num_blocks == 0 or block_table.shape[1] == 0:
        if clean:
            out.fill_(float("-inf"))
        return True
    return False
