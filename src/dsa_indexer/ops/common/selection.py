"""Device-side selection primitives shared by the top-k, candidate-block and distributed selections.

Every selection ranks fp32 (or bf16, widened exactly) values through int32 *order keys* whose signed order is
the values' order (``ops/_order.py``'s ``float_order_key``; NaN, ``-inf`` and entries outside a window become
``NONE``), searched on their uint32 *order images* (``key ^ NONE``: ``NONE -> 0``) with counts taken by carry
chains where the GPU can run them. The derivations are in ``ops/topk/README.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import interpreting

NONE = tl.constexpr(-(2**31))  # the key of every unselectable entry, below every selectable key
KEY_MAX = tl.constexpr(2**31 - 1)
INF_BITS = tl.constexpr(0x7F800000)
NEG_INF_BITS = tl.constexpr(-8388608)  # 0xFF800000 as int32
LOW_FIELD = tl.constexpr(0xFFFF)  # the low 16-bit field of two counts packed in one int32


def carry_mode(elements: int, threads: int) -> int:
    """``CARRY`` of ``reaches_unsigned`` for a tile of ``elements`` counted by ``threads`` threads: 0 (compare)
    under Triton's CPU interpreter (no inline PTX there; the counts are the same), 4 where every thread holds a
    multiple of 4 of them, else 1."""
    if interpreting():
        return 0
    return 4 if elements % (4 * threads) == 0 else 1


def timeline_args(timeline: dict | None, name: str, programs: int, slots: int, device: torch.device) -> dict:
    """Kernel arguments of the phase timeline (``stamp``, a private timing probe): none when ``timeline`` is None
    (the kernels then compile as without it), else ``timeline[name]``, an int64 ``[programs, slots]`` buffer of
    zeros created on the first call (a later call, e.g. under graph capture, reuses it: the caller zeroes it
    between replays)."""
    if timeline is None:
        return {}
    if name not in timeline:
        timeline[name] = torch.zeros((programs, slots), dtype=torch.int64, device=device)
    return dict(timeline_ptr=timeline[name], TIMELINE=True)


@triton.jit
def stamp(timeline_ptr, program, slot, TIMELINE_SLOTS: tl.constexpr, TIMELINE: tl.constexpr):
    """Phase timeline (a timing probe, off by default): with ``TIMELINE``, once every warp of the program is done
    with the phase (a barrier), the global timer (ns) goes to ``timeline_ptr[program * TIMELINE_SLOTS + slot]``
    (one thread stores the scalar)."""
    if TIMELINE:
        tl.debug_barrier()
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [program], dtype=tl.int64,
                                        is_pure=False, pack=1)
        tl.store(timeline_ptr + program.to(tl.int64) * TIMELINE_SLOTS + slot, now)


@triton.jit
def order_keys(values, inside):
    """int32 order keys of fp32 (or bf16, widened exactly) ``values``; NaN, -inf and entries not ``inside``
    give NONE."""
    bits = values.to(tl.float32).to(tl.int32, bitcast=True)
    bits = tl.where(bits == NONE, 0, bits)
    selectable = inside & ((bits & KEY_MAX) <= INF_BITS) & (bits != NEG_INF_BITS)
    keys = bits ^ ((bits >> 31) & KEY_MAX)
    return tl.where(selectable, keys, NONE)


@triton.jit
def bit_length(x):
    """Bit length of the int32 ``x`` read as unsigned (may exceed the true one by 1: harmless here)."""
    magnitude = (x & KEY_MAX).to(tl.float32)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126
    return tl.where(x < 0, 32, tl.where(x == 0, 0, exponent))


@triton.jit
def clear_low_bits(lo, rounds):
    """``lo`` with its low ``rounds`` bits cleared in the unsigned image (``rounds`` in ``[0, 32]``)."""
    low_mask = ((tl.full([], 1, tl.int64) << rounds.to(tl.int64)) - 1).to(tl.int32)
    return ((lo ^ NONE) & ~low_mask) ^ NONE


@triton.jit
def order_image(keys):
    """uint32 order images of int32 keys (``key ^ NONE``: NONE -> 0, unsigned order = key order)."""
    return (keys ^ NONE).to(tl.uint32, bitcast=True)


@triton.jit
def reaches_unsigned(images, threshold, CARRY: tl.constexpr):
    """int32 partial counts of ``images >= threshold`` over uint32 order images (``threshold >= 1``, broadcast to
    ``images``): their sum along the rows' axis is each row's count. ``CARRY`` 0: compare. 1: each key's flag is
    the carry out of ``images + (2**32 - threshold)`` (PTX ``add.cc`` + ``addc``: a carry exactly when
    ``images >= threshold``). 4: the same, and the asm sums every 4 elements of a thread (an ``addc`` chain; the
    other three outputs are 0, which ptxas folds away): ≈ 1.5 instructions per key against ≈ 3.3 for compare,
    select and add; only where those 4 always lie in one row (one row per program) and a thread holds a multiple
    of 4 elements (the launcher decides)."""
    if CARRY == 0:
        return (images >= threshold).to(tl.int32)
    negated = tl.broadcast_to(0 - threshold, images.shape)  # 2**32 - threshold
    if CARRY == 4:
        return tl.inline_asm_elementwise(
            "{ .reg .u32 d; add.cc.u32 d, $4, $8; addc.u32 $0, 0, 0; add.cc.u32 d, $5, $9; addc.u32 $0, $0, 0; "
            "add.cc.u32 d, $6, $10; addc.u32 $0, $0, 0; add.cc.u32 d, $7, $11; addc.u32 $0, $0, 0; "
            "mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0; }",
            "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [images, negated], dtype=tl.int32, is_pure=True, pack=4)
    return tl.inline_asm_elementwise("{ .reg .u32 d; add.cc.u32 d, $1, $2; addc.u32 $0, 0, 0; }", "=r,r,r",
                                     [images, negated], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def reaching(images, threshold, CARRY: tl.constexpr):
    """int32 partial counts of ``keys >= threshold`` over a 1-D tile of the keys' uint32 images (``order_image``; their
    sum is the count), ``threshold`` an int32 key above NONE: ``reaches_unsigned`` with that ``CARRY``."""
    return reaches_unsigned(images, order_image(threshold), CARRY)


@triton.jit
def search_step(images, t, count, bit, k, CARRY: tl.constexpr):
    """Decide bits ``bit + 1`` and ``bit`` of ``t`` (both still clear in the unsigned image): the largest
    of ``t``, ``t + 2**bit``, ``t + 2 * 2**bit``, ``t + 3 * 2**bit`` that ``>= k`` keys of a 1-D tile reach
    (counted on their ``images`` as ``reaching``), with that number (``count`` = ``#(>= t)`` on entry).
    The three counts of a tile of at most 16384 keys share one int64 (16-bit fields), so a round costs one
    block reduction."""
    low = 1 << bit
    first = t ^ low
    second = t ^ (low << 1)
    third = second ^ low
    # Per 4 keys (CARRY 4): three carry chains, one shift-add; ptxas folds the asm's zero outputs away.
    near = reaching(images, first, CARRY) + (reaching(images, second, CARRY) << 16)
    packed = tl.sum(near.to(tl.int64) + (reaching(images, third, CARRY).to(tl.int64) << 32), axis=0)
    first_count = (packed & LOW_FIELD).to(tl.int32)
    second_count = ((packed >> 16) & LOW_FIELD).to(tl.int32)
    third_count = (packed >> 32).to(tl.int32)
    reaches_first = first_count >= k
    t = tl.where(reaches_first, first, t)
    count = tl.where(reaches_first, first_count, count)
    reaches_second = second_count >= k
    t = tl.where(reaches_second, second, t)
    count = tl.where(reaches_second, second_count, count)
    reaches_third = third_count >= k
    t = tl.where(reaches_third, third, t)
    count = tl.where(reaches_third, third_count, count)
    return t, count


@triton.jit
def kth_largest_within(keys, k, enough, count, lo, hi, CARRY: tl.constexpr):
    """``(t, #(keys >= t))`` for a 1-D ``keys`` (at most 16384) holding ``count >= k`` selectable keys, all
    ``>= lo``, whose k-th largest is ``<= hi``: ``t`` is the k-th largest key, or, once the count at the
    bracket's floor is ``<= enough`` (``>= k``), that floor (so ``enough < k`` always gives the k-th largest).
    Two bits per round, counted on the keys' images as ``reaching`` with ``CARRY``."""
    searched = order_image(keys)
    bit = bit_length(lo ^ hi)
    t = clear_low_bits(lo, bit)
    if (bit % 2 == 1) & (count > enough):
        bit -= 1
        candidate = t ^ (1 << bit)
        candidate_count = tl.sum(reaching(searched, candidate, CARRY), axis=0)
        reaches = candidate_count >= k
        t = tl.where(reaches, candidate, t)
        count = tl.where(reaches, candidate_count, count)
    while (bit > 0) & (count > enough):
        bit -= 2
        t, count = search_step(searched, t, count, bit, k, CARRY)
    return t, count


@triton.jit
def row_bounds(starts_ptr, ends_ptr, row, row_repeat, width, HAS_STARTS: tl.constexpr):
    """(first column, length) of ``row`` as int64 scalars from the bounds of entry ``row // row_repeat`` (rows of
    one request share them), the window clamped into ``[0, width]`` (a no-op on
    validated bounds; unchecked ones never move a read or a scratch write outside the row)."""
    bound = row // row_repeat
    end = tl.load(ends_ptr + bound).to(tl.int64)
    if HAS_STARTS:
        start = tl.minimum(tl.maximum(tl.load(starts_ptr + bound).to(tl.int64), 0), width)
    else:
        start = end * 0
    end = tl.minimum(tl.maximum(end, start), width)
    return start, end - start
