"""The DeepGEMM and vLLM drop-in surfaces reproduce the documented semantics over our ops."""

from __future__ import annotations

import pytest
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


def short_rows(gen, width):
    """ks/ke with every row at most ``width`` keys long, starts spread over the keys."""
    ks = torch.randint(0, N - width, (M,), generator=gen, dtype=torch.int32)
    return ks, ks + torch.randint(0, width + 1, (M,), generator=gen, dtype=torch.int32)


def test_vllm_order_takes_an_int_sixth_argument_as_max_seqlen_k():
    gen = torch.Generator().manual_seed(6)
    q, k, k_scale, w, _, _ = fp8_inputs(gen)
    ks, ke = short_rows(gen, 7)
    main = deep_gemm.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke, False, 7)
    for got in (
        deep_gemm.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke, 7),
        deep_gemm.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke, 7, torch.float32),
        deep_gemm.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke, 7, logits_dtype=torch.float32),
    ):
        assert got.shape == (M, 7) and got.dtype == torch.float32 and got.stride(0) % 256 == 0
        for i in range(M):
            n = int(ke[i] - ks[i])
            assert torch.equal(got[i, :n], main[i, :n])
    # The same sixth value as a bool is DeepGEMM main's clean flag: full, cleaned logits.
    assert torch.equal(
        deep_gemm.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke, True), mqa_logits(q, None, k, k_scale, w, ks, ke)
    )
    # 0 in the 2.8 order: full-width logits, as max_seqlen_k=0 is in DeepGEMM main.
    uncompressed = deep_gemm.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke, 0)
    expected = mqa_logits(q, None, k, k_scale, w, ks, ke)
    assert uncompressed.shape == (M, N)
    for i in range(M):
        assert torch.equal(uncompressed[i, int(ks[i]) : int(ke[i])], expected[i, int(ks[i]) : int(ke[i])])
    # A one-key window is a 1-wide output, not clean_logits=True.
    one = deep_gemm.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ks + 1, 1)
    full = mqa_logits(q, None, k, k_scale, w, ks, ks + 1)
    assert one.shape == (M, 1)
    torch.testing.assert_close(one[:, 0], full[torch.arange(M), ks.long()], rtol=1e-6, atol=1e-6)


def test_mqa_logits_call_form_errors_name_the_argument():
    q, k, k_scale, w, ks, ke = fp8_inputs(torch.Generator().manual_seed(7))
    call = deep_gemm.fp8_fp4_mqa_logits
    with pytest.raises(TypeError, match="max_seqlen_k given twice"):
        call((q, None), (k, k_scale), w, ks, ke, 30, 30)
    with pytest.raises(TypeError, match="clean_logits"):
        call((q, None), (k, k_scale), w, ks, ke, "yes")
    with pytest.raises(TypeError, match="kv must be the \\(values, scales\\) tuple"):
        call((q, None), k, w, ks, ke)
    with pytest.raises(ValueError, match="clean_logits must be False"):
        call((q, None), (k, k_scale), w, ks, ke, True, 30)


@pytest.mark.parametrize(
    ("ks", "ke", "width", "message"),
    [
        ([-3, 0], [4, 5], 10, r"ks must be >= 0, got ks\[0\] = -3"),
        ([0, 2], [5, 41], 50, r"ke must be <= the number of keys 40, got ke\[1\] = 41"),
        ([6, 0], [5, 5], 10, r"ks must be <= ke"),
        ([0, 1], [5, 12], 10, r"ke - ks must be <= max_seqlen_k 10, got ke\[1\] - ks\[1\] = 11"),
    ],
)
def test_compressed_logits_check_ks_and_ke(ks, ke, width, message):
    q, k, k_scale, w, _, _ = fp8_inputs(torch.Generator().manual_seed(8))
    ks, ke = torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        deep_gemm.fp8_fp4_mqa_logits((q[:2], None), (k, k_scale), w[:2], ks, ke, width)


def test_bf16_logits_pass_through_in_both_orders():
    gen = torch.Generator().manual_seed(9)
    q, k, k_scale, w, _, _ = fp8_inputs(gen)
    ks, ke = short_rows(gen, 7)
    full = mqa_logits(q, None, k, k_scale, w, ks, ke, logits_dtype=torch.bfloat16)
    got = deep_gemm.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke, logits_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, full)
    compressed = deep_gemm.fp8_fp4_mqa_logits((q, None), (k, k_scale), w, ks, ke, 7, torch.bfloat16)
    assert compressed.dtype == torch.bfloat16 and compressed.shape == (M, 7)
    for i in range(M):
        n = int(ke[i] - ks[i])
        torch.testing.assert_close(compressed[i, :n].float(), full[i, int(ks[i]) : int(ke[i])].float(), rtol=1e-2, atol=1e-2)


