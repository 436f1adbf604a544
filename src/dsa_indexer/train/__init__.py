"""Training the indexer: the KL loss between the main attention and the indexer, forward and backward.

``indexer_kl_loss`` is a ``torch.autograd.Function``: the backend computes the loss and the gradients
of ``q``, ``k`` and ``weights`` in one call (the forward), and the backward scales them by the upstream
gradient. Backends: ``reference`` (``train/reference.py``, float64, any device) and ``triton``
(``train/triton.py``, CUDA); the parallel paths are in ``train/parallel.py``.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from .. import backend as _backend
from .._validation import (
    check_choice,
    check_index_tensor,
    check_positive_int,
    check_same_device,
    check_tensor,
    first_true,
    value_checks_enabled,
)
from .reference import indexer_kl_reference

__all__ = ["indexer_kl_loss", "indexer_kl_reference"]

_INDEXER_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
_ATTN_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_LSE_DTYPES = (torch.float32, torch.float64)
TARGET_NORMS = ("heads", "l1")
REDUCTIONS = ("mean", "sum")


def _check_real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def _key_count(num_tokens: int, cu_seqlens: torch.Tensor | None, ratio: int) -> int | None:
    """``Σ_b len_b // ratio`` (``None`` when it would need a device read that is switched off)."""
    if cu_seqlens is None:
        return num_tokens // ratio
    if not value_checks_enabled():
        return None
    lengths = cu_seqlens[1:].to(torch.int64) - cu_seqlens[:-1].to(torch.int64)
    return int((lengths // ratio).sum())


def _check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> None:
    check_index_tensor("cu_seqlens", cu_seqlens, ndim=1)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have at least 2 entries ([B + 1], B >= 1), got {cu_seqlens.shape[0]}")
    if not value_checks_enabled():
        return
    values = cu_seqlens.to(torch.int64)
    first, last = values[0], values[-1]
    decreasing = values[1:] < values[:-1]
    bad_ends, bad_order = torch.stack((first != 0, last != num_tokens)), decreasing.any()
    if not bool(bad_ends.any() | bad_order):
        return
    if bool(first != 0):
        raise ValueError(f"cu_seqlens[0] must be 0, got {int(first)}")
    if bool(last != num_tokens):
        raise ValueError(f"cu_seqlens[-1] must equal the number of query rows T = {num_tokens}, got {int(last)}")
    entry = first_true(decreasing)
    raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{entry}] = {int(values[entry])} > "
                     f"cu_seqlens[{entry + 1}] = {int(values[entry + 1])}")


