"""The indexer KL loss over a process group: keys sharded (context parallel) or heads sharded (tensor parallel).

Communication is linear in ``T``; no ``T × T`` tensor travels, and every reduction adds the ranks' parts in rank
order, so the result equals one process bit for bit (``context_parallel_single_process``,
``tensor_parallel_single_process`` run the same pieces over the same partition in one process). The pieces are
the backend's, chosen once per call: the float64 reference (``train/reference.py``, any device) or the Triton
kernels (``train/triton.py``; CUDA tensors, bf16/fp32). The steps and what each exchange moves are in
``train/README.md`` ("Parallel training").
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate

import torch

from . import apply_precomputed, resolve_backend, validate
from .reference import Inputs, Layout, Merged, RowStats, loss_dtype, merge_stats, ordered_sum, row_grads, row_stats

__all__ = [
    "balanced_row_blocks",
    "context_parallel_indexer_kl",
    "context_parallel_loss",
    "context_parallel_single_process",
    "tensor_parallel_indexer_kl",
    "tensor_parallel_loss",
    "tensor_parallel_single_process",
]


def balanced_row_blocks(layout: Layout, world_size: int) -> list[tuple[int, int]]:
    """Contiguous blocks of query rows, one per rank, with about equal dense causal work (visible keys)."""
    cumulative = list(accumulate(layout.visible_counts(), initial=0))
    total = cumulative[-1]
    cuts = [0] + [bisect_left(cumulative, -(-total * r // world_size)) for r in range(1, world_size)]
    cuts.append(len(cumulative) - 1)
    return list(zip(cuts[:-1], cuts[1:]))


# The pieces each rank runs; the single-process definitions call the same ones, in the same order.


@dataclass
class _Partials:
    """One shard's contribution: gradients (the reference: float64; the kernels: fp32) and, for the kernels,
    the row loss parts ``[T]`` (``None`` where the loss comes from elsewhere)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dw: torch.Tensor
    kl: torch.Tensor | None


class _ReferencePieces:
    """The float64 pieces of ``train/reference.py``: six row statistics per shard; the loss comes out of their
    merge (the entropy of a head-sharded run from the row blocks)."""

    def __init__(self, call: dict, dtypes, chunk_rows):
        self.call, self.dtypes, self.chunk_rows = call, dtypes, chunk_rows
        self.options = dict(target_norm=call["target_norm"], reduction=call["reduction"], coeff=call["coeff"])

    def shard(self, q, k, weights, attn_q, attn_k, attn_lse, *, num_heads, key_offset=None) -> Inputs:
        c = self.call
        return Inputs.of(q, k, weights, attn_q, attn_k, attn_lse, c["softmax_scale"], c["cu_seqlens"],
                         c["topk_indices"], c["compress_ratio"], key_base=key_offset or 0)

    def stats(self, x: Inputs) -> torch.Tensor:
        return row_stats(x, chunk_rows=self.chunk_rows).as_tensor()

    def merge_keys(self, stats, num_heads) -> Merged:
        return merge_stats([RowStats.from_tensor(s) for s in stats], num_heads=num_heads, **self.options)

    def row_block(self, whole: Inputs, rows, stats) -> torch.Tensor:
        """``Σ_s p̃ log p̃`` over all heads on the query rows ``rows`` (0 elsewhere)."""
        return row_stats(whole, rows=rows, chunk_rows=self.chunk_rows).entropy

    def merge_heads(self, stats, block, num_heads) -> Merged:
        """The indexer statistics are the same on every rank (rank 0's are used), the target's mass and cross
        term are summed in rank order, the entropy comes from the row blocks (or is left out)."""
        first = RowStats.from_tensor(stats[0])
        entropy = torch.zeros_like(first.mass) if block is None else block
        combined = RowStats(first.count, first.max, first.sumexp, ordered_sum([s[3] for s in stats]),
                            ordered_sum([s[4] for s in stats]), entropy)
        return merge_stats([combined], num_heads=num_heads, with_entropy=block is not None, **self.options)

    def grads(self, x: Inputs, merged: Merged, *, with_pi: bool, head_shard: bool) -> _Partials:
        dq, dk, dw = row_grads(x, merged, with_pi=with_pi, chunk_rows=self.chunk_rows)
        return _Partials(dq, dk, dw, None)

    def outputs(self, x, merged: Merged, dq, dk, dw, kl):
        q_dtype, k_dtype, w_dtype = self.dtypes
        return loss_dtype(q_dtype, merged.loss), dq.to(q_dtype), dk.to(k_dtype), dw.to(w_dtype)


