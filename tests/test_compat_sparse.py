"""DeepGEMM 2.8's sparse MQA logits entry points (``compat.deep_gemm``) against the dense logits read at
the token DeepGEMM's contract names for each column (absolute ids, aligned or ``ks % sparse_block_kv``
offset blocks, the valid prefix from the KV length, bf16 output)."""

from __future__ import annotations

import pytest
import torch

from dsa_indexer import IndexerKCache, mqa_logits, paged_mqa_logits, quantize_mxfp4
from dsa_indexer.compat import deep_gemm

H, D, SBK, NB = 4, 128, 8, 4
NEG_INF = float("-inf")


def fp4(x):
    packed, scales = quantize_mxfp4(x)
    return packed, scales, (packed.view(torch.int8), scales.view(torch.int32).squeeze(-1))


def expected_columns(dense, first_token, starts, ends, count):
    """[rows, NB * SBK] bf16: dense[r, first_token[r, j] + o] for slots j < count[r] inside [starts, ends)."""
    rows = dense.shape[0]
    out = torch.full((rows, NB * SBK), NEG_INF)
    for r in range(rows):
        for j in range(min(NB, int(count[r]))):
            for o in range(SBK):
                t = int(first_token[r, j]) + o
                if int(starts[r]) <= t < int(ends[r]):
                    out[r, j * SBK + o] = dense[r, t]
    return out.bfloat16()


@pytest.mark.parametrize("unaligned", [False, True])
def test_sparse_mqa_logits_follow_deepgemm_block_ids(unaligned):
    gen = torch.Generator().manual_seed(0)
    rows, num_keys = 5, 70
    q_packed, q_sf, q = fp4(torch.randn(rows, H, D, generator=gen))
    k_packed, k_sf, kv = fp4(torch.randn(num_keys, D, generator=gen))
    w = torch.randn(rows, H, generator=gen).bfloat16()
    ks = torch.tensor([0, 3, 8, 13, 20], dtype=torch.int32)
    ke = torch.tensor([0, 30, 70, 19, 45], dtype=torch.int32)
    count = (ke - ks + SBK - 1) // SBK
    offset = ks % SBK if unaligned else torch.zeros_like(ks)
    ids = torch.zeros(rows, NB, dtype=torch.int32)
    for r in range(rows):
        lo, hi = int(ks[r] - offset[r]) // SBK, -(-int(ke[r] - offset[r]) // SBK)  # blocks meeting [ks, ke)
        chosen = torch.randperm(max(hi - lo, 1), generator=gen)[: min(NB, int(count[r]))].sort().values + lo
        ids[r, : chosen.numel()] = chosen.to(torch.int32)
        ids[r, chosen.numel():] = chosen[-1] if chosen.numel() else 0  # DeepGEMM's padding: repeat the last id
    meta = deep_gemm.get_sparse_mqa_logits_metadata(ks, ke, num_keys, ids, torch.int8, SBK, unaligned)
    got = deep_gemm.fp8_fp4_sparse_mqa_logits(q, kv, w, meta, NB, SBK, unaligned)
    dense = mqa_logits(q_packed, q_sf, k_packed, k_sf, w.float(), ks, ke, backend="reference")
    first = ids.long() * SBK + offset.long()[:, None]
    assert got.dtype == torch.bfloat16 and got.shape == (rows, NB * SBK)
    assert torch.equal(got, expected_columns(dense, first, ks, ke, count))


def test_paged_sparse_mqa_logits_follow_deepgemm_block_ids():
    gen = torch.Generator().manual_seed(1)
    rows, page, pages = 3, 16, 4
    cache = IndexerKCache(rows * pages, block_size=page, head_dim=D, fmt="mxfp4")
    cache.insert(torch.randn(rows * pages * page, D, generator=gen), torch.arange(rows * pages * page))
    table = torch.randperm(rows * pages, generator=gen).to(torch.int32).view(rows, pages)
    lens = torch.tensor([5, 64, 41], dtype=torch.int32)
    ids = torch.tensor([[0, 0, 0, 0], [1, 4, 6, 7], [0, 2, 3, 5]], dtype=torch.int32)
    q_packed, q_sf, _ = fp4(torch.randn(rows, 1, H, D, generator=gen))
    q = (q_packed.view(torch.int8), q_sf.view(torch.int32).squeeze(-1))
    w = torch.randn(rows, H, generator=gen).bfloat16()
    meta = deep_gemm.get_paged_sparse_mqa_logits_metadata(lens, table, torch.arange(rows), page, ids, torch.int8, SBK)
    got = deep_gemm.fp8_fp4_paged_sparse_mqa_logits(q, cache.deepgemm_view(), w, meta, NB, SBK)
    dense = paged_mqa_logits(q_packed, q_sf, cache, w.float(), lens, table, pages * page, backend="reference")
    count = (lens + SBK - 1) // SBK
    expected = expected_columns(dense, ids.long() * SBK, torch.zeros_like(lens), lens, count)
    assert torch.equal(got, expected)


def test_metadata_mismatch_is_refused():
    lens = torch.tensor([8], dtype=torch.int32)
    meta = deep_gemm.get_paged_sparse_mqa_logits_metadata(
        lens, torch.zeros(1, 1, dtype=torch.int32), None, 16, torch.zeros(1, NB, dtype=torch.int32), torch.int8, SBK)
    with pytest.raises(ValueError, match="metadata was built for"):
        deep_gemm.fp8_fp4_paged_sparse_mqa_logits((None, None), None, None, meta, NB * 2, SBK)
