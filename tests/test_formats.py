"""FP8 / MXFP4 encoders against independent formulas written element by element in Python."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from dsa_indexer import dequantize_fp8, dequantize_mxfp4, quantize_fp8, quantize_mxfp4
from dsa_indexer.formats import ceil_log2, mxfp8_scale_words, pow2, ue8m0_to_fp32


def fp32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def e4m3_value(code: int) -> float:
    """Value of an e4m3fn byte from its bit fields (bias 7, no infinities, 0x7F/0xFF are NaN)."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


POSITIVE_E4M3 = [(code, e4m3_value(code)) for code in range(0x7F)]


def e4m3_round(value: float) -> int:
    """Nearest e4m3fn code; ties to the even code (mantissa LSB 0); the sign is kept, -0.0 included."""
    if math.isnan(value):
        return 0x7F
    magnitude = abs(value)
    best = min(POSITIVE_E4M3, key=lambda cv: (abs(cv[1] - magnitude), cv[0] & 1))
    code = best[0]
    return code | (0x80 if math.copysign(1.0, value) < 0 else 0)


def ceil_pow2_exponent(x: float) -> int:
    """Smallest integer e with 2**e >= x, by search (independent of frexp)."""
    e = 0
    while 2.0**e < x:
        e += 1
    while 2.0 ** (e - 1) >= x:
        e -= 1
    return e


def oracle_fp8(row: list[float], block_size: int, scale_fmt: str, amax_floor: float):
    codes, scales = [], []
    for start in range(0, len(row), block_size):
        block = row[start : start + block_size]
        amax = max([abs(v) for v in block if math.isfinite(v)] + [0.0])
        amax = max(amax, fp32(amax_floor))
        scale = float(np.float32(amax) / np.float32(448.0))
        if scale_fmt == "ue8m0":
            scale = 2.0 ** ceil_pow2_exponent(scale)
        scales.append(scale)
        for v in block:
            scaled = v if math.isnan(v) else min(max(fp32(v / scale), -448.0), 448.0)
            codes.append(e4m3_round(scaled))
    return codes, scales


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_round(value: float) -> int:
    if math.isnan(value):
        return 0
    magnitude = min(abs(value), 6.0)
    code = min(range(8), key=lambda c: (abs(E2M1[c] - magnitude), c & 1))
    return code | (8 if value < 0 and code != 0 else 0)


def oracle_mxfp4(row: list[float]):
    codes, exponents = [], []
    for start in range(0, len(row), 32):
        block = row[start : start + 32]
        amax = max([abs(v) for v in block if math.isfinite(v)] + [0.0])
        amax = max(amax, 6.0 * 2.0**-126)
        exponent = ceil_pow2_exponent(float(np.float32(amax) / np.float32(6.0)))
        exponents.append(exponent)
        codes.extend(e2m1_round(v / 2.0**exponent) for v in block)
    packed = [codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)]
    return packed, [e + 127 for e in exponents]


def edge_rows() -> torch.Tensor:
    """Rows that hit every rounding corner: midpoints, ±448, ±6, zeros, subnormals, non-finite."""
    rows = []
    mid = [e4m3_value(c) for c in range(0x7E)]
    midpoints = [(a + b) / 2 for a, b in zip(mid, mid[1:])]
    rows.append(([448.0] + midpoints + [-m for m in midpoints])[:128])
    rows.append([0.0] * 128)
    rows.append([1e-40 * (i + 1) for i in range(128)])
    rows.append([448.0 * (-1) ** i for i in range(128)])
    rows.append([6.0, -6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, -0.0] + [0.1] * 116)
    rows.append([float("nan"), 1.0, float("inf"), -2.0] + [0.5] * 124)
    rows.append([float("-inf")] + [3.0] * 127)
    rows.append([125.0, 124.0, 58.0, -136.0] * 32)
    return torch.tensor(rows, dtype=torch.float32)


