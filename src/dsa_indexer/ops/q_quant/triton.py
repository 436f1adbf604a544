"""Triton kernel of the fused Q RoPE + quantisation, and the exact format helpers it shares with the K cache.

Every helper reproduces ``dsa_indexer.formats`` bit for bit, on the GPU and under Triton's CPU
interpreter. The GPU converts fp32 -> bf16 and fp32 -> e4m3 with round-to-nearest-even (e4m3 also
saturating at ±448, NaN staying NaN: ``cvt.rn.satfinite``), exactly as torch does. The interpreter does
not (it truncates to bf16, and rounds to e4m3 with ties away from zero, losing the exponent carry, and
NaN -> 256), so under it (``INTERPRETER``) both conversions are done explicitly:

bf16 rounding (``round_to_bf16``)
    Adding ``0x7FFF + lsb`` to the fp32 bits, with ``lsb`` the lowest kept bit, carries into bit 16
    exactly when the dropped half-word is above one half, or equal to it with ``lsb = 1``: round to
    nearest, ties to even, overflowing to ``inf`` as it should. NaN is passed through unchanged.
    (On the GPU ``round_pair_to_bf16`` rounds two values with one ``cvt.rn.bf16x2.f32``: the same rounding.)

e4m3 rounding (``round_to_e4m3``)
    For ``|v| <= 448`` let ``e = max(exponent(v), -6)``: e4m3 values near ``v`` are the multiples of
    ``2**(e - 3)`` (``-6`` covers the subnormals). ``M = 1.5 * 2**(e + 20)`` (``2**exponent(v)``, taken
    from the exponent bits, times ``1.5 * 2**20``, and at least ``1.5 * 2**14``) has an fp32 ulp of
    ``2**(e - 3)``, and ``|v| < 2**(e + 1)`` keeps ``v + M`` in M's binade, so the fp32 sum rounds ``v``
    to that grid (to nearest, ties to even: ``M / 2**(e-3) = 3 * 2**22`` is even) and ``- M`` is exact.
    The sign bit of ``v`` is put back so that zeros keep their sign. The result is an e4m3 value, which
    the cast converts exactly; NaN is encoded explicitly as ``0x7F``.

e2m1 codes (``e2m1_bits``, one path everywhere: no hardware converts to e2m1 before Blackwell)
    Most of the work stays on the FMA pipe: the integer/compare pipe runs at half its rate and was
    the bottleneck. With ``m = min(|v|, 6)`` and ``k = max(exponent(m), 0)`` the e2m1 grid near ``m``
    is ``2**(k-1)``, the fp32 ulp of ``M = 1.5 * 2**(k + 22)``. ``s = copysign(m, v)``; ``(s + M) - M``
    rounds ``s`` to that grid (ties to even: ``M`` is an even number of ulps, so the parity is the
    same for either sign) and is exact, giving the signed e2m1 value ``r``; a negative value that
    rounds to zero gives ``+0`` (``M - M``), as the reference wants. The e2m1 code of ``r`` is the
    bit pattern of a float with one mantissa bit, two exponent bits (bias 1) and subnormals, which
    is what fp32 holds at the very bottom of its range: ``bits(r * 2**-126) = sign << 31 | code << 22``
    (``0.5 * 2**-126`` is the subnormal ``1 << 22``; ``6 * 2**-126`` has exponent field 3, mantissa
    ``1 << 22``). Kernels keep fp32 subnormals (no flush to zero). NaN must give +0: on the GPU
    ``m = min(max(|v|, 0), 6)`` does it, since ``max.f32`` drops NaN; numpy's maximum keeps NaN, so the
    interpreter selects 0 explicitly.

    Nibbles come out of those bits with one ``umulhi`` each (an integer multiply, FMA pipe):
    ``umulhi(b, 2**10 + 2**4) = (b >> 22) + (b >> 28)`` (the low halves never carry) has the code in
    bits 0-2 and the sign in bit 3, and ``umulhi(b, 2**14 + 2**8)`` has them in bits 4-7 (plus bits
    that the masks drop), so a byte of two elements is ``(lo & 0x0F) | (hi & 0xF0)``.

Finite block amax (``finite_abs_or_nan``)
    On the GPU ``fma(x, 0, |x|)`` is ``|x|`` for finite ``x`` and NaN for inf and NaN, and the float
    maximum (``max.f32``) drops NaN: one FMA and one max per element; a block without a finite value
    ends as NaN, which the floor's maximum in ``mxfp4_exponents`` drops too. Under the interpreter the
    keys are ``2 * bits(x) + 2**24`` (uint32, wrapping), which keep the order of ``|x|`` over the
    finite values (all in ``[2**24, 2**32)``) and send inf and NaN below ``2**24``.

ue8m0 exponents without a division (``fp8_scale_exponent``, ``mxfp4_exponents``)
    The reference takes ``ceil(log2(fp32(amax / c)))`` for ``c = 448 = 1.75 * 2**8`` or
    ``6 = 1.5 * 2**2``. For a normal ``amax = m * 2**E`` (``1 <= m < 2``) the real quotient exceeds
    ``2**(E - 8)`` (resp. ``2**(E - 2)``) exactly when ``m > 1.75`` (``m > 1.5``), so the exponent is
    ``E - 8 + [mantissa bits > 0x600000]`` (``E - 2 + [> 0x400000]``). Rounding the quotient to fp32
    never moves it across a power of two: the smallest fp32 above ``c * 2**j`` gives a quotient more
    than half an ulp above ``2**j``. (Checked against the reference for every fp32 of ten binades
    spanning the range, and every subnormal.) A subnormal ``amax`` (possible only with a subnormal
    floor) gives a subnormal quotient, clamped to -126, or 0 when ``amax <= 1.75 * 2**-142`` (bits
    ``<= 224``) rounds it to zero, whose ``frexp`` exponent is 0.

MXFP4 of bf16 values on bf16 pairs (``bf16x2``: ``quantize_store_bf16_words``; the default, run 6)
    When every value to quantise is a bf16 (a bf16 ``q`` or ``k``, and the rotated dims, which are rounded
    to bf16 anyway), rows are loaded as 32-bit words of (even dim, odd dim) pairs in row-major tiles
    (``load_bf16_words``: whole sectors per load) and the whole encode runs on packed bf16x2 instructions,
    two values each: block amax by ``max.NaN.xorsign.abs.bf16x2``, then ``mxfp4_encode_bf16x2`` (the e2m1
    magic add above, in bf16, proof in its docstring), about 4 instructions per value instead of 12; each
    thread stores the packed word it computed (consecutive threads on consecutive words). It needs finite
    values; a program holding an inf or NaN (one block-wide maximum decides) takes a saturating form of the
    same encode on the finite block maxima. Other inputs (fp16 or fp32, strided dims; and every input under
    the interpreter) take the fp32 path: ``load_pairs``' block-per-thread tiles, ``mxfp4_pack_pairs``,
    ``store_mxfp4_rows``' row-major stores.

Dividing by a power-of-two scale ``2**e`` is replaced by multiplying with ``2**-e``: both are one
correctly rounded fp32 operation on the same real quotient (``-e`` stays within the normal range).
Kernels launch with ``enable_fp_fusion=False``, so no product is fused into a sum (the RoPE rounds each
product, as the reference does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backend import interpreter_enabled
from ...formats import FP8_MAX, MXFP4_BLOCK, MXFP4_MAX, Q_AMAX_FLOOR, UE8M0_ONE, mxfp4_scale_bytes
from .reference import rope_quant_q_reference

MXFP4_AMAX_FLOOR = MXFP4_MAX * 2.0**-126

_FP8_MAX = tl.constexpr(FP8_MAX)
_MXFP4_MAX = tl.constexpr(MXFP4_MAX)
_MXFP4_AMAX_FLOOR = tl.constexpr(MXFP4_AMAX_FLOOR)
_MXFP4_BLOCK = tl.constexpr(MXFP4_BLOCK)
_UE8M0_ONE = tl.constexpr(UE8M0_ONE)
_Q_AMAX_FLOOR = tl.constexpr(Q_AMAX_FLOOR)
_SIGN_BIT = tl.constexpr(-(2**31))
_SIGN_MASK = tl.constexpr(0x80000000)
_E2M1_TO_SUBNORMAL = tl.constexpr(2.0**-126)
_LOW_NIBBLE = tl.constexpr(2**10 + 2**4)  # umulhi: (b >> 22) + (b >> 28)
_HIGH_NIBBLE = tl.constexpr(2**14 + 2**8)  # umulhi: (b >> 18) + (b >> 24)

# MXFP4 of bf16 ``q`` (unit dim stride) unless told otherwise: encode on bf16 pairs (``quantize_store_bf16_words``)
# rather than on fp32 values (94.8 against 123.4 us on an H200, run 6).
ROPE_MXFP4_BF16X2 = True

__all__ = ["rope_quant_q_triton"]


@triton.jit
def round_to_bf16(x, INTERPRETER: tl.constexpr):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), returned as fp32."""
    if INTERPRETER:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
        rounded = tl.where(x == x, rounded, x)
    else:
        rounded = x.to(tl.bfloat16).to(tl.float32)
    return rounded


