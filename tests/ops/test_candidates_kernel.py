"""Triton select_candidate_blocks / apply_candidate_mask (and indices_to_slots, benchmarked with them)
against the PyTorch reference, bit for bit, default kernels and every variant.

Runs on CUDA (scripts/gpu-check) or on Triton's CPU interpreter (TRITON_INTERPRET=1, tiny shapes).
"""

from __future__ import annotations

import pytest
import torch
import triton
from cpu_subset import cpu_subset

from dsa_indexer.ops.candidates import apply_candidate_mask, select_candidate_blocks
from dsa_indexer.ops.candidates import triton as candidates_triton
from dsa_indexer.ops.candidates.triton import (
    MaskConfig,
    SelectConfig,
    apply_candidate_mask_triton,
    select_candidate_blocks_triton,
)
from dsa_indexer.ops.topk.reference import indices_to_slots as indices_to_slots_reference
from dsa_indexer.ops.topk.triton import indices_to_slots_triton

TWO_LAUNCHES = dict(config=SelectConfig(fused_max_blocks=0))  # block keys + radix select, whatever the width
FUSED_FLAGS = MaskConfig(fused_flags_min_rows=0)  # one mask program per row builds its own flags

NEG_INF = float("-inf")
GARBAGE = (float("nan"), 1e30, float("inf"), -1e30)


def make_bounds(num_bounds, width, generator, *, with_starts=True):
    """Random ``0 <= starts <= ends <= width``, the first entry an empty row."""
    starts = torch.randint(0, width + 1, (num_bounds,), generator=generator, dtype=torch.int32)
    if not with_starts:
        starts.zero_()
    ends = starts + (torch.rand(num_bounds, generator=generator) * (width + 1 - starts)).to(torch.int32)
    ends[0] = starts[0]
    return (starts if with_starts else None), ends


def make_logits(num_rows, width, generator, data):
    if data == "random":
        return torch.randn(num_rows, width, generator=generator)
    if data == "ties":
        logits = torch.randint(0, 3, (num_rows, width), generator=generator).float()
        logits[logits == 0] = -0.0
        logits[:, ::5] = 0.0
        return logits
    if data == "close":  # one exponent, keys differ in the low mantissa bits only: every radix pass runs
        return 1.0 + torch.randint(0, 64, (num_rows, width), generator=generator).float() * 2.0**-23
    if data == "relu":  # many exact zeros, some +inf
        logits = torch.randn(num_rows, width, generator=generator).clamp_min(0.0)
        logits[torch.rand(num_rows, width, generator=generator) < 0.02] = float("inf")
        return logits
    logits = torch.randn(num_rows, width, generator=generator)
    special = torch.rand(num_rows, width, generator=generator)
    logits[special < 0.3] = float("nan")
    logits[(special >= 0.3) & (special < 0.6)] = NEG_INF
    return logits


def garbage_outside(logits, starts, ends, row_repeat):
    """Fill every column outside a row's bounds with NaN / +-1e30 / inf (never to be read)."""
    num_rows, width = logits.shape
    column = torch.arange(width)
    bound = torch.arange(num_rows) // row_repeat
    lower = torch.zeros(num_rows, dtype=torch.int64) if starts is None else starts.long()[bound]
    upper = ends.long()[bound]
    outside = (column[None, :] < lower[:, None]) | (column[None, :] >= upper[:, None])
    pattern = torch.tensor(GARBAGE)[column % len(GARBAGE)].expand(num_rows, width)
    return torch.where(outside, pattern, logits)


