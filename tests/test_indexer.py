"""Tests of the model-side ``Indexer`` module, its configurations, the YaRN table and the Hadamard rotation.

Oracles are written here, independently of ``dsa_indexer.indexer``: the YaRN table is re-derived in
float64 with ``math``, the Hadamard matrix from its ``(-1) ** popcount(i & j)`` entries, RoPE with
explicit pair formulas, and the indices of a forward against dense float64 scores of the quantised
inputs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dsa_indexer import indexer as indexer_module
from dsa_indexer.formats import dequantize_fp8, dequantize_mxfp4, quantize_fp8, quantize_mxfp4
from dsa_indexer.indexer import Indexer, IndexerConfig, hadamard_transform, yarn_cos_sin
from dsa_indexer.testing import calc_diff

STYLES = [("neox", "first"), ("neox", "trailing"), ("interleaved", "first"), ("interleaved", "trailing")]


def _inputs(config: IndexerConfig, num_tokens: int, seed: int = 1, *, start: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, config.hidden_size, generator=g).to(torch.bfloat16)
    q_latent = torch.randn(num_tokens, config.q_lora_rank, generator=g).to(torch.bfloat16)
    positions = torch.arange(start, start + num_tokens, dtype=torch.int64)
    k_input = torch.randn(num_tokens, config.k_input_size, generator=g).to(torch.bfloat16)
    return hidden, q_latent, positions, k_input


def test_deepseek_v32_preset_fields():
    c = IndexerConfig.deepseek_v32()
    assert (c.n_heads, c.head_dim, c.topk, c.rope_dim) == (64, 128, 2048, 64)
    assert (c.rope_style, c.rope_position, c.k_norm, c.norm_eps, c.fmt) == ("neox", "first", "layernorm", 1e-6, "fp8")
    assert (c.hidden_size, c.q_lora_rank, c.k_input_size) == (7168, 1536, 7168)
    assert (c.compress_ratio, c.candidate_topk_blocks) == (1, 0)
    assert (c.rope_theta, c.yarn_factor, c.original_max_position, c.beta_fast, c.beta_slow, c.max_position) == (
        10000.0, 40.0, 4096, 32.0, 1.0, 163840,
    )
    assert c.uses_yarn
    assert c.softmax_scale == 128 ** -0.5 and c.head_scale == 64 ** -0.5


def test_deepseek_v41_preset_fields():
    c = IndexerConfig.deepseek_v41()
    assert (c.n_heads, c.head_dim, c.topk, c.rope_dim) == (32, 128, 512, 64)
    assert (c.rope_style, c.rope_position, c.k_norm, c.fmt) == ("interleaved", "trailing", "rmsnorm", "mxfp4")
    assert (c.compress_ratio, c.candidate_topk_blocks, c.candidate_block_size, c.use_hadamard) == (2, 2048, 8, False)


def test_preset_overrides_and_small_keep_semantics():
    c = IndexerConfig.deepseek_v32(topk=16, use_hadamard=False)
    assert (c.topk, c.use_hadamard, c.n_heads) == (16, False, 64)
    for preset in (IndexerConfig.deepseek_v32(), IndexerConfig.deepseek_v41()):
        small = preset.small()
        assert (small.hidden_size, small.q_lora_rank) == (256, 128)
        assert small.rope_table_len == 4096
        kept = ("n_heads", "head_dim", "topk", "rope_dim", "rope_style", "rope_position", "k_norm", "norm_eps", "fmt",
                "compress_ratio", "candidate_topk_blocks", "candidate_block_size", "use_hadamard", "rope_theta",
                "yarn_factor", "original_max_position", "beta_fast", "beta_slow", "max_position")
        for name in kept:
            assert getattr(small, name) == getattr(preset, name), name
        # The table rows of the small config are the first rows of the full model's table.
        torch.testing.assert_close(yarn_cos_sin(small, 64), yarn_cos_sin(preset, 64), rtol=0, atol=0)
    assert IndexerConfig.deepseek_v41().small().wk_input_size == 128
    assert IndexerConfig.deepseek_v32().small(hidden_size=64).hidden_size == 64


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("n_heads", 0, ValueError),
        ("topk", -1, ValueError),
        ("head_dim", 1.5, TypeError),
        ("rope_dim", 63, ValueError),
        ("rope_dim", 256, ValueError),
        ("rope_style", "gptj", ValueError),
        ("rope_position", "middle", ValueError),
        ("k_norm", "batchnorm", ValueError),
        ("fmt", "int8", ValueError),
        ("norm_eps", 0.0, ValueError),
        ("yarn_factor", 0.5, ValueError),
        ("rope_theta", 1.0, ValueError),
        ("beta_fast", -1.0, ValueError),
        ("max_position", 0, ValueError),
        ("rope_table_len", 0, ValueError),
        ("candidate_block_size", 0, ValueError),
        ("use_hadamard", 1, TypeError),
    ],
)
def test_config_validation_names_the_field(field, value, error):
    with pytest.raises(error, match=field):
        IndexerConfig.deepseek_v41(**{field: value})


def test_config_validation_format_constraints():
    with pytest.raises(ValueError, match="head_dim"):
        IndexerConfig(n_heads=4, topk=8, head_dim=80, rope_dim=64, fmt="mxfp4")
    with pytest.raises(ValueError, match="head_dim"):
        IndexerConfig(n_heads=4, topk=8, head_dim=96, rope_dim=64, use_hadamard=True)


def test_state_dict_keys_match_checkpoint_names():
    v32 = Indexer(IndexerConfig.deepseek_v32().small())
    v41 = Indexer(IndexerConfig.deepseek_v41().small())
    shapes32 = {name: tuple(t.shape) for name, t in v32.state_dict().items()}
    assert shapes32 == {
        "wq_b.weight": (64 * 128, 128),
        "wk.weight": (128, 256),
        "k_norm.weight": (128,),
        "k_norm.bias": (128,),
        "weights_proj.weight": (64, 256),
    }
    shapes41 = {name: tuple(t.shape) for name, t in v41.state_dict().items()}
    assert shapes41 == {
        "wq_b.weight": (32 * 128, 128),
        "wk.weight": (128, 128),
        "k_norm.weight": (128,),
        "weights_proj.weight": (32, 256),
    }
    assert isinstance(v32.k_norm, torch.nn.LayerNorm) and isinstance(v41.k_norm, torch.nn.RMSNorm)
    for module in (v32, v41):
        assert "cos_sin" not in module.state_dict()
        assert module.cos_sin.dtype == torch.float32 and module.cos_sin.shape == (4096, 64)
        assert module.wq_b.weight.dtype == torch.bfloat16 and module.k_norm.weight.dtype == torch.float32
        assert all(layer.bias is None for layer in (module.wq_b, module.wk, module.weights_proj))


def test_load_state_dict_round_trips():
    config = IndexerConfig.deepseek_v32().small()
    source = Indexer(config, seed=3)
    with torch.no_grad():
        source.k_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
        source.k_norm.bias.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(1))
    target = Indexer(config, seed=4)
    result = target.load_state_dict(source.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
    hidden, q_latent, positions, _ = _inputs(config, 5)
    for a, b in zip(source.project(hidden, q_latent, positions), target.project(hidden, q_latent, positions)):
        assert torch.equal(a, b)
    # An RMSNorm config does not accept a LayerNorm bias.
    rms = Indexer(IndexerConfig.deepseek_v32(k_norm="rmsnorm").small())
    with pytest.raises(RuntimeError, match="k_norm.bias"):
        rms.load_state_dict(source.state_dict(), strict=True)


def test_same_seed_same_weights_different_seed_different():
    config = IndexerConfig.deepseek_v41().small()
    rng_state = torch.random.get_rng_state()
    a, b, c = Indexer(config, seed=7), Indexer(config, seed=7), Indexer(config, seed=8)
    assert torch.equal(torch.random.get_rng_state(), rng_state), "initialisation must not touch the global RNG"
    for name in ("wq_b.weight", "wk.weight", "weights_proj.weight"):
        assert torch.equal(a.state_dict()[name], b.state_dict()[name])
        assert not torch.equal(a.state_dict()[name], c.state_dict()[name])
    hidden, q_latent, positions, k_input = _inputs(config, 16)
    with torch.no_grad():
        q, k, weights = a.project(hidden, q_latent, positions, k_input=k_input)
    # Activations are O(1): unit-variance inputs give roughly unit-variance outputs.
    for tensor in (q, k, weights):
        assert 0.5 < float(tensor.float().std()) < 2.0


def test_project_shapes_dtypes_and_k_norm_in_fp32():
    config = IndexerConfig.deepseek_v32().small()
    module = Indexer(config, seed=2)
    hidden, q_latent, _, _ = _inputs(config, 6)
    positions = torch.zeros(6, dtype=torch.int64)  # RoPE at position 0 is the identity
    with torch.no_grad():
        q, k, weights = module.project(hidden, q_latent, positions)
    assert q.shape == (6, 64, 128) and q.dtype == torch.bfloat16
    assert k.shape == (6, 128) and k.dtype == torch.bfloat16
    assert weights.shape == (6, 64) and weights.dtype == torch.float32
    with torch.no_grad():
        linear = module.wk(hidden)  # bf16
        x = linear.double()
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        expected = (x - mean) / torch.sqrt(var + 1e-6)
        assert torch.equal(weights, module.weights_proj(hidden).float())
        assert torch.equal(q, module.wq_b(q_latent).view(6, 64, 128))
    torch.testing.assert_close(k.double(), expected, rtol=1e-2, atol=1e-2)
    # The norm runs in fp32 even when the module's dtype is bf16.
    torch.testing.assert_close(k, F.layer_norm(linear.float(), (128,), eps=1e-6).to(torch.bfloat16), rtol=0, atol=0)


def test_project_requires_k_input_when_wk_takes_another_tensor():
    config = IndexerConfig.deepseek_v41().small()
    module = Indexer(config)
    hidden, q_latent, positions, k_input = _inputs(config, 4)
    with pytest.raises(ValueError, match="k_input"):
        module.project(hidden, q_latent, positions)
    with pytest.raises(ValueError, match="k_input"):
        module.project(hidden, q_latent, positions, k_input=hidden)
    with torch.no_grad():
        _, k, _ = module.project(hidden, q_latent, positions, k_input=k_input)
    assert k.shape == (4, 128)


def _yarn_table_float64(rope_dim, theta, factor, original, beta_fast, beta_slow, model_len, rows):
    """DeepSeek's YaRN frequencies written out per pair with ``math``; ``[cos | sin]`` rows in float64."""
    half = rope_dim // 2
    freqs = []
    # Pair i completes original * f_i / (2 pi) rotations over the original context; solve for i.
    def pair_index_at(rotations):
        return rope_dim * math.log(original / (2 * math.pi * rotations)) / (2 * math.log(theta))
    lo = max(math.floor(pair_index_at(beta_fast)), 0)
    hi = min(math.ceil(pair_index_at(beta_slow)), rope_dim - 1)
    if hi == lo:
        hi = lo + 0.001
    for i in range(half):
        base = theta ** (-(2.0 * i) / rope_dim)
        if factor != 1 and model_len > original:
            weight_interp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
            base = (1.0 - weight_interp) * base + weight_interp * (base / factor)
        freqs.append(base)
    f = np.array(freqs, dtype=np.float64)
    p = np.asarray(rows, dtype=np.float64)[:, None]
    return np.concatenate([np.cos(p * f), np.sin(p * f)], axis=1), f, (lo, hi)