@triton.jit
def finite_abs(x):
    """``|x|`` where ``x`` is finite, 0 where it is NaN or infinite (they never set a scale)."""
    magnitude = tl.abs(x)
    return tl.where(magnitude < float("inf"), magnitude, 0.0)


@triton.jit
def finite_amax(x, axis: tl.constexpr):
    """Largest finite ``|x|`` along ``axis``, 0 where there is none."""
    return tl.max(finite_abs(x), axis=axis)


@triton.jit
def fp8_scale_exponent(amax):
    """``clamp(ceil(log2(fp32(amax / 448))), -126, 127)`` (int32) of fp32 ``amax > 0``, from its bits."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = bits >> 23
    exponent = biased - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    exponent = tl.where(biased == 0, tl.where(bits <= 224, 0, -126), exponent)
    return tl.minimum(tl.maximum(exponent, -126), 127)


@triton.jit
def pow2(exponent):
    """``2.0 ** exponent`` as fp32, built from the bits (int32 exponent in [-126, 127])."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3(v):
    """fp32 ``v`` (``|v| <= 448``) rounded to the nearest e4m3 value, ties to even, as fp32 (NaN stays NaN)."""
    bits = v.to(tl.int32, bitcast=True)
    power = (bits & 0x7F800000).to(tl.float32, bitcast=True)  # 2**exponent(v), 0 for zeros and subnormals
    magic = tl.maximum(power * 1572864.0, 24576.0)  # 1.5 * 2**(e + 20) with e = max(exponent(v), -6)
    rounded = ((v + magic) - magic).to(tl.int32, bitcast=True)
    return (rounded | (bits & _SIGN_BIT)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bytes(scaled, INTERPRETER: tl.constexpr):
    """e4m3fn bytes (uint8) of already-scaled fp32 values: clamp to ±448, nearest-even; NaN -> 0x7F."""
    if INTERPRETER:
        clamped = tl.minimum(tl.maximum(scaled, -_FP8_MAX), _FP8_MAX)
        code = round_to_e4m3(clamped).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        code = tl.where(scaled == scaled, code, tl.full(code.shape, 0x7F, tl.uint8))
    else:
        code = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return code


@triton.jit
def e2m1_bits(scaled, INTERPRETER: tl.constexpr):
    """``sign << 31 | code << 22`` (uint32) of the e2m1 value nearest to already-scaled fp32 values.

    ``code`` in [0, 7] is the magnitude code (ties to even, saturating at 6); the sign is set only
    for values below -0.25; NaN gives 0.
    """
    if INTERPRETER:  # numpy's maximum keeps NaN
        magnitude = tl.where(scaled == scaled, tl.minimum(tl.abs(scaled), _MXFP4_MAX), 0.0)
    else:  # max.f32 drops NaN: NaN -> 0
        magnitude = tl.minimum(tl.maximum(tl.abs(scaled), 0.0), _MXFP4_MAX)
    magnitude_bits = magnitude.to(tl.uint32, bitcast=True)
    signed = (magnitude_bits | (scaled.to(tl.uint32, bitcast=True) & _SIGN_MASK)).to(tl.float32, bitcast=True)
    unit = tl.maximum(magnitude_bits & 0x7F800000, 0x3F800000).to(tl.float32, bitcast=True)  # 2**k
    magic = unit * 6291456.0  # 1.5 * 2**22 * unit, whose fp32 ulp is unit / 2
    rounded = (signed + magic) - magic  # signed e2m1 value; +0 for NaN (its sign bit may be set)
    return (rounded * _E2M1_TO_SUBNORMAL).to(tl.uint32, bitcast=True)


@triton.jit
def e2m1_codes(scaled, INTERPRETER: tl.constexpr):
    """4-bit e2m1 codes (int32, sign in bit 3) of already-scaled fp32 values; ties to even, NaN -> +0."""
    return (tl.umulhi(e2m1_bits(scaled, INTERPRETER), _LOW_NIBBLE) & 0xF).to(tl.int32)


@triton.jit
def finite_abs_or_nan(x, INTERPRETER: tl.constexpr):
    """Keys whose maximum is the largest finite ``|x|``: on the GPU ``|x|`` for finite ``x``, NaN otherwise
    (``x * 0 + |x|``: one FMA; the float maximum drops NaN); under the interpreter (numpy keeps NaN)
    ``finite_order``'s integer keys."""
    if INTERPRETER:
        keys = finite_order(x)
    else:
        keys = tl.fma(x, 0.0, tl.abs(x))
    return keys


@triton.jit
def amax_from_keys(keys, INTERPRETER: tl.constexpr):
    """The largest finite ``|x|`` (fp32) from the maximum of ``finite_abs_or_nan`` keys; NaN or 0 if there is none."""
    if INTERPRETER:
        amax = finite_amax_from_order(keys)
    else:
        amax = keys
    return amax


@triton.jit
def finite_order(x):
    """uint32 keys of fp32 ``x``: increasing with ``|x|`` over finite values (all >= 2**24), below 2**24 for inf/NaN."""
    return x.to(tl.uint32, bitcast=True) * 2 + 0x01000000


@triton.jit
def finite_amax_from_order(key):
    """Inverse of ``finite_order`` on a maximum key: the largest finite ``|x|`` (fp32), 0 if there is none."""
    return tl.where(key >= 0x01000000, (key - 0x01000000) >> 1, 0).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_exponents(block_amax):
    """Unbiased ue8m0 exponents ``ceil(log2(fp32(max(amax, 6 * 2**-126) / 6)))`` (int32) of 32-element blocks.

    A NaN ``amax`` (a block without finite values, on the GPU) counts as 0: ``max.f32`` drops it.
    """
    bits = tl.maximum(block_amax, _MXFP4_AMAX_FLOOR).to(tl.int32, bitcast=True)
    return (bits >> 23) - 129 + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)


