"""Triton kernels of the V4.1 candidate blocks (twins of ``reference.py``).

``select_candidate_blocks`` ranks each row's blocks by their maximum, as uint32 order images (top-k's order keys
xor ``NONE``, ``ops/common/selection.py``), and keeps the ``num_blocks_k`` best in id order with the newest block
pinned. ``select_plan`` picks the kernel: one launch for rows of at most ``fused_max_blocks`` blocks (one
program per row, or ``split_pieces`` streaming programs per row of which the last to finish selects), else a
block-keys launch and a radix select. The one-launch searches interpolate four counted probes a round, the first
placed by the row's moments. ``apply_candidate_mask`` writes ``-inf`` outside the listed blocks without reading
the logits. ``SelectConfig`` / ``MaskConfig`` class defaults are what ships. The derivations and the measured
choices are in ``README.md`` next to this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..common.runtime import interpreting, sm_count
from ..common.selection import KEY_MAX, LOW_FIELD, NONE, carry_mode, reaches_unsigned, row_bounds, stamp, timeline_args

INF_IMAGE = tl.constexpr(0xFF800000)  # order image of +inf (topk's key of +inf ^ NONE)

_SELECT_CHUNK = 4096
_SELECT_WARPS = 8
_RADIX_BITS = 8
_SELECT_MAX_REGISTERS = 128  # 8 warps: two selection programs per SM (uncapped, ptxas takes 165: one)
_FUSED_MAX_BLOCKS = 16384  # 32 images per thread of 16 warps; the search packs two counts per int32 (< 2**15 each)
_FUSED_WARPS = 16  # 128 registers, one program per SM
_SPLIT_MAX_REGISTERS = 80  # three split-select programs per SM: a selecting one beside streaming ones
_PAD_BLOCK = 1024


@dataclass(frozen=True)
class SelectConfig:
    """Tuning of ``select_candidate_blocks``; the class defaults are what ships (tests shrink the sizes to reach
    every path with tiny shapes). ``select_plan`` picks the kernel of a call.

    fused_max_blocks: rows of at most this many blocks (padded to a power of two; at most ``_FUSED_MAX_BLOCKS``)
        take one launch, wider rows the two launches (``block_keys`` then ``select_from_keys``).
    fused_step: logits per streaming step of the fused kernel; blocks wider than it take the two launches.
    split_min_rows: calls of at least this many rows take the split select.
    split_pieces: programs per row of the split select (a power of two), also taken by calls whose pieces all
        fit one wave (one program per SM); 0: never.
    split_warps, split_chunk, split_step: the split select's warps, images re-read per chunk by the selecting
        program, and logits per streaming step.
    moment_sample: images (a power of two) whose moments place the split select's first probes.
    keys_tile: positions per program of ``block_keys``.
    """

    fused_max_blocks: int = _FUSED_MAX_BLOCKS
    fused_step: int = 16384
    split_min_rows: int = 256
    split_pieces: int = 4
    split_warps: int = 8
    split_chunk: int = 2048
    split_step: int = 8192
    moment_sample: int = 256
    keys_tile: int = 8192

    def __post_init__(self):
        if self.moment_sample < 1 or self.moment_sample & (self.moment_sample - 1):
            raise ValueError(f"moment_sample must be a power of two, got {self.moment_sample}")
        if self.fused_max_blocks > _FUSED_MAX_BLOCKS:
            raise ValueError(f"fused_max_blocks must be at most {_FUSED_MAX_BLOCKS}, got {self.fused_max_blocks}")


@dataclass(frozen=True)
class MaskConfig:
    """Tuning of ``apply_candidate_mask``; the class defaults are what ships.

    tile: positions per mask tile.
    fused_flags_min_rows: calls of at least this many rows run one mask program per row that builds its own flags
        (one launch); below, a memset and ``_candidate_flags_kernel`` fill the flags and the mask programs share
        each row's tiles.
    target_programs: about this many mask programs in all on the unfused path (a few per row).
    """

    tile: int = 2048
    fused_flags_min_rows: int = 256
    target_programs: int = 1024


DEFAULT_SELECT = SelectConfig()
DEFAULT_MASK = MaskConfig()


def select_plan(config: SelectConfig, num_rows: int, width: int, block_size: int, sms: int) -> int | None:
    """The select kernel of a call: ``None`` for the two launches (rows wider than ``fused_max_blocks`` blocks or
    blocks wider than ``fused_step``), else the split select's pieces per row from ``split_min_rows`` rows on and
    when every row's pieces fit one program per SM (``sms``), else 0 (the fused kernel, one program per row)."""
    padded_blocks = triton.next_power_of_2(max(triton.cdiv(width, block_size), 1))
    if padded_blocks > config.fused_max_blocks or triton.next_power_of_2(block_size) > config.fused_step:
        return None
    if num_rows >= config.split_min_rows or num_rows * config.split_pieces <= sms:
        return config.split_pieces
    return 0


# Phase timeline of the split select (topk's ``stamp``, a timing probe, off by default): global-timer stamps per
# program at its start and its arrival; the selecting program's also after the bounds pass, at the search's first
# round (its start, its end), after the search and the emit, and its search's round count (a number, not a time).
_TL_START = tl.constexpr(0)
_TL_ARRIVED = tl.constexpr(1)
_TL_BOUNDS = tl.constexpr(2)
_TL_SEARCHED = tl.constexpr(3)
_TL_EMITTED = tl.constexpr(4)
_TL_ROUNDS = tl.constexpr(5)
_TL_FIRST_ROUND_START = tl.constexpr(6)
_TL_FIRST_ROUND_END = tl.constexpr(7)
_TL_SLOTS = tl.constexpr(8)