@pytest.mark.parametrize("preset", ["v32", "v41", "plain"])
def test_yarn_table_matches_float64_rederivation(preset):
    if preset == "v32":
        config = IndexerConfig.deepseek_v32()
    elif preset == "v41":
        config = IndexerConfig.deepseek_v41(max_position=200000)
    else:
        config = IndexerConfig.deepseek_v32(yarn_factor=1.0)
    rows = config.max_position if preset != "v41" else 200000
    table = yarn_cos_sin(config, rows)
    assert table.dtype == torch.float32 and table.shape == (rows, 64)
    check_rows = list(range(0, 300)) + [4095, 4096, 65535, 65536, 100003, rows - 1]
    expected, freqs, (lo, hi) = _yarn_table_float64(
        64, config.rope_theta, config.yarn_factor, config.original_max_position, config.beta_fast, config.beta_slow,
        config.max_position, check_rows,
    )
    got = table[check_rows].double().numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1.2e-7)
    if preset == "v32":
        # Known correction range of V3.2's constants: pairs <= 10 extrapolate, pairs >= 23 interpolate.
        assert (lo, hi) == (10, 23)
        plain = 10000.0 ** (-np.arange(0, 64, 2) / 64.0)
        np.testing.assert_allclose(freqs[:11], plain[:11], rtol=1e-15)
        np.testing.assert_allclose(freqs[23:], plain[23:] / 40.0, rtol=1e-15)
    if preset == "plain":
        np.testing.assert_allclose(freqs, 10000.0 ** (-np.arange(0, 64, 2) / 64.0), rtol=1e-15)


