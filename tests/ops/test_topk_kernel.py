"""Triton top-k kernels against the reference: bitwise equal outputs on adversarial rows, every path.

The interpreter tests shrink the kernels' tuning (``TopkConfig``) so that tiny rows reach the split
path (group maxima, exact or early-stopped lower bound, candidates stored in column order through a
look-back and searched in registers or in memory, emit by the row's last program), the streaming row
programs (group maxima streamed in the program or from a launch of chunk programs, lower bound with and
without the early stop, gather pieces with and without masks, candidates in registers and in memory,
emit from the candidates or from the row; or gathered by a launch of one program per piece, which places its
candidates through a look-back over the row's piece flags; every search on order images from known brackets)
and the whole-row programs. GPU tests use the default tuning at realistic sizes, with each wide-row path forced
in turn.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from cpu_subset import cpu_subset

from dsa_indexer.backend import ENV_VAR
from dsa_indexer.ops.topk import indices_to_slots, reference, topk, topk_decode, topk_decode_slots
from dsa_indexer.testing import ADVERSARIAL_GENERATORS, count_topk_errors, with_garbage_past_ends

pytest.importorskip("triton", reason="Triton kernel tests need triton (make test installs it)")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dsa_indexer.ops.common import selection  # noqa: E402  (after the skip: it imports triton)
from dsa_indexer.ops.topk import triton as triton_impl  # noqa: E402

TopkConfig = triton_impl.TopkConfig

POISON = -777
# Tiny tiles so that interpreter rows reach every path: widths above 16 take the split path (few rows: 16-column
# chunks, at most 16 group maxima per row, so groups of 2, 4, 8 columns as rows widen, at most 8 candidates
# searched in registers) or row programs (``row_program_rows=1``).
TINY = dict(row_block_max=16, stream_tile=16, group_tile=16, candidate_block=8, chunk=16, pieces_tile=16)
SPLIT = TopkConfig(**TINY, row_program_rows=1 << 30)
# Plain row programs (no gather launch) with the maxima launch, and streaming the row in the program (a ``chunk``
# below the group width: the path of rows wider than 16M columns at the default tiles) with the lower-bound
# search stopped early (up to 4k maxima above it).
STREAM = TopkConfig(**TINY, row_program_rows=1, pieces_max_rows=0)
STREAM_IN_PROGRAM = replace(STREAM, chunk=1)
STREAM_LOOSE = replace(STREAM_IN_PROGRAM, bound_slack=3.0)
SPLIT_LOOSE = replace(SPLIT, bound_slack=3.0)
# Row programs with a gather launch (one program per gather piece of 2 groups, its candidates placed in the row's
# buffer by a look-back over the piece flags; the last one emits), waiting for the whole row-program grid or each
# piece for its own row (PDL is ignored under the interpreter: the kernels run without it).
PIECES = TopkConfig(**TINY, row_program_rows=1, pieces_ready_max_rows=0)
PIECES_LOOSE = replace(PIECES, bound_slack=3.0)
PIECES_READY = replace(PIECES, pieces_ready_max_rows=1 << 30)
# The gather by group tiles (``lean_gather=False``; the default gathers by quads of 4 columns where groups hold 4 to
# 16 columns, as the widths here give, and by group tiles elsewhere).
STREAM_TILE_GATHER = replace(STREAM, lean_gather=False)
STREAM_IN_PROGRAM_TILE_GATHER = replace(STREAM_IN_PROGRAM, lean_gather=False)
PIECES_TILE_GATHER = replace(PIECES_READY, lean_gather=False)
WIDE = [SPLIT, SPLIT_LOOSE, STREAM, STREAM_LOOSE, STREAM_IN_PROGRAM, PIECES, PIECES_LOOSE, PIECES_READY,
        STREAM_TILE_GATHER, STREAM_IN_PROGRAM_TILE_GATHER, PIECES_TILE_GATHER]
WIDE_IDS = ["split", "split_loose", "stream", "stream_loose", "stream_in_program", "pieces", "pieces_loose",
            "pieces_ready", "stream_tile_gather", "stream_in_program_tile_gather", "pieces_tile_gather"]
# Each wide-row path forced at the default tiles.
GPU_SPLIT = TopkConfig(row_program_rows=1 << 30)
GPU_STREAM = TopkConfig(row_program_rows=1, pieces_max_rows=0)
GPU_STREAM_IN_PROGRAM = replace(GPU_STREAM, chunk=1)
GPU_PIECES = TopkConfig(row_program_rows=1, pieces_max_rows=1 << 30, pieces_ready_max_rows=0)
GPU_PIECES_READY = replace(GPU_PIECES, pieces_ready_max_rows=1 << 30)
GPU_WIDE = [GPU_SPLIT, GPU_STREAM, GPU_STREAM_IN_PROGRAM, GPU_PIECES, GPU_PIECES_READY,
            replace(GPU_STREAM, lean_gather=False), replace(GPU_STREAM_IN_PROGRAM, lean_gather=False),
            replace(GPU_PIECES_READY, lean_gather=False)]
GPU_WIDE_IDS = ["split", "stream", "stream_in_program", "pieces", "pieces_ready", "stream_tile_gather",
                "stream_in_program_tile_gather", "pieces_ready_tile_gather"]
# The default (its routing), the same without PDL, with the gather pieces waiting on their own row program up to
# 128 rows, and with the gather by group tiles, at 32 to 128 rows of 131072.
GPU_DEFAULT = triton_impl.DEFAULT_CONFIG
GPU_NO_PDL = TopkConfig(pdl=False)
GPU_ROW_READY = TopkConfig(pieces_ready_max_rows=128, pieces_max_rows=128)
GPU_TILE_GATHER = TopkConfig(lean_gather=False)
GPU_MANY_ROWS = [GPU_SPLIT, GPU_PIECES, GPU_DEFAULT, GPU_NO_PDL, GPU_ROW_READY, GPU_TILE_GATHER]
GPU_MANY_ROWS_IDS = ["split_many_rows", "pieces_many_rows", "default_many_rows", "no_pdl_many_rows",
                     "row_ready_many_rows", "tile_gather_many_rows"]
ROW = TopkConfig()  # whole rows: carry counts, plateau check every 16 bits
ONE_ROW = TopkConfig(row_elements=16)  # one row per whole-row program
# One launch per tile (64/32/16 columns): one row of 64 per program, two rows of 32 / four of 16 (packed); one
# unclassed launch (a single tile, as rows of at most 16 columns take); the plateau check in every round.
ROW_LAUNCHES = TopkConfig(row_elements=64, row_max_registers=128)
ROW_ONE_TILE = TopkConfig(row_tiles=1)
ROW_PLATEAU_EVERY_BIT = TopkConfig(row_plateau_every=1, row_elements=64, row_max_registers=128)
ROWS_FAST = [ROW, ROW_LAUNCHES, ROW_ONE_TILE, ROW_PLATEAU_EVERY_BIT]
ROWS_FAST_IDS = ["row", "row_launches", "row_one_tile", "row_p1"]
WIDE_CPU = cpu_subset(WIDE, WIDE_IDS, keep={"split", "stream", "pieces"})


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def poisoned(num_rows: int, k: int, device) -> torch.Tensor:
    return torch.full((num_rows, k), POISON, dtype=torch.int32, device=device)


def reference_topk(logits, k, starts=None, ends=None):
    return reference.topk(logits, k, starts, ends, poisoned(logits.shape[0], k, logits.device))


def triton_topk(logits, k, starts=None, ends=None, config=ROW):
    return triton_impl.topk_triton(logits, k, starts, ends, poisoned(logits.shape[0], k, logits.device), config=config)


def assert_same(logits, k, starts=None, ends=None, config=ROW):
    expected = reference_topk(logits, k, starts, ends)
    got = triton_topk(logits, k, starts, ends, config)
    if not torch.equal(expected, got):
        row = int((expected != got).any(dim=1).nonzero()[0, 0])
        raise AssertionError(
            f"row {row} differs (k={k}, shape={list(logits.shape)}, config={config}):\n"
            f"expected {expected[row].tolist()}\ngot      {got[row].tolist()}"
        )
    return got


def random_window(num_rows, width, seed, device):
    rng = torch.Generator().manual_seed(seed)
    a = torch.randint(0, width + 1, (num_rows,), generator=rng)
    b = torch.randint(0, width + 1, (num_rows,), generator=rng)
    return torch.minimum(a, b).to(torch.int32).to(device), torch.maximum(a, b).to(torch.int32).to(device)


@pytest.mark.parametrize("name", sorted(ADVERSARIAL_GENERATORS))
def test_generators_row_path(kernel_device, name):
    logits = ADVERSARIAL_GENERATORS[name]((3, 40), 11, kernel_device)
    starts, ends = random_window(3, 40, 5, kernel_device)
    garbage = with_garbage_past_ends(logits, ends, starts=starts)
    for k in (1, 9, 41):
        assert_same(logits, k)
        assert_same(garbage, k, starts, ends, ONE_ROW if k == 9 else ROW)


@pytest.mark.parametrize("config", cpu_subset(ROWS_FAST, ROWS_FAST_IDS, keep={"row"}))
@pytest.mark.parametrize("name", sorted(ADVERSARIAL_GENERATORS))
def test_generators_rows_fast(kernel_device, name, config):
    # Short-row copy and narrower tiles: rows of 64 columns cut to lengths across the tiles.
    logits = ADVERSARIAL_GENERATORS[name]((6, 64), 13, kernel_device)
    ends = torch.tensor([64, 33, 32, 17, 9, 0], dtype=torch.int32, device=kernel_device)
    starts = torch.tensor([0, 1, 0, 0, 2, 0], dtype=torch.int32, device=kernel_device)
    garbage = with_garbage_past_ends(logits, ends, starts=starts)
    for k in (1, 5, 9, 31, 70):
        assert_same(logits, k, None, None, config)
        assert_same(garbage, k, starts, ends, config)


@pytest.mark.parametrize("config", WIDE_CPU)
@pytest.mark.parametrize("name", sorted(ADVERSARIAL_GENERATORS))
def test_generators_wide_paths(kernel_device, name, config):
    # Width 70: 5 chunks, groups of 8. k=3: the candidates (> T_low, at most 16) may exceed the
    # 8-register tile. k=12 > 10 groups: T_low is NONE and every selectable entry is a candidate.
    logits = ADVERSARIAL_GENERATORS[name]((2, 70), 12, kernel_device)
    ends = torch.tensor([70, 53], dtype=torch.int32, device=kernel_device)
    assert_same(with_garbage_past_ends(logits, ends), 3, None, ends, config)
    assert_same(logits, 12, None, None, config)


@pytest.mark.parametrize("config", cpu_subset(
    [replace(STREAM, stream_tile=64), replace(STREAM_IN_PROGRAM, stream_tile=64),
     replace(PIECES_READY, pieces_tile=64), replace(PIECES_LOOSE, pieces_tile=64)],
    ["stream", "stream_in_program", "pieces", "pieces_loose"], keep={"stream"}))
@pytest.mark.parametrize("name", ["random", pytest.param("few_distinct", marks=pytest.mark.slow),
                                  pytest.param("one_bin", marks=pytest.mark.slow)])
def test_lean_gather_groups_of_16(kernel_device, name, config):
    # Rows of up to 256 columns: groups of 16 (four quads), gather pieces of 4 groups; lengths inside a quad, at a
    # group's end and whole pieces; an exact or early bound (k 3; few_distinct: many candidates per group), and every
    # entry a candidate (k 40 > 16 groups).
    if name == "random":
        logits = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)).to(kernel_device)
    else:
        logits = ADVERSARIAL_GENERATORS[name]((4, 256), 17, kernel_device)
    ends = torch.tensor([256, 250, 131, 64], dtype=torch.int32, device=kernel_device)
    for k in (3, 40):
        assert_same(with_garbage_past_ends(logits, ends), k, None, ends, config)


@pytest.mark.parametrize("k", [3, 5])
def test_stream_strict_bound(kernel_device, k):
    # Group maxima (groups of 4 columns) tie at the k-th largest one, so the lower bound is exact and
    # strict: k=3 finds T among the 4 candidates above it, k=5 takes ties of the bound from the row.
    groups = [[9.0, 8.0, 7.0, 6.0], [1.0, 0.0, 1.0, 1.0]] + [[1.0, 0.5, 0.0, 1.0]] * 6
    logits = torch.tensor([sum(groups, []), sum(groups[::-1], [])], device=kernel_device)
    assert_same(logits, k, None, None, replace(STREAM_IN_PROGRAM, group_tile=8, bound_slack=0.0))


@pytest.mark.parametrize("config", cpu_subset([SPLIT, STREAM, PIECES], ["split", "stream", "pieces"], keep={"stream"}))
def test_strict_bound_ties_before_candidates(kernel_device, config):
    # Rows of zeros (ties at T = 0, the strict exact bound) with a few positives late in the row (fewer than k
    # candidates): the emit from the row stops once the ties are taken, the later candidates come from the buffer.
    rng = torch.Generator().manual_seed(4)
    logits = torch.zeros(6, 120)
    for row in range(6):
        logits[row, torch.randint(0, 120, (40,), generator=rng)] = -torch.rand(40, generator=rng)
        logits[row, torch.randint(60 + 10 * (row % 3), 120, (row,), generator=rng)] = 1 + torch.rand(row, generator=rng)
    ends = torch.tensor([120, 117, 100, 64, 33, 120], dtype=torch.int32, device=kernel_device)
    for k in (3, 5, 9, 12):
        assert_same(logits.to(kernel_device), k, None, ends, config)


@triton.jit
def _search_kernel(keys_ptr, out_ptr, k, enough, N: tl.constexpr, CARRY: tl.constexpr):
    keys = tl.load(keys_ptr + tl.arange(0, N))
    count, lo, hi = triton_impl._bracket(keys)
    t, count = selection.kth_largest_within(keys, k, enough, count, lo, hi, CARRY)
    tl.store(out_ptr, t)
    tl.store(out_ptr + 1, count)


@pytest.mark.parametrize("carry", [0, 1, 4])
def test_search_rounds(kernel_device, carry):
    # Keys over the whole int32 range (NONE included), clustered keys, plateaus: the exact k-th largest key
    # (enough < k) and an early-stopped floor (enough >= k) reached by its count of keys. Counts: compares of the
    # keys' images (carry 0), carries per key (1) and summed by 4 (one warp, 4 keys per thread).
    if carry > 0 and kernel_device != "cuda":
        pytest.skip("inline PTX runs on the GPU only")
    rng = torch.Generator().manual_seed(2)
    spread = torch.randint(-(2**31), 2**31 - 1, (64,), generator=rng, dtype=torch.int64)
    spread[::9] = -(2**31)
    clustered = 0x40000000 + torch.randint(0, 300, (64,), generator=rng, dtype=torch.int64)
    plateaus = torch.randint(-2, 3, (64,), generator=rng, dtype=torch.int64) * 1000 - 7
    for keys in (spread, clustered, plateaus, spread.sort().values):
        padded = torch.cat([keys, torch.full((64,), -(2**31), dtype=torch.int64)])  # 128 keys, NONE past 64
        keys32 = padded.to(torch.int32).to(kernel_device)
        selectable = keys[keys != -(2**31)]
        for k in (1, 5, 17, 40):
            kth = int(selectable.sort(descending=True).values[k - 1])
            for enough in (k - 1, k + 6):
                out = torch.zeros(2, dtype=torch.int32, device=kernel_device)
                _search_kernel[(1,)](keys32, out, k, enough, N=128, CARRY=carry, num_warps=1)
                t, count = (int(x) for x in out.cpu())
                assert count == int((selectable >= t).sum()) and count >= k
                assert t == kth or (enough >= k and count <= enough and t < kth), (k, enough, t, kth)


@pytest.mark.parametrize("config", [triton_impl.DEFAULT_CONFIG, SPLIT, STREAM, PIECES],
                         ids=["default", "split", "stream", "pieces"])
def test_path_rule_is_monotone_in_work(config):
    # Whole rows up to `row_block_max` columns whatever the rows; wider rows move from the split path to gather
    # pieces to plain row programs as the rows grow, never back.
    order = [triton_impl.SPLIT, triton_impl.ROW_PIECES, triton_impl.ROW_PROGRAMS]
    for width in (1, config.row_block_max, config.row_block_max + 1, 131072):
        paths = [triton_impl.topk_path(config, rows, width) for rows in range(1, 300)]
        if width <= config.row_block_max:
            assert set(paths) == {triton_impl.ROWS}
        else:
            ranks = [order.index(path) for path in paths]
            assert ranks == sorted(ranks)


@pytest.mark.parametrize("num_rows", [2, 3, 4])
def test_calls_take_the_path_of_the_rule(kernel_device, monkeypatch, num_rows):
    config = replace(PIECES, row_program_rows=3, pieces_max_rows=3)
    launched = []
    for name in ("_launch_split", "_launch_row_programs"):
        launch = getattr(triton_impl, name)
        monkeypatch.setattr(triton_impl, name, lambda *args, _launch=launch, _name=name, **kwargs:
                            launched.append((_name, kwargs.get("pieces"))) or _launch(*args, **kwargs))
    assert_same(tie_heavy(num_rows, 40, 1, kernel_device), 5, None, None, config)
    path = triton_impl.topk_path(config, num_rows, 40)
    expected = {triton_impl.SPLIT: ("_launch_split", None), triton_impl.ROW_PIECES: ("_launch_row_programs", True),
                triton_impl.ROW_PROGRAMS: ("_launch_row_programs", False)}[path]
    assert launched == [expected]


@pytest.mark.parametrize("num_rows", [3, 4])
def test_pieces_ready_rule(kernel_device, monkeypatch, num_rows):
    # The gather pieces wait on their own row program's ready word in calls of up to `pieces_ready_max_rows` rows,
    # on the whole row-program grid above; both exact.
    config = replace(PIECES, pdl=True, pieces_ready_max_rows=3)
    pieces_kernel = triton_impl._row_pieces_kernel
    waits = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                waits.append(kwargs["WAIT_READY"])
                return pieces_kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_impl, "_row_pieces_kernel", Recorder())
    assert_same(tie_heavy(num_rows, 40, 2, kernel_device), 5, None, None, config)
    assert waits == [num_rows <= 3]


def tie_heavy(num_rows, width, seed, device):
    rng = torch.Generator().manual_seed(seed)
    values = torch.randint(-3, 4, (num_rows, width), generator=rng).float() / 2
    values = torch.where(torch.rand(num_rows, width, generator=rng) < 0.3, -values, values)
    special = torch.rand(num_rows, width, generator=rng)
    values[special < 0.05] = math.nan
    values[(special >= 0.05) & (special < 0.08)] = math.inf
    values[(special >= 0.08) & (special < 0.12)] = -math.inf
    return values.to(device)


@pytest.mark.parametrize("config", WIDE_CPU)
@pytest.mark.parametrize("k", [1, 16, 17, *(pytest.param(k, marks=pytest.mark.slow) for k in (4, 15, 33))])
def test_lengths_around_wide_thresholds(kernel_device, k, config):
    # Row lengths at and around k, the chunk / stream tile (16) and its multiples, with garbage past each end.
    lengths = [0, 1, 15, 16, 17, 31, 32, 33, 48, 49, 57]
    ends = torch.tensor(lengths, dtype=torch.int32, device=kernel_device)
    logits = with_garbage_past_ends(tie_heavy(len(lengths), 57, k, kernel_device), ends)
    assert_same(logits, k, None, ends, config)


@pytest.mark.parametrize("k", [1, 7, 8, 9, 31, 32, 33, 64])
def test_lengths_around_row_thresholds(kernel_device, k):
    # One program per row, register tile of 32 columns: lengths around k and the tile.
    lengths = [0, 1, 7, 8, 9, 16, 31, 32]
    ends = torch.tensor(lengths, dtype=torch.int32, device=kernel_device)
    starts = torch.zeros_like(ends)
    logits = with_garbage_past_ends(tie_heavy(len(lengths), 32, k, kernel_device), ends)
    assert_same(logits, k, starts, ends)
    assert_same(logits, k, None, ends, ONE_ROW)
    for config in ROWS_FAST:
        assert_same(logits, k, starts, ends, config)


def test_value_order_details(kernel_device):
    # -0.0 == +0.0, +inf first, -inf/NaN never, subnormals and extremes ordered by value.
    row = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45, 3.4e38, -3.4e38, 0.0, -0.0, -math.nan]
    logits = torch.tensor([row, row[::-1]], dtype=torch.float32, device=kernel_device)
    tiny = dict(row_block_max=8, chunk=8, stream_tile=8, group_tile=8, candidate_block=8)
    for config in (ROW, TopkConfig(row_program_rows=3, **tiny),
                   TopkConfig(row_program_rows=1, pieces_max_rows=0, **tiny)):
        for k in (1, 2, 3, 5, 8, 12):
            assert_same(logits, k, None, None, config)


@pytest.mark.parametrize("config", cpu_subset([ROW, SPLIT, STREAM], ["row", "split", "stream"], keep={"row"}))
def test_strided_offset_and_expanded_views(kernel_device, config):
    base = tie_heavy(6, 90, 3, kernel_device)
    views = {
        "column_stride_2": base[:, ::2],
        "offset": base[1:, 7:61],
        "expanded_rows": base[2:3, :40].expand(5, 40),
        "expanded_columns": base[:, 5:6].expand(6, 24),
        "transposed": base[:, :30].t(),
    }
    for name, view in views.items():
        assert_same(view, 2 if name.startswith("expanded") else 20, None, None, config)


@pytest.mark.parametrize("config", [ROW, SPLIT, STREAM], ids=["row", "split", "stream"])
def test_empty_and_oversized(kernel_device, config):
    empty_rows = torch.empty((0, 30), device=kernel_device)
    assert triton_topk(empty_rows, 4, config=config).shape == (0, 4)
    no_columns = torch.empty((3, 0), device=kernel_device)
    assert torch.equal(triton_topk(no_columns, 5, config=config), torch.full((3, 5), -1, dtype=torch.int32,
                                                                             device=kernel_device))
    logits = tie_heavy(2, 20, 4, kernel_device)
    assert_same(logits, 50, None, None, config)


@pytest.mark.parametrize("config", [ROW, SPLIT, STREAM], ids=["row", "split", "stream"])
def test_out_with_padded_rows_keeps_the_tail(kernel_device, config):
    logits = tie_heavy(4, 40, 6, kernel_device)
    buffer = torch.full((4, 12), POISON, dtype=torch.int32, device=kernel_device)
    got = triton_impl.topk_triton(logits, 9, None, None, buffer[:, :9], config=config)
    assert got.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:, :9], reference_topk(logits, 9))
    assert bool((buffer[:, 9:] == POISON).all())


@pytest.mark.parametrize("config", [ROW, SPLIT, STREAM], ids=["row", "split", "stream"])
def test_decode_lengths_on_device(kernel_device, config):
    next_n, k = 2, 5
    logits = tie_heavy(8, 40, 8, kernel_device)
    request_lens = torch.tensor([0, 1, 23, 40], dtype=torch.int32, device=kernel_device)
    row_lens = torch.tensor([[0, 1], [17, 16], [40, 33], [2, 0]], dtype=torch.int32, device=kernel_device)
    for seq_lens in (request_lens, row_lens):
        expected = reference.topk_decode(logits, seq_lens, next_n, k, poisoned(8, k, kernel_device))
        got = triton_impl.topk_decode_triton(logits, seq_lens, next_n, k, poisoned(8, k, kernel_device),
                                             config=config)
        assert torch.equal(expected, got)


def slot_table(num_requests, width, block_size, seed, device):
    """A block table whose pages are a random permutation (distinct slots for distinct positions)."""
    pages = -(-width // block_size)
    order = torch.randperm(num_requests * pages, generator=torch.Generator().manual_seed(seed))
    return order.view(num_requests, pages).to(torch.int32).to(device)


@pytest.mark.parametrize("config", cpu_subset(
    [ROW, ONE_ROW, SPLIT, STREAM, STREAM_LOOSE, PIECES],
    ["row", "one_row", "split", "stream", "stream_loose", "pieces"], keep={"row", "split", "stream"}))
def test_decode_slots_equal_positions_mapped(kernel_device, config):
    # Fused slot output = indices_to_slots(topk_decode(...)) on every path, 1-D and 2-D lengths, the
    # output row stride wider than k (columns past k stay poison).
    next_n, k, block_size = 2, 5, 4
    logits = tie_heavy(8, 40, 8, kernel_device)
    table = slot_table(4, 40, block_size, 3, kernel_device)
    request_lens = torch.tensor([0, 1, 23, 40], dtype=torch.int32, device=kernel_device)
    row_lens = torch.tensor([[0, 1], [17, 16], [40, 33], [2, 0]], dtype=torch.int32, device=kernel_device)
    requests = torch.arange(8, dtype=torch.int32, device=kernel_device) // next_n
    for seq_lens in (request_lens, row_lens):
        positions = reference.topk_decode(logits, seq_lens, next_n, k, poisoned(8, k, kernel_device))
        expected = indices_to_slots(positions, table, block_size, requests, backend="reference")
        buffer = poisoned(8, k + 3, kernel_device)
        triton_impl.topk_decode_triton(logits, seq_lens, next_n, k, buffer[:, :k], config=config,
                                       slots=(table, block_size))
        assert torch.equal(buffer[:, :k], expected)
        assert bool((buffer[:, k:] == POISON).all())
        assert torch.equal(reference.topk_decode_slots(logits, seq_lens, next_n, k, table, block_size,
                                                       poisoned(8, k, kernel_device)), expected)


def test_decode_slots_public_function(kernel_device):
    logits = tie_heavy(6, 24, 4, kernel_device)
    seq_lens = torch.tensor([24, 7, 0], dtype=torch.int32, device=kernel_device)
    table = slot_table(3, 24, 8, 1, kernel_device)
    expected = topk_decode_slots(logits, seq_lens, 2, 6, table, 8, backend="reference")
    assert torch.equal(topk_decode_slots(logits, seq_lens, 2, 6, table, 8, backend="triton"), expected)
    with pytest.raises(ValueError, match="block_table must have B = 3 rows"):
        topk_decode_slots(logits, seq_lens, 2, 6, table[:2], 8)
    with pytest.raises(ValueError, match="block_table holds max_blocks \\* block_size = 16 positions"):
        topk_decode_slots(logits, seq_lens, 2, 6, table[:, :2], 8)
    assert torch.equal(topk_decode_slots(logits, seq_lens.long(), 2, 6, table.long(), 8, backend="triton"), expected)
    with pytest.raises(TypeError, match="block_table"):
        topk_decode_slots(logits, seq_lens, 2, 6, table.short(), 8)


def test_public_functions_dispatch_to_triton(kernel_device):
    logits = tie_heavy(3, 24, 9, kernel_device)
    starts, ends = random_window(3, 24, 2, kernel_device)
    expected = topk(logits, 6, starts=starts, ends=ends, backend="reference")
    assert torch.equal(topk(logits, 6, starts=starts, ends=ends, backend="triton"), expected)
    seq_lens = torch.tensor([24, 7, 0], dtype=torch.int32, device=kernel_device)
    assert torch.equal(topk_decode(logits, seq_lens, 1, 6, backend="triton"),
                       topk_decode(logits, seq_lens, 1, 6, backend="reference"))


def test_indices_to_slots(kernel_device):
    rng = torch.Generator().manual_seed(0)
    block_table = torch.randint(0, 1000, (3, 5), generator=rng, dtype=torch.int32).to(kernel_device)
    indices = torch.randint(-1, 5 * 16, (4, 20), generator=rng, dtype=torch.int32).to(kernel_device)
    row_to_request = torch.tensor([2, 0, 0, 1], dtype=torch.int32, device=kernel_device)
    for view in (indices, indices[:, ::2], indices.t().contiguous().t()):
        expected = indices_to_slots(view, block_table, 16, row_to_request, backend="reference")
        assert torch.equal(indices_to_slots(view, block_table, 16, row_to_request, backend="triton"), expected)
    padding_only = torch.full((2, 3), -1, dtype=torch.int32, device=kernel_device)
    empty_table = torch.empty((1, 0), dtype=torch.int32, device=kernel_device)
    rows = torch.zeros(2, dtype=torch.int32, device=kernel_device)
    assert torch.equal(indices_to_slots(padding_only, empty_table, 4, rows, backend="triton"), padding_only)


def decode_lengths(num_rows, width, seed):
    rng = torch.Generator().manual_seed(seed)
    return torch.randint(int(0.8 * width), width + 1, (num_rows,), generator=rng, dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_WIDE, ids=GPU_WIDE_IDS)
@pytest.mark.parametrize("name", sorted(ADVERSARIAL_GENERATORS))
@pytest.mark.parametrize("width, num_rows", [(131072, 4), (1 << 20, 2)])
def test_gpu_generators_long_rows(name, width, num_rows, config):
    logits = ADVERSARIAL_GENERATORS[name]((num_rows, width), 21, "cuda")
    ends = decode_lengths(num_rows, width, 3).cuda()
    garbage = with_garbage_past_ends(logits, ends)
    for k in (2048, 512):
        got = assert_same(garbage, k, None, ends, config)
        assert count_topk_errors(logits, got, k, ends=ends) == 0
    assert_same(logits, 2048, None, None, config)


# The default, one tile (one unclassed launch), and the default without PDL.
GPU_ROWS = [ROW, TopkConfig(row_tiles=1), TopkConfig(pdl=False)]
GPU_ROWS_IDS = ["rows_default", "rows_one_tile", "rows_no_pdl"]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_ROWS, ids=GPU_ROWS_IDS)
@pytest.mark.parametrize("name", sorted(ADVERSARIAL_GENERATORS))
def test_gpu_generators_prefill_rows(name, config):
    width = 8192
    logits = ADVERSARIAL_GENERATORS[name]((64, width), 22, "cuda")
    ends = torch.linspace(1, width, 64).to(torch.int32).cuda()
    starts = (ends // 3).to(torch.int32)
    for k in (2048, 512):
        got = assert_same(with_garbage_past_ends(logits, ends, starts=starts), k, starts, ends, config)
        assert count_topk_errors(logits, got, k, starts=starts, ends=ends) == 0
        assert_same(logits, k, None, torch.arange(1, 65, dtype=torch.int32, device="cuda") * 128, config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_ROWS, ids=GPU_ROWS_IDS)
def test_gpu_causal_prefill_rows(config):
    # The rows of a causal prompt (row i has i + 1 columns), clean and with NaN/-inf inside the windows.
    width = 4096
    ends = torch.arange(1, width + 1, dtype=torch.int32, device="cuda")
    for name in ("relu_sum", "one_bin", "nonfinite", "few_distinct"):
        logits = ADVERSARIAL_GENERATORS[name]((width, width), 23, "cuda")
        for k in (2048, 512):
            assert_same(logits, k, None, ends, config)
    assert_same(torch.randn(width, width, device="cuda"), 2048, None, ends, config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_WIDE, ids=GPU_WIDE_IDS)
@pytest.mark.parametrize("width", [8191, 8192, 8193, 12288, 16385, 40000])
def test_gpu_widths_around_paths(width, config):
    logits = ADVERSARIAL_GENERATORS["relu_sum"]((6, width), width, "cuda")
    lengths = torch.tensor([0, 2047, 2048, 2049, 4097, width], dtype=torch.int32, device="cuda")
    for k in (2048, 512):
        assert_same(logits, k, None, lengths, config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [ROW, TopkConfig(row_block_max=16, row_program_rows=1 << 30, chunk=64),
                                    TopkConfig(row_block_max=16, stream_tile=64, pieces_max_rows=0)],
                         ids=["row", "split", "stream"])
def test_gpu_more_than_65535_rows(config):
    logits = tie_heavy(70000, 100, 5, "cuda")
    starts, ends = random_window(70000, 100, 7, "cuda")
    assert_same(logits, 8, starts, ends, config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_WIDE, ids=GPU_WIDE_IDS)
def test_gpu_reruns_are_bitwise_equal(config):
    logits = torch.cat([ADVERSARIAL_GENERATORS["one_bin"]((4, 131072), 1, "cuda"),
                        torch.randn(4, 131072, device="cuda")])
    ends = decode_lengths(8, 131072, 4).cuda()
    first = triton_topk(logits, 2048, None, ends, config)
    prefill = torch.randn(256, 8192, device="cuda")
    first_prefill = triton_topk(prefill, 2048, config=config)
    for _ in range(20):
        assert torch.equal(triton_topk(logits, 2048, None, ends, config), first)
        assert torch.equal(triton_topk(prefill, 2048, config=config), first_prefill)


@pytest.mark.parametrize(("capability", "hip", "interpreter", "launched"), [
    ((9, 0), None, False, True), ((10, 0), None, False, True), ((8, 9), None, False, False),
    ((9, 0), "6.2", False, False), ((9, 0), None, True, False)])
def test_pdl_launches_only_where_griddepcontrol_exists(monkeypatch, capability, hip, interpreter, launched):
    """Programmatic dependent launch needs sm_90+ on CUDA (its inline PTX does not exist before, nor on ROCm) and
    a compiled kernel (the interpreter cannot run inline PTX): elsewhere the launch arguments stay empty."""
    monkeypatch.setattr(triton_impl, "capability", lambda device: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    if interpreter:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    expected = dict(PDL=True, launch_pdl=True) if launched else {}
    assert triton_impl._pdl_args(TopkConfig(pdl=True), torch.device("cuda", 0)) == expected
    assert triton_impl._pdl_args(TopkConfig(pdl=False), torch.device("cuda", 0)) == {}


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 6, 32, 128])
@pytest.mark.parametrize("config", [GPU_DEFAULT, GPU_NO_PDL, GPU_ROW_READY, GPU_TILE_GATHER],
                         ids=["default", "no_pdl", "row_ready", "tile_gather"])
def test_gpu_pdl_eager_reruns_and_graph_replay(num_rows, config):
    # The default (programmatic dependent launch but on the split path, gather pieces waiting on their own row
    # program up to 32 rows), the same without PDL, with the gather pieces waiting
    # on their rows up to 128 rows, and with the gather by group tiles, on each routed path
    # (split path, gather launch, row programs), garbage past the ends: 20 eager reruns (with PDL each call's first
    # kernel waits on the last one's) equal the reference bitwise, and a graph of two calls (k 2048 then 512)
    # replays with new logits and lengths.
    width = 131072
    logits = ADVERSARIAL_GENERATORS["few_distinct"]((num_rows, width), 9, "cuda")
    ends = decode_lengths(num_rows, width, 9).cuda()
    garbage = with_garbage_past_ends(logits, ends)
    expected = reference_topk(garbage, 2048, None, ends)
    out = poisoned(num_rows, 2048, "cuda")
    for _ in range(20):
        assert torch.equal(triton_impl.topk_triton(garbage, 2048, None, ends, out, config=config), expected)
    out_short = poisoned(num_rows, 512, "cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_impl.topk_triton(garbage, 2048, None, ends, out, config=config)
        triton_impl.topk_triton(garbage, 512, None, ends, out_short, config=config)
    for trial in range(3):
        garbage.copy_(with_garbage_past_ends(torch.randn(num_rows, width, device="cuda"), ends))
        ends.copy_(decode_lengths(num_rows, width, trial).cuda() // (trial + 1))
        graph.replay()
        assert torch.equal(out, reference_topk(garbage, 2048, None, ends))
        assert torch.equal(out_short, reference_topk(garbage, 512, None, ends))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["random", *sorted(ADVERSARIAL_GENERATORS)])
@pytest.mark.parametrize("num_rows", [32, 128])
@pytest.mark.parametrize("config", GPU_MANY_ROWS, ids=GPU_MANY_ROWS_IDS)
def test_gpu_many_rows_generators(name, num_rows, config):
    # 32 to 128 decode rows of 131072 (2048 / 8192 chunk programs on the split path), garbage past the ends.
    shape = (num_rows, 131072)
    logits = torch.randn(shape, device="cuda") if name == "random" else ADVERSARIAL_GENERATORS[name](shape, 24, "cuda")
    ends = decode_lengths(num_rows, 131072, 6).cuda()
    for k in (2048, 512):
        assert_same(with_garbage_past_ends(logits, ends), k, None, ends, config)


@pytest.mark.gpu
@pytest.mark.parametrize("num_requests", [16, 32, 64])
@pytest.mark.parametrize("config", GPU_MANY_ROWS, ids=GPU_MANY_ROWS_IDS)
def test_gpu_many_rows_reruns_and_graph_replay(num_requests, config):
    # 2 rows per request (32 / 64 / 128 rows of 131072): reruns are bitwise equal, and a captured call replays with
    # new logits and lengths.
    next_n, width, k = 2, 131072, 2048
    num_rows = num_requests * next_n
    logits = torch.cat([ADVERSARIAL_GENERATORS["one_bin"]((num_rows // 2, width), 1, "cuda"),
                        torch.randn(num_rows // 2, width, device="cuda")])
    seq_lens = decode_lengths(num_requests, width, 4).cuda()
    out = torch.empty((num_rows, k), dtype=torch.int32, device="cuda")
    first = triton_impl.topk_decode_triton(logits, seq_lens, next_n, k, out, config=config).clone()
    assert torch.equal(first, reference.topk_decode(logits, seq_lens, next_n, k, poisoned(num_rows, k, "cuda")))
    for _ in range(5):
        assert torch.equal(triton_impl.topk_decode_triton(logits, seq_lens, next_n, k, out, config=config), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_impl.topk_decode_triton(logits, seq_lens, next_n, k, out, config=config)
    for trial in range(3):
        logits.copy_(ADVERSARIAL_GENERATORS["relu_sum"]((num_rows, width), trial, "cuda"))
        seq_lens.copy_(decode_lengths(num_requests, width, trial).cuda() // (trial + 1))
        graph.replay()
        assert torch.equal(out, reference.topk_decode(logits, seq_lens, next_n, k, poisoned(num_rows, k, "cuda")))


@pytest.mark.gpu
def test_gpu_out_with_padded_rows_keeps_the_tail():
    logits = torch.randn(3, 131072, device="cuda")
    buffer = torch.full((3, 2100), POISON, dtype=torch.int32, device="cuda")
    triton_impl.topk_triton(logits, 2048, None, None, buffer[:, :2048])
    assert torch.equal(buffer[:, :2048], reference_topk(logits, 2048))
    assert bool((buffer[:, 2048:] == POISON).all())


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_WIDE, ids=GPU_WIDE_IDS)
def test_gpu_decode_slots_at_realistic_size(config):
    num_requests, next_n, width, k, block_size = 4, 2, 131072, 2048, 64
    logits = ADVERSARIAL_GENERATORS["relu_sum"]((num_requests * next_n, width), 5, "cuda")
    seq_lens = decode_lengths(num_requests, width, 5).cuda()
    table = slot_table(num_requests, width, block_size, 5, "cuda")
    requests = torch.arange(num_requests * next_n, dtype=torch.int32, device="cuda") // next_n
    positions = reference.topk_decode(logits, seq_lens, next_n, k, poisoned(num_requests * next_n, k, "cuda"))
    expected = indices_to_slots(positions, table, block_size, requests, backend="reference")
    got = triton_impl.topk_decode_triton(logits, seq_lens, next_n, k, poisoned(num_requests * next_n, k, "cuda"),
                                         config=config, slots=(table, block_size))
    assert torch.equal(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_WIDE, ids=GPU_WIDE_IDS)
def test_gpu_cuda_graph_replay_with_new_lengths(config):
    num_requests, next_n, width, k = 3, 2, 65536, 2048
    logits = torch.randn(num_requests * next_n, width, device="cuda")
    seq_lens = torch.tensor([width, 100, 40000], dtype=torch.int32, device="cuda")
    out = torch.empty((num_requests * next_n, k), dtype=torch.int32, device="cuda")
    triton_impl.topk_decode_triton(logits, seq_lens, next_n, k, out, config=config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_impl.topk_decode_triton(logits, seq_lens, next_n, k, out, config=config)
    for trial in range(3):
        logits.copy_(ADVERSARIAL_GENERATORS["relu_sum"]((num_requests * next_n, width), trial, "cuda"))
        seq_lens.copy_(decode_lengths(num_requests, width, trial).cuda() // (trial + 1))
        graph.replay()
        expected = reference.topk_decode(logits, seq_lens, next_n, k, poisoned(num_requests * next_n, k, "cuda"))
        assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [32, 128])
def test_gpu_many_rows_timeline_probe(num_rows):
    # The phase timeline (a timing probe: barriers and global-timer stamps) leaves the picks bitwise equal, and every
    # program stamps its start, its wait and its phases in order.
    logits = torch.randn(num_rows, 131072, device="cuda")
    ends = decode_lengths(num_rows, 131072, 8).cuda()
    out = poisoned(num_rows, 2048, "cuda")
    timeline = {}
    triton_impl._topk_timeline(logits, 2048, ends, out, timeline)
    assert torch.equal(out, reference_topk(logits, 2048, None, ends))
    assert sorted(timeline) == (["maxima", "pieces", "rows"] if num_rows <= 64 else ["maxima", "rows"])
    for stamps in timeline.values():
        assert bool((stamps[:, :2] > 0).all()) and bool((stamps[:, 1] >= stamps[:, 0]).all())
    rows = timeline["rows"]
    assert bool((rows[:, 5] >= rows[:, 4]).all()) and bool((rows[:, 4] >= rows[:, 1]).all())


@pytest.mark.parametrize("config", [ROW], ids=["row"])
def test_bf16_logits_select_as_their_fp32_widening(kernel_device, config):
    """bf16 logits (rounding makes ties; NaN, -inf, +inf and -0.0 kept) give the bits of the fp32 widening."""
    gen = torch.Generator().manual_seed(31)
    logits = (torch.randn(5, 70, generator=gen) * 4).round() / 4
    logits[0, 3], logits[1, 5:9], logits[2, 0], logits[3, 1] = float("nan"), float("-inf"), float("inf"), -0.0
    bf16 = logits.bfloat16().to(kernel_device)
    starts, ends = random_window(5, 70, 32, kernel_device)
    for k in (1, 33):
        expected = reference_topk(bf16.float(), k, starts, ends)
        assert torch.equal(reference_topk(bf16, k, starts, ends), expected)
        assert torch.equal(triton_topk(bf16, k, starts, ends, config), expected)
    seq_lens = torch.tensor([70, 40, 3, 69, 0], dtype=torch.int32, device=kernel_device)
    assert torch.equal(topk_decode(bf16, seq_lens, 1, 9, backend="triton"), topk_decode(bf16.float(), seq_lens, 1, 9))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [GPU_DEFAULT, *GPU_WIDE[:3]], ids=["default", *GPU_WIDE_IDS[:3]])
def test_bf16_logits_select_as_their_fp32_widening_gpu(kernel_device, config):
    gen = torch.Generator().manual_seed(33)
    bf16 = torch.randn(64, 131072, generator=gen).bfloat16().to(kernel_device)  # many ties in bf16
    seq_lens = torch.randint(0, 131073, (64,), generator=gen, dtype=torch.int32).to(kernel_device)
    ends = seq_lens.clone()
    starts = torch.zeros_like(ends)
    expected = reference_topk(bf16.float(), 2048, starts, ends)
    assert torch.equal(triton_topk(bf16, 2048, starts, ends, config), expected)
    assert torch.equal(topk_decode(bf16, seq_lens, 1, 2048), topk_decode(bf16.float(), seq_lens, 1, 2048))


def slots_oracle(positions, table, block_size, requests):
    """Python loop of the slot rule: ``-1`` unless the position's page is listed (request and page index inside
    the table), allocated (>= 0) and the slot fits int32."""
    out = []
    rows = table.tolist()
    for position_row, request in zip(positions.tolist(), requests.tolist()):
        slots = []
        for p in position_row:
            known = p >= 0 and 0 <= request < len(rows) and p // block_size < len(rows[request])
            page = rows[request][p // block_size] if known else -1
            slot = page * block_size + p % block_size
            slots.append(slot if page >= 0 and slot < 2**31 else -1)
        out.append(slots)
    return torch.tensor(out, dtype=torch.int32)


def unallocated_table(device, checks):
    """Pages -1 (unallocated), -5 and valid ones; with checks off also 2**29, whose slots pass int32 with block_size
    4 (2**31 at offset 0), which value checks refuse."""
    wide = 2**29 if checks == "off" else 6
    return torch.tensor([[3, -1, wide, 7], [-5, 0, 1, -1], [2, 9, -1, 4]], dtype=torch.int32, device=device)


def test_pages_whose_slots_leave_int32_are_refused_with_checks_on(kernel_device):
    table = unallocated_table(kernel_device, "on")
    table[0, 2] = 2**29
    indices = torch.tensor([[0, 8]], dtype=torch.int32, device=kernel_device)
    requests = torch.tensor([0], dtype=torch.int32, device=kernel_device)
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match="block_table"):
            indices_to_slots(indices, table, 4, requests, backend=backend)
        with pytest.raises(ValueError, match="block_table"):
            topk_decode_slots(tie_heavy(3, 16, 11, kernel_device), torch.full((3,), 16, dtype=torch.int32,
                              device=kernel_device), 1, 5, table, 4, backend=backend)


@pytest.mark.parametrize("checks", ["on", "off"])
def test_indices_to_slots_gives_minus_one_or_a_valid_slot(kernel_device, checks, monkeypatch):
    table = unallocated_table(kernel_device, checks)
    indices = torch.tensor([[0, 5, 8, 11, 15, -1], [0, 4, 7, 12, 15, 9], [3, 4, 11, 13, -1, -1]],
                           dtype=torch.int32, device=kernel_device)
    requests = torch.tensor([0, 1, 2], dtype=torch.int32, device=kernel_device)
    if checks == "off":  # positions past the table and requests outside it, unread
        monkeypatch.setenv("DSA_INDEXER_SKIP_VALUE_CHECKS", "1")
        indices[0, 0], indices[2, 1] = 16, 10**9
        requests[1] = 7
    expected = slots_oracle(indices.cpu(), table.cpu(), 4, requests.cpu())
    assert ((expected == -1) | (expected >= 0)).all() and (expected == -1).sum() >= 8
    for backend in ("reference", "triton"):
        for first in (0, 1):  # k = 6 (aligned rows off) and a strided view with k = 5
            got = indices_to_slots(indices[:, first:], table, 4, requests, backend=backend)
            assert torch.equal(got.cpu(), expected[:, first:])


@pytest.mark.parametrize("config", [ROW, STREAM], ids=["row", "stream"])
@pytest.mark.parametrize("checks", ["on", "off"])
def test_decode_slots_give_minus_one_or_a_valid_slot(kernel_device, config, checks, monkeypatch):
    next_n, k, block_size = 1, 5, 4
    table = unallocated_table(kernel_device, checks)  # 16 positions per request
    width = 16 if checks == "on" else 24
    logits = tie_heavy(3, width, 11, kernel_device)
    seq_lens = torch.tensor([16, 16, 11], dtype=torch.int32, device=kernel_device)
    if checks == "off":  # lengths past the table (positions 16.. have no page) and past the width
        monkeypatch.setenv("DSA_INDEXER_SKIP_VALUE_CHECKS", "1")
        seq_lens = torch.tensor([24, 10**6, 20], dtype=torch.int32, device=kernel_device)
    visible = seq_lens.clamp(max=width)
    positions = reference.topk_decode(logits, visible, next_n, k, poisoned(3, k, kernel_device))
    expected = slots_oracle(positions.cpu(), table.cpu(), block_size, torch.arange(3))
    got = triton_impl.topk_decode_triton(logits, seq_lens, next_n, k, poisoned(3, k, kernel_device), config=config,
                                         slots=(table, block_size))
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(topk_decode_slots(logits, seq_lens, next_n, k, table, block_size, backend="reference").cpu(),
                       expected)


def test_topk_window_past_the_row_is_clamped_with_checks_off(kernel_device, monkeypatch):
    monkeypatch.setenv("DSA_INDEXER_SKIP_VALUE_CHECKS", "1")
    logits = tie_heavy(3, 12, 4, kernel_device)
    starts = torch.tensor([-4, 3, 20], dtype=torch.int32, device=kernel_device)
    ends = torch.tensor([9, 10**6, 25], dtype=torch.int32, device=kernel_device)
    expected = reference_topk(logits, 5, starts.clamp(0, 12), ends.clamp(0, 12))
    assert torch.equal(triton_topk(logits, 5, starts, ends), expected)
    assert torch.equal(topk(logits, 5, starts=starts, ends=ends, backend="reference"), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [GPU_SPLIT, GPU_STREAM, GPU_PIECES, None], ids=["split", "stream", "pieces", "rows"])
def test_gpu_slots_are_minus_one_or_valid_with_checks_off(config, monkeypatch):
    # Unallocated (-1) and wild (-5, 2**30: slots past int32) pages, a table covering half the width and a
    # length past the width: every slot is -1 or the page's slot, as the CPU-tested reference maps them.
    monkeypatch.setenv("DSA_INDEXER_SKIP_VALUE_CHECKS", "1")
    num_requests, next_n, width, k, block_size = 4, 2, 131072 if config else 4096, 2048, 64
    logits = ADVERSARIAL_GENERATORS["relu_sum"]((num_requests * next_n, width), 7, "cuda")
    seq_lens = decode_lengths(num_requests, width, 7).cuda()
    seq_lens[1] = 10**7
    table = slot_table(num_requests, width // 2, block_size, 7, "cuda")
    table[:, ::3] = -1
    table[0, 1], table[2, 4] = -5, 2**30
    requests = torch.arange(num_requests * next_n, dtype=torch.int32, device="cuda") // next_n
    positions = reference.topk_decode(logits, seq_lens.clamp(max=width), next_n, k,
                                      poisoned(num_requests * next_n, k, "cuda"))
    expected = indices_to_slots(positions, table, block_size, requests, backend="reference")
    assert bool(((expected == -1) | (expected >= 0)).all()) and bool((expected >= 0).any())
    got = triton_impl.topk_decode_triton(logits, seq_lens, next_n, k, poisoned(num_requests * next_n, k, "cuda"),
                                         config=config or triton_impl.DEFAULT_CONFIG, slots=(table, block_size))
    assert torch.equal(got, expected)
    positions[0, :4] = torch.tensor([10**9, width - 1, -1, 2**31 - 1], dtype=torch.int32)
    requests[3] = 99
    assert torch.equal(indices_to_slots(positions, table, block_size, requests, backend="triton"),
                       indices_to_slots(positions, table, block_size, requests, backend="reference"))
