"""Triton kernels of the top-k family (twins of ``reference.py``): exact, deterministic radix selection.

Every entry becomes an int32 order key (``ops/common/selection.py``); a row's selection is every key above the
k-th largest ``T`` plus its first ties in column order, emitted by one ordered compaction. ``topk_path`` picks
one of four paths from the call's rows and width: whole rows in registers (one launch per register tile), the
split path (few wide rows: group-maxima chunks, then candidates and the emit), row programs (one per row, after
a maxima launch), or row programs that hand the gather to one program per gather piece. Group maxima give a
lower bound that leaves about ``1.15 k`` to ``1.3 k`` candidates, among which ``T`` is searched two bits a round.
``TopkConfig``'s class defaults are what ships. No host synchronisation: the launches are CUDA-graph capturable.
The derivations (order keys, the search, the bounds, scratch sizes) and the measured choices are in
``README.md`` next to this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..common.runtime import capability, interpreting, next_pow2
from ..common.selection import (
    KEY_MAX,
    LOW_FIELD,
    NONE,
    bit_length,
    carry_mode,
    clear_low_bits,
    kth_largest_within,
    order_keys,
    reaches_unsigned,
    stamp,
    timeline_args,
)

# Per-row state of the split path: its arrival counter (word 1), then one flag per chunk from word 8 (words 0 and 2
# to 7 are unused, kept so that the kernels' code stays as measured).
_ARRIVED = tl.constexpr(1)
_FLAGS = tl.constexpr(8)
_STATE_WORDS = 8
# Per-row state words of row programs with a gather launch, then one look-back flag per gather piece (its number of
# candidates + 1, 0 while unpublished).
_PIECE_BOUND = tl.constexpr(0)
_PIECE_INCLUSIVE = tl.constexpr(1)
_PIECE_QUALIFYING = tl.constexpr(2)
_PIECE_ARRIVED = tl.constexpr(3)
_PIECE_ROW_MAX = tl.constexpr(4)
_PIECE_READY = tl.constexpr(5)
_PIECE_FLAGS = tl.constexpr(6)
_PIECE_STATE_WORDS = 6

# Phase timeline (``stamp``, a timing probe): global-timer stamps per program. Every kernel: its start, the end of
# its wait for the previous grid; programs that emit: after the search of T, after the emit; the maxima launch: its
# maxima stored; row programs: after the lower bound, after the compaction of the qualifying group ids, after each
# gather piece (from word _TL_ROW_PIECES); the gather launch: its piece stored, its arrival, the last arriver's
# read of the pieces' flags (the number of candidates).
_TL_START = tl.constexpr(0)
_TL_WAITED = tl.constexpr(1)
_TL_T = tl.constexpr(2)
_TL_EMITTED = tl.constexpr(3)
_TL_MAXIMA = tl.constexpr(4)
_TL_BOUND = tl.constexpr(4)
_TL_COMPACTED = tl.constexpr(5)
_TL_ROW_PIECES = tl.constexpr(6)
_TL_GATHERED = tl.constexpr(4)
_TL_ARRIVED = tl.constexpr(5)
_TL_COUNTED = tl.constexpr(6)
_TL_MAXIMA_SLOTS = tl.constexpr(5)
_TL_PIECE_SLOTS = tl.constexpr(7)

_PAD_BLOCK = 1024
_SLOT_BLOCK = 2048  # indices_to_slots: positions per program
_SLOT_WARPS = 4


@dataclass(frozen=True)
class TopkConfig:
    """Tuning of the Triton top-k; the class defaults are what ships (tests shrink the sizes to reach every path
    with tiny shapes). ``topk_path`` picks the path of a call from its rows and width.

    row_block_max: widths up to this use whole-row programs (power of two, at most 16384).
    row_elements: register tile of the widest whole-row launch: ``row_elements // tile width`` rows share a
        program (1 to 16; power of two).
    row_warps: most warps of the widest whole-row launch (fewer for small tiles).
    row_tiles: whole-row launches, one per register tile halving from the widest (1 to 4): the launch of tile
        ``w`` keeps the rows of lengths ``(w / 2, w]`` (the narrowest: ``[0, w]``), so each kernel compiles one
        body with that tile's registers.
    row_narrow_elements, row_narrow_warps: ``row_elements`` and ``row_warps`` of the narrower tiles' launches.
    row_max_registers: register cap (ptxas ``maxnreg``) of the widest whole-row launch; ``None``: the compiler's.
    row_plateau_every: the whole-row search's rounds whose bit is a multiple of this also count the keys ``> t``
        (same reduction, packed), and a row whose count is below k stops there (``T = t``: a tie plateau no
        longer costs every remaining bit); 0: never.
    row_program_rows: wider rows take one row program per row when the call has at least this many rows, else
        the split path.
    pieces_max_rows: calls of row programs with at most this many rows hand the gather to a launch of one
        program per gather piece (``pieces_warps`` warps, ``pieces_tile`` columns per piece), which spreads a
        row over several SMs while the rows alone fill less than a wave.
    pieces_max_registers: register cap of the gather-piece programs (``None``: the compiler's choice).
    pieces_ready_max_rows: gather-piece calls with at most this many rows: each piece waits for its own row
        program (a per-row ready word) instead of the whole row-program grid (with ``pdl``).
    stream_tile: columns per streaming step and per gather piece of a row program (power of two, at most 16384).
    stream_warps: warps of a row program (calls above ``pieces_max_rows`` rows).
    bound_slack: the lower-bound searches stop once at most ``k + int(k * bound_slack)`` group maxima reach
        their floor.
    chunk: columns per program on the split path and in the row programs' maxima launch (power of two, at most
        16384); row programs whose ``GROUP`` exceeds it stream the row themselves.
    group_tile: most group maxima per row (at most 16384); ``None`` = ``clamp(4k, 1024, 8192)`` on the split
        path, 8192 in row programs.
    candidate_block: candidates searched in registers; ``None`` = ``clamp(2k, 1024, 16384)``.
    split_warps: warps of the split-path programs (both launches) and of the row programs' maxima launch.
    pdl: programmatic dependent launch of the whole-row and row-program kernels (``_wait_for_previous_grid``);
        ignored under the interpreter, before sm_90 and on ROCm. The split path never takes it.
    lean_gather: row programs whose ``GROUP`` is 4 to 16 load and compact each gather piece by quads of 4
        columns, one group per thread (other groups keep the ``[stream_tile // GROUP, GROUP]`` tile).
    """

    row_block_max: int = 8192
    row_elements: int = 8192
    row_warps: int = 8
    row_tiles: int = 3
    row_narrow_elements: int = 4096
    row_narrow_warps: int = 4
    row_max_registers: int | None = 80
    row_plateau_every: int = 16
    row_program_rows: int = 8
    pieces_max_rows: int = 64
    pieces_warps: int = 8
    pieces_tile: int = 4096
    pieces_max_registers: int | None = 128
    pieces_ready_max_rows: int = 32
    stream_tile: int = 8192
    stream_warps: int = 16
    bound_slack: float = 0.25
    chunk: int = 2048
    group_tile: int | None = None
    candidate_block: int | None = None
    split_warps: int = 8
    pdl: bool = True
    lean_gather: bool = True


DEFAULT_CONFIG = TopkConfig()

# The paths of a call (``topk_path``), in the order a call of growing rows meets them at a width above
# ``row_block_max``; whole rows take ``ROWS``.
ROWS = "rows"
SPLIT = "split"
ROW_PIECES = "row_pieces"
ROW_PROGRAMS = "row_programs"


def topk_path(config: TopkConfig, num_rows: int, width: int) -> str:
    """The path of a call of ``num_rows`` rows of ``width`` columns: whole rows up to ``row_block_max`` columns;
    wider rows take the split path below ``row_program_rows`` rows, row programs with a gather-piece launch up to
    ``pieces_max_rows`` rows and plain row programs above."""
    if width <= config.row_block_max:
        return ROWS
    if num_rows < config.row_program_rows:
        return SPLIT
    return ROW_PIECES if num_rows <= config.pieces_max_rows else ROW_PROGRAMS


@triton.jit
def _wait_for_previous_grid(PDL: tl.constexpr):
    """First statement of every kernel. ``PDL`` (programmatic dependent launch): let the next launch's programs
    start (they wait here in turn), then wait until the previous grid has completed and its memory is visible, so
    no memory access of this grid can overlap it."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _wait_then_release_next_grid(PDL: tl.constexpr):
    """``_wait_for_previous_grid`` in the other order: the next launch's programs start only once every program of
    this grid has seen the previous grid complete (the gather pieces of ``pieces_ready_max_rows`` rely on it: they skip
    the wait, so everything the previous grid wrote is visible to them when they start)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _row_window(row, valid, starts_ptr, ends_ptr, width, next_n, HAS_STARTS: tl.constexpr, ENDS_MODE: tl.constexpr):
    """(start, length) of the windows of ``row`` (scalar or vector; ``valid`` false gives length 0).

    ENDS_MODE 0: end ``width``; 1: ``ends[row]``; 2: decode request lengths ``L = ends[row // next_n]``,
    end ``max(L - next_n + row % next_n + 1, 0)``. The window is clamped into ``[0, width]`` (a no-op on
    validated bounds) so that bounds left unchecked (value checks off) never move a read outside the row."""
    start = row * 0
    if HAS_STARTS:
        start = tl.minimum(tl.maximum(tl.load(starts_ptr + row, mask=valid, other=0), 0), width)
    end = row * 0 + width
    if ENDS_MODE == 1:
        end = tl.load(ends_ptr + row, mask=valid, other=0)
    if ENDS_MODE == 2:
        request_len = tl.load(ends_ptr + row // next_n, mask=valid, other=0)
        end = tl.maximum(request_len - next_n + row % next_n + 1, 0)
    end = tl.minimum(tl.maximum(end, start), width)
    return start, tl.where(valid, end - start, 0)


@triton.jit
def _bracket(keys):
    """``(count, lo, hi)`` of a 1-D tile of keys: its number of selectable keys, the smallest and the largest."""
    selectable = keys != NONE
    count = tl.sum(selectable.to(tl.int32), axis=0)
    lo = tl.min(tl.where(selectable, keys, KEY_MAX), axis=0)
    hi = tl.max(keys, axis=0)
    return count, lo, hi


@triton.jit
def _kth_largest_rows(images, k, active, reaching, CARRY: tl.constexpr, PLATEAU_EVERY: tl.constexpr):
    """Per row of the uint32 order images ``images [ROWS, BLOCK]`` (``key ^ NONE``: NONE -> 0, unsigned order =
    value order) where ``active`` (others: 0): the image of a ``t`` that is the k-th largest or that exactly k
    images reach (``reaching [ROWS]`` = ``#(images != 0)``), 0 where not ``active``. Either selects the same
    entries (those ``> t`` and the first ``k - #(> t)`` equal to it), so the search stops once every row's count
    is exactly k. One bit per round (the whole-row tiles hold many keys per thread: three counts per round would
    make the rounds arithmetic-bound), counts from ``reaches_unsigned``; the rows share each round's reduction.
    ``PLATEAU_EVERY`` > 0: a round whose bit is a multiple of it also counts ``#(images > t)`` in the same
    reduction (16-bit fields; at most 16384 keys per row); fewer than k means ``T = t`` (``#(>= t) >= k``
    always holds), so that row stops: a plateau of ties at ``T`` no longer costs every remaining bit."""
    lo = tl.min(tl.where(images != 0, images, tl.full([], 0xFFFFFFFF, tl.uint32)), axis=1)  # [ROWS]
    hi = tl.max(images, axis=1)  # [ROWS]
    rounds = tl.where(active, bit_length((lo ^ hi).to(tl.int32, bitcast=True)), 0)  # [ROWS]
    t = (lo.to(tl.int64) & ~((tl.full([], 1, tl.int64) << rounds.to(tl.int64)) - 1)).to(tl.uint32)  # [ROWS]
    reaching = tl.where(active, reaching, k)  # [ROWS] #(images >= t)
    bit = tl.max(rounds, axis=0)
    while (bit > 0) & (tl.max((reaching > k).to(tl.int32), axis=0) > 0):
        bit -= 1
        candidate = t ^ (tl.full([], 1, tl.uint32) << bit.to(tl.uint32))  # [ROWS]
        reached = reaches_unsigned(images, candidate[:, None], CARRY)  # [ROWS, BLOCK]
        if PLATEAU_EVERY > 0:
            if bit % PLATEAU_EVERY == 0:
                packed = tl.sum(reached + (reaches_unsigned(images, (t + 1)[:, None], CARRY) << 16), axis=1)
                count = packed & LOW_FIELD
                reaching = tl.where((packed >> 16) < k, k, reaching)
            else:
                count = tl.sum(reached, axis=1)
        else:
            count = tl.sum(reached, axis=1)  # [ROWS]
        take = (bit < rounds) & (count >= k)
        t = tl.where(take, candidate, t)
        reaching = tl.where(take, count, reaching)
    return tl.where(active, t, 0)


@triton.jit
def _kth_largest_in_memory(ptr, n, k, TILE: tl.constexpr):
    """The k-th largest of the ``n`` keys at ``ptr`` (written by other programs of this launch)."""
    offsets = tl.arange(0, TILE)
    lo = n * 0 + KEY_MAX
    hi = n * 0 + NONE
    first = n * 0
    while first < n:
        keys = tl.load(ptr + first + offsets, mask=first + offsets < n, other=NONE, cache_modifier=".cg")  # [TILE]
        lo = tl.minimum(lo, tl.min(tl.where(keys != NONE, keys, KEY_MAX), axis=0))
        hi = tl.maximum(hi, tl.max(keys, axis=0))
        first += TILE
    bit = bit_length(lo ^ hi)
    t = clear_low_bits(lo, bit)
    while bit > 0:
        bit -= 1
        candidate = t ^ (1 << bit)
        count = n * 0
        first = n * 0
        while first < n:
            keys = tl.load(ptr + first + offsets, mask=first + offsets < n, other=NONE, cache_modifier=".cg")
            count += tl.sum((keys >= candidate).to(tl.int32), axis=0)
            first += TILE
        t = tl.where(count >= k, candidate, t)
    return t


@triton.jit
def _count_above_in_memory(ptr, n, threshold, TILE: tl.constexpr):
    offsets = tl.arange(0, TILE)
    count = n * 0
    first = n * 0
    while first < n:
        keys = tl.load(ptr + first + offsets, mask=first + offsets < n, other=NONE, cache_modifier=".cg")  # [TILE]
        count += tl.sum((keys > threshold).to(tl.int32), axis=0)
        first += TILE
    return count


@triton.jit
def _emit_taken(counts, greater, equal, columns, ties, base, out_ptrs, out_stride_col, pages, table_stride_col, table_blocks,
                block_size, AXIS: tl.constexpr, SLOTS: tl.constexpr):
    """Store the columns of the ``greater`` entries and of the first ``ties`` (>= 0) ``equal`` entries
    at ``out_ptrs`` positions ``base, base + 1, ...`` in column order along ``AXIS``; with ``SLOTS``, the
    cache slot of each column instead (``pages``: the block-table row of each output row, broadcastable
    to ``columns``).

    ``counts = greater + equal * 2**16`` (the packed flags whose prefix sum gives both ranks)."""
    prefix = tl.cumsum(counts, axis=AXIS)
    greater_rank = prefix & LOW_FIELD
    equal_rank = prefix >> 16
    take = greater | (equal & (equal_rank <= ties))
    position = base + greater_rank + tl.minimum(equal_rank, ties) - 1
    if SLOTS:
        written = _column_slots(pages, columns, take, table_stride_col, table_blocks, block_size)
    else:
        written = columns
    tl.store(out_ptrs + position.to(tl.int64) * out_stride_col, written, mask=take)


@triton.jit
def _column_slots(pages, columns, valid, table_stride_col, table_blocks, block_size):
    """int32 cache slots of request-local positions ``columns`` whose pages are listed at ``pages`` (a block-table
    row, ``table_blocks`` entries): ``-1`` where not ``valid``, where the page index reaches ``table_blocks`` (the
    entry is not read), where the page id is negative (unallocated) or where the slot passes the int32 range."""
    page_index = columns // block_size
    readable = valid & (page_index < table_blocks)
    page = tl.load(pages + page_index.to(tl.int64) * table_stride_col, mask=readable, other=-1).to(tl.int64)
    slot = page * block_size + columns % block_size
    return tl.where((page >= 0) & (slot <= KEY_MAX), slot, -1).to(tl.int32)


@triton.jit
def _page_rows(table_ptr, table_stride_row, rows, rows_per_request, SLOTS: tl.constexpr):
    """Block-table row pointers of the requests of ``rows`` (the table itself when not ``SLOTS``)."""
    if SLOTS:
        return table_ptr + (rows // rows_per_request).to(tl.int64) * table_stride_row
    return table_ptr + rows.to(tl.int64) * 0


@triton.jit
def _pad_rows(out_ptrs, out_stride_col, first, valid, k, PAD_BLOCK: tl.constexpr):
    """``-1`` into positions ``[first, k)`` of the rows at ``out_ptrs [ROWS, 1]`` (``first [ROWS]``)."""
    padding = tl.full([1, PAD_BLOCK], -1, tl.int32)
    block = tl.min(tl.where(valid, first, k), axis=0)
    while block < k:
        position = block + tl.arange(0, PAD_BLOCK)[None, :]  # [1, PAD_BLOCK]
        pad = valid[:, None] & (position >= first[:, None]) & (position < k)  # [ROWS, PAD_BLOCK]
        tl.store(out_ptrs + position.to(tl.int64) * out_stride_col, padding, mask=pad)
        block += PAD_BLOCK


@triton.jit
def _select_rows(logits_ptr, stride_row, stride_col, rows, valid, start, length, out_ptr, out_stride_row,
                 out_stride_col, k, table_ptr, table_stride_row, table_stride_col, table_blocks, block_size, rows_per_request,
                 BLOCK: tl.constexpr, PAD_BLOCK: tl.constexpr, SLOTS: tl.constexpr, CARRY: tl.constexpr,
                 PLATEAU_EVERY: tl.constexpr):
    """Top-k of the windows ``[start, start + length)`` (``length <= BLOCK``) of ``rows`` [ROWS] into ``out``:
    search (``_kth_largest_rows`` with ``CARRY``, ``PLATEAU_EVERY``) and emit on the uint32 order images; rows all
    selectable and at most k wide store their columns directly."""
    columns = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK] window-relative
    inside = columns < length[:, None]  # [ROWS, BLOCK]
    src = logits_ptr + rows.to(tl.int64)[:, None] * stride_row + (start[:, None] + columns).to(tl.int64) * stride_col
    keys = order_keys(tl.load(src, mask=inside, other=0.0), inside)  # [ROWS, BLOCK]
    images = (keys ^ NONE).to(tl.uint32, bitcast=True)  # NONE -> 0; unsigned order = value order
    selectable = tl.sum((images != 0).to(tl.int32), axis=1)  # [ROWS]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * out_stride_row  # [ROWS, 1]
    pages = _page_rows(table_ptr, table_stride_row, rows, rows_per_request, SLOTS)[:, None]  # [ROWS, 1]
    # Every row all selectable and at most k wide: the picks are the columns themselves.
    copy = tl.min(((selectable == length) & (length <= k)).to(tl.int32), axis=0) > 0
    if copy:
        if SLOTS:
            written = _column_slots(pages, columns, inside, table_stride_col, table_blocks, block_size)
        else:
            written = tl.broadcast_to(columns, [rows.shape[0], BLOCK])
        tl.store(out_ptrs + columns.to(tl.int64) * out_stride_col, written, mask=inside)
        taken = length
    else:
        searching = selectable > k
        threshold = _kth_largest_rows(images, k, searching, selectable, CARRY, PLATEAU_EVERY)  # [ROWS]
        equal = (images == threshold[:, None]) & (images != 0)
        greater = images > threshold[:, None]
        counts = greater.to(tl.int32) + (equal.to(tl.int32) << 16)  # [ROWS, BLOCK]
        totals = tl.sum(counts, axis=1)  # [ROWS]
        ties = tl.where(searching, k - (totals & LOW_FIELD), 0)
        _emit_taken(counts, greater, equal, tl.broadcast_to(columns, [rows.shape[0], BLOCK]), ties[:, None], 0,
                    out_ptrs, out_stride_col, pages, table_stride_col, table_blocks, block_size, 1, SLOTS)
        taken = (totals & LOW_FIELD) + tl.minimum(totals >> 16, ties)
    _pad_rows(out_ptrs, out_stride_col, taken, valid, k, PAD_BLOCK)


@triton.jit(do_not_specialize=["num_rows", "width", "k", "next_n", "block_size", "table_blocks", "rows_per_request",
                              "class_above", "class_upto"])
def _topk_row_kernel(
    logits_ptr, stride_row, stride_col, starts_ptr, ends_ptr, out_ptr, out_stride_row, out_stride_col,
    num_rows, width, k, next_n,
    table_ptr, table_stride_row, table_stride_col, table_blocks, block_size, rows_per_request, class_above, class_upto,
    HAS_STARTS: tl.constexpr, ENDS_MODE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    PAD_BLOCK: tl.constexpr, SLOTS: tl.constexpr, CLASSED: tl.constexpr, CARRY: tl.constexpr,
    PLATEAU_EVERY: tl.constexpr, PDL: tl.constexpr = False,
):
    """``ROWS`` whole rows per program in a register tile of ``BLOCK`` columns. ``CLASSED`` (one launch per
    tile): a program keeps only its rows whose window length lies in ``(class_above, class_upto]`` and does
    nothing when none does; the other launches own the others.
    ``CARRY``, ``PLATEAU_EVERY``: the search (``_select_rows``). ``PDL``: ``_wait_for_previous_grid``."""
    _wait_for_previous_grid(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    valid = rows < num_rows
    start, length = _row_window(rows, valid, starts_ptr, ends_ptr, width, next_n, HAS_STARTS, ENDS_MODE)
    if CLASSED:
        valid = valid & (length > class_above) & (length <= class_upto)
        length = tl.where(valid, length, 0)
    args = (logits_ptr, stride_row, stride_col, rows, valid, start, length, out_ptr, out_stride_row,
            out_stride_col, k, table_ptr, table_stride_row, table_stride_col, table_blocks, block_size, rows_per_request)
    if CLASSED:
        if tl.max(valid.to(tl.int32), axis=0) > 0:
            _select_rows(*args, BLOCK, PAD_BLOCK, SLOTS, CARRY, PLATEAU_EVERY)
    else:
        _select_rows(*args, BLOCK, PAD_BLOCK, SLOTS, CARRY, PLATEAU_EVERY)


@triton.jit
def _maxima_lower_bound(maxima, k, enough, row, CARRY: tl.constexpr):
    """Lower bound of a row's k-th largest entry from its group maxima ``[GROUP_TILE]``: ``(bound, inclusive,
    row_max)``. The search stops as soon as at most ``enough`` maxima reach its floor (candidates: entries
    ``>= bound``, ``inclusive`` 1), else ``bound`` is the exact k-th largest maximum (candidates ``> bound``:
    fewer than k groups hold one; ``inclusive`` 0). Fewer than k selectable maxima: ``NONE``, inclusive.
    ``row_max``: the largest key of the row (the largest maximum), an upper bracket of the candidates' search."""
    bound = row * 0 + NONE
    inclusive = row * 0 + 1
    count, lo, row_max = _bracket(maxima)
    if count >= k:
        bound, reaching = kth_largest_within(maxima, k, enough, count, lo, row_max, CARRY)
        inclusive = (reaching <= enough).to(tl.int32)
    return bound, inclusive, row_max


@triton.jit
def _compact_qualifying(maxima, slots, bound, inclusive, ids_row):
    """Stores, ascending at ``ids_row``, the group ids ``slots`` whose maxima reach the bound; returns their number."""
    qualifies = _reaches(maxima, bound, inclusive).to(tl.int32)
    num_qualifying = tl.sum(qualifies, axis=0)
    tl.store(ids_row + tl.cumsum(qualifies, axis=0) - 1, slots, mask=qualifies != 0)
    return num_qualifying


@triton.jit
def _store_piece_state(state_row, bound, inclusive, row_max, num_qualifying):
    """The gather-piece launch's per-row state: bound, kind, the row's largest key, number of qualifying groups,
    no arrivals."""
    tl.store(state_row + _PIECE_BOUND, bound)
    tl.store(state_row + _PIECE_INCLUSIVE, inclusive)
    tl.store(state_row + _PIECE_ROW_MAX, row_max)
    tl.store(state_row + _PIECE_QUALIFYING, num_qualifying)
    tl.store(state_row + _PIECE_ARRIVED, 0)


@triton.jit(do_not_specialize=["width", "next_n", "num_chunks"])
def _split_group_max_kernel(
    logits_ptr, stride_row, stride_col, starts_ptr, ends_ptr, group_max_ptr, state_ptr, state_stride,
    width, next_n, num_chunks,
    HAS_STARTS: tl.constexpr, ENDS_MODE: tl.constexpr,
    CHUNK: tl.constexpr, GROUP: tl.constexpr, MAXIMA_STRIDE: tl.constexpr, CLEAR_STATE: tl.constexpr,
    PDL: tl.constexpr = False, timeline_ptr=None, TIMELINE: tl.constexpr = False, CLEAR_READY: tl.constexpr = False,
):
    """Group maxima of chunks of ``CHUNK`` columns: ``group_max[row * MAXIMA_STRIDE + column // GROUP]`` for
    the chunks up to the row's length (one chunk at least); with ``CLEAR_STATE`` (split path), the chunk's flag
    is cleared too, and chunk 0 clears the row's arrival counter. Also the streaming pass of row programs of
    calls with few rows; with ``CLEAR_READY`` (``pieces_ready_max_rows``) chunk 0 clears the row's ``_PIECE_READY``
    word. ``PDL``: ``_wait_for_previous_grid``. ``TIMELINE``: ``stamp`` (``_TL_*``)."""
    stamp(timeline_ptr, tl.program_id(0), _TL_START, _TL_MAXIMA_SLOTS, TIMELINE)
    _wait_for_previous_grid(PDL)
    GROUPS_PER_CHUNK: tl.constexpr = CHUNK // GROUP
    pid = tl.program_id(0)
    stamp(timeline_ptr, pid, _TL_WAITED, _TL_MAXIMA_SLOTS, TIMELINE)
    row = pid // num_chunks
    chunk = pid % num_chunks
    start, length = _row_window(row, row >= 0, starts_ptr, ends_ptr, width, next_n, HAS_STARTS, ENDS_MODE)
    if chunk < tl.maximum(tl.cdiv(length, CHUNK), 1):
        group_ids = tl.arange(0, GROUPS_PER_CHUNK)  # [GROUPS_PER_CHUNK]
        columns = chunk * CHUNK + group_ids[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS_PER_CHUNK, GROUP]
        inside = columns < length
        src = logits_ptr + row.to(tl.int64) * stride_row + (start + columns).to(tl.int64) * stride_col
        if chunk < length // CHUNK:  # a whole chunk inside the row: no mask, so the loads can be 16 bytes wide
            values = tl.load(src)
        else:
            values = tl.load(src, mask=inside, other=0.0)
        keys = order_keys(values, inside)  # [GROUPS_PER_CHUNK, GROUP]
        group_row = group_max_ptr + row.to(tl.int64) * MAXIMA_STRIDE
        tl.store(group_row + chunk * GROUPS_PER_CHUNK + group_ids, tl.max(keys, axis=1))
        if CLEAR_STATE:
            tl.store(state_ptr + row.to(tl.int64) * state_stride + _FLAGS + chunk, 0)
            if chunk == 0:
                tl.store(state_ptr + row.to(tl.int64) * state_stride + _ARRIVED, 0)
        if CLEAR_READY:
            if chunk == 0:
                tl.store(state_ptr + row.to(tl.int64) * state_stride + _PIECE_READY, 0)
    stamp(timeline_ptr, pid, _TL_MAXIMA, _TL_MAXIMA_SLOTS, TIMELINE)


@triton.jit
def _flags_before(flags_row, chunk, FLAG_TILE: tl.constexpr):
    """The flags of chunks ``[0, chunk)`` of a row (``flags_row [FLAG_TILE]``; 1 at the others) once every one is
    published (non-zero): decoupled look-back, a program waits only for programs of lower ids."""
    lower = tl.arange(0, FLAG_TILE)  # [FLAG_TILE]
    is_lower = lower < chunk
    flags = tl.load(flags_row + lower, mask=is_lower, other=1, volatile=True)
    while tl.min(flags, axis=0) == 0:
        flags = tl.load(flags_row + lower, mask=is_lower, other=1, volatile=True)
    return flags


@triton.jit(do_not_specialize=["width", "k", "next_n", "num_rows", "num_chunks", "enough", "block_size", "table_blocks",
                               "rows_per_request"])
def _split_candidates_kernel(
    logits_ptr, stride_row, stride_col, starts_ptr, ends_ptr, group_max_ptr, cand_keys_ptr, cand_columns_ptr,
    cand_stride, state_ptr, state_stride, width, k, next_n, num_rows, num_chunks, enough, out_ptr, out_stride_row,
    out_stride_col, table_ptr, table_stride_row, table_stride_col, table_blocks, block_size, rows_per_request,
    HAS_STARTS: tl.constexpr, ENDS_MODE: tl.constexpr, CHUNK: tl.constexpr, GROUP: tl.constexpr,
    GROUP_TILE: tl.constexpr, CANDIDATE_BLOCK: tl.constexpr, CARRY: tl.constexpr, CARRY_BOUND: tl.constexpr,
    FLAG_TILE: tl.constexpr, PAD_BLOCK: tl.constexpr, SLOTS: tl.constexpr,
):
    """Step 2 of the split path (module docstring): every program finds the row's lower bound from all its group
    maxima (the same on each; ``enough``, counts with ``CARRY_BOUND``) while its whole chunk loads (L2: step 1
    just read it), stores the chunk's candidates (keys and columns) in column order (its offset from a look-back
    over the row's chunk flags, which hold count + 1), and the row's last program to arrive finds ``T`` and emits
    the row from them (``_select_and_emit``, its search in registers counted with ``CARRY``)."""
    GROUPS_PER_CHUNK: tl.constexpr = CHUNK // GROUP
    pid = tl.program_id(0)
    row = num_rows - 1 - pid // num_chunks
    chunk = pid % num_chunks
    start, length = _row_window(row, row >= 0, starts_ptr, ends_ptr, width, next_n, HAS_STARTS, ENDS_MODE)
    row_chunks = tl.maximum(tl.cdiv(length, CHUNK), 1)
    if chunk < row_chunks:
        state_row = state_ptr + row.to(tl.int64) * state_stride
        maxima_row = group_max_ptr + row.to(tl.int64) * GROUP_TILE
        group_ids = tl.arange(0, GROUPS_PER_CHUNK)  # [GROUPS_PER_CHUNK]
        columns = chunk * CHUNK + group_ids[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS_PER_CHUNK, GROUP]
        src = logits_ptr + row.to(tl.int64) * stride_row + (start + columns).to(tl.int64) * stride_col
        inside = columns < length
        if chunk < length // CHUNK:  # a whole chunk inside the row: no mask, so the loads can be 16 bytes wide
            values = tl.load(src)
        else:
            values = tl.load(src, mask=inside, other=0.0)
        slots = tl.arange(0, GROUP_TILE)  # [GROUP_TILE]
        all_maxima = tl.load(maxima_row + slots, mask=slots < row_chunks * GROUPS_PER_CHUNK, other=NONE)
        t_low, inclusive, row_max = _maxima_lower_bound(all_maxima, k, enough, row, CARRY_BOUND)
        keys = order_keys(values, inside)  # [GROUPS_PER_CHUNK, GROUP]
        is_candidate = _reaches(keys, t_low, inclusive).to(tl.int32)
        per_group = tl.sum(is_candidate, axis=1)  # [GROUPS_PER_CHUNK]
        chunk_count = tl.sum(per_group, axis=0)
        tl.atomic_xchg(state_row + _FLAGS + chunk, chunk_count + 1, sem="relaxed", scope="gpu")
        first = tl.sum(_flags_before(state_row + _FLAGS, chunk, FLAG_TILE) - 1, axis=0)
        group_first = first + tl.cumsum(per_group, axis=0) - per_group  # [GROUPS_PER_CHUNK]
        position = group_first[:, None] + tl.cumsum(is_candidate, axis=1) - 1  # [GROUPS_PER_CHUNK, GROUP]
        cand_keys_row = cand_keys_ptr + row.to(tl.int64) * cand_stride
        tl.store(cand_keys_row + position, keys, mask=is_candidate != 0)
        cand_columns_row = cand_columns_ptr + row.to(tl.int64) * cand_stride
        tl.store(cand_columns_row + position, columns, mask=is_candidate != 0)
        tl.debug_barrier()
        arrived = tl.atomic_add(state_row + _ARRIVED, 1, sem="acq_rel", scope="gpu")
        if arrived == row_chunks - 1:
            # Every program published its flag before arriving: their sum is the number of candidates.
            every = tl.arange(0, FLAG_TILE)  # [FLAG_TILE]
            flags = tl.load(state_row + _FLAGS + every, mask=every < row_chunks, other=1, volatile=True)
            _select_and_emit(row, logits_ptr + row.to(tl.int64) * stride_row, start, stride_col, length, k, t_low,
                             inclusive, row_max, tl.sum(flags - 1, axis=0), cand_keys_row, cand_columns_row, out_ptr,
                             out_stride_row, out_stride_col, table_ptr, table_stride_row, table_stride_col, table_blocks,
                             block_size, rows_per_request, CHUNK, CANDIDATE_BLOCK, PAD_BLOCK, SLOTS, CARRY, None, row, 1, False)


@triton.jit
def _reaches(keys, bound, inclusive):
    """``keys >= bound`` where ``inclusive`` else ``keys > bound``; NONE never reaches."""
    return ((keys > bound) | ((inclusive != 0) & (keys == bound))) & (keys != NONE)


@triton.jit
def _emit_ordered(keys, columns, threshold, ties, base, out_row, out_stride_col, pages, table_stride_col, table_blocks, block_size,
                  SLOTS: tl.constexpr):
    """Emit the 1-D tile ``keys``/``columns`` (ascending columns, after every earlier tile of the row):
    entries ``> threshold`` and the first ``ties`` entries ``== threshold`` go to positions ``base, ...``.
    Returns the next ``base`` and the ties still to take."""
    greater = keys > threshold
    equal = (keys == threshold) & (keys != NONE)
    counts = greater.to(tl.int32) + (equal.to(tl.int32) << 16)
    total = tl.sum(counts, axis=0)
    _emit_taken(counts, greater, equal, columns, ties, base, out_row, out_stride_col, pages, table_stride_col, table_blocks,
                block_size, 0, SLOTS)
    ties_taken = tl.minimum(total >> 16, ties)
    return base + (total & LOW_FIELD) + ties_taken, ties - ties_taken


@triton.jit
def _gather_piece(src_row, start, stride_col, ids, piece_first, num_qualifying, length, TILE_GROUPS: tl.constexpr,
                  GROUP: tl.constexpr):
    """Logits ``[TILE_GROUPS, GROUP]`` of the groups ``ids`` (qualifying ids ``piece_first, ...``; slots
    past ``num_qualifying`` read nothing and give 0). A piece before the last
    is loaded without a mask (16-byte loads): it holds only groups below the last qualifying one, so
    every column of it lies inside the row (a qualifying group has a selectable entry)."""
    columns = ids[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [TILE_GROUPS, GROUP]
    pointers = src_row + (start + columns).to(tl.int64) * stride_col
    in_piece = piece_first + tl.arange(0, TILE_GROUPS) < num_qualifying  # [TILE_GROUPS]
    inside = in_piece[:, None] & (columns < length)
    if piece_first + TILE_GROUPS < num_qualifying:
        values = tl.load(pointers)
    else:
        values = tl.load(pointers, mask=inside, other=0.0)
    return values


@triton.jit
def _load_quads(pointers, columns, in_piece, length, stride_col, GROUP: tl.constexpr, MASKED: tl.constexpr):
    """The four quads of ``_gather_quads`` from the quad-0 ``pointers``/``columns`` ``[TILE_GROUPS, 4]``; with
    ``MASKED`` only the entries of qualifying slots (``in_piece [TILE_GROUPS, 1]``) inside the row."""
    if MASKED:
        quad0 = tl.load(pointers, mask=in_piece & (columns < length), other=0.0)
    else:
        quad0 = tl.load(pointers)
    quad1 = quad0
    quad2 = quad0
    quad3 = quad0
    if GROUP >= 8:
        if MASKED:
            quad1 = tl.load(pointers + 4 * stride_col, mask=in_piece & (columns + 4 < length), other=0.0)
        else:
            quad1 = tl.load(pointers + 4 * stride_col)
    if GROUP >= 16:
        if MASKED:
            quad2 = tl.load(pointers + 8 * stride_col, mask=in_piece & (columns + 8 < length), other=0.0)
            quad3 = tl.load(pointers + 12 * stride_col, mask=in_piece & (columns + 12 < length), other=0.0)
        else:
            quad2 = tl.load(pointers + 8 * stride_col)
            quad3 = tl.load(pointers + 12 * stride_col)
    return quad0, quad1, quad2, quad3


@triton.jit
def _gather_quads(src_row, start, stride_col, ids, piece_first, num_qualifying, length, TILE_GROUPS: tl.constexpr,
                  GROUP: tl.constexpr):
    """``_gather_piece`` by quads: four ``[TILE_GROUPS, 4]`` logits, quad ``q`` the columns ``4q .. 4q + 3`` of
    each group (one thread holds a whole group). ``GROUP`` 4 to 16; the quads past the group (``4q >= GROUP``)
    repeat quad 0 (no loads; the callers ignore them). A piece before the last is loaded without a mask."""
    in_piece = (piece_first + tl.arange(0, TILE_GROUPS) < num_qualifying)[:, None]  # [TILE_GROUPS, 1]
    columns = ids[:, None] * GROUP + tl.arange(0, 4)[None, :]  # [TILE_GROUPS, 4] of quad 0
    pointers = src_row + (start + columns).to(tl.int64) * stride_col
    if piece_first + TILE_GROUPS < num_qualifying:
        quad0, quad1, quad2, quad3 = _load_quads(pointers, columns, in_piece, length, stride_col, GROUP, False)
    else:
        quad0, quad1, quad2, quad3 = _load_quads(pointers, columns, in_piece, length, stride_col, GROUP, True)
    return quad0, quad1, quad2, quad3


@triton.jit
def _quad_candidates(values, ids, in_piece, length, bound, inclusive, QUAD: tl.constexpr, GROUP: tl.constexpr):
    """Quad ``QUAD`` of a gather piece (``values [TILE_GROUPS, 4]``, groups ``ids``, ``in_piece`` the slots below
    the row's number of qualifying groups): its order keys, columns, candidate flags (``_reaches`` the bound) and
    per-group candidate counts ``[TILE_GROUPS]`` (in-thread). A quad past the group (``4 * QUAD >= GROUP``) has
    no candidates."""
    columns = ids[:, None] * GROUP + (4 * QUAD) + tl.arange(0, 4)[None, :]  # [TILE_GROUPS, 4]
    keys = order_keys(values, in_piece[:, None] & (columns < length))
    is_candidate = _reaches(keys, bound, inclusive).to(tl.int32)
    if 4 * QUAD >= GROUP:
        is_candidate = is_candidate * 0
    return keys, columns, is_candidate, tl.sum(is_candidate, axis=1)


@triton.jit
def _store_quad(keys, columns, is_candidate, quad_first, cand_keys_row, cand_columns_row):
    """Store a quad's candidates in column order from buffer slot ``quad_first [TILE_GROUPS]`` of each group (its
    group's first slot plus the candidates of its earlier quads): in-quad ranks are an in-thread prefix sum."""
    position = quad_first[:, None] + tl.cumsum(is_candidate, axis=1) - 1  # [TILE_GROUPS, 4]
    tl.store(cand_keys_row + position, keys, mask=is_candidate != 0)
    tl.store(cand_columns_row + position, columns, mask=is_candidate != 0)


@triton.jit
def _compact_quads(quad0, quad1, quad2, quad3, ids, piece_first, num_qualifying, length, bound, inclusive,
                   num_candidates, cand_keys_row, cand_columns_row, flags_row, piece, TILE_GROUPS: tl.constexpr,
                   GROUP: tl.constexpr, FLAG_TILE: tl.constexpr):
    """Store a gather piece's candidates (``_gather_quads``' quads of the groups ``ids``, qualifying ids
    ``piece_first, ...``) in column order from buffer slot ``num_candidates``; returns the piece's number of
    candidates. One 1-D scan of the per-group counts over the piece; counts and ranks within a group are in-thread.
    With ``FLAG_TILE > 0`` (gather launch) the piece first publishes its count + 1 in ``flags_row[piece]`` and
    adds the counts of the row's lower pieces (``_flags_before``) to ``num_candidates``."""
    in_piece = piece_first + tl.arange(0, TILE_GROUPS) < num_qualifying  # [TILE_GROUPS]
    keys0, columns0, is_candidate0, count0 = _quad_candidates(quad0, ids, in_piece, length, bound, inclusive, 0,
                                                              GROUP)
    keys1, columns1, is_candidate1, count1 = _quad_candidates(quad1, ids, in_piece, length, bound, inclusive, 1,
                                                              GROUP)
    keys2, columns2, is_candidate2, count2 = _quad_candidates(quad2, ids, in_piece, length, bound, inclusive, 2,
                                                              GROUP)
    keys3, columns3, is_candidate3, count3 = _quad_candidates(quad3, ids, in_piece, length, bound, inclusive, 3,
                                                              GROUP)
    per_group = count0 + count1 + count2 + count3  # [TILE_GROUPS]
    piece_count = tl.sum(per_group, axis=0)
    if FLAG_TILE > 0:
        # The flag needs only the count (not the candidates): later pieces of the row wait on it alone.
        tl.atomic_xchg(flags_row + piece, piece_count + 1, sem="relaxed", scope="gpu")
        num_candidates += tl.sum(_flags_before(flags_row, piece, FLAG_TILE) - 1, axis=0)
    group_first = num_candidates + tl.cumsum(per_group, axis=0) - per_group
    _store_quad(keys0, columns0, is_candidate0, group_first, cand_keys_row, cand_columns_row)
    _store_quad(keys1, columns1, is_candidate1, group_first + count0, cand_keys_row, cand_columns_row)
    _store_quad(keys2, columns2, is_candidate2, group_first + count0 + count1, cand_keys_row, cand_columns_row)
    _store_quad(keys3, columns3, is_candidate3, group_first + count0 + count1 + count2, cand_keys_row,
                cand_columns_row)
    return piece_count


@triton.jit
def _select_and_emit(row, src_row, start, stride_col, length, k, bound, inclusive, row_max, num_candidates,
                     cand_keys_row, cand_columns_row, out_ptr, out_stride_row, out_stride_col, table_ptr,
                     table_stride_row, table_stride_col, table_blocks, block_size, rows_per_request, STREAM_TILE: tl.constexpr,
                     CANDIDATE_BLOCK: tl.constexpr, PAD_BLOCK: tl.constexpr, SLOTS: tl.constexpr,
                     CARRY: tl.constexpr, timeline_ptr, program, TIMELINE_SLOTS: tl.constexpr,
                     TIMELINE: tl.constexpr):
    """The end of a row program (and of the split path): ``T`` among the ``num_candidates`` candidates (keys and
    columns, in column order at buffer slots ``[0, num_candidates)``) of the ``bound``, then the ordered emit of the
    row's k picks and the padding. The search in registers counts as ``reaching`` with ``CARRY`` and starts from
    the bracket ``[bound, row_max]`` and ``num_candidates`` (no reductions over the candidates); the ties are counted
    only when more than k candidates reach the threshold found. A row emitted from the row itself (strict bound,
    fewer than k candidates) is streamed in tiles of ``STREAM_TILE`` only until its ties are taken (the first ones in
    column order; e.g. the zeros of a row without positive entries lie in its first few tiles), then the remaining
    candidates are emitted from the buffer (fewer than k: held in registers). ``TIMELINE``: ``stamp`` of
    ``program`` after the search of T and after the emit."""
    # T and the ties, then the ordered emit: from the candidates, or from the row when T is the bound
    # itself and its ties (not candidates) are taken.
    slots = tl.arange(0, CANDIDATE_BLOCK)  # of the candidates held in registers
    out_row = out_ptr + row.to(tl.int64) * out_stride_row
    pages = _page_rows(table_ptr, table_stride_row, row, rows_per_request, SLOTS)
    taken = row * 0
    if (inclusive == 0) & (num_candidates < k):
        # Every entry > T = bound is a candidate; the first k - num_candidates ties come from the row.
        ties = k - num_candidates
        line = tl.arange(0, STREAM_TILE)
        line_first = row * 0
        while (line_first < length) & (ties > 0):
            line_columns = line_first + line
            line_inside = line_columns < length
            line_keys = order_keys(tl.load(src_row + (start + line_columns).to(tl.int64) * stride_col,
                                            mask=line_inside, other=0.0), line_inside)
            taken, ties = _emit_ordered(line_keys, line_columns, bound, ties, taken, out_row, out_stride_col,
                                        pages, table_stride_col, table_blocks, block_size, SLOTS)
            line_first += STREAM_TILE
        # The candidates past the streamed columns follow in column order: the j-th at position taken + j -
        # emitted (emitted = candidates already streamed = taken minus the ties taken).
        emitted = taken - (k - num_candidates - ties)
        held = tl.arange(0, CANDIDATE_BLOCK)
        remaining = (held >= emitted) & (held < num_candidates)
        held_columns = tl.load(cand_columns_row + slots, mask=remaining, other=0, cache_modifier=".cg")
        _emit_taken(remaining.to(tl.int32), remaining, held < 0, held_columns, 0, taken, out_row, out_stride_col,
                    pages, table_stride_col, table_blocks, block_size, 0, SLOTS)
        taken += num_candidates - emitted
    elif num_candidates <= CANDIDATE_BLOCK:
        held = slots < num_candidates
        held_keys = tl.load(cand_keys_row + slots, mask=held, other=NONE, cache_modifier=".cg")
        held_columns = tl.load(cand_columns_row + slots, mask=held, other=0, cache_modifier=".cg")
        threshold = row * 0 + NONE
        ties = row * 0
        if num_candidates > k:
            # Every candidate reaches the bound; none exceeds the row's largest key.
            threshold, reaching = kth_largest_within(held_keys, k, k, num_candidates, bound, row_max, CARRY)
            ties = k  # exactly k candidates reach the threshold: every tie is taken
            if reaching > k:
                ties = k - tl.sum((held_keys > threshold).to(tl.int32), axis=0)
        stamp(timeline_ptr, program, _TL_T, TIMELINE_SLOTS, TIMELINE)
        taken, ties = _emit_ordered(held_keys, held_columns, threshold, ties, taken, out_row, out_stride_col, pages,
                                    table_stride_col, table_blocks, block_size, SLOTS)
    else:
        threshold = row * 0 + NONE
        ties = row * 0
        if num_candidates > k:
            threshold = _kth_largest_in_memory(cand_keys_row, num_candidates, k, CANDIDATE_BLOCK)
            ties = k - _count_above_in_memory(cand_keys_row, num_candidates, threshold, CANDIDATE_BLOCK)
        stamp(timeline_ptr, program, _TL_T, TIMELINE_SLOTS, TIMELINE)
        slot = tl.arange(0, CANDIDATE_BLOCK)
        slot_first = row * 0
        while slot_first < num_candidates:
            in_slots = slot_first + slot < num_candidates
            slot_keys = tl.load(cand_keys_row + slot_first + slot, mask=in_slots, other=NONE, cache_modifier=".cg")
            slot_columns = tl.load(cand_columns_row + slot_first + slot, mask=in_slots, other=0,
                                   cache_modifier=".cg")
            taken, ties = _emit_ordered(slot_keys, slot_columns, threshold, ties, taken, out_row, out_stride_col,
                                        pages, table_stride_col, table_blocks, block_size, SLOTS)
            slot_first += CANDIDATE_BLOCK
    one = tl.full([1], 0, tl.int32)
    _pad_rows(out_row + tl.zeros([1, 1], tl.int64), out_stride_col, one + taken, one == 0, k, PAD_BLOCK)
    stamp(timeline_ptr, program, _TL_EMITTED, TIMELINE_SLOTS, TIMELINE)


@triton.jit
def _compact_tile(values, ids, piece_first, num_qualifying, length, bound, inclusive, num_candidates, cand_keys_row,
                  cand_columns_row, flags_row, piece, TILE_GROUPS: tl.constexpr, GROUP: tl.constexpr,
                  FLAG_TILE: tl.constexpr):
    """``_compact_quads`` for a piece loaded as one ``[TILE_GROUPS, GROUP]`` tile (``_gather_piece``; groups of any
    width, a group spread over several lanes): per-group sums and in-group ranks across lanes."""
    columns = ids[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [TILE_GROUPS, GROUP]
    inside = (piece_first + tl.arange(0, TILE_GROUPS) < num_qualifying)[:, None] & (columns < length)
    keys = order_keys(values, inside)
    is_candidate = _reaches(keys, bound, inclusive).to(tl.int32)
    per_group = tl.sum(is_candidate, axis=1)  # [TILE_GROUPS]
    position = (tl.cumsum(per_group, axis=0) - per_group)[:, None] + tl.cumsum(is_candidate, axis=1) - 1
    piece_count = tl.sum(per_group, axis=0)
    if FLAG_TILE > 0:
        # The flag needs only the count (not the candidates): later pieces of the row wait on it alone.
        tl.atomic_xchg(flags_row + piece, piece_count + 1, sem="relaxed", scope="gpu")
        num_candidates += tl.sum(_flags_before(flags_row, piece, FLAG_TILE) - 1, axis=0)
    tl.store(cand_keys_row + num_candidates + position, keys, mask=is_candidate != 0)
    tl.store(cand_columns_row + num_candidates + position, columns, mask=is_candidate != 0)
    return piece_count


@triton.jit
def _gather_loaded(src_row, start, stride_col, ids, piece_first, num_qualifying, length, TILE_GROUPS: tl.constexpr,
                   GROUP: tl.constexpr, LEAN_GATHER: tl.constexpr):
    """A gather piece's logits as four tensors: the quads of ``_gather_quads`` with ``LEAN_GATHER``, else the
    ``_gather_piece`` tile four times (``_compact_tile`` reads the first only)."""
    if LEAN_GATHER:
        quad0, quad1, quad2, quad3 = _gather_quads(src_row, start, stride_col, ids, piece_first, num_qualifying,
                                                   length, TILE_GROUPS, GROUP)
    else:
        quad0 = _gather_piece(src_row, start, stride_col, ids, piece_first, num_qualifying, length, TILE_GROUPS,
                              GROUP)
        quad1 = quad0
        quad2 = quad0
        quad3 = quad0
    return quad0, quad1, quad2, quad3


@triton.jit
def _compact_loaded(quad0, quad1, quad2, quad3, ids, piece_first, num_qualifying, length, bound, inclusive,
                    num_candidates, cand_keys_row, cand_columns_row, flags_row, piece, TILE_GROUPS: tl.constexpr,
                    GROUP: tl.constexpr, FLAG_TILE: tl.constexpr, LEAN_GATHER: tl.constexpr):
    """``_compact_quads`` or ``_compact_tile`` of ``_gather_loaded``'s tensors; returns the piece's candidates."""
    if LEAN_GATHER:
        piece_count = _compact_quads(quad0, quad1, quad2, quad3, ids, piece_first, num_qualifying, length, bound,
                                     inclusive, num_candidates, cand_keys_row, cand_columns_row, flags_row, piece,
                                     TILE_GROUPS, GROUP, FLAG_TILE)
    else:
        piece_count = _compact_tile(quad0, ids, piece_first, num_qualifying, length, bound, inclusive, num_candidates,
                                    cand_keys_row, cand_columns_row, flags_row, piece, TILE_GROUPS, GROUP, FLAG_TILE)
    return piece_count


@triton.jit
def _gather_candidates(src_row, start, stride_col, length, ids, ids_row, num_qualifying, bound, inclusive,
                       cand_keys_row, cand_columns_row, row, timeline_ptr, TIMELINE_SLOTS: tl.constexpr,
                       TILE_GROUPS: tl.constexpr, GROUP: tl.constexpr, LEAN_GATHER: tl.constexpr,
                       TIMELINE: tl.constexpr):
    """A row program's gather loop: the candidates of the ``num_qualifying`` groups listed at ``ids_row`` (``ids``:
    the first piece's, already loaded) in column order at buffer slots ``0, ...``, piece by piece
    (``_gather_loaded``, ``_compact_loaded``: by quads with ``LEAN_GATHER``, else by group tiles; the next piece's
    logits in flight while this one is compacted, the ids a piece further ahead). Returns the number of candidates."""
    group_ids = tl.arange(0, TILE_GROUPS)  # [TILE_GROUPS]
    num_candidates = num_qualifying * 0
    piece_first = num_qualifying * 0
    quad0, quad1, quad2, quad3 = _gather_loaded(src_row, start, stride_col, ids, piece_first, num_qualifying, length,
                                                TILE_GROUPS, GROUP, LEAN_GATHER)
    next_ids = tl.load(ids_row + TILE_GROUPS + group_ids, mask=TILE_GROUPS + group_ids < num_qualifying, other=0,
                       cache_modifier=".cg")
    while piece_first < num_qualifying:
        next_first = piece_first + TILE_GROUPS
        next0, next1, next2, next3 = _gather_loaded(src_row, start, stride_col, next_ids, next_first, num_qualifying,
                                                    length, TILE_GROUPS, GROUP, LEAN_GATHER)
        later = next_first + TILE_GROUPS + group_ids
        later_ids = tl.load(ids_row + later, mask=later < num_qualifying, other=0, cache_modifier=".cg")
        num_candidates += _compact_loaded(quad0, quad1, quad2, quad3, ids, piece_first, num_qualifying, length, bound,
                                          inclusive, num_candidates, cand_keys_row, cand_columns_row, None, 0,
                                          TILE_GROUPS, GROUP, 0, LEAN_GATHER)
        stamp(timeline_ptr, row, _TL_ROW_PIECES + piece_first // TILE_GROUPS, TIMELINE_SLOTS, TIMELINE)
        quad0, quad1, quad2, quad3 = next0, next1, next2, next3
        ids = next_ids
        next_ids = later_ids
        piece_first = next_first
    return num_candidates


@triton.jit(do_not_specialize=["width", "k", "next_n", "enough", "capacity", "block_size", "table_blocks",
                              "rows_per_request"])
def _row_program_kernel(
    logits_ptr, stride_row, stride_col, starts_ptr, ends_ptr, out_ptr, out_stride_row, out_stride_col,
    groups_ptr, cand_keys_ptr, cand_columns_ptr, capacity, state_ptr, state_stride, width, k, next_n, enough,
    table_ptr, table_stride_row, table_stride_col, table_blocks, block_size, rows_per_request,
    HAS_STARTS: tl.constexpr, ENDS_MODE: tl.constexpr, GROUP: tl.constexpr, GROUP_TILE: tl.constexpr,
    STREAM_TILE: tl.constexpr, CANDIDATE_BLOCK: tl.constexpr, PAD_BLOCK: tl.constexpr, SLOTS: tl.constexpr,
    STREAM: tl.constexpr, STORE_STATE: tl.constexpr, CARRY_BOUND: tl.constexpr, CARRY_SEARCH: tl.constexpr,
    PDL: tl.constexpr = False,
    timeline_ptr=None, TIMELINE: tl.constexpr = False, SIGNAL_READY: tl.constexpr = False,
    LEAN_GATHER: tl.constexpr = False,
):
    """One program per row. ``STREAM``: the program computes the group maxima itself (else an earlier
    launch of ``_split_group_max_kernel`` stored them). The program gathers the candidates and emits the row,
    or, with ``STORE_STATE`` (gather launch), stops after the compaction of the qualifying group ids:
    the bound, its kind, the row's largest key and the number of qualifying groups go to the row's state words
    at ``state_ptr + row * state_stride`` for ``_row_pieces_kernel``, and the look-back flags of the row's gather
    pieces are cleared; with ``SIGNAL_READY`` (``pieces_ready_max_rows``) the row's ``_PIECE_READY`` word is then set
    (release) for the gather pieces, which wait on it instead of on this grid, and the next launch starts only
    after this grid's wait (``_wait_then_release_next_grid``). ``CARRY_BOUND`` / ``CARRY_SEARCH``: the counts
    (``reaching``) of the lower-bound search and of the candidates' search (``_select_and_emit``). ``PDL``:
    ``_wait_for_previous_grid``. ``TIMELINE``: ``stamp`` (``_TL_*``; gather piece i at ``_TL_ROW_PIECES + i``).
    ``LEAN_GATHER`` (``lean_gather``, GROUP 4 to 16): the gather by quads (``_gather_candidates``)."""
    TIMELINE_SLOTS: tl.constexpr = _TL_ROW_PIECES + GROUP_TILE // (STREAM_TILE // GROUP)
    stamp(timeline_ptr, tl.program_id(0), _TL_START, TIMELINE_SLOTS, TIMELINE)
    if SIGNAL_READY:
        _wait_then_release_next_grid(PDL)
    else:
        _wait_for_previous_grid(PDL)
    TILE_GROUPS: tl.constexpr = STREAM_TILE // GROUP
    row = tl.program_id(0)
    stamp(timeline_ptr, row, _TL_WAITED, TIMELINE_SLOTS, TIMELINE)
    start, length = _row_window(row, row >= 0, starts_ptr, ends_ptr, width, next_n, HAS_STARTS, ENDS_MODE)
    src_row = logits_ptr + row.to(tl.int64) * stride_row
    maxima_row = groups_ptr + row.to(tl.int64) * (2 * GROUP_TILE)
    ids_row = maxima_row + GROUP_TILE
    group_ids = tl.arange(0, TILE_GROUPS)  # [TILE_GROUPS]
    in_group = tl.arange(0, GROUP)[None, :]  # [1, GROUP]
    tile_columns = group_ids[:, None] * GROUP + in_group  # [TILE_GROUPS, GROUP]

    if STREAM:
        # Stream the row once, keeping the next tile's loads in flight while this one is reduced. Full
        # tiles are loaded under a mask that is uniform per tile (so the loads can be 16 bytes wide), the
        # last partial tile under the row's length.
        num_tiles = tl.cdiv(length, STREAM_TILE)
        full_end = length // STREAM_TILE * STREAM_TILE
        values = tl.load(src_row + (start + tile_columns).to(tl.int64) * stride_col, mask=tile_columns < full_end,
                         other=0.0)
        tile = num_tiles * 0
        while tile < num_tiles:
            columns = tile * STREAM_TILE + tile_columns
            next_columns = columns + STREAM_TILE
            next_values = tl.load(src_row + (start + next_columns).to(tl.int64) * stride_col,
                                  mask=next_columns < full_end, other=0.0)
            if tile * STREAM_TILE == full_end:
                values = tl.load(src_row + (start + columns).to(tl.int64) * stride_col, mask=columns < length,
                                 other=0.0)
            keys = order_keys(values, columns < length)
            tl.store(maxima_row + tile * TILE_GROUPS + group_ids, tl.max(keys, axis=1))
            values = next_values
            tile += 1
        tl.debug_barrier()

    # Lower bound: stop as soon as at most `enough` group maxima reach it (candidates >= bound), else
    # the exact k-th largest maximum (candidates > bound: fewer than k groups hold one).
    slots = tl.arange(0, GROUP_TILE)  # [GROUP_TILE]
    num_groups = tl.cdiv(length, GROUP)
    maxima = tl.load(maxima_row + slots, mask=slots < num_groups, other=NONE, cache_modifier=".cg")
    bound, inclusive, row_max = _maxima_lower_bound(maxima, k, enough, row, CARRY_BOUND)
    stamp(timeline_ptr, row, _TL_BOUND, TIMELINE_SLOTS, TIMELINE)
    num_qualifying = _compact_qualifying(maxima, slots, bound, inclusive, ids_row)
    stamp(timeline_ptr, row, _TL_COMPACTED, TIMELINE_SLOTS, TIMELINE)
    if STORE_STATE:
        _store_piece_state(state_ptr + row.to(tl.int64) * state_stride, bound, inclusive, row_max, num_qualifying)
        pieces = tl.arange(0, GROUP_TILE // TILE_GROUPS)  # at least the row's pieces
        num_pieces = tl.maximum(tl.cdiv(num_qualifying, TILE_GROUPS), 1)
        tl.store(state_ptr + row.to(tl.int64) * state_stride + _PIECE_FLAGS + pieces, tl.zeros_like(pieces),
                 mask=pieces < num_pieces)
        if SIGNAL_READY:
            tl.debug_barrier()  # every thread's id and state stores precede the release
            tl.atomic_xchg(state_ptr + row.to(tl.int64) * state_stride + _PIECE_READY, 1, sem="release",
                           scope="gpu")
    if not STORE_STATE:
        tl.debug_barrier()

        # Candidates of the qualifying groups, in column order (groups ascending, then columns in a group).
        cand_keys_row = cand_keys_ptr + row.to(tl.int64) * capacity
        cand_columns_row = cand_columns_ptr + row.to(tl.int64) * capacity
        ids = tl.load(ids_row + group_ids, mask=group_ids < num_qualifying, other=0, cache_modifier=".cg")
        num_candidates = _gather_candidates(src_row, start, stride_col, length, ids, ids_row, num_qualifying, bound,
                                            inclusive, cand_keys_row, cand_columns_row, row, timeline_ptr,
                                            TIMELINE_SLOTS, TILE_GROUPS, GROUP, LEAN_GATHER, TIMELINE)
        tl.debug_barrier()

        _select_and_emit(row, src_row, start, stride_col, length, k, bound, inclusive, row_max, num_candidates,
                         cand_keys_row, cand_columns_row, out_ptr, out_stride_row, out_stride_col, table_ptr,
                         table_stride_row, table_stride_col, table_blocks, block_size, rows_per_request, STREAM_TILE,
                         CANDIDATE_BLOCK, PAD_BLOCK, SLOTS, CARRY_SEARCH, timeline_ptr, row, TIMELINE_SLOTS, TIMELINE)


@triton.jit(do_not_specialize=["width", "k", "next_n", "state_stride", "capacity", "block_size", "table_blocks",
                               "rows_per_request"])
def _row_pieces_kernel(
    logits_ptr, stride_row, stride_col, starts_ptr, ends_ptr, out_ptr, out_stride_row, out_stride_col,
    groups_ptr, state_ptr, state_stride, cand_keys_ptr, cand_columns_ptr, capacity, width, k, next_n,
    table_ptr, table_stride_row, table_stride_col, table_blocks, block_size, rows_per_request,
    HAS_STARTS: tl.constexpr, ENDS_MODE: tl.constexpr, GROUP: tl.constexpr, GROUP_TILE: tl.constexpr,
    STREAM_TILE: tl.constexpr, CANDIDATE_BLOCK: tl.constexpr, MAX_PIECES: tl.constexpr, PAD_BLOCK: tl.constexpr,
    SLOTS: tl.constexpr, CARRY: tl.constexpr, PDL: tl.constexpr = False, timeline_ptr=None,
    TIMELINE: tl.constexpr = False, WAIT_READY: tl.constexpr = False, LEAN_GATHER: tl.constexpr = False,
):
    """Gather launch of row programs: program ``row * MAX_PIECES + piece`` re-reads the qualifying groups
    ``[piece * TILE_GROUPS, (piece + 1) * TILE_GROUPS)`` of its row (ids and bound from the row program
    stage before), publishes its number of candidates + 1 in its flag (the row's state word of the piece, cleared
    by the row program), sums the flags of the row's lower pieces (decoupled look-back, as the split path's chunks)
    and stores its candidates in column order at that offset in the row's buffer (``capacity`` slots). The row's
    last piece program to finish (an acq_rel arrival counter) runs ``_select_and_emit`` (with ``CARRY``) on the
    buffer in place. A row without qualifying groups still runs piece 0 (nothing gathered), which pads. ``PDL``:
    ``_wait_for_previous_grid``; with ``WAIT_READY`` (``pieces_ready_max_rows``) a program lets the next launch start
    and waits only for its own row's ``_PIECE_READY`` word (acquire), set by its row program, instead of the
    whole row-program grid: the rows whose programs finish early gather early. ``TIMELINE``: ``stamp``
    (``_TL_*``; "waited" after the row's word). ``LEAN_GATHER`` (``lean_gather``, GROUP 4 to 16): the piece by
    quads (``_gather_quads``, ``_compact_quads``)."""
    stamp(timeline_ptr, tl.program_id(0), _TL_START, _TL_PIECE_SLOTS, TIMELINE)
    TILE_GROUPS: tl.constexpr = STREAM_TILE // GROUP
    pid = tl.program_id(0)
    row = pid // MAX_PIECES
    piece = pid % MAX_PIECES
    state_row = state_ptr + row.to(tl.int64) * state_stride
    if WAIT_READY:
        if PDL:
            gdc_launch_dependents()
        # The row programs all started before this grid (they release it after their own wait), so none waits
        # on a program of this grid: the spin ends.
        ready = tl.atomic_add(state_row + _PIECE_READY, 0, sem="acquire", scope="gpu")
        while ready == 0:
            ready = tl.atomic_add(state_row + _PIECE_READY, 0, sem="acquire", scope="gpu")
    else:
        _wait_for_previous_grid(PDL)
    stamp(timeline_ptr, pid, _TL_WAITED, _TL_PIECE_SLOTS, TIMELINE)
    start, length = _row_window(row, row >= 0, starts_ptr, ends_ptr, width, next_n, HAS_STARTS, ENDS_MODE)
    num_qualifying = tl.load(state_row + _PIECE_QUALIFYING)
    num_pieces = tl.maximum(tl.cdiv(num_qualifying, TILE_GROUPS), 1)
    if piece < num_pieces:
        bound = tl.load(state_row + _PIECE_BOUND)
        inclusive = tl.load(state_row + _PIECE_INCLUSIVE)
        src_row = logits_ptr + row.to(tl.int64) * stride_row
        ids_row = groups_ptr + row.to(tl.int64) * (2 * GROUP_TILE) + GROUP_TILE
        group_ids = tl.arange(0, TILE_GROUPS)  # [TILE_GROUPS]
        piece_first = piece * TILE_GROUPS
        ids = tl.load(ids_row + piece_first + group_ids, mask=piece_first + group_ids < num_qualifying, other=0)
        flags_row = state_row + _PIECE_FLAGS
        cand_keys_row = cand_keys_ptr + row.to(tl.int64) * capacity
        cand_columns_row = cand_columns_ptr + row.to(tl.int64) * capacity
        quad0, quad1, quad2, quad3 = _gather_loaded(src_row, start, stride_col, ids, piece_first, num_qualifying,
                                                    length, TILE_GROUPS, GROUP, LEAN_GATHER)
        _compact_loaded(quad0, quad1, quad2, quad3, ids, piece_first, num_qualifying, length, bound, inclusive,
                        piece * 0, cand_keys_row, cand_columns_row, flags_row, piece, TILE_GROUPS, GROUP,
                        GROUP_TILE // TILE_GROUPS, LEAN_GATHER)
        stamp(timeline_ptr, pid, _TL_GATHERED, _TL_PIECE_SLOTS, TIMELINE)
        tl.debug_barrier()
        arrived = tl.atomic_add(state_row + _PIECE_ARRIVED, 1, sem="acq_rel", scope="gpu")
        stamp(timeline_ptr, pid, _TL_ARRIVED, _TL_PIECE_SLOTS, TIMELINE)
        if arrived == num_pieces - 1:
            # Every piece published its flag before arriving: their sum is the number of candidates, which lie in
            # column order in the row's buffer.
            every = tl.arange(0, GROUP_TILE // TILE_GROUPS)
            flags = tl.load(flags_row + every, mask=every < num_pieces, other=1, volatile=True)
            stamp(timeline_ptr, pid, _TL_COUNTED, _TL_PIECE_SLOTS, TIMELINE)
            row_max = tl.load(state_row + _PIECE_ROW_MAX)
            _select_and_emit(row, src_row, start, stride_col, length, k, bound, inclusive, row_max,
                             tl.sum(flags - 1, axis=0), cand_keys_row, cand_columns_row, out_ptr, out_stride_row,
                             out_stride_col, table_ptr, table_stride_row, table_stride_col, table_blocks, block_size,
                             rows_per_request, STREAM_TILE, CANDIDATE_BLOCK, PAD_BLOCK, SLOTS, CARRY, timeline_ptr,
                             pid, _TL_PIECE_SLOTS, TIMELINE)


@triton.jit(do_not_specialize=["num_requests", "table_blocks", "k", "block_size"])
def _indices_to_slots_kernel(
    indices_ptr, idx_stride_row, idx_stride_col, table_ptr, table_stride_row, table_stride_col, num_requests,
    table_blocks, request_ptr, out_ptr, k, block_size, BLOCK: tl.constexpr, ALIGNED_ROWS: tl.constexpr,
):
    """Grid ``(R, cdiv(k, BLOCK))``. ``ALIGNED_ROWS`` (``k % 4 == 0``): programs whose ``BLOCK``
    positions all lie inside the row run unmasked, with the output row offset written as a multiple
    of 4 the compiler can see, so indices and slots move as 16-byte loads and stores. A request outside
    ``[0, num_requests)`` reads no table row and gives ``-1`` slots."""
    row = tl.program_id(0).to(tl.int64)
    position = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    index_row = indices_ptr + row * idx_stride_row
    request = tl.load(request_ptr + row).to(tl.int64)
    known = (request >= 0) & (request < num_requests)
    table_row = table_ptr + tl.where(known, request, 0) * table_stride_row
    if ALIGNED_ROWS and ((tl.program_id(1) + 1) * BLOCK <= k):
        index = tl.load(index_row + position.to(tl.int64) * idx_stride_col)  # [BLOCK]
        slot = _column_slots(table_row, index, known & (index >= 0), table_stride_col, table_blocks, block_size)
        tl.store(out_ptr + row * ((k // 4) * 4) + position, slot)
    else:
        in_row = position < k
        index = tl.load(index_row + position.to(tl.int64) * idx_stride_col, mask=in_row, other=-1)  # [BLOCK]
        slot = _column_slots(table_row, index, known & in_row & (index >= 0), table_stride_col, table_blocks,
                             block_size)
        tl.store(out_ptr + row * k + position, slot, mask=in_row)


def _bounds_args(starts: torch.Tensor | None, ends: torch.Tensor | None, decode: bool, logits: torch.Tensor):
    has_starts = starts is not None
    ends_mode = 2 if decode else (1 if ends is not None else 0)
    starts_arg = starts.contiguous() if has_starts else logits
    ends_arg = ends.contiguous() if ends is not None else logits
    return starts_arg, ends_arg, dict(HAS_STARTS=has_starts, ENDS_MODE=ends_mode)


def _slot_args(slots, logits):
    """Kernel arguments of the slot output: ``slots = (block_table, block_size, rows_per_request)`` or None."""
    if slots is None:
        return (logits, 0, 0, 0, 1, 1), dict(SLOTS=False)
    table, block_size, rows_per_request = slots
    return (table, table.stride(0), table.stride(1), table.shape[1], block_size, rows_per_request), dict(SLOTS=True)


def _pdl_args(config, device):
    """Launch arguments of ``config.pdl`` (``_wait_for_previous_grid``) on ``device``; none under the interpreter,
    which cannot run inline PTX, and none before sm_90 or on ROCm (no ``griddepcontrol`` there)."""
    if not config.pdl or interpreting() or torch.version.hip is not None:
        return {}
    if capability(device)[0] < 9:
        return {}
    return dict(PDL=True, launch_pdl=True)


def _launch_rows(logits, k, bounds, out, next_n, bounds_flags, slot_args, config):
    """Whole rows: one launch per register tile, widest first (``row_tiles``), each keeping the rows of its width
    class; a single tile takes one unclassed launch."""
    num_rows, width = logits.shape
    block = max(16, next_pow2(width))
    tiles = max(1, min(config.row_tiles, 4))
    while tiles > 1 and block >> (tiles - 1) < 16:
        tiles -= 1
    # The interpreter cannot run inline PTX: it takes the plain comparison (same counts).
    search = dict(CARRY=not interpreting(), PLATEAU_EVERY=config.row_plateau_every)
    common = dict(PAD_BLOCK=_PAD_BLOCK, **search, **bounds_flags, **slot_args[1],
                  **_pdl_args(config, logits.device))
    if tiles == 1:
        _launch_row_tile(logits, k, bounds, out, next_n, slot_args, block, config.row_elements, config.row_warps,
                         config.row_max_registers, -1, width, dict(CLASSED=False, **common))
        return
    for tile_index in range(tiles):
        tile = block >> tile_index
        narrow = tile_index > 0
        elements = config.row_narrow_elements if narrow else config.row_elements
        warps_max = config.row_narrow_warps if narrow else config.row_warps
        class_above = -1 if tile_index == tiles - 1 else tile // 2
        registers = None if narrow else config.row_max_registers
        _launch_row_tile(logits, k, bounds, out, next_n, slot_args, tile, elements, warps_max, registers,
                         class_above, tile, dict(CLASSED=True, **common))


def _launch_row_tile(logits, k, bounds, out, next_n, slot_args, block, elements, warps_max, max_registers,
                     class_above, class_upto, flags):
    """One launch of ``_topk_row_kernel`` with ``BLOCK = block`` and ``elements // block`` rows per program."""
    num_rows, width = logits.shape
    rows = min(16, max(1, elements // block))
    warps = max(1, min(warps_max, rows * block // 256))
    registers = {} if max_registers is None else dict(maxnreg=max_registers)
    # Carry counts summed by 4 in the asm need one row per program and 4k elements per thread.
    carry = 0 if not flags["CARRY"] else (carry_mode(block, 32 * warps) if rows == 1 else 1)
    _topk_row_kernel[(triton.cdiv(num_rows, rows),)](
        logits, logits.stride(0), logits.stride(1), *bounds, out, out.stride(0), out.stride(1),
        num_rows, width, k, next_n, *slot_args[0], class_above, class_upto, ROWS=rows, BLOCK=block,
        num_warps=warps, **registers, **{**flags, "CARRY": carry},
    )


def _launch_split(logits, k, bounds, out, next_n, bounds_flags, slot_args, config):
    num_rows, width = logits.shape
    chunk = config.chunk
    num_chunks = triton.cdiv(width, chunk)
    group_tile_max = config.group_tile or min(8192, max(1024, next_pow2(4 * k)))
    group = 1
    while num_chunks * chunk // group > group_tile_max:
        group *= 2
    if group > chunk:
        raise ValueError(f"logits width {width} is too large for the top-k split path (chunk {chunk})")
    group_tile = next_pow2(num_chunks * chunk // group)
    candidate_block = config.candidate_block or min(16384, max(1024, next_pow2(2 * k)))
    enough = k + int(k * config.bound_slack)
    capacity = max(1, min(max(enough, k - 1) * group, width))
    flag_tile = next_pow2(num_chunks)
    state_stride = _STATE_WORDS + flag_tile
    device = logits.device
    state = torch.empty((num_rows, state_stride), dtype=torch.int32, device=device)
    group_max = torch.empty((num_rows, group_tile), dtype=torch.int32, device=device)
    cand_keys = torch.empty((num_rows, capacity), dtype=torch.int32, device=device)
    cand_columns = torch.empty_like(cand_keys)
    grid = (num_rows * num_chunks,)
    rows_args = (logits, logits.stride(0), logits.stride(1), *bounds)
    warps = config.split_warps
    _split_group_max_kernel[grid](
        *rows_args, group_max, state, state_stride, width, next_n, num_chunks, CHUNK=chunk, GROUP=group,
        MAXIMA_STRIDE=group_tile, CLEAR_STATE=True, num_warps=warps, **bounds_flags,
    )
    _split_candidates_kernel[grid](
        *rows_args, group_max, cand_keys, cand_columns, capacity, state, state_stride, width, k, next_n, num_rows,
        num_chunks, enough, out, out.stride(0), out.stride(1), *slot_args[0], CHUNK=chunk, GROUP=group,
        GROUP_TILE=group_tile, CANDIDATE_BLOCK=candidate_block, CARRY=carry_mode(candidate_block, 32 * warps),
        CARRY_BOUND=carry_mode(group_tile, 32 * warps), FLAG_TILE=flag_tile, PAD_BLOCK=_PAD_BLOCK, num_warps=warps,
        **bounds_flags, **slot_args[1],
    )


def _launch_row_programs(logits, k, bounds, out, next_n, bounds_flags, slot_args, config, pieces, timeline=None):
    """One program per row (``stream_warps`` warps, ``stream_tile``-column steps), after a maxima launch; with
    ``pieces`` the gather goes to a launch of one program per gather piece (``pieces_warps``, ``pieces_tile``)."""
    num_rows, width = logits.shape
    stream_tile = config.pieces_tile if pieces else config.stream_tile
    columns = triton.cdiv(width, stream_tile) * stream_tile
    group_tile_max = config.group_tile or 8192
    group = 1
    while columns // group > group_tile_max:
        group *= 2
    if group > stream_tile:
        raise ValueError(f"logits width {width} is too large for the top-k row programs (stream tile {stream_tile})")
    group_tile = next_pow2(columns // group)
    enough = k + int(k * config.bound_slack)
    capacity = max(1, min(width, max(enough, k - 1) * group))
    candidate_block = config.candidate_block or min(16384, max(1024, next_pow2(2 * k)))
    device = logits.device
    groups = torch.empty((num_rows, 2 * group_tile), dtype=torch.int32, device=device)
    stream = not (group <= config.chunk <= stream_tile)  # the row program streams the row itself
    row_ready = pieces and num_rows <= config.pieces_ready_max_rows and not stream
    lean = config.lean_gather and 4 <= group <= 16
    pdl = _pdl_args(config, logits.device)
    if pieces:
        max_pieces = triton.cdiv(min(max(enough, k - 1), group_tile), stream_tile // group)
        state = torch.empty((num_rows, _PIECE_STATE_WORDS + max_pieces), dtype=torch.int32, device=device)
    else:
        state = groups
    cand_keys = torch.empty((num_rows, capacity), dtype=torch.int32, device=device)
    cand_columns = torch.empty_like(cand_keys)
    if not stream:
        num_chunks = triton.cdiv(width, config.chunk)
        ready_state = (state, state.stride(0)) if row_ready else (groups, 0)  # the words the maxima launch clears
        _split_group_max_kernel[(num_rows * num_chunks,)](
            logits, logits.stride(0), logits.stride(1), *bounds, groups, *ready_state, width, next_n, num_chunks,
            CHUNK=config.chunk, GROUP=group, MAXIMA_STRIDE=2 * group_tile, CLEAR_STATE=False,
            CLEAR_READY=row_ready, num_warps=config.split_warps, **bounds_flags, **pdl,
            **timeline_args(timeline, "maxima", num_rows * num_chunks, _TL_MAXIMA_SLOTS.value, device),
        )
    warps = config.pieces_warps if pieces else config.stream_warps
    carry_search = carry_mode(candidate_block, 32 * warps)
    row_slots = _TL_ROW_PIECES.value + group_tile * group // stream_tile
    _row_program_kernel[(num_rows,)](
        logits, logits.stride(0), logits.stride(1), *bounds, out, out.stride(0), out.stride(1),
        groups, cand_keys, cand_columns, capacity, state, state.stride(0), width, k, next_n, enough, *slot_args[0],
        GROUP=group, GROUP_TILE=group_tile, STREAM_TILE=stream_tile, CANDIDATE_BLOCK=candidate_block,
        PAD_BLOCK=_PAD_BLOCK, STREAM=stream, STORE_STATE=pieces,
        CARRY_BOUND=carry_mode(group_tile, 32 * warps), CARRY_SEARCH=carry_search, SIGNAL_READY=row_ready,
        LEAN_GATHER=lean and not pieces, num_warps=warps,
        **bounds_flags, **slot_args[1], **pdl, **timeline_args(timeline, "rows", num_rows, row_slots, device),
    )
    if pieces:
        registers = {} if config.pieces_max_registers is None else dict(maxnreg=config.pieces_max_registers)
        _row_pieces_kernel[(num_rows * max_pieces,)](
            logits, logits.stride(0), logits.stride(1), *bounds, out, out.stride(0), out.stride(1),
            groups, state, state.stride(0), cand_keys, cand_columns, capacity, width, k, next_n, *slot_args[0],
            GROUP=group, GROUP_TILE=group_tile, STREAM_TILE=stream_tile, CANDIDATE_BLOCK=candidate_block,
            MAX_PIECES=max_pieces, PAD_BLOCK=_PAD_BLOCK, CARRY=carry_search, WAIT_READY=row_ready,
            LEAN_GATHER=lean, num_warps=warps,
            **registers, **bounds_flags, **slot_args[1], **pdl,
            **timeline_args(timeline, "pieces", num_rows * max_pieces, _TL_PIECE_SLOTS.value, device),
        )


def _launch(logits, k, starts, ends, out, next_n, decode, config, slots=None, timeline=None):
    num_rows, width = logits.shape
    if num_rows == 0:
        return out
    starts_arg, ends_arg, bounds_flags = _bounds_args(starts, ends, decode, logits)
    args = (logits, k, (starts_arg, ends_arg), out, next_n, bounds_flags, _slot_args(slots, logits), config)
    path = topk_path(config, num_rows, width)
    if path == ROWS:
        _launch_rows(*args)
    elif path == SPLIT:
        _launch_split(*args)
    else:
        _launch_row_programs(*args, pieces=path == ROW_PIECES, timeline=timeline)
    return out


def _topk_timeline(logits, k, ends, out, timeline, *, config=DEFAULT_CONFIG):
    """``topk_triton(logits, k, None, ends, out)`` on the row-program paths with the phase timeline on (a timing probe
    for benchmarks and tests, GPU only: inline PTX): ``timeline`` (a dict) receives or reuses int64 buffers of global
    timer stamps (ns), ``"maxima"`` ``[programs, _TL_MAXIMA_SLOTS]``, ``"rows"`` ``[rows, _TL_ROW_PIECES + pieces]``
    and, with the gather launch, ``"pieces"`` ``[programs, _TL_PIECE_SLOTS]`` (words ``_TL_*``; 0 where a program
    did not reach the phase). Other paths are refused."""
    if topk_path(config, *logits.shape) not in (ROW_PIECES, ROW_PROGRAMS):
        raise ValueError("the phase timeline covers the row-program paths only")
    return _launch(logits, k, None, ends, out, 1, False, config, timeline=timeline)


def topk_triton(
    logits: torch.Tensor,
    k: int,
    starts: torch.Tensor | None,
    ends: torch.Tensor | None,
    out: torch.Tensor,
    *,
    config: TopkConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """Twin of ``reference.topk``: exact per-row top-k of ``logits [R, C]`` into ``out [R, k]``."""
    return _launch(logits, k, starts, ends, out, 1, False, config)


def topk_decode_triton(
    logits: torch.Tensor,
    seq_lens: torch.Tensor,
    next_n: int,
    k: int,
    out: torch.Tensor,
    *,
    config: TopkConfig = DEFAULT_CONFIG,
    slots: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Twin of ``reference.topk_decode``; row lengths are computed from ``seq_lens`` on the device. With
    ``slots = (block_table, block_size)`` the rows' picks are written as cache slots (the twin of
    ``reference.topk_decode`` followed by ``reference.indices_to_slots``), in the same launch."""
    fused = None if slots is None else (*slots, next_n)
    if seq_lens.dim() == 2:
        return _launch(logits, k, None, seq_lens.reshape(-1), out, 1, False, config, fused)
    return _launch(logits, k, None, seq_lens, out, next_n, True, config, fused)


def indices_to_slots_triton(
    indices: torch.Tensor, block_table: torch.Tensor, block_size: int, row_to_request: torch.Tensor,
) -> torch.Tensor:
    """Twin of ``reference.indices_to_slots``: ``block_table[request, p // bs] * bs + p % bs``, ``-1`` kept.
    ``_SLOT_BLOCK`` positions per program of ``_SLOT_WARPS`` warps; 16-byte slot stores when ``k % 4 == 0``."""
    num_rows, k = indices.shape
    slots = torch.empty((num_rows, k), dtype=torch.int32, device=indices.device)
    if num_rows == 0 or k == 0:
        return slots
    _indices_to_slots_kernel[(num_rows, triton.cdiv(k, _SLOT_BLOCK))](
        indices, indices.stride(0), indices.stride(1), block_table, block_table.stride(0), block_table.stride(1),
        block_table.shape[0], block_table.shape[1], row_to_request.contiguous(), slots, k, block_size, BLOCK=_SLOT_BLOCK,
        ALIGNED_ROWS=k % 4 == 0, num_warps=_SLOT_WARPS,
    )
    return slots