@triton.jit
def mxfp4_pack_pairs(even, odd, INTERPRETER: tl.constexpr):
    """MXFP4 of values given as pairs ``even, odd [ROWS, NB, 4, 4]``: pair ``16b + 4g + i`` of a row (its
    elements ``32b + 8g + 2i`` and ``+ 1``) is ``even[row, b, g, i]``, ``odd[row, b, g, i]``.

    Returns ``(packed uint8 [ROWS, NB, 4, 4], scales uint8 [ROWS, NB])``: the byte of each pair holds the
    even element in its low nibble.
    """
    keys = tl.maximum(finite_abs_or_nan(even, INTERPRETER), finite_abs_or_nan(odd, INTERPRETER))
    amax = amax_from_keys(tl.max(tl.max(keys, axis=3), axis=2), INTERPRETER)  # [ROWS, NB]
    exponent = mxfp4_exponents(amax)
    inverse = pow2(-exponent)[:, :, None, None]  # [ROWS, NB, 1, 1]
    low = tl.umulhi(e2m1_bits(even * inverse, INTERPRETER), _LOW_NIBBLE)
    high = tl.umulhi(e2m1_bits(odd * inverse, INTERPRETER), _HIGH_NIBBLE)
    return ((low & 0x0F) | (high & 0xF0)).to(tl.uint8), (exponent + 127).to(tl.uint8)


@triton.jit
def pair_index(NB: tl.constexpr):
    """``16b + 4g + i`` as ``[1, NB, 4, 4]`` (axes row, b, g, i): the pair that tile position holds."""
    return (tl.arange(0, NB)[None, :, None, None] * 16 + tl.arange(0, 4)[None, None, :, None] * 4
            + tl.arange(0, 4)[None, None, None, :])


@triton.jit
def load_pairs(row_ptrs, first_dim, stride, rows_ok, PAIRS: tl.constexpr, NB: tl.constexpr):
    """Dims ``first_dim + 2p`` and ``+ 1`` of each row, ``p < PAIRS``, as fp32 ``(even, odd) [ROWS, NB, 4, 4]``
    (the tiles of ``mxfp4_pack_pairs``); ``row_ptrs [ROWS]``; masked-off pairs read 0.

    Each 32-dim block is loaded as four 8-dim runs (wide loads) along an axis after the row and block
    axes, which Triton's layouts keep inside one thread: the block amax needs no shuffles, but a warp's
    32 threads sit on 32 rows, so each 16-byte load touches 32 half-used sectors.
    """
    rows: tl.constexpr = row_ptrs.shape[0]
    dim = (tl.arange(0, NB)[None, :, None, None] * 32 + tl.arange(0, 4)[None, None, :, None] * 8
           + tl.arange(0, 8)[None, None, None, :])  # [1, NB, 4, 8]
    ok = rows_ok[:, None, None, None] & (dim < 2 * PAIRS)
    x = tl.load(row_ptrs[:, None, None, None] + (dim + first_dim) * stride, mask=ok, other=0.0)  # [ROWS, NB, 4, 8]
    return tl.split(tl.reshape(x.to(tl.float32), [rows, NB, 4, 4, 2]))


