"""Decode and prefill context parallelism on real process groups (gloo, spawned CPU processes).

Every worker runs a batch of cases in one spawn (starting processes is the slow part) and returns its
results; the parent compares them with single-process runs of the same inputs.
"""

from __future__ import annotations

import pytest
import torch

from dsa_indexer import IndexerKCache, SparseAttnIndexer, build_metadata, rope_quant_q, topk, topk_decode
from dsa_indexer.dcp_positions import global_to_local, local_lengths
from dsa_indexer.distributed import DcpMergeWorkspace, gather_prefill_k, merge_topk_global, select_candidate_blocks_dcp
from dsa_indexer.ops.candidates import select_candidate_blocks
from dsa_indexer.testing import few_distinct_rows, run_distributed

pytestmark = pytest.mark.distributed

ROWS, WIDTH, K = 6, 97, 16


def sharded_columns(logits: torch.Tensor, rank: int, world: int, interleave: int) -> torch.Tensor:
    """This rank's local logits: its owned global positions, in local order."""
    owner, local = global_to_local(torch.arange(logits.shape[1]), world, interleave)
    mine = (owner == rank).nonzero().squeeze(1)
    return logits[:, mine[local[mine].argsort()]]


def merge_cases(rank: int, world: int) -> list[torch.Tensor]:
    """Local top-k + merge for several interleaves and row layouts; returns the merged ids."""
    results = []
    logits = few_distinct_rows((ROWS, WIDTH), 3)
    lengths = torch.tensor([97, 1, 0, 40, 5, 96], dtype=torch.int32)
    for interleave in (1, 2, 4):
        local = sharded_columns(logits, rank, world, interleave)
        local_len = local_lengths(lengths, rank, world, interleave)
        # Decode layout: rows see [0, len) of their own request.
        indices = topk_decode(local.contiguous(), local_len, 1, K)
        merge_topk_global(local.contiguous(), indices, K, interleave=interleave)
        results.append(indices)
        # Prefill layout: rows are slices of a wider ragged buffer with row starts.
        offset = 7
        wide = torch.full((ROWS, local.shape[1] + offset), float("nan"))
        wide[:, offset:] = local
        starts = torch.full((ROWS,), offset, dtype=torch.int32)
        ends = starts + local_len
        indices = topk(wide, K, starts=starts, ends=ends)
        merge_topk_global(wide, indices, K, interleave=interleave, starts=starts)
        results.append(indices)
    return results


