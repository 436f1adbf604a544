"""The fused DCP merge's kernels (key pack, keyed select) against independent oracles, world simulated in one
process: every rank's local top-k is packed, the packs are stacked as the all-gather lays them out, and the
select must give the single-rank top-k of the whole rows bit for bit."""

from __future__ import annotations

import pytest
import torch

from dsa_indexer import topk_decode
from dsa_indexer.dcp_positions import global_to_local, local_lengths, local_to_global
from dsa_indexer.ops._order import composite_key
from dsa_indexer.ops.dcp import (
    dcp_block_scores,
    pack_candidate_keys,
    pack_local_candidates,
    pack_scored_keys,
    select_global_topk_keys,
)
from dsa_indexer.testing import few_distinct_rows


def shard(logits: torch.Tensor, rank: int, world: int, interleave: int) -> torch.Tensor:
    """``rank``'s local logits: its owned global positions, in local order."""
    owner, local = global_to_local(torch.arange(logits.shape[1], device=logits.device), world, interleave)
    mine = (owner == rank).nonzero().squeeze(1)
    return logits[:, mine[local[mine].argsort()]].contiguous()


def simulated_merge(logits, lengths, k, world, interleave, backend):
    """Local top-k per rank, key pack, the all-gather's layout ``[W, R, k]``, keyed select."""
    packed = []
    for rank in range(world):
        local = shard(logits, rank, world, interleave)
        local_topk = topk_decode(local, local_lengths(lengths, rank, world, interleave), 1, k)
        packed.append(pack_candidate_keys(local, local_topk, rank, world, interleave, backend=backend))
    out = torch.full((logits.shape[0], k), -777, dtype=torch.int32, device=logits.device)
    return select_global_topk_keys(torch.stack(packed), k, out=out, backend=backend)


def awkward_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    """Rows with ties (few distinct values), NaN, -inf, signed zeros and +inf."""
    logits = few_distinct_rows((rows, width), seed)
    logits[0] = torch.randn(width, generator=torch.Generator().manual_seed(seed))
    logits[1, ::5] = float("nan")
    logits[1, 1::7] = float("-inf")
    logits[2, ::2] = -0.0
    logits[2, 1::2] = 0.0
    logits[3, 4] = float("inf")
    return logits


