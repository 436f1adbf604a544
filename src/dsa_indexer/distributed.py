"""Decode context parallelism (DCP, DESIGN §8): position mapping and the pieces of the exact merge.

The KV of a request is sharded over ``W`` ranks with interleave ``I``: global position ``g`` lives on
rank ``(g // I) % W`` at local index ``(g // (I * W)) * I + g % I``. Each rank scores and selects
its own shard, then the exact merge (``merge_topk_global``) turns the local top-k into the global one:

1. ``pack_candidate_keys``: each rank's local top-k as one int64 word per candidate whose integer order
   is the §5 order (score descending, global id ascending);
2. one ``all_gather_into_tensor`` gives every rank the ``[W, R, k]`` words;
3. ``select_global_topk_keys``: the ids of each row's k largest words, ascending.

``pack_local_candidates`` and ``select_global_topk`` are the same steps on ``(score, global id)`` pairs.

A key in the global top-k has fewer than k keys above it globally, hence fewer than k on its own
rank, so it is in its rank's local top-k: the merge equals a top-k over the whole row. The local
top-k must break ties toward the lower local index (the §6 order does); since the global id grows
with the local id on one rank, the tie choices then agree too. Ids travel as integers, never floats.

The collective parts — ``merge_topk_global``, ``select_candidate_blocks_dcp`` and the prefill context
parallel ``gather_prefill_k`` — run on any ``torch.distributed`` process group (gloo on CPU, NCCL on
GPUs) using only all-gathers of equal-size tensors and ``all_reduce``. While value checks are enabled, each
first exchanges a small shape descriptor, so a mismatch between ranks raises the same ``ValueError`` on
every rank instead of hanging. ``torch.distributed`` is imported only when a collective runs.
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
    "DcpMergeWorkspace",
    "gather_prefill_k",
    "global_to_local",
    "local_lengths",
    "local_to_global",
    "merge_scored_topk_global",
    "merge_topk_global",
    "pack_candidate_keys",
    "pack_local_candidates",
    "select_candidate_blocks_dcp",
    "select_global_topk",
    "select_global_topk_keys",
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


def _pack_candidate_keys_reference(
    logits: torch.Tensor,
    local_topk: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int,
    starts: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    scores, global_ids = _pack_local_candidates_reference(logits, local_topk, rank, world_size, interleave, starts)
    valid_id = (global_ids >= 0) & (global_ids <= _MAX_GLOBAL_ID)
    return out.copy_(composite_key(torch.where(valid_id, scores, float("-inf")), global_ids.clamp(0, _MAX_GLOBAL_ID)))


def _pack_candidate_keys_triton(*args):
    from ._distributed_triton import pack_candidate_keys_triton

    return pack_candidate_keys_triton(*args)


def pack_candidate_keys(
    logits: torch.Tensor,
    local_topk: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int,
    starts: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """This rank's local top-k as one int64 order key per candidate (the fused merge's payload).

    Args:
        logits, local_topk, rank, world_size, interleave, starts: as for ``pack_local_candidates``.
        out: optional contiguous int64 ``[R, k]`` destination.
        backend: ``"auto" | "reference" | "triton"``.

    Returns:
        int64 ``[R, k]``: ``composite_key(score, global id)`` of ``ops/_order.py``, i.e. the score's order
        key in the high 32 bits and ``2**32 - 1 - id`` in the low ones, so that integer order is the §5
        order (score descending, then id ascending); ``UNSELECTABLE`` (``-2**63``) where the pair of
        ``pack_local_candidates`` is unselectable (NaN or ``-inf`` score, padding) or the id is ``>= 2**31``.
    """
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    check_tensor("local_topk", local_topk, dtype=torch.int32, shape=(logits.shape[0], None))
    _check_layout(world_size, interleave, rank)
    if starts is not None:
        check_tensor("starts", starts, dtype=torch.int32, shape=(logits.shape[0],))
    if out is None:
        out = torch.empty(local_topk.shape, dtype=torch.int64, device=logits.device)
    check_tensor("out", out, dtype=torch.int64, shape=local_topk.shape)
    if not out.is_contiguous():
        raise ValueError("out must be contiguous (it is the all-gather's send buffer)")
    check_same_device(logits=logits, local_topk=local_topk, starts=starts, out=out)
    triton_impl = _pack_candidate_keys_triton if _backend.triton_available() else None
    impl = _backend.dispatch(_pack_candidate_keys_reference, triton_impl, backend, logits.device)
    return impl(logits, local_topk, rank, world_size, interleave, starts, out)


def _select_global_topk_keys_reference(keys: torch.Tensor, k: int, out: torch.Tensor, scratch) -> torch.Tensor:
    world_size, num_rows, width = keys.shape
    row_keys = keys.permute(1, 0, 2).reshape(num_rows, world_size * width)
    ids = 0xFFFFFFFF - (row_keys & 0xFFFFFFFF)
    return out.copy_(top_ids_ascending(row_keys, ids, k))


def _select_global_topk_keys_triton(*args):
    from ._distributed_triton import select_global_topk_keys_triton

    return select_global_topk_keys_triton(*args)


def select_global_topk_keys(
    keys: torch.Tensor,
    k: int,
    *,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The global top-k from every rank's packed candidate keys (the fused merge's select).

    Args:
        keys: int64 ``[W, R, k_in]`` (each ``[R, k_in]`` slab row-contiguous), rank ``w``'s
            ``pack_candidate_keys`` in slab ``w``: the all-gather's output. Within a slab row the
            selectable candidates must come in ascending id order, as a local top-k's ascending
            positions give them (the Triton kernel relies on it to emit ids in order without a sort).
        k: positions to select per row (>= 1, ``<= W * k_in``).
        out: optional int32 ``[R, k]`` destination (any strides).
        scratch: optional int32 workspace of at least ``R * W * k_in`` elements (the Triton kernel's
            per-rank lists; allocated when None).
        backend: ``"auto" | "reference" | "triton"``.

    Returns:
        int32 ``[R, k]``: the ids (``2**32 - 1 - low word``) of the ``min(k, #selectable)`` largest
        selectable keys of each row, ascending, then ``-1``: exactly ``select_global_topk`` of the
        unpacked pairs.
    """
    check_tensor("keys", keys, dtype=torch.int64, ndim=3)
    check_positive_int("k", k)
    world_size, num_rows, width = keys.shape
    if k > world_size * width:
        raise ValueError(f"k = {k} exceeds the {world_size} x {width} candidates of keys")
    if keys.stride(2) != 1 or keys.stride(1) != width:
        raise ValueError("keys must have row-contiguous [R, k_in] slabs")
    if out is None:
        out = torch.empty((num_rows, k), dtype=torch.int32, device=keys.device)
    check_tensor("out", out, dtype=torch.int32, shape=(num_rows, k))
    if scratch is None:
        scratch = torch.empty(num_rows * world_size * width, dtype=torch.int32, device=keys.device)
    check_tensor("scratch", scratch, dtype=torch.int32, ndim=1)
    if scratch.shape[0] < num_rows * world_size * width:
        raise ValueError(f"scratch needs >= {num_rows * world_size * width} elements, got {scratch.shape[0]}")
    check_same_device(keys=keys, out=out, scratch=scratch)
    triton_impl = _select_global_topk_keys_triton if _backend.triton_available() else None
    impl = _backend.dispatch(_select_global_topk_keys_reference, triton_impl, backend, keys.device)
    return impl(keys, k, out, scratch)


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