@dataclass
class _KernelMerged:
    lse: torch.Tensor
    denom: torch.Tensor
    kl: torch.Tensor | None  # the loss parts of the row blocks (tensor parallel, exact loss)


class _KernelPieces:
    """The Triton pieces of ``train/triton.py``: ``[2, T]`` fp32 statistics per shard (``LSE_I`` over its keys
    and the ``"l1"`` target mass), fp32 partial gradients and row loss parts."""

    def __init__(self, call: dict, dtypes):
        from . import triton

        self.kernels, self.call, self.dtypes = triton, call, dtypes

    def shard(self, q, k, weights, attn_q, attn_k, attn_lse, *, num_heads, key_offset=None):
        key_shard = None if key_offset is None else self.kernels.KeyShard(key_offset, k.shape[0])
        return self.kernels.prepare(q, k, weights, attn_q, attn_k, attn_lse, **self.call, key_shard=key_shard,
                                    num_heads=num_heads)

    def stats(self, x) -> torch.Tensor:
        return self.kernels.row_statistics(x)

    def merge_keys(self, stats, num_heads) -> _KernelMerged:
        return _KernelMerged(*self.kernels.merge_key_statistics(stats), None)

    def row_block(self, whole, rows, stats) -> torch.Tensor:
        """The loss parts over all heads on the query rows ``rows`` (0 elsewhere)."""
        lse, denom = self.kernels.merge_head_statistics(stats)
        return self.kernels.row_gradients(whole, lse, denom, rows=rows, gradients=False)[0]

    def merge_heads(self, stats, block, num_heads) -> _KernelMerged:
        return _KernelMerged(*self.kernels.merge_head_statistics(stats), block)

    def grads(self, x, merged: _KernelMerged, *, with_pi: bool, head_shard: bool) -> _Partials:
        # A head shard's loss part leaves out Σ p log p (its p is partial): the cross-entropy part, summed
        # over the shards, is the loss without the entropy (exact_loss=False).
        kl, dq, dk, dw = self.kernels.row_gradients(x, merged.lse, merged.denom, pi_weight=1.0 if with_pi else 0.0,
                                                    entropy=not head_shard, partial=True)
        return _Partials(dq, dk, dw, kl if merged.kl is None else None)

    def outputs(self, x, merged: _KernelMerged, dq, dk, dw, kl):
        q_dtype, k_dtype, w_dtype = self.dtypes
        loss = self.kernels.finish_loss(x, merged.lse, kl if merged.kl is None else merged.kl)
        return loss, dq.to(q_dtype), dk.to(k_dtype), dw.to(w_dtype)


def _pieces(backend, q, k, weights, attn_q, attn_lse, call: dict, chunk_rows):
    """The backend's pieces for these tensors (``indexer_kl_loss``'s rule: ``"auto"`` runs the kernels for
    CUDA tensors that are not float64)."""
    dtypes = (q.dtype, k.dtype, weights.dtype)
    if resolve_backend(backend, q.device, (q.dtype, weights.dtype, attn_q.dtype, attn_lse.dtype)) == "triton":
        return _KernelPieces(call, dtypes)
    return _ReferencePieces(call, dtypes, chunk_rows)


def _call(softmax_scale, cu_seqlens, topk_indices, compress_ratio, target_norm, reduction, coeff) -> dict:
    if topk_indices is not None:
        topk_indices = topk_indices.to(torch.int32)  # the index-dtype policy: int64 accepted, int32 inside
    return dict(softmax_scale=float(softmax_scale), cu_seqlens=cu_seqlens, topk_indices=topk_indices,
                compress_ratio=compress_ratio, target_norm=target_norm, reduction=reduction, coeff=float(coeff))


