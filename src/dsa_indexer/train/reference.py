"""The indexer KL loss, forward and backward, in float64 PyTorch: the definition the kernels must meet.

``indexer_kl_reference`` is the whole computation; it is built from three pieces that the parallel
paths (``dsa_indexer.train.parallel``) reuse, so that a sharded run and a single process share every
floating-point operation:

1. ``row_stats`` — per query row, over a range of packed keys and a range of main-attention heads: the
   number of visible keys, the running max and sum of ``exp(I - max)`` of the indexer logits, and the
   target's unnormalised mass ``S = Σ p̃``, cross term ``X = Σ p̃·I`` and entropy ``E = Σ p̃·log p̃``
   (``p̃ = Σ_h P_h`` over the heads of the range);
2. ``merge_stats`` — combines the statistics of several key ranges in list order into ``LSE_I``, the
   target denominator ``D_t``, the per-row gradient scale ``c/N`` and the loss;
3. ``row_grads`` — the gradients ``dq, dw`` of the rows and ``dk`` of the keys of one range, given the
   merged statistics.

Queries are processed in chunks of rows, so the memory is ``O(chunk · keys · max(H, H_I))`` besides the
inputs and gradients (each chunk holds only the keys its rows can see). Everything is accumulated in
float64 and the results are rounded once: the loss to float32, the gradients to the input dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Layout",
    "Merged",
    "RowStats",
    "indexer_kl_reference",
    "loss_dtype",
    "merge_stats",
    "ordered_sum",
    "row_grads",
    "row_stats",
]

# Elements of one chunk's [rows, heads, keys] float64 intermediate (32 MiB).
_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Layout:
    """Host description of a packed batch: sequence ``b`` owns query rows ``[seq[b], seq[b+1])`` and
    packed key rows ``[keys[b], keys[b+1])``, ``keys[b+1] - keys[b] = (seq[b+1] - seq[b]) // ratio``."""

    seq: tuple[int, ...]
    keys: tuple[int, ...]
    ratio: int

    @staticmethod
    def of(num_tokens: int, cu_seqlens: torch.Tensor | None, ratio: int) -> Layout:
        bounds = [0, num_tokens] if cu_seqlens is None else [int(v) for v in cu_seqlens.tolist()]
        keys = [0]
        for start, end in zip(bounds[:-1], bounds[1:]):
            keys.append(keys[-1] + (end - start) // ratio)
        return Layout(tuple(bounds), tuple(keys), ratio)

    @property
    def num_keys(self) -> int:
        return self.keys[-1]

    def visible_counts(self) -> list[int]:
        """Keys each query row can see in the dense stage, ``(p + 1) // ratio`` for local position ``p``."""
        counts = []
        for start, end in zip(self.seq[:-1], self.seq[1:]):
            counts.extend((p + 1) // self.ratio for p in range(end - start))
        return counts


@dataclass
class Inputs:
    """float64 copies of the inputs (``attn_k`` as ``[T_k, H_kv, D_a]``); ``k`` and ``attn_k`` may hold only
    the packed key rows ``[key_base, key_base + len)`` (a context-parallel shard)."""

    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor
    attn_q: torch.Tensor
    attn_k: torch.Tensor
    attn_lse: torch.Tensor
    softmax_scale: float
    topk_indices: torch.Tensor | None
    layout: Layout
    key_base: int = 0

    @staticmethod
    def of(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale, cu_seqlens, topk_indices, ratio,
           key_base: int = 0) -> Inputs:
        f64 = torch.float64
        attn_k = attn_k if attn_k.dim() == 3 else attn_k.unsqueeze(1)
        return Inputs(
            q.to(f64), k.to(f64), weights.to(f64), attn_q.to(f64), attn_k.to(f64), attn_lse.to(f64),
            float(softmax_scale), None if topk_indices is None else topk_indices.to(torch.int64),
            Layout.of(q.shape[0], cu_seqlens, ratio), key_base,
        )

    @property
    def key_range(self) -> tuple[int, int]:
        return self.key_base, self.key_base + self.k.shape[0]


@dataclass
class RowStats:
    """Per-row statistics over one key range and head range; float64 ``[T]`` except ``count`` (int64)."""

    count: torch.Tensor
    max: torch.Tensor
    sumexp: torch.Tensor
    mass: torch.Tensor
    cross: torch.Tensor
    entropy: torch.Tensor

    @staticmethod
    def empty(num_rows: int, device) -> RowStats:
        zeros = lambda: torch.zeros(num_rows, dtype=torch.float64, device=device)  # noqa: E731
        return RowStats(torch.zeros(num_rows, dtype=torch.int64, device=device),
                        torch.full((num_rows,), float("-inf"), dtype=torch.float64, device=device),
                        zeros(), zeros(), zeros(), zeros())

    def as_tensor(self) -> torch.Tensor:
        """``[6, T]`` float64 (the count exactly), for one collective."""
        return torch.stack((self.count.to(torch.float64), self.max, self.sumexp, self.mass, self.cross, self.entropy))

    @staticmethod
    def from_tensor(packed: torch.Tensor) -> RowStats:
        return RowStats(packed[0].to(torch.int64), *packed[1:].unbind(0))


@dataclass
class Merged:
    """Row quantities after the merge: ``lse`` of the indexer logits, target denominator ``denom``,
    gradient scale ``scale`` (``c/N`` or ``c`` on valid rows, 0 elsewhere), per-row ``kl`` and the loss
    (all float64)."""

    lse: torch.Tensor
    denom: torch.Tensor
    scale: torch.Tensor
    kl: torch.Tensor
    loss: torch.Tensor


def _blocks(layout: Layout, rows: tuple[int, int], keys: tuple[int, int], heads: int, chunk_rows: int | None):
    """``(b, r0, r1, j0, j1)``: query rows ``[r0, r1)`` of sequence ``b`` (packed) and the sequence-local
    keys ``[j0, j1)`` they may see inside the packed key range ``keys``; chunks of rows cap the float64
    intermediates at ``_CHUNK_ELEMENTS`` unless ``chunk_rows`` is given."""
    for b in range(len(layout.seq) - 1):
        start, end = max(layout.seq[b], rows[0]), min(layout.seq[b + 1], rows[1])
        key_base = layout.keys[b]
        lo = max(0, keys[0] - key_base)
        hi = min(layout.keys[b + 1], keys[1]) - key_base
        if start >= end or lo >= hi:
            continue
        span = max(1, min(hi, (end - layout.seq[b]) // layout.ratio) - lo)
        step = chunk_rows or max(1, _CHUNK_ELEMENTS // (span * heads))
        for r0 in range(start, end, step):
            r1 = min(end, r0 + step)
            j1 = min(hi, (r1 - layout.seq[b]) // layout.ratio)
            if j1 > lo:
                yield b, r0, r1, lo, j1


def _block_terms(x: Inputs, b: int, r0: int, r1: int, j0: int, j1: int):
    """Indexer logits ``I``, scores ``a = q·k``, the visibility mask and the target ``p̃`` of one block."""
    layout = x.layout
    key_rows = slice(layout.keys[b] + j0 - x.key_base, layout.keys[b] + j1 - x.key_base)
    q, w, k = x.q[r0:r1], x.weights[r0:r1], x.k[key_rows]
    a = torch.einsum("tjd,sd->tjs", q, k)
    logits = torch.einsum("tj,tjs->ts", w, a.clamp_min(0))
    local = torch.arange(r0, r1, device=q.device) - layout.seq[b]
    columns = torch.arange(j0, j1, device=q.device)
    mask = columns[None, :] < ((local + 1) // layout.ratio)[:, None]
    if x.topk_indices is not None:
        ids = x.topk_indices[r0:r1] - j0
        inside = (ids >= 0) & (ids < j1 - j0)
        selected = torch.zeros(r1 - r0, j1 - j0 + 1, dtype=torch.bool, device=q.device)
        # Out-of-range ids (and -1) land in the spare last column, which is dropped; duplicates count once.
        selected.scatter_(1, torch.where(inside, ids, j1 - j0), True)
        mask &= selected[:, :-1]
    kv_heads = x.attn_k.shape[1]
    # Heads grouped by key head ([t, H_kv, H/H_kv, D_a]): no per-head copy of the keys.
    grouped = x.attn_q[r0:r1].unflatten(1, (kv_heads, -1))
    z = torch.einsum("tkgd,skd->tkgs", grouped, x.attn_k[key_rows]).flatten(1, 2)
    lse = torch.where(mask.any(1, keepdim=True), x.attn_lse[r0:r1], 0.0)
    probs = torch.exp(x.softmax_scale * z - lse[:, :, None]).sum(1)
    target = torch.where(mask, probs, 0.0)
    return logits, a, mask, target


def row_stats(x: Inputs, *, rows: tuple[int, int] | None = None, chunk_rows: int | None = None) -> RowStats:
    """Statistics of query rows ``rows`` (default: all) over the keys ``x`` holds and all its heads."""
    num_rows = x.q.shape[0]
    rows = rows or (0, num_rows)
    keys = x.key_range
    stats = RowStats.empty(num_rows, x.q.device)
    heads = max(x.q.shape[1], x.attn_q.shape[1])
    for b, r0, r1, j0, j1 in _blocks(x.layout, rows, keys, heads, chunk_rows):
        logits, _, mask, target = _block_terms(x, b, r0, r1, j0, j1)
        count = mask.sum(1)
        top = torch.where(mask, logits, float("-inf")).max(1).values
        shift = torch.where(count > 0, top, 0.0)
        stats.count[r0:r1] = count
        stats.max[r0:r1] = top
        stats.sumexp[r0:r1] = torch.where(mask, torch.exp(logits - shift[:, None]), 0.0).sum(1)
        stats.mass[r0:r1] = target.sum(1)
        stats.cross[r0:r1] = (target * torch.where(mask, logits, 0.0)).sum(1)
        stats.entropy[r0:r1] = torch.special.xlogy(target, target).sum(1)
    return stats


def ordered_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts[0] + parts[1] + ...`` added in list order (the fixed order every cross-shard sum uses)."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def merge_stats(parts: Sequence[RowStats], *, num_heads: int, target_norm: str, reduction: str, coeff: float,
                with_entropy: bool = True) -> Merged:
    """Combine statistics of disjoint key ranges in list order.

    ``num_heads`` is the total head count H (the ``"heads"`` denominator). A row is valid when it sees a
    key and, for ``"l1"``, its target mass is positive. ``with_entropy=False`` leaves ``Σ p log p`` out of
    ``KL_t`` (``KL_t = −Σ p·I + LSE_I``; the gradients do not change).
    """
    count = ordered_sum([p.count for p in parts])
    top = parts[0].max
    for part in parts[1:]:
        top = torch.maximum(top, part.max)
    safe_top = torch.where(count > 0, top, 0.0)
    sumexp = ordered_sum([torch.where(p.count > 0, p.sumexp * torch.exp(p.max - safe_top), 0.0) for p in parts])
    mass = ordered_sum([p.mass for p in parts])
    cross = ordered_sum([p.cross for p in parts])
    entropy = ordered_sum([p.entropy for p in parts])
    valid = count > 0
    if target_norm == "l1":
        valid &= mass > 0
        denom = torch.where(valid, mass, 1.0)
    else:
        denom = torch.full_like(mass, float(num_heads))
    # The true LSE wherever the row sees a key (π <= 1 even on an "l1" row without target mass).
    lse = torch.where(count > 0, safe_top + torch.log(torch.where(count > 0, sumexp, 1.0)), 0.0)
    plogp = (entropy - mass * torch.log(denom)) / denom if with_entropy else 0.0
    kl = torch.where(valid, plogp - cross / denom + lse, 0.0)
    num_valid = int(valid.sum())
    divisor = num_valid if reduction == "mean" and num_valid > 0 else 1
    total = kl.sum() * coeff / divisor
    scale = valid.to(torch.float64) * (coeff / divisor)
    return Merged(lse, denom, scale, kl, total)


def row_grads(x: Inputs, merged: Merged, *, with_pi: bool = True, chunk_rows: int | None = None):
    """float64 ``(dq [T, H_I, D_I], dk [keys held, D_I], dw [T, H_I])`` of ``G = scale·(π − p̃/D)`` over
    the keys and heads ``x`` holds; ``with_pi=False`` drops the ``π`` term (head shards other than the
    first, whose partial targets sum to the whole)."""
    rows = (0, x.q.shape[0])
    keys = x.key_range
    dq = torch.zeros_like(x.q)
    dk = torch.zeros_like(x.k)
    dw = torch.zeros_like(x.weights)
    heads = max(x.q.shape[1], x.attn_q.shape[1])
    for b, r0, r1, j0, j1 in _blocks(x.layout, rows, keys, heads, chunk_rows):
        logits, a, mask, target = _block_terms(x, b, r0, r1, j0, j1)
        lse, denom, scale = merged.lse[r0:r1, None], merged.denom[r0:r1, None], merged.scale[r0:r1, None]
        pi = torch.exp(torch.where(mask, logits - lse, float("-inf"))) if with_pi else 0.0
        grad = torch.where(mask, scale * (pi - target / denom), 0.0)
        positive = (a > 0).to(torch.float64)
        key_rows = slice(x.layout.keys[b] + j0 - x.key_base, x.layout.keys[b] + j1 - x.key_base)
        dw[r0:r1] = torch.einsum("ts,tjs->tj", grad, a.clamp_min(0))
        weighted = grad[:, None, :] * positive * x.weights[r0:r1, :, None]
        dq[r0:r1] = torch.einsum("tjs,sd->tjd", weighted, x.k[key_rows])
        dk[key_rows] += torch.einsum("tjs,tjd->sd", weighted, x.q[r0:r1])
    return dq, dk, dw


def loss_dtype(dtype: torch.dtype, loss: torch.Tensor) -> torch.Tensor:
    """The loss rounded to float32, or kept in float64 for float64 inputs (gradcheck)."""
    return loss.to(torch.float64 if dtype == torch.float64 else torch.float32)


def indexer_kl_reference(q, k, weights, attn_q, attn_k, attn_lse, *, softmax_scale: float, cu_seqlens=None,
                         topk_indices=None, compress_ratio: int = 1, target_norm: str = "heads",
                         reduction: str = "mean", coeff: float = 1.0, chunk_rows: int | None = None):
    """The loss and its gradients; arguments and math as ``dsa_indexer.train.indexer_kl_loss`` (not
    validated here). ``chunk_rows`` fixes the query-chunk size (default: from a 32 MiB budget).

    Returns ``(loss [], dq like q, dk like k, dweights like weights)``; the loss is float32 (float64 when q
    is float64).
    """
    x = Inputs.of(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale, cu_seqlens, topk_indices, compress_ratio)
    stats = row_stats(x, chunk_rows=chunk_rows)
    merged = merge_stats([stats], num_heads=attn_q.shape[1], target_norm=target_norm, reduction=reduction,
                         coeff=coeff)
    dq, dk, dw = row_grads(x, merged, chunk_rows=chunk_rows)
    return loss_dtype(q.dtype, merged.loss), dq.to(q.dtype), dk.to(k.dtype), dw.to(weights.dtype)