def random_rows(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-6, 6, 6)[torch.randint(0, 6, (6, 1), generator=gen)]
    return torch.randn(6, 256, generator=gen) * scale


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "fp32"])
@pytest.mark.parametrize("block_size", [128, 32])
@pytest.mark.parametrize("rows", ["edge", "random"])
def test_fp8_matches_elementwise_oracle(scale_fmt, block_size, rows):
    x = edge_rows() if rows == "edge" else random_rows(block_size)
    values, scales = quantize_fp8(x, block_size=block_size, scale_fmt=scale_fmt)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    for r in range(x.shape[0]):
        codes, expected_scales = oracle_fp8(x[r].tolist(), block_size, scale_fmt, 1e-4)
        assert values[r].view(torch.uint8).tolist() == codes, f"row {r}"
        assert scales[r].tolist() == expected_scales, f"row {r}"


def test_fp8_q_floor_applies_to_all_zero_block():
    values, scales = quantize_fp8(torch.zeros(2, 128), amax_floor=1e-10)
    assert scales.tolist() == [[2.0 ** ceil_pow2_exponent(fp32(1e-10) / 448)]] * 2
    assert values.view(torch.uint8).eq(0).all()


def test_fp8_bf16_input_is_read_exactly():
    x = random_rows(3).bfloat16()
    assert torch.equal(
        quantize_fp8(x)[0].view(torch.uint8), quantize_fp8(x.float())[0].view(torch.uint8)
    )


