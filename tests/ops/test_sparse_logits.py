"""Sparse logits (``ops/sparse_logits``): the reference against an independent oracle (the dense reference
logits read at each column's position, with the padding rule applied by a plain Python scan), the Triton
kernels against the reference (interpreter: tiny shapes; ``gpu``: realistic ones, reruns bitwise, graph
capture), and ``topk_sparse`` against the dense top-k over candidate-masked dense logits.
"""

from __future__ import annotations

import pytest
import torch

from dsa_indexer.cache import IndexerKCache
from dsa_indexer.formats import quantize_fp8, quantize_mxfp4
from dsa_indexer.ops.candidates import apply_candidate_mask
from dsa_indexer.ops.logits import mqa_logits, paged_mqa_logits
from dsa_indexer.ops.sparse_logits import sparse_mqa_logits, sparse_paged_mqa_logits, topk_sparse
from dsa_indexer.ops.topk import topk
from dsa_indexer.testing import calc_diff

NEG_INF = float("-inf")
TIER = 5e-6


def quantized(q, k, weights, fmt):
    if fmt == "fp8":
        q_values, q_scales = quantize_fp8(q, block_size=q.shape[-1], amax_floor=1e-10)
        k_values, k_scales = quantize_fp8(k, block_size=k.shape[-1])
        return q_values, None, k_values, k_scales[:, 0], weights * q_scales[..., 0].reshape(weights.shape)
    q_values, q_scales = quantize_mxfp4(q)
    k_values, k_scales = quantize_mxfp4(k)
    return q_values, q_scales, k_values, k_scales, weights


def candidate_rows(rows, num_blocks, max_id, gen, pad="neg"):
    """Ascending random candidate rows with a random number of padding entries (-1 or repeat-last)."""
    out = torch.full((rows, num_blocks), -1, dtype=torch.int32)
    for r in range(rows):
        count = int(torch.randint(0, num_blocks + 1, (1,), generator=gen))
        ids = torch.randperm(max_id, generator=gen)[:count].sort().values
        out[r, : ids.numel()] = ids
        if pad == "repeat" and 0 < ids.numel() < num_blocks:
            out[r, ids.numel():] = ids[-1]
    return out


def oracle(dense, starts, lengths, blocks, block_size):
    """Column j*bs+o of row r = dense[r, starts[r] + pos] for live entries inside the row, else -inf."""
    rows, num_blocks = blocks.shape
    out = torch.full((rows, num_blocks * block_size), NEG_INF)
    for r in range(rows):
        previous = -1
        for j in range(num_blocks):
            b = int(blocks[r, j])
            live = b >= 0 and b > previous
            previous = max(previous, b)
            for o in range(block_size):
                pos = b * block_size + o
                if live and pos < int(lengths[r]):
                    out[r, j * block_size + o] = dense[r, int(starts[r]) + pos]
    return out


def prefill_case(fmt, seed=0, heads=4, dim=64, block_size=4, num_blocks=5, pad="neg"):
    gen = torch.Generator().manual_seed(seed)
    ranges = [(0, 0), (3, 40), (0, 37), (10, 11), (5, 29), (2, 39)]
    num_keys = 41
    q = torch.randn(len(ranges), heads, dim, generator=gen)
    k = torch.randn(num_keys, dim, generator=gen)
    w = torch.randn(len(ranges), heads, generator=gen)
    args = quantized(q, k, w, fmt)
    ks = torch.tensor([s for s, _ in ranges], dtype=torch.int32)
    ke = torch.tensor([e for _, e in ranges], dtype=torch.int32)
    blocks = candidate_rows(len(ranges), num_blocks, 12, gen, pad)
    return args, ks, ke, blocks, block_size