def test_yarn_table_rows_do_not_depend_on_length_and_device_argument():
    config = IndexerConfig.deepseek_v41()
    short = yarn_cos_sin(config, 100, device="cpu")
    longer = yarn_cos_sin(config, 70000)
    assert torch.equal(short, longer[:100])
    assert torch.equal(short[0], torch.cat([torch.ones(32), torch.zeros(32)]))
    with pytest.raises(ValueError, match="max_position"):
        yarn_cos_sin(config, 0)


def test_positions_index_rows_of_the_table_and_out_of_range_is_rejected():
    config = IndexerConfig.deepseek_v32(rope_table_len=50).small(rope_table_len=50)
    module = Indexer(config)
    assert module.cos_sin.shape == (50, 64)
    x = torch.randn(3, 128).to(torch.bfloat16)
    module.apply_rope(x, torch.tensor([0, 17, 49]))
    with pytest.raises(ValueError, match="positions"):
        module.apply_rope(x, torch.tensor([0, 17, 50]))
    with pytest.raises(ValueError, match="positions"):
        module.apply_rope(x, torch.tensor([-1, 0, 1]))


@pytest.mark.parametrize("style, place", STYLES)
def test_rope_at_position_zero_is_identity(style, place):
    module = Indexer(IndexerConfig.deepseek_v32(rope_style=style, rope_position=place).small())
    x = torch.randn(4, 64, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(module.apply_rope(x, torch.zeros(4, dtype=torch.int64)), x)


@pytest.mark.parametrize("style, place", STYLES)
def test_apply_rope_rotates_the_configured_pairs(style, place):
    module = Indexer(IndexerConfig.deepseek_v32(rope_style=style, rope_position=place).small())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 128, generator=g).to(torch.bfloat16)
    positions = torch.tensor([0, 1, 7, 1000, 4095])
    out = module.apply_rope(x, positions)
    table = module.cos_sin.double()
    dims = np.arange(0, 64) if place == "first" else np.arange(64, 128)
    if style == "neox":
        first, second = dims[:32], dims[32:]
    else:
        first, second = dims[0::2], dims[1::2]
    xd = x.double()
    cos, sin = table[positions, None, :32], table[positions, None, 32:]
    expected = xd.clone()
    expected[..., first] = xd[..., first] * cos - xd[..., second] * sin
    expected[..., second] = xd[..., second] * cos + xd[..., first] * sin
    # Rotated dims: one bf16 rounding away from the float64 rotation; the others untouched.
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -8, atol=1e-6)
    untouched = np.setdiff1d(np.arange(128), dims)
    assert torch.equal(out[..., untouched], x[..., untouched])