def _check_topk(topk_indices: torch.Tensor, num_tokens: int, cu_seqlens, ratio: int) -> None:
    check_index_tensor("topk_indices", topk_indices, ndim=2)
    if topk_indices.shape[0] != num_tokens:
        raise ValueError(f"topk_indices must have T = {num_tokens} rows (one per query), got shape "
                         f"{list(topk_indices.shape)}")
    if not value_checks_enabled() or topk_indices.numel() == 0:
        return
    rows = torch.arange(num_tokens, device=topk_indices.device)
    if cu_seqlens is None:
        limit = torch.full_like(rows, num_tokens // ratio)
    else:
        bounds = cu_seqlens.to(torch.int64)
        seq = torch.searchsorted(bounds, rows, right=True) - 1
        limit = (bounds[seq + 1] - bounds[seq]) // ratio
    ids = topk_indices.to(torch.int64)
    bad = (ids < -1) | (ids >= limit[:, None])
    if bool(bad.any()):
        row = first_true(bad.any(1))
        col = first_true(bad[row])
        raise ValueError(
            f"topk_indices must hold sequence-local key ids in [0, T_k of the row's sequence) or -1, got "
            f"topk_indices[{row}, {col}] = {int(ids[row, col])} where that sequence has {int(limit[row])} keys"
        )


def validate(q, k, weights, attn_q, attn_k, attn_lse, *, softmax_scale, cu_seqlens, topk_indices, compress_ratio,
             target_norm, reduction, coeff, check_key_count: bool = True) -> None:
    """Every check of ``indexer_kl_loss`` (the parallel paths reuse it on their local shards, where the key
    count is checked across ranks instead: ``check_key_count=False``)."""
    check_tensor("q", q, dtype=_INDEXER_DTYPES, ndim=3)
    num_tokens, index_heads, index_dim = q.shape
    check_tensor("k", k, dtype=q.dtype, ndim=2)
    if k.shape[1] != index_dim:
        raise ValueError(f"k must have shape [T_k, D_I] with D_I = {index_dim} (from q), got {list(k.shape)}")
    check_tensor("weights", weights, dtype=_INDEXER_DTYPES, shape=(num_tokens, index_heads))
    check_tensor("attn_q", attn_q, dtype=_ATTN_DTYPES, ndim=3)
    if attn_q.shape[0] != num_tokens:
        raise ValueError(f"attn_q must have shape [T, H, D_a] with T = {num_tokens} (from q), got {list(attn_q.shape)}")
    heads, attn_dim = attn_q.shape[1], attn_q.shape[2]
    check_tensor("attn_k", attn_k, dtype=attn_q.dtype, ndim=(2, 3))
    if attn_k.shape[-1] != attn_dim or attn_k.shape[0] != k.shape[0]:
        raise ValueError(f"attn_k must have shape [T_k, D_a] or [T_k, H_kv, D_a] with T_k = {k.shape[0]} (from k) "
                         f"and D_a = {attn_dim} (from attn_q), got {list(attn_k.shape)}")
    if attn_k.dim() == 3 and (attn_k.shape[1] == 0 or heads % attn_k.shape[1] != 0):
        raise ValueError(f"attn_k's key heads H_kv must divide the H = {heads} heads of attn_q, got H_kv = "
                         f"{attn_k.shape[1]}")
    check_tensor("attn_lse", attn_lse, dtype=_LSE_DTYPES, shape=(num_tokens, heads))
    _check_real("softmax_scale", softmax_scale)
    _check_real("coeff", coeff)
    check_positive_int("compress_ratio", compress_ratio)
    check_choice("target_norm", target_norm, TARGET_NORMS)
    check_choice("reduction", reduction, REDUCTIONS)
    check_same_device(q=q, k=k, weights=weights, attn_q=attn_q, attn_k=attn_k, attn_lse=attn_lse,
                      cu_seqlens=cu_seqlens, topk_indices=topk_indices)
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, num_tokens)
    if check_key_count:
        expected = _key_count(num_tokens, cu_seqlens, compress_ratio)
        if expected is not None and k.shape[0] != expected:
            source = "T // compress_ratio" if cu_seqlens is None else "Σ_b len_b // compress_ratio over cu_seqlens"
            raise ValueError(f"k must have {source} = {expected} rows, got {k.shape[0]}")
    if topk_indices is not None:
        _check_topk(topk_indices, num_tokens, cu_seqlens, compress_ratio)


def _triton_module_exists() -> bool:
    return _backend.triton_available() and importlib.util.find_spec(f"{__name__}.triton") is not None


def resolve_backend(backend: str, device: torch.device, dtypes) -> str:
    """``"triton"`` or ``"reference"`` for tensors of these dtypes on ``device``: ``"auto"`` picks Triton for
    CUDA tensors when ``train/triton.py`` imports (float64 always runs the reference), an explicit backend
    beats ``DSA_INDEXER_BACKEND``; ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1``."""
    has_kernel = torch.float64 not in dtypes and _triton_module_exists()
    if _backend.resolve(backend, device, has_kernel) == "reference":
        return "reference"
    try:
        from . import triton  # noqa: F401
    except ImportError:
        if _backend.requested_backend(backend) == "triton":
            raise
        return "reference"
    return "triton"


def _implementation(backend: str, device: torch.device, dtypes):
    """The backend function for these tensors (``resolve_backend``'s choice)."""
    if resolve_backend(backend, device, dtypes) == "reference":
        return indexer_kl_reference
    from .triton import indexer_kl_triton

    return indexer_kl_triton