def decode_case(fmt, seed=0, batch=3, next_n=2, heads=4, dim=64, page=16, block_size=4, num_blocks=6, pad="neg",
                scale_fmt=None):
    gen = torch.Generator().manual_seed(seed)
    pages_per_request = 4
    cache = IndexerKCache(batch * pages_per_request + 2, block_size=page, head_dim=dim, fmt=fmt, scale_fmt=scale_fmt)
    cache.buffer.fill_(0xFF)  # unread bytes are NaN / infinite scales
    lengths = torch.tensor([0, 1, 50, 64][:batch], dtype=torch.int32)
    table = torch.full((batch, pages_per_request), -1, dtype=torch.int32)
    pages = torch.randperm(cache.num_blocks, generator=gen)
    for b in range(batch):
        used = -(-int(lengths[b]) // page)
        table[b, :used] = pages[b * pages_per_request : b * pages_per_request + used].to(torch.int32)
        for p in range(int(lengths[b])):
            key = torch.randn(1, dim, generator=gen)
            slot = torch.tensor([int(table[b, p // page]) * page + p % page])
            from dsa_indexer.ops.k_cache import insert_k

            insert_k(key, cache, slot, backend="reference")
    q = torch.randn(batch, next_n, heads, dim, generator=gen)
    w = torch.randn(batch * next_n, heads, generator=gen)
    if fmt == "fp8":
        q_values, q_scales = quantize_fp8(q, block_size=dim, amax_floor=1e-10)
        q_scale, w = None, w * q_scales[..., 0].reshape(w.shape)
    else:
        q_values, q_scale = quantize_mxfp4(q)
    blocks = candidate_rows(batch * next_n, num_blocks, 17, gen, pad)
    return q_values, q_scale, cache, w, lengths, table, blocks, block_size


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("pad", ["neg", "repeat"])
def test_prefill_reference_matches_dense_oracle(fmt, pad):
    (q, q_scale, k, k_scale, w), ks, ke, blocks, bs = prefill_case(fmt, pad=pad)
    dense = mqa_logits(q, q_scale, k, k_scale, w, ks, ke, backend="reference")
    got = sparse_mqa_logits(q, q_scale, k, k_scale, w, ks, ke, blocks, bs, backend="reference")
    assert torch.equal(got, oracle(dense, ks, ke - ks, blocks, bs))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("pad", ["neg", "repeat"])
def test_decode_reference_matches_dense_oracle(fmt, pad):
    q, q_scale, cache, w, lengths, table, blocks, bs = decode_case(fmt, pad=pad)
    batch, next_n = q.shape[:2]
    dense = paged_mqa_logits(q, q_scale, cache, w, lengths, table, 64, backend="reference")
    rows = torch.clamp(lengths[:, None] - next_n + 1 + torch.arange(next_n), min=0).reshape(-1)
    got = sparse_paged_mqa_logits(q, q_scale, cache, w, lengths, table, blocks, bs, backend="reference")
    assert torch.equal(got, oracle(dense, torch.zeros(batch * next_n, dtype=torch.int32), rows, blocks, bs))


def test_topk_sparse_equals_masked_dense_topk():
    (q, q_scale, k, k_scale, w), ks, ke, blocks, bs = prefill_case("fp8", seed=3)
    dense = mqa_logits(q, q_scale, k, k_scale, w, ks, ke, backend="reference")
    sparse = sparse_mqa_logits(q, q_scale, k, k_scale, w, ks, ke, blocks, bs, backend="reference")
    apply_candidate_mask(dense, ks, ke, blocks, bs, backend="reference")
    for k_pick in (1, 7, 25):
        expected = topk(dense, k_pick, starts=ks, ends=ke, backend="reference")
        assert torch.equal(topk_sparse(sparse, blocks, bs, k_pick, backend="reference"), expected)


def test_topk_sparse_ties_go_to_the_lower_position():
    logits = torch.tensor([[1.0, 2.0, 2.0, NEG_INF, 2.0, 2.0]])
    blocks = torch.tensor([[1, 4, 4]], dtype=torch.int32)  # last entry repeats: padding
    assert topk_sparse(logits, blocks, 2, 2, backend="reference").tolist() == [[3, 8]]


def test_bad_candidate_rows_raise():
    (q, q_scale, k, k_scale, w), ks, ke, blocks, bs = prefill_case("fp8")
    blocks[1, :3] = torch.tensor([4, 2, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="non-decreasing"):
        sparse_mqa_logits(q, q_scale, k, k_scale, w, ks, ke, blocks, bs, backend="reference")
    blocks[1, :3] = torch.tensor([-1, 2, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="non-decreasing"):
        sparse_mqa_logits(q, q_scale, k, k_scale, w, ks, ke, blocks, bs, backend="reference")
    with pytest.raises(ValueError, match="logits_dtype"):
        sparse_mqa_logits(q, q_scale, k, k_scale, w, ks, ke, blocks.clamp_min(-1).sort().values, bs,
                          logits_dtype=torch.float16, backend="reference")


def test_topk_sparse_kernels_match_reference(kernel_device):
    gen = torch.Generator().manual_seed(7)
    blocks = candidate_rows(5, 6, 20, gen, "repeat")
    logits = torch.randint(-3, 4, (5, 6 * 3), generator=gen).float()  # many ties
    logits[torch.rand(logits.shape, generator=gen) < 0.2] = NEG_INF
    expected = topk_sparse(logits, blocks, 3, 7, backend="reference")
    out = torch.full((5, 7), -9, dtype=torch.int32, device=kernel_device)
    got = topk_sparse(logits.to(kernel_device), blocks.to(kernel_device), 3, 7, out=out, backend="triton")
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_matches_reference(kernel_device, fmt, logits_dtype):
    (q, q_scale, k, k_scale, w), ks, ke, blocks, bs = prefill_case(fmt, seed=1, pad="repeat")
    args = [None if t is None else t.to(kernel_device) for t in (q, q_scale, k, k_scale, w, ks, ke, blocks)]
    expected = sparse_mqa_logits(q, q_scale, k, k_scale, w, ks, ke, blocks, bs, backend="reference")
    out = torch.full((blocks.shape[0], blocks.shape[1] * bs), -7.0, dtype=logits_dtype, device=kernel_device)
    got = sparse_mqa_logits(*args, bs, out=out, logits_dtype=logits_dtype, backend="triton").float().cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    if logits_dtype == torch.float32:
        assert calc_diff(got, expected) < TIER
    else:
        assert torch.equal(got, expected.bfloat16().float()) or calc_diff(got, expected) < 1e-4


@pytest.mark.parametrize("fmt, scale_fmt, dim", [("fp8", None, 64), ("fp8", "mxfp8", 64), ("mxfp4", None, 64),
                                                ("fp8", None, 32), ("mxfp4", None, 32), ("mxfp4", None, 128)])
def test_decode_kernel_matches_reference(kernel_device, fmt, scale_fmt, dim):
    """Head dims 32 and 128 beside 64: MXFP4 contracts two half-depth dots, 16 deep at D = 32 unless padded (the
    GPU's e4m3 dot needs 32)."""
    q, q_scale, cache, w, lengths, table, blocks, bs = decode_case(fmt, seed=2, dim=dim, block_size=8,
                                                                   scale_fmt=scale_fmt)
    expected = sparse_paged_mqa_logits(q, q_scale, cache, w, lengths, table, blocks, bs, backend="reference")
    moved = IndexerKCache(cache.num_blocks, block_size=cache.block_size, head_dim=cache.head_dim, fmt=fmt,
                          scale_fmt=scale_fmt, device=kernel_device)
    moved.buffer.copy_(cache.buffer)
    args = [None if t is None else t.to(kernel_device) for t in (q, q_scale)]
    rest = [t.to(kernel_device) for t in (w, lengths, table, blocks)]
    got = sparse_paged_mqa_logits(*args, moved, *rest, bs, backend="triton").cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert calc_diff(got, expected) < TIER




def test_prefill_with_unchecked_windows_reads_only_the_keys(kernel_device, monkeypatch):
    """Value checks off: windows past the keys are clamped into [0, N] on both backends."""
    (q, q_scale, k, k_scale, w), ks, ke, blocks, bs = prefill_case("fp8", seed=5)
    wild_ks, wild_ke = ks.clone(), ke.clone()
    wild_ks[1], wild_ke[1], wild_ke[2], wild_ks[3] = -30, 10**6, 2**30, -(2**30)
    expected = sparse_mqa_logits(q, q_scale, k, k_scale, w, wild_ks.clamp(0, k.shape[0]),
                                 wild_ke.clamp(max=k.shape[0]), blocks, bs, backend="reference")
    monkeypatch.setenv("DSA_INDEXER_SKIP_VALUE_CHECKS", "1")
    assert torch.equal(sparse_mqa_logits(q, q_scale, k, k_scale, w, wild_ks, wild_ke, blocks, bs, backend="reference"),
                       expected)
    args = [None if t is None else t.to(kernel_device) for t in (q, q_scale, k, k_scale, w, wild_ks, wild_ke, blocks)]
    got = sparse_mqa_logits(*args, bs, backend="triton").cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert calc_diff(got, expected) < TIER

@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_decode_with_unchecked_wild_pages_reads_zero_bytes(kernel_device, fmt, monkeypatch):
    """Value checks off: page ids outside the cache and lengths past the table read nothing outside the cache
    or the table; such positions score as zero-byte keys, on both backends (contract §12)."""
    q, q_scale, cache, w, lengths, table, blocks, bs = decode_case(fmt, seed=4, block_size=8)
    wild_table, wild_lengths = table.clone(), lengths.clone()
    wild_table[2, 1], wild_table[1, 0] = 10**6, -5
    wild_lengths[2] = 10**6  # past the table's 4 pages
    listed = set(wild_table.flatten().tolist())
    zero_page = next(p for p in range(cache.num_blocks) if p not in listed)
    cache.buffer[zero_page] = 0
    readable = (wild_table >= 0) & (wild_table < cache.num_blocks)
    oracle_table = torch.where(readable, wild_table, zero_page)
    oracle_lengths = wild_lengths.clamp(max=table.shape[1] * cache.block_size)
    expected = sparse_paged_mqa_logits(q, q_scale, cache, w, oracle_lengths, oracle_table, blocks, bs,
                                       backend="reference")
    monkeypatch.setenv("DSA_INDEXER_SKIP_VALUE_CHECKS", "1")
    assert torch.equal(sparse_paged_mqa_logits(q, q_scale, cache, w, wild_lengths, wild_table, blocks, bs,
                                               backend="reference"), expected)
    moved = IndexerKCache(cache.num_blocks, block_size=cache.block_size, head_dim=cache.head_dim, fmt=fmt,
                          device=kernel_device)
    moved.buffer.copy_(cache.buffer)
    args = [None if t is None else t.to(kernel_device) for t in (q, q_scale)]
    rest = [t.to(kernel_device) for t in (w, wild_lengths, wild_table, blocks)]
    got = sparse_paged_mqa_logits(*args, moved, *rest, bs, backend="triton").cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert calc_diff(got, expected) < TIER

@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("next_n", [1, 2])
def test_decode_kernel_at_v41_shapes(fmt, next_n):
    """32 heads, D = 128, 2048 blocks of 8 over a 64K context: the kernel against the reference (tier, masks
    exact) and the dense Triton logits at the same positions (tier), ten reruns bitwise, bf16 = fp32 rounded."""
    gen = torch.Generator().manual_seed(5)
    batch, heads, dim, page, length, num_blocks, block = 3, 32, 128, 64, 65536, 2048, 8
    pages = length // page
    cache = IndexerKCache(batch * pages, block_size=page, head_dim=dim, fmt=fmt, device="cuda")
    keys = torch.randn(batch * pages * page, dim, generator=gen).cuda()
    cache.insert(keys, torch.arange(keys.shape[0], device="cuda"))
    table = torch.randperm(batch * pages, generator=gen).view(batch, pages).int().cuda()
    lens = torch.tensor([length, 40000, 1000], dtype=torch.int32).cuda()
    q = torch.randn(batch, next_n, heads, dim, generator=gen)
    w = torch.randn(batch * next_n, heads, generator=gen)
    if fmt == "fp8":
        q_values, q_scales = quantize_fp8(q, block_size=dim, amax_floor=1e-10)
        q_scale, w = None, w * q_scales[..., 0].reshape(w.shape)
    else:
        q_values, q_scale = quantize_mxfp4(q)
        q_scale = q_scale.cuda()
    q_values, w = q_values.cuda(), w.cuda()
    blocks = candidate_rows(batch * next_n, num_blocks, length // block, gen, "repeat").cuda()
    args = (q_values, q_scale, cache, w, lens, table, blocks, block)
    got = sparse_paged_mqa_logits(*args, backend="triton")
    expected = sparse_paged_mqa_logits(*args, backend="reference")
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert calc_diff(got, expected) < TIER
    dense = paged_mqa_logits(q_values, q_scale, cache, w, lens, table, length, backend="triton")
    positions = (blocks.long()[:, :, None] * block + torch.arange(block, device="cuda")).flatten(1)
    at = torch.where(torch.isinf(got), NEG_INF, dense.gather(1, positions.clamp(0, length - 1)))
    assert calc_diff(got, at) < TIER
    for _ in range(10):
        assert torch.equal(sparse_paged_mqa_logits(*args, backend="triton"), got)
    assert torch.equal(sparse_paged_mqa_logits(*args, logits_dtype=torch.bfloat16, backend="triton"), got.bfloat16())


@pytest.mark.gpu
def test_sparse_decode_step_captures_in_a_graph():
    """Logits + top-k as positions, captured once and replayed with new candidate rows, equal eager."""
    gen = torch.Generator().manual_seed(6)
    batch, heads, dim, page, length, num_blocks, block, k = 4, 32, 128, 64, 16384, 256, 8, 64
    pages = length // page
    cache = IndexerKCache(batch * pages, block_size=page, head_dim=dim, fmt="fp8", device="cuda")
    keys = torch.randn(batch * pages * page, dim, generator=gen).cuda()
    cache.insert(keys, torch.arange(keys.shape[0], device="cuda"))
    table = torch.randperm(batch * pages, generator=gen).view(batch, pages).int().cuda()
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    q = quantize_fp8(torch.randn(batch, 1, heads, dim, generator=gen), block_size=dim, amax_floor=1e-10)[0].cuda()
    w = torch.randn(batch, heads, generator=gen).cuda()
    blocks = candidate_rows(batch, num_blocks, length // block, gen).cuda()
    logits = torch.empty(batch, num_blocks * block, device="cuda")
    picks = torch.empty(batch, k, dtype=torch.int32, device="cuda")

    def step():
        sparse_paged_mqa_logits(q, None, cache, w, lens, table, blocks, block, out=logits)
        topk_sparse(logits, blocks, block, k, out=picks)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(5):
        blocks.copy_(candidate_rows(batch, num_blocks, length // block, gen).cuda())
        graph.replay()
        torch.cuda.synchronize()
        eager_logits = sparse_paged_mqa_logits(q, None, cache, w, lens, table, blocks, block)
        assert torch.equal(logits, eager_logits)
        assert torch.equal(picks, topk_sparse(eager_logits, blocks, block, k))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("next_n", [1, 3])
def test_decode_programs_write_disjoint_outputs(kernel_device, fmt, next_n):
    """No two programs of the sparse decode kernel write the same logit (a race on a GPU that the interpreter,
    running programs one at a time, would hide)."""
    if kernel_device != "cpu":
        pytest.skip("records the CPU interpreter's stores: the GPU runs these kernels compiled")
    from program_writes import conflicting_writes, recorded_program_writes

    q, q_scale, cache, w, lengths, table, blocks, bs = decode_case(fmt, seed=5, next_n=next_n, block_size=8)
    out = torch.empty(blocks.shape[0], blocks.shape[1] * bs)
    with recorded_program_writes() as writes:
        sparse_paged_mqa_logits(q, q_scale, cache, w, lengths, table, blocks, bs, out=out, backend="triton")
    assert not conflicting_writes(writes, out)
    assert calc_diff(out, sparse_paged_mqa_logits(q, q_scale, cache, w, lengths, table, blocks, bs,
                                                  backend="reference")) < TIER
