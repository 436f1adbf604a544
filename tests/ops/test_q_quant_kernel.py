"""rope_quant_q: the Triton kernel against the PyTorch reference, bit for bit.

Runs on CUDA (``scripts/gpu-check``) and on Triton's CPU interpreter (``TRITON_INTERPRET=1``). The only
bytes compared loosely are NaN encodings, whose sign the contract leaves unspecified (and which the
reference itself produces differently on CPU and GPU).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from dsa_indexer.backend import ENV_VAR
from dsa_indexer.formats import e2m1_codes, fp8_scales, mxfp4_exponents
from dsa_indexer.ops.q_quant import rope_quant_q
from dsa_indexer.ops.q_quant.reference import rope_quant_q_reference

triton = pytest.importorskip("triton", reason="Triton kernel tests need triton (make test installs it)")
tl = triton.language

from dsa_indexer.ops.common import codecs  # noqa: E402  (needs triton)
from dsa_indexer.ops.common.runtime import interpreting  # noqa: E402
from dsa_indexer.ops.q_quant import triton as q_kernels  # noqa: E402  (needs triton)

CONFIGS = [(fmt, style, position) for fmt in ("fp8", "mxfp4") for style in ("neox", "interleaved")
           for position in ("first", "trailing")]
NAN = float("nan")
INF = float("inf")


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def canonical(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``'s bits, with every NaN replaced by one canonical NaN (NaN signs are unspecified)."""
    if t is None:
        return None
    if t.dtype == torch.float8_e4m3fn:
        bits = t.view(torch.uint8).clone()
        bits[(bits & 0x7F) == 0x7F] = 0x7F
        return bits
    if t.dtype == torch.float32:
        bits = t.view(torch.int32).clone()
        bits[torch.isnan(t)] = 0x7FC00000
        return bits
    return t


def assert_same_results(got, expected) -> None:
    for name, g, e in zip(("values", "scales", "weights_out"), got, expected):
        if e is None:
            assert g is None, name
            continue
        assert g.dtype == e.dtype and g.shape == e.shape and g.device == e.device, name
        differ = canonical(g) != canonical(e)
        assert not bool(differ.any()), f"{name} differs at {differ.nonzero()[:8].tolist()}"


