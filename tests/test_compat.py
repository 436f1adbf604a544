"""The DeepGEMM and vLLM drop-in surfaces reproduce the documented semantics over our ops."""

from __future__ import annotations

import torch

from dsa_indexer import IndexerKCache, mqa_logits, paged_mqa_logits, quantize_fp8, quantize_mxfp4, topk, topk_decode
from dsa_indexer.compat import deep_gemm, vllm_ops

M, N, H, D = 9, 40, 4, 128


def fp8_inputs(gen):
    q = torch.randn(M, H, D, generator=gen).to(torch.float8_e4m3fn)
    k, k_scale = quantize_fp8(torch.randn(N, D, generator=gen))
    weights = torch.randn(M, H, generator=gen)
    ks = torch.randint(0, 10, (M,), generator=gen, dtype=torch.int32)
    ke = ks + torch.randint(0, 25, (M,), generator=gen, dtype=torch.int32)
    return q, k, k_scale.squeeze(1), weights, ks, ke


def test_mqa_logits_fp8_matches_and_pads_the_row_stride():
    q, k, k_scale, w, ks, ke = fp8_inputs(torch.Generator().manual_seed(0))
    got = deep_gemm.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke)
    assert got.shape == (M, N) and got.stride(0) % 256 == 0 and got.stride(0) >= N
    assert torch.equal(got, mqa_logits(q, None, k, k_scale, w, ks, ke))


def test_mqa_logits_fp4_views_are_accepted():
    gen = torch.Generator().manual_seed(1)
    q_packed, q_sf = quantize_mxfp4(torch.randn(M, H, D, generator=gen))
    k_packed, k_sf = quantize_mxfp4(torch.randn(N, D, generator=gen))
    w = torch.randn(M, H, generator=gen)
    ks = torch.zeros(M, dtype=torch.int32)
    ke = torch.full((M,), N, dtype=torch.int32)
    got = deep_gemm.fp8_fp4_mqa_logits(
        (q_packed.view(torch.int8), q_sf.view(torch.int32).squeeze(-1)),
        (k_packed.view(torch.int8), k_sf.view(torch.int32).squeeze(-1)), w, ks, ke,
    )
    assert torch.equal(got, mqa_logits(q_packed, q_sf, k_packed, k_sf, w, ks, ke))


def test_compressed_logits_are_row_start_relative():
    q, k, k_scale, w, ks, ke = fp8_inputs(torch.Generator().manual_seed(2))
    full = mqa_logits(q, None, k, k_scale, w, ks, ke)
    got = deep_gemm.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke, clean_logits=False, max_seqlen_k=30)
    for i in range(M):
        n = int(ke[i] - ks[i])
        # A window of the keys is a matmul of another shape: equal within fp32 rounding.
        torch.testing.assert_close(got[i, :n], full[i, int(ks[i]) : int(ke[i])], rtol=1e-6, atol=1e-6)


def test_paged_logits_from_the_fused_cache_view():
    gen = torch.Generator().manual_seed(3)
    cache = IndexerKCache(6, block_size=8)
    cache.insert(torch.randn(48, D, generator=gen), torch.arange(48))
    q = torch.randn(2, 2, H, D, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(4, H, generator=gen)
    lens = torch.tensor([[20, 21], [5, 6]], dtype=torch.int32)
    table = torch.tensor([[3, 1, 0, 2], [5, 4, 0, 0]], dtype=torch.int32)
    schedule = deep_gemm.get_paged_mqa_logits_metadata(lens, 8, 132)
    assert schedule.shape == (133, 2)
    got = deep_gemm.fp8_fp4_paged_mqa_logits((q, None), cache.deepgemm_view(), w, lens, table, schedule, 32)
    expected = paged_mqa_logits(q, None, cache, w, lens, table, 32, clean=False)
    for row, length in enumerate(lens.flatten().tolist()):
        assert torch.equal(got[row, :length], expected[row, :length])


def test_vllm_insert_and_gather_match_the_cache():
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(10, D, generator=gen).bfloat16()
    slots = torch.tensor([3, 0, 9, -1, 4, 5, 6, 7, 8, 1])
    ours = IndexerKCache(2, block_size=8)
    ours.insert(k, slots)
    theirs = torch.zeros(2, 8, 132, dtype=torch.uint8)
    vllm_ops.indexer_k_quant_and_cache(k, theirs, slots, 128, "ue8m0")
    assert torch.equal(theirs, ours.buffer)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 12], dtype=torch.int32)
    dst_k = torch.empty(12, D, dtype=torch.uint8)
    dst_scale = torch.empty(12, 4, dtype=torch.uint8)
    vllm_ops.cp_gather_indexer_k_quant_cache(theirs, dst_k, dst_scale, table, cu)
    values, scales = ours.gather(table, cu)
    assert torch.equal(dst_k, values.view(torch.uint8)) and torch.equal(dst_scale.view(torch.float32).squeeze(1), scales)


def test_vllm_topk_per_row_prefill_and_decode():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 50, generator=gen)
    starts = torch.tensor([0, 3, 10, 0, 7, 49], dtype=torch.int32)
    ends = torch.tensor([50, 20, 10, 5, 40, 50], dtype=torch.int32)
    indices = torch.full((8, 12), -9, dtype=torch.int32)
    vllm_ops.top_k_per_row_prefill(logits, starts, ends, indices, 6, logits.stride(0), logits.stride(1), 4)
    assert torch.equal(indices[:6, :4], topk(logits, 4, starts=starts, ends=ends))
    assert (indices[6:] == -9).all() and (indices[:, 4:] == -9).all()
    seq_lens = torch.tensor([30, 2, 50], dtype=torch.int32)
    decode = torch.full((6, 4), -9, dtype=torch.int32)
    vllm_ops.top_k_per_row_decode(logits, 2, seq_lens, decode, 6, logits.stride(0), 1, 4)
    assert torch.equal(decode, topk_decode(logits, seq_lens, 2, 4))
