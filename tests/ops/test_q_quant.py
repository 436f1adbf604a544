"""rope_quant_q against an element-by-element Python oracle: RoPE pairs, bf16 rounding, quantisers, fold."""

from __future__ import annotations

import bisect
import math
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch

from dsa_indexer.backend import ENV_VAR
from dsa_indexer.formats import quantize_fp8
from dsa_indexer.ops.q_quant import rope_quant_q

NAN = float("nan")
INF = float("inf")


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def fp32(value: float) -> float:
    """Round a Python float to the nearest fp32 (ties to even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def bf16(value: float) -> float:
    """Round an fp32-representable value to bf16 by its bits: nearest, ties to the even upper half."""
    if math.isnan(value):
        return value
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def e4m3_from_code(code: int) -> float:
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    magnitude = mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return -magnitude if code & 0x80 else magnitude


E4M3_MAGNITUDES = [e4m3_from_code(code) for code in range(0x7F)]  # increasing with the code


def e4m3_code(value: float) -> int:
    """Nearest e4m3fn code of ``value`` (already within ±448), ties to the even code, sign kept."""
    magnitude = abs(value)
    upper = bisect.bisect_left(E4M3_MAGNITUDES, magnitude)
    if upper == len(E4M3_MAGNITUDES):
        code = upper - 1
    elif E4M3_MAGNITUDES[upper] == magnitude or upper == 0:
        code = upper
    else:
        below, above = magnitude - E4M3_MAGNITUDES[upper - 1], E4M3_MAGNITUDES[upper] - magnitude
        code = upper - 1 if below < above or (below == above and (upper - 1) % 2 == 0) else upper
    return code | (0x80 if math.copysign(1.0, value) < 0 else 0)


E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_code(value: float) -> int:
    if math.isnan(value):
        return 0
    magnitude = min(abs(value), 6.0)
    distances = [abs(m - magnitude) for m in E2M1_MAGNITUDES]
    candidates = [c for c in range(8) if distances[c] == min(distances)]
    code = candidates[0] if len(candidates) == 1 else next(c for c in candidates if c % 2 == 0)
    return code | (8 if value < 0 and code else 0)


def smallest_pow2_exponent_at_least(x: float) -> int:
    return math.ceil(math.log2(x))


def oracle_fp8_head(head: list[float]) -> tuple[list[int | None], float]:
    """(e4m3 codes, None for NaN elements) and the ue8m0 scale of one head vector, floor 1e-10."""
    amax = max([abs(v) for v in head if math.isfinite(v)] + [0.0])
    scale = 2.0 ** smallest_pow2_exponent_at_least(fp32(max(amax, fp32(1e-10)) / 448.0))
    codes = [None if math.isnan(v) else e4m3_code(min(max(v / scale, -448.0), 448.0)) for v in head]
    return codes, scale


def oracle_mxfp4_head(head: list[float]) -> tuple[list[int], list[int]]:
    codes, scale_bytes = [], []
    for start in range(0, len(head), 32):
        block = head[start : start + 32]
        amax = max([abs(v) for v in block if math.isfinite(v)] + [0.0])
        exponent = smallest_pow2_exponent_at_least(fp32(max(amax, 6.0 * 2.0**-126) / 6.0))
        scale_bytes.append(exponent + 127)
        codes.extend(e2m1_code(v / 2.0**exponent) for v in block)
    scale_bytes += [127] * (-len(scale_bytes) % 4)  # padded to whole 4-byte words with the scale 1.0
    return [codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)], scale_bytes


def rotate_half_neox(rope: list[float], cos: list[float], sin: list[float]) -> list[float]:
    """NeoX as ``x * [cos, cos] + rotate_half(x) * [sin, sin]``, every product and sum rounded to fp32."""
    half = len(rope) // 2
    rotated_half = [-v for v in rope[half:]] + rope[:half]
    return [
        bf16(fp32(fp32(x * c) + fp32(r * s))) for x, r, c, s in zip(rope, rotated_half, cos + cos, sin + sin)
    ]


def rotate_complex_interleaved(rope: list[float], cos: list[float], sin: list[float]) -> list[float]:
    """Interleaved pairs as complex numbers times ``cos + i sin``, each product and sum rounded to fp32."""
    out = []
    for pair, (c, s) in enumerate(zip(cos, sin)):
        z, w = complex(rope[2 * pair], rope[2 * pair + 1]), complex(c, s)
        real = fp32(fp32(z.real * w.real) - fp32(z.imag * w.imag))
        imag = fp32(fp32(z.real * w.imag) + fp32(z.imag * w.real))
        out += [bf16(real), bf16(imag)]
    return out


def oracle_rope_head(head: list[float], cos: list[float], sin: list[float], style: str, position: str) -> list[float]:
    rope_dim = 2 * len(cos)
    start = 0 if position == "first" else len(head) - rope_dim
    rotate = rotate_half_neox if style == "neox" else rotate_complex_interleaved
    return head[:start] + rotate(head[start : start + rope_dim], cos, sin) + head[start + rope_dim :]


def oracle(q, positions, cos_sin, weights, softmax_scale, head_scale, *, rope_style, rope_position, fmt):
    """Expected (q bytes [T][H][...], scale bytes or None, weights_out fp32 bits) from Python scalars."""
    half = cos_sin.shape[1] // 2
    table = cos_sin.float().tolist()
    q_rows, scale_rows, weight_rows = [], [], []
    for t, head_rows in enumerate(q.float().tolist()):
        cos, sin = table[positions[t]][:half], table[positions[t]][half:]
        q_heads, scale_heads, weight_heads = [], [], []
        for h, head in enumerate(head_rows):
            rotated = oracle_rope_head(head, cos, sin, rope_style, rope_position)
            weight = np.float32(weights[t, h].item())
            if fmt == "fp8":
                codes, scale = oracle_fp8_head(rotated)
                q_heads.append(codes)
                folded = weight * np.float32(scale) * np.float32(softmax_scale) * np.float32(head_scale)
            else:
                packed, scale_bytes = oracle_mxfp4_head(rotated)
                q_heads.append(packed)
                scale_heads.append(scale_bytes)
                folded = weight * np.float32(softmax_scale) * np.float32(head_scale)
            weight_heads.append(int(np.float32(folded).view(np.int32)))
        q_rows.append(q_heads)
        scale_rows.append(scale_heads)
        weight_rows.append(weight_heads)
    return q_rows, (scale_rows if fmt == "mxfp4" else None), weight_rows


def rope_table(max_pos: int, rope_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``[max_pos, rope_dim]`` of ``[cos | sin]`` for base-10000 frequencies."""
    half = rope_dim // 2
    inverse_frequency = 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / rope_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inverse_frequency
    return torch.cat((angles.cos(), angles.sin()), dim=1).to(dtype)


