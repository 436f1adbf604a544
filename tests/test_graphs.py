"""CUDA graphs: the decode step of SparseAttnIndexer captured once, replayed with new lengths,
block tables and data, equals eager execution every time."""

from __future__ import annotations

import pytest
import torch

from dsa_indexer import IndexerKCache, MetadataBuilder, SparseAttnIndexer, rope_quant_q

pytestmark = pytest.mark.gpu

BATCH, NEXT_N, HEADS, DIM, BLOCK, TOPK, PAGES = 4, 2, 8, 128, 64, 64, 8
WIDTH = PAGES * BLOCK


def make_layer(fmt: str):
    cache = IndexerKCache(BATCH * PAGES, block_size=BLOCK, head_dim=DIM, fmt=fmt, device="cuda")
    buffer = torch.full((BATCH * NEXT_N, TOPK), -1, dtype=torch.int32, device="cuda")
    layer = SparseAttnIndexer(cache, TOPK, buffer, workspace_tokens=WIDTH * BATCH, decode_logits_width=WIDTH)
    return layer, cache, buffer


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_captured_decode_step_replays_equal_to_eager(fmt):
    gen = torch.Generator().manual_seed(0)
    builder = MetadataBuilder(
        max_decode_requests=BATCH, max_next_n=NEXT_N, max_blocks_per_request=PAGES, block_size=BLOCK,
        num_spec_tokens=NEXT_N - 1, device="cuda",
    )
    graph_layer, graph_cache, graph_buffer = make_layer(fmt)
    eager_layer, eager_cache, eager_buffer = make_layer(fmt)
    initial = torch.randn(BATCH * PAGES * BLOCK, DIM, generator=gen).bfloat16().cuda()
    for cache in (graph_cache, eager_cache):
        cache.insert(initial, torch.arange(initial.shape[0], device="cuda"))
    cos_sin = torch.randn(WIDTH + 1, 64, generator=gen).cuda()
    tokens = BATCH * NEXT_N
    static = dict(
        q=torch.empty(tokens, HEADS, DIM, dtype=torch.bfloat16, device="cuda"),
        k=torch.empty(tokens, DIM, dtype=torch.bfloat16, device="cuda"),
        w=torch.empty(tokens, HEADS, device="cuda"),
        positions=torch.zeros(tokens, dtype=torch.int64, device="cuda"),
    )

    def plan(step: int):
        lengths = torch.randint(NEXT_N, WIDTH - 1, (BATCH,), generator=gen).tolist()
        table = torch.randperm(BATCH * PAGES, generator=gen)[: BATCH * PAGES].view(BATCH, PAGES).to(torch.int32)
        meta = builder.build(lengths, [NEXT_N] * BATCH, table.cuda())
        static["q"].copy_(torch.randn(tokens, HEADS, DIM, generator=gen).bfloat16())
        static["k"].copy_(torch.randn(tokens, DIM, generator=gen).bfloat16())
        static["w"].copy_(torch.randn(tokens, HEADS, generator=gen))
        static["positions"].copy_(torch.tensor([p for n in lengths for p in range(n - NEXT_N, n)]))
        return meta

    def step(layer, meta):
        q_quant, q_scale, weights = rope_quant_q(static["q"], static["positions"], cos_sin, static["w"], DIM**-0.5,
                                                 HEADS**-0.5, fmt=fmt)
        return layer(q_quant, q_scale, static["k"], weights, meta)

    meta = plan(0)
    q_quant, q_scale, weights = rope_quant_q(static["q"], static["positions"], cos_sin, static["w"], DIM**-0.5,
                                             HEADS**-0.5, fmt=fmt)
    graph_layer.warmup(q_quant, q_scale, static["k"], weights, meta)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graph_layer, meta)
    for replay in range(100):
        meta = plan(replay + 1)
        graph.replay()
        step(eager_layer, meta)
        torch.cuda.synchronize()
        assert torch.equal(graph_buffer, eager_buffer), f"replay {replay}"
        assert torch.equal(graph_cache.buffer, eager_cache.buffer), f"replay {replay}: caches differ"