class DcpMergeWorkspace:
    """Preallocated buffers of ``merge_topk_global`` for up to ``max_rows`` rows (create once, reuse every step).

    Args:
        max_rows: most rows a merge will carry (>= 0).
        k: the top-k width (>= 1), the same for every merge that uses the workspace.
        group: the DCP process group (None: the default group).
        interleave: the sharding's interleave (>= 1).
        device: where the buffers live (the logits' device; a CUDA device for NCCL).

    Holds ``send`` (int64 ``[max_rows * k]``: this rank's packed keys), ``gathered`` (int64
    ``[W * max_rows * k]``: every rank's, rank-major) and ``scratch`` (int32 ``[max_rows * W * k]``: the
    select's per-rank lists): 8 + 12 W bytes per candidate slot. Creating it is a collective: every rank
    creates its workspace together, with the same ``k`` and ``interleave`` (checked across ranks while value
    checks are enabled; ``max_rows`` may differ, each merge's row count must not).
    """

    def __init__(self, max_rows: int, k: int, *, group=None, interleave: int = 1, device=None) -> None:
        rank, world_size = _group_layout(group)

        def check() -> None:
            check_positive_int("max_rows", max_rows, minimum=0)
            check_positive_int("k", k)
            check_positive_int("interleave", interleave)

        error = _local_check(check)
        if world_size > 1:
            _agree_on(group, "DcpMergeWorkspace arguments [k, interleave]", [-1, -1] if error else [k, interleave], error)
        elif error is not None:
            raise error
        self.group, self.rank, self.world_size = group, rank, world_size
        self.max_rows, self.k, self.interleave = max_rows, k, interleave
        self.send, self.gathered, self.scratch = _merge_buffers(max_rows, k, world_size, device)


