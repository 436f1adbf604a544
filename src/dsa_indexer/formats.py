"""FP8 (e4m3) and MXFP4 (e2m1) encode/decode: the single source of numeric truth.

Every kernel in the package must reproduce these functions bit for bit. The rules are written out
in ``docs/contract.md``; in short:

FP8 e4m3, one scale per ``block_size`` elements
    ``amax = max(|x|)`` over the finite elements of the block, floored at ``amax_floor``;
    ``scale = amax / 448`` (IEEE fp32 division), rounded up to a power of two when
    ``scale_fmt="ue8m0"`` (exponent clamped to [-126, 127]);
    ``value = e4m3(clamp(x / scale, -448, 448))`` with round-to-nearest-even.
    NaN stays NaN, ``±inf`` saturates to ``±448``.

MXFP4 e2m1, one ue8m0 scale per 32 elements
    ``scale = 2 ** ceil(log2(max(amax, 6 * 2**-126) / 6))`` stored as the byte ``exponent + 127``;
    magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}, round-to-nearest, ties to even, saturating at 6; no
    negative zero; NaN encodes as +0 and ``±inf`` saturates to ``±6``. Two values per byte, the
    even element in the low nibble. A vector's ``D/32`` scale bytes are padded to a whole number of
    4-byte words with ``127`` (the scale 1.0), as DeepGEMM packs them: ``D = 64`` has one word
    ``[s0, s1, 127, 127]``, ``D = 128`` one word of four scales.

MXFP8 scale words (``scale_fmt="mxfp8"`` FP8 K caches)
    a power-of-two FP8 scale ``2**e`` stored as four equal ue8m0 bytes ``e + 127`` instead of an fp32.
"""

from __future__ import annotations

import torch

from ._validation import check_floating, check_last_dim_multiple, check_positive_finite, check_positive_int, check_tensor
from .ops.common.registration import registered_op

FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
K_AMAX_FLOOR = 1e-4
Q_AMAX_FLOOR = 1e-10

MXFP4_BLOCK = 32
MXFP4_MAX = 6.0
# ue8m0 byte of the scale 1.0: the padding of MXFP4 scale words.
UE8M0_ONE = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding thresholds between consecutive e2m1 magnitudes. ``>`` where the tie goes down to the
# even code, ``>=`` where it goes up to the even code.
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