@triton.jit
def store_scale_padding(scale_rows, rows_ok, DIM: tl.constexpr):
    """Write ``UE8M0_ONE`` to the padding bytes ``[DIM / 32, S)`` after ``scale_rows [ROWS]``, ``S`` the scale
    bytes of the vector (``formats.mxfp4_scale_bytes``: ``DIM / 32`` rounded up to whole 4-byte words)."""
    if (DIM // 32) % 4:
        pad = tl.arange(0, 4)
        tl.store(scale_rows[:, None] + DIM // 32 + pad[None, :], tl.full([1, 4], _UE8M0_ONE, tl.uint8),
                 mask=rows_ok[:, None] & (DIM // 32 + pad < (DIM + 127) // 128 * 4)[None, :])


@triton.jit
def store_mxfp4_rows(value_rows, scale_rows, rows_ok, packed, scales, WIDTH: tl.constexpr):
    """Store ``mxfp4_pack_pairs``'s ``packed [ROWS, NB, 4, 4]`` and ``scales [ROWS, NB]`` of dims ``[0, WIDTH)``
    of each row: bytes ``[0, WIDTH / 2)`` after ``value_rows [ROWS]`` (byte pointers), scales
    ``[0, WIDTH / 32)`` after ``scale_rows [ROWS]``; rows where ``rows_ok`` is false write nothing.

    Stored as ``[ROWS, NB * 16]`` and ``[ROWS, NB]`` tiles, whose coalesced layouts put up to 16 contiguous
    bytes in a thread and consecutive threads on consecutive runs: one ``STG.128`` per 16 bytes, every
    32-byte sector written whole by one instruction (the compiler converts the layout through shared memory:
    one ``STS.128`` and one ``LDS.128``). Stored from the block-per-thread layout they are computed in, a
    warp's 4-byte stores would write 32 sectors partly: 16% slower (run 4).
    """
    rows: tl.constexpr = packed.shape[0]
    nb: tl.constexpr = packed.shape[1]
    byte = tl.arange(0, nb * 16)  # [NB * 16]
    tl.store(value_rows[:, None] + byte[None, :], tl.reshape(packed, [rows, nb * 16]),
             mask=rows_ok[:, None] & (byte < WIDTH // 2)[None, :])
    block = tl.arange(0, nb)
    tl.store(scale_rows[:, None] + block[None, :], scales,
             mask=rows_ok[:, None] & (block < WIDTH // _MXFP4_BLOCK)[None, :])


@triton.jit
def _store_mxfp4_pairs(values_ptr, scales_ptr, head_rows, heads_ok, even, odd, START: tl.constexpr,
                       WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, INTERPRETER: tl.constexpr):
    """Quantise and store dims ``[START, START + WIDTH)`` of each head.

    ``even, odd``: those dims as ``load_pairs`` tiles ``[BLOCK_H, NB, 4, 4]``.
    """
    packed, scales = mxfp4_pack_pairs(even, odd, INTERPRETER)
    store_mxfp4_rows(values_ptr + head_rows * (HEAD_DIM // 2) + START // 2,
                     scales_ptr + head_rows * ((HEAD_DIM + 127) // 128 * 4) + START // _MXFP4_BLOCK, heads_ok, packed,
                     scales, WIDTH)


# Packed bf16x2 encode of four words (eight bf16 values) into four MXFP4 bytes; see ``mxfp4_encode_bf16x2``.
# Inputs ``$1..$4`` the words, ``$5`` the scale ``2**-e`` in both halves; output ``$0``. ``{clamp}``: nothing, or
# (saturating variant) ``v = copysign(min(max(|v|, 0), 6), v)``, which sends inf to 6 and NaN to ±0.
_ENCODE_WORD = (
    "mul.rn.bf16x2 v, {w}, $5; {clamp}and.b32 u, v, 0x7F807F80; max.bf16x2 u, u, one; "
    "fma.rn.bf16x2 v, u, magic, v; fma.rn.bf16x2 v, u, neg_magic, v; mul.rn.bf16x2 b{i}, v, tiny; "
    "mul.hi.u32 h{i}, b{i}, 0x04104000; "
)
_CLAMP_WORD = ("and.b32 u, v, 0x7FFF7FFF; max.bf16x2 u, u, zero; min.bf16x2 u, u, six; and.b32 v, v, 0x80008000; "
               "or.b32 v, v, u; ")


def _encode_words_asm(saturate: bool) -> str:
    return (
        "{ .reg .b32 v, u, one, magic, neg_magic, tiny, zero, six, b0, b1, b2, b3, h0, h1, h2, h3, lo, hi, codes, "
        "signs; "
        "mov.b32 one, 0x3F803F80; mov.b32 magic, 0x42C042C0; mov.b32 neg_magic, 0xC2C0C2C0; "
        "mov.b32 tiny, 0x00800080; mov.b32 zero, 0; mov.b32 six, 0x40C040C0; "
        + "".join(_ENCODE_WORD.format(w=f"${i + 1}", i=i, clamp=_CLAMP_WORD if saturate else "") for i in range(4))
        + "prmt.b32 lo, h0, h1, 0x0040; prmt.b32 hi, h2, h3, 0x0040; prmt.b32 codes, lo, hi, 0x5410; "
        "prmt.b32 lo, b0, b1, 0x0073; prmt.b32 hi, b2, b3, 0x0073; prmt.b32 signs, lo, hi, 0x5410; "
        "and.b32 signs, signs, 0x80808080; or.b32 $0, codes, signs; }"
    )


_ENCODE_WORDS_ASM = tl.constexpr(_encode_words_asm(False))
_ENCODE_WORDS_SATURATING_ASM = tl.constexpr(_encode_words_asm(True))


@triton.jit
def load_bf16_words(row_words, first_word, rows_ok, WORDS: tl.constexpr, NB: tl.constexpr):
    """Words ``first_word + w``, ``w < WORDS``, after each of ``row_words [ROWS]`` (uint32 pointers) as
    ``[ROWS, NB, 4, 4]`` uint32 tiles (word ``16b + 4g + i`` at ``[row, b, g, i]``); a word holds the bf16 pair
    (dim ``2w``, dim ``2w + 1``), the even dim in its low half. Masked-off words read 0.

    Loaded as a ``[ROWS, NB * 16]`` tile, whose coalesced layout puts 4 words in a thread and consecutive
    threads on consecutive words (whole sectors per load); the tiles keep that layout, so a block spans 4
    threads (two shuffles for its amax) and each thread encodes one packed word. (Loaded one block per thread,
    as ``load_pairs`` does, a warp's 16-byte loads touch 32 rows: 12-15% slower, run 6.)
    """
    rows: tl.constexpr = row_words.shape[0]
    word = tl.arange(0, NB * 16)  # [NB * 16]
    words = tl.load(row_words[:, None] + first_word + word[None, :], mask=rows_ok[:, None] & (word < WORDS)[None, :],
                    other=0)
    return tl.reshape(words, [rows, NB, 4, 4])


@triton.jit
def unpack_bf16_words(words):
    """fp32 ``(even, odd)`` of bf16 pair words (exact)."""
    return (words << 16).to(tl.float32, bitcast=True), (words & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def pack_bf16_words(even, odd, INTERPRETER: tl.constexpr):
    """uint32 words of ``(round_to_bf16(even), round_to_bf16(odd))``, the even value in the low half (on the GPU
    one ``cvt.rn.bf16x2.f32`` per word)."""
    if INTERPRETER:
        low = round_to_bf16(even, INTERPRETER).to(tl.uint32, bitcast=True) >> 16
        words = low | (round_to_bf16(odd, INTERPRETER).to(tl.uint32, bitcast=True) & 0xFFFF0000)
    else:
        words = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [even, odd], dtype=tl.uint32,
                                          is_pure=True, pack=1)
    return words


@triton.jit
def _abs_max_bf16x2(a, b):
    """Per 16-bit half of bf16 pair words: ``max(|a|, |b|)``, NaN if either is NaN (result signs are meaningless)."""
    return tl.inline_asm_elementwise("max.NaN.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.uint32,
                                     is_pure=True, pack=1)


@triton.jit
def _max_bf16x2(a, b):
    """Per 16-bit half of bf16 pair words: the maximum; NaN only if both are NaN."""
    return tl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.uint32, is_pure=True,
                                     pack=1)


@triton.jit
def bf16x2_block_amax(words, INTERPRETER: tl.constexpr):
    """bf16 bits (uint32, < 2**15) of the largest ``|x|`` of each 32-dim block of ``load_bf16_words`` tiles
    ``[ROWS, NB, 4, 4]`` -> ``[ROWS, NB]``; ``>= 0x7F80`` (inf or NaN) when the block holds an inf or NaN
    (on the GPU one ``max.NaN.xorsign.abs.bf16x2`` per word; integer maxima of ``|x|``'s bits under the interpreter)."""
    if INTERPRETER:
        amax = tl.max(tl.max(tl.maximum(words & 0x7FFF, (words >> 16) & 0x7FFF), 3), 2)
    else:
        halves = tl.reduce(tl.reduce(words, 3, _abs_max_bf16x2), 2, _abs_max_bf16x2)
        amax = tl.maximum(halves & 0x7FFF, (halves >> 16) & 0x7FFF)
    return amax


@triton.jit
def bf16x2_finite_block_amax(words):
    """fp32 largest finite ``|x|`` of each block of ``load_bf16_words`` tiles -> ``[ROWS, NB]``, NaN for a block
    without a finite value (GPU only): per word ``fma(x, 0, |x|)`` (NaN for inf and NaN) and NaN-dropping maxima."""
    keys = tl.inline_asm_elementwise("{ .reg .b32 a, z; and.b32 a, $1, 0x7FFF7FFF; mov.b32 z, 0; "
                                     "fma.rn.bf16x2 $0, $1, z, a; }", "=r,r", [words], dtype=tl.uint32,
                                     is_pure=True, pack=1)
    even, odd = unpack_bf16_words(tl.reduce(tl.reduce(keys, 3, _max_bf16x2), 2, _max_bf16x2))
    return tl.maximum(even, odd)  # max.f32: drops NaN


@triton.jit
def mxfp4_encode_bf16x2(words, amax, SATURATE: tl.constexpr):
    """MXFP4 of ``load_bf16_words`` tiles ``[ROWS, NB, 4, 4]`` given their blocks' largest finite ``|x|`` (fp32
    ``amax [ROWS, NB]``; NaN counts as 0). GPU only. Without ``SATURATE`` every value must be finite.

    Returns ``(packed uint32 [ROWS, NB, 4], scales uint8 [ROWS, NB])``: packed word ``4b + g`` holds bytes
    ``16b + 4g .. + 3`` of the row (byte ``j`` = dims ``2j``, ``2j + 1``, the even one in the low nibble).

    Every value is a bf16 (8 significant bits), so the arithmetic runs on bf16 pairs, two values per
    instruction, each result rounded once to bf16 (nearest even, subnormals kept), as ``e2m1_bits`` does
    in fp32: ``v = x * 2**-e`` is exact unless ``|v| < 2**-126`` (code 0 either way), and ``|v| <= 6``
    for finite ``x``; ``SATURATE`` clamps inf to ±6 and NaN to ±0. ``u = max(2**exponent(v), 1)``;
    ``(v + 96u) - 96u`` rounds ``v`` to the e2m1 grid ``u / 2`` (``96u`` has bf16 ulp ``u / 2``, is an even
    number of them, and ``v + 96u`` stays in its binade since ``|v| < 2u``), small negatives giving +0;
    times ``2**-126`` its bf16 bits are ``sign << 15 | code << 6`` (bf16 subnormals have e2m1's structure).
    ``umulhi(b, 2**26 + 2**20 + 2**14) = (b >> 6) + (b >> 12) + (b >> 18)`` holds both codes and the low
    half's sign in bits 0-6 (the dropped low parts sum below 1: no carry); the high half's sign (bit 31)
    is merged from the byte-permuted words. Checked against ``formats.e2m1_codes`` for every finite bf16
    and every exponent (exhaustively, by emulating the bf16 roundings).
    """
    rows: tl.constexpr = words.shape[0]
    nb: tl.constexpr = words.shape[1]
    exponent = mxfp4_exponents(amax)  # [ROWS, NB]
    inverse = ((127 - exponent) << 7).to(tl.uint32) * 0x10001  # 2**-e in both halves
    even_pairs, odd_pairs = tl.split(tl.reshape(words, [rows, nb, 4, 2, 2]))  # word i = 2 * i1 + i0
    word0, word2 = tl.split(even_pairs)
    word1, word3 = tl.split(odd_pairs)
    args = [word0, word1, word2, word3, tl.broadcast_to(inverse[:, :, None], word0.shape)]
    if SATURATE:
        packed = tl.inline_asm_elementwise(_ENCODE_WORDS_SATURATING_ASM, "=r,r,r,r,r,r", args, dtype=tl.uint32,
                                           is_pure=True, pack=1)
    else:
        packed = tl.inline_asm_elementwise(_ENCODE_WORDS_ASM, "=r,r,r,r,r,r", args, dtype=tl.uint32, is_pure=True,
                                           pack=1)
    return packed, (exponent + 127).to(tl.uint8)


@triton.jit
def store_mxfp4_words(value_rows, scale_rows, rows_ok, packed, scales, WIDTH: tl.constexpr):
    """``store_mxfp4_rows`` for ``mxfp4_encode_bf16x2``'s ``packed [ROWS, NB, 4]`` words (``value_rows`` 4-byte
    aligned), from the layout they were computed in: from ``load_bf16_words``' tiles, one word per thread and
    consecutive threads on consecutive words, already coalesced (a row-major tile through shared memory was
    not faster, run 6)."""
    nb: tl.constexpr = packed.shape[1]
    value_words = value_rows.to(tl.pointer_type(tl.uint32), bitcast=True)
    word = tl.arange(0, nb)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # [1, NB, 4]
    tl.store(value_words[:, None, None] + word, packed, mask=rows_ok[:, None, None] & (word < WIDTH // 8))
    block = tl.arange(0, nb)
    tl.store(scale_rows[:, None] + block[None, :], scales,
             mask=rows_ok[:, None] & (block < WIDTH // _MXFP4_BLOCK)[None, :])


@triton.jit
def quantize_store_bf16_words(value_rows, scale_rows, rows_ok, words, amax, WIDTH: tl.constexpr,
                              FINITE: tl.constexpr, INTERPRETER: tl.constexpr):
    """MXFP4 of dims ``[0, WIDTH)`` of each row given as ``load_bf16_words`` tiles, stored as ``store_mxfp4_rows``
    does. ``amax``: ``bf16x2_block_amax(words)``.

    ``FINITE`` (the caller has checked that every value of the program is finite): ``mxfp4_encode_bf16x2``
    (about 4 instructions per value instead of 12); otherwise its saturating form on the finite block
    maxima. The interpreter takes the fp32 path (``mxfp4_pack_pairs``) either way.
    """
    if INTERPRETER:
        even, odd = unpack_bf16_words(words)
        packed, scales = mxfp4_pack_pairs(even, odd, INTERPRETER)
        store_mxfp4_rows(value_rows, scale_rows, rows_ok, packed, scales, WIDTH)
    else:
        if FINITE:
            packed_words, scales = mxfp4_encode_bf16x2(words, (amax << 16).to(tl.float32, bitcast=True), False)
        else:
            packed_words, scales = mxfp4_encode_bf16x2(words, bf16x2_finite_block_amax(words), True)
        store_mxfp4_words(value_rows, scale_rows, rows_ok, packed_words, scales, WIDTH)


@triton.jit
def _quantize_store_words(values_ptr, scales_ptr, head_rows, heads_ok, words, amax, START: tl.constexpr,
                          WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, FINITE: tl.constexpr, INTERPRETER: tl.constexpr):
    """``quantize_store_bf16_words`` of dims ``[START, START + WIDTH)`` of each head (``words``: those dims)."""
    quantize_store_bf16_words(values_ptr + head_rows * (HEAD_DIM // 2) + START // 2,
                              scales_ptr + head_rows * ((HEAD_DIM + 127) // 128 * 4) + START // _MXFP4_BLOCK, heads_ok,
                              words, amax, WIDTH, FINITE, INTERPRETER)


@triton.jit
def round_pair_to_bf16(x0, x1):
    """``(round_to_bf16(x0), round_to_bf16(x1))`` on the GPU with one packed conversion (``cvt.rn.bf16x2.f32``,
    round to nearest even like the single one) per pair instead of two."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 packed; cvt.rn.bf16x2.f32 packed, $3, $2; shl.b32 $0, packed, 16; "
        "and.b32 $1, packed, 0xFFFF0000; }",
        "=r,=r,f,f", [x0, x1], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _rope_pairs(x0, x1, cos, sin, PACKED: tl.constexpr, INTERPRETER: tl.constexpr):
    """bf16-rounded ``(x0 cos - x1 sin, x1 cos + x0 sin)``; ``PACKED`` rounds them as a pair on the GPU."""
    r0 = x0 * cos - x1 * sin
    r1 = x1 * cos + x0 * sin
    if PACKED and not INTERPRETER:
        r0, r1 = round_pair_to_bf16(r0, r1)
    else:
        r0 = round_to_bf16(r0, INTERPRETER)
        r1 = round_to_bf16(r1, INTERPRETER)
    return r0, r1


@triton.jit(do_not_specialize=["num_heads"])
def _rope_quant_q_kernel(
    q_ptr, positions_ptr, cos_sin_ptr, weights_ptr, values_ptr, scales_ptr, weights_out_ptr,
    num_heads,
    stride_qt, stride_qh, stride_qd, stride_positions,
    stride_cs_pos, stride_cs_dim,
    stride_wt, stride_wh,
    softmax_scale, head_scale,
    HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_START: tl.constexpr, INTERLEAVED: tl.constexpr,
    HALF_BLOCK: tl.constexpr, PASS_START: tl.constexpr, PASS_BLOCK: tl.constexpr,
    MXFP4: tl.constexpr, BLOCK_H: tl.constexpr, BF16X2: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """One program: token ``program_id(0)``, heads ``[program_id(1) * BLOCK_H, +BLOCK_H)``.

    RoPE works on pairs ``(x0[j], x1[j])``, ``j < ROPE_DIM / 2``: dims ``ROPE_START + j`` and
    ``ROPE_START + ROPE_DIM / 2 + j`` (NeoX) or ``ROPE_START + 2j`` and ``+ 1`` (interleaved, loaded as
    ``[.., j, 2]`` and split). The other ``HEAD_DIM - ROPE_DIM`` dims start at ``PASS_START``.
    MXFP4 keeps every segment as (even dim, odd dim) pairs ``[BLOCK_H, NB, 16]`` from the load to the
    packed bytes, so no tile changes layout: interleaved rope pairs are such pairs already; NeoX
    halves are loaded as pairs of consecutive dims, with ``cos``/``sin`` split the same way; the rotated
    pairs are rounded to bf16 with one packed conversion each. ``BF16X2`` (MXFP4 of bf16 ``q`` with unit dim
    stride and even token and head strides): segments are loaded as bf16 pair words (``load_bf16_words``),
    the rotated pairs rounded into such words, and each segment quantised by ``quantize_store_bf16_words``.
    """
    half: tl.constexpr = ROPE_DIM // 2
    pass_width: tl.constexpr = HEAD_DIM - ROPE_DIM
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    heads_ok = heads < num_heads
    head_rows = token * num_heads + heads  # [BLOCK_H] row of the [T * H] outputs
    q_rows = q_ptr + token * stride_qt + heads.to(tl.int64) * stride_qh  # [BLOCK_H]
    q_heads = q_rows[:, None]  # [BLOCK_H, 1]
    position = tl.load(positions_ptr + token * stride_positions).to(tl.int64)
    table = cos_sin_ptr + position * stride_cs_pos
    weights = tl.load(weights_ptr + token * stride_wt + heads * stride_wh, mask=heads_ok, other=0.0).to(tl.float32)
    softmax = tl.cast(softmax_scale, tl.float32)  # the interpreter passes tiny Python floats as fp64
    head = tl.cast(head_scale, tl.float32)

    if MXFP4 and BF16X2:
        q_words = q_rows.to(tl.pointer_type(tl.uint32), bitcast=True)  # [BLOCK_H]
        if INTERLEAVED:
            rope_nb: tl.constexpr = HALF_BLOCK // 16
            pair = pair_index(rope_nb)  # [1, NB, 4, 4] rope pair j
            cos = tl.load(table + pair * stride_cs_dim, mask=pair < half, other=0.0).to(tl.float32)
            sin = tl.load(table + (pair + half) * stride_cs_dim, mask=pair < half, other=0.0).to(tl.float32)
            pairs = load_bf16_words(q_words, ROPE_START // 2, heads_ok, half, rope_nb)
            x0, x1 = unpack_bf16_words(pairs)
            first = pack_bf16_words(x0 * cos - x1 * sin, x1 * cos + x0 * sin, INTERPRETER)  # [ROPE_START, +ROPE_DIM)
            first_width: tl.constexpr = ROPE_DIM
        else:
            half_nb: tl.constexpr = HALF_BLOCK // 32
            table_row = table + tl.zeros([1], tl.int64)  # [1]: cos/sin split like a row of q
            table_ok = tl.full([1], True, tl.int1)
            cos_even, cos_odd = load_pairs(table_row, 0, stride_cs_dim, table_ok, half // 2, half_nb)
            sin_even, sin_odd = load_pairs(table_row, half, stride_cs_dim, table_ok, half // 2, half_nb)
            x0_even, x0_odd = unpack_bf16_words(load_bf16_words(q_words, ROPE_START // 2, heads_ok, half // 2, half_nb))
            x1_even, x1_odd = unpack_bf16_words(load_bf16_words(q_words, (ROPE_START + half) // 2, heads_ok, half // 2,
                                                                half_nb))
            first = pack_bf16_words(x0_even * cos_even - x1_even * sin_even, x0_odd * cos_odd - x1_odd * sin_odd,
                                    INTERPRETER)  # dims [ROPE_START, +half)
            second = pack_bf16_words(x1_even * cos_even + x0_even * sin_even, x1_odd * cos_odd + x0_odd * sin_odd,
                                     INTERPRETER)  # dims [ROPE_START + half, +half)
            first_width: tl.constexpr = half
        first_amax = bf16x2_block_amax(first, INTERPRETER)  # [BLOCK_H, NB]
        rope_amax = first_amax
        if not INTERLEAVED:
            second_amax = bf16x2_block_amax(second, INTERPRETER)
            rope_amax = tl.maximum(rope_amax, second_amax)
        largest = tl.max(rope_amax)  # one block-wide reduction (per tile shape)
        if pass_width > 0:
            kept = load_bf16_words(q_words, PASS_START // 2, heads_ok, pass_width // 2, PASS_BLOCK // 32)
            kept_amax = bf16x2_block_amax(kept, INTERPRETER)
            if PASS_BLOCK // 32 == rope_amax.shape[1]:
                largest = tl.max(tl.maximum(rope_amax, kept_amax))
            else:
                largest = tl.maximum(largest, tl.max(kept_amax))
        if largest < 0x7F80:  # every value of the program finite
            _quantize_store_words(values_ptr, scales_ptr, head_rows, heads_ok, first, first_amax, ROPE_START,
                                  first_width, HEAD_DIM, True, INTERPRETER)
            if not INTERLEAVED:
                _quantize_store_words(values_ptr, scales_ptr, head_rows, heads_ok, second, second_amax,
                                      ROPE_START + half, half, HEAD_DIM, True, INTERPRETER)
            if pass_width > 0:
                _quantize_store_words(values_ptr, scales_ptr, head_rows, heads_ok, kept, kept_amax, PASS_START,
                                      pass_width, HEAD_DIM, True, INTERPRETER)
        else:
            _quantize_store_words(values_ptr, scales_ptr, head_rows, heads_ok, first, first_amax, ROPE_START,
                                  first_width, HEAD_DIM, False, INTERPRETER)
            if not INTERLEAVED:
                _quantize_store_words(values_ptr, scales_ptr, head_rows, heads_ok, second, second_amax,
                                      ROPE_START + half, half, HEAD_DIM, False, INTERPRETER)
            if pass_width > 0:
                _quantize_store_words(values_ptr, scales_ptr, head_rows, heads_ok, kept, kept_amax, PASS_START,
                                      pass_width, HEAD_DIM, False, INTERPRETER)
        weights_out = (weights * softmax) * head
    elif MXFP4:
        if INTERLEAVED:
            rope_nb: tl.constexpr = HALF_BLOCK // 16
            pair = pair_index(rope_nb)  # [1, NB, 4, 4] rope pair j
            cos = tl.load(table + pair * stride_cs_dim, mask=pair < half, other=0.0).to(tl.float32)
            sin = tl.load(table + (pair + half) * stride_cs_dim, mask=pair < half, other=0.0).to(tl.float32)
            x0, x1 = load_pairs(q_rows, ROPE_START, stride_qd, heads_ok, half, rope_nb)
            r0, r1 = _rope_pairs(x0, x1, cos, sin, True, INTERPRETER)
            _store_mxfp4_pairs(values_ptr, scales_ptr, head_rows, heads_ok, r0, r1, ROPE_START, ROPE_DIM, HEAD_DIM,
                               INTERPRETER)
        else:
            half_nb: tl.constexpr = HALF_BLOCK // 32
            table_row = table + tl.zeros([1], tl.int64)  # [1]: cos/sin split like a row of q
            table_ok = tl.full([1], True, tl.int1)
            cos_even, cos_odd = load_pairs(table_row, 0, stride_cs_dim, table_ok, half // 2, half_nb)
            sin_even, sin_odd = load_pairs(table_row, half, stride_cs_dim, table_ok, half // 2, half_nb)
            x0_even, x0_odd = load_pairs(q_rows, ROPE_START, stride_qd, heads_ok, half // 2, half_nb)
            x1_even, x1_odd = load_pairs(q_rows, ROPE_START + half, stride_qd, heads_ok, half // 2, half_nb)
            r0_even, r1_even = _rope_pairs(x0_even, x1_even, cos_even, sin_even, True, INTERPRETER)
            r0_odd, r1_odd = _rope_pairs(x0_odd, x1_odd, cos_odd, sin_odd, True, INTERPRETER)
            _store_mxfp4_pairs(values_ptr, scales_ptr, head_rows, heads_ok, r0_even, r0_odd, ROPE_START, half,
                               HEAD_DIM, INTERPRETER)
            _store_mxfp4_pairs(values_ptr, scales_ptr, head_rows, heads_ok, r1_even, r1_odd, ROPE_START + half, half,
                               HEAD_DIM, INTERPRETER)
        if pass_width > 0:
            kept_even, kept_odd = load_pairs(q_rows, PASS_START, stride_qd, heads_ok, pass_width // 2,
                                             PASS_BLOCK // 32)
            _store_mxfp4_pairs(values_ptr, scales_ptr, head_rows, heads_ok, kept_even, kept_odd, PASS_START,
                               pass_width, HEAD_DIM, INTERPRETER)
        weights_out = (weights * softmax) * head
    else:
        pair = tl.arange(0, HALF_BLOCK)  # [HALF_BLOCK]
        pair_ok = pair < half
        cos = tl.load(table + pair * stride_cs_dim, mask=pair_ok, other=0.0).to(tl.float32)[None, :]  # [1, HALF_BLOCK]
        sin = tl.load(table + (half + pair) * stride_cs_dim, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
        pairs_ok = heads_ok[:, None] & pair_ok[None, :]  # [BLOCK_H, HALF_BLOCK]
        if INTERLEAVED:
            pair_dims = ROPE_START + 2 * pair[:, None] + tl.arange(0, 2)[None, :]  # [HALF_BLOCK, 2]
            x = tl.load(q_heads[:, :, None] + pair_dims[None, :, :] * stride_qd, mask=pairs_ok[:, :, None], other=0.0)
            x0, x1 = tl.split(x.to(tl.float32))  # [BLOCK_H, HALF_BLOCK] each
        else:
            x0 = tl.load(q_heads + (ROPE_START + pair)[None, :] * stride_qd, mask=pairs_ok, other=0.0).to(tl.float32)
            x1 = tl.load(q_heads + (ROPE_START + half + pair)[None, :] * stride_qd, mask=pairs_ok, other=0.0)
            x1 = x1.to(tl.float32)
        r0, r1 = _rope_pairs(x0, x1, cos, sin, False, INTERPRETER)  # [BLOCK_H, HALF_BLOCK]
        amax = tl.maximum(finite_amax(r0, 1), finite_amax(r1, 1))  # [BLOCK_H]
        if pass_width > 0:
            pass_dim = PASS_START + tl.arange(0, PASS_BLOCK)  # [PASS_BLOCK]
            pass_ok = heads_ok[:, None] & (pass_dim < PASS_START + pass_width)[None, :]
            kept = tl.load(q_heads + pass_dim[None, :] * stride_qd, mask=pass_ok, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, finite_amax(kept, 1))
        exponent = fp8_scale_exponent(tl.maximum(amax, _Q_AMAX_FLOOR))  # [BLOCK_H]
        inverse = pow2(-exponent)[:, None]  # [BLOCK_H, 1]
        rows = values_ptr + head_rows[:, None] * HEAD_DIM  # [BLOCK_H, 1]
        if INTERLEAVED:
            codes = e4m3_bytes(tl.join(r0, r1) * inverse[:, :, None], INTERPRETER)  # [BLOCK_H, HALF_BLOCK, 2]
            tl.store(rows[:, :, None] + pair_dims[None, :, :], codes, mask=pairs_ok[:, :, None])
        else:
            tl.store(rows + (ROPE_START + pair)[None, :], e4m3_bytes(r0 * inverse, INTERPRETER), mask=pairs_ok)
            tl.store(rows + (ROPE_START + half + pair)[None, :], e4m3_bytes(r1 * inverse, INTERPRETER),
                     mask=pairs_ok)
        if pass_width > 0:
            tl.store(rows + pass_dim[None, :], e4m3_bytes(kept * inverse, INTERPRETER), mask=pass_ok)
        weights_out = ((weights * pow2(exponent)) * softmax) * head
    tl.store(weights_out_ptr + head_rows, weights_out, mask=heads_ok)


def mxfp4_kernel_supports(rope_dim: int, rope_style: str) -> bool:
    """The kernel quantises MXFP4 heads whose rope dims (and their NeoX halves) are whole 32-blocks."""
    return rope_dim % (2 * MXFP4_BLOCK if rope_style == "neox" else MXFP4_BLOCK) == 0


def rope_quant_q_triton(
    q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    weights: torch.Tensor,
    softmax_scale: float,
    head_scale: float,
    *,
    rope_style: str,
    rope_position: str,
    fmt: str,
    block_heads: int | None = None,
    num_warps: int | None = None,
    bf16x2: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Triton twin of ``rope_quant_q_reference`` (same arguments and results, bit for bit).

    MXFP4 with a rope dim that ``mxfp4_kernel_supports`` refuses (not a multiple of 64 for NeoX, of 32
    for interleaved; no DeepSeek model has one) runs the reference instead, with the same results.
    ``block_heads`` (a power of two; default all heads, at most 64) and ``num_warps`` (default 8 for FP8,
    4 for MXFP4: the fastest measured on an H200) tune the launch. ``bf16x2`` (MXFP4 only; default
    ``ROPE_MXFP4_BF16X2``; results identical) encodes on bf16 pairs; it applies to bf16 ``q`` with unit dim
    stride, even token and head strides, 4-byte aligned (other ``q`` take the fp32 path).
    No host synchronisation.
    """
    num_tokens, num_heads, head_dim = q.shape
    rope_dim = cos_sin.shape[1]
    mxfp4 = fmt == "mxfp4"
    if mxfp4 and not mxfp4_kernel_supports(rope_dim, rope_style):
        return rope_quant_q_reference(q, positions, cos_sin, weights, softmax_scale, head_scale,
                                      rope_style=rope_style, rope_position=rope_position, fmt=fmt)
    weights_out = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    if mxfp4:
        values = torch.empty((num_tokens, num_heads, head_dim // 2), dtype=torch.uint8, device=q.device)
        # Padding bytes of D/32 % 4 != 0 scale words (D = 64) hold UE8M0_ONE; the kernel writes the D/32 scales.
        scale_shape = (num_tokens, num_heads, mxfp4_scale_bytes(head_dim))
        scales = (torch.empty(scale_shape, dtype=torch.uint8, device=q.device) if head_dim % (4 * MXFP4_BLOCK) == 0
                  else torch.full(scale_shape, UE8M0_ONE, dtype=torch.uint8, device=q.device))
    else:
        values = torch.empty((num_tokens, num_heads, head_dim), dtype=torch.float8_e4m3fn, device=q.device)
        scales = None
    if num_tokens == 0 or num_heads == 0:
        return values, scales, weights_out
    if block_heads is None:
        block_heads = min(64, triton.next_power_of_2(num_heads))
    if num_warps is None:
        num_warps = 4 if mxfp4 else 8
    first = rope_position == "first"
    if bf16x2 is None:
        bf16x2 = ROPE_MXFP4_BF16X2
    words_ok = (q.dtype == torch.bfloat16 and q.stride(2) == 1 and q.stride(0) % 2 == 0 and q.stride(1) % 2 == 0
                and q.data_ptr() % 4 == 0)
    grid = (num_tokens, triton.cdiv(num_heads, block_heads))
    _rope_quant_q_kernel[grid](
        q, positions, cos_sin, weights, values.view(torch.uint8), values if scales is None else scales, weights_out,
        num_heads,
        q.stride(0), q.stride(1), q.stride(2), positions.stride(0),
        cos_sin.stride(0), cos_sin.stride(1),
        weights.stride(0), weights.stride(1),
        softmax_scale, head_scale,
        HEAD_DIM=head_dim, ROPE_DIM=rope_dim, ROPE_START=0 if first else head_dim - rope_dim,
        INTERLEAVED=rope_style == "interleaved", HALF_BLOCK=triton.next_power_of_2(rope_dim // 2),
        PASS_START=rope_dim if first else 0, PASS_BLOCK=triton.next_power_of_2(max(head_dim - rope_dim, 1)),
        MXFP4=mxfp4, BLOCK_H=block_heads,
        BF16X2=mxfp4 and bf16x2 and words_ok,
        INTERPRETER=interpreter_enabled(),
        num_warps=num_warps, enable_fp_fusion=False,
    )
    return values, scales, weights_out