def case(num_rows, width, seed, data, *, row_repeat=1, with_starts=True, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    starts, ends = make_bounds(-(-num_rows // row_repeat) + 1, width, generator, with_starts=with_starts)
    logits = garbage_outside(make_logits(num_rows, width, generator, data), starts, ends, row_repeat)
    moved = None if starts is None else starts.to(device)
    return logits.to(device), moved, ends.to(device), generator


def check_select(logits, starts, ends, num_blocks_k, block_size, row_repeat=1):
    expected = select_candidate_blocks(logits, starts, ends, num_blocks_k, block_size, row_repeat=row_repeat,
                                       backend="reference")
    out = torch.full((logits.shape[0], num_blocks_k), -777, dtype=torch.int32, device=logits.device)
    actual = select_candidate_blocks(logits, starts, ends, num_blocks_k, block_size, row_repeat=row_repeat, out=out,
                                     backend="triton")
    assert actual is out
    assert torch.equal(actual, expected)
    return actual


def check_mask(logits, starts, ends, candidate_blocks, block_size, row_repeat=1):
    expected = logits.clone()
    apply_candidate_mask(expected, starts, ends, candidate_blocks, block_size, row_repeat=row_repeat,
                         backend="reference")
    apply_candidate_mask(logits, starts, ends, candidate_blocks, block_size, row_repeat=row_repeat,
                         backend="triton")
    assert torch.equal(logits.view(torch.int32), expected.view(torch.int32))


# Blocks of 8 keep two data sets on the interpreter (CI time); the GPU suite runs every case.
SELECT_CASES = [pytest.param(block_size, data, marks=pytest.mark.slow if block_size == 8 and data not in ("random", "ties")
                             else ()) for block_size in (1, 3, 8)
                for data in ("random", "ties", "close", "relu", "nan_and_neg_inf")]


@pytest.mark.parametrize("block_size,data", SELECT_CASES)
@pytest.mark.parametrize("row_repeat,with_starts", [(1, True), (2, False)])
def test_select_matches_reference(kernel_device, data, block_size, row_repeat, with_starts):
    logits, starts, ends, _ = case(7, 60, block_size, data, row_repeat=row_repeat, with_starts=with_starts,
                                   device=kernel_device)
    for num_blocks_k in (1, 4, 9, 100):
        check_select(logits, starts, ends, num_blocks_k, block_size, row_repeat)


@pytest.mark.parametrize("block_size", [64, 200])
def test_select_large_blocks(kernel_device, block_size):
    logits, starts, ends, _ = case(5, 700, block_size, "nan_and_neg_inf", device=kernel_device)
    check_select(logits, starts, ends, 2, block_size)
    check_select(logits, starts, ends, 20, block_size)


def test_select_equal_block_maxima_go_to_the_lower_block_id(kernel_device):
    # Every block has maximum 1.0 except the newest (pinned): the lowest ids win.
    logits = torch.zeros(3, 64, device=kernel_device)
    logits[:, ::4] = 1.0
    ends = torch.tensor([64, 61, 33], dtype=torch.int32, device=kernel_device)
    result = check_select(logits, None, ends, 5, 4)
    assert result[0].tolist() == [0, 1, 2, 3, 15]
    assert result[2].tolist() == [0, 1, 2, 3, 8]


def test_select_infinite_logits_tie_with_the_pinned_block(kernel_device):
    # +inf blocks tie with the pinned newest block; the lower ids win, as in the reference.
    logits = torch.randn(2, 40, device=kernel_device)
    logits[:, 0] = float("inf")
    logits[:, 9] = float("inf")
    logits[0, 17] = float("inf")
    ends = torch.full((2,), 40, dtype=torch.int32, device=kernel_device)
    assert check_select(logits, None, ends, 2, 4)[0].tolist() == [0, 2]
    check_select(logits, None, ends, 3, 4)


def all_equal_and_unselectable_rows(device):
    """``[4, 3000]`` logits: all 0.5, all -inf, all NaN, alternating signed zeros; row ends just past or inside."""
    logits = torch.full((4, 3000), 0.5, device=device)
    logits[1] = NEG_INF
    logits[2] = float("nan")
    logits[3, ::2] = -0.0
    logits[3, 1::2] = 0.0
    return logits, torch.tensor([3000, 2999, 3000, 2500], dtype=torch.int32, device=device)


def test_select_all_equal_and_all_unselectable_rows(kernel_device):
    logits, ends = all_equal_and_unselectable_rows(kernel_device)
    result = check_select(logits, None, ends, 5, 2)
    assert result[1].tolist() == [1499, -1, -1, -1, -1]
    check_select(logits, None, ends, 2000, 1)


def test_select_rows_longer_than_one_chunk(kernel_device):
    # 5000 blocks per row: several chunks of keys per radix pass (the two-launch path; the fused kernel's
    # long rows are the GPU tests' V4.1 shapes); ties across chunk borders.
    generator = torch.Generator().manual_seed(11)
    starts = torch.tensor([0, 150, 200], dtype=torch.int32)
    ends = torch.tensor([5200, 5150, 5200], dtype=torch.int32)
    logits = garbage_outside(make_logits(3, 5200, generator, "ties"), starts, ends, 1).to(kernel_device)
    starts, ends = starts.to(kernel_device), ends.to(kernel_device)
    for num_blocks_k in (1500, 2600):
        expected = select_candidate_blocks(logits, starts, ends, num_blocks_k, 1, backend="reference")
        assert torch.equal(select_candidate_blocks_triton(logits, starts, ends, num_blocks_k, 1, 1, **TWO_LAUNCHES),
                           expected)


def test_select_strided_logits_and_out(kernel_device):
    logits, starts, ends, _ = case(5, 33, 3, "ties", device=kernel_device)
    expected = select_candidate_blocks(logits, starts, ends, 3, 4, backend="reference")
    column_major = logits.t().contiguous().t()
    padded = torch.full((5, 50), float("nan"), device=kernel_device)
    padded[:, 7:40] = logits
    for view in (column_major, padded[:, 7:40]):
        assert torch.equal(select_candidate_blocks(view, starts, ends, 3, 4, backend="triton"), expected)
    out_base = torch.full((3, 5), -777, dtype=torch.int32, device=kernel_device)
    select_candidate_blocks(logits, starts, ends, 3, 4, out=out_base.t(), backend="triton")
    assert torch.equal(out_base.t(), expected)


def test_select_empty_rows_and_k_past_the_block_count(kernel_device):
    logits = torch.randn(3, 10, device=kernel_device)
    bounds = torch.tensor([4, 0, 10], dtype=torch.int32, device=kernel_device)
    assert torch.equal(check_select(logits, bounds, bounds, 3, 2), torch.full((3, 3), -1, dtype=torch.int32,
                                                                              device=kernel_device))
    ends = torch.tensor([10, 9, 1], dtype=torch.int32, device=kernel_device)
    result = check_select(logits, None, ends, 8, 2)
    assert result[0, :5].tolist() == [0, 1, 2, 3, 4]
    assert result[2].tolist() == [0] + [-1] * 7


@pytest.mark.parametrize("num_rows,width", [(0, 10), (3, 0), (0, 0)])
def test_select_zero_size_logits(kernel_device, num_rows, width):
    logits = torch.zeros(num_rows, width, device=kernel_device)
    ends = torch.zeros(3, dtype=torch.int32, device=kernel_device)
    result = select_candidate_blocks(logits, None, ends, 4, 2, backend="triton")
    assert torch.equal(result, torch.full((num_rows, 4), -1, dtype=torch.int32, device=kernel_device))


@pytest.mark.parametrize("block_size", [1, 4, 7])
@pytest.mark.parametrize("row_repeat,with_starts", [(1, True), (2, False), (3, True)])
def test_mask_matches_reference(kernel_device, block_size, row_repeat, with_starts):
    logits, starts, ends, generator = case(6, 30, block_size, "nan_and_neg_inf", row_repeat=row_repeat,
                                           with_starts=with_starts, device=kernel_device)
    # -1 padding, other negatives, duplicates, ids past the row's blocks and past the logits' blocks.
    candidate_blocks = torch.randint(-3, 30 // block_size + 3, (6, 5), generator=generator, dtype=torch.int32)
    candidate_blocks[:, 0] = -1
    candidate_blocks[:, 1] = candidate_blocks[:, 2]
    check_mask(logits, starts, ends, candidate_blocks.to(kernel_device), block_size, row_repeat)


def test_mask_keeps_exactly_the_selected_blocks(kernel_device):
    logits, starts, ends, _ = case(5, 90, 5, "random", device=kernel_device)
    chosen = select_candidate_blocks(logits, starts, ends, 4, 8, backend="triton")
    check_mask(logits, starts, ends, chosen, 8)


def test_mask_strided_view_leaves_the_rest_of_the_buffer_untouched(kernel_device):
    buffer = torch.randn(4, 30, device=kernel_device)
    original = buffer.clone()
    logits = buffer[:, 5:25]
    starts = torch.tensor([0, 3, 5, 19], dtype=torch.int32, device=kernel_device)
    ends = torch.tensor([20, 17, 5, 20], dtype=torch.int32, device=kernel_device)
    candidate_blocks = torch.tensor([[0, 3], [1, -1], [0, 1], [0, -1]], dtype=torch.int32, device=kernel_device)
    check_mask(logits, starts, ends, candidate_blocks, 4)
    assert torch.equal(buffer[:, :5], original[:, :5])
    assert torch.equal(buffer[:, 25:], original[:, 25:])
    column_major = original[:, 5:25].t().contiguous().t()
    check_mask(column_major, starts, ends, candidate_blocks.t().contiguous().t(), 4)


@pytest.mark.parametrize("shape", [(0, 10, 3), (3, 0, 2), (3, 8, 0)])
def test_mask_zero_size_inputs(kernel_device, shape):
    num_rows, width, num_candidates = shape
    logits = torch.randn(num_rows, width, device=kernel_device)
    candidate_blocks = torch.zeros(num_rows, num_candidates, dtype=torch.int32, device=kernel_device)
    ends = torch.full((3,), width, dtype=torch.int32, device=kernel_device)
    check_mask(logits, None, ends, candidate_blocks, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("data", ["random", "ties", "close", "relu"])
def test_v41_shapes_match_reference_and_reruns_are_bitwise_stable(data):
    # 64 rows x 128K compressed positions, blocks of 8 (16K blocks per row), top 2048 blocks.
    generator = torch.Generator().manual_seed(1)
    num_rows, width = 64, 131072
    starts = torch.randint(0, 4096, (num_rows,), generator=generator, dtype=torch.int32)
    ends = width - torch.randint(0, 4096, (num_rows,), generator=generator, dtype=torch.int32)
    ends[:4] = starts[:4] + torch.tensor([0, 1, 8 * 2048, 8 * 2048 + 1], dtype=torch.int32)
    logits = garbage_outside(make_logits(num_rows, width, generator, data), starts, ends, 1).cuda()
    starts, ends = starts.cuda(), ends.cuda()
    first = check_select(logits, starts, ends, 2048, 8)
    for _ in range(20):
        assert torch.equal(select_candidate_blocks(logits, starts, ends, 2048, 8, backend="triton"), first)
    masked = logits.clone()
    check_mask(masked, starts, ends, first, 8)
    for _ in range(20):
        again = logits.clone()
        apply_candidate_mask(again, starts, ends, first, 8, backend="triton")
        assert torch.equal(again.view(torch.int32), masked.view(torch.int32))


@pytest.mark.gpu
def test_million_column_rows_with_row_repeat():
    generator = torch.Generator().manual_seed(2)
    width = 1 << 20
    logits = make_logits(4, width, generator, "close").cuda()
    ends = torch.tensor([width, width - 5], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, 3], dtype=torch.int32, device="cuda")
    chosen = check_select(logits, starts, ends, 2048, 8, row_repeat=2)
    check_mask(logits, starts, ends, chosen, 8, row_repeat=2)


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_bounds():
    # The kernels are captured directly: the public wrappers' bounds check reads back to the host.
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 4096, generator=generator).cuda()
    masked = torch.empty_like(logits)
    starts = torch.zeros(8, dtype=torch.int32, device="cuda")
    ends = torch.full((8,), 4096, dtype=torch.int32, device="cuda")
    out = torch.empty(8, 64, dtype=torch.int32, device="cuda")

    def step():
        select_candidate_blocks_triton(logits, starts, ends, 64, 8, 1, out)
        masked.copy_(logits)
        apply_candidate_mask_triton(masked, starts, ends, out, 8, 1)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        new_starts = torch.randint(0, 2048, (8,), generator=generator, dtype=torch.int32)
        starts.copy_(new_starts)
        ends.copy_(new_starts + torch.randint(0, 2049, (8,), generator=generator, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        expected = select_candidate_blocks(logits, starts, ends, 64, 8, backend="reference")
        assert torch.equal(out, expected)
        expected_masked = logits.clone()
        apply_candidate_mask(expected_masked, starts, ends, expected, 8, backend="reference")
        assert torch.equal(masked.view(torch.int32), expected_masked.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("blocks_per_row", [32, 64, 96])
@pytest.mark.parametrize("data", ["random", "ties"])
def test_select_split_discard_leaves_other_rows_images(blocks_per_row, data):
    # Rows of one, two and three 128-byte lines of scratch images (96 blocks pad to 128), many rows selected at
    # once: a row's discarded lines are its own, so every row still selects from its own images, run after run.
    generator = torch.Generator().manual_seed(6)
    num_rows, width = 1536, 8 * blocks_per_row - 3
    logits = make_logits(num_rows, width, generator, data).cuda()
    starts = torch.randint(0, 16, (num_rows,), generator=generator, dtype=torch.int32).cuda()
    ends = torch.full((num_rows,), width, dtype=torch.int32, device="cuda")
    variant = dict(config=SelectConfig(split_min_rows=0))
    for num_blocks_k in (1, 7, blocks_per_row // 2):
        expected = select_candidate_blocks(logits, starts, ends, num_blocks_k, 8, backend="reference")
        for _ in range(5):
            assert torch.equal(select_candidate_blocks_triton(logits, starts, ends, num_blocks_k, 8, 1, **variant),
                               expected)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks_per_row", [100, 200])
def test_mask_fused_flags_discard_leaves_other_rows_flags(blocks_per_row):
    # 1536 rows masked at once, each dropping its one or two 128-byte lines of flags after its tiles: a row's
    # discarded flags are its own, so every row still keeps exactly its listed blocks, run after run.
    generator = torch.Generator().manual_seed(7)
    num_rows, width = 1536, 8 * blocks_per_row - 5
    logits = make_logits(num_rows, width, generator, "random").cuda()
    starts = torch.randint(0, 16, (num_rows,), generator=generator, dtype=torch.int32).cuda()
    ends = torch.full((num_rows,), width, dtype=torch.int32, device="cuda")
    candidate_blocks = torch.randint(-1, blocks_per_row, (num_rows, 9), generator=generator, dtype=torch.int32).cuda()
    expected = logits.clone()
    apply_candidate_mask(expected, starts, ends, candidate_blocks, 8, backend="reference")
    for _ in range(5):
        masked = logits.clone()
        apply_candidate_mask_triton(masked, starts, ends, candidate_blocks, 8, 1, config=FUSED_FLAGS)
        assert torch.equal(masked.view(torch.int32), expected.view(torch.int32))


@pytest.mark.gpu
def test_select_split_discards_only_rows_of_whole_lines():
    lines = torch.empty(4, 32, dtype=torch.int32, device="cuda")
    assert candidates_triton._discardable_rows(lines)
    assert not candidates_triton._discardable_rows(torch.empty(4, 16, dtype=torch.int32, device="cuda"))
    assert not candidates_triton._discardable_rows(lines.view(-1)[8:].view(3, 40)[:, :32])
    assert not candidates_triton._discardable_rows(torch.empty(4, 32, dtype=torch.int32))


def test_select_split_discard_is_off_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not candidates_triton._discardable_rows(torch.empty(4, 32, dtype=torch.int32))


# The two-launch select (block keys + radix select: rows wider than the fused kernel's limit), with the shipped
# keys tile and a small one.
VARIANTS = {
    "two_launch": TWO_LAUNCHES,
    "two_launch_small_tiles": dict(config=SelectConfig(fused_max_blocks=0, keys_tile=64)),
}


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
@pytest.mark.parametrize("data", ["ties", "close", "nan_and_neg_inf"])
def test_select_variants_match_reference(kernel_device, variant, data):
    # Starts at multiples of 4 (the 16-byte path) and not; rows long enough for interior tiles.
    logits, _, ends, _ = case(6, 300, 7, data, device=kernel_device)
    starts = torch.tensor([0, 4, 8, 3, 100, 61, 0], dtype=torch.int32, device=kernel_device)
    ends = torch.maximum(ends, starts).clone()
    ends[0], ends[1], ends[2] = 300, 297, 8
    for num_blocks_k in (5, 40):
        expected = select_candidate_blocks(logits, starts, ends, num_blocks_k, 8, backend="reference")
        actual = select_candidate_blocks_triton(logits, starts, ends, num_blocks_k, 8, 1, **variant)
        assert torch.equal(actual, expected)
    expected = select_candidate_blocks(logits, None, ends, 9, 4, row_repeat=2, backend="reference")
    assert torch.equal(select_candidate_blocks_triton(logits, None, ends, 9, 4, 2, **variant), expected)


# The fused one-launch select (the default) in tiny streaming steps, so that interpreter rows span several.
FUSED_SMALL_STEPS = dict(config=SelectConfig(split_pieces=0, fused_step=16))
FUSED_ALIGNMENT_VARIANTS = {"fused": dict(config=SelectConfig(split_pieces=0, fused_step=128))}


@pytest.mark.parametrize("data", ["random", "ties", "close", "relu", "nan_and_neg_inf"])
@pytest.mark.parametrize("block_size,row_repeat,with_starts", [(8, 1, True), (3, 2, False), (1, 1, True)])
def test_select_fused_matches_reference(kernel_device, data, block_size, row_repeat, with_starts):
    # Random windows (an empty first row), K from 1 (only the pin or a +inf block) to past the block count.
    logits, starts, ends, _ = case(7, 60, block_size, data, row_repeat=row_repeat, with_starts=with_starts,
                                   device=kernel_device)
    for num_blocks_k in (1, 2, 5, 100):
        expected = select_candidate_blocks(logits, starts, ends, num_blocks_k, block_size, row_repeat=row_repeat,
                                           backend="reference")
        out = torch.full((7, num_blocks_k), -777, dtype=torch.int32, device=kernel_device)
        actual = select_candidate_blocks_triton(logits, starts, ends, num_blocks_k, block_size, row_repeat, out,
                                                **FUSED_SMALL_STEPS)
        assert actual is out
        assert torch.equal(actual, expected)


def assert_views_and_strided_out_match(logits, starts, ends, num_blocks_k, variant):
    """Column-major and NaN-padded views of ``logits`` selected (blocks of 4) into a transposed ``out``
    equal the reference."""
    rows, width = logits.shape
    expected = select_candidate_blocks(logits, starts, ends, num_blocks_k, 4, backend="reference")
    padded = torch.full((rows, width + 10), float("nan"), device=logits.device)
    padded[:, 7:width + 7] = logits
    out_base = torch.full((num_blocks_k, rows), -777, dtype=torch.int32, device=logits.device)
    for view in (logits.t().contiguous().t(), padded[:, 7:width + 7]):
        select_candidate_blocks_triton(view, starts, ends, num_blocks_k, 4, 1, out_base.t(), **variant)
        assert torch.equal(out_base.t(), expected)


@pytest.mark.parametrize("variant", FUSED_ALIGNMENT_VARIANTS.values(), ids=FUSED_ALIGNMENT_VARIANTS.keys())
def test_select_fused_aligned_starts_ties_pins_and_strides(kernel_device, variant):
    # Starts at multiples of 4 (16-byte path) and not; equal maxima and +inf blocks tying with the pin.
    logits, _, _, _ = case(6, 300, 7, "ties", device=kernel_device)
    logits[:, 40] = float("inf")
    logits[1, 120] = float("inf")
    starts = torch.tensor([0, 4, 8, 3, 100, 61], dtype=torch.int32, device=kernel_device)
    ends = torch.tensor([300, 297, 8, 300, 101, 299], dtype=torch.int32, device=kernel_device)
    for num_blocks_k in (1, 2, 3, 40):
        expected = select_candidate_blocks(logits, starts, ends, num_blocks_k, 8, backend="reference")
        assert torch.equal(select_candidate_blocks_triton(logits, starts, ends, num_blocks_k, 8, 1, **variant),
                           expected)
    assert_views_and_strided_out_match(logits, starts, ends, 5, variant)




def split(**fields) -> dict:
    """Keyword arguments that force the split select (every call, whatever its rows) with ``fields``."""
    return dict(config=SelectConfig(split_min_rows=0, **fields))


# Split select (the default from split_min_rows rows): several streaming programs per row, the last to finish
# selects (on a GPU the search counts with carry chains; the interpreter compares: the same counts).
SPLIT_VARIANTS = {"pieces_4": split(split_pieces=4, split_step=16),
                  "pieces_8_one_warp": split(split_pieces=8, split_warps=1, split_step=8),
                  "pieces_4_chunk_4": split(split_pieces=4, split_step=16, split_chunk=4),
                  "pieces_4_chunk_8": split(split_pieces=4, split_step=16, split_chunk=8),
                  "pieces_2_one_warp": split(split_pieces=2, split_warps=1, split_step=16)}


@pytest.mark.parametrize("variant", cpu_subset(list(SPLIT_VARIANTS.values()), list(SPLIT_VARIANTS),
                                               keep={"pieces_4", "pieces_4_chunk_4"}))
@pytest.mark.parametrize("data", ["random", "ties", "nan_and_neg_inf"])
@pytest.mark.parametrize("block_size,row_repeat,with_starts", [(8, 1, True), (3, 2, False)])
def test_select_split_matches_reference(kernel_device, variant, data, block_size, row_repeat, with_starts):
    # Random windows (an empty first row), K 1 (only the pin or a +inf block) to past the block count.
    logits, starts, ends, _ = case(7, 60, block_size, data, row_repeat=row_repeat, with_starts=with_starts,
                                   device=kernel_device)
    for num_blocks_k in (1, 5, 100):
        expected = select_candidate_blocks(logits, starts, ends, num_blocks_k, block_size, row_repeat=row_repeat,
                                           backend="reference")
        actual = select_candidate_blocks_triton(logits, starts, ends, num_blocks_k, block_size, row_repeat,
                                                **variant)
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("pieces,chunk", [(2, 256), pytest.param(16, 64, marks=pytest.mark.slow),
                                          pytest.param(2, 128, marks=pytest.mark.slow)])
def test_select_split_runs_ties_pins_and_strides(kernel_device, pieces, chunk):
    # One warp over 256 padded blocks, several steps per piece (pieces 2), one step per piece (16); chunks of 256
    # (one chunk; on a GPU 8 images per thread: 4-image carry sums), 128 (two chunks, 4-image carry sums) and 64
    # (four chunks, carry per image); the emit's runs of 4 ids. Aligned and unaligned starts, +inf blocks tying with
    # the pin, equal maxima, an empty row, column-major and padded views, a strided out.
    logits, _, _, _ = case(5, 500, 13, "ties", device=kernel_device)
    logits[:, 90] = float("inf")
    starts = torch.tensor([0, 4, 3, 100, 497], dtype=torch.int32, device=kernel_device)
    ends = torch.tensor([500, 500, 499, 101, 497], dtype=torch.int32, device=kernel_device)
    variant = split(split_pieces=pieces, split_warps=1, split_step=64, split_chunk=chunk)
    for num_blocks_k in (1, 2, 40, 200):
        expected = select_candidate_blocks(logits, starts, ends, num_blocks_k, 3, backend="reference")
        assert torch.equal(select_candidate_blocks_triton(logits, starts, ends, num_blocks_k, 3, 1, **variant),
                           expected)
    assert_views_and_strided_out_match(logits, starts, ends, 7, variant)


# The first search round placed by the row's moments (the split select samples them): rows
# whose moments mislead (lognormal tails, huge values whose squares overflow, +inf blocks left out of the moments,
# one value, negative rows) must still select exactly.
MOMENT_VARIANTS = {"fused": FUSED_SMALL_STEPS, "split": split(split_step=16),
                   "split_sample": split(split_step=16, moment_sample=16)}


def moment_rows(width, generator):
    normal = torch.randn(6, width, generator=generator)
    rows = [normal[0], torch.exp(3 * normal[1]), normal[2] * 3e38, normal[3] - 50.0,
            torch.full((width,), 2.5), normal[5].clamp_min(0.0)]
    rows[5][::7] = float("inf")
    return torch.stack(rows)


MOMENT_CASES = [(variant, data) for variant in ("fused", "split", "split_sample")
                for data in ("moments", "random", "ties", "close", "relu", "nan_and_neg_inf")]


@pytest.mark.parametrize("variant,data", [pytest.param(v, d, id=f"{v}-{d}", marks=() if v == "fused" else pytest.mark.slow)
                                          for v, d in MOMENT_CASES])
def test_select_moment_probes_match_reference(kernel_device, variant, data):
    generator = torch.Generator().manual_seed(11)
    if data == "moments":
        logits = moment_rows(480, generator).to(kernel_device)
        starts = torch.tensor([0, 4, 3, 0, 8, 1], dtype=torch.int32, device=kernel_device)
        ends = torch.full((6,), 480, dtype=torch.int32, device=kernel_device)
    else:
        logits, starts, ends, _ = case(7, 60, 8, data, device=kernel_device)
    for num_blocks_k in (1, 2, 5, 13, 100):
        expected = select_candidate_blocks(logits, starts, ends, num_blocks_k, 4, backend="reference")
        actual = select_candidate_blocks_triton(logits, starts, ends, num_blocks_k, 4, 1, **MOMENT_VARIANTS[variant])
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("config", [SelectConfig(), SelectConfig(split_min_rows=8, split_pieces=4),
                                    SelectConfig(split_pieces=0), SelectConfig(fused_max_blocks=64)],
                         ids=["default", "min_rows_8", "never_split", "narrow_fused"])
@pytest.mark.parametrize("sms", [1, 27, 28, 132])
def test_select_plan_rule(config, sms):
    # Two launches exactly for rows wider than fused_max_blocks blocks (or blocks wider than fused_step); else the
    # split select from split_min_rows rows on (monotone in the rows from there) and wherever every row's pieces
    # fit one program per SM, the fused kernel otherwise.
    for width, block_size in ((60, 8), (131072, 8), (16384 * 8 + 1, 8), (100, 2 * config.fused_step)):
        padded = triton.next_power_of_2(triton.cdiv(width, block_size))
        two_launches = padded > config.fused_max_blocks or triton.next_power_of_2(block_size) > config.fused_step
        plans = [candidates_triton.select_plan(config, rows, width, block_size, sms) for rows in range(1, 600)]
        for rows, plan in enumerate(plans, start=1):
            if two_launches:
                assert plan is None
            elif rows >= config.split_min_rows or rows * config.split_pieces <= sms:
                assert plan == config.split_pieces
            else:
                assert plan == 0
        if not two_launches:
            assert all(plan == config.split_pieces for plan in plans[config.split_min_rows - 1:])


def test_select_timeline_covers_the_split_select_only():
    # The phase timeline is the split kernel's: asking it of the fused kernel is refused before any launch.
    logits, starts, ends, _ = case(3, 60, 8, "random")
    out = torch.full((3, 5), -777, dtype=torch.int32)
    with pytest.raises(ValueError, match="split select"):
        candidates_triton.select_fused(logits, starts, ends, 5, 8, 1, out, 0, timeline={})
    assert bool((out == -777).all())


@pytest.mark.parametrize("sample", [3, 0, -8])
def test_select_moment_sample_must_be_a_power_of_two(sample):
    # Refused with the config: the sample is a power-of-two tensor of the selecting program.
    with pytest.raises(ValueError, match="moment_sample"):
        SelectConfig(moment_sample=sample)


@pytest.mark.gpu
def test_select_timeline_probe_gpu():
    # The phase timeline (barriers and global-timer stamps) leaves the ids bitwise equal; every program stamps its
    # start and arrival in order, and exactly one program a row (the last to arrive) its selection's phases.
    logits, starts, ends, _ = case(12, 4000, 9, "random", device="cuda")
    expected = select_candidate_blocks(logits, starts, ends, 40, 8, backend="reference")
    out = torch.empty_like(expected)
    timeline = {}
    candidates_triton.select_fused(logits, starts, ends, 40, 8, 1, out, 4, timeline=timeline)
    assert torch.equal(out, expected)
    stamps = timeline["split"].cpu()
    ct = candidates_triton
    assert stamps.shape == (12 * 4, ct._TL_SLOTS.value)
    assert bool((stamps[:, ct._TL_START.value] > 0).all())
    assert bool((stamps[:, ct._TL_ARRIVED.value] >= stamps[:, ct._TL_START.value]).all())
    selecting = stamps[stamps[:, ct._TL_EMITTED.value] > 0]
    assert selecting.shape[0] == 12
    phases = [ct._TL_ARRIVED.value, ct._TL_BOUNDS.value, ct._TL_SEARCHED.value, ct._TL_EMITTED.value]
    assert bool((selecting[:, phases].diff(dim=1) >= 0).all())
    searched = selecting[selecting[:, ct._TL_ROUNDS.value] > 0]  # rows whose search ran a round
    assert searched.shape[0] > 0
    rounds = [ct._TL_BOUNDS.value, ct._TL_FIRST_ROUND_START.value, ct._TL_FIRST_ROUND_END.value,
              ct._TL_SEARCHED.value]
    assert bool((searched[:, rounds].diff(dim=1) >= 0).all())


def test_select_fused_all_equal_unselectable_and_too_wide_rows(kernel_device):
    # Equal keys everywhere (the search ends on a one-key bracket), rows without selectable logits, and
    # rows wider than _FUSED_MAX_BLOCKS blocks (the two-launch path). 2048 and 4096 padded blocks: on a GPU,
    # carry counts summed by 4 in the asm.
    logits, ends = all_equal_and_unselectable_rows(kernel_device)
    for num_blocks_k, block_size in ((5, 2), (700, 2), (2000, 1)):
        expected = select_candidate_blocks(logits, None, ends, num_blocks_k, block_size, backend="reference")
        actual = select_candidate_blocks_triton(logits, None, ends, num_blocks_k, block_size, 1,
                                                config=SelectConfig(split_pieces=0, fused_step=1024))
        assert torch.equal(actual, expected)
    wide = torch.randn(2, 2 * candidates_triton._FUSED_MAX_BLOCKS + 3, device=kernel_device)
    wide_ends = torch.tensor([wide.shape[1], 100], dtype=torch.int32, device=kernel_device)
    expected = select_candidate_blocks(wide, None, wide_ends, 3, 1, backend="reference")
    assert torch.equal(select_candidate_blocks_triton(wide, None, wide_ends, 3, 1, 1), expected)


MASK_VARIANTS = {"flags_launch": {}, "fused_flags": dict(fused_flags_min_rows=0)}


@pytest.mark.parametrize("variant", MASK_VARIANTS.values(), ids=MASK_VARIANTS.keys())
@pytest.mark.parametrize("block_size,tile", [(8, 64), (4, 32), (12, 128), (8, 4096)])
def test_mask_variants_match_reference(kernel_device, variant, block_size, tile):
    logits, _, _, generator = case(6, 400, block_size, "nan_and_neg_inf", device=kernel_device)
    starts = torch.tensor([0, 4, 12, 3, 200, 400], dtype=torch.int32, device=kernel_device)
    ends = torch.tensor([400, 397, 300, 399, 400, 400], dtype=torch.int32, device=kernel_device)
    candidate_blocks = torch.randint(-1, 400 // block_size + 2, (6, 20), generator=generator, dtype=torch.int32)
    candidate_blocks = candidate_blocks.to(kernel_device)
    expected = logits.clone()
    apply_candidate_mask(expected, starts, ends, candidate_blocks, block_size, backend="reference")
    apply_candidate_mask_triton(logits, starts, ends, candidate_blocks, block_size, 1,
                                config=MaskConfig(tile=tile, **variant))
    assert torch.equal(logits.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("row_repeat,with_starts", [(1, True), (2, False)])
def test_mask_fused_flags_strided_candidates_and_row_repeat(kernel_device, row_repeat, with_starts):
    # Column-major ids with -1, other negatives, duplicates and ids past the row; rows sharing bounds.
    logits, starts, ends, generator = case(6, 60, 3, "random", row_repeat=row_repeat, with_starts=with_starts,
                                           device=kernel_device)
    candidate_blocks = torch.randint(-2, 60 // 4 + 3, (6, 9), generator=generator, dtype=torch.int32)
    candidate_blocks = candidate_blocks.t().contiguous().t().to(kernel_device)
    expected = logits.clone()
    apply_candidate_mask(expected, starts, ends, candidate_blocks, 4, row_repeat=row_repeat, backend="reference")
    apply_candidate_mask_triton(logits, starts, ends, candidate_blocks, 4, row_repeat, config=FUSED_FLAGS)
    assert torch.equal(logits.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("k", [2048, 2050, 2051, 130, 8])
def test_indices_to_slots_match_reference(kernel_device, k):
    # Rows of whole 2048-position programs (16-byte rows when k % 4 == 0) and partial ones.
    generator = torch.Generator().manual_seed(k)
    num_rows, pages, block_size = 6, 9, 16
    indices = torch.randint(-1, pages * block_size, (num_rows, k), generator=generator, dtype=torch.int32)
    table = torch.randperm(3 * pages, generator=generator).to(torch.int32).view(3, pages)
    row_to_request = torch.tensor([0, 0, 1, 2, 2, 1], dtype=torch.int32)
    expected = indices_to_slots_reference(indices, table, block_size, row_to_request)
    args = [t.to(kernel_device) for t in (indices, table)]
    actual = indices_to_slots_triton(args[0], args[1], block_size, row_to_request.to(kernel_device))
    assert torch.equal(actual.cpu(), expected)
    strided = torch.full((num_rows, k + 3), -5, dtype=torch.int32, device=kernel_device)[:, 3:]
    strided.copy_(args[0])
    actual = indices_to_slots_triton(strided, args[1], block_size, row_to_request.to(kernel_device))
    assert torch.equal(actual.cpu(), expected)


def v41_case(data):
    """16 rows of the V4.1 shape, starts alternately multiples of 4 and not, and their reference top-2048."""
    generator = torch.Generator().manual_seed(4)
    num_rows, width = 16, 131072
    starts = torch.randint(0, 1024, (num_rows,), generator=generator, dtype=torch.int32) * 4
    starts[1::2] += 1
    ends = width - torch.randint(0, 4096, (num_rows,), generator=generator, dtype=torch.int32)
    logits = garbage_outside(make_logits(num_rows, width, generator, data), starts, ends, 1).cuda()
    starts, ends = starts.cuda(), ends.cuda()
    return logits, starts, ends, select_candidate_blocks(logits, starts, ends, 2048, 8, backend="reference")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
@pytest.mark.parametrize("data", ["random", "close"])
def test_v41_shapes_select_variants(data, variant):
    logits, starts, ends, expected = v41_case(data)
    keys = candidates_triton.block_keys(logits, starts, ends, 8, 1, **variant)
    out = torch.empty_like(expected)
    candidates_triton.select_from_keys(keys, starts, ends, 2048, 8, 1, out)
    assert torch.equal(out, expected)


# Bench-sized kernels: the fused kernel and the split select forced, and the default's choice.
V41_FUSED_VARIANTS = {"default": {}, "fused": dict(config=SelectConfig(split_pieces=0)), "split_4": split(),
                      "split_8": split(split_pieces=8)}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", V41_FUSED_VARIANTS.values(), ids=V41_FUSED_VARIANTS.keys())
@pytest.mark.parametrize("data", ["random", "close", "ties", "relu"])
def test_v41_shapes_fused_select(data, variant):
    logits, starts, ends, expected = v41_case(data)
    for _ in range(3):
        assert torch.equal(select_candidate_blocks_triton(logits, starts, ends, 2048, 8, 1, **variant), expected)
    logits, starts, ends, _ = case(64, 131072, 9, data, device="cuda")  # random windows, empty row first
    for num_blocks_k in (2048, 1):
        expected = select_candidate_blocks(logits, starts, ends, num_blocks_k, 8, backend="reference")
        assert torch.equal(select_candidate_blocks_triton(logits, starts, ends, num_blocks_k, 8, 1, **variant),
                           expected)


V41_MASK_VARIANTS = {"flags_launch": {}, "fused_flags": dict(config=FUSED_FLAGS)}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", V41_MASK_VARIANTS.values(), ids=V41_MASK_VARIANTS.keys())
def test_v41_shapes_mask_variants(variant):
    logits, starts, ends, chosen = v41_case("random")
    expected = logits.clone()
    apply_candidate_mask(expected, starts, ends, chosen, 8, backend="reference")
    apply_candidate_mask_triton(logits, starts, ends, chosen, 8, 1, **variant)
    assert torch.equal(logits.view(torch.int32), expected.view(torch.int32))


@pytest.mark.gpu
def test_indices_to_slots_variants_at_bench_shape():
    generator = torch.Generator(device="cuda").manual_seed(5)
    indices = torch.randint(-1, 65536, (512, 2048), device="cuda", generator=generator, dtype=torch.int32)
    table = torch.randperm(8 * 1024, device="cuda", generator=generator).to(torch.int32).view(8, 1024)
    row_to_request = torch.arange(512, device="cuda", dtype=torch.int32) // 64
    expected = indices_to_slots_reference(indices, table, 64, row_to_request)
    assert torch.equal(indices_to_slots_triton(indices, table, 64, row_to_request), expected)


@pytest.mark.parametrize("config", [SelectConfig(), SelectConfig(fused_max_blocks=0)], ids=["fused", "two_launches"])
def test_unchecked_bounds_past_the_row_are_clamped(kernel_device, config, monkeypatch):
    # Value checks off: a start below 0, ends past the width and a start past it act as the window clamped into
    # [0, width] (the reference on clamped bounds), with no read or scratch write outside the rows.
    monkeypatch.setenv("DSA_INDEXER_SKIP_VALUE_CHECKS", "1")
    generator = torch.Generator().manual_seed(17)
    logits = make_logits(4, 40, generator, "random").to(kernel_device)
    starts = torch.tensor([-5, 3, 45, 0], dtype=torch.int32, device=kernel_device)
    ends = torch.tensor([30, 10**6, 50, 2**31 - 1], dtype=torch.int32, device=kernel_device)
    clamped_starts = starts.clamp(0, 40)
    clamped_ends = torch.maximum(ends, clamped_starts).clamp(max=40)
    expected = select_candidate_blocks(logits, clamped_starts, clamped_ends, 3, 4, backend="reference")
    got = candidates_triton.select_candidate_blocks_triton(logits, starts, ends, 3, 4, 1, config=config)
    assert torch.equal(got, expected)
    masked, expected_masked = logits.clone(), logits.clone()
    apply_candidate_mask(expected_masked, clamped_starts, clamped_ends, expected, 4, backend="reference")
    apply_candidate_mask(masked, starts, ends, expected, 4, backend="triton")
    assert torch.equal(masked.view(torch.int32), expected_masked.view(torch.int32))
