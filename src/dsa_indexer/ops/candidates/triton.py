"""Triton kernels of the V4.1 candidate blocks (twins of ``reference.py``).

``select_candidate_blocks`` runs two kernels.

1. ``_block_keys_kernel``, grid ``(R, block tiles)``: each program reduces ``BLOCK_NB`` blocks of
   one row to their maximum over the selectable logits (NaN and ``-inf`` become ``-inf``; columns
   outside ``[starts, ends)`` are never read) and stores one 32-bit *block key* per block in a
   scratch ``[R, ceil(C / block_size)]`` int32 buffer. The key is the unsigned order key of the
   maximum: for fp32 bits ``x`` (``-0.0`` first turned into ``+0.0``), ``key = x ^ 0xFFFFFFFF``
   when the sign bit is set, else ``x | 0x80000000``; then ``key(a) < key(b)`` (unsigned) iff
   ``a < b``. It is ``ops/_order.float_order_key`` plus ``2**31``, so it ranks exactly like the
   reference. A block without selectable entries gets key 0, below every selectable key (the
   smallest, ``-FLT_MAX``, has key ``0x00800000``). The newest block of the row gets the key of
   ``+inf``.
2. ``_select_kernel``, one program per row: an exact radix select over the row's block keys. A
   histogram of the keys' top ``RADIX_BITS`` bits gives the bin where the k-th best key falls; the
   keys of that bin are compacted into a second scratch row, and the next passes histogram the next
   ``RADIX_BITS`` bits of those candidates only (the ones that agree with the prefix found so far).
   After the last pass the prefix ``T`` is the key of the k-th best block and ``ties`` the number of
   blocks with key ``T`` to take. Blocks with equal keys rank by block id ascending, so the chosen
   set is every key above ``T`` plus the first ``ties`` keys equal to ``T`` in id order: exactly the
   reference's (score desc, id asc) order. A pass that finds its bin taken whole
   (``count == remaining``) ends the search early with a shorter prefix; the final compaction then
   compares the keys' top bits only. The compaction walks the keys in id order, so the ids come out
   ascending; the rest of the row is -1. ``tl.histogram`` is a ballot histogram (about 65 warp
   instructions per 32 keys for 8 bits), so this kernel is issue-bound: the candidate compaction
   keeps the later passes to the keys of one bin.

``apply_candidate_mask`` builds one flag byte per block and row (set for every listed id in
``[0, row blocks)``) and runs ``_mask_kernel``, which walks the row's tiles and stores ``-inf`` on
every column outside ``[starts, ends)`` or in an unlisted block. It never reads the logits: kept
entries are untouched, and the masked ones are written without being read. From
``_MASK_FUSED_MIN_ROWS`` rows on (``fused_flags``) one mask program per row builds its own flags
first (one launch); below, a memset and ``_candidate_flags_kernel`` fill the flags and the mask
kernel's programs (about ``_TARGET_PROGRAMS`` in all, a few per row) share the row's tiles. The
``-inf`` stores are streaming (``.cs``) stores (``streaming``).

``vector`` path of the block-keys and mask kernels (the default since run 4 of session 3): tiles
wholly inside a row whose start is a multiple of 4 (unit column stride) take a second, unmasked path
whose addresses the compiler can prove 16-byte aligned (``(start // 4) * 4``), so they load / store
16 bytes per instruction; other tiles keep the masked scalar path (``vector=False`` everywhere).
The switches are keyword arguments of the host functions, their defaults the module constants
``_KEYS_VECTOR``, ``_MASK_VECTOR``, ``_MASK_FUSED_MIN_ROWS`` and ``_MASK_STREAMING``.

Loops whose trip count is a run-time value are ``while`` loops: Triton's CPU interpreter (with
numpy 2) cannot turn a run-time bound into a Python ``range``. No host synchronisation anywhere:
the ops are CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_KEYS_TILE = 8192
_SELECT_CHUNK = 4096
_SELECT_WARPS = 8
_MASK_TILE = 2048  # run 4: 84.8 µs at R 512 against 85.9 for 4096 and 86.0 for 8192
_RADIX_BITS = 8
_TARGET_PROGRAMS = 1024
_SELECT_MAX_REGISTERS = 128  # 8 warps: two selection programs per SM (uncapped, ptxas takes 165: one)
# Defaults of the switches, each also a keyword argument. Run 4 (session 3) made the 16-byte paths the default.
_KEYS_VECTOR = True  # 16-byte loads in the block-keys pass on aligned interior tiles (149 -> 81 µs at R 512)
_MASK_VECTOR = True  # 16-byte stores in the mask kernel on aligned interior tiles (90.6 -> 84.8 µs at R 512)
_MASK_FUSED_MIN_ROWS = 256  # rows from which one mask kernel also builds the flags (None: never)
_MASK_STREAMING = True  # streaming (.cs) stores in the mask kernel


@triton.jit
def _row_bounds(starts_ptr, ends_ptr, row, row_repeat, HAS_STARTS: tl.constexpr):
    """(first column, length) of ``row`` as int64 scalars."""
    bound = row // row_repeat
    end = tl.load(ends_ptr + bound).to(tl.int64)
    if HAS_STARTS:
        start = tl.load(starts_ptr + bound).to(tl.int64)
    else:
        start = end * 0
    return start, end - start


@triton.jit
def _pick_bin(hist, bins, remaining):
    """The bin holding the ``remaining``-th largest counted key of ``hist`` [BINS], the count above
    it and the count in it."""
    at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # [BINS] keys with digit >= bin
    chosen = tl.max(tl.where(at_least >= remaining, bins, 0), axis=0)
    above = tl.sum(tl.where(bins > chosen, hist, 0), axis=0)
    in_bin = tl.sum(tl.where(bins == chosen, hist, 0), axis=0)
    return chosen, above, in_bin


@triton.jit(do_not_specialize=["row_repeat"])
def _block_keys_kernel(
    logits_ptr, starts_ptr, ends_ptr, keys_ptr,
    row_repeat, stride_row, stride_col, keys_stride,
    HAS_STARTS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_J: tl.constexpr,
    VECTOR: tl.constexpr,
):
    """``VECTOR`` (only with unit column stride): a tile wholly inside a row whose start is a multiple
    of 4 is read unmasked from a base the compiler knows to be 4-aligned, i.e. with 16-byte loads;
    other tiles take the masked scalar path."""
    row = tl.program_id(0).to(tl.int64)
    start, length = _row_bounds(starts_ptr, ends_ptr, row, row_repeat, HAS_STARTS)
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


@triton.jit(do_not_specialize=["row_repeat", "num_blocks_k"])
def _select_kernel(
    keys_ptr, cand_ptr, starts_ptr, ends_ptr, out_ptr,
    row_repeat, num_blocks_k, keys_stride, out_stride_row, out_stride_col,
    HAS_STARTS: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr, RADIX_BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    _, length = _row_bounds(starts_ptr, ends_ptr, row, row_repeat, HAS_STARTS)
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


@triton.jit(do_not_specialize=["row_repeat", "num_candidates"])
def _candidate_flags_kernel(
    candidates_ptr, starts_ptr, ends_ptr, flags_ptr,
    row_repeat, num_candidates, cand_stride_row, cand_stride_col, flags_stride,
    HAS_STARTS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    _, length = _row_bounds(starts_ptr, ends_ptr, row, row_repeat, HAS_STARTS)
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
    VECTOR: tl.constexpr, FUSED_FLAGS: tl.constexpr, BLOCK_K: tl.constexpr, STORE_CACHE: tl.constexpr,
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
    visible to its own later loads. ``STORE_CACHE`` is the ``-inf`` stores' cache modifier.
    """
    row = tl.program_id(0).to(tl.int64)
    start64, length64 = _row_bounds(starts_ptr, ends_ptr, row, row_repeat, HAS_STARTS)
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
                             cache_modifier=STORE_CACHE)
                else:
                    tl.store(row_ptr + column, minus_inf, mask=unlisted[:, None] & (offset < BLOCK_SIZE)[None, :],
                             cache_modifier=STORE_CACHE)
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
                         cache_modifier=STORE_CACHE)
        tile += programs_per_row