class _PrecomputedGrads(torch.autograd.Function):
    """Loss whose gradients were computed with it: backward returns ``grad_output · grad`` for q, k, weights."""

    @staticmethod
    def forward(ctx, q, k, weights, compute):
        loss, dq, dk, dw = compute()
        ctx.save_for_backward(dq, dk, dw)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        dq, dk, dw = ctx.saved_tensors
        return (dq * grad_output.to(dq.dtype), dk * grad_output.to(dk.dtype), dw * grad_output.to(dw.dtype), None)


def apply_precomputed(q, k, weights, compute) -> torch.Tensor:
    """The loss from ``compute() -> (loss, dq, dk, dw)`` with autograd to ``q``, ``k``, ``weights``."""
    return _PrecomputedGrads.apply(q, k, weights, compute)


def indexer_kl_loss(q, k, weights, attn_q, attn_k, attn_lse, *, softmax_scale: float, cu_seqlens=None,
                    topk_indices=None, compress_ratio: int = 1, target_norm: str = "heads", reduction: str = "mean",
                    coeff: float = 1.0, backend: str = "auto") -> torch.Tensor:
    r"""KL divergence from the main attention's head-summed distribution to the indexer's softmax.

    Math (one packed batch of ``T`` query tokens; for query row ``t`` of a sequence, ``V_t`` is the set of
    sequence-local keys it sees):

    - indexer logits ``I[t,s] = Σ_j w[t,j]·relu(q[t,j]·k[s])``, ``π = softmax over V_t of I[t]``,
      ``LSE_I[t] = log Σ_{s∈V_t} exp I[t,s]``;
    - target ``P_h[t,s] = exp(softmax_scale·attn_q[t,h]·attn_k[s] − attn_lse[t,h])``,
      ``p[t,s] = Σ_h P_h[t,s] / D_t`` with ``D_t = H`` (``target_norm="heads"``: each head's LSE is over
      ``V_t``) or ``D_t = Σ_{s∈V_t} Σ_h P_h[t,s]`` (``"l1"``: the attention also saw other keys);
    - ``KL_t = Σ_{s∈V_t} p·(log p − I) + LSE_I[t]`` (``0·log 0 = 0``); rows with empty ``V_t`` (and, for
      ``"l1"``, rows whose target mass is 0) are not valid: they contribute 0 and are not counted in ``N``;
    - ``loss = coeff · Σ_t KL_t / N`` (``reduction="mean"``; 0 when ``N = 0``) or ``coeff · Σ_t KL_t``
      (``"sum"``);
    - gradients, ``a = q[t,j]·k[s]``, ``G = (coeff/N)·(π − p)`` on ``V_t`` (``coeff·(π − p)`` for
      ``"sum"``): ``dw[t,j] = Σ_s G·relu(a)``, ``dq[t,j] = w[t,j]·Σ_s G·1[a>0]·k[s]``,
      ``dk[s] = Σ_t Σ_j G·w[t,j]·1[a>0]·q[t,j]``. ``attn_*`` get no gradient (the target is detached).

    ``KL_t`` is the KL divergence when ``p`` sums to 1 over ``V_t`` (always for ``"l1"``; for ``"heads"``
    when ``attn_lse`` is over ``V_t``); ``G = π − p`` is the exact gradient of the formula either way.

    Args:
        q: indexer queries ``[T, H_I, D_I]``, bfloat16, float32 or float64.
        k: indexer keys ``[T_k, D_I]``, q's dtype.
        weights: indexer head weights ``[T, H_I]``, bfloat16, float32 or float64 (any scale already folded in).
        attn_q: main-attention queries ``[T, H, D_a]`` (bfloat16, float16, float32 or float64).
        attn_k: main-attention keys ``[T_k, D_a]`` (MQA / MLA latent) or ``[T_k, H_kv, D_a]`` (GQA, head
            ``h`` reads key head ``h // (H / H_kv)``), attn_q's dtype.
        attn_lse: ``[T, H]`` float32 (or float64): natural-log LSE of ``softmax_scale·attn_q[t,h]·attn_k``
            over the keys the attention saw. Read only on valid rows, where it must be finite.
        softmax_scale: the main attention's softmax scale (finite).
        cu_seqlens: ``[B + 1]`` int32/int64 packed sequence bounds, ``0 = cu[0] <= ... <= cu[B] = T``; None is
            one sequence of ``T`` tokens. Sequence ``b`` has ``len_b // compress_ratio`` keys, packed in order:
            ``T_k = Σ_b len_b // compress_ratio``.
        topk_indices: None (dense stage: ``V_t`` = every visible key) or ``[T, K]`` int32/int64 (sparse
            stage): sequence-local key ids in ``[0, len_b // compress_ratio)``, ``-1`` padding; ``V_t`` is
            the set of listed ids that are visible (duplicates count once; invisible ids are ignored).
        compress_ratio: ``r >= 1``; the query at sequence-local position ``p`` sees keys ``j < (p + 1) // r``
            (``r = 1``: ``j <= p``). The first ``r - 1`` rows of each sequence see no key.
        target_norm: ``"heads"`` or ``"l1"`` (see the math).
        reduction: ``"mean"`` or ``"sum"``.
        coeff: loss coefficient ``c`` (finite).
        backend: ``"auto"`` (Triton for CUDA tensors when ``dsa_indexer.train.triton`` imports; float64 and
            CPU tensors use the reference), ``"reference"`` or ``"triton"``; ``DSA_INDEXER_BACKEND`` changes what
            ``"auto"`` means (an explicit backend wins).

    Returns:
        The loss, a float32 scalar tensor (float64 for float64 ``q``) on the inputs' device, differentiable with respect to ``q``,
        ``k`` and ``weights`` (gradients in their dtypes). The gradients are computed with the loss; the
        backward only multiplies them by the upstream gradient.

    Raises:
        TypeError / ValueError naming the argument, before anything is computed: wrong types, dtypes,
        shapes, devices, strings, a ``cu_seqlens`` that does not run from 0 to ``T`` non-decreasing, a key
        count other than ``Σ_b len_b // r``, topk ids outside ``[-1, keys of the row's sequence)``. The
        value checks read device values once each (skipped under CUDA graph capture and with
        ``DSA_INDEXER_SKIP_VALUE_CHECKS=1``).

    Example::

        T, H_I, D_I, H, D_a = 256, 8, 32, 4, 64
        q = torch.randn(T, H_I, D_I, requires_grad=True)
        k = torch.randn(T, D_I, requires_grad=True)
        w = torch.randn(T, H_I, requires_grad=True)
        attn_q, attn_k = torch.randn(T, H, D_a), torch.randn(T, D_a)
        scores = torch.einsum("thd,sd->ths", attn_q, attn_k) * D_a**-0.5
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        lse = scores.masked_fill(~causal[:, None], float("-inf")).logsumexp(-1)   # [T, H]
        loss = indexer_kl_loss(q, k, w, attn_q, attn_k, lse, softmax_scale=D_a**-0.5)
        loss.backward()
    """
    validate(q, k, weights, attn_q, attn_k, attn_lse, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
             topk_indices=topk_indices, compress_ratio=compress_ratio, target_norm=target_norm, reduction=reduction,
             coeff=coeff)
    _backend.requested_backend(backend)
    implementation = _implementation(backend, q.device, (q.dtype, weights.dtype, attn_q.dtype, attn_lse.dtype))
    if topk_indices is not None:
        topk_indices = topk_indices.to(torch.int32)  # the index-dtype policy: int64 accepted, int32 inside

    def compute():
        return implementation(q.detach(), k.detach(), weights.detach(), attn_q.detach(), attn_k.detach(),
                              attn_lse.detach(), softmax_scale=float(softmax_scale), cu_seqlens=cu_seqlens,
                              topk_indices=topk_indices, compress_ratio=compress_ratio, target_norm=target_norm,
                              reduction=reduction, coeff=float(coeff))

    return apply_precomputed(q, k, weights, compute)