@pytest.mark.parametrize("interleave", [1, 3])
def test_pack_candidate_keys_is_the_composite_key_of_the_pairs(kernel_device, interleave):
    logits = awkward_rows(5, 30, 1)
    local_topk = torch.randint(-1, 33, (5, 6), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    starts = torch.tensor([0, 2, 5, 1, 0], dtype=torch.int32)
    scores, ids = pack_local_candidates(logits, local_topk, 2, 3, interleave, starts, backend="reference")
    expected = composite_key(torch.where(ids >= 0, scores, float("-inf")), ids.clamp_min(0))
    for backend in ("reference", "triton"):
        device = kernel_device if backend == "triton" else "cpu"
        out = torch.full((5, 6), 123, dtype=torch.int64, device=device)
        got = pack_candidate_keys(logits.to(device), local_topk.to(device), 2, 3, interleave, starts.to(device),
                                  out=out, backend=backend)
        assert got is out
        assert torch.equal(got.cpu(), expected), backend


@pytest.mark.parametrize("interleave", [1, 3])
def test_pack_scored_keys_is_the_composite_key_of_the_pairs(kernel_device, interleave):
    scores = awkward_rows(5, 12, 4)[:, ::2]  # strided: NaN, -inf, signed zeros, +inf among the picks
    positions = torch.randint(-1, 40, (5, 6), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    positions[4, 2] = 2**30  # its global id is past 2**31 - 1: unselectable
    ids = local_to_global(positions.to(torch.int64), 2, 3, interleave)
    valid = (ids >= 0) & (ids < 2**31)
    expected = composite_key(torch.where(valid, scores, float("-inf")), ids.clamp(0, 2**31 - 1))
    for backend in ("reference", "triton"):
        device = kernel_device if backend == "triton" else "cpu"
        out = torch.full((5, 6), 123, dtype=torch.int64, device=device)
        got = pack_scored_keys(scores.to(device), positions.to(device), 2, 3, interleave, out=out, backend=backend)
        assert got is out
        assert torch.equal(got.cpu(), expected), backend


@pytest.mark.parametrize("world, interleave, k", [(2, 1, 16), (3, 2, 5)])  # W 4 and 8: the GPU test below
def test_simulated_merge_equals_single_rank_topk(kernel_device, world, interleave, k):
    width = 41
    logits = awkward_rows(5, width, world + k)
    lengths = torch.tensor([41, 40, 17, 9, 0], dtype=torch.int32)
    expected = topk_decode(logits, lengths, 1, k, backend="reference")
    assert torch.equal(simulated_merge(logits, lengths, k, world, interleave, "reference"), expected)
    got = simulated_merge(logits.to(kernel_device), lengths.to(kernel_device), k, world, interleave, "triton")
    assert torch.equal(got.cpu(), expected)


def test_keyed_select_takes_the_lowest_ids_among_ties(kernel_device):
    # One row, 2 ranks x 4 candidates of one score: the 5 lowest of the 8 ids, rank lists interleaved.
    ids = torch.tensor([[[0, 3, 4, 9]], [[1, 2, 7, 8]]])
    keys = composite_key(torch.ones(2, 1, 4), ids)
    expected = torch.tensor([[0, 1, 2, 3, 4]], dtype=torch.int32)
    for backend, device in (("reference", "cpu"), ("triton", kernel_device)):
        assert torch.equal(select_global_topk_keys(keys.to(device), 5, backend=backend).cpu(), expected), backend


def test_keyed_select_one_bit_search_of_wide_tiles(kernel_device, monkeypatch):
    # Tiles above TWO_BIT_SEARCH_MAX_SLOTS (W * k_in > 16384 at decode sizes) search one bit per round.
    from dsa_indexer.ops.dcp import triton as dcp_triton

    monkeypatch.setattr(dcp_triton, "TWO_BIT_SEARCH_MAX_SLOTS", 0)
    test_keyed_select_takes_the_lowest_ids_among_ties(kernel_device)
    test_simulated_merge_equals_single_rank_topk(kernel_device, 3, 2, 5)


@pytest.mark.parametrize("row_repeat, with_starts", [(1, False), (2, True)])
def test_dcp_block_scores_kernel_equals_reference(kernel_device, row_repeat, with_starts):
    # Local blocks of 3 (a global block of 6 over 2 ranks), NaN / -inf / +inf / signed zeros, rows shorter than
    # the blocks, and the pinned newest block inside, at the edge of and past the score columns (or absent).
    logits = awkward_rows(6, 50, 3)
    bounds = 6 // row_repeat
    ends = torch.tensor([50, 37, 0, 5, 49, 1][:bounds], dtype=torch.int32)
    starts = torch.tensor([0, 4, 0, 2, 1, 0][:bounds], dtype=torch.int32) if with_starts else None
    global_ends = torch.tensor([100, 74, 0, 120, 121, 1][:bounds], dtype=torch.int32)
    args = (3, 20, row_repeat)
    want = dcp_block_scores(logits, starts, ends, *args, global_ends, 6, out=torch.empty(6, 20), backend="reference")
    out = torch.full((6, 20), 5.0, device=kernel_device)
    got = dcp_block_scores(logits.to(kernel_device), None if starts is None else starts.to(kernel_device),
                           ends.to(kernel_device), *args, global_ends.to(kernel_device), 6, out=out, backend="triton")
    assert torch.equal(got.cpu(), want)
    for row, end in enumerate(global_ends.repeat_interleave(row_repeat).tolist()):
        if 0 < end <= 120:  # newest block (end - 1) // 6 is one of the 20 columns
            assert want[row, (end - 1) // 6] == float("inf")


def _bad_select_calls(keys, out, scratch):
    return [
        (lambda: select_global_topk_keys(keys.int(), 4, out=out), TypeError, "keys"),
        (lambda: select_global_topk_keys(keys[0], 4, out=out), ValueError, "keys"),
        (lambda: select_global_topk_keys(keys, 0, out=out), ValueError, "k"),
        (lambda: select_global_topk_keys(keys, 7, out=out), ValueError, "exceeds"),
        (lambda: select_global_topk_keys(keys.transpose(1, 2), 4, out=out), ValueError, "row-contiguous"),
        (lambda: select_global_topk_keys(keys, 4, out=out[:, :3]), ValueError, "out"),
        (lambda: select_global_topk_keys(keys, 4, out=out, scratch=scratch[:5]), ValueError, "scratch"),
    ]


@pytest.mark.parametrize("index", range(7))
def test_keyed_select_rejects_bad_arguments_without_writing(index):
    keys = composite_key(torch.randn(2, 3, 3), torch.arange(18).view(2, 3, 3))
    out = torch.full((3, 4), -5, dtype=torch.int32)
    scratch = torch.zeros(18, dtype=torch.int32)
    call, error, name = _bad_select_calls(keys, out, scratch)[index]
    with pytest.raises(error, match=name):
        call()
    assert (out == -5).all() and (scratch == 0).all()


def test_pack_candidate_keys_rejects_a_strided_out():
    logits = torch.randn(2, 8)
    local_topk = torch.zeros(2, 3, dtype=torch.int32)
    out = torch.zeros(3, 2, dtype=torch.int64).t()
    with pytest.raises(ValueError, match="out must be contiguous"):
        pack_candidate_keys(logits, local_topk, 0, 2, 1, out=out)
    with pytest.raises(TypeError, match="out"):
        pack_candidate_keys(logits, local_topk, 0, 2, 1, out=torch.zeros(2, 3, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("interleave", [1, 64])
@pytest.mark.parametrize("k", [512, 2048])
def test_simulated_merge_at_decode_size_equals_single_gpu_topk(world, interleave, k):
    rows, width = 32, 131072
    gen = torch.Generator().manual_seed(world * k + interleave)
    logits = torch.randn(rows, width, generator=gen).cuda()
    logits[1::4] = few_distinct_rows((rows // 4, width), 3, "cuda")  # tie-heavy rows
    lengths = torch.randint(k // 2, width + 1, (rows,), generator=gen).to(torch.int32).cuda()
    lengths[0] = width
    expected = topk_decode(logits, lengths, 1, k)
    assert torch.equal(expected[:4].cpu(), topk_decode(logits[:4].cpu(), lengths[:4].cpu(), 1, k, backend="reference"))
    assert torch.equal(simulated_merge(logits, lengths, k, world, interleave, "triton"), expected)


@pytest.mark.gpu
def test_simulated_merge_replays_in_a_cuda_graph():
    # Local top-k, key pack and keyed select of every simulated rank, captured once, replayed on new logits.
    world, rows, width, k = 2, 8, 8192, 512
    gen = torch.Generator().manual_seed(8)
    lengths = torch.randint(k // 2, width + 1, (rows,), generator=gen).to(torch.int32).cuda()
    shards = [torch.empty(rows, width // world, device="cuda") for _ in range(world)]
    shard_lengths = [local_lengths(lengths, rank, world, 1) for rank in range(world)]
    local = [torch.empty(rows, k, dtype=torch.int32, device="cuda") for _ in range(world)]
    gathered = torch.empty(world, rows, k, dtype=torch.int64, device="cuda")
    scratch = torch.empty(world * rows * k, dtype=torch.int32, device="cuda")
    merged = torch.empty(rows, k, dtype=torch.int32, device="cuda")

    def load(logits):
        for rank in range(world):
            shards[rank].copy_(shard(logits, rank, world, 1))

    def merge():
        for rank in range(world):
            topk_decode(shards[rank], shard_lengths[rank], 1, k, out=local[rank])
            pack_candidate_keys(shards[rank], local[rank], rank, world, 1, out=gathered[rank])
        select_global_topk_keys(gathered, k, out=merged, scratch=scratch)

    load(torch.randn(rows, width, generator=gen).cuda())
    merge()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        merge()
    for _ in range(2):
        logits = torch.randn(rows, width, generator=gen).cuda()
        load(logits)
        merged.fill_(-777)
        graph.replay()
        assert torch.equal(merged, topk_decode(logits, lengths, 1, k))
