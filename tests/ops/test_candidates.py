"""select_candidate_blocks / apply_candidate_mask against Python-loop oracles."""

from __future__ import annotations

import math

import pytest
import torch

from dsa_indexer.ops.candidates import apply_candidate_mask, select_candidate_blocks

NEG_INF = float("-inf")
GARBAGE = (float("nan"), 1e30, float("inf"), -1e30)


def row_bound(bounds, row, row_repeat, default=0):
    return default if bounds is None else int(bounds[row // row_repeat])


def select_oracle(logits, starts, ends, num_blocks_k, block_size, row_repeat=1):
    rows = logits.tolist()
    expected = []
    for row, values in enumerate(rows):
        start = row_bound(starts, row, row_repeat)
        length = max(row_bound(ends, row, row_repeat) - start, 0)
        num_blocks = -(-length // block_size)
        scores = []
        for block in range(num_blocks):
            block_values = values[start + block * block_size : start + min((block + 1) * block_size, length)]
            selectable = [v for v in block_values if not math.isnan(v) and v != NEG_INF]
            scores.append(max(selectable) if selectable else NEG_INF)
        if num_blocks:
            scores[-1] = math.inf
        ranked = sorted((b for b in range(num_blocks) if scores[b] != NEG_INF), key=lambda b: (-scores[b], b))
        chosen = sorted(ranked[:num_blocks_k])
        expected.append(chosen + [-1] * (num_blocks_k - len(chosen)))
    return torch.tensor(expected, dtype=torch.int32).view(len(rows), num_blocks_k)


def mask_oracle(logits, starts, ends, candidate_blocks, block_size, row_repeat=1):
    expected = logits.clone()
    for row in range(logits.shape[0]):
        start = row_bound(starts, row, row_repeat)
        end = row_bound(ends, row, row_repeat)
        listed = {int(b) for b in candidate_blocks[row] if b >= 0}
        for column in range(logits.shape[1]):
            if not (start <= column < end and (column - start) // block_size in listed):
                expected[row, column] = NEG_INF
    return expected


def make_rows(num_bounds, width, seed, *, with_starts=True):
    """Random bounds (empty rows included), logits with garbage outside the bounds."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, width + 1, (num_bounds,), generator=generator, dtype=torch.int32)
    if not with_starts:
        starts.zero_()
    ends = starts + (torch.rand(num_bounds, generator=generator) * (width + 1 - starts)).to(torch.int32)
    if num_bounds > 1:
        ends[0] = starts[0]
    return starts if with_starts else None, ends, generator


def make_logits(num_rows, width, starts, ends, row_repeat, generator, data):
    if data == "random":
        logits = torch.randn(num_rows, width, generator=generator)
    elif data == "ties":
        logits = torch.randint(0, 3, (num_rows, width), generator=generator).float()
        logits[logits == 0] = -0.0
        logits[:, ::5] = 0.0
    else:
        logits = torch.randn(num_rows, width, generator=generator)
        special = torch.rand(num_rows, width, generator=generator)
        logits[special < 0.3] = float("nan")
        logits[(special >= 0.3) & (special < 0.6)] = NEG_INF
    for row in range(num_rows):
        start = row_bound(starts, row, row_repeat)
        end = row_bound(ends, row, row_repeat)
        for column in list(range(0, start)) + list(range(end, width)):
            logits[row, column] = GARBAGE[column % len(GARBAGE)]
    return logits


@pytest.mark.parametrize("data", ["random", "ties", "nan_and_neg_inf"])
@pytest.mark.parametrize("row_repeat", [1, 2])
@pytest.mark.parametrize("block_size", [1, 3, 8, 64])
@pytest.mark.parametrize("num_blocks_k", [1, 2, 5, 100])
@pytest.mark.parametrize("with_starts", [True, False])
def test_select_matches_loop_oracle(data, row_repeat, block_size, num_blocks_k, with_starts):
    num_rows, width = 7, 50
    starts, ends, generator = make_rows(-(-num_rows // row_repeat) + 1, width, seed=block_size, with_starts=with_starts)
    logits = make_logits(num_rows, width, starts, ends, row_repeat, generator, data)
    result = select_candidate_blocks(logits, starts, ends, num_blocks_k, block_size, row_repeat=row_repeat)
    assert result.dtype == torch.int32
    assert torch.equal(result, select_oracle(logits, starts, ends, num_blocks_k, block_size, row_repeat))


def test_select_equal_block_maxima_go_to_the_lower_block_id():
    # Blocks 0..4 of 4 positions; blocks 1, 2 and 3 share the maximum 5.0; block 4 is newest (pinned).
    logits = torch.tensor([[1.0, 0, 0, 0, 5, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 5, -9, -9, -9, -9]])
    result = select_candidate_blocks(logits, None, torch.tensor([20], dtype=torch.int32), 3, 4)
    assert result.tolist() == [[1, 2, 4]]


def test_select_negative_and_positive_zero_tie():
    logits = torch.tensor([[-0.0, 0.0, 0.0, -0.0, -1.0]])
    result = select_candidate_blocks(logits, None, torch.tensor([5], dtype=torch.int32), 3, 1)
    assert result.tolist() == [[0, 1, 4]]


def test_select_pins_partial_newest_block_even_when_it_scores_lowest():
    logits = torch.tensor([[9.0, 9.0, 8.0, 8.0, 7.0, 7.0, -5.0, float("nan")]])
    ends = torch.tensor([7], dtype=torch.int32)  # newest block 3 holds only column 6
    result = select_candidate_blocks(logits, None, ends, 2, 2)
    assert result.tolist() == [[0, 3]]


def test_select_newest_block_is_chosen_even_when_all_unselectable():
    logits = torch.tensor([[1.0, 2.0, float("nan"), NEG_INF, NEG_INF]])
    # Block 1 (nan, -inf) is never chosen; the newest block 2 (-inf) is pinned.
    result = select_candidate_blocks(logits, None, torch.tensor([5], dtype=torch.int32), 4, 2)
    assert result.tolist() == [[0, 2, -1, -1]]
    result = select_candidate_blocks(logits, None, torch.tensor([4], dtype=torch.int32), 4, 2)
    assert result.tolist() == [[0, 1, -1, -1]]


def test_select_blocks_without_selectable_entries_are_never_chosen():
    logits = torch.tensor([[NEG_INF, float("nan"), 3.0, NEG_INF, NEG_INF, NEG_INF, 1.0]])
    result = select_candidate_blocks(logits, None, torch.tensor([7], dtype=torch.int32), 4, 2)
    assert result.tolist() == [[1, 3, -1, -1]]


def test_select_rows_without_context_give_only_minus_one():
    logits = torch.randn(3, 10)
    bounds = torch.tensor([4, 0, 10], dtype=torch.int32)
    result = select_candidate_blocks(logits, bounds, bounds, 3, 2)
    assert torch.equal(result, torch.full((3, 3), -1, dtype=torch.int32))


@pytest.mark.parametrize("num_rows,width", [(0, 10), (3, 0), (0, 0)])
def test_select_zero_size_logits(num_rows, width):
    out = torch.full((num_rows, 4), -777, dtype=torch.int32)
    result = select_candidate_blocks(torch.zeros(num_rows, width), None, torch.zeros(3, dtype=torch.int32), 4, 2,
                                     out=out)
    assert result is out
    assert torch.equal(out, torch.full((num_rows, 4), -1, dtype=torch.int32))


def test_select_strided_logits_match_contiguous():
    starts, ends, generator = make_rows(5, 33, seed=3)
    contiguous = make_logits(5, 33, starts, ends, 1, generator, "ties")
    transposed = contiguous.t().contiguous().t()  # column-major [5, 33]
    padded_rows = torch.full((5, 50), float("nan"))
    padded_rows[:, 7:40] = contiguous
    expected = select_oracle(contiguous, starts, ends, 3, 4)
    assert torch.equal(select_candidate_blocks(transposed, starts, ends, 3, 4), expected)
    assert torch.equal(select_candidate_blocks(padded_rows[:, 7:40], starts, ends, 3, 4), expected)


def test_select_writes_every_entry_of_out():
    starts, ends, generator = make_rows(4, 20, seed=5)
    logits = make_logits(4, 20, starts, ends, 1, generator, "random")
    out = torch.full((4, 6), -777, dtype=torch.int32)
    result = select_candidate_blocks(logits, starts, ends, 6, 3, out=out)
    assert result is out
    assert torch.equal(out, select_oracle(logits, starts, ends, 6, 3))


@pytest.mark.parametrize("row_repeat", [1, 2, 3])
@pytest.mark.parametrize("block_size", [1, 4, 7])
@pytest.mark.parametrize("with_starts", [True, False])
def test_mask_matches_loop_oracle(row_repeat, block_size, with_starts):
    num_rows, width = 6, 30
    starts, ends, generator = make_rows(-(-num_rows // row_repeat), width, seed=block_size, with_starts=with_starts)
    logits = make_logits(num_rows, width, starts, ends, row_repeat, generator, "nan_and_neg_inf")
    # -1 padding, other negatives, duplicates, ids past the row's blocks and past the logits' blocks.
    candidate_blocks = torch.randint(-3, width // block_size + 3, (num_rows, 5), generator=generator,
                                     dtype=torch.int32)
    candidate_blocks[:, 0] = -1
    candidate_blocks[:, 1] = candidate_blocks[:, 2]
    expected = mask_oracle(logits, starts, ends, candidate_blocks, block_size, row_repeat)
    assert apply_candidate_mask(logits, starts, ends, candidate_blocks, block_size, row_repeat=row_repeat) is None
    assert torch.equal(logits.isnan(), expected.isnan())
    assert torch.equal(logits.nan_to_num(0.0), expected.nan_to_num(0.0))


def test_mask_strided_view_leaves_the_rest_of_the_buffer_untouched():
    buffer = torch.randn(4, 30)
    original = buffer.clone()
    logits = buffer[:, 5:25]
    starts = torch.tensor([0, 3, 5, 19], dtype=torch.int32)
    ends = torch.tensor([20, 17, 5, 20], dtype=torch.int32)
    candidate_blocks = torch.tensor([[0, 3], [1, -1], [0, 1], [0, -1]], dtype=torch.int32)
    expected = mask_oracle(logits, starts, ends, candidate_blocks, 4)
    apply_candidate_mask(logits, starts, ends, candidate_blocks, 4)
    assert torch.equal(logits, expected)
    assert torch.equal(buffer[:, :5], original[:, :5])
    assert torch.equal(buffer[:, 25:], original[:, 25:])


def test_mask_keeps_exactly_the_selected_blocks():
    starts, ends, generator = make_rows(5, 40, seed=11)
    logits = make_logits(5, 40, starts, ends, 1, generator, "random")
    chosen = select_candidate_blocks(logits, starts, ends, 2, 4)
    expected = mask_oracle(logits, starts, ends, chosen, 4)
    apply_candidate_mask(logits, starts, ends, chosen, 4)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("shape", [(0, 10, 3), (3, 0, 2), (3, 8, 0)])
def test_mask_zero_size_inputs(shape):
    num_rows, width, num_candidates = shape
    logits = torch.randn(num_rows, width)
    candidate_blocks = torch.zeros(num_rows, num_candidates, dtype=torch.int32)
    ends = torch.full((3,), width, dtype=torch.int32)
    expected = mask_oracle(logits, None, ends, candidate_blocks, 2)
    apply_candidate_mask(logits, None, ends, candidate_blocks, 2)
    assert torch.equal(logits, expected)


def _select_args(**overrides):
    args = {
        "logits": torch.randn(4, 10),
        "starts": torch.zeros(4, dtype=torch.int32),
        "ends": torch.full((4,), 10, dtype=torch.int32),
        "num_blocks_k": 3,
        "block_size": 2,
        "row_repeat": 1,
        "out": torch.full((4, 3), -777, dtype=torch.int32),
        "backend": "auto",
    }
    args.update(overrides)
    return args


SELECT_ERRORS = [
    ({"logits": [[1.0]]}, TypeError, "logits"),
    ({"logits": torch.randn(4, 10, dtype=torch.float16)}, TypeError, "logits"),
    ({"logits": torch.randn(40)}, ValueError, "logits"),
    ({"starts": torch.zeros(3, dtype=torch.int32)}, ValueError, "starts"),
    ({"starts": torch.zeros(4)}, TypeError, "starts"),
    ({"starts": torch.zeros(4, dtype=torch.int16)}, TypeError, "starts"),
    ({"starts": torch.tensor([0, -1, 0, 0], dtype=torch.int32)}, ValueError, "starts"),
    ({"starts": torch.tensor([0, 0, 0, 11], dtype=torch.int32)}, ValueError, "starts"),
    ({"ends": torch.tensor([10, 10, 11, 10], dtype=torch.int32)}, ValueError, "ends"),
    ({"starts": None, "ends": torch.tensor([10, -1, 10, 10], dtype=torch.int32)}, ValueError, "starts"),
    ({"ends": None}, TypeError, "ends"),
    ({"ends": torch.full((3,), 10, dtype=torch.int32)}, ValueError, "ends"),
    ({"ends": torch.full((2, 2), 10, dtype=torch.int32)}, ValueError, "ends"),
    ({"ends": torch.full((2,), 10, dtype=torch.int32), "row_repeat": 1}, ValueError, "ends"),
    ({"ends": torch.full((4,), 10, dtype=torch.int32, device="meta")}, ValueError, "ends"),
    ({"num_blocks_k": 0}, ValueError, "num_blocks_k"),
    ({"num_blocks_k": 1.5}, TypeError, "num_blocks_k"),
    ({"num_blocks_k": 2**31}, ValueError, "num_blocks_k"),
    ({"block_size": 0}, ValueError, "block_size"),
    ({"row_repeat": 0}, ValueError, "row_repeat"),
    ({"row_repeat": True}, TypeError, "row_repeat"),
    ({"out": torch.zeros(4, 3, dtype=torch.int64)}, TypeError, "out"),
    ({"out": torch.zeros(4, 2, dtype=torch.int32)}, ValueError, "out"),
    ({"backend": "gpu"}, ValueError, "backend"),
]


@pytest.mark.parametrize("overrides,error,name", SELECT_ERRORS)
def test_select_rejects_bad_arguments_without_writing(overrides, error, name):
    args = _select_args(**overrides)
    out = args["out"]
    before = out.clone()
    with pytest.raises(error, match=name):
        select_candidate_blocks(
            args.pop("logits"), args.pop("starts"), args.pop("ends"), args.pop("num_blocks_k"),
            args.pop("block_size"), **args
        )
    assert torch.equal(out, before)


def test_select_accepts_short_bounds_with_row_repeat():
    result = select_candidate_blocks(torch.randn(5, 6), None, torch.tensor([6, 6, 3], dtype=torch.int32), 1, 2,
                                     row_repeat=2)
    assert torch.equal(result[:, 0], torch.tensor([2, 2, 2, 2, 1], dtype=torch.int32))


def test_bounds_entries_no_row_uses_are_not_checked():
    # A fixed-size bounds buffer may hold anything past the entries rows read.
    logits = torch.randn(3, 8)
    starts = torch.tensor([0, 2, -50], dtype=torch.int32)
    ends = torch.tensor([8, 5, 999], dtype=torch.int32)
    result = select_candidate_blocks(logits, starts, ends, 2, 2, row_repeat=2)
    assert torch.equal(result, select_oracle(logits, starts, ends, 2, 2, row_repeat=2))
    expected = mask_oracle(logits, starts, ends, result, 2, row_repeat=2)
    apply_candidate_mask(logits, starts, ends, result, 2, row_repeat=2)
    assert torch.equal(logits, expected)


def _mask_args(**overrides):
    args = {
        "logits": torch.randn(4, 10),
        "starts": torch.zeros(2, dtype=torch.int32),
        "ends": torch.full((2,), 10, dtype=torch.int32),
        "candidate_blocks": torch.zeros(4, 2, dtype=torch.int32),
        "block_size": 2,
        "row_repeat": 2,
        "backend": "auto",
    }
    args.update(overrides)
    return args


MASK_ERRORS = [
    ({"logits": torch.randn(4, 10, dtype=torch.float64)}, TypeError, "logits"),
    ({"logits": torch.randn(4, 10, 1)}, ValueError, "logits"),
    ({"starts": torch.zeros(1, dtype=torch.int32)}, ValueError, "starts"),
    ({"ends": torch.full((2,), 10.0)}, TypeError, "ends"),
    ({"ends": torch.tensor([10, 11], dtype=torch.int32)}, ValueError, "ends"),
    ({"starts": torch.tensor([0, 11], dtype=torch.int32)}, ValueError, "starts"),
    ({"starts": torch.tensor([-3, 0], dtype=torch.int32)}, ValueError, "starts"),
    ({"candidate_blocks": torch.zeros(4, 2, dtype=torch.uint8)}, TypeError, "candidate_blocks"),
    ({"row_repeat": 1}, ValueError, "starts"),
    ({"candidate_blocks": torch.zeros(3, 2, dtype=torch.int32)}, ValueError, "candidate_blocks"),
    ({"candidate_blocks": torch.zeros(4, 2)}, TypeError, "candidate_blocks"),
    ({"candidate_blocks": torch.zeros(4, dtype=torch.int32)}, ValueError, "candidate_blocks"),
    ({"candidate_blocks": torch.zeros(4, 2, dtype=torch.int32, device="meta")}, ValueError, "candidate_blocks"),
    ({"block_size": -4}, ValueError, "block_size"),
    ({"row_repeat": 0}, ValueError, "row_repeat"),
    ({"backend": "tpu"}, ValueError, "backend"),
]


@pytest.mark.parametrize("overrides,error,name", MASK_ERRORS)
def test_mask_rejects_bad_arguments_without_writing(overrides, error, name):
    args = _mask_args(**overrides)
    logits = args["logits"]
    before = logits.clone()
    with pytest.raises(error, match=name):
        apply_candidate_mask(
            args.pop("logits"), args.pop("starts"), args.pop("ends"), args.pop("candidate_blocks"),
            args.pop("block_size"), **args
        )
    assert torch.equal(logits, before)


@pytest.mark.parametrize("block_size", [2**24, 2**40])
def test_select_reference_memory_does_not_grow_with_block_size(block_size):
    # One block covers every row: the result is that of block_size = width. A rows x block_size working
    # set would take GiBs at 2**24 and fail to allocate at 2**40.
    logits = make_logits(4, 64, None, None, 1, torch.Generator().manual_seed(0), "random")
    ends = torch.tensor([64, 33, 1, 0], dtype=torch.int32)
    result = select_candidate_blocks(logits, None, ends, 2, block_size, backend="reference")
    assert torch.equal(result, select_candidate_blocks(logits, None, ends, 2, 64, backend="reference"))
    assert torch.equal(result, select_oracle(logits, None, ends, 2, block_size))
    assert result.tolist() == [[0, -1], [0, -1], [0, -1], [-1, -1]]
