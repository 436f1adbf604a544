"""Device-side number-format codecs shared by the op families, bit-exact with ``dsa_indexer.formats``.

Encode (quantisation: ``ops.q_quant``, ``ops.k_cache``, ``train``): bf16 and e4m3 rounding, ue8m0 exponents,
e2m1 codes and MXFP4 packing, in fp32 and on packed bf16 pairs (inline PTX). Decode (``ops.logits``,
``ops.sparse_logits``): e4m3 bytes as fp16 (the upcast path), MXFP4 vectors expanded to e4m3 or fp16 scaled by
a per-vector power of two (Triton operations and an inline-PTX twin with the same bits), mxfp8 scale words.
Every helper gives the same bits on the GPU and under Triton's CPU interpreter (``INTERPRETER`` arguments pick
the explicit forms the interpreter needs). The derivations are in ``ops/q_quant/README.md`` (encode) and
``ops/logits/README.md`` (decode).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...formats import FP8_MAX, MXFP4_BLOCK, MXFP4_MAX, UE8M0_ONE
from .runtime import capability, interpreting, next_pow2

# Setting this environment variable to 1 makes every GPU take the upcast path (fp16 dots on e4m3 values rebuilt
# from their bytes) that GPUs without FP8 tensor cores take; the tests use it to run that path on any GPU.
FORCE_UPCAST_ENV = "DSA_INDEXER_FORCE_UPCAST"
MXFP4_AMAX_FLOOR = MXFP4_MAX * 2.0**-126

_FP8_MAX = tl.constexpr(FP8_MAX)
_MXFP4_MAX = tl.constexpr(MXFP4_MAX)
_MXFP4_AMAX_FLOOR = tl.constexpr(MXFP4_AMAX_FLOOR)
_MXFP4_BLOCK = tl.constexpr(MXFP4_BLOCK)
_UE8M0_ONE = tl.constexpr(UE8M0_ONE)
_SIGN_BIT = tl.constexpr(-(2**31))
_SIGN_MASK = tl.constexpr(0x80000000)
_E2M1_TO_SUBNORMAL = tl.constexpr(2.0**-126)
_LOW_NIBBLE = tl.constexpr(2**10 + 2**4)  # umulhi: (b >> 22) + (b >> 28)
_HIGH_NIBBLE = tl.constexpr(2**14 + 2**8)  # umulhi: (b >> 18) + (b >> 24)


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
    warp's 4-byte stores would write 32 sectors partly: 16% slower on an H200.
    """
    rows: tl.constexpr = packed.shape[0]
    nb: tl.constexpr = packed.shape[1]
    byte = tl.arange(0, nb * 16)  # [NB * 16]
    tl.store(value_rows[:, None] + byte[None, :], tl.reshape(packed, [rows, nb * 16]),
             mask=rows_ok[:, None] & (byte < WIDTH // 2)[None, :])
    block = tl.arange(0, nb)
    tl.store(scale_rows[:, None] + block[None, :], scales,
             mask=rows_ok[:, None] & (block < WIDTH // _MXFP4_BLOCK)[None, :])


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
    as ``load_pairs`` does, a warp's 16-byte loads touch 32 rows: 12-15% slower on an H200.)
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
    not faster on an H200)."""
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
def round_pair_to_bf16(x0, x1):
    """``(round_to_bf16(x0), round_to_bf16(x1))`` on the GPU with one packed conversion (``cvt.rn.bf16x2.f32``,
    round to nearest even like the single one) per pair instead of two."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 packed; cvt.rn.bf16x2.f32 packed, $3, $2; shl.b32 $0, packed, 16; "
        "and.b32 $1, packed, 0xFFFF0000; }",
        "=r,=r,f,f", [x0, x1], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def e4m3_bits_to_fp16(x):
    """uint8 e4m3 bit patterns -> fp16 values (exact; ``0x7F``/``0xFF`` -> NaN)."""
    bits = x.to(tl.int16)
    magnitude = ((bits & 0x7F) << 7).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    value = tl.where((bits & 0x80) != 0, -magnitude, magnitude)
    return tl.where((bits & 0x7F) == 0x7F, float("nan"), value).to(tl.float16)


@triton.jit
def dot_operand(x):
    """A tile as the tensor cores take it: e4m3 and fp16 as they are, raw e4m3 bytes rebuilt as fp16."""
    if x.dtype == tl.uint8:
        operand = e4m3_bits_to_fp16(x)
    else:
        operand = x
    return operand


@triton.jit
def mxfp4_block_scales(scale_bytes):
    """ue8m0 bytes ``[ROWS, BLOCK_D/32]`` (any integer type) -> (int32 ``[ROWS, BLOCK_D/32]``: the fp16
    exponent field of each block's multiplier ``2**(14 + e_b - e_max)``, 0 for a dropped block
    (multiplier +0); fp32 ``[ROWS]`` ``2**e_max``)."""
    exponent_bytes = scale_bytes.to(tl.int32)
    top_byte = tl.max(exponent_bytes, axis=1)  # [ROWS]
    scale_field = tl.maximum(29 - (top_byte[:, None] - exponent_bytes), 0)
    row_mul = (top_byte << 23).to(tl.float32, bitcast=True)
    return scale_field, row_mul


@triton.jit
def mxfp4_halves(packed, scale_bytes, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Packed e2m1 ``[ROWS, BLOCK_D/32, 16]`` uint8 and ue8m0 bytes ``[ROWS, BLOCK_D/32]`` -> (even
    elements, odd elements: fp16 ``[ROWS, BLOCK_D/2]`` each, divided by ``2**e_max``; fp32 ``[ROWS]``
    ``2**e_max``). Element ``2i`` is the low nibble of byte ``i``."""
    scale_field, row_mul = mxfp4_block_scales(scale_bytes)
    block_scale = (scale_field << 10).to(tl.int16).to(tl.float16, bitcast=True)[:, :, None]  # [ROWS, BLOCK_D/32, 1]
    bits = packed.to(tl.int32)  # [ROWS, BLOCK_D/32, 16]
    even = (((bits << 12) & 0x8000) | ((bits << 9) & 0x0E00)).to(tl.int16).to(tl.float16, bitcast=True)
    odd = (((bits << 8) & 0x8000) | ((bits << 5) & 0x0E00)).to(tl.int16).to(tl.float16, bitcast=True)
    return (tl.reshape(even * block_scale, (ROWS, BLOCK_D // 2)), tl.reshape(odd * block_scale, (ROWS, BLOCK_D // 2)),
            row_mul)


# Per block: e4m3 of the eight e2m1 magnitudes (fp16 ``code << 9``, codes 0..7) times the block's fp16x2
# multiplier ``$2``, with the instructions of the Triton path (``mul.rn.f16x2``, ``cvt.rn.satfinite``),
# so each entry has the bits that path gives: ``$0`` holds codes 0..3 (byte i: code i), ``$1`` codes 4..7.
E4M3_TABLE_ASM = tl.constexpr("""
{
.reg .b32 c<4>, h<4>;
.reg .b16 e<4>;
mov.b32 c0, 0x02000000;
mov.b32 c1, 0x06000400;
mov.b32 c2, 0x0A000800;
mov.b32 c3, 0x0E000C00;
mul.rn.f16x2 h0, c0, $2;
mul.rn.f16x2 h1, c1, $2;
mul.rn.f16x2 h2, c2, $2;
mul.rn.f16x2 h3, c3, $2;
cvt.rn.satfinite.e4m3x2.f16x2 e0, h0;
cvt.rn.satfinite.e4m3x2.f16x2 e1, h1;
cvt.rn.satfinite.e4m3x2.f16x2 e2, h2;
cvt.rn.satfinite.e4m3x2.f16x2 e3, h3;
mov.b32 $0, {e0, e1};
mov.b32 $1, {e2, e3};
}
""")
# One packed word ``$2`` (four bytes of one block, low nibble = even element) -> its four even and four
# odd e4m3 values (``$0``, ``$1``; byte i from byte i): the three magnitude bits of each nibble index the
# block's table (``$3``, ``$7``: bytes 0..7) through ``prmt``, the two results are de-interleaved by
# byte, and each nibble's sign bit is OR-ed into bit 7 (the tables round to nearest, which is symmetric
# in the sign, -0 included). Nine instructions for eight values.
E2M1_EXPAND_ASM = tl.constexpr("""
{
.reg .b32 m, mh, p0, p1, sl;
and.b32 m, $2, 0x77777777;
shr.b32 mh, m, 16;
prmt.b32 p0, $3, $7, m;
prmt.b32 p1, $3, $7, mh;
prmt.b32 $0, p0, p1, 0x6420;
prmt.b32 $1, p0, p1, 0x7531;
shl.b32 sl, $2, 4;
lop3.b32 $0, $0, sl, 0x80808080, 0xF8;
lop3.b32 $1, $1, $2, 0x80808080, 0xF8;
}
""")


@triton.jit
def mxfp4_halves_e4m3(packed, scale_bytes):
    """GPU twin of ``mxfp4_halves`` followed by the e4m3 conversion, bit for bit, in inline PTX: packed
    ``[ROWS, BLOCK_D/32, 16]`` uint8 -> (even, odd: e4m3 ``[ROWS, BLOCK_D/32, 16]``; fp32 ``[ROWS]``)."""
    scale_field, row_mul = mxfp4_block_scales(scale_bytes)
    scale_pair = scale_field * 0x04000400  # [ROWS, BLOCK_D/32] fp16x2 bits (multiplier, multiplier)
    table_low, table_high = tl.inline_asm_elementwise(
        E4M3_TABLE_ASM, "=r,=r,r", [scale_pair], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    even, odd = tl.inline_asm_elementwise(
        E2M1_EXPAND_ASM, "=r,=r,r,r,r,r,r,r,r,r,r",
        [packed, table_low[:, :, None], table_high[:, :, None]],
        dtype=(tl.float8e4nv, tl.float8e4nv), is_pure=True, pack=4)
    return even, odd, row_mul


def key_block_depth(dim: int, mxfp4: bool) -> int:
    """``BLOCK_D`` of a ``dim``-element key row in the logits kernels: a power of two with every dot at least
    32 deep (Hopper's e4m3 wgmma needs K >= 32). MXFP4 rows contract as two half-depth dots (even and odd
    elements), so they pad to 64: at D = 32 the second scale block is masked to zeros."""
    return next_pow2(dim, 64 if mxfp4 else 32)


@triton.jit
def mxfp4_dot_order(x, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """De-interleaved half ``[ROWS, BLOCK_D/2]`` (or ``[ROWS, BLOCK_D/32, 16]``) -> the same values in
    the contraction order of the decode dot: position ``16i + 4b + j`` (``i`` < 4, ``j`` < 4, ``b`` < the
    block count) holds half element ``16b + 4i + j``."""
    blocks = tl.reshape(x, (ROWS, BLOCK_D // 32, 4, 4))
    return tl.reshape(tl.permute(blocks, (0, 2, 1, 3)), (ROWS, BLOCK_D // 2))


@triton.jit
def mxfp4_dot_order_source(BLOCK_D: tl.constexpr):
    """``[BLOCK_D/2]``: the de-interleaved half element at each position of ``mxfp4_dot_order``."""
    position = tl.arange(0, BLOCK_D // 2)
    return 16 * ((position // 4) % (BLOCK_D // 32)) + 4 * (position // (BLOCK_D // 8)) + position % 4


@triton.jit(do_not_specialize=["num_rows"])
def _mxfp4_rows_kernel(
    packed_ptr, stride_packed, scales_ptr, stride_scales, out_ptr, stride_out, mul_ptr,
    num_rows,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Rows ``[program_id(0) * BLOCK_R, +BLOCK_R)`` of packed MXFP4 -> ``out`` (e4m3 or fp16; even elements
    in columns ``[0, D/2)``, odd ones in ``[D/2, D)``) and ``mul``."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_ok = rows < num_rows
    block = tl.arange(0, BLOCK_D // 32)
    byte = tl.arange(0, 16)
    block_ok = block < DIM // 32
    packed = tl.load(packed_ptr + rows[:, None, None] * stride_packed + block[None, :, None] * 16 + byte[None, None, :],
                     mask=row_ok[:, None, None] & block_ok[None, :, None], other=0)  # [BLOCK_R, BLOCK_D/32, 16]
    scale_bytes = tl.load(scales_ptr + rows[:, None] * stride_scales + block[None, :],
                          mask=row_ok[:, None] & block_ok[None, :], other=0)  # [BLOCK_R, BLOCK_D/32]
    even, odd, row_mul = mxfp4_halves(packed, scale_bytes, BLOCK_R, BLOCK_D)
    half = tl.arange(0, BLOCK_D // 2)
    out_rows = out_ptr + rows[:, None] * stride_out + half[None, :]  # [BLOCK_R, BLOCK_D/2]
    half_ok = row_ok[:, None] & (half < DIM // 2)[None, :]
    tl.store(out_rows, even, mask=half_ok)
    tl.store(out_rows + DIM // 2, odd, mask=half_ok)
    tl.store(mul_ptr + rows, row_mul, mask=row_ok)


@triton.jit
def ue8m0_word_to_fp32(word):
    """The fp32 scale ``2**(e - 127)`` of mxfp8 scale words (int32: four equal ue8m0 bytes ``e``; the low byte,
    little-endian, is read)."""
    return ((word & 0xFF) << 23).to(tl.float32, bitcast=True)


def use_upcast(device: torch.device) -> bool:
    """fp16 dots instead of e4m3 ones: forced by ``DSA_INDEXER_FORCE_UPCAST=1``, automatic on CUDA
    devices of compute capability below 8.9 (no FP8 tensor cores)."""
    if os.environ.get(FORCE_UPCAST_ENV, "0") == "1":
        return True
    return device.type == "cuda" and capability(device) < (8, 9)


def mxfp4_rows(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 ``[..., D/2]`` with ue8m0 ``[..., D/32]`` -> (``dtype`` ``[..., D]`` values / 2**e_max,
    de-interleaved: even elements, then odd ones; fp32 ``[...]`` 2**e_max)."""
    lead = packed.shape[:-1]
    dim = packed.shape[-1] * 2
    packed_rows = packed.reshape(-1, packed.shape[-1])
    scale_rows = scales.reshape(-1, scales.shape[-1])
    num_rows = packed_rows.shape[0]
    values = torch.empty((num_rows, dim), dtype=dtype, device=packed.device)
    row_mul = torch.empty((num_rows,), dtype=torch.float32, device=packed.device)
    if num_rows:
        block_r = 16 if interpreting() else 64
        _mxfp4_rows_kernel[(triton.cdiv(num_rows, block_r),)](
            packed_rows, packed_rows.stride(0), scale_rows, scale_rows.stride(0), values, values.stride(0), row_mul,
            num_rows, DIM=dim, BLOCK_D=next_pow2(dim, 32), BLOCK_R=block_r, num_warps=4,
        )
    return values.view(*lead, dim), row_mul.view(lead)


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a contiguous copy where its last dimension is strided (the kernels load rows whole)."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()
