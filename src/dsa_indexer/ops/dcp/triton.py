"""Triton kernels of the DCP merge and of the DCP candidate block scores (derivations: ``README.md``).

The pack of a rank's local top-k (as ``(score, global id)`` pairs, or as one int64 order key per candidate), the
fused select of the global top-k from the gathered keys, and the local block scores that the MAX-reduce takes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...dcp_positions import MAX_GLOBAL_ID as _MAX_GLOBAL_ID
from ..common.runtime import interpreting, next_pow2
from ..common.selection import KEY_MAX, NONE, bit_length, clear_low_bits, kth_largest_within, order_keys, row_bounds

MAX_GLOBAL_ID = tl.constexpr(_MAX_GLOBAL_ID)
# Largest select tile searched two bits per round (three 16-bit counts share one int64 reduction).
TWO_BIT_SEARCH_MAX_SLOTS = 16384


@triton.jit
def _pack_local_candidates_kernel(
    logits_ptr, logits_row_stride, logits_col_stride, width,
    topk_ptr, topk_row_stride, k,
    starts_ptr,
    scores_ptr, ids_ptr,
    rank, world_size, interleave,
    HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    in_k = offsets < k
    local = tl.load(topk_ptr + row * topk_row_stride + offsets, mask=in_k, other=-1).to(tl.int64)
    column = local
    if HAS_STARTS:
        column = local + tl.load(starts_ptr + row).to(tl.int64)
    valid = in_k & (local >= 0) & (column >= 0) & (column < width)
    score = tl.load(
        logits_ptr + row * logits_row_stride + column * logits_col_stride, mask=valid, other=float("-inf")
    )
    span = interleave * world_size
    global_id = (local // interleave) * span + rank * interleave + local % interleave
    global_id = tl.where(valid, global_id, -1)
    tl.store(scores_ptr + row * k + offsets, score, mask=in_k)
    tl.store(ids_ptr + row * k + offsets, global_id, mask=in_k)


def pack_local_candidates_triton(
    logits: torch.Tensor,
    local_topk: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int,
    starts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of the reference pack: ``(scores float32 [R, k], global_ids int64 [R, k])``."""
    num_rows, k = local_topk.shape
    scores = torch.empty((num_rows, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((num_rows, k), dtype=torch.int64, device=logits.device)
    if num_rows == 0 or k == 0:
        return scores, ids
    block = min(1024, next_pow2(k))
    topk_rows = local_topk if local_topk.stride(1) == 1 else local_topk.contiguous()
    grid = (num_rows, triton.cdiv(k, block))
    _pack_local_candidates_kernel[grid](
        logits, logits.stride(0), logits.stride(1), logits.shape[1],
        topk_rows, topk_rows.stride(0), k,
        starts if starts is not None else topk_rows,
        scores, ids,
        rank, world_size, interleave,
        HAS_STARTS=starts is not None, BLOCK=block,
    )
    return scores, ids


@triton.jit
def _pack_candidate_keys_kernel(
    logits_ptr, logits_row_stride, logits_col_stride, width,
    topk_ptr, topk_row_stride, topk_col_stride, k,
    starts_ptr,
    keys_ptr,
    rank, world_size, interleave,
    HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    in_k = offsets < k
    local = tl.load(topk_ptr + row * topk_row_stride + offsets * topk_col_stride, mask=in_k, other=-1).to(tl.int64)
    column = local
    if HAS_STARTS:
        column = local + tl.load(starts_ptr + row).to(tl.int64)
    span = interleave * world_size
    global_id = (local // interleave) * span + rank * interleave + local % interleave
    valid = in_k & (local >= 0) & (column >= 0) & (column < width) & (global_id <= MAX_GLOBAL_ID)
    score = tl.load(
        logits_ptr + row * logits_row_stride + column * logits_col_stride, mask=valid, other=float("-inf")
    )
    order_key = order_keys(score, valid)  # int32, NONE where unselectable
    # Low word: the bitwise-inverted id (zero-extended), so that a larger word is a lower id on ties.
    low = (~global_id.to(tl.int32)).to(tl.uint32, bitcast=True).to(tl.int64)
    low = tl.where(order_key == NONE, 0, low)
    tl.store(keys_ptr + row * k + offsets, (order_key.to(tl.int64) << 32) | low, mask=in_k)


def pack_candidate_keys_triton(
    logits: torch.Tensor,
    local_topk: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int,
    starts: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """Triton twin of the reference key pack: writes int64 ``out [R, k]`` (contiguous) and returns it."""
    num_rows, k = local_topk.shape
    if num_rows == 0 or k == 0:
        return out
    block = min(1024, next_pow2(k))
    grid = (num_rows, triton.cdiv(k, block))
    _pack_candidate_keys_kernel[grid](
        logits, logits.stride(0), logits.stride(1), logits.shape[1],
        local_topk, local_topk.stride(0), local_topk.stride(1), k,
        starts if starts is not None else local_topk,
        out,
        rank, world_size, interleave,
        HAS_STARTS=starts is not None, BLOCK=block,
    )
    return out


@triton.jit
def _pack_scored_keys_kernel(
    scores_ptr, scores_row_stride, scores_col_stride,
    positions_ptr, positions_row_stride, positions_col_stride, k,
    keys_ptr,
    rank, world_size, interleave,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    in_k = offsets < k
    local = tl.load(
        positions_ptr + row * positions_row_stride + offsets * positions_col_stride, mask=in_k, other=-1
    ).to(tl.int64)
    span = interleave * world_size
    global_id = (local // interleave) * span + rank * interleave + local % interleave
    valid = in_k & (local >= 0) & (global_id <= MAX_GLOBAL_ID)
    score = tl.load(scores_ptr + row * scores_row_stride + offsets * scores_col_stride, mask=valid, other=float("-inf"))
    order_key = order_keys(score, valid)  # int32, NONE where unselectable
    low = (~global_id.to(tl.int32)).to(tl.uint32, bitcast=True).to(tl.int64)
    low = tl.where(order_key == NONE, 0, low)
    tl.store(keys_ptr + row * k + offsets, (order_key.to(tl.int64) << 32) | low, mask=in_k)


def pack_scored_keys_triton(
    scores: torch.Tensor,
    local_positions: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Triton twin of the reference scored pack: writes int64 ``out [R, k]`` (contiguous) and returns it."""
    num_rows, k = local_positions.shape
    if num_rows == 0 or k == 0:
        return out
    block = min(1024, next_pow2(k))
    _pack_scored_keys_kernel[(num_rows, triton.cdiv(k, block))](
        scores, scores.stride(0), scores.stride(1),
        local_positions, local_positions.stride(0), local_positions.stride(1), k,
        out,
        rank, world_size, interleave,
        BLOCK=block,
    )
    return out


@triton.jit
def _kth_largest_1bit(keys, k, count, lo, hi):
    """``kth_largest_within``'s result (``enough = k``) one bit per round: for tiles of more than 16384 keys,
    where the two-bit rounds' 16-bit count fields could overflow."""
    bit = bit_length(lo ^ hi)
    t = clear_low_bits(lo, bit)
    while (bit > 0) & (count > k):
        bit -= 1
        candidate = t ^ (1 << bit)
        reached = tl.sum((keys >= candidate).to(tl.int32), axis=0)
        take = reached >= k
        t = tl.where(take, candidate, t)
        count = tl.where(take, reached, count)
    return t, count


@triton.jit
def _kth_largest(keys, k, count, lo, hi, TWO_BITS: tl.constexpr, CARRY: tl.constexpr):
    """``(t, #(keys >= t))`` for 1-D int32 ``keys`` (NONE: unselectable) with ``count > k`` selectable keys in
    ``[lo, hi]``: ``t`` is the k-th largest key or one that exactly k keys reach (the same entries ``>= t``)."""
    if TWO_BITS:
        t, count = kth_largest_within(keys, k, k, count, lo, hi, CARRY)
    else:
        t, count = _kth_largest_1bit(keys, k, count, lo, hi)
    return t, count


@triton.jit
def _select_global_topk_keys_kernel(
    keys_ptr, rank_stride, row_stride,
    out_ptr, out_row_stride, out_col_stride,
    scratch_ptr,
    width, k, world_size,
    WP: tl.constexpr, KP: tl.constexpr, OUT_BLOCK: tl.constexpr, SEARCH_ROUNDS: tl.constexpr,
    TWO_BITS: tl.constexpr, CARRY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, WP * KP)  # slot j of rank w at w * KP + j
    ranks = offsets // KP
    cols = offsets % KP
    inside = (ranks < world_size) & (cols < width)
    words = tl.load(keys_ptr + ranks * rank_stride + row * row_stride + cols, mask=inside, other=0)
    keys = tl.where(inside, (words >> 32).to(tl.int32), NONE)  # score order keys, NONE: unselectable
    ids = ~words.to(tl.int32)  # the low word is the inverted id
    selectable = keys != NONE

    # Threshold: the k-th largest score key T, then the lowest ids among the ties at T.
    count = tl.sum(selectable.to(tl.int32), axis=0)
    tie_floor = tl.full([], NONE, tl.int32)  # ties taken where KEY_MAX - id >= tie_floor: all, by default
    t = tl.full([], NONE, tl.int32)  # at most k selectable: every one
    if count > k:
        lo = tl.min(tl.where(selectable, keys, KEY_MAX), axis=0)
        hi = tl.max(keys, axis=0)
        t, reached = _kth_largest(keys, k, count, lo, hi, TWO_BITS, CARRY)
        if reached > k:
            greater = tl.sum((keys > t).to(tl.int32), axis=0)
            tie_keys = tl.where(keys == t, KEY_MAX - ids, NONE)  # larger = lower id
            tie_lo = tl.min(tl.where(keys == t, tie_keys, KEY_MAX), axis=0)
            tie_hi = tl.max(tie_keys, axis=0)
            tie_floor, _ = _kth_largest(tie_keys, k - greater, reached - greater, tie_lo, tie_hi, TWO_BITS, CARRY)
    taken = selectable & ((keys > t) | ((keys == t) & (KEY_MAX - ids >= tie_floor)))

    # Ascending ids: each rank's taken ids are ascending (its local top-k is), so an id's place is its rank
    # among its own rank's taken ids plus, for every other rank, how many of that rank's taken ids are lower
    # (a binary search in that rank's compacted list).
    flags = taken.to(tl.int32)
    before = tl.cumsum(flags, axis=0) - flags  # taken slots before this one, over the ranks in order
    total = tl.sum(flags, axis=0)
    lists = scratch_ptr + row * world_size * width
    rank_base = tl.zeros([WP * KP], dtype=tl.int32)
    for other in tl.static_range(WP):
        rank_base += tl.where(ranks > other, tl.sum(tl.where(ranks == other, flags, 0), axis=0), 0)
    place = before - rank_base
    tl.store(lists + ranks * width + place, ids, mask=taken)
    tl.debug_barrier()
    position = place
    for other in tl.static_range(WP):
        length = tl.sum(tl.where(ranks == other, flags, 0), axis=0)
        low = tl.zeros([WP * KP], dtype=tl.int32)
        high = tl.where(taken & (ranks != other), length, 0)
        for _ in tl.static_range(SEARCH_ROUNDS):
            active = low < high
            middle = (low + high) // 2
            value = tl.load(lists + other * width + middle, mask=active, other=0)
            below = value < ids
            low = tl.where(active & below, middle + 1, low)
            high = tl.where(active & ~below, middle, high)
        position += low
    out_row = out_ptr + row * out_row_stride
    tl.store(out_row + position * out_col_stride, ids, mask=taken)
    pad = tl.arange(0, OUT_BLOCK)
    tl.store(out_row + pad * out_col_stride, tl.full([OUT_BLOCK], -1, tl.int32), mask=(pad >= total) & (pad < k))


def select_global_topk_keys_triton(keys: torch.Tensor, k: int, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Triton twin of the reference keyed select: ``keys [W, R, k_in]`` int64 (row-contiguous), ``out [R, k]``
    int32, ``scratch`` int32 with at least ``R * W * k_in`` elements."""
    world_size, num_rows, width = keys.shape
    if num_rows == 0:
        return out
    wp, kp = next_pow2(world_size), next_pow2(width)
    block = wp * kp
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    _select_global_topk_keys_kernel[(num_rows,)](
        keys, keys.stride(0), keys.stride(1),
        out, out.stride(0), out.stride(1),
        scratch,
        width, k, world_size,
        WP=wp, KP=kp, OUT_BLOCK=next_pow2(k), SEARCH_ROUNDS=max(1, width.bit_length()),
        TWO_BITS=block <= TWO_BIT_SEARCH_MAX_SLOTS, CARRY=int(not interpreting()), num_warps=warps,
    )
    return out


@triton.jit(do_not_specialize=["row_repeat", "num_blocks", "local_block", "global_block", "width"])
def _dcp_block_scores_kernel(
    logits_ptr, stride_row, stride_col, starts_ptr, ends_ptr, global_ends_ptr, scores_ptr,
    row_repeat, num_blocks, local_block, global_block, width,
    HAS_STARTS: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_J: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    start, length = row_bounds(starts_ptr, ends_ptr, row, row_repeat, width, HAS_STARTS)
    blocks = tl.program_id(1).to(tl.int64) * BLOCK_NB + tl.arange(0, BLOCK_NB)  # [BLOCK_NB]
    best = tl.full([BLOCK_NB], float("-inf"), tl.float32)
    row_ptr = logits_ptr + row * stride_row
    first = local_block * 0
    while first < local_block:
        inner = first + tl.arange(0, BLOCK_J)  # [BLOCK_J]
        pos = blocks[:, None] * local_block + inner[None, :]  # [BLOCK_NB, BLOCK_J] row-relative
        inside = (inner[None, :] < local_block) & (pos < length)
        values = tl.load(row_ptr + (start + pos) * stride_col, mask=inside, other=float("-inf"))
        best = tl.maximum(best, tl.max(tl.where(values != values, float("-inf"), values), axis=1))
        first += BLOCK_J
    # Pinned before the MAX-reduce: every rank pins the same block, and +inf survives the maximum.
    global_end = tl.load(global_ends_ptr + row // row_repeat).to(tl.int64)
    newest = tl.where(global_end > 0, (global_end - 1) // global_block, -1)
    best = tl.where(blocks == newest, float("inf"), best)
    tl.store(scores_ptr + row * num_blocks + blocks, best, mask=blocks < num_blocks)


def dcp_block_scores_triton(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    local_block: int,
    num_blocks: int,
    row_repeat: int,
    global_ends: torch.Tensor,
    global_block: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Triton twin of the reference DCP block scores: float32 ``out [R, num_blocks]`` (contiguous)."""
    num_rows = logits.shape[0]
    if num_rows == 0 or num_blocks == 0:
        return out
    block_j = min(64, next_pow2(local_block))
    block_nb = max(1, min(next_pow2(num_blocks), 4096 // block_j))
    _dcp_block_scores_kernel[(num_rows, triton.cdiv(num_blocks, block_nb))](
        logits, logits.stride(0), logits.stride(1), starts if starts is not None else ends, ends, global_ends, out,
        row_repeat, num_blocks, local_block, global_block, logits.shape[1],
        HAS_STARTS=starts is not None, BLOCK_NB=block_nb, BLOCK_J=block_j, num_warps=4,
    )
    return out


def select_global_topk_triton(
    scores: torch.Tensor, global_ids: torch.Tensor, k: int, out: torch.Tensor | None
) -> torch.Tensor:
    """``select_global_topk`` through the Triton top-k: candidates sorted by id become columns, so the top-k's
    tie rule (lower column) is the merge's (lower id) and its ascending columns are ascending ids. Everything
    stays on the device (no host reads), so it is graph-capturable."""
    from ..topk import topk

    num_rows = scores.shape[0]
    if out is None:
        out = torch.empty((num_rows, k), dtype=torch.int32, device=scores.device)
    valid_id = (global_ids >= 0) & (global_ids <= _MAX_GLOBAL_ID)
    ordered_ids, order = torch.where(valid_id, global_ids, _MAX_GLOBAL_ID + 1).sort(dim=1, stable=True)
    ordered_scores = torch.where(valid_id, scores, float("-inf")).gather(1, order)
    columns = topk(ordered_scores.contiguous(), k, backend="triton")
    picked = ordered_ids.gather(1, columns.clamp_min(0).to(torch.int64))
    return out.copy_(torch.where(columns >= 0, picked, -1))