def _merge_buffers(rows: int, k: int, world_size: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The merge's send, gathered and scratch buffers (see ``DcpMergeWorkspace``)."""
    slots = rows * k
    return (
        torch.empty(slots, dtype=torch.int64, device=device),
        torch.empty(world_size * slots, dtype=torch.int64, device=device),
        torch.empty(world_size * slots, dtype=torch.int32, device=device),
    )


def _check_workspace(workspace, rows: int, k: int, interleave: int, world_size: int, device: torch.device) -> None:
    if not isinstance(workspace, DcpMergeWorkspace):
        raise TypeError(f"workspace must be a DcpMergeWorkspace, got {type(workspace).__name__}")
    if (workspace.k, workspace.interleave, workspace.world_size) != (k, interleave, world_size):
        raise ValueError(
            f"workspace was made for k={workspace.k}, interleave={workspace.interleave}, world {workspace.world_size}; "
            f"the merge has k={k}, interleave={interleave}, world {world_size}"
        )
    if rows > workspace.max_rows:
        raise ValueError(f"the merge has {rows} rows, the workspace holds {workspace.max_rows}")
    if workspace.send.device != device:
        raise ValueError(f"workspace is on {workspace.send.device}, logits on {device}")


def merge_topk_global(
    logits: torch.Tensor,
    topk_indices: torch.Tensor,
    k: int,
    *,
    group=None,
    interleave: int = 1,
    starts: torch.Tensor | None = None,
    workspace: DcpMergeWorkspace | None = None,
    backend: str = "auto",
) -> None:
    """Turn every rank's local top-k into the exact global top-k, in place (a collective).

    Args:
        logits: ``[R, C_local]`` float32 this rank's logits, as given to its local top-k.
        topk_indices: ``[R, k]`` int32 this rank's local top-k (positions relative to ``starts``,
            ascending, ``-1``-padded: a top-k's output); overwritten with global request-local positions.
        k: positions per row; ``k <= W * topk_indices.shape[1]``.
        group: the DCP process group (None: the default group). Every rank calls with the same ``R``
            and ``k``; a world of one is a no-op.
        interleave: consecutive positions per rank in the sharding.
        starts: ``[R]`` int32 or int64 first column of each row (prefill chunks), None for 0.
        workspace: a ``DcpMergeWorkspace`` of this group, ``k`` and ``interleave`` with ``>= R`` rows;
            None allocates one for the call.

    Three launches: ``pack_candidate_keys`` into ``workspace.send``, one ``all_gather_into_tensor`` into
    ``workspace.gathered``, ``select_global_topk_keys`` into ``topk_indices``; nothing is allocated with a
    workspace, and nothing is read on the host while value checks are disabled (CUDA-graph capture,
    ``DSA_INDEXER_SKIP_VALUE_CHECKS=1``), so the merge can be captured. While they are enabled, the ranks
    first exchange ``[R, k, interleave]`` (a small all-gather read on the host), so that a mismatch raises
    the same ``ValueError`` on every rank instead of hanging.

    The result is bitwise equal to the top-k of the whole (unsharded) row.
    """
    import torch.distributed as dist

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
        check_same_device(logits=logits, topk_indices=topk_indices, starts=starts)
        if workspace is not None:
            _check_workspace(workspace, logits.shape[0], k, interleave, world_size, logits.device)

    error = _local_check(check)
    if world_size == 1:
        if error is not None:
            raise error
        return
    descriptor = [-1, -1, -1] if error else [logits.shape[0], topk_indices.shape[1], interleave]
    _agree_on(group, "merge_topk_global arguments [rows, k, interleave]", descriptor, error)
    rows = logits.shape[0]
    if workspace is None:
        send, gathered, scratch = _merge_buffers(rows, k, world_size, logits.device)
    else:
        send, gathered, scratch = workspace.send, workspace.gathered, workspace.scratch
    send, gathered = send[: rows * k], gathered[: world_size * rows * k]
    pack_candidate_keys(logits, topk_indices, rank, world_size, interleave, starts, out=send.view(rows, k), backend=backend)
    dist.all_gather_into_tensor(gathered, send, group=group)
    select_global_topk_keys(gathered.view(world_size, rows, k), k, out=topk_indices, scratch=scratch, backend=backend)


def _dcp_block_scores_reference(logits, starts, ends, local_block, num_blocks, row_repeat, global_ends, global_block,
                                out) -> torch.Tensor:
    from .ops.candidates.reference import block_scores

    num_rows = logits.shape[0]
    scores = block_scores(logits, starts, ends, local_block, num_blocks, row_repeat)
    block_ids = torch.arange(num_blocks, device=logits.device).expand(num_rows, num_blocks)
    bound_index = torch.arange(num_rows, device=logits.device) // row_repeat
    newest = torch.div(global_ends.to(torch.int64)[bound_index] - 1, global_block, rounding_mode="floor")
    return out.copy_(torch.where(block_ids == newest[:, None], float("inf"), scores))


def _dcp_block_scores_triton(*args):
    from ._distributed_triton import dcp_block_scores_triton

    return dcp_block_scores_triton(*args)


def merge_scored_topk_global(
    scores: torch.Tensor,
    local_positions: torch.Tensor,
    k: int,
    *,
    group=None,
    interleave: int = 1,
    out: torch.Tensor,
) -> None:
    """``merge_topk_global`` for candidates that come with their scores (a collective).

    For callers whose local logits are not indexed by position (the sparse consumer path: a rank's sparse
    logits column maps to a local position through its candidate blocks).

    Args:
        scores: ``[R, k]`` float32 score of each local pick (``-inf`` for padding).
        local_positions: ``[R, k]`` int32 this rank's local top-k (request-local positions, ``-1`` padding).
        k: positions per row.
        group, interleave: as for ``merge_topk_global``.
        out: int32 ``[R, k]``: receives the global top-k positions (ascending, ``-1``-padded).
    """
    rank, world_size = _group_layout(group)

    def check() -> None:
        check_tensor("scores", scores, dtype=torch.float32, ndim=2)
        check_tensor("local_positions", local_positions, dtype=torch.int32, shape=tuple(scores.shape))
        check_tensor("out", out, dtype=torch.int32, shape=(scores.shape[0], k))
        check_positive_int("k", k)
        check_positive_int("interleave", interleave)
        if scores.shape[1] != k:
            raise ValueError(f"scores must have k = {k} columns (the local top-k), got {scores.shape[1]}")

    error = _local_check(check)
    if world_size == 1:
        if error is not None:
            raise error
        out.copy_(local_positions)
        return
    descriptor = [-1, -1, -1] if error else [scores.shape[0], k, interleave]
    _agree_on(group, "merge_scored_topk_global arguments [rows, k, interleave]", descriptor, error)
    import torch.distributed as dist

    rows = scores.shape[0]
    local = local_positions.to(torch.int64)
    global_ids = _local_to_global(local, rank, world_size, interleave)
    valid = (local >= 0) & (global_ids <= _MAX_GLOBAL_ID)
    send = composite_key(torch.where(valid, scores, float("-inf")), global_ids.clamp(0, _MAX_GLOBAL_ID)).contiguous()
    gathered = torch.empty(world_size * rows * k, dtype=torch.int64, device=scores.device)
    dist.all_gather_into_tensor(gathered, send.view(-1), group=group)
    select_global_topk_keys(gathered.view(world_size, rows, k), k, out=out)


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
    backend: str = "auto",
) -> torch.Tensor:
    """V4.1 candidate blocks of a DCP-sharded row (a collective; interleave 1 only).

    With interleave 1 and ``global_block_size`` divisible by ``W``, local block ``b`` (of
    ``global_block_size // W`` local positions) is exactly this rank's share of global block ``b``, so
    the global block score is the MAX over ranks of the local ones. The newest block is pinned from
    the global row length ``global_ends [R'] int32`` (``(global_end - 1) // global_block_size``; rows
    with no context pin nothing). Every rank calls with the same rows and ``max_global_blocks``, also
    with an empty shard. Returns int32 ``[R, num_blocks_k]`` global block ids, ascending, ``-1``-padded.

    Three launches: this rank's block scores (float32 ``[R, max_global_blocks]``, the newest block
    already ``+inf``: every rank pins it, and the maximum keeps it), one ``all_reduce`` MAX, and the §5
    top-k of the reduced scores (block id = column). The argument exchange runs while value checks are
    enabled, as for ``merge_topk_global``.
    """
    import torch.distributed as dist

    from .ops.topk import topk

    _, world_size = _group_layout(group)

    def check() -> None:
        check_tensor("logits", logits, dtype=torch.float32, ndim=2)
        check_positive_int("num_blocks_k", num_blocks_k)
        check_positive_int("global_block_size", global_block_size)
        check_positive_int("max_global_blocks", max_global_blocks, minimum=0)
        check_positive_int("row_repeat", row_repeat)
        check_index_tensor("global_ends", global_ends, ndim=1)
        check_index_tensor("ends", ends, ndim=1)
        if starts is not None:
            check_index_tensor("starts", starts, shape=ends.shape)
        check_same_device(logits=logits, ends=ends, starts=starts, global_ends=global_ends)
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
    scores = torch.empty((logits.shape[0], max_global_blocks), dtype=torch.float32, device=logits.device)
    triton_impl = _dcp_block_scores_triton if _backend.triton_available() else None
    impl = _backend.dispatch(_dcp_block_scores_reference, triton_impl, backend, logits.device)
    impl(logits, starts, ends, global_block_size // world_size, max_global_blocks, row_repeat, global_ends,
         global_block_size, scores)
    if world_size > 1:
        dist.all_reduce(scores, op=dist.ReduceOp.MAX, group=group)
    return topk(scores, num_blocks_k, out=out, backend=backend)


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