@triton.jit
def _pad_after_taken(out_row, out_stride_col, totals, ties, num_blocks_k, PAD_BLOCK: tl.constexpr):
    """Stores ``-1`` in the slots ``[taken, num_blocks_k)`` of one output row, ``taken`` being the blocks above
    ``T`` (low field of ``totals``) plus the ties taken (at most ``ties`` of the high field)."""
    taken = (totals & LOW_FIELD) + tl.minimum(totals >> 16, ties)
    first = (taken // PAD_BLOCK) * PAD_BLOCK
    while first < num_blocks_k:
        slot = first + tl.arange(0, PAD_BLOCK)  # [PAD_BLOCK]
        tl.store(out_row + slot.to(tl.int64) * out_stride_col, tl.full([PAD_BLOCK], -1, tl.int32),
                 mask=(slot >= taken) & (slot < num_blocks_k))
        first += PAD_BLOCK


@triton.jit
def _pick_bin(hist, bins, remaining):
    """The bin holding the ``remaining``-th largest counted key of ``hist`` [BINS], the count above
    it and the count in it."""
    at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # [BINS] keys with digit >= bin
    chosen = tl.max(tl.where(at_least >= remaining, bins, 0), axis=0)
    above = tl.sum(tl.where(bins > chosen, hist, 0), axis=0)
    in_bin = tl.sum(tl.where(bins == chosen, hist, 0), axis=0)
    return chosen, above, in_bin


@triton.jit(do_not_specialize=["row_repeat", "width"])
def _block_keys_kernel(
    logits_ptr, starts_ptr, ends_ptr, keys_ptr,
    row_repeat, width, stride_row, stride_col, keys_stride,
    HAS_STARTS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_J: tl.constexpr,
    VECTOR: tl.constexpr,
):
    """``VECTOR`` (only with unit column stride): a tile wholly inside a row whose start is a multiple
    of 4 is read unmasked from a base the compiler knows to be 4-aligned, i.e. with 16-byte loads;
    other tiles take the masked scalar path."""
    row = tl.program_id(0).to(tl.int64)
    start, length = row_bounds(starts_ptr, ends_ptr, row, row_repeat, width, HAS_STARTS)
    num_blocks = (length + BLOCK_SIZE - 1) // BLOCK_SIZE
    first_block = tl.program_id(1).to(tl.int64) * BLOCK_NB
    blocks = first_block + tl.arange(0, BLOCK_NB)  # [BLOCK_NB]
    best = tl.full([BLOCK_NB], float("-inf"), tl.float32)
    row_ptr = logits_ptr + row * stride_row
    if VECTOR and (start % 4 == 0) and ((first_block + BLOCK_NB) * BLOCK_SIZE <= length):
        aligned_start = (start // 4) * 4  # == start; the product tells the compiler it is 4-aligned
        for first in tl.static_range(0, BLOCK_SIZE, BLOCK_J):
            inner = first + tl.arange(0, BLOCK_J)  # [BLOCK_J]
            pos = blocks[:, None] * BLOCK_SIZE + inner[None, :]  # [BLOCK_NB, BLOCK_J] row-relative
            if BLOCK_J <= BLOCK_SIZE - first:
                values = tl.load(row_ptr + aligned_start + pos)
            else:
                values = tl.load(row_ptr + aligned_start + pos, mask=(inner < BLOCK_SIZE)[None, :],
                                 other=float("-inf"))
            values = tl.where(values != values, float("-inf"), values)
            best = tl.maximum(best, tl.max(values, axis=1))
    else:
        for first in tl.static_range(0, BLOCK_SIZE, BLOCK_J):
            inner = first + tl.arange(0, BLOCK_J)  # [BLOCK_J]
            pos = blocks[:, None] * BLOCK_SIZE + inner[None, :]  # [BLOCK_NB, BLOCK_J] row-relative
            ok = (inner[None, :] < BLOCK_SIZE) & (pos < length)
            values = tl.load(row_ptr + (start + pos) * stride_col, mask=ok, other=float("-inf"))
            values = tl.where(values != values, float("-inf"), values)
            best = tl.maximum(best, tl.max(values, axis=1))
    bits = best.to(tl.uint32, bitcast=True)  # [BLOCK_NB]
    bits = tl.where(bits == 0x80000000, 0, bits)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    key = tl.where(best == float("-inf"), 0, key)
    key = tl.where(blocks == num_blocks - 1, 0xFF800000, key)
    tl.store(keys_ptr + row * keys_stride + blocks, key.to(tl.int32, bitcast=True), mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["row_repeat", "width", "num_blocks_k"])
def _select_kernel(
    keys_ptr, cand_ptr, starts_ptr, ends_ptr, out_ptr,
    row_repeat, width, num_blocks_k, keys_stride, out_stride_row, out_stride_col,
    HAS_STARTS: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr, RADIX_BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    _, length = row_bounds(starts_ptr, ends_ptr, row, row_repeat, width, HAS_STARTS)
    num_blocks = (length + BLOCK_SIZE - 1) // BLOCK_SIZE
    row_keys = keys_ptr + row * keys_stride
    row_cand = cand_ptr + row * keys_stride
    BINS: tl.constexpr = 1 << RADIX_BITS
    TOP_SHIFT: tl.constexpr = 32 - RADIX_BITS
    bins = tl.arange(0, BINS)  # [BINS]
    lanes = tl.arange(0, CHUNK)  # [CHUNK]
    hist = tl.zeros([BINS], dtype=tl.int32)
    first = num_blocks * 0
    while first < num_blocks:
        idx = first + lanes  # [CHUNK]
        keys = tl.load(row_keys + idx, mask=idx < num_blocks, other=0).to(tl.uint32, bitcast=True)
        hist += tl.histogram((keys >> TOP_SHIFT).to(tl.int32), BINS, mask=keys != 0)
        first += CHUNK
    taken = tl.minimum(tl.sum(hist, axis=0).to(tl.int64), num_blocks_k)
    chosen, above, in_bin = _pick_bin(hist, bins, taken)
    prefix = chosen.to(tl.uint32)
    shift = (num_blocks * 0 + TOP_SHIFT).to(tl.uint32)
    remaining = taken - above
    searching = (taken > 0) & (in_bin != remaining)
    num_cand = num_blocks * 0
    first = num_blocks * 0
    while searching & (first < num_blocks):
        idx = first + lanes  # [CHUNK]
        keys = tl.load(row_keys + idx, mask=idx < num_blocks, other=0).to(tl.uint32, bitcast=True)
        match = (keys != 0) & ((keys >> TOP_SHIFT) == prefix)
        slot = num_cand + tl.cumsum(match.to(tl.int32), axis=0) - match.to(tl.int32)
        tl.store(row_cand + slot, keys.to(tl.int32, bitcast=True), mask=match)
        num_cand += tl.sum(match.to(tl.int32), axis=0)
        first += CHUNK
    tl.debug_barrier()
    for p in tl.static_range(1, 32 // RADIX_BITS):
        pass_shift = 32 - RADIX_BITS * (p + 1)
        hist = tl.zeros([BINS], dtype=tl.int32)
        first = num_blocks * 0
        while searching & (first < num_cand):
            idx = first + lanes  # [CHUNK]
            keys = tl.load(row_cand + idx, mask=idx < num_cand, other=0).to(tl.uint32, bitcast=True)
            match = (idx < num_cand) & ((keys >> (pass_shift + RADIX_BITS)) == prefix)
            digit = ((keys >> pass_shift) & (BINS - 1)).to(tl.int32)
            hist += tl.histogram(digit, BINS, mask=match)
            first += CHUNK
        chosen, above, in_bin = _pick_bin(hist, bins, remaining)
        prefix = tl.where(searching, (prefix << RADIX_BITS) | chosen.to(tl.uint32), prefix)
        shift = tl.where(searching, pass_shift, shift)
        remaining = tl.where(searching, remaining - above, remaining)
        searching = searching & (in_bin != remaining)
    out_row = out_ptr + row * out_stride_row
    written = num_blocks * 0
    ties_seen = num_blocks * 0
    first = num_blocks * 0
    while (first < num_blocks) & (written < taken):
        idx = first + lanes  # [CHUNK]
        keys = tl.load(row_keys + idx, mask=idx < num_blocks, other=0).to(tl.uint32, bitcast=True)
        high = keys >> shift
        tie = (keys != 0) & (high == prefix)
        tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - tie.to(tl.int32)
        pick = (keys != 0) & ((high > prefix) | (tie & (tie_rank < remaining)))
        slot = written + tl.cumsum(pick.to(tl.int32), axis=0) - pick.to(tl.int32)
        tl.store(out_row + slot * out_stride_col, idx.to(tl.int32), mask=pick)
        written += tl.sum(pick.to(tl.int32), axis=0)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)
        first += CHUNK
    first = taken
    while first < num_blocks_k:
        slot = first + lanes  # [CHUNK]
        tl.store(out_row + slot * out_stride_col, tl.full([CHUNK], -1, tl.int32), mask=slot < num_blocks_k)
        first += CHUNK


@triton.jit
def _step_values(row_ptr, first_column, stride_col, blocks, readable, BLOCK_SIZE: tl.constexpr,
                 BLOCK_J: tl.constexpr, UNIT_STRIDE: tl.constexpr):
    """fp32 logits ``[STEP_NB, BLOCK_J]`` of ``blocks`` [STEP_NB] (``-inf`` past ``readable`` and past
    the block). With ``UNIT_STRIDE`` and a 4-aligned ``first_column`` the mask is constant over each
    block's ``BLOCK_SIZE`` (a multiple of 4) columns, so the loads are 16 bytes wide. The loads carry an
    evict-first L2 hint (the logits are read once)."""
    inner = tl.arange(0, BLOCK_J)  # [BLOCK_J]
    pos = blocks[:, None] * BLOCK_SIZE + inner[None, :]  # [STEP_NB, BLOCK_J] row-relative
    if BLOCK_J == BLOCK_SIZE:
        ok = tl.broadcast_to((blocks < readable)[:, None], [blocks.shape[0], BLOCK_J])
    else:
        ok = (blocks < readable)[:, None] & (inner < BLOCK_SIZE)[None, :]
    if UNIT_STRIDE:
        return tl.load(row_ptr + first_column + pos, mask=ok, other=float("-inf"), eviction_policy="evict_first")
    return tl.load(row_ptr + (first_column + pos) * stride_col, mask=ok, other=float("-inf"),
                   eviction_policy="evict_first")


@triton.jit
def _max_images(values):
    """uint32 order images of the row maxima of ``values`` [STEP_NB, BLOCK_J]: topk's order key ``^ NONE``
    (unsigned order = value order), 0 when no entry is selectable (NaN and ``-inf`` only). ``tl.max`` skips NaN
    operands (PTX ``max.f32`` on the GPU, ``np.nanmax`` in Triton's CPU interpreter), so only a block of NaN alone
    gives NaN, mapped once per block (about 2 instructions a logit fewer than masking every NaN before the
    maximum)."""
    best = tl.max(values, axis=1)  # [STEP_NB]
    best = tl.where(best != best, float("-inf"), best)
    bits = best.to(tl.int32, bitcast=True)
    bits = tl.where(bits == NONE, 0, bits)  # -0.0 ranks as +0.0
    image = bits ^ ((bits >> 31) | NONE)  # negative: all bits flipped; else the sign bit set
    return tl.where(best == float("-inf"), 0, image).to(tl.uint32, bitcast=True)


@triton.jit
def _stream_row_images(images, row_ptr, first_column, stride_col, readable, STEPS: tl.constexpr,
                       STEP_NB: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_J: tl.constexpr,
                       UNIT_STRIDE: tl.constexpr):
    """``images [STEPS, STEP_NB]`` (block ``s * STEP_NB + j`` at ``[s, j]``) with the block images of the
    row's readable blocks. The next step's loads are issued before the current step is reduced (two steps
    of logits in registers), so they are in flight across the step's layout-conversion barrier (4 % faster than
    loading after the reduce)."""
    step_ids = tl.arange(0, STEPS)  # [STEPS]
    lanes = tl.arange(0, STEP_NB)  # [STEP_NB]
    values = _step_values(row_ptr, first_column, stride_col, lanes, readable, BLOCK_SIZE, BLOCK_J, UNIT_STRIDE)
    for s in tl.static_range(STEPS):
        if s + 1 < STEPS:
            following = _step_values(row_ptr, first_column, stride_col, (s + 1) * STEP_NB + lanes, readable,
                                     BLOCK_SIZE, BLOCK_J, UNIT_STRIDE)
        images = tl.where(step_ids[:, None] == s, _max_images(values)[None, :], images)
        if s + 1 < STEPS:
            values = following
    return images


@triton.jit
def _add_pairs(a_first, a_second, b_first, b_second):
    return a_first + b_first, a_second + b_second


@triton.jit
def _add_triples(a_first, a_second, a_third, b_first, b_second, b_third):
    return a_first + b_first, a_second + b_second, a_third + b_third


@triton.jit
def _image_value(image):
    """The fp32 value whose order image is ``image`` (int64 in ``[1, 2**32)``, or uint32)."""
    key = image.to(tl.int32) ^ NONE  # the low 32 bits; topk's signed order key
    return (key ^ ((key >> 31) & KEY_MAX)).to(tl.float32, bitcast=True)


@triton.jit
def _probe(value, low, high):
    """int64 order image of the fp32 ``value``, clamped into ``[low + 1, high - 1]`` (NaN lands on a bound)."""
    bits = value.to(tl.int32, bitcast=True)
    image = (bits ^ ((bits >> 31) | NONE)).to(tl.uint32, bitcast=True).to(tl.int64)
    return tl.minimum(tl.maximum(image, low + 1), high - 1)


@triton.jit
def _reach_pair(images, first, second, CARRY: tl.constexpr):
    """int32 partial counts ``#(images >= first) + #(images >= second) * 2**16`` of the uint32 ``images``
    (thresholds int64 scalars in ``[1, 2**32)``): summed over ``images`` they are the two packed counts.
    ``CARRY`` 1 / 4: topk's ``reaches_unsigned`` carry counts (PTX ``add.cc`` + ``addc``; 4 sums every 4
    images of a thread in the asm: ~1.5 instructions per image and threshold; needs a multiple of 4 images
    per thread); 0 (Triton's CPU interpreter, which cannot run inline PTX): compare and select of a constant."""
    first = first.to(tl.uint32)
    second = second.to(tl.uint32)
    if CARRY == 0:
        return tl.where(images >= first, 1, 0) + tl.where(images >= second, 65536, 0)
    return reaches_unsigned(images, first, CARRY) + (reaches_unsigned(images, second, CARRY) << 16)


@triton.jit
def _reach_accumulate(counts, images, threshold):
    """``counts`` (int32, shaped as the uint32 ``images``) plus the carry counts of ``images >= threshold`` (an
    int64 scalar in ``[1, 2**32)``; PTX ``add.cc`` + ``addc`` as topk's ``reaches_unsigned``): the 4 carries of
    every 4 images of a thread chained into the first of their 4 counts, the other 3 passed through (zeros from
    the start stay zeros, which ptxas folds away): ~1.5 instructions per image, none to accumulate. Needs a
    multiple of 4 images per thread; summed over all counts it is the count."""
    negated = tl.broadcast_to(0 - threshold.to(tl.uint32), images.shape)  # 2**32 - threshold
    return tl.inline_asm_elementwise(
        "{ .reg .u32 d; add.cc.u32 d, $8, $12; addc.u32 $0, $4, 0; add.cc.u32 d, $9, $13; addc.u32 $0, $0, 0; "
        "add.cc.u32 d, $10, $14; addc.u32 $0, $0, 0; add.cc.u32 d, $11, $15; addc.u32 $0, $0, 0; "
        "mov.u32 $1, $5; mov.u32 $2, $6; mov.u32 $3, $7; }",
        "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r", [counts, images, negated], dtype=tl.int32, is_pure=True, pack=4)


@triton.jit
def _narrow(probe, count, k, low, low_count, high, high_count):
    """Bracket ``[low, high)`` (``#(>= low) = low_count >= k > high_count = #(>= high)``) narrowed by a
    probe inside it reached by ``count`` images."""
    up = (count >= k) & (probe > low)
    down = (count < k) & (probe < high)
    return (tl.where(up, probe, low), tl.where(up, count, low_count), tl.where(down, probe, high),
            tl.where(down, count, high_count))


@triton.jit
def _round_probes(k, low, low_count, high, high_count):
    """The four probes of one round of ``_kth_largest_interpolated`` (int64 images inside ``(low, high)``):
    the interpolated position of the k-th image in value space (linear between the bracket's values, by the
    counts) minus and plus a width, the bracket's midpoint in value space and its midpoint in image space."""
    low_value = _image_value(low)
    high_value = _image_value(high - 1)
    span = high_value - low_value
    in_bracket = (low_count - high_count).to(tl.float32)
    guess = low_value + span * ((low_count - k).to(tl.float32) / in_bracket)
    width = span * (0.015625 + 0.5 / in_bracket)  # 1/64 of the bracket, or half an image's share of it
    below = _probe(guess - width, low, high)
    above = _probe(guess + width, low, high)
    middle = _probe(low_value + span * 0.5, low, high)
    return below, above, middle, low + (high - low) // 2


@triton.jit
def _narrow_by_probes(below, above, middle, halving, first, second, k, low, low_count, high, high_count):
    """The bracket narrowed by the four probes reached by the packed counts ``first`` (``below`` and ``above``)
    and ``second`` (``middle`` and ``halving``)."""
    low, low_count, high, high_count = _narrow(below, first & LOW_FIELD, k, low, low_count, high, high_count)
    low, low_count, high, high_count = _narrow(above, first >> 16, k, low, low_count, high, high_count)
    low, low_count, high, high_count = _narrow(middle, second & LOW_FIELD, k, low, low_count, high, high_count)
    low, low_count, high, high_count = _narrow(halving, second >> 16, k, low, low_count, high, high_count)
    return low, low_count, high, high_count


@triton.jit
def _moment_terms(images):
    """fp32 ``(1, v, v * v)`` of the finite values ``v`` of the uint32 ``images`` (0 and ``+inf``'s image give
    zeros): summed over images (a row's, or a sample of them) they are the count, sum and sum of squares of their
    finite selectable values."""
    finite = (images != 0) & (images < INF_IMAGE)
    value = tl.where(finite, _image_value(images), 0.0)
    return finite.to(tl.float32), value, value * value


@triton.jit
def _moment_probes(k, selectable, finite, total, squares, low, high):
    """Four probes (int64 images inside ``(low, high)``) for the first round of the search, placed in value space
    by the row's moments: ``mean + sd * (z + d)`` for ``d`` in -0.3, -0.1, 0.1, 0.3, with ``z`` the standard
    normal quantile of the k-th largest's place among the ``finite`` values (Tukey's lambda approximation,
    ~0.01 off). On bell-shaped rows (the block maxima of normal or ReLU-weighted logits) they bracket the k-th
    image within a few hundred images, where the first interpolated round leaves thousands (simulated:
    3.5 rounds against 6.3; ``scripts/cand_search_sim.py``); elsewhere they are ordinary counted probes (the search stays exact)."""
    mean = total / tl.maximum(finite, 1.0)
    sd = tl.sqrt(tl.maximum(squares / tl.maximum(finite, 1.0) - mean * mean, 0.0))
    above = (k - (selectable - finite.to(tl.int32))).to(tl.float32)  # the infinite ones rank first
    tail = tl.minimum(tl.maximum(above / tl.maximum(finite, 1.0), 1e-4), 1.0 - 1e-4)
    z = 4.91 * (tl.exp2(0.14 * tl.log2(1.0 - tail)) - tl.exp2(0.14 * tl.log2(tail)))
    return (_probe(mean + sd * (z - 0.3), low, high), _probe(mean + sd * (z + 0.3), low, high),
            _probe(mean + sd * (z - 0.1), low, high), _probe(mean + sd * (z + 0.1), low, high))


@triton.jit
def _probes(k, selectable, low, low_count, high, high_count, opening, finite, total, squares):
    """The four probes of a search round: ``_moment_probes`` in the ``opening`` round, else ``_round_probes`` (one
    copy of the round's counting code serves both)."""
    if opening != 0:
        below, above, middle, halving = _moment_probes(k, selectable, finite, total, squares, low, high)
    else:
        below, above, middle, halving = _round_probes(k, low, low_count, high, high_count)
    return below, above, middle, halving


@triton.jit
def _kth_largest_interpolated(images, k, selectable, CARRY: tl.constexpr):
    """A uint32 ``t`` that is the k-th largest of the 1-D uint32 ``images`` (fewer than 32768, ``selectable >
    k >= 1`` of them other than 0) or that exactly k images reach; either gives the same selection.

    Keeps a bracket ``[low, high)`` with ``#(images >= low) >= k > #(images >= high)`` and counts four probes
    inside it per round (``_round_probes``; two packed int32 sums, one block reduction, ``_reach_pair`` with
    ``CARRY``). The image-space midpoint at least halves the bracket every round (at most 32 rounds whatever
    the data). Ends when ``#(images >= low) == k`` or the bracket is one image wide (then ``low`` is the k-th
    largest). The first round's probes come from the row's moments (``_moment_probes``)."""
    low = tl.min(tl.where(images != 0, images, tl.full([], 0xFFFFFFFF, tl.uint32)), axis=0).to(tl.int64)
    high = tl.max(images, axis=0).to(tl.int64) + 1
    low_count = selectable
    high_count = selectable * 0
    finite, total, squares = tl.reduce(_moment_terms(images), 0, _add_triples)
    opening = selectable * 0 + 1
    while (low_count > k) & (high - low > 1):
        below, above, middle, halving = _probes(k, selectable, low, low_count, high, high_count, opening, finite,
                                                total, squares)
        opening = opening * 0
        first, second = tl.reduce((_reach_pair(images, below, above, CARRY),
                                   _reach_pair(images, middle, halving, CARRY)), 0, _add_pairs)
        low, low_count, high, high_count = _narrow_by_probes(below, above, middle, halving, first, second, k, low,
                                                             low_count, high, high_count)
    return low.to(tl.uint32)


@triton.jit
def _threshold(images, num_blocks, num_blocks_k, CARRY: tl.constexpr):
    """The uint32 image ``t`` of a row's selection over its (unpinned) ``images``: every block above ``t`` is
    taken, then the first ``k - #(> t)`` equal to it in id order (0: take every selectable block; the image of
    ``+inf``: only the pin, ``k == 1``)."""
    selectable = tl.sum((images != 0).to(tl.int32), axis=0)
    k_rest = num_blocks_k - (num_blocks > 0).to(tl.int32)
    t = tl.zeros([], tl.uint32)
    if selectable > k_rest:
        if k_rest > 0:
            t = _kth_largest_interpolated(images, k_rest, selectable, CARRY)
        else:
            t = tl.full([], INF_IMAGE, tl.uint32)
    return t


@triton.jit(do_not_specialize=["row_repeat", "width", "num_blocks_k"])
def _fused_select_kernel(
    logits_ptr, starts_ptr, ends_ptr, out_ptr,
    row_repeat, width, num_blocks_k, stride_row, stride_col, out_stride_row, out_stride_col,
    HAS_STARTS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_J: tl.constexpr, STEPS: tl.constexpr,
    STEP_NB: tl.constexpr, VECTOR: tl.constexpr, PAD_BLOCK: tl.constexpr, CARRY: tl.constexpr,
):
    """One program per row: stream the row, hold its ``STEPS * STEP_NB`` block images in registers
    (``[STEPS, STEP_NB]``, block ``s * STEP_NB + j`` at ``[s, j]``), find the threshold and emit.

    The newest block is never read (its score is pinned): the search runs over the other blocks for
    ``k - 1`` places, which gives the same threshold as searching all blocks with the pin for ``k`` (the
    pin holds the largest image, ``+inf``'s; removing one copy of the maximum shifts every rank by one),
    and keeps the pin's image out of the searched range (a narrower starting bracket). ``VECTOR`` (unit
    column stride): rows whose start is a multiple of 4 load from a base the compiler knows to be
    4-aligned (16-byte loads). ``CARRY``: the search's counting (``_reach_pair``).

    The emit's prefix sum runs over the flattened images, in which each thread holds ``NB / threads``
    separate runs of one id: a warp scan and a cross-warp exchange per run (~3K of the ~8K SASS
    instructions per thread; a one-run-per-thread layout cut that but lost on the loads)."""
    row = tl.program_id(0).to(tl.int64)
    start, length = row_bounds(starts_ptr, ends_ptr, row, row_repeat, width, HAS_STARTS)
    num_blocks = ((length + BLOCK_SIZE - 1) // BLOCK_SIZE).to(tl.int32)
    readable = num_blocks - 1  # every block but the pinned newest one
    row_ptr = logits_ptr + row * stride_row
    images = tl.zeros([STEPS, STEP_NB], tl.uint32)
    if VECTOR and (start % 4 == 0):
        aligned_start = (start // 4) * 4  # == start; the product tells the compiler it is 4-aligned
        images = _stream_row_images(images, row_ptr, aligned_start, 1, readable, STEPS, STEP_NB, BLOCK_SIZE,
                                    BLOCK_J, True)
    else:
        images = _stream_row_images(images, row_ptr, start, stride_col, readable, STEPS, STEP_NB, BLOCK_SIZE,
                                    BLOCK_J, False)
    # Row-major flattening (free: [s, j] and s * STEP_NB + j share a thread) keeps block-id order.
    images = tl.reshape(images, [STEPS * STEP_NB])  # [NB]
    block_ids = tl.arange(0, STEPS * STEP_NB)  # [NB]
    t = _threshold(images, num_blocks, num_blocks_k, CARRY)
    images = tl.where(block_ids == num_blocks - 1, INF_IMAGE, images)
    greater = images > t
    equal = (images == t) & (images != 0)
    counts = greater.to(tl.int32) + (equal.to(tl.int32) << 16)  # [NB]: two 16-bit fields
    prefix = tl.cumsum(counts, axis=0)  # inclusive, in block-id order
    totals = tl.sum(counts, axis=0)
    ties = tl.where(t == 0, 0, num_blocks_k - (totals & LOW_FIELD))
    greater_rank = prefix & LOW_FIELD
    equal_rank = prefix >> 16
    take = greater | (equal & (equal_rank <= ties))
    position = greater_rank + tl.minimum(equal_rank, ties) - 1
    out_row = out_ptr + row * out_stride_row
    tl.store(out_row + position.to(tl.int64) * out_stride_col, block_ids, mask=take)
    _pad_after_taken(out_row, out_stride_col, totals, ties, num_blocks_k, PAD_BLOCK)


@triton.jit
def _load_images(keys_row, block_ids):
    """uint32 images at ``keys_row + block_ids`` (the scratch is int32)."""
    return tl.load(keys_row + block_ids).to(tl.uint32, bitcast=True)


@triton.jit
def _scratch_probe_counts(keys_row, below, above, middle, halving, NB: tl.constexpr, CHUNK: tl.constexpr,
                          CARRY: tl.constexpr):
    """Two packed int32 counts over the NB images at ``keys_row``, read in chunks of CHUNK: ``#(>= below) +
    #(>= above) * 2**16`` and the same for ``middle`` and ``halving`` (``_reach_pair`` with ``CARRY``)."""
    lanes = tl.arange(0, CHUNK)  # [CHUNK]
    first = tl.zeros([CHUNK], tl.int32)
    second = tl.zeros([CHUNK], tl.int32)
    if CARRY == 4:
        # One count per probe, chained through the asm (no per-chunk packing); unrolled (the compiler keeps the
        # asm's loop rolled): the loads hoisted over the counting.
        reach_below = tl.zeros([CHUNK], tl.int32)
        reach_above = tl.zeros([CHUNK], tl.int32)
        reach_middle = tl.zeros([CHUNK], tl.int32)
        reach_halving = tl.zeros([CHUNK], tl.int32)
        for c in tl.static_range(NB // CHUNK):
            images = _load_images(keys_row, c * CHUNK + lanes)  # [CHUNK]
            reach_below = _reach_accumulate(reach_below, images, below)
            reach_above = _reach_accumulate(reach_above, images, above)
            reach_middle = _reach_accumulate(reach_middle, images, middle)
            reach_halving = _reach_accumulate(reach_halving, images, halving)
        first = reach_below + (reach_above << 16)
        second = reach_middle + (reach_halving << 16)
    else:  # CARRY 1, or 0 under the interpreter
        for c in tl.static_range(NB // CHUNK):
            images = _load_images(keys_row, c * CHUNK + lanes)  # [CHUNK]
            first += _reach_pair(images, below, above, CARRY)
            second += _reach_pair(images, middle, halving, CARRY)
    return tl.reduce((first, second), 0, _add_pairs)


@triton.jit
def _kth_largest_in_scratch(keys_row, k, selectable, low, high, finite, total, squares, NB: tl.constexpr,
                            CHUNK: tl.constexpr, CARRY: tl.constexpr, timeline_ptr=None,
                            program=0, TIMELINE: tl.constexpr = False):
    """``_kth_largest_interpolated`` over the NB images at ``keys_row`` (re-read every round, chunk by chunk,
    from L1 after the first round: the images never sit in registers); ``low`` / ``high`` (int64) are the
    smallest image other than 0 and the largest image plus one, ``finite`` / ``total`` / ``squares`` the row's
    sums of ``_moment_terms`` (the opening round's probes). Same probes, same result. With
    ``TIMELINE`` the round count goes to word ``_TL_ROUNDS`` of ``program``'s timeline."""
    low_count = selectable
    high_count = selectable * 0
    opening = selectable * 0 + 1
    rounds = selectable * 0
    stamp(timeline_ptr, program, _TL_FIRST_ROUND_START, _TL_SLOTS, TIMELINE)
    while (low_count > k) & (high - low > 1):
        below, above, middle, halving = _probes(k, selectable, low, low_count, high, high_count, opening, finite,
                                                total, squares)
        opening = opening * 0
        first, second = _scratch_probe_counts(keys_row, below, above, middle, halving, NB, CHUNK, CARRY)
        low, low_count, high, high_count = _narrow_by_probes(below, above, middle, halving, first, second, k, low,
                                                             low_count, high, high_count)
        if TIMELINE:
            if rounds == 0:
                stamp(timeline_ptr, program, _TL_FIRST_ROUND_END, _TL_SLOTS, TIMELINE)
        rounds += 1
    if TIMELINE:
        tl.store(timeline_ptr + program.to(tl.int64) * _TL_SLOTS + _TL_ROUNDS, rounds.to(tl.int64))
    return low.to(tl.uint32)


@triton.jit
def _emit_counts(images, block_ids, t, num_blocks):
    """Packed ``greater + equal * 2**16`` flags of ``images`` against the threshold ``t``, the pinned newest
    block (``num_blocks - 1``) given the image of ``+inf``."""
    images = tl.where(block_ids == num_blocks - 1, INF_IMAGE, images)
    return (images > t).to(tl.int32) + (((images == t) & (images != 0)).to(tl.int32) << 16)


@triton.jit
def _emit_prescanned(keys_row, t, num_blocks, num_blocks_k, out_row, out_stride_col, NB: tl.constexpr,
                     CHUNK: tl.constexpr, LANES: tl.constexpr, PAD_BLOCK: tl.constexpr):
    """The emit of ``_select_from_scratch`` in two passes over the NB images at ``keys_row``, as ``[LANES,
    RUN]`` chunks (``RUN = CHUNK // LANES`` consecutive ids per row of the tensor; with RUN 4 a row is one 16-byte
    load of one thread). The first pass keeps every run's packed count (``[LANES, CHUNKS]``, run ``lane`` of chunk
    ``c`` at ``[lane, c]``) and one scan gives every run's offset; the second pass then ranks within each run and
    stores, with no cross-thread exchange per chunk. sm_90a SASS at the bench shape, per thread: ~220 instructions
    a chunk plus ~1.2K once and ~10 barriers in all, against ~440 a chunk (a totals pass included) and 13 barriers
    a chunk for the scan per chunk it replaced (-3.6 % at R 512). Both passes are loops:
    unrolled, the compiler hoists every chunk's loads and spills at 80 registers."""
    RUN: tl.constexpr = CHUNK // LANES
    CHUNKS: tl.constexpr = NB // CHUNK
    # At least RUN columns (the extra ones stay 0): fewer put copies of a column in one thread, on which Triton
    # 3.6's scan lowering asserts.
    COLUMNS: tl.constexpr = CHUNKS if CHUNKS >= RUN else RUN
    run_ids = tl.arange(0, LANES)[:, None] * RUN + tl.arange(0, RUN)[None, :]  # [LANES, RUN]
    chunk_columns = tl.arange(0, COLUMNS)[None, :]  # [1, COLUMNS]
    run_counts = tl.zeros([LANES, COLUMNS], tl.int32)
    for c in range(CHUNKS):  # a loop: one chunk of images in registers at a time
        block_ids = c * CHUNK + run_ids
        counts = _emit_counts(_load_images(keys_row, block_ids), block_ids, t, num_blocks)  # [LANES, RUN]
        run_counts = tl.where(chunk_columns == c, tl.sum(counts, axis=1)[:, None], run_counts)
    chunk_counts = tl.sum(run_counts, axis=0)  # [COLUMNS]
    totals = tl.sum(chunk_counts, axis=0)
    earlier_chunks = tl.cumsum(chunk_counts, axis=0) - chunk_counts  # [COLUMNS] exclusive
    earlier = tl.cumsum(run_counts, axis=0) - run_counts + earlier_chunks[None, :]  # [LANES, COLUMNS] exclusive
    ties = tl.where(t == 0, 0, num_blocks_k - (totals & LOW_FIELD))
    for c in range(CHUNKS):  # a loop: one chunk of images in registers at a time
        block_ids = c * CHUNK + run_ids
        counts = _emit_counts(_load_images(keys_row, block_ids), block_ids, t, num_blocks)  # [LANES, RUN]
        run_offset = tl.sum(tl.where(chunk_columns == c, earlier, 0), axis=1)  # [LANES]: column c
        prefix = tl.cumsum(counts, axis=1) + run_offset[:, None]  # inclusive, in block-id order
        equal_rank = prefix >> 16
        take = ((counts & LOW_FIELD) != 0) | (((counts >> 16) != 0) & (equal_rank <= ties))
        position = (prefix & LOW_FIELD) + tl.minimum(equal_rank, ties) - 1
        tl.store(out_row + position.to(tl.int64) * out_stride_col, block_ids, mask=take)
    _pad_after_taken(out_row, out_stride_col, totals, ties, num_blocks_k, PAD_BLOCK)


@triton.jit
def _select_from_scratch(keys_row, num_blocks, num_blocks_k, out_row, out_stride_col, NB: tl.constexpr,
                         CHUNK: tl.constexpr, LANES: tl.constexpr, PAD_BLOCK: tl.constexpr, CARRY: tl.constexpr,
                         SAMPLE: tl.constexpr, timeline_ptr=None, program=0,
                         TIMELINE: tl.constexpr = False):
    """The selection of ``_split_select_kernel``: the row's NB images read in chunks of CHUNK (``[LANES, CHUNK
    // LANES]`` for the emit, one run of ids per row of the tensor) by every pass (bounds, search rounds, totals,
    emit), so the selecting program needs no more registers than a streaming one. The search opens with
    ``_moment_probes`` from the moments of SAMPLE images at a stride of ``NB / SAMPLE`` (blocks ``0, NB / SAMPLE,
    ...``), scaled to the row: an estimate is all the probes need (the search counts every probe)."""
    lanes = tl.arange(0, CHUNK)  # [CHUNK]
    present = tl.zeros([CHUNK], tl.int32)
    lowest = tl.full([CHUNK], 0xFFFFFFFF, tl.uint32)
    highest = tl.zeros([CHUNK], tl.uint32)
    for c in range(NB // CHUNK):  # a loop: one chunk of images in registers at a time
        images = _load_images(keys_row, c * CHUNK + lanes)  # [CHUNK]
        present += (images != 0).to(tl.int32)
        lowest = tl.minimum(lowest, tl.where(images != 0, images, 0xFFFFFFFF))
        highest = tl.maximum(highest, images)
    selectable = tl.sum(present, axis=0)
    k_rest = num_blocks_k - (num_blocks > 0).to(tl.int32)
    stamp(timeline_ptr, program, _TL_BOUNDS, _TL_SLOTS, TIMELINE)
    t = tl.zeros([], tl.uint32)
    if selectable > k_rest:
        if k_rest > 0:
            sampled = _load_images(keys_row, tl.arange(0, SAMPLE) * (NB // SAMPLE))  # [SAMPLE]
            finite, total, squares = tl.reduce(_moment_terms(sampled), 0, _add_triples)
            finite *= NB // SAMPLE  # a power of two: the mean and deviation are the sample's exactly
            total *= NB // SAMPLE
            squares *= NB // SAMPLE
            t = _kth_largest_in_scratch(keys_row, k_rest, selectable, tl.min(lowest, axis=0).to(tl.int64),
                                        tl.max(highest, axis=0).to(tl.int64) + 1, finite, total, squares, NB, CHUNK,
                                        CARRY, timeline_ptr, program, TIMELINE)
        else:
            t = tl.full([], INF_IMAGE, tl.uint32)
    stamp(timeline_ptr, program, _TL_SEARCHED, _TL_SLOTS, TIMELINE)
    _emit_prescanned(keys_row, t, num_blocks, num_blocks_k, out_row, out_stride_col, NB, CHUNK, LANES, PAD_BLOCK)
    stamp(timeline_ptr, program, _TL_EMITTED, _TL_SLOTS, TIMELINE)


# ``discard.global.L2``: the 128-byte line at ``$1`` leaves the L2 without a write-back (its bytes become undefined).
_DISCARD_L2_ASM = tl.constexpr("discard.global.L2 [$1], 128;\nmov.u32 $0, 0;")


@triton.jit
def _discard_lines(first, num_lines, LINE: tl.constexpr, CHUNK: tl.constexpr):
    """Drops the ``num_lines`` 128-byte lines from ``first`` (128-byte aligned, ``LINE`` elements a line) out of the L2
    unwritten, ``CHUNK`` a trip: dead scratch (a selected row's images, a masked row's flags) whose dirty lines
    would otherwise be written back to DRAM later, in the streaming's bandwidth (the select's images: 32 MiB at R
    512, 128 MiB at R 2048). GPU only (inline PTX)."""
    tl.debug_barrier()  # every thread's reads of the lines precede their discard
    lanes = tl.arange(0, CHUNK)
    base = num_lines * 0
    while base < num_lines:
        line = tl.minimum(base + lanes, num_lines - 1)  # lanes past the end drop the last line again
        tl.inline_asm_elementwise(_DISCARD_L2_ASM, "=r,l", [first + line * LINE], dtype=tl.int32, is_pure=False,
                                  pack=1)
        base += CHUNK


@triton.jit
def _stream_piece_images(keys_row, row_ptr, first_column, stride_col, readable, first_block, STEPS: tl.constexpr,
                         STEP_NB: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_J: tl.constexpr,
                         UNIT_STRIDE: tl.constexpr):
    """Stores the block images of blocks ``[first_block, first_block + STEPS * STEP_NB)`` of one row at
    ``keys_row + block`` (0 past ``readable``), the next step's loads issued before the current step is
    reduced."""
    lanes = tl.arange(0, STEP_NB)  # [STEP_NB]
    values = _step_values(row_ptr, first_column, stride_col, first_block + lanes, readable, BLOCK_SIZE, BLOCK_J,
                          UNIT_STRIDE)
    for s in tl.static_range(STEPS):
        if s + 1 < STEPS:
            following = _step_values(row_ptr, first_column, stride_col, first_block + (s + 1) * STEP_NB + lanes,
                                     readable, BLOCK_SIZE, BLOCK_J, UNIT_STRIDE)
        images = _max_images(values)
        # Scalar stores (``max_contiguous`` 1): the images still pass through shared memory, as 16-byte accesses
        # (for 16-byte stores they went as 4-byte ones: R 512 121.6 against 122.3 µs).
        ids = tl.max_contiguous(first_block + s * STEP_NB + lanes, 1)
        tl.store(keys_row + ids, images.to(tl.int32, bitcast=True))
        if s + 1 < STEPS:
            values = following


@triton.jit(do_not_specialize=["row_repeat", "width", "num_blocks_k"])
def _split_select_kernel(
    logits_ptr, starts_ptr, ends_ptr, out_ptr, keys_ptr, arrivals_ptr,
    row_repeat, width, num_blocks_k, stride_row, stride_col, out_stride_row, out_stride_col,
    HAS_STARTS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_J: tl.constexpr, STEPS: tl.constexpr,
    STEP_NB: tl.constexpr, PIECES: tl.constexpr, LANES: tl.constexpr, VECTOR: tl.constexpr,
    PAD_BLOCK: tl.constexpr, SELECT_CHUNK: tl.constexpr, CARRY: tl.constexpr,
    SAMPLE: tl.constexpr, DISCARD: tl.constexpr, timeline_ptr=None,
    TIMELINE: tl.constexpr = False,
):
    """``PIECES`` programs per row (program ``row * PIECES + piece``): each streams blocks ``[piece * NB /
    PIECES, (piece + 1) * NB / PIECES)`` of its row (``STEPS`` steps of ``STEP_NB`` blocks) into the row's
    scratch images ``keys_ptr + row * NB`` (int32 [R, NB], ``NB = PIECES * STEPS * STEP_NB``; the pinned
    newest block and blocks past the row get 0), then arrives on ``arrivals[row]`` (acq_rel, zero at launch). The
    last program to arrive selects the row (``_select_from_scratch``): every pass of the
    selection re-reads the images in chunks of SELECT_CHUNK (L1 hits after the first), so the kernel's
    registers are the streaming's and several programs fit per SM (a selecting one beside streaming ones).
    Why: the selection of one row overlaps the streaming of the later rows on the other SMs, instead of one
    program per row doing both one after the other (~39 µs a row, 4 rows per SM). ``DISCARD`` (GPU only,
    rows of whole 128-byte lines): the selecting program then drops the row's images from the L2 unwritten
    (``_discard_lines``)."""
    program = tl.program_id(0)
    stamp(timeline_ptr, program, _TL_START, _TL_SLOTS, TIMELINE)
    row = (program // PIECES).to(tl.int64)
    piece = program % PIECES
    start, length = row_bounds(starts_ptr, ends_ptr, row, row_repeat, width, HAS_STARTS)
    num_blocks = ((length + BLOCK_SIZE - 1) // BLOCK_SIZE).to(tl.int32)
    readable = num_blocks - 1  # every block but the pinned newest one
    row_ptr = logits_ptr + row * stride_row
    NB: tl.constexpr = PIECES * STEPS * STEP_NB
    keys_row = keys_ptr + row * NB
    first_block = piece * (STEPS * STEP_NB)
    if VECTOR and (start % 4 == 0):
        aligned_start = (start // 4) * 4  # == start; the product tells the compiler it is 4-aligned
        _stream_piece_images(keys_row, row_ptr, aligned_start, 1, readable, first_block, STEPS, STEP_NB, BLOCK_SIZE,
                             BLOCK_J, True)
    else:
        _stream_piece_images(keys_row, row_ptr, start, stride_col, readable, first_block, STEPS, STEP_NB, BLOCK_SIZE,
                             BLOCK_J, False)
    tl.debug_barrier()  # every thread's image stores precede the CTA's arrival (release)
    arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel", scope="gpu")
    stamp(timeline_ptr, program, _TL_ARRIVED, _TL_SLOTS, TIMELINE)
    if arrived == PIECES - 1:
        _select_from_scratch(keys_row, num_blocks, num_blocks_k, out_ptr + row * out_stride_row, out_stride_col, NB,
                             SELECT_CHUNK, LANES, PAD_BLOCK, CARRY, SAMPLE, timeline_ptr, program, TIMELINE)
        if DISCARD:
            _discard_lines(keys_row, NB // 32, 32, NB // 32)


@triton.jit(do_not_specialize=["row_repeat", "width", "num_candidates"])
def _candidate_flags_kernel(
    candidates_ptr, starts_ptr, ends_ptr, flags_ptr,
    row_repeat, width, num_candidates, cand_stride_row, cand_stride_col, flags_stride,
    HAS_STARTS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    _, length = row_bounds(starts_ptr, ends_ptr, row, row_repeat, width, HAS_STARTS)
    num_blocks = (length + BLOCK_SIZE - 1) // BLOCK_SIZE
    slot = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    ids = tl.load(candidates_ptr + row * cand_stride_row + slot * cand_stride_col, mask=slot < num_candidates,
                  other=-1).to(tl.int64)
    listed = (ids >= 0) & (ids < num_blocks)
    tl.store(flags_ptr + row * flags_stride + ids, tl.full([BLOCK_K], 1, tl.int8), mask=listed)


@triton.jit(do_not_specialize=["row_repeat", "width", "programs_per_row", "span_blocks", "num_candidates"])
def _mask_kernel(
    logits_ptr, starts_ptr, ends_ptr, flags_ptr, candidates_ptr,
    row_repeat, width, programs_per_row, span_blocks, stride_row, stride_col, flags_stride,
    num_candidates, cand_stride_row, cand_stride_col,
    HAS_STARTS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_J: tl.constexpr,
    VECTOR: tl.constexpr, FUSED_FLAGS: tl.constexpr, BLOCK_K: tl.constexpr,
    DISCARD_FLAGS: tl.constexpr,
):
    """Blocks are numbered relative to the row start, from ``-ceil(start / BLOCK_SIZE)`` up to
    ``span_blocks`` of them, so the tiles also cover the columns before ``start`` and after ``end``.

    A column of block ``b`` is masked when it lies in ``[0, width)`` (one unsigned compare) and the
    block is unlisted or the column is at or past ``end``: the kept part of a listed block is the part
    before ``end``, and blocks outside the row are never listed. Columns are int32 (below 2**31;
    only the address is 64-bit), which keeps the per-element work to two compares and the store.

    ``VECTOR`` (only with unit column stride and ``BLOCK_SIZE % 4 == 0``): a tile wholly inside a row
    whose start is a multiple of 4 stores with the block's flag alone as mask, constant over aligned
    groups of 4 columns from a base the compiler knows to be 4-aligned, i.e. 16-byte stores.

    ``FUSED_FLAGS`` (one program per row, ``programs_per_row == 1``): the program builds its row's
    flags itself (clears ``[0, row blocks)``, barrier, sets the listed ids, barrier) instead of the
    memset and ``_candidate_flags_kernel`` launches; the barrier makes the CTA's global stores
    visible to its own later loads. The ``-inf`` stores are streaming (``.cs``). ``DISCARD_FLAGS`` (with
    ``FUSED_FLAGS``; GPU only, flag rows of whole 128-byte lines): the program then drops its row's flags from the L2
    unwritten (``_discard_lines``).
    """
    row = tl.program_id(0).to(tl.int64)
    start64, length64 = row_bounds(starts_ptr, ends_ptr, row, row_repeat, width, HAS_STARTS)
    start = start64.to(tl.int32)
    end = (start64 + length64).to(tl.int32)
    lowest = -((start + BLOCK_SIZE - 1) // BLOCK_SIZE)
    num_blocks = (length64.to(tl.int32) + BLOCK_SIZE - 1) // BLOCK_SIZE
    row_ptr = logits_ptr + row * stride_row
    flags_row = flags_ptr + row * flags_stride
    width_u = width.to(tl.uint32)
    inner = tl.arange(0, BLOCK_J)  # [BLOCK_J]
    tile = tl.program_id(1)
    aligned = start % 4 == 0
    aligned_start = (start // 4) * 4  # == start when aligned; the product tells the compiler so
    if FUSED_FLAGS:
        lanes = tl.arange(0, BLOCK_K)  # [BLOCK_K]
        base = num_blocks * 0
        while base < num_blocks:
            block = base + lanes  # [BLOCK_K]
            tl.store(flags_row + block, tl.zeros([BLOCK_K], tl.int8), mask=block < num_blocks)
            base += BLOCK_K
        tl.debug_barrier()
        cand_row = candidates_ptr + row * cand_stride_row
        base = num_blocks * 0
        while base < num_candidates:
            slot = base + lanes  # [BLOCK_K]
            ids = tl.load(cand_row + slot.to(tl.int64) * cand_stride_col, mask=slot < num_candidates, other=-1)
            listed = (ids >= 0) & (ids < num_blocks)
            tl.store(flags_row + ids.to(tl.int64), tl.full([BLOCK_K], 1, tl.int8), mask=listed)
            base += BLOCK_K
        tl.debug_barrier()
    while tile * BLOCK_NB < span_blocks:
        first_block = lowest + tile * BLOCK_NB
        blocks = first_block + tl.arange(0, BLOCK_NB)  # [BLOCK_NB] int32
        if VECTOR and aligned and (first_block >= 0) and ((first_block + BLOCK_NB) * BLOCK_SIZE <= end - start):
            unlisted = tl.load(flags_row + blocks) == 0  # [BLOCK_NB]
            for j in tl.static_range(0, BLOCK_SIZE, BLOCK_J):
                offset = j + inner  # [BLOCK_J]
                column = aligned_start + blocks[:, None] * BLOCK_SIZE + offset[None, :]  # [BLOCK_NB, BLOCK_J]
                minus_inf = tl.full([BLOCK_NB, BLOCK_J], float("-inf"), tl.float32)
                if BLOCK_J <= BLOCK_SIZE - j:
                    tl.store(row_ptr + column, minus_inf, mask=unlisted[:, None].broadcast_to(BLOCK_NB, BLOCK_J),
                             cache_modifier=".cs")
                else:
                    tl.store(row_ptr + column, minus_inf, mask=unlisted[:, None] & (offset < BLOCK_SIZE)[None, :],
                             cache_modifier=".cs")
        else:
            in_row = (blocks >= 0) & (blocks < num_blocks)
            unlisted = tl.load(flags_row + blocks, mask=in_row, other=0) == 0  # [BLOCK_NB]
            first = start + blocks * BLOCK_SIZE  # [BLOCK_NB] first column of each block
            for j in tl.static_range(0, BLOCK_SIZE, BLOCK_J):
                offset = j + inner  # [BLOCK_J]
                column = first[:, None] + offset[None, :]  # [BLOCK_NB, BLOCK_J]
                masked = ((column.to(tl.uint32) < width_u) & (unlisted[:, None] | (column >= end))
                          & (offset < BLOCK_SIZE)[None, :])
                tl.store(row_ptr + column.to(tl.int64) * stride_col,
                         tl.full([BLOCK_NB, BLOCK_J], float("-inf"), tl.float32), mask=masked,
                         cache_modifier=".cs")
        tile += programs_per_row
    if FUSED_FLAGS and DISCARD_FLAGS:
        _discard_lines(flags_row, (num_blocks + 127) // 128, 128, 256)


def _tiles(block_size: int, tile: int) -> tuple[int, int]:
    """(BLOCK_NB, BLOCK_J): blocks per tile and positions per block step, ``BLOCK_NB * BLOCK_J <= tile``."""
    block_j = min(triton.next_power_of_2(block_size), tile)
    return max(1, tile // block_j), block_j


def _bounds_args(starts: torch.Tensor | None, ends: torch.Tensor) -> tuple[torch.Tensor, bool]:
    return (ends, False) if starts is None else (starts, True)


def _unit_stride(logits: torch.Tensor) -> bool:
    """The 16-byte paths (``VECTOR``) need a unit column stride."""
    return logits.stride(1) == 1


def block_keys(logits: torch.Tensor, starts: torch.Tensor | None, ends: torch.Tensor, block_size: int,
               row_repeat: int, *, config: SelectConfig = DEFAULT_SELECT) -> torch.Tensor:
    """First stage of the two-launch select: int32 block keys ``[R, max(ceil(C / block_size), 1)]``,
    ``config.keys_tile`` positions per program."""
    num_rows, width = logits.shape
    max_blocks = triton.cdiv(width, block_size)
    keys = torch.empty((num_rows, max(max_blocks, 1)), dtype=torch.int32, device=logits.device)
    if num_rows and max_blocks:
        starts_arg, has_starts = _bounds_args(starts, ends)
        block_nb, block_j = _tiles(block_size, config.keys_tile)
        block_nb = min(block_nb, triton.next_power_of_2(max_blocks))
        _block_keys_kernel[(num_rows, triton.cdiv(max_blocks, block_nb))](
            logits, starts_arg, ends, keys,
            row_repeat, width, logits.stride(0), logits.stride(1), keys.stride(0),
            HAS_STARTS=has_starts, BLOCK_SIZE=block_size, BLOCK_NB=block_nb, BLOCK_J=block_j,
            VECTOR=_unit_stride(logits), num_warps=8,
        )
    return keys


def select_from_keys(keys: torch.Tensor, starts: torch.Tensor | None, ends: torch.Tensor, num_blocks_k: int,
                     block_size: int, row_repeat: int, out: torch.Tensor, *, width: int | None = None) -> torch.Tensor:
    """Second stage of the two-launch select: the ``num_blocks_k`` best block ids of each row of ``keys`` into
    ``out`` (the radix kernel, one program of ``_SELECT_WARPS`` warps per row scanning ``_SELECT_CHUNK`` keys per
    step). ``width``: the logits' columns (default: the positions of ``keys``' blocks)."""
    if width is None:
        width = keys.shape[1] * block_size
    if out.shape[0]:
        starts_arg, has_starts = _bounds_args(starts, ends)
        candidates = torch.empty_like(keys)
        _select_kernel[(out.shape[0],)](
            keys, candidates, starts_arg, ends, out,
            row_repeat, width, num_blocks_k, keys.stride(0), out.stride(0), out.stride(1),
            HAS_STARTS=has_starts, BLOCK_SIZE=block_size, CHUNK=_SELECT_CHUNK, RADIX_BITS=_RADIX_BITS,
            num_warps=_SELECT_WARPS, maxnreg=_SELECT_MAX_REGISTERS,
        )
    return out


def _discardable_rows(scratch: torch.Tensor) -> bool:
    """Whether each row of ``scratch`` (``[R, N]``, unit column stride: the split select's images, the fused mask's
    flags) starts a 128-byte line and its row stride is whole lines, so that discarding a row's lines leaves the
    other rows' alone; never under Triton's CPU interpreter (no inline PTX)."""
    if interpreting() or scratch.device.type != "cuda":
        return False
    return scratch.data_ptr() % 128 == 0 and scratch.stride(0) * scratch.element_size() % 128 == 0


def select_fused(logits: torch.Tensor, starts: torch.Tensor | None, ends: torch.Tensor, num_blocks_k: int,
                 block_size: int, row_repeat: int, out: torch.Tensor, pieces: int, *,
                 config: SelectConfig = DEFAULT_SELECT, timeline: dict | None = None) -> torch.Tensor:
    """Rows of at most ``config.fused_max_blocks`` blocks in one launch; ``pieces`` (``select_plan``) picks the
    kernel:

    - 0: ``_fused_select_kernel``, one program of ``_FUSED_WARPS`` warps per row, ``config.fused_step`` logits
      per streaming step.
    - > 0: ``_split_select_kernel``, ``pieces`` programs of ``config.split_warps`` warps per row (at most one per
      block), the last to finish selecting with the images re-read in chunks of ``config.split_chunk`` (capped at
      the row's), ``config.split_step`` logits per streaming step, the first probes placed by the moments of
      ``config.moment_sample`` images; each selected row's images are dropped from the L2 unwritten where its
      rows are whole lines (``_discardable_rows``). Scratch images ``[R, next_power_of_2(blocks)]`` and zeroed
      arrival counters ``[R]`` are allocated per call (a memset in the same stream: CUDA-graph capturable).

    ``timeline`` (a dict; the split kernel only, GPU only; a private timing probe): the stamps in
    ``timeline["split"]``, int64 ``[R * pieces, _TL_SLOTS]`` (words ``_TL_*``), created on the first call."""
    num_rows, width = logits.shape
    max_blocks = triton.cdiv(width, block_size)
    padded_blocks = triton.next_power_of_2(max(max_blocks, 1))
    assert padded_blocks <= config.fused_max_blocks, "the fused select holds at most fused_max_blocks keys per row"
    if num_rows == 0:
        return out
    if width == 0:
        return out.fill_(-1)
    starts_arg, has_starts = _bounds_args(starts, ends)
    block_j = triton.next_power_of_2(block_size)
    if pieces:
        pieces = min(triton.next_power_of_2(pieces), padded_blocks)
        piece_blocks = padded_blocks // pieces
        piece_step_blocks = min(max(1, config.split_step // block_j), piece_blocks)
        warps = config.split_warps
        chunk = min(config.split_chunk, padded_blocks)
        lanes = chunk // min(4, chunk)
        keys = torch.empty((num_rows, padded_blocks), dtype=torch.int32, device=logits.device)
        arrivals = torch.zeros((num_rows,), dtype=torch.int32, device=logits.device)
        _split_select_kernel[(num_rows * pieces,)](
            logits, starts_arg, ends, out, keys, arrivals,
            row_repeat, width, num_blocks_k, logits.stride(0), logits.stride(1), out.stride(0), out.stride(1),
            HAS_STARTS=has_starts, BLOCK_SIZE=block_size, BLOCK_J=block_j, STEPS=piece_blocks // piece_step_blocks,
            STEP_NB=piece_step_blocks, PIECES=pieces, LANES=lanes, VECTOR=_unit_stride(logits),
            PAD_BLOCK=_PAD_BLOCK, SELECT_CHUNK=chunk, CARRY=carry_mode(chunk, 32 * warps),
            SAMPLE=min(config.moment_sample, padded_blocks), DISCARD=_discardable_rows(keys),
            num_warps=warps, maxnreg=_SPLIT_MAX_REGISTERS,
            **timeline_args(timeline, "split", num_rows * pieces, _TL_SLOTS.value, logits.device),
        )
        return out
    if timeline is not None:
        raise ValueError("the phase timeline covers the split select only (pieces > 0)")
    step_blocks = min(max(1, config.fused_step // block_j), padded_blocks)
    _fused_select_kernel[(num_rows,)](
        logits, starts_arg, ends, out,
        row_repeat, width, num_blocks_k, logits.stride(0), logits.stride(1), out.stride(0), out.stride(1),
        HAS_STARTS=has_starts, BLOCK_SIZE=block_size, BLOCK_J=block_j, STEPS=padded_blocks // step_blocks,
        STEP_NB=step_blocks, VECTOR=_unit_stride(logits), PAD_BLOCK=_PAD_BLOCK,
        CARRY=carry_mode(padded_blocks, 32 * _FUSED_WARPS), num_warps=_FUSED_WARPS,
    )
    return out


def select_candidate_blocks_triton(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    num_blocks_k: int,
    block_size: int,
    row_repeat: int,
    out: torch.Tensor | None = None,
    *,
    config: SelectConfig = DEFAULT_SELECT,
) -> torch.Tensor:
    """Triton twin of ``select_candidate_blocks_reference``: the path ``select_plan`` picks for the call."""
    if out is None:
        out = torch.empty((logits.shape[0], num_blocks_k), dtype=torch.int32, device=logits.device)
    num_rows, width = logits.shape
    pieces = select_plan(config, num_rows, width, block_size, sm_count(logits.device))
    if pieces is None:
        keys = block_keys(logits, starts, ends, block_size, row_repeat, config=config)
        return select_from_keys(keys, starts, ends, num_blocks_k, block_size, row_repeat, out, width=width)
    return select_fused(logits, starts, ends, num_blocks_k, block_size, row_repeat, out, pieces, config=config)


def apply_candidate_mask_triton(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    candidate_blocks: torch.Tensor,
    block_size: int,
    row_repeat: int,
    *,
    config: MaskConfig = DEFAULT_MASK,
) -> None:
    """Triton twin of ``apply_candidate_mask_reference`` (in place): ``config.tile`` positions per mask tile;
    from ``config.fused_flags_min_rows`` rows on one mask program per row builds its own flags (one launch instead
    of three) and drops them from the L2 unwritten once the row is masked (their rows padded to whole 128-byte
    lines); 16-byte stores on aligned interior tiles (unit column stride, ``block_size % 4 == 0``)."""
    num_rows, width = logits.shape
    if num_rows == 0 or width == 0:
        return
    vector = _unit_stride(logits) and block_size % 4 == 0
    fused_flags = num_rows >= config.fused_flags_min_rows
    starts_arg, has_starts = _bounds_args(starts, ends)
    max_blocks = triton.cdiv(width, block_size)
    num_candidates = candidate_blocks.shape[1]
    block_nb, block_j = _tiles(block_size, config.tile)
    block_nb = min(block_nb, triton.next_power_of_2(max_blocks + 1))
    discard = False
    if fused_flags:
        flag_columns = triton.cdiv(max_blocks, 128) * 128
        flags = torch.empty((num_rows, flag_columns), dtype=torch.int8, device=logits.device)[:, :max_blocks]
        discard = _discardable_rows(flags)
        programs = 1
    else:
        flags = torch.zeros((num_rows, max_blocks), dtype=torch.int8, device=logits.device)
        programs = max(1, min(triton.cdiv(config.target_programs, num_rows), triton.cdiv(max_blocks + 1, block_nb)))
    if num_candidates and not fused_flags:
        block_k = min(1024, triton.next_power_of_2(num_candidates))
        _candidate_flags_kernel[(num_rows, triton.cdiv(num_candidates, block_k))](
            candidate_blocks, starts_arg, ends, flags,
            row_repeat, width, num_candidates, candidate_blocks.stride(0), candidate_blocks.stride(1), flags.stride(0),
            HAS_STARTS=has_starts, BLOCK_SIZE=block_size, BLOCK_K=block_k, num_warps=4,
        )
    _mask_kernel[(num_rows, programs)](
        logits, starts_arg, ends, flags, candidate_blocks,
        row_repeat, width, programs, max_blocks + 1, logits.stride(0), logits.stride(1), flags.stride(0),
        num_candidates, candidate_blocks.stride(0), candidate_blocks.stride(1),
        HAS_STARTS=has_starts, BLOCK_SIZE=block_size, BLOCK_NB=block_nb, BLOCK_J=block_j, VECTOR=vector,
        FUSED_FLAGS=fused_flags, BLOCK_K=1024, DISCARD_FLAGS=discard, num_warps=8,
    )
