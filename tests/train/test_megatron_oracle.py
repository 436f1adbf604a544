"""The reference equals megatron-core 0.19.2's ``FusedDSAIndexerLoss`` (dense, sparse, packed THD, compressed keys).

Megatron computes in float32 from float32 inputs; the reference gets the same inputs and a float64
attention LSE over ``V_t`` (Megatron renormalises each head over ``V_t``: ``target_norm="heads"``).
Agreement: loss and every gradient within 1e-6 relative (gradients: ``‖ours − megatron‖ / ‖megatron‖``).
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from kl_oracle import attention_lse, relative_error, visibility

from dsa_indexer.train import indexer_kl_loss


@pytest.fixture(scope="module")
def megatron():
    from megatron_oracle import ProcessGroups, load_fused_loss

    try:
        fused_loss, masking = load_fused_loss()
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"megatron-core wheel unavailable: {error}")
    return fused_loss, masking, ProcessGroups()


def inputs(num_tokens, num_keys, seed, *, index_heads=4, index_dim=16, heads=4, attn_dim=32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, index_heads, index_dim, generator=g),
            torch.randn(num_keys, index_dim, generator=g),
            torch.randn(num_tokens, index_heads, generator=g) * 0.3,
            torch.randn(num_tokens, heads, attn_dim, generator=g),
            torch.randn(num_keys, heads, attn_dim, generator=g))


def run_megatron(megatron, q, k, w, attn_q, attn_k, *, scale, coeff, topk, sparse, mask=None, cu_seqlens=None,
                 query_valid_rows=None):
    fused_loss, masking, groups = megatron
    leaves = [t.clone().requires_grad_(True) for t in (q, w, k)]
    starts = ends = None
    if cu_seqlens is not None:
        starts, ends = masking.generate_varlen_mask_params(cu_seqlens)
    topk_indices, loss = fused_loss.apply(
        leaves[0][:, None], leaves[1][:, None], leaves[2][:, None], attn_q[:, None], attn_k[:, None], scale, topk,
        coeff, mask, sparse, groups, starts, ends, None, query_valid_rows, False, True,
    )
    loss.backward()
    dq, dw, dk = (leaf.grad for leaf in leaves)
    return loss.detach(), dq, dk, dw, topk_indices[0]


def run_ours(q, k, w, attn_q, attn_k, *, scale, coeff, topk_indices=None, cu_seqlens=None, ratio=1):
    mask = visibility(q.shape[0], k.shape[0], cu_seqlens, ratio, topk_indices)
    lse = attention_lse(attn_q, attn_k, scale, mask)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, w)]
    loss = indexer_kl_loss(*leaves, attn_q, attn_k, lse, softmax_scale=scale, coeff=coeff, cu_seqlens=cu_seqlens,
                           topk_indices=topk_indices, compress_ratio=ratio, backend="reference")
    loss.backward()
    return (loss.detach(), *(leaf.grad for leaf in leaves))


def assert_agree(ours, theirs):
    assert ours[0].item() == pytest.approx(theirs[0].item(), rel=1e-6)
    for name, got, want in zip(("dq", "dk", "dw"), ours[1:], theirs[1:4]):
        assert want.abs().max() > 0, name
        assert relative_error(got, want) <= 1e-6, name


def local_ids(global_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Megatron's packed key columns as sequence-local ids (-1 kept)."""
    rows = torch.arange(global_ids.shape[0])
    seq = torch.searchsorted(cu_seqlens.long(), rows, right=True) - 1
    return torch.where(global_ids >= 0, global_ids - cu_seqlens.long()[seq][:, None], -1).to(torch.int32)


@pytest.mark.parametrize("sparse", [False, True])
def test_single_sequence(megatron, sparse):
    q, k, w, attn_q, attn_k = inputs(24, 24, seed=1)
    # An explicit causal mask: without one Megatron's top-k also ranks future keys (its loss masks them).
    causal = torch.zeros(24, 24).masked_fill(torch.ones(24, 24, dtype=torch.bool).triu(1), float("-inf"))
    theirs = run_megatron(megatron, q, k, w, attn_q, attn_k, scale=0.18, coeff=0.01, topk=6, sparse=sparse,
                          mask=causal)
    topk_indices = theirs[4].to(torch.int32) if sparse else None
    assert_agree(run_ours(q, k, w, attn_q, attn_k, scale=0.18, coeff=0.01, topk_indices=topk_indices), theirs)


@pytest.mark.parametrize("sparse", [False, True])
def test_packed_thd(megatron, sparse):
    cu_seqlens = torch.tensor([0, 9, 10, 23], dtype=torch.int32)
    q, k, w, attn_q, attn_k = inputs(23, 23, seed=2)
    theirs = run_megatron(megatron, q, k, w, attn_q, attn_k, scale=0.2, coeff=1.0, topk=5, sparse=sparse,
                          cu_seqlens=cu_seqlens)
    topk_indices = local_ids(theirs[4], cu_seqlens) if sparse else None
    ours = run_ours(q, k, w, attn_q, attn_k, scale=0.2, coeff=1.0, topk_indices=topk_indices, cu_seqlens=cu_seqlens)
    assert_agree(ours, theirs)


def test_compressed_keys_through_an_additive_mask(megatron):
    ratio, num_tokens = 3, 20
    num_keys = num_tokens // ratio
    q, k, w, attn_q, attn_k = inputs(num_tokens, num_keys, seed=3)
    visible = torch.arange(num_keys)[None, :] < ((torch.arange(num_tokens) + 1) // ratio)[:, None]
    mask = torch.zeros(num_tokens, num_keys).masked_fill(~visible, float("-inf"))
    theirs = run_megatron(megatron, q, k, w, attn_q, attn_k, scale=0.15, coeff=1.0, topk=3, sparse=False, mask=mask,
                          query_valid_rows=visible.any(1))
    assert_agree(run_ours(q, k, w, attn_q, attn_k, scale=0.15, coeff=1.0, ratio=ratio), theirs)