@pytest.mark.parametrize("rows", ["edge", "random"])
def test_mxfp4_matches_elementwise_oracle(rows):
    x = edge_rows() if rows == "edge" else random_rows(7)
    packed, scales = quantize_mxfp4(x)
    assert packed.shape == (x.shape[0], x.shape[1] // 2) and scales.shape == (x.shape[0], x.shape[1] // 32)
    for r in range(x.shape[0]):
        expected_packed, expected_scales = oracle_mxfp4(x[r].tolist())
        assert packed[r].tolist() == expected_packed, f"row {r}"
        assert scales[r].tolist() == expected_scales, f"row {r}"


def test_mxfp4_ties_go_to_even():
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4])
    packed, scales = quantize_mxfp4(ties)
    assert scales.tolist() == [[127, 127, 127, 127]]  # one block scale (2**0), then word padding
    assert dequantize_mxfp4(packed, scales)[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


def test_mxfp4_even_element_is_low_nibble_and_no_negative_zero():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 6.0, -3.0, -0.1
    packed, _ = quantize_mxfp4(x)
    assert packed[0, 0].item() == 0x7 | (0xD << 4)
    assert packed[0, 1].item() == 0x0


@pytest.mark.parametrize("shape", [(1, 128), (3, 5, 64), (0, 128)])
def test_round_trip_shapes_and_error_bound(shape):
    x = torch.randn(shape)
    block = min(128, shape[-1])
    values, scales = quantize_fp8(x, block_size=block)
    restored = dequantize_fp8(values, scales, block_size=block)
    assert restored.shape == x.shape
    if x.numel():
        assert ((restored - x).abs() <= scales.amax() * 16 + 1e-12).all()
    packed, mx_scales = quantize_mxfp4(x)
    assert dequantize_mxfp4(packed, mx_scales).shape == x.shape


def test_dequantize_fp8_is_exact_product():
    x = random_rows(11)
    values, scales = quantize_fp8(x)
    expected = torch.tensor([[e4m3_value(c) for c in row] for row in values.view(torch.uint8).tolist()])
    assert torch.equal(dequantize_fp8(values, scales), expected * scales.repeat_interleave(128, dim=1))


def test_ceil_log2_and_pow2_are_exact():
    x = torch.tensor([1.0, 1.0000001, 0.75, 2.0**-126, 3.0e38, 2.0**-140, 448.0 / 448.0])
    assert ceil_log2(x).tolist() == [ceil_pow2_exponent(v) for v in x.tolist()]
    exponents = torch.arange(-126, 128)
    assert pow2(exponents).tolist() == [2.0**e for e in range(-126, 128)]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quantize_fp8(torch.randn(4, 100)), "x's last dimension"),
        (lambda: quantize_fp8(torch.randint(0, 4, (2, 128))), "x must be a float"),
        (lambda: quantize_fp8(torch.randn(2, 128), scale_fmt="e5m2"), "scale_fmt"),
        (lambda: quantize_fp8(torch.randn(2, 128), amax_floor=0.0), "amax_floor"),
        (lambda: quantize_fp8(torch.randn(2, 128), amax_floor=float("inf")), "amax_floor"),
        (lambda: quantize_fp8(torch.randn(2, 128), amax_floor=float("nan")), "amax_floor"),
        (lambda: quantize_fp8(torch.randn(2, 128), amax_floor=-1e-4), "amax_floor"),
        (lambda: quantize_fp8(torch.randn(2, 128), amax_floor="1e-4"), "amax_floor"),
        (lambda: quantize_fp8(torch.randn(2, 128), amax_floor=True), "amax_floor"),
        (lambda: quantize_fp8(torch.randn(2, 128), block_size=128.0), "block_size"),
        (lambda: quantize_fp8(torch.randn(2, 128), block_size=0), "block_size"),
        (lambda: dequantize_fp8(torch.zeros(2, 128).to(torch.float8_e4m3fn), torch.ones(2, 1), block_size=128.0),
         "block_size"),
        (lambda: quantize_fp8([1.0] * 128), "x must be a torch.Tensor"),
        (lambda: quantize_mxfp4(torch.randn(2, 48)), "x's last dimension"),
        (lambda: dequantize_fp8(torch.zeros(2, 128), torch.ones(2, 1)), "values must have dtype"),
        (
            lambda: dequantize_fp8(torch.zeros(2, 128).to(torch.float8_e4m3fn), torch.ones(2, 2)),
            "scales must have shape",
        ),
        (lambda: dequantize_mxfp4(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8)), "scales"),
        (lambda: dequantize_mxfp4(torch.zeros(2, 64), torch.zeros(2, 4, dtype=torch.uint8)), "packed"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("dim", [32, 64, 96, 128, 256])
def test_mxfp4_scale_bytes_pad_to_words_as_deepgemm_packs_them(dim):
    """D/32 block scales, then 127 (the scale 1.0) up to a whole number of 4-byte words: DeepGEMM's
    ``per_token_cast_to_fp4(..., use_packed_ue8m0=True)`` layout (one int32 per 128 dims, 36-byte rows at D = 64)."""
    x = torch.randn(3, dim) * torch.tensor([[1e-3], [1.0], [1e3]])
    packed, scales = quantize_mxfp4(x)
    blocks = dim // 32
    words = -(-blocks // 4)
    assert scales.shape == (3, 4 * words)
    expected_exponents = [[math.ceil(math.log2(max(abs(v) for v in row[b * 32:(b + 1) * 32]) / 6)) + 127
                           for b in range(blocks)] for row in x.tolist()]
    assert scales[:, :blocks].tolist() == expected_exponents
    assert (scales[:, blocks:] == 127).all()
    other_padding = scales.clone()
    other_padding[:, blocks:] = 0
    assert torch.equal(dequantize_mxfp4(packed, other_padding), dequantize_mxfp4(packed, scales))  # padding unread


def test_mxfp8_scale_words_are_four_exponent_bytes_and_decode_exactly():
    scales = torch.tensor([2.0**-126, 2.0**-3, 1.0, 2.0**40, 2.0**127])
    words = mxfp8_scale_words(scales)
    assert words.dtype == torch.uint8 and words.shape == (5, 4)
    assert words.tolist() == [[b] * 4 for b in (1, 124, 127, 167, 254)]
    assert torch.equal(ue8m0_to_fp32(words[:, 0]), scales)