@pytest.mark.parametrize("n", [1, 2, 4, 8, 32, 128])
def test_hadamard_is_the_orthonormal_sylvester_matrix(n):
    eye = torch.eye(n, dtype=torch.float32)
    h = hadamard_transform(eye)  # rows: e_i @ H / sqrt(n) = row i of H / sqrt(n)
    sylvester = torch.tensor(
        [[(-1.0) ** bin(i & j).count("1") for j in range(n)] for i in range(n)], dtype=torch.float64
    ) / math.sqrt(n)
    torch.testing.assert_close(h.double(), sylvester, rtol=0, atol=1e-7)
    torch.testing.assert_close((h.double() @ h.double().T), torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-6)


def test_hadamard_preserves_dot_products_and_dtype():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(7, 4, 128, generator=g)
    k = torch.randn(9, 128, generator=g)
    hq, hk = hadamard_transform(q), hadamard_transform(k)
    assert hq.dtype == torch.float32 and hq.shape == q.shape
    rotated_dots = torch.einsum("thd,nd->thn", hq, hk)
    torch.testing.assert_close(rotated_dots, torch.einsum("thd,nd->thn", q, k), rtol=1e-5, atol=1e-4)
    qb = q.to(torch.bfloat16)
    out = hadamard_transform(qb)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, hadamard_transform(qb.float()).to(torch.bfloat16))
    with pytest.raises(ValueError, match="power of two"):
        hadamard_transform(torch.zeros(3, 96))


