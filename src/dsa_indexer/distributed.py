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

The collective parts — ``merge_topk_global``, ``select_candidate_blocks_dcp`` and the prefill context
parallel ``gather_prefill_k`` — run on any ``torch.distributed`` process group (gloo on CPU, NCCL on
GPUs) using only ``all_gather`` of equal-size tensors and ``all_reduce``. Each first exchanges a small
shape descriptor, so a mismatch between ranks raises the same ``ValueError`` on every rank instead of
hanging. ``torch.distributed`` is imported only when a collective runs.
"""

from __future__ import annotations

import torch

from . import backend as _backend
from ._validation import (
    check_index_tensor,
    check_k,
    check_positive_int,
    check_same_device,
    check_tensor,
    index_as_int32,
    value_checks_enabled,
)
from .ops._order import composite_key, top_ids_ascending

__all__ = [
    "gather_prefill_k",
    "global_to_local",
    "local_lengths",
    "local_to_global",
    "merge_topk_global",
    "pack_local_candidates",
    "select_candidate_blocks_dcp",
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


def _pack_local_candidates_triton(*args):
    from ._distributed_triton import pack_local_candidates_triton

    return pack_local_candidates_triton(*args)


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
        local_topk: ``[R, k]`` int32 or int64 local positions relative to ``starts`` (``-1`` padding),
            the output of the local top-k; values within the int32 range.
        rank, world_size, interleave: this rank's place in the sharding (see ``global_to_local``).
        starts: ``[R]`` int32 or int64 first column of each row (prefill chunks), or None for 0.
        backend: ``"auto" | "reference" | "triton"``.

    Returns:
        ``(scores float32 [R, k], global_ids int64 [R, k])`` with
        ``scores[r, j] = logits[r, starts[r] + l]`` and ``global_ids[r, j] = local_to_global(l)`` for
        ``l = local_topk[r, j]``; ``(-inf, -1)`` where ``l < 0`` or the column is outside ``[0, C)``
        (such entries are padding, not an error: checking them would cost a host synchronisation).
    """
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    check_index_tensor("local_topk", local_topk, shape=(logits.shape[0], None))
    _check_layout(world_size, interleave, rank)
    if starts is not None:
        check_index_tensor("starts", starts, shape=(logits.shape[0],))
    check_same_device(logits=logits, local_topk=local_topk, starts=starts)
    local_topk = index_as_int32("local_topk", local_topk)
    starts = None if starts is None else index_as_int32("starts", starts)
    triton_impl = _pack_local_candidates_triton if _backend.triton_available() else None
    impl = _backend.dispatch(_pack_local_candidates_reference, triton_impl, backend, logits.device)
    return impl(logits, local_topk, rank, world_size, interleave, starts)


def _select_global_topk_reference(
    scores: torch.Tensor, global_ids: torch.Tensor, k: int, out: torch.Tensor | None
) -> torch.Tensor:
    if out is None:
        out = torch.empty((scores.shape[0], k), dtype=torch.int32, device=scores.device)
    valid_id = (global_ids >= 0) & (global_ids <= _MAX_GLOBAL_ID)
    keys = composite_key(torch.where(valid_id, scores, float("-inf")), global_ids.clamp(0, _MAX_GLOBAL_ID))
    return out.copy_(top_ids_ascending(keys, global_ids, k))