def _tiles(block_size: int, tile: int) -> tuple[int, int]:
    """(BLOCK_NB, BLOCK_J): blocks per tile and positions per block step, ``BLOCK_NB * BLOCK_J <= tile``."""
    block_j = min(triton.next_power_of_2(block_size), tile)
    return max(1, tile // block_j), block_j


def _bounds_args(starts: torch.Tensor | None, ends: torch.Tensor) -> tuple[torch.Tensor, bool]:
    return (ends, False) if starts is None else (starts, True)


def _programs_per_row(num_rows: int, tiles: int) -> int:
    """Programs sharing one row's tiles, so that about ``_TARGET_PROGRAMS`` programs run in all."""
    return max(1, min(triton.cdiv(_TARGET_PROGRAMS, max(num_rows, 1)), tiles))


def block_keys(logits: torch.Tensor, starts: torch.Tensor | None, ends: torch.Tensor, block_size: int,
               row_repeat: int, *, vector: bool | None = None, tile: int = _KEYS_TILE) -> torch.Tensor:
    """First stage: int32 block keys ``[R, max(ceil(C / block_size), 1)]``. ``vector`` (default
    ``_KEYS_VECTOR``) enables the 16-byte-load path (used only with a unit column stride); ``tile`` is
    the positions per program."""
    num_rows, width = logits.shape
    max_blocks = triton.cdiv(width, block_size)
    keys = torch.empty((num_rows, max(max_blocks, 1)), dtype=torch.int32, device=logits.device)
    if num_rows and max_blocks:
        vector = (_KEYS_VECTOR if vector is None else vector) and logits.stride(1) == 1
        starts_arg, has_starts = _bounds_args(starts, ends)
        block_nb, block_j = _tiles(block_size, tile)
        block_nb = min(block_nb, triton.next_power_of_2(max_blocks))
        _block_keys_kernel[(num_rows, triton.cdiv(max_blocks, block_nb))](
            logits, starts_arg, ends, keys,
            row_repeat, logits.stride(0), logits.stride(1), keys.stride(0),
            HAS_STARTS=has_starts, BLOCK_SIZE=block_size, BLOCK_NB=block_nb, BLOCK_J=block_j, VECTOR=vector,
            num_warps=8,
        )
    return keys


def select_from_keys(keys: torch.Tensor, starts: torch.Tensor | None, ends: torch.Tensor, num_blocks_k: int,
                     block_size: int, row_repeat: int, out: torch.Tensor) -> torch.Tensor:
    """Second stage: the ``num_blocks_k`` best block ids of each row of ``keys`` into ``out`` (the
    radix kernel, one program of ``_SELECT_WARPS`` warps per row scanning ``_SELECT_CHUNK`` keys per
    step)."""
    if out.shape[0]:
        starts_arg, has_starts = _bounds_args(starts, ends)
        candidates = torch.empty_like(keys)
        _select_kernel[(out.shape[0],)](
            keys, candidates, starts_arg, ends, out,
            row_repeat, num_blocks_k, keys.stride(0), out.stride(0), out.stride(1),
            HAS_STARTS=has_starts, BLOCK_SIZE=block_size, CHUNK=_SELECT_CHUNK, RADIX_BITS=_RADIX_BITS,
            num_warps=_SELECT_WARPS, maxnreg=_SELECT_MAX_REGISTERS,
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
    vector: bool | None = None,
    keys_tile: int = _KEYS_TILE,
) -> torch.Tensor:
    """Triton twin of ``select_candidate_blocks_reference``; ``vector`` and ``keys_tile`` go to
    ``block_keys``."""
    if out is None:
        out = torch.empty((logits.shape[0], num_blocks_k), dtype=torch.int32, device=logits.device)
    keys = block_keys(logits, starts, ends, block_size, row_repeat, vector=vector, tile=keys_tile)
    return select_from_keys(keys, starts, ends, num_blocks_k, block_size, row_repeat, out)


def apply_candidate_mask_triton(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    candidate_blocks: torch.Tensor,
    block_size: int,
    row_repeat: int,
    *,
    vector: bool | None = None,
    tile: int = _MASK_TILE,
    fused_flags: bool | None = None,
    streaming: bool | None = None,
) -> None:
    """Triton twin of ``apply_candidate_mask_reference`` (in place). ``vector`` (default
    ``_MASK_VECTOR``) enables the 16-byte-store path (unit column stride, ``block_size % 4 == 0``);
    ``tile`` is the positions per mask tile; ``fused_flags`` (default: ``num_rows >=
    _MASK_FUSED_MIN_ROWS``) runs one mask program per row that builds its own flags (one launch instead
    of three); ``streaming`` (default ``_MASK_STREAMING``) marks the stores ``.cs``."""
    num_rows, width = logits.shape
    if num_rows == 0 or width == 0:
        return
    vector = (_MASK_VECTOR if vector is None else vector) and logits.stride(1) == 1 and block_size % 4 == 0
    if fused_flags is None:
        fused_flags = _MASK_FUSED_MIN_ROWS is not None and num_rows >= _MASK_FUSED_MIN_ROWS
    streaming = _MASK_STREAMING if streaming is None else streaming
    starts_arg, has_starts = _bounds_args(starts, ends)
    max_blocks = triton.cdiv(width, block_size)
    num_candidates = candidate_blocks.shape[1]
    block_nb, block_j = _tiles(block_size, tile)
    block_nb = min(block_nb, triton.next_power_of_2(max_blocks + 1))
    if fused_flags:
        flags = torch.empty((num_rows, max_blocks), dtype=torch.int8, device=logits.device)
        programs = 1
    else:
        flags = torch.zeros((num_rows, max_blocks), dtype=torch.int8, device=logits.device)
        programs = _programs_per_row(num_rows, triton.cdiv(max_blocks + 1, block_nb))
    if num_candidates and not fused_flags:
        block_k = min(1024, triton.next_power_of_2(num_candidates))
        _candidate_flags_kernel[(num_rows, triton.cdiv(num_candidates, block_k))](
            candidate_blocks, starts_arg, ends, flags,
            row_repeat, num_candidates, candidate_blocks.stride(0), candidate_blocks.stride(1), flags.stride(0),
            HAS_STARTS=has_starts, BLOCK_SIZE=block_size, BLOCK_K=block_k, num_warps=4,
        )
    _mask_kernel[(num_rows, programs)](
        logits, starts_arg, ends, flags, candidate_blocks,
        row_repeat, width, programs, max_blocks + 1, logits.stride(0), logits.stride(1), flags.stride(0),
        num_candidates, candidate_blocks.stride(0), candidate_blocks.stride(1),
        HAS_STARTS=has_starts, BLOCK_SIZE=block_size, BLOCK_NB=block_nb, BLOCK_J=block_j, VECTOR=vector,
        FUSED_FLAGS=fused_flags, BLOCK_K=1024, STORE_CACHE=".cs" if streaming else "", num_warps=8,
    )
