"""Decode context parallelism's collectives and its public API (DESIGN §8).

The KV of a request is sharded over the ranks of a ``torch.distributed`` group (position math:
``dsa_indexer.dcp_positions``); each rank scores and selects its own shard, and the functions here turn the
local results into global ones: ``merge_topk_global`` (key pack, one ``all_gather_into_tensor``, keyed select:
``dsa_indexer.ops.dcp``), ``merge_scored_topk_global``, ``select_candidate_blocks_dcp`` (an ``all_reduce``
MAX of block scores) and the prefill context parallel ``gather_prefill_k``. They run on any process group
(gloo on CPU, NCCL on GPUs). While value checks are enabled, each first exchanges a small shape descriptor, so
a mismatch between ranks raises the same ``ValueError`` on every rank instead of hanging.
``torch.distributed`` is imported only when a collective runs.
"""

from __future__ import annotations

import torch

from ._validation import check_index_tensor, check_positive_int, check_same_device, check_tensor, value_checks_enabled
from .dcp_positions import global_to_local, local_lengths, local_to_global
from .ops.dcp import (
    dcp_block_scores,
    pack_candidate_keys,
    pack_local_candidates,
    pack_scored_keys,
    select_global_topk,
    select_global_topk_keys,
)

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


def merge_scored_topk_global(
    scores: torch.Tensor,
    local_positions: torch.Tensor,
    k: int,
    *,
    group=None,
    interleave: int = 1,
    out: torch.Tensor,
    backend: str = "auto",
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
        backend: ``"auto" | "reference" | "triton"`` for the pack and the select.
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
    send, gathered, scratch = _merge_buffers(rows, k, world_size, scores.device)
    pack_scored_keys(scores, local_positions, rank, world_size, interleave, out=send.view(rows, k), backend=backend)
    dist.all_gather_into_tensor(gathered, send, group=group)
    select_global_topk_keys(gathered.view(world_size, rows, k), k, out=out, scratch=scratch, backend=backend)


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
    dcp_block_scores(logits, starts, ends, global_block_size // world_size, max_global_blocks, row_repeat, global_ends,
                     global_block_size, out=scores, backend=backend)
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