def _select_global_topk_by_id_order(
    scores: torch.Tensor, global_ids: torch.Tensor, k: int, out: torch.Tensor | None
) -> torch.Tensor:
    """The same selection through the Triton top-k: candidates sorted by id become columns, so the
    top-k's tie rule (lower column) is the merge's (lower id) and its ascending columns are ascending
    ids. Everything stays on the device (no host reads), so it is graph-capturable."""
    from .ops.topk import topk

    num_rows = scores.shape[0]
    if out is None:
        out = torch.empty((num_rows, k), dtype=torch.int32, device=scores.device)
    valid_id = (global_ids >= 0) & (global_ids <= _MAX_GLOBAL_ID)
    ordered_ids, order = torch.where(valid_id, global_ids, _MAX_GLOBAL_ID + 1).sort(dim=1, stable=True)
    ordered_scores = torch.where(valid_id, scores, float("-inf")).gather(1, order)
    columns = topk(ordered_scores.contiguous(), k, backend="triton")
    picked = ordered_ids.gather(1, columns.clamp_min(0).to(torch.int64))
    return out.copy_(torch.where(columns >= 0, picked, -1))


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
        global_ids: ``[R, M]`` int64 (or int32) candidate global ids, unique per row apart from ``-1``.
        k: positions to select per row, ``1 <= k <= 2**31 - 1``.
        out: optional int32 ``[R, k]`` destination.
        backend: ``"auto" | "reference" | "triton"``.

    Returns:
        int32 ``[R, k]``: the global ids of the first ``min(k, #selectable)`` candidates by (score
        descending, global id ascending), ascending, then ``-1``. A candidate is selectable unless
        its score is NaN or ``-inf`` or its id is outside ``[0, 2**31)`` (``-1`` is padding).
    """
    check_tensor("scores", scores, dtype=torch.float32, ndim=2)
    check_index_tensor("global_ids", global_ids, shape=scores.shape)
    check_k("k", k)
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, shape=(scores.shape[0], k))
    check_same_device(scores=scores, global_ids=global_ids, out=out)
    # Ids are int64 here (not int32): ids past 2**31 - 1 are valid input that is never selectable.
    global_ids = global_ids.to(torch.int64)
    triton_impl = _select_global_topk_by_id_order if _backend.triton_available() else None
    impl = _backend.dispatch(_select_global_topk_reference, triton_impl, backend, scores.device)
    return impl(scores, global_ids, k, out)


def _group_layout(group) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group`` (None: the default group); a clear error without one."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call init_process_group first)")
    return dist.get_rank(group), dist.get_world_size(group)


def _agree_on(group, what: str, descriptor: list[int], local_error: Exception | None = None) -> None:
    """Collective argument check: every rank contributes an error flag and a fixed-length int descriptor.

    If any rank's own checks failed, or the descriptors differ, every rank raises the same kind of
    ``ValueError`` — no rank is left waiting in a later collective. The exchange reads a device tensor
    on the host, so it is skipped where value checks are (CUDA-graph capture,
    ``DSA_INDEXER_SKIP_VALUE_CHECKS=1``): then only this rank's own error is raised.
    """
    import torch.distributed as dist

    if not value_checks_enabled():
        if local_error is not None:
            raise local_error
        return

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor([int(local_error is not None), *descriptor], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    rows = [t.tolist() for t in gathered]
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        detail = f": {local_error}" if local_error is not None else ""
        raise ValueError(f"{what}: rank(s) {failed} rejected their arguments{detail}") from local_error
    if len({tuple(row[1:]) for row in rows}) != 1:
        raise ValueError(f"{what} differ across ranks: {[row[1:] for row in rows]}")


def _local_check(check) -> Exception | None:
    """Run this rank's argument checks, keeping the error for the collective check."""
    try:
        check()
    except (ValueError, TypeError) as error:
        return error
    return None


