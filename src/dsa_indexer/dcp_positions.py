"""Decode context parallelism's position math: where a global position lives (pure index arithmetic).

The KV of a request is sharded over ``W`` ranks with interleave ``I``: global position ``g`` lives on
rank ``(g // I) % W`` at local index ``(g // (I * W)) * I + g % I``. Nothing here communicates.
"""

from __future__ import annotations

import torch

from ._validation import check_index_tensor, check_positive_int

__all__ = ["MAX_GLOBAL_ID", "check_layout", "global_to_local", "local_lengths", "local_to_global", "to_global_int64"]

# Merged ids are reported as int32: anything outside this range is not a valid global position.
MAX_GLOBAL_ID = torch.iinfo(torch.int32).max


def check_layout(world_size: int, interleave: int, rank: int | None = None) -> None:
    """``world_size >= 1``, ``interleave >= 1`` and, given, ``0 <= rank < world_size``."""
    check_positive_int("world_size", world_size)
    check_positive_int("interleave", interleave)
    if rank is not None:
        check_positive_int("rank", rank, minimum=0)
        if rank >= world_size:
            raise ValueError(f"rank must be < world_size = {world_size}, got {rank}")


def to_global_int64(local_pos: torch.Tensor, rank: int, world_size: int, interleave: int) -> torch.Tensor:
    """int64 global ids of int64 local positions (no checks); negative positions give -1."""
    global_pos = (local_pos // interleave) * (interleave * world_size) + rank * interleave + local_pos % interleave
    return torch.where(local_pos >= 0, global_pos, -1)


def global_to_local(
    global_pos: torch.Tensor, world_size: int, interleave: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Owner and local index of global positions.

    Args:
        global_pos: int32/int64 tensor of any shape; negative entries are padding.
        world_size: ranks W (>= 1).
        interleave: consecutive positions per rank I (>= 1).

    Returns:
        ``(rank, local_pos)``, both of ``global_pos``'s shape and dtype: ``rank = (g // I) % W``,
        ``local_pos = (g // (I * W)) * I + g % I``; ``(-1, -1)`` where ``g < 0``.
    """
    check_index_tensor("global_pos", global_pos)
    check_layout(world_size, interleave)
    position = global_pos.to(torch.int64)
    chunk = position // interleave
    rank = torch.where(position >= 0, chunk % world_size, -1)
    local_pos = torch.where(position >= 0, (chunk // world_size) * interleave + position % interleave, -1)
    return rank.to(global_pos.dtype), local_pos.to(global_pos.dtype)


def local_to_global(local_pos: torch.Tensor, rank: int, world_size: int, interleave: int) -> torch.Tensor:
    """Global positions of ``rank``'s local positions (inverse of ``global_to_local``).

    Args:
        local_pos: int32/int64 tensor of any shape; negative entries are padding.
        rank: the owning rank, ``0 <= rank < world_size``.
        world_size, interleave: as for ``global_to_local``.

    Returns:
        ``(l // I) * (I * W) + rank * I + l % I`` with ``local_pos``'s shape and dtype; ``-1`` where
        ``l < 0``.
    """
    check_index_tensor("local_pos", local_pos)
    check_layout(world_size, interleave, rank)
    return to_global_int64(local_pos.to(torch.int64), rank, world_size, interleave).to(local_pos.dtype)


def local_lengths(global_lengths: torch.Tensor, rank: int, world_size: int, interleave: int) -> torch.Tensor:
    """How many of the positions ``[0, L)`` of each length ``L`` live on ``rank``.

    Args:
        global_lengths: int32/int64 tensor of any shape (negative lengths count as 0).
        rank, world_size, interleave: as for ``local_to_global``.

    Returns:
        Same shape and dtype: ``(L // (I * W)) * I + clamp(L % (I * W) - rank * I, 0, I)``, exact for
        every ``L >= 0``.
    """
    check_index_tensor("global_lengths", global_lengths)
    check_layout(world_size, interleave, rank)
    length = global_lengths.to(torch.int64).clamp_min(0)
    span = interleave * world_size
    partial = (length % span - rank * interleave).clamp(0, interleave)
    return ((length // span) * interleave + partial).to(global_lengths.dtype)
