"""DCP position math and the exact merge pieces (``ops.dcp``), against brute force (no process group)."""

from __future__ import annotations

import math

import pytest
import torch

from dsa_indexer.dcp_positions import global_to_local, local_lengths, local_to_global
from dsa_indexer.ops.dcp import pack_candidate_keys, pack_local_candidates, select_global_topk, select_global_topk_keys

WORLD_SIZES = [1, 2, 3, 4]
INTERLEAVES = [1, 2, 4, 8]
NEG_INF = float("-inf")


def deal_positions(num_positions, world_size, interleave):
    """Owned global positions per rank, in local order: chunks of I dealt round-robin."""
    owned = [[] for _ in range(world_size)]
    for chunk_start in range(0, num_positions, interleave):
        rank = (chunk_start // interleave) % world_size
        owned[rank].extend(range(chunk_start, min(chunk_start + interleave, num_positions)))
    return owned


def exact_topk(values, k):
    """Positions of the k best selectable values by (value desc, position asc), ascending, then -1."""
    selectable = [i for i, v in enumerate(values) if not math.isnan(v) and v != NEG_INF]
    chosen = sorted(sorted(selectable, key=lambda i: (-values[i], i))[:k])
    return chosen + [-1] * (k - len(chosen))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("interleave", INTERLEAVES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_position_mapping_matches_brute_force(world_size, interleave, dtype):
    num_positions = 3 * world_size * interleave + 5
    owned = deal_positions(num_positions, world_size, interleave)
    expected_rank = [-1] * (num_positions + 1)
    expected_local = [-1] * (num_positions + 1)
    for rank, positions in enumerate(owned):
        for local, position in enumerate(positions):
            expected_rank[position + 1] = rank
            expected_local[position + 1] = local
    global_pos = torch.arange(-1, num_positions, dtype=dtype)
    rank, local = global_to_local(global_pos, world_size, interleave)
    assert rank.dtype == dtype and local.dtype == dtype
    assert rank.tolist() == expected_rank
    assert local.tolist() == expected_local
    for rank_id, positions in enumerate(owned):
        local_pos = torch.arange(-1, len(positions), dtype=dtype)
        mapped = local_to_global(local_pos, rank_id, world_size, interleave)
        assert mapped.dtype == dtype
        assert mapped.tolist() == [-1] + positions


def test_position_mapping_keeps_shape_and_all_padding():
    global_pos = torch.tensor([[5, -1], [-1, 12]])
    rank, local = global_to_local(global_pos, 2, 4)
    assert rank.tolist() == [[1, -1], [-1, 1]]
    assert local.tolist() == [[1, -1], [-1, 4]]
    assert local_to_global(local, 1, 2, 4).tolist() == [[5, -1], [-1, 12]]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("interleave", INTERLEAVES)
def test_local_lengths_match_brute_force(world_size, interleave):
    max_length = 4 * world_size * interleave + 3
    owned = deal_positions(max_length, world_size, interleave)
    lengths = torch.arange(max_length + 1, dtype=torch.int32)
    for rank, positions in enumerate(owned):
        counted = local_lengths(lengths, rank, world_size, interleave)
        assert counted.dtype == torch.int32
        assert counted.tolist() == [sum(1 for p in positions if p < length) for length in range(max_length + 1)]


def test_local_lengths_of_a_large_length_and_negative_lengths():
    lengths = torch.tensor([[2**40 + 13, -5]], dtype=torch.int64)
    # 2**40 + 13 = 2**36 full spans of 16, then 13 = 4 + 4 + 4 + 1 positions over ranks 0..3.
    counts = [local_lengths(lengths, rank, 4, 4).tolist() for rank in range(4)]
    assert counts == [[[2**38 + 4, 0]], [[2**38 + 4, 0]], [[2**38 + 4, 0]], [[2**38 + 1, 0]]]


def test_pack_local_candidates_matches_loop_oracle():
    logits = torch.tensor([[0.5, 1.5, 2.5, float("nan"), 4.5], [9.0, 8.0, 7.0, 6.0, 5.0]])
    local_topk = torch.tensor([[0, 2, -1, 4], [1, 3, 2, -1]], dtype=torch.int32)
    starts = torch.tensor([0, 2], dtype=torch.int32)
    scores, global_ids = pack_local_candidates(logits, local_topk, 1, 3, 2, starts)
    # Rank 1 of 3, interleave 2: local 0, 1, 2, 3 -> global 2, 3, 8, 9; row 1 reads from column 2.
    assert scores.dtype == torch.float32 and global_ids.dtype == torch.int64
    assert scores.tolist() == [[0.5, 2.5, NEG_INF, 4.5], [6.0, NEG_INF, 5.0, NEG_INF]]
    assert global_ids.tolist() == [[2, 8, -1, 14], [3, -1, 8, -1]]


def test_pack_local_candidates_on_empty_shard():
    scores, global_ids = pack_local_candidates(torch.zeros(2, 0), torch.full((2, 3), -1, dtype=torch.int32), 0, 2, 1)
    assert torch.equal(scores, torch.full((2, 3), NEG_INF))
    assert torch.equal(global_ids, torch.full((2, 3), -1, dtype=torch.int64))


def test_select_global_topk_matches_loop_oracle():
    scores = torch.tensor([[3.0, float("nan"), 3.0, NEG_INF, -0.0, 0.0, 7.0, 3.0, 1.0]])
    global_ids = torch.tensor([[9, 4, 2, 1, 30, 5, -1, 7, 2**31]])
    out = torch.full((1, 5), -777, dtype=torch.int32)
    result = select_global_topk(scores, global_ids, 5, out=out)
    # Selectable: (3, 9) (3, 2) (-0, 30) (0, 5) (3, 7); order 2, 7, 9, then the zeros 5 and 30.
    assert result is out
    assert out.tolist() == [[2, 5, 7, 9, 30]]
    assert select_global_topk(scores, global_ids, 4).tolist() == [[2, 5, 7, 9]]
    assert select_global_topk(scores, global_ids, 8).tolist() == [[2, 5, 7, 9, 30, -1, -1, -1]]


def test_select_global_topk_zero_rows_and_no_candidates():
    assert select_global_topk(torch.zeros(0, 6), torch.zeros(0, 6, dtype=torch.int64), 3).shape == (0, 3)
    result = select_global_topk(torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.int64), 3)
    assert torch.equal(result, torch.full((2, 3), -1, dtype=torch.int32))


def make_row(length, data, seed):
    generator = torch.Generator().manual_seed(seed)
    if data == "random":
        return torch.randn(length, generator=generator).tolist()
    values = torch.randint(-2, 3, (length,), generator=generator).float()
    values[values == -2] = float("nan")
    values[values == -1] = NEG_INF
    values[values == 0] = -0.0
    values[::3] = torch.where(values[::3] == -0.0, 0.0, values[::3])
    return values.tolist()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("interleave", INTERLEAVES)
@pytest.mark.parametrize("data", ["random", "ties"])
def test_merged_local_topk_equals_single_rank_topk(world_size, interleave, data):
    row_lengths = [0, 1, 5, 37, 100]
    row_offsets = [3, 0, 1, 2, 0]  # prefill-style row starts inside each rank's logits
    rows = [make_row(length, data, seed=length + world_size) for length in row_lengths]
    owned = [deal_positions(length, world_size, interleave) for length in row_lengths]
    for k in [1, 3, 7, 20]:
        gathered_scores, gathered_ids, gathered_keys = [], [], []
        for rank in range(world_size):
            shard_lengths = [len(positions[rank]) for positions in owned]
            width = max(offset + shard for offset, shard in zip(row_offsets, shard_lengths)) + 2
            local_logits = torch.full((len(rows), width), float("nan"))
            local_topk = []
            for row, values in enumerate(rows):
                shard = [values[position] for position in owned[row][rank]]
                offset = row_offsets[row]
                local_logits[row, offset : offset + len(shard)] = torch.tensor(shard)
                local_logits[row, offset + len(shard) :] = 1e30  # garbage past the shard
                local_topk.append(exact_topk(shard, k))
            starts = torch.tensor(row_offsets, dtype=torch.int32)
            local_topk = torch.tensor(local_topk, dtype=torch.int32)
            scores, global_ids = pack_local_candidates(local_logits, local_topk, rank, world_size, interleave, starts)
            gathered_scores.append(scores)
            gathered_ids.append(global_ids)
            gathered_keys.append(pack_candidate_keys(local_logits, local_topk, rank, world_size, interleave, starts))
        merged = select_global_topk(torch.cat(gathered_scores, dim=1), torch.cat(gathered_ids, dim=1), k)
        expected = torch.tensor([exact_topk(values, k) for values in rows], dtype=torch.int32)
        assert torch.equal(merged, expected), f"k={k}"
        assert torch.equal(select_global_topk_keys(torch.stack(gathered_keys), k), expected), f"keyed, k={k}"


def _mapping_error_cases():
    positions = torch.arange(4)
    return [
        (lambda: global_to_local([1, 2], 2, 1), TypeError, "global_pos"),
        (lambda: global_to_local(positions.float(), 2, 1), TypeError, "global_pos"),
        (lambda: global_to_local(positions, 0, 1), ValueError, "world_size"),
        (lambda: global_to_local(positions, 2, 0), ValueError, "interleave"),
        (lambda: global_to_local(positions, 2.0, 1), TypeError, "world_size"),
        (lambda: local_to_global(positions.float(), 0, 2, 1), TypeError, "local_pos"),
        (lambda: local_to_global(positions, 2, 2, 1), ValueError, "rank"),
        (lambda: local_to_global(positions, -1, 2, 1), ValueError, "rank"),
        (lambda: local_to_global(positions, 0, 2, -3), ValueError, "interleave"),
        (lambda: local_lengths(positions.double(), 0, 2, 1), TypeError, "global_lengths"),
        (lambda: local_lengths(positions, 3, 3, 1), ValueError, "rank"),
        (lambda: local_lengths(positions, 0, 0, 1), ValueError, "world_size"),
    ]


@pytest.mark.parametrize("index", range(len(_mapping_error_cases())))
def test_mapping_rejects_bad_arguments(index):
    call, error, name = _mapping_error_cases()[index]
    with pytest.raises(error, match=name):
        call()


PACK_ERRORS = [
    ({"logits": torch.zeros(2, 5, dtype=torch.bfloat16)}, TypeError, "logits"),
    ({"logits": torch.zeros(10)}, ValueError, "logits"),
    ({"local_topk": torch.zeros(3, 4, dtype=torch.int32)}, ValueError, "local_topk"),
    ({"local_topk": torch.zeros(2, 4)}, TypeError, "local_topk"),
    ({"local_topk": torch.zeros(2, 4, dtype=torch.int32, device="meta")}, ValueError, "local_topk"),
    ({"rank": 2}, ValueError, "rank"),
    ({"world_size": 0}, ValueError, "world_size"),
    ({"interleave": 0}, ValueError, "interleave"),
    ({"starts": torch.zeros(3, dtype=torch.int32)}, ValueError, "starts"),
    ({"starts": torch.zeros(2)}, TypeError, "starts"),
    ({"starts": torch.zeros(2, dtype=torch.int16)}, TypeError, "starts"),
    ({"local_topk": torch.zeros(2, 4, dtype=torch.int16)}, TypeError, "local_topk"),
    ({"backend": "nccl"}, ValueError, "backend"),
]


@pytest.mark.parametrize("overrides,error,name", PACK_ERRORS)
def test_pack_local_candidates_rejects_bad_arguments(overrides, error, name):
    args = {
        "logits": torch.zeros(2, 5),
        "local_topk": torch.zeros(2, 4, dtype=torch.int32),
        "rank": 1,
        "world_size": 2,
        "interleave": 1,
        "starts": None,
        "backend": "auto",
    }
    args.update(overrides)
    with pytest.raises(error, match=name):
        pack_local_candidates(**args)


SELECT_ERRORS = [
    ({"scores": torch.zeros(2, 6, dtype=torch.float64)}, TypeError, "scores"),
    ({"scores": torch.zeros(12)}, ValueError, "scores"),
    ({"global_ids": torch.zeros(2, 6, dtype=torch.int16)}, TypeError, "global_ids"),
    ({"global_ids": torch.zeros(2, 5, dtype=torch.int64)}, ValueError, "global_ids"),
    ({"global_ids": torch.zeros(2, 6, dtype=torch.int64, device="meta")}, ValueError, "global_ids"),
    ({"k": 0}, ValueError, "^k "),
    ({"k": 2.5}, TypeError, "^k "),
    ({"out": torch.zeros(2, 3, dtype=torch.int64)}, TypeError, "out"),
    ({"out": torch.zeros(2, 4, dtype=torch.int32)}, ValueError, "out"),
    ({"backend": "cutedsl"}, ValueError, "backend"),
]


@pytest.mark.parametrize("overrides,error,name", SELECT_ERRORS)
def test_select_global_topk_rejects_bad_arguments_without_writing(overrides, error, name):
    args = {
        "scores": torch.zeros(2, 6),
        "global_ids": torch.zeros(2, 6, dtype=torch.int64),
        "k": 3,
        "out": torch.full((2, 3), -777, dtype=torch.int32),
        "backend": "auto",
    }
    args.update(overrides)
    out = args["out"]
    before = out.clone()
    with pytest.raises(error, match=name):
        select_global_topk(args.pop("scores"), args.pop("global_ids"), args.pop("k"), **args)
    assert torch.equal(out, before)


@pytest.mark.parametrize("candidates, k", [(48, 12), (48, 1), (37, 37), (20, 29), (1, 1)])
def test_select_global_topk_kernel_path_equals_reference(kernel_device, candidates, k):
    from dsa_indexer.testing import few_distinct_rows

    gen = torch.Generator().manual_seed(9 + candidates + k)
    rows = 6
    scores = few_distinct_rows((rows, candidates), gen)
    scores[0, :5] = float("nan")
    scores[1, 3:9] = float("-inf")
    scores[4, ::2] = -0.0
    scores[4, 1::2] = 0.0
    ids = torch.stack([torch.randperm(1000, generator=gen)[:candidates] for _ in range(rows)]).to(torch.int64)
    ids[2, ::3] = -1
    ids[3, :40] = -1
    ids[5, ::4] = 2**31
    expected = select_global_topk(scores, ids, k, backend="reference")
    out = torch.full((rows, k), -777, dtype=torch.int32, device=kernel_device)
    got = select_global_topk(scores.to(kernel_device), ids.to(kernel_device), k, out=out, backend="triton")
    assert got is out
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("interleave, with_starts", [(1, False), (4, True)])
def test_pack_kernel_equals_reference(kernel_device, interleave, with_starts):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 30, generator=gen)
    local_topk = torch.randint(-1, 26, (6, 5), generator=gen, dtype=torch.int32)
    starts = torch.randint(0, 6, (6,), generator=gen, dtype=torch.int32) if with_starts else None
    want = pack_local_candidates(logits, local_topk, 1, 3, interleave, starts, backend="reference")
    got = pack_local_candidates(
        logits.to(kernel_device), local_topk.to(kernel_device), 1, 3, interleave,
        None if starts is None else starts.to(kernel_device), backend="triton",
    )
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