@pytest.mark.parametrize(
    "config",
    [
        IndexerConfig.deepseek_v32(use_hadamard=False).small(),
        IndexerConfig.deepseek_v41().small(),
        IndexerConfig.deepseek_v32(use_hadamard=False, rope_style="interleaved", rope_position="trailing").small(),
    ],
    ids=["v32-fp8", "v41-mxfp4", "fp8-interleaved-trailing"],
)
def test_quantize_q_equals_rope_quant_q_bit_for_bit(config):
    from dsa_indexer.ops.q_quant import rope_quant_q

    module = Indexer(config, seed=11)
    hidden, q_latent, _, k_input = _inputs(config, 9)
    positions = torch.tensor([0, 1, 2, 5, 100, 1000, 2047, 4000, 4095])
    with torch.no_grad():
        q, k, weights = module.project(hidden, q_latent, positions, k_input=k_input)
        q_quant, q_scale, k_cache, weights_out = module.quantize(q, k, weights, positions)
    want_q, want_scale, want_w = rope_quant_q(
        q, positions, module.cos_sin, weights, 128 ** -0.5, config.n_heads ** -0.5,
        rope_style=config.rope_style, rope_position=config.rope_position, fmt=config.fmt,
    )
    assert q_quant.dtype == want_q.dtype
    assert torch.equal(q_quant.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(weights_out, want_w)
    if config.fmt == "fp8":
        assert q_scale is None and want_scale is None
    else:
        assert torch.equal(q_scale, want_scale)
    assert k_cache is k
    # k used the same rotation arithmetic as rope_quant_q used for q: quantising apply_rope(q) the
    # way rope_quant_q does reproduces its bytes.
    rotated = module.apply_rope(q, positions)
    if config.fmt == "fp8":
        values, scales = quantize_fp8(rotated, block_size=128, amax_floor=1e-10)
        assert torch.equal(values.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(weights.float() * scales.squeeze(-1) * 128 ** -0.5 * config.n_heads ** -0.5, want_w)
    else:
        packed, scales = quantize_mxfp4(rotated)
        assert torch.equal(packed, want_q) and torch.equal(scales, want_scale)


def _dequantised_logits(q_quant, q_scale, k_cache, weights_out, fmt):
    """float64 ``[T, N]`` logits of the quantised Q against every key (K quantised as the cache does)."""
    if fmt == "fp8":
        q = q_quant.double()  # the Q scale is folded into weights_out
        k_values, k_scales = quantize_fp8(k_cache, block_size=128, amax_floor=1e-4)
        k = dequantize_fp8(k_values, k_scales, block_size=128).double()
    else:
        q = dequantize_mxfp4(q_quant, q_scale).double()
        k = dequantize_mxfp4(*quantize_mxfp4(k_cache)).double()
    dots = torch.einsum("thd,nd->thn", q, k).clamp_min(0)
    return torch.einsum("thn,th->tn", dots, weights_out.double())


@pytest.mark.parametrize("fmt, bound", [("fp8", 1e-3), ("mxfp4", 2e-2)])
def test_hadamard_path_quantised_scores_match_fp32_scores(fmt, bound):
    config = IndexerConfig.deepseek_v32(fmt=fmt, use_hadamard=True).small()
    module = Indexer(config, seed=5)
    hidden, q_latent, positions, _ = _inputs(config, 48, seed=9, start=100)
    with torch.no_grad():
        q, k, weights = module.project(hidden, q_latent, positions)
        q_quant, q_scale, k_cache, weights_out = module.quantize(q, k, weights, positions)
        reference = module.scores_fp32(module.apply_rope(q, positions), k, weights)
    assert (q_scale is None) == (fmt == "fp8")
    # k_for_cache is the Hadamard-rotated key, still in bf16.
    assert k_cache.dtype == torch.bfloat16
    assert torch.equal(k_cache, hadamard_transform(k))
    logits = _dequantised_logits(q_quant, q_scale, k_cache, weights_out, fmt)
    diff = calc_diff(logits, reference)
    assert diff < bound, diff


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_hadamard_reduces_quantisation_error_on_outlier_channels(fmt):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(32, 64, 128, generator=g)
    k = torch.randn(40, 128, generator=g)
    for x in (q, k):  # two outlier channels outside the rotated dims, as activations often have
        x[..., 70] *= 30
        x[..., 100] *= 20
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    w = torch.randn(32, 64, generator=g)
    positions = torch.arange(32)
    errors = {}
    for use_hadamard in (False, True):
        module = Indexer(IndexerConfig.deepseek_v32(fmt=fmt, use_hadamard=use_hadamard).small())
        with torch.no_grad():
            k_rot = module.apply_rope(k, torch.arange(40))
            q_quant, q_scale, k_cache, weights_out = module.quantize(q, k_rot, w, positions)
            reference = module.scores_fp32(module.apply_rope(q, positions), k_rot, w)
        errors[use_hadamard] = calc_diff(_dequantised_logits(q_quant, q_scale, k_cache, weights_out, fmt), reference)
    assert errors[True] < errors[False] / 4, errors


def test_hadamard_fp8_fold_matches_rope_quant_q_convention():
    config = IndexerConfig.deepseek_v32().small()  # V3.2 preset: Hadamard on
    module = Indexer(config, seed=6)
    hidden, q_latent, positions, _ = _inputs(config, 5)
    with torch.no_grad():
        q, k, weights = module.project(hidden, q_latent, positions)
        q_quant, q_scale, _, weights_out = module.quantize(q, k, weights, positions)
    rotated = hadamard_transform(module.apply_rope(q, positions))
    values, scales = quantize_fp8(rotated, block_size=128, amax_floor=1e-10)
    assert q_scale is None
    assert torch.equal(q_quant.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(weights_out, weights * scales.squeeze(-1) * 128 ** -0.5 * 64 ** -0.5)


def test_scores_fp32_matches_float64_sum_and_is_chunk_invariant(monkeypatch):
    config = IndexerConfig.deepseek_v32().small()
    module = Indexer(config)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(10, 64, 128, generator=g).to(torch.bfloat16)
    k = torch.randn(33, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(10, 64, generator=g)
    scores = module.scores_fp32(q, k, w)
    expected = torch.zeros(10, 33, dtype=torch.float64)
    for h in range(64):
        head_weight = w[:, h : h + 1].double() * 64 ** -0.5 * 128 ** -0.5
        expected += head_weight * (q[:, h].double() @ k.double().T).clamp_min(0)
    torch.testing.assert_close(scores.double(), expected, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(indexer_module, "_SCORES_CHUNK_BYTES", 64 * 33 * 4 * 3)  # 3 rows per chunk
    # Chunks are separate matmuls; BLAS may order a dot differently by shape, so equal within fp32 rounding.
    torch.testing.assert_close(module.scores_fp32(q, k, w), scores, rtol=1e-6, atol=1e-6)


def _check_against_oracle(indices, oracle_rows, topk):
    """Each row: ascending, in range, min(k, visible) picks, picked values = the top values (float64)."""
    for r, scores in enumerate(oracle_rows):
        row = indices[r].tolist()
        picks = [i for i in row if i >= 0]
        visible = scores.shape[0]
        count = min(topk, visible)
        assert len(picks) == count, (r, row, visible)
        assert row[count:] == [-1] * (topk - count), (r, row)
        assert picks == sorted(set(picks)) and all(0 <= i < visible for i in picks), (r, row)
        got = np.sort(scores[picks])[::-1]
        want = np.sort(scores)[::-1][:count]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=f"row {r}")


def _run_forward_steps(config, seed, *, use_k_override):
    from dsa_indexer.cache import IndexerKCache
    from dsa_indexer.layer import SparseAttnIndexer
    from dsa_indexer.metadata import build_metadata

    module = Indexer(config, seed=seed)
    ratio, topk, block_size = config.compress_ratio, config.topk, 16
    blocks_per_request = 4
    cache = IndexerKCache(2 * blocks_per_request, block_size=block_size, fmt=config.fmt)
    buffer = torch.full((64, topk), -7, dtype=torch.int32)
    layer = SparseAttnIndexer(cache, topk, buffer, workspace_tokens=128, compress_ratio=ratio)
    block_table = torch.tensor([[3, 0, 5, 6], [1, 7, 2, 4]], dtype=torch.int32)
    keys = [[], []]  # per request: the keys inserted so far (bf16, as the cache quantises them)
    # Step 1: two prefills of 37 and 26 tokens. Step 2: one decode each.
    steps = [([37, 26], [37, 26]), ([38, 27], [1, 1])]
    g = torch.Generator().manual_seed(seed + 100)
    for step, (seq_lens, query_lens) in enumerate(steps):
        metadata = build_metadata(seq_lens, query_lens, block_table, block_size=block_size, compress_ratio=ratio,
                                  workspace_tokens=128)
        token_positions = [p for s, q in zip(seq_lens, query_lens) for p in range(s - q, s)]
        token_request = [r for r, q in enumerate(query_lens) for _ in range(q)]
        num_tokens = len(token_positions)
        positions = torch.tensor(token_positions, dtype=torch.int64)
        hidden = torch.randn(num_tokens, config.hidden_size, generator=g).to(torch.bfloat16)
        q_latent = torch.randn(num_tokens, config.q_lora_rank, generator=g).to(torch.bfloat16)
        k_input = torch.randn(num_tokens, config.k_input_size, generator=g).to(torch.bfloat16)
        k_override = torch.randn(num_tokens, 128, generator=g).to(torch.bfloat16) if use_k_override else None
        indices = module(hidden, q_latent, positions, metadata, layer, k=k_override, k_input=k_input)
        assert indices.shape == (num_tokens, topk) and indices.dtype == torch.int32
        # Oracle: same quantised Q / weights, keys quantised as the cache does, dense float64 scores.
        with torch.no_grad():
            q = module.project_q(q_latent)
            k = k_override if use_k_override else module.project_k(k_input, positions)
            weights = module.head_weights(hidden)
            q_quant, q_scale, k_cache, weights_out = module.quantize(q, k, weights, positions)
        for t, (p, r) in enumerate(zip(token_positions, token_request)):
            if (p + 1) % ratio == 0:
                keys[r].append(k_cache[t])
        rows = []
        for t, (p, r) in enumerate(zip(token_positions, token_request)):
            visible = (p + 1) // ratio
            if visible == 0:
                rows.append(np.empty(0))
                continue
            request_keys = torch.stack(keys[r][:visible])
            logits = _dequantised_logits(
                q_quant[t : t + 1], None if q_scale is None else q_scale[t : t + 1], request_keys,
                weights_out[t : t + 1], config.fmt,
            )
            rows.append(logits[0].numpy())
        _check_against_oracle(indices, rows, topk)
        assert metadata.num_decodes == (2 if step == 1 else 0)


@pytest.mark.parametrize("use_hadamard", [False, True], ids=["plain", "hadamard"])
def test_forward_v32_fp8_matches_dense_oracle(use_hadamard):
    config = IndexerConfig.deepseek_v32(topk=8, use_hadamard=use_hadamard).small()
    _run_forward_steps(config, seed=21, use_k_override=False)


def test_forward_v41_mxfp4_compressed_keys_match_dense_oracle():
    config = IndexerConfig.deepseek_v41(topk=6).small()
    _run_forward_steps(config, seed=22, use_k_override=True)


def test_forward_rejects_a_layer_of_another_configuration():
    from dsa_indexer.cache import IndexerKCache
    from dsa_indexer.layer import SparseAttnIndexer
    from dsa_indexer.metadata import build_metadata

    config = IndexerConfig.deepseek_v32(topk=8).small()
    module = Indexer(config)
    hidden, q_latent, positions, _ = _inputs(config, 4)
    metadata = build_metadata([4], [4], torch.tensor([[0]], dtype=torch.int32), block_size=16)
    wrong_k = SparseAttnIndexer(IndexerKCache(1, block_size=16), 16, torch.empty(8, 16, dtype=torch.int32),
                                workspace_tokens=16)
    with pytest.raises(ValueError, match="topk"):
        module(hidden, q_latent, positions, metadata, wrong_k)
    wrong_fmt = SparseAttnIndexer(IndexerKCache(1, block_size=16, fmt="mxfp4"), 8,
                                  torch.empty(8, 8, dtype=torch.int32), workspace_tokens=16)
    with pytest.raises(ValueError, match="fmt|mxfp4"):
        module(hidden, q_latent, positions, metadata, wrong_fmt)
    with pytest.raises(TypeError, match="SparseAttnIndexer"):
        module(hidden, q_latent, positions, metadata, object())