def paged_inputs(gen, batch, next_n, block_size=8, blocks=10):
    cache = IndexerKCache(blocks, block_size=block_size)
    cache.insert(torch.randn(blocks * block_size, D, generator=gen), torch.arange(blocks * block_size))
    q = torch.randn(batch, next_n, H, D, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(batch * next_n, H, generator=gen)
    table = torch.stack([torch.randperm(blocks, generator=gen)[:4] for _ in range(batch)]).to(torch.int32)
    return cache, q, w, table


def test_varlen_rows_score_their_own_request():
    gen = torch.Generator().manual_seed(10)
    cache, _, _, table = paged_inputs(gen, 3, 1)
    indices = torch.tensor([2, 0, 2, 2, 1], dtype=torch.int32)  # any order, any count per request
    rows = indices.shape[0]
    q = torch.randn(rows, 1, H, D, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(rows, H, generator=gen)
    lens = torch.tensor([[9], [1], [10], [31], [17]], dtype=torch.int32)
    schedule = deep_gemm.get_paged_mqa_logits_metadata(lens, 8, 7, indices=indices)
    assert schedule.shape == (8, 2)
    per_request = deep_gemm.fp8_fp4_paged_mqa_logits(
        (q, None), cache.deepgemm_view(), w, lens, table, schedule, 32, indices=indices
    )
    per_row = deep_gemm.fp8_fp4_paged_mqa_logits(
        (q, None), cache.deepgemm_view(), w, lens.flatten(), table[indices.long()], schedule, 32, indices=indices
    )
    for r in range(rows):
        n = int(lens[r])
        alone = paged_mqa_logits(q[r : r + 1], None, cache, w[r : r + 1], lens[r : r + 1], table[indices[r] : indices[r] + 1], 32)
        assert torch.equal(per_request[r, :n], alone[0, :n]) and torch.equal(per_row[r, :n], alone[0, :n])


def test_varlen_rows_reject_bad_indices():
    gen = torch.Generator().manual_seed(11)
    cache, q, w, table = paged_inputs(gen, 3, 1)
    lens = torch.full((3, 1), 5, dtype=torch.int32)
    schedule = torch.zeros(9, 2, dtype=torch.int32)
    call = deep_gemm.fp8_fp4_paged_mqa_logits
    with pytest.raises(ValueError, match=r"indices must be in \[0, 2\)"):
        call((q, None), cache.deepgemm_view(), w, lens, table[:2], schedule, 8, indices=torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match="indices must have one entry per query row"):
        call((q, None), cache.deepgemm_view(), w, lens, table, schedule, 8, indices=torch.tensor([0, 1]))
    q2 = torch.randn(3, 2, H, D, generator=gen).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="next_n 1"):
        deep_gemm.get_paged_mqa_logits_metadata(torch.full((3, 2), 5, dtype=torch.int32), 8, 4, indices=torch.arange(3))
    with pytest.raises(ValueError, match="next_n 1"):
        call((q2, None), cache.deepgemm_view(), w.repeat(2, 1), lens.repeat(1, 2), table, schedule, 8, indices=torch.arange(3))


def test_next_n_4_with_any_schedule_slot_count():
    gen = torch.Generator().manual_seed(12)
    cache, q, w, table = paged_inputs(gen, 2, 4)
    request_lens = torch.tensor([29, 4], dtype=torch.int32)
    lens = request_lens[:, None] - 3 + torch.arange(4, dtype=torch.int32)
    for slots in (1, 66, 131):
        schedule = deep_gemm.get_paged_mqa_logits_metadata(lens, 8, slots)
        assert schedule.shape == (slots + 1, 2)
        got = deep_gemm.fp8_fp4_paged_mqa_logits((q, None), cache.deepgemm_view(), w, lens, table, schedule, 32)
        expected = paged_mqa_logits(q, None, cache, w, request_lens, table, 32)
        for row, length in enumerate(lens.flatten().tolist()):
            assert torch.equal(got[row, :length], expected[row, :length])


def test_vllm_insert_rejects_unknown_scale_formats_untouched():
    cache = torch.full((2, 8, 132), 7, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"scale_fmt must be one of \(None, 'fp32', 'ue8m0', 'mxfp8'\), got 'e8m0'"):
        vllm_ops.indexer_k_quant_and_cache(torch.randn(3, D), cache, torch.arange(3), 128, "e8m0")
    assert (cache == 7).all()


def test_vllm_mxfp8_insert_stores_four_equal_ue8m0_bytes():
    gen = torch.Generator().manual_seed(13)
    k = torch.randn(5, D, generator=gen).bfloat16()
    slots = torch.tensor([3, 0, -1, 9, 4])
    ue8m0 = torch.zeros(2, 8, 132, dtype=torch.uint8)
    mxfp8 = torch.zeros(2, 8, 132, dtype=torch.uint8)
    vllm_ops.indexer_k_quant_and_cache(k, ue8m0, slots, 128, "ue8m0")
    vllm_ops.indexer_k_quant_and_cache(k, mxfp8, slots, 128, "mxfp8")
    # A page is [8 x 128 value bytes][8 x 4 scale bytes].
    pages_ue8m0, pages_mxfp8 = ue8m0.view(2, 8 * 132), mxfp8.view(2, 8 * 132)
    assert torch.equal(pages_mxfp8[:, :1024], pages_ue8m0[:, :1024])
    exponent = (pages_ue8m0[:, 1024:].contiguous().view(torch.int32) >> 23) & 0xFF  # [2, 8]
    assert exponent[0, 3] > 0
    assert torch.equal(pages_mxfp8[:, 1024:].view(2, 8, 4), exponent.to(torch.uint8)[..., None].expand(2, 8, 4))


def test_vllm_topk_rejects_strides_past_the_logits():
    logits = torch.randn(4, 10)
    indices = torch.full((4, 3), -9, dtype=torch.int32)
    bounds = torch.zeros(4, dtype=torch.int32), torch.full((4,), 10, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"stride0 \(12\) and stride1 \(1\) reach element 45"):
        vllm_ops.top_k_per_row_prefill(logits, *bounds, indices, 4, 12, 1, 3)
    with pytest.raises(ValueError, match="stride1"):
        vllm_ops.top_k_per_row_decode(logits, 1, bounds[1], indices, 4, 10, 2, 3)
    assert (indices == -9).all()