def make_inputs(num_tokens, num_heads, head_dim, rope_dim, *, device, seed, q_dtype=torch.bfloat16,
                table_dtype=torch.float32, weights_dtype=torch.bfloat16, positions_dtype=torch.int64, max_pos=50):
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.logspace(-4, 4, 9)[torch.randint(0, 9, (num_tokens, num_heads, 1), generator=gen)]
    q = (torch.randn(num_tokens, num_heads, head_dim, generator=gen) * magnitude).to(q_dtype)
    angles = torch.rand(max_pos, rope_dim // 2, generator=gen) * 2 * math.pi
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(table_dtype)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(positions_dtype)
    weights = torch.randn(num_tokens, num_heads, generator=gen).to(weights_dtype)
    return [t.to(device) for t in (q, positions, cos_sin, weights)]


def run_both(q, positions, cos_sin, weights, softmax_scale=0.088388, head_scale=0.125, **options):
    args = (q, positions, cos_sin, weights, softmax_scale, head_scale)
    got = rope_quant_q(*args, backend="triton", **options)
    expected = rope_quant_q(*args, backend="reference", **options)
    assert_same_results(got, expected)
    return got


@pytest.mark.parametrize("fmt, rope_style, rope_position", CONFIGS)
def test_matches_reference(kernel_device, fmt, rope_style, rope_position):
    inputs = make_inputs(5, 19, 128, 64, device=kernel_device, seed=1)
    run_both(*inputs, rope_style=rope_style, rope_position=rope_position, fmt=fmt)


# (head_dim, rope_dim). MXFP4 geometries the kernel does not support (``mxfp4_kernel_supports``) run the
# reference inside the Triton wrapper; they stay here to check that routing.
GEOMETRIES = {
    "fp8": [(40, 10), (33, 6), (64, 64), (128, 2), (160, 64)],
    "mxfp4": [(96, 32), (64, 64), (128, 16), (192, 128), (160, 96)],
}


@pytest.mark.parametrize("rope_position", ["first", "trailing"])
@pytest.mark.parametrize("rope_style", ["neox", "interleaved"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_unusual_head_and_rope_dims(kernel_device, fmt, rope_style, rope_position):
    for seed, (head_dim, rope_dim) in enumerate(GEOMETRIES[fmt]):
        inputs = make_inputs(3, 3, head_dim, rope_dim, device=kernel_device, seed=seed)
        run_both(*inputs, rope_style=rope_style, rope_position=rope_position, fmt=fmt)


@pytest.mark.parametrize(
    "q_dtype, table_dtype, weights_dtype, positions_dtype",
    [
        (torch.float16, torch.bfloat16, torch.float32, torch.int32),
        (torch.float32, torch.float16, torch.float16, torch.int64),
    ],
)
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_every_input_dtype(kernel_device, fmt, q_dtype, table_dtype, weights_dtype, positions_dtype):
    inputs = make_inputs(4, 5, 128, 64, device=kernel_device, seed=3, q_dtype=q_dtype, table_dtype=table_dtype,
                         weights_dtype=weights_dtype, positions_dtype=positions_dtype)
    run_both(*inputs, rope_style="interleaved", rope_position="first", fmt=fmt)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_strided_inputs(kernel_device, fmt):
    q, positions, cos_sin, weights = make_inputs(6, 4, 128, 64, device=kernel_device, seed=5)
    wide_q = torch.zeros(4, 6, 2 * 128 + 8, dtype=q.dtype, device=kernel_device)
    wide_q[:, :, 8::2] = q.transpose(0, 1)
    strided_q = wide_q.transpose(0, 1)[:, :, 8::2]  # token stride < head stride, dim stride 2
    wide_table = torch.zeros(cos_sin.shape[0], 100, device=kernel_device)
    wide_table[:, 3:67] = cos_sin
    strided_positions = torch.stack((positions, positions), dim=1)[:, 1]
    strided_weights = weights.t().contiguous().t()
    assert not (strided_q.is_contiguous() or strided_weights.is_contiguous() or strided_positions.is_contiguous())
    got = run_both(strided_q, strided_positions, wide_table[:, 3:67], strided_weights, rope_style="neox",
                   rope_position="trailing", fmt=fmt)
    contiguous = rope_quant_q(q, positions, cos_sin, weights, 0.088388, 0.125, rope_style="neox",
                              rope_position="trailing", fmt=fmt, backend="triton")
    assert_same_results(got, contiguous)


E4M3_VALUES = torch.arange(0, 0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_MIDPOINTS = (E4M3_VALUES[1:] + E4M3_VALUES[:-1]) / 2


def edge_q(head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Heads with NaN, ±inf, zeros, ±448, every e4m3 midpoint and the MXFP4 thresholds, at scale 1."""
    heads = torch.randn(12, head_dim)
    heads[0, 1] = NAN  # in the rope dims of "first"
    heads[1, head_dim - 2] = NAN  # in the rope dims of "trailing"
    heads[2, 0], heads[2, head_dim - 1] = INF, -INF
    heads[3] = 0.0
    heads[4] = -0.0
    heads[5] = 448.0
    heads[5, 1::2] = -448.0
    heads[6, : head_dim // 2] = 1e-3
    heads[6, head_dim // 2] = 448.0  # scale exactly 1: the other entries are e4m3 midpoints
    heads[7] = 448.0
    midpoints = E4M3_MIDPOINTS[torch.arange(head_dim) % E4M3_MIDPOINTS.numel()]
    heads[6, head_dim // 2 + 1:] = midpoints[: head_dim // 2 - 1]
    heads[7, : head_dim // 2] = -midpoints[head_dim // 2: head_dim]
    thresholds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    heads[8] = thresholds[torch.arange(head_dim) % 8] * torch.where(torch.arange(head_dim) % 3 == 0, -1.0, 1.0)
    heads[9] = 1e-30 * torch.randn(head_dim)
    heads[10] = 3e4 * torch.randn(head_dim)
    heads[11, :] = 2.0 ** -20
    return heads.to(dtype)


@pytest.mark.parametrize("fmt, rope_style, rope_position", CONFIGS)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_edge_values(kernel_device, fmt, rope_style, rope_position, q_dtype):
    head_dim = 128
    heads = edge_q(head_dim, q_dtype)
    q = heads.unsqueeze(0).repeat(3, 1, 1)
    if q_dtype == torch.float32:
        q[1, :, :4] = torch.tensor([3e38, -3e38, 1e-40, -1e-45])  # overflowing products, subnormals
    cos_sin = torch.tensor([[1.0] * 32 + [0.0] * 32, [0.0] * 32 + [1.0] * 32, [0.6] * 32 + [-0.8] * 32])
    positions = torch.tensor([0, 1, 2])
    weights = torch.randn(3, heads.shape[0]).to(torch.bfloat16)
    weights[0, 0] = NAN
    weights[1, 1] = -INF
    inputs = [t.to(kernel_device) for t in (q, positions, cos_sin, weights)]
    run_both(*inputs, rope_style=rope_style, rope_position=rope_position, fmt=fmt)


@pytest.mark.parametrize("block_heads, num_warps", [(1, 1), (2, 1), (8, 2), (64, 4)])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_launch_knobs_do_not_change_results(kernel_device, fmt, block_heads, num_warps):
    q, positions, cos_sin, weights = make_inputs(3, 11, 128, 64, device=kernel_device, seed=8)
    options = dict(rope_style="neox", rope_position="first", fmt=fmt)
    config = q_kernels.RopeQuantConfig(block_heads=block_heads, num_warps=num_warps)
    got = q_kernels.rope_quant_q_triton(q, positions, cos_sin, weights, 0.1, 0.3, config=config, **options)
    assert_same_results(got, rope_quant_q_reference(q, positions, cos_sin, weights, 0.1, 0.3, **options))


# Both MXFP4 encodes of a bf16 ``q``, explicitly whatever the default: on bf16 pairs, and
# the fp32 path that other dtypes and strides take.
MXFP4_VARIANTS = {"bf16x2": dict(config=q_kernels.MXFP4_ROPE_QUANT_CONFIG),
                  "fp32_path": dict(config=replace(q_kernels.MXFP4_ROPE_QUANT_CONFIG, bf16x2=False))}
BF16X2_VARIANTS = ["bf16x2"]
ROPE_LAYOUTS = [(style, position) for style in ("neox", "interleaved") for position in ("first", "trailing")]


@pytest.mark.parametrize("variant", list(MXFP4_VARIANTS))
@pytest.mark.parametrize("rope_position", ["first", "trailing"])
@pytest.mark.parametrize("rope_style", ["neox", "interleaved"])
def test_mxfp4_variants_match_reference(kernel_device, rope_style, rope_position, variant):
    options = dict(rope_style=rope_style, rope_position=rope_position, fmt="mxfp4")
    heads = edge_q(128, torch.bfloat16)
    q = heads.unsqueeze(0).repeat(3, 1, 1)
    cos_sin = torch.tensor([[1.0] * 32 + [0.0] * 32, [0.0] * 32 + [1.0] * 32, [0.6] * 32 + [-0.8] * 32])
    edge_inputs = [q, torch.tensor([0, 1, 2]), cos_sin, torch.randn(3, heads.shape[0]).to(torch.bfloat16)]
    cases = [[t.to(kernel_device) for t in edge_inputs]]
    cases += [make_inputs(3, 5, head_dim, rope_dim, device=kernel_device, seed=seed)
              for seed, (head_dim, rope_dim) in enumerate([(96, 32), (192, 128), (160, 96)])]
    for q, positions, cos_sin, weights in cases:
        got = q_kernels.rope_quant_q_triton(q, positions, cos_sin, weights, 0.1, 0.3, **options,
                                            **MXFP4_VARIANTS[variant])
        assert_same_results(got, rope_quant_q_reference(q, positions, cos_sin, weights, 0.1, 0.3, **options))


@pytest.mark.parametrize("variant", BF16X2_VARIANTS)
@pytest.mark.parametrize("rope_style, rope_position", ROPE_LAYOUTS)
def test_bf16x2_finite_edge_values(kernel_device, rope_style, rope_position, variant):
    """The edge heads without inf and NaN (each token's heads share a program: the encode for all-finite
    programs), at three scales."""
    options = dict(rope_style=rope_style, rope_position=rope_position, fmt="mxfp4")
    heads = edge_q(128, torch.float32)[3:]
    q = torch.stack((heads, -heads * 2.0**-100, heads * 2.0**80)).to(torch.bfloat16)
    cos_sin = torch.tensor([[1.0] * 32 + [0.0] * 32, [0.0] * 32 + [1.0] * 32, [0.6] * 32 + [-0.8] * 32])
    inputs = [t.to(kernel_device) for t in (q, torch.tensor([0, 1, 2]), cos_sin,
                                            torch.randn(3, heads.shape[0]).to(torch.bfloat16))]
    got = q_kernels.rope_quant_q_triton(*inputs, 0.1, 0.3, **options, **MXFP4_VARIANTS[variant])
    assert_same_results(got, rope_quant_q_reference(*inputs, 0.1, 0.3, **options))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_no_tokens(kernel_device, fmt):
    q, positions, cos_sin, weights = make_inputs(0, 4, 128, 64, device=kernel_device, seed=0)
    got = run_both(q, positions, cos_sin, weights, rope_style="neox", rope_position="first", fmt=fmt)
    assert got[0].shape[0] == 0


@triton.jit
def _helper_kernel(x_ptr, out_ptr, n, WHICH: tl.constexpr, BLOCK: tl.constexpr, INTERPRETER: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if WHICH == "e4m3":
        tl.store(out_ptr + offsets, codecs.e4m3_bytes(x, INTERPRETER).to(tl.int32), mask=mask)
    elif WHICH == "bf16":
        tl.store(out_ptr + offsets, codecs.round_to_bf16(x, INTERPRETER).to(tl.int32, bitcast=True), mask=mask)
    elif WHICH == "fp8_exponent":
        tl.store(out_ptr + offsets, codecs.fp8_scale_exponent(x), mask=mask)
    elif WHICH == "mxfp4_exponent":
        tl.store(out_ptr + offsets, codecs.mxfp4_exponents(x), mask=mask)
    else:
        tl.store(out_ptr + offsets, codecs.e2m1_codes(x, INTERPRETER), mask=mask)


def apply_helper(which: str, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.int32, device=x.device)
    block = 1024
    _helper_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), WHICH=which, BLOCK=block,
                                                     INTERPRETER=interpreting())
    return out


def random_bit_patterns(count: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (count,), generator=gen, dtype=torch.int64).to(torch.int32).view(
        torch.float32)


def neighbours(x: torch.Tensor) -> torch.Tensor:
    """``x`` and its fp32 neighbours one ulp below and above."""
    bits = x.view(torch.int32)
    return torch.cat((x, (bits - 1).view(torch.float32), (bits + 1).view(torch.float32)))


def test_e4m3_rounding_matches_torch(kernel_device):
    special = torch.tensor([0.0, -0.0, NAN, -NAN, INF, -INF, 448.0, -448.0, 464.0, 480.0, 1e-45, 2.0**-10])
    values = torch.cat((E4M3_VALUES, -E4M3_VALUES, E4M3_MIDPOINTS, -E4M3_MIDPOINTS, torch.tensor([464.0, 2.0**-10])))
    gen = torch.Generator().manual_seed(0)
    x = torch.cat((special, neighbours(values), (torch.rand(20000, generator=gen) - 0.5) * 1000,
                   random_bit_patterns(20000, seed=1)))
    got = apply_helper("e4m3", x.to(kernel_device)).cpu()
    expected = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    nan = torch.isnan(x)
    assert torch.equal(got[~nan], expected[~nan])
    assert bool((got[nan] == 0x7F).all())


def test_bf16_rounding_matches_torch(kernel_device):
    gen = torch.Generator().manual_seed(2)
    upper = torch.randint(0, 2**16, (4000,), generator=gen, dtype=torch.int32) << 16
    ties = torch.cat(((upper | 0x8000), (upper | 0x18000))).view(torch.float32)
    x = torch.cat((neighbours(ties), random_bit_patterns(20000, seed=3),
                   torch.tensor([0.0, -0.0, INF, -INF, NAN, 3.4028235e38, -3.4028235e38])))
    got = apply_helper("bf16", x.to(kernel_device)).cpu().view(torch.float32)
    expected = x.to(torch.bfloat16).float()
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), expected[~nan].view(torch.int32))


def amax_samples() -> torch.Tensor:
    """Positive finite fp32 values: random bit patterns, every subnormal step near the bottom, and the
    neighbours of powers of two and of ``448 * 2**k`` and ``6 * 2**k`` (where exponents change)."""
    positive = random_bit_patterns(20000, seed=4).abs()
    edges = torch.tensor([c * 2.0**e for c in (1.0, 448.0, 6.0) for e in range(-149, 119)])
    edges = edges[(edges > 0) & torch.isfinite(edges)]
    tiny = torch.arange(1, 600, dtype=torch.int32).view(torch.float32)
    x = torch.cat((positive, neighbours(edges), tiny, torch.tensor([3.4028235e38, 1.1754942e-38, 1.1754944e-38])))
    return x[torch.isfinite(x) & (x > 0)]


def test_fp8_scale_exponent_matches_formats(kernel_device):
    x = amax_samples()
    got = apply_helper("fp8_exponent", x.to(kernel_device)).cpu()
    scales = fp8_scales(x[:, None], 1, "ue8m0", 1e-45)[:, 0]  # one-element blocks: amax = x
    expected = (scales.view(torch.int32) >> 23) - 127
    assert torch.equal(got, expected)


def test_mxfp4_exponents_match_formats(kernel_device):
    x = amax_samples()
    got = apply_helper("mxfp4_exponent", x.to(kernel_device)).cpu()
    blocks = torch.zeros(x.numel(), 32)
    blocks[:, 5] = x
    assert torch.equal(got, mxfp4_exponents(blocks)[:, 0])


def test_e2m1_codes_match_formats(kernel_device):
    thresholds = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0])
    gen = torch.Generator().manual_seed(5)
    x = torch.cat((neighbours(thresholds), -neighbours(thresholds), (torch.rand(5000, generator=gen) - 0.5) * 16,
                   torch.tensor([-0.0, NAN, -NAN, INF, -INF, 1e-45, -1e-45])))
    got = apply_helper("e2m1", x.to(kernel_device)).cpu()
    assert torch.equal(got, e2m1_codes(x).to(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fmt, rope_style, rope_position, num_heads",
    [("fp8", "neox", "first", 64), ("mxfp4", "interleaved", "trailing", 32), ("fp8", "interleaved", "trailing", 64),
     ("mxfp4", "neox", "first", 64)],
)
def test_realistic_shapes_and_reruns_are_bitwise_equal(kernel_device, fmt, rope_style, rope_position, num_heads):
    q, positions, cos_sin, weights = make_inputs(2048, num_heads, 128, 64, device=kernel_device, seed=11,
                                                 max_pos=8192)
    options = dict(rope_style=rope_style, rope_position=rope_position, fmt=fmt)
    first = run_both(q, positions, cos_sin, weights, 128**-0.5, num_heads**-0.5, **options)
    for _ in range(20):
        again = rope_quant_q(q, positions, cos_sin, weights, 128**-0.5, num_heads**-0.5, backend="triton", **options)
        for a, b in zip(first, again):
            assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(MXFP4_VARIANTS))
@pytest.mark.parametrize("rope_style, rope_position", ROPE_LAYOUTS)
def test_mxfp4_variants_at_realistic_shapes(kernel_device, rope_style, rope_position, variant):
    q, positions, cos_sin, weights = make_inputs(2048, 64, 128, 64, device=kernel_device, seed=14, max_pos=8192)
    options = dict(rope_style=rope_style, rope_position=rope_position, fmt="mxfp4")
    got = q_kernels.rope_quant_q_triton(q, positions, cos_sin, weights, 128**-0.5, 0.125, **options,
                                        **MXFP4_VARIANTS[variant])
    assert_same_results(got, rope_quant_q_reference(q, positions, cos_sin, weights, 128**-0.5, 0.125, **options))


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_inputs(kernel_device):
    q, positions, cos_sin, weights = make_inputs(256, 64, 128, 64, device=kernel_device, seed=12, max_pos=4096)
    options = dict(rope_style="neox", rope_position="first", fmt="fp8")
    call = lambda: q_kernels.rope_quant_q_triton(q, positions, cos_sin, weights, 0.1, 0.125, **options)  # noqa: E731
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    fresh_q, fresh_positions, _, fresh_weights = make_inputs(256, 64, 128, 64, device=kernel_device, seed=13,
                                                             max_pos=4096)
    q.copy_(fresh_q)
    positions.copy_(fresh_positions)
    weights.copy_(fresh_weights)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_results(captured, rope_quant_q_reference(q, positions, cos_sin, weights, 0.1, 0.125, **options))
