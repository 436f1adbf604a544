"""An independent dense oracle of the indexer KL loss and the random cases the training tests share.

``naive_kl`` builds the whole ``[T, T_k]`` visibility mask with Python loops over the rows and computes
the loss with autograd-friendly torch ops (log-softmax, xlogy): it shares no code with the library.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def visibility(num_tokens: int, num_keys: int, cu_seqlens, ratio: int, topk_indices) -> torch.Tensor:
    """bool ``[T, T_k]``: packed key ``s`` is in ``V_t``."""
    bounds = [0, num_tokens] if cu_seqlens is None else [int(v) for v in cu_seqlens]
    mask = torch.zeros(num_tokens, num_keys, dtype=torch.bool)
    key_offset = 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        for position in range(end - start):
            row = start + position
            seen = (position + 1) // ratio
            ids = range(seen) if topk_indices is None else {int(i) for i in topk_indices[row] if 0 <= int(i) < seen}
            for i in ids:
                mask[row, key_offset + i] = True
        key_offset += (end - start) // ratio
    assert key_offset == num_keys
    return mask


def attention_lse(attn_q, attn_k, softmax_scale: float, mask: torch.Tensor) -> torch.Tensor:
    """float64 ``[T, H]`` LSE of each head over the keys of ``mask`` (``-inf`` on empty rows)."""
    scores = torch.einsum("thd,shd->ths", attn_q.double(), expand_heads(attn_k, attn_q.shape[1]).double())
    scores = (scores * softmax_scale).masked_fill(~mask[:, None, :], float("-inf"))
    return scores.logsumexp(-1)


def expand_heads(attn_k: torch.Tensor, heads: int) -> torch.Tensor:
    if attn_k.dim() == 2:
        return attn_k[:, None, :].expand(-1, heads, -1)
    return attn_k.repeat_interleave(heads // attn_k.shape[1], dim=1)


def naive_kl(q, k, weights, attn_q, attn_k, attn_lse, *, softmax_scale, cu_seqlens=None, topk_indices=None,
             compress_ratio=1, target_norm="heads", reduction="mean", coeff=1.0) -> torch.Tensor:
    """The loss as a differentiable function of ``q, k, weights`` (float64)."""
    mask = visibility(q.shape[0], k.shape[0], cu_seqlens, compress_ratio, topk_indices)
    logits = torch.einsum("tj,tjs->ts", weights, torch.relu(torch.einsum("tjd,sd->tjs", q, k)))
    log_pi = torch.log_softmax(logits.masked_fill(~mask, -1e30), dim=-1)
    scores = torch.einsum("thd,shd->ths", attn_q.double(), expand_heads(attn_k, attn_q.shape[1]).double())
    lse = torch.where(mask.any(1, keepdim=True), attn_lse.double(), 0.0)
    target = torch.exp(softmax_scale * scores - lse[:, :, None]).sum(1).masked_fill(~mask, 0.0)
    heads = attn_q.shape[1]
    denom = torch.full((q.shape[0], 1), float(heads), dtype=torch.float64) if target_norm == "heads" else \
        target.sum(-1, keepdim=True)
    valid = mask.any(1) & (denom[:, 0] > 0)
    p = target / torch.where(denom > 0, denom, 1.0)
    kl = (torch.special.xlogy(p, p) - p * log_pi.masked_fill(~mask, 0.0)).sum(-1)
    kl = torch.where(valid, kl, 0.0)
    count = int(valid.sum())
    return coeff * kl.sum() / (count if reduction == "mean" and count else 1)


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor
    attn_q: torch.Tensor
    attn_k: torch.Tensor
    attn_lse: torch.Tensor
    kwargs: dict

    def args(self):
        return self.q, self.k, self.weights, self.attn_q, self.attn_k, self.attn_lse


def make_case(*, lengths=(13,), ratio=1, heads=4, kv_heads=0, index_heads=3, index_dim=8, attn_dim=16, topk=None,
              target_norm="heads", reduction="mean", coeff=1.0, softmax_scale=0.3, dtype=torch.float64,
              seed=0, lse_over_visible=True) -> Case:
    """A random packed batch; ``kv_heads=0`` is MQA (``attn_k [T_k, D_a]``); ``topk`` ids are drawn from
    ``[-1, keys + 2)`` (padding, duplicates and invisible ids included) and clipped to the sequence's keys.
    The attention LSE is over ``V_t`` or, with ``lse_over_visible=False``, over all dense visible keys."""
    g = torch.Generator().manual_seed(seed)
    num_tokens = sum(lengths)
    cu_seqlens = None if len(lengths) == 1 else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                                                             dtype=torch.int32)
    key_counts = [n // ratio for n in lengths]
    num_keys = sum(key_counts)
    q = torch.randn(num_tokens, index_heads, index_dim, generator=g, dtype=torch.float64)
    k = torch.randn(num_keys, index_dim, generator=g, dtype=torch.float64)
    weights = torch.randn(num_tokens, index_heads, generator=g, dtype=torch.float64)
    attn_q = torch.randn(num_tokens, heads, attn_dim, generator=g, dtype=torch.float64)
    shape = (num_keys, attn_dim) if kv_heads == 0 else (num_keys, kv_heads, attn_dim)
    attn_k = torch.randn(*shape, generator=g, dtype=torch.float64)
    topk_indices = None
    if topk is not None:
        rows = []
        for n, keys in zip(lengths, key_counts):
            ids = torch.randint(-1, max(keys, 1) + 2, (n, topk), generator=g)
            rows.append(torch.where(ids < keys, ids, -1))
        topk_indices = torch.cat(rows).to(torch.int32) if rows else torch.empty(0, topk, dtype=torch.int32)
    mask = visibility(num_tokens, num_keys, cu_seqlens, ratio, topk_indices if lse_over_visible else None)
    # float64 cases keep a float64 LSE so that p sums to 1 to float64 rounding (the oracle's KL and the
    # formula of the contract then have the same gradient).
    attn_lse = attention_lse(attn_q, attn_k, softmax_scale, mask).to(torch.float64 if dtype == torch.float64 else
                                                                       torch.float32)
    cast = lambda t: t.to(dtype)  # noqa: E731
    kwargs = dict(softmax_scale=softmax_scale, cu_seqlens=cu_seqlens, topk_indices=topk_indices,
                  compress_ratio=ratio, target_norm=target_norm, reduction=reduction, coeff=coeff)
    return Case(cast(q), cast(k), cast(weights), cast(attn_q), cast(attn_k), attn_lse, kwargs)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖got − expected‖ / ‖expected‖`` in float64 (absolute when ``expected`` is 0)."""
    got, expected = got.double(), expected.double()
    scale = expected.norm().item()
    return (got - expected).norm().item() / (scale if scale > 0 else 1.0)


def kernel_tier_failures(got, want, dtype: torch.dtype) -> list[str]:
    """What of ``got = (loss, dq, dk, dw)`` from the kernels falls outside the kernel tier around ``want`` (the
    tolerances of ``test_kernel.py``: loss to 1e-5 relative, gradients to ``calc_diff`` 1e-9 for float32
    inputs and 5e-6 for bfloat16)."""
    from dsa_indexer.testing import calc_diff

    failures = []
    loss, want_loss = float(got[0]), float(want[0])
    if abs(loss - want_loss) > 1e-5 * (1 + abs(want_loss)):
        failures.append(f"loss {loss} vs {want_loss}")
    bound = 1e-9 if dtype == torch.float32 else 5e-6
    for name, x, y in zip(("dq", "dk", "dw"), got[1:], want[1:]):
        if not bool(torch.isfinite(x).all()) or calc_diff(x, y) >= bound:
            failures.append(f"{name}: calc_diff {calc_diff(x, y)}")
    return failures
