"""NVIDIA cuDNN frontend's DSA indexer loss (``cudnn.DSA``, ``nvidia-cudnn-frontend`` >= 1.24) on our inputs: the
training suite's ``cudnn`` baseline (``scripts/cudnn-wheels`` installs it on a GPU machine without network).

cuDNN FE has no loss kernel. Its training path recomputes the target and the indexer scores into fp32 tensors
(``scores``) and runs the indexer backward (``backward``), which consumes them in place and returns the three
gradients:

- dense: ``dense_attn_score_recompute_wrapper`` writes the target mass ``Σ_h P_h`` ``[1, T, T]`` and its L1 norm
  ``[1, T]``, ``dense_indexer_score_recompute_wrapper`` the logits ``I`` ``[1, T, T]`` and ``LSE_I`` ``[1, T]``
  (both zero past the causal bound, or unwritten there); ``dense_indexer_backward_wrapper`` takes the four;
- sparse: ``sparse_attn_score_recompute_wrapper`` writes ``p`` ``[1, T, K]`` (``Σ_h P_h`` over its L1 mass on the
  row's listed slots, 0 on ``-1``), ``sparse_indexer_score_recompute_wrapper`` ``π`` ``[1, T, K]``;
  ``indexer_backward_wrapper`` takes both.

Its math against ``docs/contract.md`` §14: the target is normalised by its L1 mass (ours with
``target_norm="l1"``); the gradient of the logits is ``G = g − π Σ_s g`` with
``g = −c/(B·S_q) · max(p, e^-100) · 1[log π >= −100]`` (the kernels' "clipped-log KL"), which equals ours,
``(c/N)(π − p)``, while no visible ``π`` is below ``e^-100``; its mean divides by every query row ``B·S_q`` (ours
by the rows that see a key: the same for one causal sequence). Its indexer scale is 1 (our weights carry it).
Kernels: SM90 and SM100; bf16 inputs; the backward needs ``H_I >= 64`` and, sparse, ``K % 128 == 0``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

# Elements of the float64 chunk ``loss`` reads at a time ([rows, T] of the dense scores).
_LOSS_CHUNK_ELEMENTS = 1 << 24


def available() -> bool:
    """Whether ``cudnn.deepseek_sparse_attention`` is installed and the current GPU is SM90 or SM100."""
    try:
        found = importlib.util.find_spec("cudnn.deepseek_sparse_attention") is not None
    except (ImportError, OSError):  # finding it imports ``cudnn``, whose compiled module may not load
        return False
    return found and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)


@dataclass(frozen=True)
class Arguments:
    """Our inputs as cuDNN FE takes them: one sequence as a batch of one (BSHD), views of ours where they can be."""

    q: torch.Tensor  # [1, T, H_I, D_I] bf16
    k: torch.Tensor  # [1, T, D_I] bf16
    weights: torch.Tensor  # [1, T, H_I] bf16
    attn_q: torch.Tensor  # [1, T, H, D_a] bf16
    attn_k: torch.Tensor  # [1, T, D_a] bf16
    attn_lse: torch.Tensor  # [1, T, H] fp32
    topk: torch.Tensor | None  # [1, T, K] int32, -1 padded; None: dense
    softmax_scale: float
    coeff: float
    grad_loss: torch.Tensor  # [1] fp32: the loss's upstream gradient, 1


def arguments(q, k, weights, attn_q, attn_k, attn_lse, topk_indices=None, *, softmax_scale: float,
              coeff: float = 1.0) -> Arguments:
    """cuDNN FE's arguments for our packed inputs (``docs/contract.md`` shapes) of one causal sequence with
    ``compress_ratio`` 1 and MQA keys ``attn_k [T, D_a]``; ``ValueError`` for what its kernels do not take."""
    t, index_heads = q.shape[:2]
    if k.shape[0] != t or attn_k.dim() != 2:
        raise ValueError("cuDNN FE DSA baseline: one sequence, compress_ratio 1 and MQA attn_k [T, D_a] only")
    if any(x.dtype != torch.bfloat16 for x in (q, k, weights, attn_q, attn_k)):
        raise ValueError("cuDNN FE DSA takes bf16 q, k, weights, attn_q, attn_k")
    if index_heads < 64:
        raise ValueError(f"cuDNN FE's indexer backward needs H_I >= 64, got {index_heads}")
    if topk_indices is not None and topk_indices.shape[1] % 128:
        raise ValueError(f"cuDNN FE's sparse indexer backward needs K % 128 == 0, got K={topk_indices.shape[1]}")
    topk = None if topk_indices is None else topk_indices.to(torch.int32).contiguous()[None]
    return Arguments(q.contiguous()[None], k.contiguous()[None], weights.contiguous()[None], attn_q.contiguous()[None],
                     attn_k.contiguous()[None], attn_lse.float().contiguous()[None], topk, float(softmax_scale),
                     float(coeff), torch.ones(1, dtype=torch.float32, device=q.device))


def scores(x: Arguments) -> tuple[torch.Tensor, ...]:
    """The fp32 tensors its backward consumes: dense ``(target mass [1, T, T], its L1 norm [1, T], I [1, T, T],
    LSE_I [1, T])``, sparse ``(p [1, T, K], π [1, T, K])``."""
    from cudnn import DSA

    heads, index_heads = x.attn_q.shape[2], x.q.shape[2]
    if x.topk is None:
        attn = DSA.dense_attn_score_recompute_wrapper(x.attn_q, x.attn_k[:, :, None], x.attn_lse, x.softmax_scale,
                                                      qhead_per_kv_head=heads)
        index = DSA.dense_indexer_score_recompute_wrapper(x.q, x.k[:, :, None], x.weights, qhead_per_kv_head=index_heads)
        return attn["out"], attn["denom"], index["out"], index["denom"]
    target = DSA.sparse_attn_score_recompute_wrapper(x.attn_q, x.attn_k, x.attn_lse, x.topk, x.softmax_scale,
                                                     qhead_per_kv_head=heads)
    predict = DSA.sparse_indexer_score_recompute_wrapper(x.q, x.k, x.weights, x.topk, qhead_per_kv_head=index_heads)
    return target["target"], predict["predict"]


def backward(x: Arguments, score_tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq [T, H_I, D_I], dk [T, D_I], dweights [T, H_I])`` bf16 from ``scores(x)``, which it overwrites."""
    from cudnn import DSA

    if x.topk is None:
        out = DSA.dense_indexer_backward_wrapper(x.q, x.weights, x.k, *score_tensors, grad_loss=x.grad_loss,
                                                 loss_coeff=x.coeff)
    else:
        target, predict = score_tensors
        out = DSA.indexer_backward_wrapper(x.q, x.weights, x.k, target, predict, x.topk, grad_loss=x.grad_loss,
                                           loss_coeff=x.coeff)
    return out["d_index_q"][0], out["d_index_k"][0], out["d_weights"][0]