def assert_matches_oracle(result, expected, fmt):
    q_quant, q_scale, weights_out = result
    expected_q, expected_scale, expected_weights = expected
    assert weights_out.dtype == torch.float32
    assert weights_out.view(torch.int32).tolist() == expected_weights
    if fmt == "fp8":
        assert q_scale is None and q_quant.dtype == torch.float8_e4m3fn
        got = q_quant.view(torch.uint8).tolist()
        nan_mask = torch.isnan(q_quant.float()).tolist()
        for t, heads in enumerate(expected_q):
            for h, codes in enumerate(heads):
                assert [c is None for c in codes] == nan_mask[t][h], f"NaN positions of token {t} head {h}"
                got_without_nan = [g for g, c in zip(got[t][h], codes) if c is not None]
                assert got_without_nan == [c for c in codes if c is not None], f"token {t} head {h}"
    else:
        assert q_quant.dtype == torch.uint8 and q_scale.dtype == torch.uint8
        assert q_quant.tolist() == expected_q
        assert q_scale.tolist() == expected_scale


CASES = {
    # name: (T, H, D, rope_dim, q dtype, cos_sin dtype, weights dtype, positions dtype)
    "v32_shape": (3, 2, 128, 64, torch.bfloat16, torch.float32, torch.float32, torch.int64),
    "fp16_q_bf16_table": (2, 3, 64, 32, torch.float16, torch.bfloat16, torch.bfloat16, torch.int32),
    "fp32_q_whole_head_rotated": (2, 2, 64, 64, torch.float32, torch.float32, torch.float32, torch.int32),
    "narrow_rope_odd_tokens": (5, 1, 96, 16, torch.bfloat16, torch.float32, torch.bfloat16, torch.int64),
}


