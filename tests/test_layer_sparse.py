"""Consumer layers scoring only their candidate blocks: the sparse path against the dense + mask path.

Keys, queries and weights are small integers on the FP8 / e2m1 grids (one scale per key, ``2**-6`` for
FP8, ``2**0`` for MXFP4), so every logit is an exact fp32 value whatever order a backend sums in: the
two paths' logits agree bit for bit on every backend, and the contract then promises the same indices
(set and order) from both. Integer logits also tie often, which exercises the lower-position rule.
The interpreter runs tiny shapes; ``gpu`` tests run V4.1-like ones (32 heads, D = 128, blocks of 8) and a
captured decode step.
"""

from __future__ import annotations

import pytest
import torch

from dsa_indexer import IndexerKCache, MetadataBuilder, SparseAttnIndexer, build_metadata
from dsa_indexer.formats import FP8_DTYPE, quantize_mxfp4

POISON = -7


def exact_keys(tokens: int, dim: int, fmt: str, gen) -> torch.Tensor:
    """Keys whose quantisation is exact: integers in [-4, 4] with a 4 per row (FP8 scale 2**-6), or e2m1
    values with a 6 in every 32-element block (MXFP4 scale 2**0)."""
    if fmt == "fp8":
        keys = torch.randint(-4, 5, (tokens, dim), generator=gen).float()
        keys[:, 0] = 4.0
        return keys
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    keys = grid[torch.randint(0, 8, (tokens, dim), generator=gen)] * (torch.randint(0, 2, (tokens, dim), generator=gen) * 2 - 1)
    keys[:, ::32] = 6.0
    return keys


def exact_queries(tokens: int, heads: int, dim: int, fmt: str, gen):
    if fmt == "fp8":
        return torch.randint(-4, 5, (tokens, heads, dim), generator=gen).float().to(FP8_DTYPE), None
    return quantize_mxfp4(exact_keys(tokens * heads, dim, fmt, gen).view(tokens, heads, dim))


def ascending_candidates(tokens: int, num_blocks: int, max_id: int, gen) -> torch.Tensor:
    drawn = torch.randint(-1, max_id, (tokens, num_blocks), generator=gen)
    drawn = torch.where(drawn < 0, 1 << 20, drawn).sort(dim=1).values
    return torch.where(drawn == 1 << 20, -1, drawn).to(torch.int32)