def _head_shard(attn_q, attn_k, attn_lse, heads: tuple[int, int]):
    """``attn_q``, ``attn_k``, ``attn_lse`` restricted to the heads ``[h0, h1)`` (GQA: their key heads)."""
    h0, h1 = heads
    if attn_k.dim() == 3:
        group = attn_q.shape[1] // attn_k.shape[1]
        attn_k = attn_k[:, h0 // group: (h1 - 1) // group + 1].contiguous()
    return attn_q[:, h0:h1].contiguous(), attn_k, attn_lse[:, h0:h1].contiguous()


def context_parallel_single_process(q, k, weights, attn_q, attn_k, attn_lse, *, key_splits, softmax_scale,
                                    cu_seqlens=None, topk_indices=None, compress_ratio=1, target_norm="heads",
                                    reduction="mean", coeff=1.0, backend="auto", chunk_rows=None):
    """What ``context_parallel_indexer_kl`` computes over key shards of sizes ``key_splits`` (in rank order),
    in one process with the same backend pieces: ``(loss, dq, dk [T_k, D_I] (all shards), dweights)``."""
    call = _call(softmax_scale, cu_seqlens, topk_indices, compress_ratio, target_norm, reduction, coeff)
    pieces = _pieces(backend, q, k, weights, attn_q, attn_lse, call, chunk_rows)
    heads = attn_q.shape[1]
    offsets = list(accumulate(key_splits, initial=0))
    # Each shard in its own allocation, as on a rank.
    shards = [pieces.shard(q, k[lo:hi].clone(), weights, attn_q, attn_k[lo:hi].clone(), attn_lse, num_heads=heads,
                           key_offset=lo) for lo, hi in zip(offsets[:-1], offsets[1:])]
    merged = pieces.merge_keys([pieces.stats(x) for x in shards], heads)
    parts = [pieces.grads(x, merged, with_pi=True, head_shard=False) for x in shards]
    kl = None if parts[0].kl is None else ordered_sum([p.kl for p in parts])
    return pieces.outputs(shards[0], merged, ordered_sum([p.dq for p in parts]), torch.cat([p.dk for p in parts]),
                          ordered_sum([p.dw for p in parts]), kl)


def tensor_parallel_single_process(q, k, weights, attn_q, attn_k, attn_lse, *, world_size, softmax_scale,
                                   cu_seqlens=None, topk_indices=None, compress_ratio=1, target_norm="heads",
                                   reduction="mean", coeff=1.0, exact_loss=True, backend="auto", chunk_rows=None):
    """What ``tensor_parallel_indexer_kl`` computes over ``world_size`` equal head shards, in one process with
    the same backend pieces."""
    call = _call(softmax_scale, cu_seqlens, topk_indices, compress_ratio, target_norm, reduction, coeff)
    pieces = _pieces(backend, q, k, weights, attn_q, attn_lse, call, chunk_rows)
    heads = attn_q.shape[1]
    per_rank = heads // world_size
    shards = [pieces.shard(q, k, weights, *_head_shard(attn_q, attn_k, attn_lse, (r * per_rank, (r + 1) * per_rank)),
                           num_heads=heads) for r in range(world_size)]
    stats = [pieces.stats(x) for x in shards]
    block = None
    if exact_loss:
        whole = pieces.shard(q, k, weights, attn_q, attn_k, attn_lse, num_heads=heads)
        blocks = balanced_row_blocks(Layout.of(q.shape[0], cu_seqlens, compress_ratio), world_size)
        block = ordered_sum([pieces.row_block(whole, rows, stats) for rows in blocks])
    merged = pieces.merge_heads(stats, block, heads)
    parts = [pieces.grads(x, merged, with_pi=r == 0, head_shard=True) for r, x in enumerate(shards)]
    summed = [None if getattr(parts[0], name) is None else ordered_sum([getattr(p, name) for p in parts])
              for name in ("dq", "dk", "dw", "kl")]
    return pieces.outputs(shards[0], merged, *summed)


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
    """Sum of every rank's ``tensor`` added in rank order (the same bits as ``ordered_sum`` of them):
    ``all_to_all`` of slices, a rank-order sum of each slice, ``all_gather`` of the sums."""
    dist = _dist()
    world = dist.get_world_size(group)
    flat = tensor.reshape(-1)
    width = -(-flat.numel() // world)
    padded = torch.zeros(world * width, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    received = torch.empty_like(padded)
    dist.all_to_all_single(received, padded, group=group)
    mine = ordered_sum(list(received.view(world, width).unbind(0)))
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


def _reduce(tensor, group):
    return None if tensor is None else _ordered_all_reduce(tensor, group)


def context_parallel_indexer_kl(q, k, weights, attn_q, attn_k, attn_lse, *, softmax_scale: float, cu_seqlens=None,
                                topk_indices=None, compress_ratio: int = 1, target_norm: str = "heads",
                                reduction: str = "mean", coeff: float = 1.0, backend: str = "auto", group=None,
                                chunk_rows=None):
    """Loss and gradients with the keys sharded over ``group`` (see ``train/README.md`` for the layout).

    Args: as ``indexer_kl_loss``, except that ``k [n_r, D_I]`` and ``attn_k [n_r, ...]`` are this rank's
    contiguous shard of the packed keys (rank order; ``Σ_r n_r = T_k``); every other tensor is whole.
    ``backend``: ``"auto"`` (the kernels for CUDA tensors that are not float64, as ``indexer_kl_loss``),
    ``"reference"`` or ``"triton"``. ``chunk_rows``: the reference's query chunk (the kernels ignore it).
    Returns ``(loss, dq [T, H_I, D_I], dk [n_r, D_I] (this shard's keys), dweights [T, H_I])``, the same on
    every rank except ``dk``.
    """
    validate(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
             topk_indices=topk_indices, compress_ratio=compress_ratio, target_norm=target_norm, reduction=reduction,
             coeff=coeff, check_key_count=False)
    call = _call(softmax_scale, cu_seqlens, topk_indices, compress_ratio, target_norm, reduction, coeff)
    pieces = _pieces(backend, q, k, weights, attn_q, attn_lse, call, chunk_rows)
    descriptor = [*q.shape, attn_q.shape[1], attn_q.shape[2], attn_k.dim(), k.shape[0]]
    names = ["T", "H_I", "D_I", "H", "D_a", "attn_k rank", "shard size"]
    rows = _agree(descriptor, group, names, varying=(6,))
    splits = [row[6] for row in rows]
    layout = Layout.of(q.shape[0], cu_seqlens, compress_ratio)
    if sum(splits) != layout.num_keys:
        raise ValueError(f"the key shards (sizes {splits} in rank order) must add up to T_k = Σ_b len_b // "
                         f"compress_ratio = {layout.num_keys}")
    rank, _ = _rank(group)
    heads = attn_q.shape[1]
    x = pieces.shard(q, k, weights, attn_q, attn_k, attn_lse, num_heads=heads, key_offset=sum(splits[:rank]))
    merged = pieces.merge_keys(_all_gather(pieces.stats(x), group), heads)
    part = pieces.grads(x, merged, with_pi=True, head_shard=False)
    return pieces.outputs(x, merged, _reduce(part.dq, group), part.dk, _reduce(part.dw, group),
                          _reduce(part.kl, group))


def tensor_parallel_indexer_kl(q, k, weights, attn_q, attn_k, attn_lse, *, softmax_scale: float, cu_seqlens=None,
                               topk_indices=None, compress_ratio: int = 1, target_norm: str = "heads",
                               reduction: str = "mean", coeff: float = 1.0, exact_loss: bool = True,
                               backend: str = "auto", group=None, chunk_rows=None):
    """Loss and gradients with the main-attention heads sharded over ``group`` (equal shards, rank order).

    Args: as ``indexer_kl_loss``, except that ``attn_q [T, H/W, D_a]``, ``attn_lse [T, H/W]`` and a GQA
    ``attn_k [T_k, H_kv/W, D_a]`` hold this rank's heads; ``exact_loss`` as in ``train/README.md``;
    ``backend`` and ``chunk_rows`` as in ``context_parallel_indexer_kl``.
    Returns ``(loss, dq, dk, dweights)``, the same on every rank.
    """
    validate(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
             topk_indices=topk_indices, compress_ratio=compress_ratio, target_norm=target_norm, reduction=reduction,
             coeff=coeff)
    if not isinstance(exact_loss, bool):
        raise TypeError(f"exact_loss must be a bool, got {type(exact_loss).__name__}")
    call = _call(softmax_scale, cu_seqlens, topk_indices, compress_ratio, target_norm, reduction, coeff)
    pieces = _pieces(backend, q, k, weights, attn_q, attn_lse, call, chunk_rows)
    descriptor = [*q.shape, k.shape[0], *attn_q.shape[1:], attn_k.dim(), attn_k.shape[1] if attn_k.dim() == 3 else 0]
    _agree(descriptor, group, ["T", "H_I", "D_I", "T_k", "heads per rank", "D_a", "attn_k rank", "key heads per rank"])
    rank, world = _rank(group)
    heads = attn_q.shape[1] * world
    x = pieces.shard(q, k, weights, attn_q, attn_k, attn_lse, num_heads=heads)
    stats = _all_gather(pieces.stats(x), group)
    block = None
    if exact_loss:
        full_k = torch.cat(_all_gather(attn_k, group), dim=1) if attn_k.dim() == 3 else attn_k
        whole = pieces.shard(q, k, weights, torch.cat(_all_gather(attn_q, group), dim=1), full_k,
                             torch.cat(_all_gather(attn_lse, group), dim=1), num_heads=heads)
        rows = balanced_row_blocks(Layout.of(q.shape[0], cu_seqlens, compress_ratio), world)[rank]
        block = _ordered_all_reduce(pieces.row_block(whole, rows, stats), group)
    merged = pieces.merge_heads(stats, block, heads)
    part = pieces.grads(x, merged, with_pi=rank == 0, head_shard=True)
    return pieces.outputs(x, merged, *(_reduce(t, group) for t in (part.dq, part.dk, part.dw, part.kl)))


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