def make_inputs(case: str, seed: int = 0, max_pos: int = 40):
    tokens, heads, head_dim, rope_dim, q_dtype, table_dtype, weights_dtype, positions_dtype = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-3, 3, 7)[torch.randint(0, 7, (tokens, heads, 1), generator=gen)]
    q = (torch.randn(tokens, heads, head_dim, generator=gen) * magnitudes).to(q_dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(positions_dtype)
    weights = torch.randn(tokens, heads, generator=gen).to(weights_dtype)
    return q, positions, rope_table(max_pos, rope_dim, table_dtype), weights


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("rope_position", ["first", "trailing"])
@pytest.mark.parametrize("rope_style", ["neox", "interleaved"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_oracle_bit_exact(case, rope_style, rope_position, fmt):
    q, positions, cos_sin, weights = make_inputs(case)
    softmax_scale, head_scale = q.shape[-1] ** -0.5, q.shape[1] ** -0.5
    options = dict(rope_style=rope_style, rope_position=rope_position, fmt=fmt)
    result = rope_quant_q(q, positions, cos_sin, weights, softmax_scale, head_scale, **options)
    expected = oracle(q, positions.tolist(), cos_sin, weights, softmax_scale, head_scale, **options)
    assert_matches_oracle(result, expected, fmt)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_output_shapes_and_dtypes(fmt):
    q, positions, cos_sin, weights = make_inputs("v32_shape")
    q_quant, q_scale, weights_out = rope_quant_q(q, positions, cos_sin, weights, 1.0, 1.0, fmt=fmt)
    tokens, heads, head_dim = q.shape
    assert weights_out.shape == (tokens, heads)
    if fmt == "fp8":
        assert q_quant.shape == (tokens, heads, head_dim) and q_scale is None
    else:
        assert q_quant.shape == (tokens, heads, head_dim // 2)
        assert q_scale.shape == (tokens, heads, -(-head_dim // 128) * 4)  # D/32 padded to 4-byte words


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_zero_tokens(fmt):
    q = torch.empty(0, 4, 128, dtype=torch.bfloat16)
    positions = torch.empty(0, dtype=torch.int64)
    cos_sin = rope_table(8, 64, torch.float32)
    q_quant, q_scale, weights_out = rope_quant_q(q, positions, cos_sin, torch.empty(0, 4), 1.0, 1.0, fmt=fmt)
    assert weights_out.shape == (0, 4)
    assert q_quant.shape == ((0, 4, 128) if fmt == "fp8" else (0, 4, 64))
    assert q_scale is None if fmt == "fp8" else q_scale.shape == (0, 4, 4)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_strided_inputs_give_the_same_bytes(fmt):
    q, positions, cos_sin, weights = make_inputs("v32_shape", seed=3)
    q_strided = q.transpose(0, 1).contiguous().transpose(0, 1)
    weights_strided = torch.zeros(weights.shape[0], weights.shape[1] * 2)[:, ::2]
    weights_strided.copy_(weights)
    cos_sin_strided = torch.zeros(cos_sin.shape[0], cos_sin.shape[1] + 5)[:, 5:]
    cos_sin_strided.copy_(cos_sin)
    assert not q_strided.is_contiguous() and not weights_strided.is_contiguous()
    plain = rope_quant_q(q, positions, cos_sin, weights, 0.3, 0.7, fmt=fmt)
    strided = rope_quant_q(q_strided, positions, cos_sin_strided, weights_strided, 0.3, 0.7, fmt=fmt)
    assert torch.equal(plain[0].view(torch.uint8), strided[0].view(torch.uint8))
    assert torch.equal(plain[2].view(torch.int32), strided[2].view(torch.int32))
    if fmt == "mxfp4":
        assert torch.equal(plain[1], strided[1])


@pytest.mark.parametrize("rope_position", ["first", "trailing"])
@pytest.mark.parametrize("rope_style", ["neox", "interleaved"])
def test_position_with_unit_cosine_is_identity(rope_style, rope_position):
    q, _, cos_sin, weights = make_inputs("v32_shape", seed=5)
    identity = torch.zeros_like(cos_sin)
    identity[:, : cos_sin.shape[1] // 2] = 1.0
    positions = torch.zeros(q.shape[0], dtype=torch.int64)
    q_quant, _, weights_out = rope_quant_q(
        q, positions, identity, weights, 1.0, 1.0, rope_style=rope_style, rope_position=rope_position
    )
    values, scales = quantize_fp8(q, block_size=q.shape[-1], amax_floor=1e-10)
    assert torch.equal(q_quant.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(weights_out, weights * scales.squeeze(-1))


@pytest.mark.parametrize("rope_position", ["first", "trailing"])
@pytest.mark.parametrize("rope_style", ["neox", "interleaved"])
def test_rope_dims_are_rotated_like_float64_complex_rope(rope_style, rope_position):
    q, positions, cos_sin, weights = make_inputs("v32_shape", seed=9)
    positions = torch.tensor([7, 19, 33])
    q_quant, _, weights_out = rope_quant_q(
        q, positions, cos_sin, weights, 1.0, 1.0, rope_style=rope_style, rope_position=rope_position
    )
    q_scale = (weights_out / weights).to(torch.float64)  # the fold is exact: q_scale is a power of two
    restored = q_quant.to(torch.float64) * q_scale[..., None]
    head_dim, rope_dim = q.shape[-1], cos_sin.shape[1]
    rope = slice(0, rope_dim) if rope_position == "first" else slice(head_dim - rope_dim, head_dim)
    x = q.to(torch.float64)[..., rope]
    half = rope_dim // 2
    pairs = (
        torch.complex(x[..., :half], x[..., half:])
        if rope_style == "neox"
        else torch.complex(x[..., 0::2], x[..., 1::2])
    )
    frequencies = 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / rope_dim)
    angles = positions.to(torch.float64)[:, None] * frequencies
    turned = pairs * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    if rope_style == "neox":
        exact = torch.cat((turned.real, turned.imag), -1)
    else:
        exact = torch.view_as_real(turned).flatten(-2)
    tolerance = exact.abs() * (1 / 16 + 1 / 64) + q_scale[..., None]
    assert ((restored[..., rope] - exact).abs() <= tolerance).all()
    unrotated = torch.cat((x[..., :half], x[..., half:]), -1) if rope_style == "neox" else x
    assert not ((restored[..., rope] - unrotated).abs() <= tolerance).all()


def fma_sensitive_pair() -> tuple[float, float]:
    """``(x0, cos)`` with ``x0`` a bf16 in [1, 2) and ``cos`` an fp32 such that ``x0 * cos - 1``

    is exactly a bf16 tie plus less than half an fp32 ulp of 1: rounding the product to fp32 first
    lands on the tie ``(1 + 2**-4 + 2**-8) * 2**-8`` (bf16 rounds it down to the even
    ``(1 + 2**-4) * 2**-8``), while a fused multiply-add or exact arithmetic keeps the excess and rounds up.
    """
    for numerator_excess in range(1, 128):
        numerator = 2**31 + 2**23 + 2**19 + 2**15 + numerator_excess  # x0 * cos = numerator / 2**31
        for mantissa in range(129, 256, 2):
            if numerator % mantissa == 0:
                return mantissa / 128, (numerator // mantissa) / 2**24
    raise AssertionError("no FMA-sensitive pair found")


@pytest.mark.parametrize("rope_position", ["first", "trailing"])
@pytest.mark.parametrize("rope_style", ["neox", "interleaved"])
def test_rope_rounds_each_fp32_product_and_sum_before_bf16(rope_style, rope_position):
    x0, cos0 = fma_sensitive_pair()
    head_dim, rope_dim = 128, 64
    half = rope_dim // 2
    start = 0 if rope_position == "first" else head_dim - rope_dim
    partner = start + (half if rope_style == "neox" else 1)
    q = torch.zeros(1, 1, head_dim, dtype=torch.bfloat16)
    q[0, 0, start], q[0, 0, partner] = x0, 1.0
    cos_sin = torch.zeros(1, rope_dim)
    cos_sin[0, :half] = 1.0
    cos_sin[0, 0], cos_sin[0, half] = cos0, 1.0  # pair 0: cos = cos0, sin = 1
    assert fp32(cos0) == cos0 and bf16(x0) == x0
    positions = torch.zeros(1, dtype=torch.int32)
    q_quant, _, weights_out = rope_quant_q(
        q, positions, cos_sin, torch.ones(1, 1), 1.0, 1.0, rope_style=rope_style, rope_position=rope_position
    )
    scale = weights_out.item()
    step_by_step = bf16(fp32(fp32(x0 * cos0) - 1.0))
    exact = Fraction(x0) * Fraction(cos0) - 1
    fused = bf16(fp32(float(exact)))
    assert step_by_step == (1 + 2**-4) * 2**-8 and fused == step_by_step + 2**-15
    assert e4m3_code(step_by_step / scale) != e4m3_code(fused / scale), "the test must tell the two apart"
    assert q_quant.view(torch.uint8)[0, 0, start].item() == e4m3_code(step_by_step / scale)


def test_all_zero_head_takes_the_scale_floor():
    q = torch.zeros(2, 3, 128, dtype=torch.bfloat16)
    positions = torch.tensor([0, 5])
    cos_sin = rope_table(8, 64, torch.float32)
    weights = torch.full((2, 3), 2.0)
    q_quant, _, weights_out = rope_quant_q(q, positions, cos_sin, weights, 1.0, 1.0)
    floor_scale = 2.0 ** math.ceil(math.log2(fp32(1e-10) / 448))
    assert set(q_quant.view(torch.uint8).unique().tolist()) <= {0x00, 0x80}  # ±0: IEEE zero signs of the rotation
    assert weights_out.tolist() == [[2.0 * floor_scale] * 3] * 2
    packed, scales, _ = rope_quant_q(q, positions, cos_sin, weights, 1.0, 1.0, fmt="mxfp4")
    assert packed.eq(0).all() and scales.eq(1).all()  # 2**-126: the MXFP4 floor


@pytest.mark.parametrize("exponent", [-3, 0, 1, 4])
def test_head_at_448_multiples_encodes_full_scale(exponent):
    peak = 448.0 * 2.0**exponent
    q = torch.zeros(1, 2, 128, dtype=torch.bfloat16)
    q[0, 0, 64], q[0, 0, 65], q[0, 0, 100] = peak, -peak, peak / 2
    q[0, 1, 70], q[0, 1, 71] = 450.0 * 2.0**exponent, -peak  # one bf16 step above the peak: the scale doubles
    cos_sin = torch.cat((torch.ones(1, 32), torch.zeros(1, 32)), dim=1)
    q_quant, _, weights_out = rope_quant_q(q, torch.zeros(1, dtype=torch.int64), cos_sin, torch.ones(1, 2), 1.0, 1.0)
    codes = q_quant.view(torch.uint8)[0]
    assert weights_out.tolist() == [[2.0**exponent, 2.0 ** (exponent + 1)]]
    assert codes[0, 64].item() == 0x7E and codes[0, 65].item() == 0xFE and codes[0, 100].item() == 0x76
    assert codes[1, 70].item() == e4m3_code(225.0) == 0x76 and codes[1, 71].item() == 0xF6


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("rope_style", ["neox", "interleaved"])
def test_nonfinite_q_follows_documented_rules(rope_style, fmt):
    q, _, cos_sin, weights = make_inputs("v32_shape", seed=11)
    positions = torch.tensor([3, 7, 11])  # non-zero angles: an inf times sin is never inf * 0
    q[0, 0, 3] = NAN  # a rotated dim: both elements of its pair become NaN
    q[0, 1, 90] = NAN  # a pass-through dim
    q[1, 0, 100], q[1, 1, 101] = INF, -INF  # saturate, scale from the finite elements
    q[2, 1, 5] = INF  # a rotated dim: IEEE arithmetic on the pair
    options = dict(rope_style=rope_style, rope_position="first", fmt=fmt)
    result = rope_quant_q(q, positions, cos_sin, weights, 0.5, 0.25, **options)
    expected = oracle(q, positions.tolist(), cos_sin, weights, 0.5, 0.25, **options)
    assert_matches_oracle(result, expected, fmt)
    assert torch.isfinite(result[2]).all()
    if fmt == "fp8":
        partner = 3 + 32 if rope_style == "neox" else 2
        nan_positions = torch.isnan(result[0].float()).nonzero().tolist()
        assert sorted(nan_positions) == sorted([[0, 0, 3], [0, 0, partner], [0, 1, 90]])
        assert result[0][1, 0, 100].float().item() == 448.0 and result[0][1, 1, 101].float().item() == -448.0


def test_weights_fold_multiplies_left_to_right_in_fp32():
    q, positions, cos_sin, _ = make_inputs("v32_shape", seed=13)
    q, positions = q.repeat(40, 1, 1), positions.repeat(40)
    weights = torch.randn(q.shape[:2], generator=torch.Generator().manual_seed(1))
    softmax_scale, head_scale = 128**-0.5, 3**-0.5
    _, _, weights_out = rope_quant_q(q, positions, cos_sin, weights, softmax_scale, head_scale)
    identity_out = rope_quant_q(q, positions, cos_sin, weights, 1.0, 1.0)[2]
    q_scale = (identity_out / weights).numpy()
    w = weights.numpy()
    left_to_right = w * q_scale * np.float32(softmax_scale) * np.float32(head_scale)
    scales_first = w * q_scale * np.float32(np.float32(softmax_scale) * np.float32(head_scale))
    assert np.array_equal(weights_out.numpy().view(np.int32), left_to_right.view(np.int32))
    assert not np.array_equal(left_to_right, scales_first), "the test must tell the orders apart"


def valid_args(**overrides):
    q, positions, cos_sin, weights = make_inputs("v32_shape")
    args = dict(q=q, positions=positions, cos_sin=cos_sin, weights=weights, softmax_scale=0.1, head_scale=0.2)
    args.update(overrides)
    return args


def call(args, **options):
    positional = [args[name] for name in ("q", "positions", "cos_sin", "weights", "softmax_scale", "head_scale")]
    return rope_quant_q(*positional, **options)


VALIDATION_CASES = [
    # (argument overrides, keyword options, exception, match)
    (dict(q=[[1.0]]), {}, TypeError, "q must be a torch.Tensor"),
    (dict(q=torch.zeros(3, 2, 128, dtype=torch.int32)), {}, TypeError, "q must have dtype"),
    (dict(q=torch.zeros(3, 2, 128).to(torch.float8_e4m3fn)), {}, TypeError, "q must have dtype"),
    (dict(q=torch.zeros(3, 256, dtype=torch.bfloat16)), {}, ValueError, "q must have 3 dimensions"),
    (dict(positions=torch.zeros(3)), {}, TypeError, "positions must have dtype"),
    (dict(positions=torch.zeros(4, dtype=torch.int64)), {}, ValueError, "positions must have shape"),
    (dict(positions=torch.tensor([0, -1, 2])), {}, ValueError, r"positions must lie in \[0, 40\)"),
    (dict(positions=torch.tensor([0, 40, 2])), {}, ValueError, r"positions must lie in \[0, 40\)"),
    (dict(positions=torch.zeros(3, dtype=torch.int64, device="meta")), {}, ValueError, "positions is on meta"),
    (dict(cos_sin=torch.zeros(40)), {}, ValueError, "cos_sin must have 2 dimensions"),
    (dict(cos_sin=torch.zeros(40, 64, dtype=torch.int64)), {}, TypeError, "cos_sin must have dtype"),
    (dict(cos_sin=torch.zeros(40, 63)), {}, ValueError, "cos_sin must have an even"),
    (dict(cos_sin=torch.zeros(40, 0)), {}, ValueError, "cos_sin must have an even"),
    (dict(cos_sin=torch.zeros(40, 130)), {}, ValueError, "cos_sin must have an even"),
    (dict(weights=torch.zeros(3, 3)), {}, ValueError, "weights must have shape"),
    (dict(weights=torch.zeros(3, 2, dtype=torch.int32)), {}, TypeError, "weights must have dtype"),
    (dict(softmax_scale="0.1"), {}, TypeError, "softmax_scale must be a real number"),
    (dict(softmax_scale=True), {}, TypeError, "softmax_scale must be a real number"),
    (dict(softmax_scale=INF), {}, ValueError, "softmax_scale must be finite"),
    (dict(head_scale=NAN), {}, ValueError, "head_scale must be finite"),
    (dict(head_scale=None), {}, TypeError, "head_scale must be a real number"),
    ({}, dict(rope_style="gptj"), ValueError, "rope_style must be one of"),
    ({}, dict(rope_position="last"), ValueError, "rope_position must be one of"),
    ({}, dict(fmt="int8"), ValueError, "fmt must be one of"),
    (dict(q=torch.zeros(3, 2, 80, dtype=torch.bfloat16)), dict(fmt="mxfp4"), ValueError, "head dim must be a multiple"),
    ({}, dict(backend="cuda"), ValueError, "backend must be one of"),
    ({}, dict(backend="triton"), ValueError, "backend='triton'"),
]


@pytest.mark.parametrize("overrides, options, error, match", VALIDATION_CASES)
@pytest.mark.usefixtures("without_interpreter")
def test_invalid_arguments_raise_naming_the_argument(overrides, options, error, match):
    args = valid_args(**overrides)
    snapshot = {
        name: value.clone()
        for name, value in args.items()
        if isinstance(value, torch.Tensor) and value.device.type == "cpu"
    }
    with pytest.raises(error, match=match):
        call(args, **options)
    for name, before in snapshot.items():
        assert torch.equal(args[name].view(torch.uint8), before.view(torch.uint8)), f"{name} was modified"


def test_backend_env_override_is_validated(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fastest")
    with pytest.raises(ValueError, match=ENV_VAR):
        call(valid_args())


def test_reference_backend_matches_auto_on_cpu():
    args = valid_args()
    auto = call(args)
    reference = call(args, backend="reference")
    assert torch.equal(auto[0].view(torch.uint8), reference[0].view(torch.uint8))
    assert torch.equal(auto[2], reference[2])