def _all_gather_cat(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _all_gather_candidates(scores: torch.Tensor, global_ids: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``[R, k]`` candidates as ``[R, W * k]`` (rank-major), in one all-gather.

    Scores travel as their int32 bits beside int32 ids: ids above ``2**31 - 1`` (never selectable)
    travel as ``-1`` (padding), which the selection treats the same way.
    """
    import torch.distributed as dist

    ids = torch.where(global_ids <= _MAX_GLOBAL_ID, global_ids, -1).to(torch.int32)
    packed = torch.stack((scores.view(torch.int32), ids))
    parts = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, packed, group=group)
    rank_major = torch.stack(parts, dim=2).flatten(2)
    return rank_major[0].view(torch.float32), rank_major[1].to(torch.int64)


def merge_topk_global(
    logits: torch.Tensor,
    topk_indices: torch.Tensor,
    k: int,
    *,
    group=None,
    interleave: int = 1,
    starts: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Turn every rank's local top-k into the exact global top-k, in place (a collective).

    Args:
        logits: ``[R, C_local]`` float32 this rank's logits, as given to its local top-k.
        topk_indices: ``[R, k]`` int32 this rank's local top-k (positions relative to ``starts``,
            ascending, ``-1``-padded); overwritten with global request-local positions.
        k: positions per row; ``k <= W * topk_indices.shape[1]``.
        group: the DCP process group (None: the default group). Every rank calls with the same ``R``
            and ``k``; a world of one is a no-op.
        interleave: consecutive positions per rank in the sharding.
        starts: ``[R]`` int32 or int64 first column of each row (prefill chunks), None for 0.

    The result is bitwise equal to the top-k of the whole (unsharded) row.
    """
    rank, world_size = _group_layout(group)

    def check() -> None:
        check_tensor("logits", logits, dtype=torch.float32, ndim=2)
        check_tensor("topk_indices", topk_indices, dtype=torch.int32, shape=(logits.shape[0], None))
        check_positive_int("k", k)
        check_positive_int("interleave", interleave)
        if starts is not None:
            check_index_tensor("starts", starts, shape=(logits.shape[0],))
        if k > world_size * topk_indices.shape[1]:
            raise ValueError(f"k = {k} exceeds the {world_size} x {topk_indices.shape[1]} candidates the ranks contribute")
        if k != topk_indices.shape[1]:
            raise ValueError(f"topk_indices must have k = {k} columns to receive the merged ids, got {topk_indices.shape[1]}")

    error = _local_check(check)
    if world_size == 1:
        if error is not None:
            raise error
        return
    descriptor = [-1, -1, -1] if error else [logits.shape[0], topk_indices.shape[1], interleave]
    _agree_on(group, "merge_topk_global arguments [rows, k, interleave]", descriptor, error)
    scores, global_ids = pack_local_candidates(logits, topk_indices, rank, world_size, interleave, starts, backend=backend)
    all_scores, all_ids = _all_gather_candidates(scores, global_ids, group)
    select_global_topk(all_scores, all_ids, k, out=topk_indices, backend=backend)


def select_candidate_blocks_dcp(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    num_blocks_k: int,
    global_block_size: int,
    *,
    global_ends: torch.Tensor,
    max_global_blocks: int,
    group=None,
    row_repeat: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """V4.1 candidate blocks of a DCP-sharded row (a collective; interleave 1 only).

    With interleave 1 and ``global_block_size`` divisible by ``W``, local block ``b`` (of
    ``global_block_size // W`` local positions) is exactly this rank's share of global block ``b``, so
    the global block score is the MAX over ranks of the local ones. The newest block is pinned from
    the global row length ``global_ends [R'] int32`` (``(global_end - 1) // global_block_size``; rows
    with no context pin nothing). Every rank calls with the same rows and ``max_global_blocks``, also
    with an empty shard. Returns int32 ``[R, num_blocks_k]`` global block ids, ascending, ``-1``-padded.
    """
    import torch.distributed as dist

    from .ops._order import composite_key, top_ids_ascending
    from .ops.candidates.reference import block_scores

    _, world_size = _group_layout(group)

    def check() -> None:
        check_tensor("logits", logits, dtype=torch.float32, ndim=2)
        check_positive_int("num_blocks_k", num_blocks_k)
        check_positive_int("global_block_size", global_block_size)
        check_positive_int("max_global_blocks", max_global_blocks, minimum=0)
        check_index_tensor("global_ends", global_ends, ndim=1)
        if global_block_size % world_size:
            raise ValueError(
                f"global_block_size ({global_block_size}) must be a multiple of the DCP world size ({world_size})"
            )

    error = _local_check(check)
    descriptor = [-1, -1, -1] if error else [logits.shape[0], max_global_blocks, num_blocks_k]
    if world_size > 1:
        _agree_on(group, "select_candidate_blocks_dcp arguments [rows, max_global_blocks, num_blocks_k]",
                  descriptor, error)
    elif error is not None:
        raise error
    num_rows = logits.shape[0]
    scores = block_scores(logits, starts, ends, global_block_size // world_size, max_global_blocks, row_repeat)
    if world_size > 1:
        dist.all_reduce(scores, op=dist.ReduceOp.MAX, group=group)
    block_ids = torch.arange(max_global_blocks, device=logits.device).expand(num_rows, max_global_blocks)
    bound_index = torch.arange(num_rows, device=logits.device) // row_repeat
    newest = torch.div(global_ends.to(torch.int64)[bound_index] - 1, global_block_size, rounding_mode="floor")
    scores = torch.where(block_ids == newest[:, None], float("inf"), scores)
    chosen = top_ids_ascending(composite_key(scores, block_ids), block_ids, num_blocks_k)
    if out is None:
        out = torch.empty((num_rows, num_blocks_k), dtype=torch.int32, device=logits.device)
    return out.copy_(chosen)


def gather_prefill_k(
    k: torch.Tensor, slot_mapping: torch.Tensor, num_decode_tokens: int, *, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill context parallelism: every rank receives the whole prompt's keys (a collective).

    Args:
        k: ``[T, D]`` this rank's keys: its ``num_decode_tokens`` decode tokens first, then its share of
            the prefill tokens (padded so that every rank holds the same number of rows).
        slot_mapping: ``[T]`` int64 slots of those rows (``-1`` for padding).
        num_decode_tokens: decode rows, which stay local.
        group: the PCP process group (None: the default group).

    Returns:
        ``(k_all, slots_all)``: the decode rows, then every rank's prefill rows in rank order, ready for
        ``insert_k`` into this rank's replicated cache.
    """
    _, world_size = _group_layout(group)

    def check() -> None:
        check_tensor("k", k, ndim=2)
        check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(k.shape[0],))
        check_positive_int("num_decode_tokens", num_decode_tokens, minimum=0)
        if num_decode_tokens > k.shape[0]:
            raise ValueError(f"num_decode_tokens ({num_decode_tokens}) exceeds the {k.shape[0]} rows of k")

    error = _local_check(check)
    if world_size == 1:
        if error is not None:
            raise error
        return k, slot_mapping
    descriptor = [-1, -1] if error else [k.shape[0] - num_decode_tokens, k.shape[1]]
    _agree_on(group, "gather_prefill_k prefill shapes [rows, head_dim] (pad every rank to the same count)",
              descriptor, error)
    k_all = torch.cat([k[:num_decode_tokens], _all_gather_cat(k[num_decode_tokens:], group, dim=0)])
    slots_all = torch.cat(
        [slot_mapping[:num_decode_tokens], _all_gather_cat(slot_mapping[num_decode_tokens:], group, dim=0)]
    )
    return k_all, slots_all
