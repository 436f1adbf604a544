"""Triton kernels of the top-k family (twins of ``reference.py``): exact, deterministic radix selection.

Keys. Every entry becomes an int32 key whose signed order is the order of the fp32 values
(``ops/_order.py``'s ``float_order_key``): ``-0.0`` is first canonicalised to ``+0.0``, then the bits
``b`` map to ``b`` when ``b >= 0`` and to ``b ^ 0x7FFFFFFF`` when ``b < 0``. NaN, ``-inf`` and entries
outside the row window become ``NONE = -2**31``, below every selectable key (the smallest selectable
key, that of ``-FLT_MAX``, is ``0x80800000 > -2**31``). Keys are compared as integers only, so the
interpreter and the GPU agree bit for bit.

Selection rule. With ``T`` the ``k``-th largest selectable key of a row and ``G = #(key > T)``, the
contract's selection is every entry with ``key > T`` plus the first ``k - G`` entries (lowest columns)
with ``key == T``. When the row has at most ``k`` selectable entries, ``T = NONE`` and ``k - G`` is
taken as 0: every selectable entry, nothing else. Emitting is an ordered compaction: the output
position of a taken entry is the number of taken entries at lower columns (an inclusive prefix sum,
minus one), so columns come out ascending, and positions ``[taken, k)`` are padded with ``-1``.

Finding ``T`` (``_kth_largest``). ``T = max{t : #(key >= t) >= k}``, found bit by bit over the
unsigned image ``u = key ^ 0x80000000``: starting from a lower bound ``t``, set bit ``b`` when the
count of keys ``>= t | 2**b`` is still ``>= k``. Because ``t``'s bits ``<= b`` are zero at that
moment, setting bit ``b`` of ``u`` is toggling bit ``b`` of the signed key, so the search runs on
int32 directly. The search starts at the common high bits of ``lo`` (smallest selectable key) and
``hi`` (largest key): ``T`` lies in ``[lo, hi]`` and shares them, so only ``bit_length(lo ^ hi)``
rounds are needed (10 for rows whose values share 22 high bits). Each round is one block reduction.

Short rows (``width <= row_block_max``): one program per row holds the whole window in registers,
finds ``T`` and emits: one launch, no scratch.

Long rows (split path, three passes over the logits and small int32 scratch):

1. *Group maxima.* Programs own ``CHUNK`` columns of one row and store the maximum key of each group
   of ``GROUP`` consecutive columns. The last program of a row to finish (an atomic arrival counter)
   computes ``T_low``, the ``k``-th largest group maximum (``NONE`` when fewer than ``k`` groups hold a
   selectable entry). ``T >= T_low``: the ``k`` groups whose maxima are ``>= T_low`` give ``k``
   distinct entries ``>= T_low``. At most ``k - 1`` groups have a maximum ``> T_low``, so at most
   ``(k - 1) * GROUP`` entries are ``> T_low``: the candidate buffer below never overflows (when
   ``T_low = NONE`` the candidates are the selectable entries, at most ``(k - 1) * GROUP`` as well).
   ``GROUP`` is the smallest power of two that keeps a row's groups within one register tile
   (``group_tile``), so for random data the candidates number about ``1.15 k``.
2. *Candidates.* Each program appends its keys ``> T_low`` to the row's buffer (an atomic cursor; the
   order does not matter). The row's last program finds ``T``: if fewer than ``k`` candidates exist,
   ``T = T_low`` and ``k - #candidates`` ties are taken, else ``T`` is the ``k``-th largest candidate
   (every key ``>= T`` is a candidate) and ``k - #(candidates > T)`` ties are taken.
3. *Emit.* Each program counts its keys ``> T`` and ``== T``, publishes both in a per-row flag array
   and sums the flags of the lower chunks of its row (decoupled look-back: a program waits only for
   programs of lower ids, which the hardware dispatches first, as CUB's single-pass scan assumes;
   under the interpreter programs run in id order). Ties go to the lowest columns through the prefix
   count of ties, and each program writes its taken columns at its prefix offset; the row's last chunk
   pads with ``-1``.

Pass 2 walks the rows in reverse order so that it starts on the rows pass 1 left in L2, pass 3 in
forward order for the same reason. All scratch is allocated with ``torch.empty``/``torch.zeros`` by
the wrappers; nothing is read back to the host, so the launches are CUDA-graph capturable. Scratch per
row: ``4 * (group tile + min((k - 1) * GROUP, width) + 8 + flags)`` bytes.

Strides: any logits strides (column stride 0 or > 1 included) and any ``out`` strides are honoured in
the kernels; no copy is made. ``starts``/``ends``/``seq_lens`` are made contiguous (a no-op for the
usual tensors). Addresses are computed in int64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

NONE = tl.constexpr(-(2**31))
KEY_MAX = tl.constexpr(2**31 - 1)
INF_BITS = tl.constexpr(0x7F800000)
NEG_INF_BITS = tl.constexpr(-8388608)  # 0xFF800000 as int32

# Per-row state words of the split path (int32, zero-initialised), then one flag per chunk.
_ARRIVED_GROUPS = tl.constexpr(0)
_ARRIVED_CANDIDATES = tl.constexpr(1)
_NUM_CANDIDATES = tl.constexpr(2)
_T_LOW = tl.constexpr(3)
_THRESHOLD = tl.constexpr(4)
_TIES = tl.constexpr(5)
_FLAGS = tl.constexpr(8)
_STATE_WORDS = 8

_PAD_BLOCK = 1024
_SLOT_BLOCK = 1024


@dataclass(frozen=True)
class TopkConfig:
    """Tuning of the Triton top-k (tests shrink these to reach every path with tiny shapes).

    row_block_max: widths up to this use one program per row (power of two).
    chunk: columns per program on the split path (power of two).
    group_tile: most group maxima per row on the split path; ``None`` = ``clamp(4k, 1024, 8192)``.
    candidate_block: candidates searched in registers; ``None`` = ``clamp(2k, 1024, 16384)``.
    """

    row_block_max: int = 8192
    chunk: int = 4096
    group_tile: int | None = None
    candidate_block: int | None = None


DEFAULT_CONFIG = TopkConfig()


@triton.jit
def _row_window(row, starts_ptr, ends_ptr, width, next_n, HAS_STARTS: tl.constexpr, ENDS_MODE: tl.constexpr):
    """(start, length) of a row's window. ENDS_MODE 0: ``width``; 1: ``ends[row]``; 2: decode request
    lengths ``L = ends[row // next_n]``, end ``max(L - next_n + row % next_n + 1, 0)``."""
    start = row * 0
    if HAS_STARTS:
        start = tl.load(starts_ptr + row)
    end = row * 0 + width
    if ENDS_MODE == 1:
        end = tl.load(ends_ptr + row)
    if ENDS_MODE == 2:
        request_len = tl.load(ends_ptr + row // next_n)
        end = tl.maximum(request_len - next_n + row % next_n + 1, 0)
    return start, end - start


@triton.jit
def _order_keys(values, inside):
    """int32 order keys of fp32 ``values``; NaN, -inf and entries not ``inside`` give NONE."""
    bits = values.to(tl.int32, bitcast=True)
    bits = tl.where(bits == NONE, 0, bits)
    selectable = inside & ((bits & KEY_MAX) <= INF_BITS) & (bits != NEG_INF_BITS)
    keys = bits ^ ((bits >> 31) & KEY_MAX)
    return tl.where(selectable, keys, NONE)


@triton.jit
def _bit_length(x):
    """Bit length of the int32 ``x`` read as unsigned (may exceed the true one by 1: harmless here)."""
    magnitude = (x & KEY_MAX).to(tl.float32)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126
    return tl.where(x < 0, 32, tl.where(x == 0, 0, exponent))


@triton.jit
def _search_start(lo, hi):
    """(start key, rounds): ``lo`` with its low ``bit_length(lo ^ hi)`` unsigned bits cleared."""
    rounds = _bit_length(lo ^ hi)
    low_mask = ((tl.full([], 1, tl.int64) << rounds.to(tl.int64)) - 1).to(tl.int32)
    return ((lo ^ NONE) & ~low_mask) ^ NONE, rounds


@triton.jit
def _kth_largest(keys, k):
    """Largest t with ``#(keys >= t) >= k``; needs at least k keys other than NONE."""
    lo = tl.min(tl.where(keys != NONE, keys, KEY_MAX), axis=0)
    hi = tl.max(keys, axis=0)
    t, bit = _search_start(lo, hi)
    while bit > 0:
        bit -= 1
        candidate = t ^ (1 << bit)
        count = tl.sum((keys >= candidate).to(tl.int32), axis=0)
        t = tl.where(count >= k, candidate, t)
    return t


@triton.jit
def _kth_largest_in_memory(ptr, n, k, TILE: tl.constexpr):
    """``_kth_largest`` over the ``n`` keys at ``ptr`` (written by other programs of this launch)."""
    offsets = tl.arange(0, TILE)
    lo = n * 0 + KEY_MAX
    hi = n * 0 + NONE
    first = n * 0
    while first < n:
        keys = tl.load(ptr + first + offsets, mask=first + offsets < n, other=NONE, cache_modifier=".cg")  # [TILE]
        lo = tl.minimum(lo, tl.min(tl.where(keys != NONE, keys, KEY_MAX), axis=0))
        hi = tl.maximum(hi, tl.max(keys, axis=0))
        first += TILE
    t, bit = _search_start(lo, hi)
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
def _emit_taken(greater, equal, columns, ties_left, base, out_row, out_stride_col):
    """Write the columns of ``greater`` entries and of the first ``ties_left`` ``equal`` entries at
    positions ``base, base + 1, ...`` in column order; return ``base`` + the number written."""
    tie_rank = tl.cumsum(equal.to(tl.int32), axis=0)
    take = greater | (equal & (tie_rank <= ties_left))
    position = base + tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_row + position.to(tl.int64) * out_stride_col, columns, mask=take)
    return base + tl.sum(take.to(tl.int32), axis=0)


@triton.jit
def _pad_row(out_row, out_stride_col, first, k, PAD_BLOCK: tl.constexpr):
    """``-1`` into positions ``[first, k)``."""
    padding = tl.full([PAD_BLOCK], -1, tl.int32)
    while first < k:
        position = first + tl.arange(0, PAD_BLOCK)  # [PAD_BLOCK]
        tl.store(out_row + position.to(tl.int64) * out_stride_col, padding, mask=position < k)
        first += PAD_BLOCK


@triton.jit(do_not_specialize=["width", "k", "next_n"])
def _topk_row_kernel(
    logits_ptr, stride_row, stride_col, starts_ptr, ends_ptr, out_ptr, out_stride_row, out_stride_col,
    width, k, next_n,
    HAS_STARTS: tl.constexpr, ENDS_MODE: tl.constexpr, BLOCK: tl.constexpr, PAD_BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    start, length = _row_window(row, starts_ptr, ends_ptr, width, next_n, HAS_STARTS, ENDS_MODE)
    columns = tl.arange(0, BLOCK)  # [BLOCK] window-relative
    inside = columns < length
    src = logits_ptr + row.to(tl.int64) * stride_row + (start + columns).to(tl.int64) * stride_col
    keys = _order_keys(tl.load(src, mask=inside, other=0.0), inside)  # [BLOCK]
    num_selectable = tl.sum((keys != NONE).to(tl.int32), axis=0)
    threshold = num_selectable * 0 + NONE
    ties = num_selectable * 0
    if num_selectable > k:
        threshold = _kth_largest(keys, k)
        ties = k - tl.sum((keys > threshold).to(tl.int32), axis=0)
    out_row = out_ptr + row.to(tl.int64) * out_stride_row
    greater = keys > threshold
    equal = (keys == threshold) & (keys != NONE)
    taken = _emit_taken(greater, equal, columns, ties, ties * 0, out_row, out_stride_col)
    _pad_row(out_row, out_stride_col, taken, k, PAD_BLOCK)


@triton.jit(do_not_specialize=["width", "k", "next_n", "num_chunks"])
def _split_group_max_kernel(
    logits_ptr, stride_row, stride_col, starts_ptr, ends_ptr, group_max_ptr, state_ptr, state_stride,
    width, k, next_n, num_chunks,
    HAS_STARTS: tl.constexpr, ENDS_MODE: tl.constexpr,
    CHUNK: tl.constexpr, GROUP: tl.constexpr, GROUP_TILE: tl.constexpr,
):
    GROUPS_PER_CHUNK: tl.constexpr = CHUNK // GROUP
    pid = tl.program_id(0)
    row = pid // num_chunks
    chunk = pid % num_chunks
    start, length = _row_window(row, starts_ptr, ends_ptr, width, next_n, HAS_STARTS, ENDS_MODE)
    row_chunks = tl.maximum(tl.cdiv(length, CHUNK), 1)
    if chunk < row_chunks:
        group_ids = tl.arange(0, GROUPS_PER_CHUNK)  # [GROUPS_PER_CHUNK]
        columns = chunk * CHUNK + group_ids[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS_PER_CHUNK, GROUP]
        inside = columns < length
        src = logits_ptr + row.to(tl.int64) * stride_row + (start + columns).to(tl.int64) * stride_col
        keys = _order_keys(tl.load(src, mask=inside, other=0.0), inside)  # [GROUPS_PER_CHUNK, GROUP]
        group_row = group_max_ptr + row.to(tl.int64) * GROUP_TILE
        tl.store(group_row + chunk * GROUPS_PER_CHUNK + group_ids, tl.max(keys, axis=1))
        state_row = state_ptr + row.to(tl.int64) * state_stride
        tl.debug_barrier()
        arrived = tl.atomic_add(state_row + _ARRIVED_GROUPS, 1, sem="acq_rel", scope="gpu")
        if arrived == row_chunks - 1:
            tile = tl.arange(0, GROUP_TILE)  # [GROUP_TILE]
            maxima = tl.load(group_row + tile, mask=tile < row_chunks * GROUPS_PER_CHUNK, other=NONE,
                             cache_modifier=".cg")  # [GROUP_TILE]
            selectable_groups = tl.sum((maxima != NONE).to(tl.int32), axis=0)
            t_low = selectable_groups * 0 + NONE
            if selectable_groups >= k:
                t_low = _kth_largest(maxima, k)
            tl.store(state_row + _T_LOW, t_low)


@triton.jit(do_not_specialize=["width", "k", "next_n", "num_rows", "num_chunks"])
def _split_candidates_kernel(
    logits_ptr, stride_row, stride_col, starts_ptr, ends_ptr, cand_ptr, cand_stride, state_ptr, state_stride,
    width, k, next_n, num_rows, num_chunks,
    HAS_STARTS: tl.constexpr, ENDS_MODE: tl.constexpr, CHUNK: tl.constexpr, CANDIDATE_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = num_rows - 1 - pid // num_chunks
    chunk = pid % num_chunks
    start, length = _row_window(row, starts_ptr, ends_ptr, width, next_n, HAS_STARTS, ENDS_MODE)
    row_chunks = tl.maximum(tl.cdiv(length, CHUNK), 1)
    if chunk < row_chunks:
        state_row = state_ptr + row.to(tl.int64) * state_stride
        t_low = tl.load(state_row + _T_LOW)
        columns = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
        inside = columns < length
        src = logits_ptr + row.to(tl.int64) * stride_row + (start + columns).to(tl.int64) * stride_col
        keys = _order_keys(tl.load(src, mask=inside, other=0.0), inside)  # [CHUNK]
        is_candidate = keys > t_low
        first = tl.atomic_add(state_row + _NUM_CANDIDATES, tl.sum(is_candidate.to(tl.int32), axis=0),
                              sem="relaxed", scope="gpu")
        cand_row = cand_ptr + row.to(tl.int64) * cand_stride
        position = first + tl.cumsum(is_candidate.to(tl.int32), axis=0) - 1
        tl.store(cand_row + position, keys, mask=is_candidate)
        tl.debug_barrier()
        arrived = tl.atomic_add(state_row + _ARRIVED_CANDIDATES, 1, sem="acq_rel", scope="gpu")
        if arrived == row_chunks - 1:
            total = tl.load(state_row + _NUM_CANDIDATES, volatile=True)
            threshold = t_low
            ties = tl.where(t_low != NONE, k - total, 0)
            if total >= k:
                if total <= CANDIDATE_BLOCK:
                    tile = tl.arange(0, CANDIDATE_BLOCK)  # [CANDIDATE_BLOCK]
                    candidates = tl.load(cand_row + tile, mask=tile < total, other=NONE, cache_modifier=".cg")
                    threshold = _kth_largest(candidates, k)
                    ties = k - tl.sum((candidates > threshold).to(tl.int32), axis=0)
                else:
                    threshold = _kth_largest_in_memory(cand_row, total, k, CANDIDATE_BLOCK)
                    ties = k - _count_above_in_memory(cand_row, total, threshold, CANDIDATE_BLOCK)
            tl.store(state_row + _THRESHOLD, threshold)
            tl.store(state_row + _TIES, ties)


@triton.jit(do_not_specialize=["width", "k", "next_n", "num_chunks"])
def _split_emit_kernel(
    logits_ptr, stride_row, stride_col, starts_ptr, ends_ptr, out_ptr, out_stride_row, out_stride_col,
    state_ptr, state_stride,
    width, k, next_n, num_chunks,
    HAS_STARTS: tl.constexpr, ENDS_MODE: tl.constexpr, CHUNK: tl.constexpr, FLAG_TILE: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // num_chunks
    chunk = pid % num_chunks
    start, length = _row_window(row, starts_ptr, ends_ptr, width, next_n, HAS_STARTS, ENDS_MODE)
    row_chunks = tl.maximum(tl.cdiv(length, CHUNK), 1)
    if chunk < row_chunks:
        state_row = state_ptr + row.to(tl.int64) * state_stride
        threshold = tl.load(state_row + _THRESHOLD)
        ties = tl.load(state_row + _TIES)
        columns = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
        inside = columns < length
        src = logits_ptr + row.to(tl.int64) * stride_row + (start + columns).to(tl.int64) * stride_col
        keys = _order_keys(tl.load(src, mask=inside, other=0.0), inside)  # [CHUNK]
        greater = keys > threshold
        equal = (keys == threshold) & (keys != NONE)
        num_greater = tl.sum(greater.to(tl.int32), axis=0)
        num_equal = tl.sum(equal.to(tl.int32), axis=0)
        tl.atomic_xchg(state_row + _FLAGS + chunk, 1 + num_greater + (num_equal << 16), sem="relaxed", scope="gpu")
        lower = tl.arange(0, FLAG_TILE)  # [FLAG_TILE]
        is_lower = lower < chunk
        flags = tl.load(state_row + _FLAGS + lower, mask=is_lower, other=1, volatile=True)  # [FLAG_TILE]
        while tl.min(flags, axis=0) == 0:
            flags = tl.load(state_row + _FLAGS + lower, mask=is_lower, other=1, volatile=True)
        greater_before = tl.sum((flags & 0xFFFF) - 1, axis=0)
        equal_before = tl.sum(flags >> 16, axis=0)
        out_row = out_ptr + row.to(tl.int64) * out_stride_row
        base = greater_before + tl.minimum(equal_before, ties)
        taken = _emit_taken(greater, equal, columns, ties - equal_before, base, out_row, out_stride_col)
        if chunk == row_chunks - 1:
            _pad_row(out_row, out_stride_col, taken, k, PAD_BLOCK)


@triton.jit(do_not_specialize=["k", "block_size"])
def _indices_to_slots_kernel(
    indices_ptr, idx_stride_row, idx_stride_col, table_ptr, table_stride_row, table_stride_col,
    request_ptr, out_ptr, k, block_size, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    position = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    in_row = position < k
    index = tl.load(indices_ptr + row.to(tl.int64) * idx_stride_row + position.to(tl.int64) * idx_stride_col,
                    mask=in_row, other=-1)  # [BLOCK]
    valid = in_row & (index >= 0)
    local = tl.maximum(index, 0).to(tl.int64)
    request = tl.load(request_ptr + row).to(tl.int64)
    page = tl.load(table_ptr + request * table_stride_row + (local // block_size) * table_stride_col,
                   mask=valid, other=0).to(tl.int64)  # [BLOCK]
    slot = page * block_size + local % block_size
    tl.store(out_ptr + row.to(tl.int64) * k + position, tl.where(valid, slot, -1).to(tl.int32), mask=in_row)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _bounds_args(starts: torch.Tensor | None, ends: torch.Tensor | None, decode: bool, logits: torch.Tensor):
    has_starts = starts is not None
    ends_mode = 2 if decode else (1 if ends is not None else 0)
    starts_arg = starts.contiguous() if has_starts else logits
    ends_arg = ends.contiguous() if ends is not None else logits
    return starts_arg, ends_arg, has_starts, ends_mode


def _launch(logits, k, starts, ends, out, next_n, decode, config):
    num_rows, width = logits.shape
    if num_rows == 0:
        return out
    starts_arg, ends_arg, has_starts, ends_mode = _bounds_args(starts, ends, decode, logits)
    common = dict(HAS_STARTS=has_starts, ENDS_MODE=ends_mode)
    if width <= config.row_block_max:
        block = max(16, _next_pow2(width))
        _topk_row_kernel[(num_rows,)](
            logits, logits.stride(0), logits.stride(1), starts_arg, ends_arg, out, out.stride(0), out.stride(1),
            width, k, next_n, BLOCK=block, PAD_BLOCK=_PAD_BLOCK, num_warps=4 if block <= 1024 else 8, **common,
        )
        return out
    chunk = config.chunk
    num_chunks = triton.cdiv(width, chunk)
    group_tile_max = config.group_tile or min(8192, max(1024, _next_pow2(4 * k)))
    group = 1
    while num_chunks * chunk // group > group_tile_max:
        group *= 2
    if group > chunk:
        raise ValueError(f"logits width {width} is too large for the top-k split path (chunk {chunk})")
    group_tile = _next_pow2(num_chunks * chunk // group)
    candidate_block = config.candidate_block or min(16384, max(1024, _next_pow2(2 * k)))
    capacity = max(1, min((k - 1) * group, width))
    flag_tile = _next_pow2(num_chunks)
    state_stride = _STATE_WORDS + flag_tile
    device = logits.device
    state = torch.zeros((num_rows, state_stride), dtype=torch.int32, device=device)
    group_max = torch.empty((num_rows, group_tile), dtype=torch.int32, device=device)
    candidates = torch.empty((num_rows, capacity), dtype=torch.int32, device=device)
    grid = (num_rows * num_chunks,)
    rows_args = (logits, logits.stride(0), logits.stride(1), starts_arg, ends_arg)
    _split_group_max_kernel[grid](
        *rows_args, group_max, state, state_stride, width, k, next_n, num_chunks,
        CHUNK=chunk, GROUP=group, GROUP_TILE=group_tile, num_warps=8, **common,
    )
    _split_candidates_kernel[grid](
        *rows_args, candidates, capacity, state, state_stride, width, k, next_n, num_rows, num_chunks,
        CHUNK=chunk, CANDIDATE_BLOCK=candidate_block, num_warps=8, **common,
    )
    _split_emit_kernel[grid](
        *rows_args, out, out.stride(0), out.stride(1), state, state_stride, width, k, next_n, num_chunks,
        CHUNK=chunk, FLAG_TILE=flag_tile, PAD_BLOCK=_PAD_BLOCK, num_warps=8, **common,
    )
    return out


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
) -> torch.Tensor:
    """Twin of ``reference.topk_decode``; row lengths are computed from ``seq_lens`` on the device."""
    if seq_lens.dim() == 2:
        return _launch(logits, k, None, seq_lens.reshape(-1), out, 1, False, config)
    return _launch(logits, k, None, seq_lens, out, next_n, True, config)


def indices_to_slots_triton(
    indices: torch.Tensor, block_table: torch.Tensor, block_size: int, row_to_request: torch.Tensor
) -> torch.Tensor:
    """Twin of ``reference.indices_to_slots``: ``block_table[request, p // bs] * bs + p % bs``, ``-1`` kept."""
    num_rows, k = indices.shape
    slots = torch.empty((num_rows, k), dtype=torch.int32, device=indices.device)
    if num_rows == 0 or k == 0:
        return slots
    _indices_to_slots_kernel[(num_rows, triton.cdiv(k, _SLOT_BLOCK))](
        indices, indices.stride(0), indices.stride(1), block_table, block_table.stride(0), block_table.stride(1),
        row_to_request.contiguous(), slots, k, block_size, BLOCK=_SLOT_BLOCK, num_warps=4,
    )
    return slots
