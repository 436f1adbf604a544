"""The per-rank pieces of decode context parallelism (DESIGN §8): no collectives here.

The exact merge packs each rank's local top-k (``pack_candidate_keys``, or ``pack_scored_keys`` for picks that
come with their scores) as int64 words whose integer order is the §5 order, and selects the global top-k
from every rank's words (``select_global_topk_keys``); ``pack_local_candidates`` and ``select_global_topk`` are
the same steps on ``(score, global id)`` pairs. ``dcp_block_scores`` is a rank's input to the candidate
blocks' MAX-reduce. ``dsa_indexer.distributed`` composes them with the collectives; why the merge is exact:
``README.md``.
"""

from __future__ import annotations

import torch

from ... import backend as _backend
from ..._validation import (
    check_index_tensor,
    check_k,
    check_positive_int,
    check_same_device,
    check_tensor,
    index_as_int32,
)
from ...dcp_positions import check_layout
from .reference import (
    dcp_block_scores_reference,
    pack_candidate_keys_reference,
    pack_local_candidates_reference,
    pack_scored_keys_reference,
    select_global_topk_keys_reference,
    select_global_topk_reference,
)

__all__ = [
    "dcp_block_scores",
    "pack_candidate_keys",
    "pack_local_candidates",
    "pack_scored_keys",
    "select_global_topk",
    "select_global_topk_keys",
]


def _triton(name: str):
    """The Triton implementation ``name`` of ``triton.py`` (imported on first call), None without Triton."""
    if not _backend.triton_available():
        return None

    def call(*args):
        from . import triton

        return getattr(triton, name)(*args)

    return call


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
    check_layout(world_size, interleave, rank)
    if starts is not None:
        check_index_tensor("starts", starts, shape=(logits.shape[0],))
    check_same_device(logits=logits, local_topk=local_topk, starts=starts)
    local_topk = index_as_int32("local_topk", local_topk)
    starts = None if starts is None else index_as_int32("starts", starts)
    impl = _backend.dispatch(
        pack_local_candidates_reference, _triton("pack_local_candidates_triton"), backend, logits.device
    )
    return impl(logits, local_topk, rank, world_size, interleave, starts)


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
    impl = _backend.dispatch(select_global_topk_reference, _triton("select_global_topk_triton"), backend, scores.device)
    return impl(scores, global_ids, k, out)


def _check_keys_out(out: torch.Tensor, shape) -> None:
    check_tensor("out", out, dtype=torch.int64, shape=shape)
    if not out.is_contiguous():
        raise ValueError("out must be contiguous (it is the all-gather's send buffer)")


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
    check_layout(world_size, interleave, rank)
    if starts is not None:
        check_tensor("starts", starts, dtype=torch.int32, shape=(logits.shape[0],))
    if out is None:
        out = torch.empty(local_topk.shape, dtype=torch.int64, device=logits.device)
    _check_keys_out(out, local_topk.shape)
    check_same_device(logits=logits, local_topk=local_topk, starts=starts, out=out)
    impl = _backend.dispatch(pack_candidate_keys_reference, _triton("pack_candidate_keys_triton"), backend, logits.device)
    return impl(logits, local_topk, rank, world_size, interleave, starts, out)


def pack_scored_keys(
    scores: torch.Tensor,
    local_positions: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``pack_candidate_keys`` for local picks that come with their scores (the sparse consumer's top-k).

    Args:
        scores: ``[R, k]`` float32 score of each pick (``-inf`` for padding), any strides.
        local_positions: ``[R, k]`` int32 this rank's local positions (``-1`` padding), any strides.
        rank, world_size, interleave: this rank's place in the sharding.
        out: optional contiguous int64 ``[R, k]`` destination.
        backend: ``"auto" | "reference" | "triton"``.

    Returns:
        int64 ``[R, k]``: ``composite_key(scores, local_to_global(local_positions))``; ``UNSELECTABLE`` for
        padding, NaN or ``-inf`` scores and ids ``>= 2**31``.
    """
    check_tensor("scores", scores, dtype=torch.float32, ndim=2)
    check_tensor("local_positions", local_positions, dtype=torch.int32, shape=tuple(scores.shape))
    check_layout(world_size, interleave, rank)
    if out is None:
        out = torch.empty(local_positions.shape, dtype=torch.int64, device=scores.device)
    _check_keys_out(out, local_positions.shape)
    check_same_device(scores=scores, local_positions=local_positions, out=out)
    impl = _backend.dispatch(pack_scored_keys_reference, _triton("pack_scored_keys_triton"), backend, scores.device)
    return impl(scores, local_positions, rank, world_size, interleave, out)


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
    impl = _backend.dispatch(
        select_global_topk_keys_reference, _triton("select_global_topk_keys_triton"), backend, keys.device
    )
    return impl(keys, k, out, scratch)


def dcp_block_scores(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    local_block: int,
    num_blocks: int,
    row_repeat: int,
    global_ends: torch.Tensor,
    global_block: int,
    *,
    out: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """This rank's candidate block scores under DCP, the newest global block pinned (the MAX-reduce's input).

    Args:
        logits: ``[R, C]`` float32 local logits, any strides.
        starts, ends: ``[R']`` int32 or int64 local row bounds (``starts`` None for 0), as for
            ``select_candidate_blocks``; row ``r`` uses entry ``r // row_repeat``.
        local_block: local positions per block (``global_block // W`` at interleave 1).
        num_blocks: block columns (the most global blocks of any row).
        row_repeat: rows sharing one bounds entry (>= 1).
        global_ends: ``[R']`` int32 or int64 global row lengths.
        global_block: positions per global block.
        out: contiguous float32 ``[R, num_blocks]``.
        backend: ``"auto" | "reference" | "triton"``.

    Returns:
        ``out``: the max selectable logit of each local block (``-inf`` if none), ``+inf`` in the newest
        block ``(global_end - 1) // global_block`` of rows with ``global_end > 0``.
    """
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    for name, value in (("local_block", local_block), ("row_repeat", row_repeat), ("global_block", global_block)):
        check_positive_int(name, value)
    check_positive_int("num_blocks", num_blocks, minimum=0)
    check_tensor("out", out, dtype=torch.float32, shape=(logits.shape[0], num_blocks))
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    check_same_device(logits=logits, starts=starts, ends=ends, global_ends=global_ends, out=out)
    impl = _backend.dispatch(dcp_block_scores_reference, _triton("dcp_block_scores_triton"), backend, logits.device)
    return impl(logits, starts, ends, local_block, num_blocks, row_repeat, global_ends, global_block, out)
