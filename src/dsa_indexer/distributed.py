"""Decode context parallelism (DCP, DESIGN §8): position mapping and the pieces of the exact merge.

The KV of a request is sharded over ``W`` ranks with interleave ``I``: global position ``g`` lives on
rank ``(g // I) % W`` at local index ``(g // (I * W)) * I + g % I``. Each rank scores and selects
its own shard, then the exact merge turns the local top-k into the global one:

1. ``pack_local_candidates``: each rank's local top-k as ``(score, global id)``;
2. an ``all_gather`` along dim 1 (equal-size tensors) gives every rank the ``W * k`` candidates;
3. ``select_global_topk``: the top k of those under the §6 order (score descending, global id
   ascending), output ascending.

A key in the global top-k has fewer than k keys above it globally, hence fewer than k on its own
rank, so it is in its rank's local top-k: the merge equals a top-k over the whole row. The local
top-k must break ties toward the lower local index (the §6 order does); since the global id grows
with the local id on one rank, the tie choices then agree too. Ids travel as integers, never floats.

Everything here works without a process group; nothing imports ``torch.distributed``.
"""

from __future__ import annotations

import torch

from . import backend as _backend
from ._validation import check_index_tensor, check_positive_int, check_same_device, check_tensor
from .ops._order import composite_key
from .ops._order import top_ids_ascending

__all__ = [
    "global_to_local",
    "local_lengths",
    "local_to_global",
    "pack_local_candidates",
    "select_global_topk",
]

# Merged ids are reported as int32: anything outside this range is not a valid global position.
_MAX_GLOBAL_ID = torch.iinfo(torch.int32).max


def _check_layout(world_size: int, interleave: int, rank: int | None = None) -> None:
    check_positive_int("world_size", world_size)
    check_positive_int("interleave", interleave)
    if rank is not None:
        check_positive_int("rank", rank, minimum=0)
        if rank >= world_size:
            raise ValueError(f"rank must be < world_size = {world_size}, got {rank}")


def _local_to_global(local_pos: torch.Tensor, rank: int, world_size: int, interleave: int) -> torch.Tensor:
    """int64 global ids of int64 local positions; negative positions give -1."""
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
    _check_layout(world_size, interleave)
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
    _check_layout(world_size, interleave, rank)
    return _local_to_global(local_pos.to(torch.int64), rank, world_size, interleave).to(local_pos.dtype)


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
    _check_layout(world_size, interleave, rank)
    length = global_lengths.to(torch.int64).clamp_min(0)
    span = interleave * world_size
    partial = (length % span - rank * interleave).clamp(0, interleave)
    return ((length // span) * interleave + partial).to(global_lengths.dtype)


def _pack_local_candidates_reference(
    logits: torch.Tensor,
    local_topk: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int,
    starts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows, width = logits.shape
    local_pos = local_topk.to(torch.int64)
    column = local_pos if starts is None else local_pos + starts.to(torch.int64)[:, None]
    valid = (local_pos >= 0) & (column >= 0) & (column < width)
    if width == 0:
        scores = torch.full(local_pos.shape, float("-inf"), dtype=torch.float32, device=logits.device)
    else:
        scores = logits.gather(1, column.clamp(0, width - 1))
        scores = torch.where(valid, scores, float("-inf"))
    global_ids = torch.where(valid, _local_to_global(local_pos, rank, world_size, interleave), -1)
    return scores, global_ids


def pack_local_candidates(
    logits: torch.Tensor,
    local_topk: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int,
    starts: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's local top-k as ``(score, global id)`` candidates for the exact merge.

    Args:
        logits: ``[R, C]`` float32 local logits (any strides), as given to the local top-k.
        local_topk: ``[R, k]`` int32 local positions relative to ``starts`` (``-1`` padding), the
            output of the local top-k.
        rank, world_size, interleave: this rank's place in the sharding (see ``global_to_local``).
        starts: ``[R]`` int32 first column of each row (prefill chunks), or None for 0.
        backend: ``"auto" | "reference" | "triton"``.

    Returns:
        ``(scores float32 [R, k], global_ids int64 [R, k])`` with
        ``scores[r, j] = logits[r, starts[r] + l]`` and ``global_ids[r, j] = local_to_global(l)`` for
        ``l = local_topk[r, j]``; ``(-inf, -1)`` where ``l < 0`` or the column is outside ``[0, C)``
        (such entries are padding, not an error: checking them would cost a host synchronisation).
    """
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    check_tensor("local_topk", local_topk, dtype=torch.int32, shape=(logits.shape[0], None))
    _check_layout(world_size, interleave, rank)
    if starts is not None:
        check_tensor("starts", starts, dtype=torch.int32, shape=(logits.shape[0],))
    check_same_device(logits=logits, local_topk=local_topk, starts=starts)
    impl = _backend.dispatch(_pack_local_candidates_reference, None, backend, logits.device)
    return impl(logits, local_topk, rank, world_size, interleave, starts)


def _select_global_topk_reference(
    scores: torch.Tensor, global_ids: torch.Tensor, k: int, out: torch.Tensor | None
) -> torch.Tensor:
    if out is None:
        out = torch.empty((scores.shape[0], k), dtype=torch.int32, device=scores.device)
    valid_id = (global_ids >= 0) & (global_ids <= _MAX_GLOBAL_ID)
    keys = composite_key(torch.where(valid_id, scores, float("-inf")), global_ids.clamp(0, _MAX_GLOBAL_ID))
    return out.copy_(top_ids_ascending(keys, global_ids, k))


def select_global_topk(
    scores: torch.Tensor,
    global_ids: torch.Tensor,
    k: int,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The global top-k from the gathered candidates of all ranks.

    Args:
        scores: ``[R, M]`` float32 candidate scores (``M = W * k`` after the all-gather).
        global_ids: ``[R, M]`` int64 candidate global ids, unique per row apart from ``-1``.
        k: positions to select per row (>= 1).
        out: optional int32 ``[R, k]`` destination.
        backend: ``"auto" | "reference" | "triton"``.

    Returns:
        int32 ``[R, k]``: the global ids of the first ``min(k, #selectable)`` candidates by (score
        descending, global id ascending), ascending, then ``-1``. A candidate is selectable unless
        its score is NaN or ``-inf`` or its id is outside ``[0, 2**31)`` (``-1`` is padding).
    """
    check_tensor("scores", scores, dtype=torch.float32, ndim=2)
    check_tensor("global_ids", global_ids, dtype=torch.int64, shape=scores.shape)
    check_positive_int("k", k)
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, shape=(scores.shape[0], k))
    check_same_device(scores=scores, global_ids=global_ids, out=out)
    impl = _backend.dispatch(_select_global_topk_reference, None, backend, scores.device)
    return impl(scores, global_ids, k, out)