def decode_size_rows(width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows: Gaussian at full length, tie-heavy (10 values) at 3/4, and one shorter than its k."""
    logits = torch.randn(3, width, generator=torch.Generator().manual_seed(seed))
    logits[1] = few_distinct_rows((1, width), seed)[0]
    lengths = torch.tensor([width, 3 * width // 4, 300], dtype=torch.int32)
    return logits, lengths


def decode_size_cases(rank: int, world: int) -> list[torch.Tensor]:
    """k 512 and 2048 (more than k keys on every rank), interleave 1 and 64, through a workspace made once
    for each (k, interleave) with spare rows, and once without one."""
    results = []
    for k in (512, 2048):
        logits, lengths = decode_size_rows(world * (k + 300) + 37, k)
        for interleave in (1, 64):
            workspace = DcpMergeWorkspace(5, k, interleave=interleave)
            local = sharded_columns(logits, rank, world, interleave).contiguous()
            local_len = local_lengths(lengths, rank, world, interleave)
            for space in (workspace, None):
                indices = topk_decode(local, local_len, 1, k)
                merge_topk_global(local, indices, k, interleave=interleave, workspace=space)
                results.append(indices)
    return results


def candidate_cases(rank: int, world: int) -> list[torch.Tensor]:
    logits = few_distinct_rows((ROWS, WIDTH), 4)
    lengths = torch.tensor([97, 1, 0, 40, 5, 96], dtype=torch.int32)
    local = sharded_columns(logits, rank, world, 1).contiguous()
    local_len = local_lengths(lengths, rank, world, 1)
    block = 8
    return [
        select_candidate_blocks_dcp(
            local, None, local_len, 5, block, global_ends=lengths, max_global_blocks=-(-WIDTH // block)
        )
    ]


def dcp_cases(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    """Every merge and candidate case of one world size in one spawn (starting processes is the slow part);
    last, ``merge_cases`` again as an engine runs them under graph capture: no collective argument exchange."""
    import os

    results = {"merge": merge_cases(rank, world), "decode_size": decode_size_cases(rank, world),
               "candidates": candidate_cases(rank, world)}
    os.environ["DSA_INDEXER_SKIP_VALUE_CHECKS"] = "1"
    results["merge_without_value_checks"] = merge_cases(rank, world)
    return results


@pytest.mark.parametrize("world", [2, 4, 8])
def test_merge_and_candidate_blocks_equal_single_rank(world):
    logits = few_distinct_rows((ROWS, WIDTH), 3)
    lengths = torch.tensor([97, 1, 0, 40, 5, 96], dtype=torch.int32)
    expected = topk_decode(logits, lengths, 1, K)
    expected_large = []
    for k in (512, 2048):
        large, large_lengths = decode_size_rows(world * (k + 300) + 37, k)
        expected_large += [topk_decode(large, large_lengths, 1, k)] * 4
    candidate_logits = few_distinct_rows((ROWS, WIDTH), 4)
    expected_blocks = select_candidate_blocks(candidate_logits, None, lengths, 5, 8)
    for results in run_distributed(dcp_cases, world):
        assert all(torch.equal(merged, expected) for merged in results["merge"])
        assert all(torch.equal(merged, expected) for merged in results["merge_without_value_checks"])
        assert len(results["decode_size"]) == len(expected_large)
        for merged, want in zip(results["decode_size"], expected_large):
            assert torch.equal(merged, want)
        assert torch.equal(results["candidates"][0], expected_blocks)


# Layer end to end: the same steps on one rank and on W ranks with sharded caches.
STEPS = [
    [(0, 40), (1, 30), (2, 3)],
    [(1, 2), (2, 2), (0, 60)],
    [(1, 1), (2, 2), (0, 2)],
    [(0, 2), (1, 2), (2, 2)],
]
HEADS, DIM, BLOCK, TOPK = 4, 128, 8, 24


def run_layer_steps(
    rank: int, world: int, interleave: int, candidates: bool, fmt: str, consumer: str | None = None
) -> list[torch.Tensor]:
    """``candidates``: a source layer (writes blocks); ``consumer``: ``consumer_logits`` of a consumer layer
    given the same ascending random blocks on every rank."""
    group = None
    if world > 1:
        import torch.distributed as dist

        group = dist.group.WORLD
    gen = torch.Generator().manual_seed(11)
    num_requests, pages = 3, 24
    cache = IndexerKCache(num_requests * pages, block_size=BLOCK, head_dim=DIM, fmt=fmt)
    block_table = torch.randperm(num_requests * pages, generator=torch.Generator().manual_seed(rank)).to(torch.int32)
    block_table = block_table.view(num_requests, pages)
    buffer = torch.full((160, TOPK), -7, dtype=torch.int32)
    candidate_buffer = torch.full((160, 3), -1, dtype=torch.int32) if candidates or consumer else None
    layer = SparseAttnIndexer(
        cache, TOPK, buffer, workspace_tokens=1024, candidate_blocks=candidate_buffer, candidate_block_size=8,
        candidate_write=candidates, consumer_logits=consumer or "auto", dcp_group=group, dcp_interleave=interleave,
    )
    cos_sin = torch.randn(256, 64, generator=gen)
    lengths = [0] * num_requests
    outputs = []
    for step in STEPS:
        requests = [r for r, _ in step]
        plan = [q for _, q in step]
        meta = build_metadata(
            [lengths[r] + q for r, q in step], plan, block_table[requests], block_size=BLOCK, num_spec_tokens=1,
            dcp_rank=rank, dcp_world_size=world, dcp_interleave=interleave, max_logits_bytes=4 * 20 * 64,
        )
        positions = torch.cat([torch.arange(lengths[r], lengths[r] + q) for r, q in step])
        tokens = sum(plan)
        q = torch.randn(tokens, HEADS, DIM, generator=gen).bfloat16()
        k = torch.randn(tokens, DIM, generator=gen).bfloat16()
        w = torch.randn(tokens, HEADS, generator=gen)
        q_quant, q_scale, weights = rope_quant_q(q, positions, cos_sin, w, DIM**-0.5, HEADS**-0.5, fmt=fmt)
        if consumer:
            drawn = torch.randint(-1, 9, (tokens, 3), generator=gen)
            drawn = torch.where(drawn < 0, 99, drawn).sort(dim=1).values
            candidate_buffer[:tokens] = torch.where(drawn == 99, -1, drawn)
        layer(q_quant, q_scale, k, weights, meta)
        outputs.append(buffer[:tokens].clone())
        if candidates:
            outputs.append(candidate_buffer[:tokens].clone())
        for r, count in step:
            lengths[r] += count
    return outputs


# (interleave, source layer, format, consumer_logits of a consumer layer); the single-rank oracle of a sparse
# consumer is the dense consumer.
LAYER_CASES = [(1, False, "fp8", None), (2, False, "mxfp4", None), (4, False, "fp8", None), (1, True, "fp8", None),
               (1, False, "fp8", "sparse")]


def layer_cases(rank: int, world: int) -> list[list[torch.Tensor]]:
    return [run_layer_steps(rank, world, *case) for case in LAYER_CASES]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_layer_under_dcp_equals_single_rank(world):
    expected = [run_layer_steps(0, 1, 1, candidates, fmt, consumer and "dense") for _, candidates, fmt, consumer in LAYER_CASES]
    for rank_cases in run_distributed(layer_cases, world):
        for got_steps, want_steps in zip(rank_cases, expected):
            for got, want in zip(got_steps, want_steps):
                assert torch.equal(got, want)


def pcp_case(rank: int, world: int) -> torch.Tensor:
    """Two PCP ranks split one prompt's prefill tokens; each inserts the gathered keys."""
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(2 + 20, DIM, generator=gen)
    slots = torch.cat([torch.tensor([40, 41]), torch.arange(20)])
    decode, prefill = 2, 20
    share = prefill // world
    mine = slice(decode + rank * share, decode + (rank + 1) * share)
    local_k = torch.cat([k[:decode], k[mine]])
    local_slots = torch.cat([slots[:decode], slots[mine]])
    cache = IndexerKCache(8, block_size=8)
    all_k, all_slots = gather_prefill_k(local_k, local_slots, decode)
    cache.insert(all_k, all_slots)
    return cache.buffer


def test_pcp_gives_every_rank_the_single_rank_cache():
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(22, DIM, generator=gen)
    slots = torch.cat([torch.tensor([40, 41]), torch.arange(20)])
    expected = IndexerKCache(8, block_size=8)
    expected.insert(k, slots)
    for buffer in run_distributed(pcp_case, 2):
        assert torch.equal(buffer, expected.buffer)


def bad_call_cases(rank: int, world: int) -> list[str]:
    messages = []
    logits = torch.randn(4, 10)
    indices = torch.zeros(4 + rank, 3, dtype=torch.int32)[:4 + rank]
    for call in (
        lambda: merge_topk_global(torch.randn(4 + rank, 10), torch.zeros(4 + rank, 3, dtype=torch.int32), 3),
        lambda: merge_topk_global(logits, torch.zeros(4, 3, dtype=torch.int32), 3 * world + 1),
        lambda: merge_topk_global(logits, indices, 3) if rank == 0 else merge_topk_global(logits, indices.float(), 3),
        lambda: gather_prefill_k(torch.randn(3 + rank, DIM), torch.zeros(3 + rank, dtype=torch.int64), 0),
    ):
        try:
            call()
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_bad_input_raises_on_every_rank_without_hanging():
    per_rank = run_distributed(bad_call_cases, 2, timeout_s=120)
    for messages in per_rank:
        assert "differ across ranks" in messages[0]
        assert "exceeds the 2 x 3 candidates" in messages[1]
        assert "rejected their arguments" in messages[2]
        assert "differ across ranks" in messages[3]


def test_uninitialised_group_is_a_clear_error():
    with pytest.raises(ValueError, match="not initialised"):
        merge_topk_global(torch.randn(2, 4), torch.zeros(2, 2, dtype=torch.int32), 2)


def nccl_merge_case(rank: int, world: int, rows: int, width: int, k: int, interleave: int) -> list[torch.Tensor]:
    """The merge on NCCL eagerly, then captured in a CUDA graph with a workspace and replayed."""
    logits = few_distinct_rows((rows, width), 21)
    lengths = torch.randint(int(0.8 * width), width + 1, (rows,), generator=torch.Generator().manual_seed(2))
    local = sharded_columns(logits, rank, world, interleave).contiguous().cuda()
    local_len = local_lengths(lengths.to(torch.int32), rank, world, interleave).cuda()
    local_topk = topk_decode(local, local_len, 1, k)
    eager = local_topk.clone()
    merge_topk_global(local, eager, k, interleave=interleave)
    workspace = DcpMergeWorkspace(rows, k, interleave=interleave, device="cuda")
    captured = local_topk.clone()
    merge_topk_global(local, captured, k, interleave=interleave, workspace=workspace)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured.copy_(local_topk)
        merge_topk_global(local, captured, k, interleave=interleave, workspace=workspace)
    captured.fill_(-777)
    graph.replay()
    torch.cuda.synchronize()
    return [eager.cpu(), captured.cpu()]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL (device kind nvidia-h200-x2)")
@pytest.mark.parametrize("k, interleave", [(2048, 1), (512, 64)])
def test_nccl_merge_at_realistic_size_equals_single_rank(k, interleave):
    rows, width = 32, 131072
    logits = few_distinct_rows((rows, width), 21)
    lengths = torch.randint(int(0.8 * width), width + 1, (rows,), generator=torch.Generator().manual_seed(2))
    expected = topk_decode(logits, lengths.to(torch.int32), 1, k, backend="reference")
    for merged in run_distributed(nccl_merge_case, 2, rows, width, k, interleave, backend="nccl"):
        assert torch.equal(merged[0], expected) and torch.equal(merged[1], expected)
