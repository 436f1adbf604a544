"""The indexer KL loss over a process group: keys sharded (context parallel) or heads sharded (tensor parallel).

Communication is linear in ``T``; no ``T × T`` tensor travels, and every reduction adds the ranks' parts in rank
order, so the result equals one process bit for bit (``context_parallel_reference``,
``tensor_parallel_reference`` define it on one process). The float64 reference runs on every rank (CPU or GPU
tensors; gloo or NCCL). The steps and what each exchange moves are in ``train/README.md`` ("Parallel training").
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate

import torch

from . import apply_precomputed, validate
from .reference import Inputs, Layout, Merged, RowStats, loss_dtype, merge_stats, row_grads, row_stats

__all__ = [
    "balanced_row_blocks",
    "context_parallel_indexer_kl",
    "context_parallel_loss",
    "context_parallel_reference",
    "tensor_parallel_indexer_kl",
    "tensor_parallel_loss",
    "tensor_parallel_reference",
]


def _ordered_sum(parts):
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def balanced_row_blocks(layout: Layout, world_size: int) -> list[tuple[int, int]]:
    """Contiguous blocks of query rows, one per rank, with about equal dense causal work (visible keys)."""
    cumulative = list(accumulate(layout.visible_counts(), initial=0))
    total = cumulative[-1]
    cuts = [0] + [bisect_left(cumulative, -(-total * r // world_size)) for r in range(1, world_size)]
    cuts.append(len(cumulative) - 1)
    return list(zip(cuts[:-1], cuts[1:]))


# The pieces each rank runs; the single-process definitions call the same ones, in the same order.


def _cp_merge(stats: list[torch.Tensor], heads: int, options: dict) -> Merged:
    return merge_stats([RowStats.from_tensor(s) for s in stats], num_heads=heads, **options)


def _tp_merge(stats: list[torch.Tensor], entropy: torch.Tensor | None, heads: int, options: dict) -> Merged:
    """Head shards: the indexer statistics are the same on every rank (rank 0's are used), the target's
    mass and cross term are summed in rank order, the entropy comes from the row blocks (or is 0)."""
    first = RowStats.from_tensor(stats[0])
    combined = RowStats(first.count, first.max, first.sumexp, _ordered_sum([s[3] for s in stats]),
                        _ordered_sum([s[4] for s in stats]), torch.zeros_like(first.mass) if entropy is None else entropy)
    return merge_stats([combined], num_heads=heads, with_entropy=entropy is not None, **options)


def _options(target_norm, reduction, coeff) -> dict:
    return dict(target_norm=target_norm, reduction=reduction, coeff=float(coeff))


def _outputs(merged: Merged, dq, dk, dw, q, k, weights):
    return loss_dtype(q.dtype, merged.loss), dq.to(q.dtype), dk.to(k.dtype), dw.to(weights.dtype)


def context_parallel_reference(q, k, weights, attn_q, attn_k, attn_lse, *, key_splits, softmax_scale, cu_seqlens=None,
                               topk_indices=None, compress_ratio=1, target_norm="heads", reduction="mean", coeff=1.0,
                               chunk_rows=None):
    """What ``context_parallel_indexer_kl`` computes over key shards of sizes ``key_splits`` (in rank order),
    in one process: ``(loss, dq, dk [T_k, D_I] (all shards), dweights)``."""
    x = Inputs.of(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale, cu_seqlens, topk_indices, compress_ratio)
    offsets = list(accumulate(key_splits, initial=0))
    shards = [x.key_slice((lo, hi)) for lo, hi in zip(offsets[:-1], offsets[1:])]
    stats = [row_stats(s, chunk_rows=chunk_rows).as_tensor() for s in shards]
    merged = _cp_merge(stats, attn_q.shape[1], _options(target_norm, reduction, coeff))
    grads = [row_grads(s, merged, chunk_rows=chunk_rows) for s in shards]
    dq = _ordered_sum([g[0] for g in grads])
    dw = _ordered_sum([g[2] for g in grads])
    return _outputs(merged, dq, torch.cat([g[1] for g in grads]), dw, q, k, weights)


def tensor_parallel_reference(q, k, weights, attn_q, attn_k, attn_lse, *, world_size, softmax_scale, cu_seqlens=None,
                              topk_indices=None, compress_ratio=1, target_norm="heads", reduction="mean", coeff=1.0,
                              exact_loss=True, chunk_rows=None):
    """What ``tensor_parallel_indexer_kl`` computes over ``world_size`` equal head shards, in one process."""
    x = Inputs.of(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale, cu_seqlens, topk_indices, compress_ratio)
    heads = attn_q.shape[1]
    per_rank = heads // world_size
    shards = [x.head_slice((r * per_rank, (r + 1) * per_rank)) for r in range(world_size)]
    stats = [row_stats(s, chunk_rows=chunk_rows).as_tensor() for s in shards]
    entropy = None
    if exact_loss:
        blocks = balanced_row_blocks(x.layout, world_size)
        entropy = _ordered_sum([row_stats(x, rows=rows, chunk_rows=chunk_rows).entropy for rows in blocks])
    merged = _tp_merge(stats, entropy, heads, _options(target_norm, reduction, coeff))
    grads = [row_grads(s, merged, with_pi=r == 0, chunk_rows=chunk_rows) for r, s in enumerate(shards)]
    return _outputs(merged, *(_ordered_sum([g[i] for g in grads]) for i in range(3)), q, k, weights)


# Collectives.


def _dist():
    import torch.distributed as dist

    return dist


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    dist = _dist()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _ordered_all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum of every rank's ``tensor`` added in rank order (the same bits as ``_ordered_sum`` of them):
    ``all_to_all`` of slices, a rank-order sum of each slice, ``all_gather`` of the sums."""
    dist = _dist()
    world = dist.get_world_size(group)
    flat = tensor.reshape(-1)
    width = -(-flat.numel() // world)
    padded = torch.zeros(world * width, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    received = torch.empty_like(padded)
    dist.all_to_all_single(received, padded, group=group)
    mine = _ordered_sum(list(received.view(world, width).unbind(0)))
    return torch.cat(_all_gather(mine, group))[: flat.numel()].view_as(tensor)


def _agree(descriptor: list[int], group, names: list[str], varying: tuple[int, ...] = ()) -> list[list[int]]:
    """Exchange a small shape descriptor; every rank raises the same error when they differ (except at the
    ``varying`` positions)."""
    parts = _all_gather(torch.tensor(descriptor, dtype=torch.int64), group)
    rows = [p.tolist() for p in parts]
    for position in range(len(descriptor)):
        if position in varying:
            continue
        values = [row[position] for row in rows]
        if len(set(values)) != 1:
            raise ValueError(f"the ranks disagree on {names[position]}: {values} in rank order")
    return rows


def _rank(group) -> tuple[int, int]:
    dist = _dist()
    return dist.get_rank(group), dist.get_world_size(group)


def context_parallel_indexer_kl(q, k, weights, attn_q, attn_k, attn_lse, *, softmax_scale: float, cu_seqlens=None,
                                topk_indices=None, compress_ratio: int = 1, target_norm: str = "heads",
                                reduction: str = "mean", coeff: float = 1.0, group=None, chunk_rows=None):
    """Loss and gradients with the keys sharded over ``group`` (see the module docstring for the layout).

    Args: as ``indexer_kl_loss``, except that ``k [n_r, D_I]`` and ``attn_k [n_r, ...]`` are this rank's
    contiguous shard of the packed keys (rank order; ``Σ_r n_r = T_k``); every other tensor is whole.
    Returns ``(loss, dq [T, H_I, D_I], dk [n_r, D_I] (this shard's keys), dweights [T, H_I])``, the same on
    every rank except ``dk``.
    """
    validate(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
             topk_indices=topk_indices, compress_ratio=compress_ratio, target_norm=target_norm, reduction=reduction,
             coeff=coeff, check_key_count=False)
    descriptor = [*q.shape, attn_q.shape[1], attn_q.shape[2], attn_k.dim(), k.shape[0]]
    names = ["T", "H_I", "D_I", "H", "D_a", "attn_k rank", "shard size"]
    rows = _agree(descriptor, group, names, varying=(6,))
    splits = [row[6] for row in rows]
    layout = Layout.of(q.shape[0], cu_seqlens, compress_ratio)
    if sum(splits) != layout.num_keys:
        raise ValueError(f"the key shards (sizes {splits} in rank order) must add up to T_k = Σ_b len_b // "
                         f"compress_ratio = {layout.num_keys}")
    rank, _ = _rank(group)
    base = sum(splits[:rank])
    x = Inputs.of(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale, cu_seqlens, topk_indices, compress_ratio,
                  key_base=base)
    stats = _all_gather(row_stats(x, chunk_rows=chunk_rows).as_tensor(), group)
    merged = _cp_merge(stats, attn_q.shape[1], _options(target_norm, reduction, coeff))
    dq, dk, dw = row_grads(x, merged, chunk_rows=chunk_rows)
    dq, dw = _ordered_all_reduce(dq, group), _ordered_all_reduce(dw, group)
    return _outputs(merged, dq, dk, dw, q, k, weights)


def tensor_parallel_indexer_kl(q, k, weights, attn_q, attn_k, attn_lse, *, softmax_scale: float, cu_seqlens=None,
                               topk_indices=None, compress_ratio: int = 1, target_norm: str = "heads",
                               reduction: str = "mean", coeff: float = 1.0, exact_loss: bool = True, group=None,
                               chunk_rows=None):
    """Loss and gradients with the main-attention heads sharded over ``group`` (equal shards, rank order).

    Args: as ``indexer_kl_loss``, except that ``attn_q [T, H/W, D_a]``, ``attn_lse [T, H/W]`` and a GQA
    ``attn_k [T_k, H_kv/W, D_a]`` hold this rank's heads; ``exact_loss`` as in the module docstring.
    Returns ``(loss, dq, dk, dweights)``, the same on every rank.
    """
    validate(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
             topk_indices=topk_indices, compress_ratio=compress_ratio, target_norm=target_norm, reduction=reduction,
             coeff=coeff)
    if not isinstance(exact_loss, bool):
        raise TypeError(f"exact_loss must be a bool, got {type(exact_loss).__name__}")
    descriptor = [*q.shape, k.shape[0], *attn_q.shape[1:], attn_k.dim(), attn_k.shape[1] if attn_k.dim() == 3 else 0]
    _agree(descriptor, group, ["T", "H_I", "D_I", "T_k", "heads per rank", "D_a", "attn_k rank", "key heads per rank"])
    rank, world = _rank(group)
    local_heads = attn_q.shape[1]
    x = Inputs.of(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale, cu_seqlens, topk_indices, compress_ratio)
    stats = _all_gather(row_stats(x, chunk_rows=chunk_rows).as_tensor(), group)
    entropy = None
    if exact_loss:
        full_k = torch.cat(_all_gather(attn_k, group), dim=1) if attn_k.dim() == 3 else attn_k
        whole = Inputs.of(q, k, weights, torch.cat(_all_gather(attn_q, group), dim=1), full_k,
                          torch.cat(_all_gather(attn_lse, group), dim=1), softmax_scale, cu_seqlens, topk_indices,
                          compress_ratio)
        rows = balanced_row_blocks(whole.layout, world)[rank]
        entropy = _ordered_all_reduce(row_stats(whole, rows=rows, chunk_rows=chunk_rows).entropy, group)
    merged = _tp_merge(stats, entropy, local_heads * world, _options(target_norm, reduction, coeff))
    grads = row_grads(x, merged, with_pi=rank == 0, chunk_rows=chunk_rows)
    return _outputs(merged, *(_ordered_all_reduce(g, group) for g in grads), q, k, weights)


def context_parallel_loss(q, k, weights, attn_q, attn_k, attn_lse, **kwargs) -> torch.Tensor:
    """``context_parallel_indexer_kl`` as a differentiable loss (gradients to ``q``, this rank's ``k`` and
    ``weights``); the backward needs no communication."""
    def compute():
        return context_parallel_indexer_kl(q.detach(), k.detach(), weights.detach(), attn_q, attn_k, attn_lse,
                                           **kwargs)

    return apply_precomputed(q, k, weights, compute)


def tensor_parallel_loss(q, k, weights, attn_q, attn_k, attn_lse, **kwargs) -> torch.Tensor:
    """``tensor_parallel_indexer_kl`` as a differentiable loss; the backward needs no communication."""
    def compute():
        return tensor_parallel_indexer_kl(q.detach(), k.detach(), weights.detach(), attn_q, attn_k, attn_lse, **kwargs)

    return apply_precomputed(q, k, weights, compute)