SCALE_FORMATS = ("ue8m0", "fp32")
_MIN_EXPONENT = -126
_MAX_EXPONENT = 127


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(x))`` of positive finite fp32 values, as int32 (no float log rounding)."""
    mantissa, exponent = torch.frexp(x)
    # x = mantissa * 2**exponent with mantissa in [0.5, 1): a power of two has mantissa 0.5.
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).to(torch.int32)


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` as exact fp32 for int exponents in [-126, 127] (built from the bits)."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def _ieee_divide(numerator: torch.Tensor, denominator: float) -> torch.Tensor:
    """Correctly rounded fp32 division. Dividing a CUDA tensor by a Python scalar multiplies by the
    rounded reciprocal instead, which differs in the last bit for some inputs."""
    return numerator / torch.full_like(numerator, denominator)


def _finite_block_amax(blocks: torch.Tensor) -> torch.Tensor:
    magnitude = blocks.abs()
    return torch.where(torch.isfinite(blocks), magnitude, torch.zeros_like(magnitude)).amax(dim=-1)


def fp8_scales(x: torch.Tensor, block_size: int, scale_fmt: str, amax_floor: float) -> torch.Tensor:
    """Per-block fp32 scales of ``x [..., D]`` -> ``[..., D // block_size]``."""
    blocks = x.float().unflatten(-1, (-1, block_size))
    amax = _finite_block_amax(blocks).clamp_min(amax_floor)
    scale = _ieee_divide(amax, FP8_MAX)
    if scale_fmt == "ue8m0":
        scale = pow2(ceil_log2(scale).clamp(_MIN_EXPONENT, _MAX_EXPONENT))
    return scale


@registered_op(
    "quantize_fp8",
    fake=lambda x, *, block_size=128, scale_fmt="ue8m0", amax_floor=K_AMAX_FLOOR: (
        torch.empty_like(x, dtype=FP8_DTYPE),
        x.new_empty((*x.shape[:-1], x.shape[-1] // block_size), dtype=torch.float32),
    ),
)
def quantize_fp8(
    x: torch.Tensor,
    *,
    block_size: int = 128,
    scale_fmt: str = "ue8m0",
    amax_floor: float = K_AMAX_FLOOR,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., D]`` to e4m3 with one fp32 scale per ``block_size`` elements.

    Returns ``(values float8_e4m3fn [..., D], scales float32 [..., D // block_size])`` such that
    ``values * scale`` approximates ``x``. ``scale_fmt`` is ``"ue8m0"`` (power-of-two scales) or
    ``"fp32"`` (plain ``amax / 448``). ``block_size`` is an int ``>= 1`` dividing ``D``. ``amax_floor``
    (finite, ``> 0``) is 1e-4 for K and 1e-10 for Q by convention.
    """
    check_tensor("x", x, min_ndim=1)
    check_floating("x", x)
    check_positive_int("block_size", block_size)
    check_last_dim_multiple("x", x, block_size, "block_size")
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FORMATS}, got {scale_fmt!r}")
    amax_floor = check_positive_finite("amax_floor", amax_floor)
    scale = fp8_scales(x, block_size, scale_fmt, amax_floor)
    blocks = x.float().unflatten(-1, (-1, block_size))
    scaled = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(FP8_DTYPE).flatten(-2), scale


@registered_op("dequantize_fp8", fake=lambda values, scales, *, block_size=128: torch.empty_like(
    values, dtype=torch.float32))
def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, *, block_size: int = 128) -> torch.Tensor:
    """``values [..., D]`` e4m3 times ``scales [..., D // block_size]`` -> float32 ``[..., D]``."""
    check_tensor("values", values, dtype=FP8_DTYPE, min_ndim=1)
    check_positive_int("block_size", block_size)
    check_last_dim_multiple("values", values, block_size, "block_size")
    expected = (*values.shape[:-1], values.shape[-1] // block_size)
    check_tensor("scales", scales, dtype=torch.float32, shape=expected, device=values.device)
    blocks = values.float().unflatten(-1, (-1, block_size))
    return (blocks * scales.unsqueeze(-1)).flatten(-2)


def mxfp4_scale_bytes(dim: int) -> int:
    """Scale bytes of a ``dim``-element MXFP4 vector: ``dim / 32`` rounded up to whole 4-byte words."""
    return -(-dim // (4 * MXFP4_BLOCK)) * 4


def ue8m0_to_fp32(scale_bytes: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes (uint8, any shape) -> fp32 ``2 ** (byte - 127)``, built from the bits (exact for bytes
    1..254; byte 0 reads as 0.0 and 255 as inf)."""
    return (scale_bytes.to(torch.int32) << 23).view(torch.float32)


def mxfp8_scale_words(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales ``[...]`` -> their mxfp8 words: uint8 ``[..., 4]``, four equal ue8m0 bytes."""
    exponent_byte = ((scales.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return exponent_byte.unsqueeze(-1).expand(*scales.shape, 4).contiguous()


def mxfp4_exponents(x: torch.Tensor) -> torch.Tensor:
    """Unbiased ue8m0 exponents of the 32-element blocks of ``x [..., D]`` -> int32 ``[..., D // 32]``."""
    blocks = x.float().unflatten(-1, (-1, MXFP4_BLOCK))
    amax = _finite_block_amax(blocks).clamp_min(MXFP4_MAX * 2.0**_MIN_EXPONENT)
    return ceil_log2(_ieee_divide(amax, MXFP4_MAX))


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (uint8, sign in bit 3) of already-scaled fp32 values."""
    magnitude = scaled.abs()
    code = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for threshold, inclusive in _E2M1_STEPS:
        code += (magnitude >= threshold if inclusive else magnitude > threshold).to(torch.uint8)
    negative = (scaled < 0) & (code != 0)
    return code | (negative.to(torch.uint8) << 3)


@registered_op("quantize_mxfp4", fake=lambda x: (
    x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8),
    x.new_empty((*x.shape[:-1], mxfp4_scale_bytes(x.shape[-1])), dtype=torch.uint8),
))
def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., D]`` to MXFP4 (D a multiple of 32).

    Returns ``(packed uint8 [..., D // 2], scales uint8 [..., S])``: two e2m1 codes per byte,
    element ``2i`` in the low nibble; scale byte ``b < D // 32`` is block ``b``'s ``exponent + 127``,
    and ``S = mxfp4_scale_bytes(D)`` pads them to whole 4-byte words with ``UE8M0_ONE``.
    """
    check_tensor("x", x, min_ndim=1)
    check_floating("x", x)
    check_last_dim_multiple("x", x, MXFP4_BLOCK, "32 (the MXFP4 block)")
    exponent = mxfp4_exponents(x)
    blocks = x.float().unflatten(-1, (-1, MXFP4_BLOCK))
    codes = e2m1_codes(blocks / pow2(exponent).unsqueeze(-1)).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    blocks = exponent.shape[-1]
    scales = torch.full((*exponent.shape[:-1], mxfp4_scale_bytes(x.shape[-1])), UE8M0_ONE, dtype=torch.uint8,
                        device=x.device)
    scales[..., :blocks] = (exponent + 127).to(torch.uint8)
    return packed, scales


@registered_op("dequantize_mxfp4", fake=lambda packed, scales: packed.new_empty(
    (*packed.shape[:-1], packed.shape[-1] * 2), dtype=torch.float32))
def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``packed uint8 [..., D // 2]`` and ``scales uint8 [..., mxfp4_scale_bytes(D)]`` -> float32 ``[..., D]``
    (the padding bytes past ``D // 32`` are not read)."""
    check_tensor("packed", packed, dtype=torch.uint8, min_ndim=1)
    check_last_dim_multiple("packed", packed, MXFP4_BLOCK // 2, "16 (half the MXFP4 block)")
    dim = packed.shape[-1] * 2
    expected = (*packed.shape[:-1], mxfp4_scale_bytes(dim))
    check_tensor("scales", scales, dtype=torch.uint8, shape=expected, device=packed.device)
    scales = scales[..., : dim // MXFP4_BLOCK]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    magnitude = table[(codes & 0x7).long()]
    values = torch.where((codes & 0x8) != 0, -magnitude, magnitude)
    scale = pow2(scales.to(torch.int32) - 127)
    return (values.unflatten(-1, (-1, MXFP4_BLOCK)) * scale.unsqueeze(-1)).flatten(-2)