def run_consumer(steps, *, fmt, consumer, device, heads, dim, page, topk, num_blocks, block, num_spec_tokens,
                 workspace_tokens, max_logits_bytes, backend="auto", seed=0):
    """Buffers after each step of a consumer layer; every random draw depends on ``seed`` only."""
    gen = torch.Generator().manual_seed(seed)
    num_requests = 1 + max(r for step in steps for r, _ in step)
    pages = 1 + max(sum(q for _, q in (x for step in steps for x in step if x[0] == r)) for r in range(num_requests)) // page
    cache = IndexerKCache(num_requests * pages, block_size=page, head_dim=dim, fmt=fmt, device=device)
    table = torch.randperm(num_requests * pages, generator=gen).to(torch.int32).view(num_requests, pages)
    max_tokens = sum(q for _, q in max(steps, key=lambda s: sum(q for _, q in s)))
    buffer = torch.full((max_tokens, topk), POISON, dtype=torch.int32, device=device)
    candidates = torch.full((max_tokens, num_blocks), -1, dtype=torch.int32, device=device)
    layer = SparseAttnIndexer(cache, topk, buffer, workspace_tokens=workspace_tokens, candidate_blocks=candidates,
                              candidate_block_size=block, consumer_logits=consumer, backend=backend)
    lengths = [0] * num_requests
    outputs = []
    for step in steps:
        requests = [r for r, _ in step]
        plan = [q for _, q in step]
        tokens = sum(plan)
        meta = build_metadata([lengths[r] + q for r, q in step], plan, table[requests].to(device), block_size=page,
                              num_spec_tokens=num_spec_tokens, workspace_tokens=workspace_tokens,
                              max_logits_bytes=max_logits_bytes, device=device)
        q, q_scale = exact_queries(tokens, heads, dim, fmt, gen)
        k = exact_keys(tokens, dim, fmt, gen)
        w = torch.randint(-3, 4, (tokens, heads), generator=gen).float()
        longest = max(lengths[r] + n for r, n in step)
        candidates[:tokens] = ascending_candidates(tokens, num_blocks, -(-longest // block) + 2, gen).to(device)
        buffer.fill_(POISON)
        layer(q.to(device), None if q_scale is None else q_scale.to(device), k.to(device), w.to(device), meta)
        outputs.append(buffer[:tokens].cpu().clone())
        for r, n in step:
            lengths[r] += n
    return outputs


# A chunked prefill beside a decode, then a padded decode batch (next_n 2 beside 1) with a new prefill.
TINY_STEPS = [[(0, 1), (1, 20), (2, 37)], [(0, 2), (1, 1), (2, 2), (3, 9)]]
TINY = dict(heads=4, dim=32, page=16, topk=9, num_blocks=4, block=4, num_spec_tokens=1, workspace_tokens=64,
            max_logits_bytes=4 * 16 * 64)


@pytest.mark.parametrize("fmt", ["fp8"])  # MXFP4 kernels: tests/ops/test_sparse_logits.py, and the gpu test below
def test_sparse_consumer_in_kernels_equals_dense_consumer(kernel_device, fmt):
    sparse = run_consumer(TINY_STEPS, fmt=fmt, consumer="sparse", device=kernel_device, backend="triton", **TINY)
    dense = run_consumer(TINY_STEPS, fmt=fmt, consumer="dense", device="cpu", backend="reference", **TINY)
    for index, (got, want) in enumerate(zip(sparse, dense)):
        assert torch.equal(got, want), f"step {index}"
        assert (got >= -1).all(), f"step {index}: poison left in the step's rows"


GPU_STEPS = [
    [(0, 1500), (1, 3000)],
    [(0, 2), (1, 2), (2, 700)],
    [(0, 1), (1, 2), (2, 2)],
]
GPU = dict(heads=32, dim=128, page=64, topk=512, num_blocks=256, block=8, num_spec_tokens=1, workspace_tokens=8192,
           max_logits_bytes=4 * 1024 * 4096)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_sparse_consumer_equals_dense_consumer_on_gpu(fmt):
    sparse = run_consumer(GPU_STEPS, fmt=fmt, consumer="sparse", device="cuda", **GPU)
    dense = run_consumer(GPU_STEPS, fmt=fmt, consumer="dense", device="cuda", **GPU)
    again = run_consumer(GPU_STEPS, fmt=fmt, consumer="sparse", device="cuda", **GPU)
    for index, (got, want, rerun) in enumerate(zip(sparse, dense, again)):
        assert torch.equal(got, want), f"step {index}"
        assert torch.equal(got, rerun), f"step {index}: a rerun differs"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_captured_sparse_decode_step_replays_equal_to_eager(fmt):
    batch, next_n, heads, dim, page, pages, topk, num_blocks, block = 4, 2, 32, 128, 64, 64, 512, 256, 8
    gen = torch.Generator().manual_seed(1)
    width = pages * page

    def make():
        cache = IndexerKCache(batch * pages, block_size=page, head_dim=dim, fmt=fmt, device="cuda")
        buffer = torch.full((batch * next_n, topk), -1, dtype=torch.int32, device="cuda")
        candidates = torch.full((batch * next_n, num_blocks), -1, dtype=torch.int32, device="cuda")
        layer = SparseAttnIndexer(cache, topk, buffer, workspace_tokens=width, candidate_blocks=candidates,
                                  candidate_block_size=block, consumer_logits="sparse", decode_logits_width=width,
                                  skip_k_cache_insert=True)
        return layer, cache, buffer, candidates

    graph_side, eager_side = make(), make()
    keys = exact_keys(batch * pages * page, dim, fmt, gen).cuda()
    for side in (graph_side, eager_side):
        side[1].insert(keys, torch.arange(keys.shape[0], device="cuda"))
    builder = MetadataBuilder(max_decode_requests=batch, max_next_n=next_n, max_blocks_per_request=pages,
                              block_size=page, num_spec_tokens=next_n - 1, device="cuda")
    tokens = batch * next_n
    q0, s0 = exact_queries(tokens, heads, dim, fmt, gen)
    static_q = q0.cuda()
    static_s = None if s0 is None else s0.cuda()
    static_w = torch.zeros(tokens, heads, device="cuda")

    def plan():
        lengths = torch.randint(next_n, width, (batch,), generator=gen).tolist()
        table = torch.randperm(batch * pages, generator=gen).view(batch, pages).to(torch.int32)
        q, s = exact_queries(tokens, heads, dim, fmt, gen)
        static_q.copy_(q)
        if s is not None:
            static_s.copy_(s)
        static_w.copy_(torch.randint(-3, 4, (tokens, heads), generator=gen).float())
        blocks = ascending_candidates(tokens, num_blocks, width // block, gen).cuda()
        for side in (graph_side, eager_side):
            side[3].copy_(blocks)
        return builder.build(lengths, [next_n] * batch, table.cuda())

    meta = plan()
    graph_side[0].warmup(static_q, static_s, None, static_w, meta)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_side[0](static_q, static_s, None, static_w, meta)
    for replay in range(20):
        meta = plan()
        graph.replay()
        eager_side[0](static_q, static_s, None, static_w, meta)
        torch.cuda.synchronize()
        assert torch.equal(graph_side[2], eager_side[2]), f"replay {replay}"