def step(x: Arguments) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One training step of its indexer loss: the gradients (it computes no loss value)."""
    return backward(x, scores(x))


def loss(x: Arguments, score_tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """float64 KL loss of ``scores(x)`` (read before ``backward`` overwrites them): ``c/T · Σ_t Σ_s p (log p − log π)``
    over the causal keys (dense, whatever lies past the bound ignored) or the listed slots (sparse)."""
    t = x.q.shape[1]
    if x.topk is not None:
        target, predict = (s[0].double() for s in score_tensors)
        kl = torch.special.xlogy(target, target) - torch.special.xlogy(target, predict)
        return x.coeff * torch.where(x.topk[0] >= 0, kl, 0.0).sum() / t
    mass, l1, logits, lse = (s[0] for s in score_tensors)
    keys = torch.arange(t, device=mass.device)
    total = torch.zeros((), dtype=torch.float64, device=mass.device)
    chunk = max(1, _LOSS_CHUNK_ELEMENTS // t)
    for r0 in range(0, t, chunk):
        r1 = min(t, r0 + chunk)
        visible = keys[None, :] <= keys[r0:r1, None]
        p = torch.where(visible, mass[r0:r1].double() / l1[r0:r1, None].double(), 0.0)
        log_pi = torch.where(visible, logits[r0:r1].double() - lse[r0:r1, None].double(), 0.0)
        total += (torch.special.xlogy(p, p) - p * log_pi).sum()
    return x.coeff * total / t
