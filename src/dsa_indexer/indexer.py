"""The model-side indexer module: projections, key norm, RoPE, optional Hadamard, quantisation.

``Indexer`` turns a layer's hidden state and the MLA's query latent into what the indexer layer
(``SparseAttnIndexer``) consumes, for the two public DeepSeek configurations:

- DeepSeek-V3.2: 64 heads of 128 dims, top-2048, RoPE NeoX on the first 64 dims, LayerNorm on the
  key, FP8 (one ue8m0 scale per (token, head) for Q, per token for K);
- DeepSeek-V4.1: 32 heads, top-512, RoPE interleaved on the trailing 64 dims, RMSNorm on the key,
  MXFP4, keys compressed 2:1, two-level candidate blocks (2048 blocks of 8 positions).

One step, for ``T`` tokens::

    q       = wq_b(q_latent).view(T, H, D)                      (dtype; RoPE still to apply)
    k       = rope(norm_fp32(wk(hidden)))                       (dtype, [T, D])
    weights = weights_proj(hidden).float()                      ([T, H])
    [Hadamard: q = H·rope(q), k = H·k]                          (orthonormal, changes only rounding)
    q_quant, q_scale, weights_out = RoPE + quantise q           (``rope_quant_q``, DESIGN §4)
    indices = SparseAttnIndexer(q_quant, q_scale, k, weights_out, metadata)

The score it ranks by (DESIGN §5, before quantisation) is
``I[i, j] = sum_h w[i, h] * H**-0.5 * D**-0.5 * relu(q_rot[i, h] . k_rot[j])``; ``scores_fp32``
computes it unquantised for tests and demos.

Parameter names follow the public DeepSeek checkpoints (``wq_b``, ``wk``, ``k_norm``,
``weights_proj``) so a layer's ``...indexer.*`` tensors load with ``load_state_dict`` once they are
dense (checkpoints that store ``wq_b``/``wk`` in FP8 with block scales must be dequantised first).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._validation import check_floating, check_index_tensor, check_tensor
from .formats import Q_AMAX_FLOOR, quantize_fp8, quantize_mxfp4

__all__ = ["Indexer", "IndexerConfig", "hadamard_transform", "rope_frequencies", "yarn_cos_sin"]

ROPE_STYLES = ("neox", "interleaved")
ROPE_POSITIONS = ("first", "trailing")
K_NORMS = ("layernorm", "rmsnorm")
FORMATS = ("fp8", "mxfp4")

# Rows of the cos/sin table that ``IndexerConfig.small`` keeps (positions 0 .. 4095).
SMALL_ROPE_TABLE_LEN = 4096
# Rows of the table computed at once by ``yarn_cos_sin`` (bounds its float64 temporaries).
_TABLE_CHUNK_ROWS = 1 << 16
# Bytes of the ``[rows, H, N]`` fp32 intermediate of one ``scores_fp32`` chunk.
_SCORES_CHUNK_BYTES = 256 << 20


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"IndexerConfig.{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"IndexerConfig.{name} must be >= {minimum}, got {value}")


def _check_positive_float(name: str, value, *, minimum: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"IndexerConfig.{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0 or (minimum is not None and value < minimum):
        bound = f">= {minimum}" if minimum is not None else "> 0"
        raise ValueError(f"IndexerConfig.{name} must be a finite number {bound}, got {value}")


def _check_option(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"IndexerConfig.{name} must be one of {choices}, got {value!r}")


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclass(frozen=True, kw_only=True)
class IndexerConfig:
    """Shape, numerics and positional encoding of one indexer.

    Fields (all keyword-only; every instance is validated, ``ValueError``/``TypeError`` naming the field):

    - ``n_heads``, ``head_dim``, ``topk``: index heads ``H``, their dimension ``D``, keys kept per query.
    - ``rope_dim``: dims of each head that RoPE rotates; ``rope_style`` ``"neox"`` (pairs ``x[i]``,
      ``x[i + rope_dim/2]``) or ``"interleaved"`` (pairs ``x[2i]``, ``x[2i+1]``); ``rope_position``
      ``"first"`` (dims ``[0, rope_dim)``) or ``"trailing"`` (the last ``rope_dim``).
    - ``k_norm``: ``"layernorm"`` (weight and bias) or ``"rmsnorm"`` (weight only), epsilon ``norm_eps``.
    - ``fmt``: ``"fp8"`` or ``"mxfp4"``, the format of Q and of the K cache.
    - ``hidden_size``: input of ``weights_proj`` and (unless ``wk_input_size`` is set) of ``wk``;
      ``q_lora_rank``: input of ``wq_b`` (the MLA's normalised query latent);
      ``wk_input_size``: input of ``wk`` when the keys come from another tensor than the hidden state
      (V4.1 projects them from the compressor's 512-dim latent); ``None`` means ``hidden_size``.
    - ``compress_ratio``: tokens per key (keys then come from a compressor, see ``Indexer.forward``).
    - ``candidate_topk_blocks`` / ``candidate_block_size``: V4.1 two-level selection (0 = off).
    - ``use_hadamard``: rotate q and k by the orthonormal Hadamard matrix before quantisation.
    - RoPE frequencies (DeepSeek's YaRN, see ``yarn_cos_sin``): ``rope_theta``, ``yarn_factor``,
      ``original_max_position``, ``beta_fast``, ``beta_slow``, ``max_position`` (the model's context;
      YaRN applies when it exceeds ``original_max_position`` and ``yarn_factor != 1``).
    - ``rope_table_len``: rows of the ``Indexer``'s cos/sin buffer (``None``: ``max_position``). It
      only limits the positions the module accepts; the frequencies do not depend on it.
    """

    n_heads: int
    topk: int
    head_dim: int = 128
    rope_dim: int = 64
    rope_style: str = "neox"
    rope_position: str = "first"
    k_norm: str = "layernorm"
    norm_eps: float = 1e-6
    fmt: str = "fp8"
    hidden_size: int = 7168
    q_lora_rank: int = 1536
    wk_input_size: int | None = None
    compress_ratio: int = 1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    use_hadamard: bool = False
    rope_theta: float = 10000.0
    yarn_factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_position: int = 163840
    rope_table_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_heads", "topk", "head_dim", "rope_dim", "hidden_size", "q_lora_rank", "compress_ratio",
                     "original_max_position", "max_position"):
            _check_int(name, getattr(self, name), 1)
        _check_int("candidate_topk_blocks", self.candidate_topk_blocks, 0)
        _check_int("candidate_block_size", self.candidate_block_size, 0)
        if self.wk_input_size is not None:
            _check_int("wk_input_size", self.wk_input_size, 1)
        if self.rope_table_len is not None:
            _check_int("rope_table_len", self.rope_table_len, 1)
        _check_option("rope_style", self.rope_style, ROPE_STYLES)
        _check_option("rope_position", self.rope_position, ROPE_POSITIONS)
        _check_option("k_norm", self.k_norm, K_NORMS)
        _check_option("fmt", self.fmt, FORMATS)
        if not isinstance(self.use_hadamard, bool):
            raise TypeError(f"IndexerConfig.use_hadamard must be a bool, got {type(self.use_hadamard).__name__}")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(
                f"IndexerConfig.rope_dim must be even and <= head_dim ({self.head_dim}), got {self.rope_dim}"
            )
        if self.fmt == "mxfp4" and self.head_dim % 32:
            raise ValueError(f"IndexerConfig.head_dim must be a multiple of 32 for fmt='mxfp4', got {self.head_dim}")
        if self.use_hadamard and not _is_power_of_two(self.head_dim):
            raise ValueError(f"IndexerConfig.head_dim must be a power of two with use_hadamard, got {self.head_dim}")
        if self.candidate_topk_blocks > 0 and self.candidate_block_size < 1:
            raise ValueError(
                "IndexerConfig.candidate_block_size must be >= 1 when candidate_topk_blocks > 0, "
                f"got {self.candidate_block_size}"
            )
        _check_positive_float("norm_eps", self.norm_eps)
        _check_positive_float("rope_theta", self.rope_theta)
        if self.rope_theta <= 1:
            raise ValueError(f"IndexerConfig.rope_theta must be > 1, got {self.rope_theta}")
        _check_positive_float("yarn_factor", self.yarn_factor, minimum=1.0)
        _check_positive_float("beta_fast", self.beta_fast)
        _check_positive_float("beta_slow", self.beta_slow)

    @property
    def k_input_size(self) -> int:
        """Input features of ``wk``."""
        return self.hidden_size if self.wk_input_size is None else self.wk_input_size

    @property
    def uses_yarn(self) -> bool:
        """Whether the RoPE frequencies are YaRN-blended (else plain RoPE)."""
        return self.yarn_factor != 1 and self.max_position > self.original_max_position

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def head_scale(self) -> float:
        return self.n_heads ** -0.5

    def replace(self, **overrides) -> IndexerConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **overrides)

    def small(self, **overrides) -> IndexerConfig:
        """A copy with tiny projections for demos and tests.

        ``hidden_size=256``, ``q_lora_rank=128`` (``wk_input_size=128`` when it was set) and a cos/sin
        table of ``4096`` rows; heads, dims, top-k, RoPE (style, placement, frequencies), norm, format,
        compression, candidates and Hadamard are kept. ``overrides`` apply last.
        """
        fields = dict(
            hidden_size=256,
            q_lora_rank=128,
            wk_input_size=None if self.wk_input_size is None else 128,
            rope_table_len=min(self.max_position, SMALL_ROPE_TABLE_LEN),
        )
        fields.update(overrides)
        return dataclasses.replace(self, **fields)

    @classmethod
    def deepseek_v32(cls, **overrides) -> IndexerConfig:
        """DeepSeek-V3.2 (``inference/config_671B_v3.2.json`` and ``inference/model.py``).

        64 heads x 128, top-2048, RoPE NeoX on the first 64 dims (DeepSeek's 2025-11-18 correction:
        the indexer RoPE is non-interleaved), LayerNorm(eps 1e-6) with bias, FP8 with ue8m0 scales,
        ``dim`` 7168, ``q_lora_rank`` 1536, YaRN ``rope_theta`` 10000 / factor 40 / original 4096 /
        ``beta_fast`` 32 / ``beta_slow`` 1 / ``max_seq_len`` 163840, no compression, no candidates.
        ``use_hadamard=True`` as DeepSeek's reference (``rotate_activation``) and SGLang do; upstream
        vLLM skips it (``use_hadamard=False`` reproduces that; the exact scores are the same, only the
        quantisation error differs).
        """
        fields = dict(
            n_heads=64, head_dim=128, topk=2048, rope_dim=64, rope_style="neox", rope_position="first",
            k_norm="layernorm", norm_eps=1e-6, fmt="fp8", hidden_size=7168, q_lora_rank=1536,
            wk_input_size=None, compress_ratio=1, candidate_topk_blocks=0, candidate_block_size=0,
            use_hadamard=True, rope_theta=10000.0, yarn_factor=40.0, original_max_position=4096,
            beta_fast=32.0, beta_slow=1.0, max_position=163840,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def deepseek_v41(cls, **overrides) -> IndexerConfig:
        """DeepSeek-V4.1-Flash (HF ``transformers`` ``DeepseekV41TextConfig`` defaults, released config).

        32 heads x 128, top-512, RoPE interleaved on the trailing 64 dims, RMSNorm on the key, MXFP4,
        keys compressed 2:1, candidate blocks 2048 x 8, no Hadamard (V4.1 dropped V4's rotation).

        Placeholders to override (not in this project's research notes; taken from the HF config's
        documented defaults): ``hidden_size`` 5120, ``q_lora_rank`` 1280, ``wk_input_size`` 512 (keys
        are projected from the compressor's latent of the attention head dim), ``norm_eps`` 1e-20
        (``rms_norm_eps``), and the compressed branch's RoPE: ``compress_rope_theta`` 160000 with YaRN
        factor 16 / original 65536 / ``beta_fast`` 32 / ``beta_slow`` 1 / ``max_position`` 1048576.
        Building an ``Indexer`` at the full ``max_position`` allocates a 256 MiB cos/sin table; set
        ``rope_table_len`` (or use ``small()``) when shorter positions suffice.
        """
        fields = dict(
            n_heads=32, head_dim=128, topk=512, rope_dim=64, rope_style="interleaved", rope_position="trailing",
            k_norm="rmsnorm", norm_eps=1e-20, fmt="mxfp4", hidden_size=5120, q_lora_rank=1280,
            wk_input_size=512, compress_ratio=2, candidate_topk_blocks=2048, candidate_block_size=8,
            use_hadamard=False, rope_theta=160000.0, yarn_factor=16.0, original_max_position=65536,
            beta_fast=32.0, beta_slow=1.0, max_position=1048576,
        )
        fields.update(overrides)
        return cls(**fields)


def rope_frequencies(config: IndexerConfig) -> torch.Tensor:
    """Angular frequency of each rotated pair, float64 ``[rope_dim / 2]`` (radians per position).

    Plain RoPE: ``f_i = theta ** (-2i / rope_dim)``. With YaRN (``config.uses_yarn``), DeepSeek's
    blend: the pair index where a frequency completes ``r`` rotations over the original context is
    ``c(r) = rope_dim * ln(original / (2 pi r)) / (2 ln theta)``; ``low = max(floor(c(beta_fast)), 0)``,
    ``high = min(ceil(c(beta_slow)), rope_dim - 1)`` (``high += 0.001`` when equal); the ramp
    ``g_i = clamp((i - low) / (high - low), 0, 1)`` moves from extrapolation (``f_i``, fast pairs) to
    interpolation (``f_i / factor``, slow pairs): ``f'_i = f_i / factor * g_i + f_i * (1 - g_i)``.
    No attention-magnitude factor is applied to cos/sin (DeepSeek puts YaRN's ``mscale`` into the
    MLA softmax scale, which the indexer does not use).
    """
    dim = config.rope_dim
    base = float(config.rope_theta)
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    freqs = 1.0 / base**exponents
    if not config.uses_yarn:
        return freqs

    def correction_dim(rotations: float) -> float:
        return dim * math.log(config.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(config.beta_fast)), 0)
    high = min(math.ceil(correction_dim(config.beta_slow)), dim - 1)
    span = (high - low) if high != low else 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / span).clamp(0.0, 1.0)
    return freqs / config.yarn_factor * ramp + freqs * (1.0 - ramp)


def yarn_cos_sin(
    config: IndexerConfig, max_position: int | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """The RoPE table ``float32 [max_position, rope_dim]``: row ``p`` is ``[cos(p f) | sin(p f)]``.

    ``f`` are ``rope_frequencies(config)`` (DeepSeek's YaRN blend, plain RoPE when ``yarn_factor ==
    1`` or ``config.max_position <= original_max_position``). ``max_position`` (default
    ``config.max_position``) only sets the number of rows: tables of different lengths agree row for
    row. Angles and their cos/sin are computed in float64 and rounded once to fp32 (DeepSeek's
    reference builds the table in fp32; the two differ by fp32 rounding of ``p * f``, up to about
    ``p * 2**-24`` radians at large positions).
    """
    rows = config.max_position if max_position is None else max_position
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"max_position must be an int >= 1, got {rows!r}")
    freqs = rope_frequencies(config)
    half = config.rope_dim // 2
    table = torch.empty(rows, 2 * half, dtype=torch.float32)
    for start in range(0, rows, _TABLE_CHUNK_ROWS):
        stop = min(rows, start + _TABLE_CHUNK_ROWS)
        angles = torch.arange(start, stop, dtype=torch.float64)[:, None] * freqs[None, :]
        table[start:stop, :half] = torch.cos(angles)
        table[start:stop, half:] = torch.sin(angles)
    return table.to(device) if device is not None else table


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard transform over the last dim: ``x @ H_n / sqrt(n)``.

    ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]`` (entry ``(i, j)`` is ``(-1) ** popcount(i & j)``,
    symmetric), ``n`` a power of two. Computed in fp32 with ``log2(n)`` butterfly passes, scaled by
    ``n ** -0.5`` and cast back to ``x``'s dtype. Being orthogonal and symmetric, it preserves dot
    products: ``hadamard_transform(q) . hadamard_transform(k) == q . k`` up to rounding.
    """
    check_tensor("x", x, min_ndim=1)
    check_floating("x", x)
    n = x.shape[-1]
    if not _is_power_of_two(n):
        raise ValueError(f"x's last dimension must be a power of two, got {n}")
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.view(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).view(-1, n)
        h *= 2
    return (y * (n ** -0.5)).view(x.shape).to(x.dtype)


class Indexer(nn.Module):
    """DeepSeek's indexer module (V3.2 or V4.1 configuration), producing the indexer layer's inputs.

    Args:
        config: an ``IndexerConfig`` (``IndexerConfig.deepseek_v32()``, ``.deepseek_v41()``, ``.small()``).
        seed: seeds the ``torch.Generator`` of the deterministic initialisation (no global RNG use):
            projections ``N(0, 1 / in_features)`` (O(1) outputs for O(1) inputs), norm weight 1, bias 0.
        dtype: dtype of the projections and of q / k (bf16, as the fused Q path requires).
        device: where parameters and the cos/sin table live.
        backend: ``"auto" | "reference" | "triton"`` for ``rope_quant_q``.

    Submodules (checkpoint names): ``wq_b: Linear(q_lora_rank, H * D)``, ``wk: Linear(k_input_size,
    D)``, ``k_norm: LayerNorm(D, eps)`` (weight and bias) or ``RMSNorm(D, eps)`` (weight), kept in fp32
    and applied in fp32, ``weights_proj: Linear(hidden_size, H)``; all linears without bias.
    Buffer ``cos_sin`` (not in the state dict): ``yarn_cos_sin(config, rope_table_len or max_position)``.
    """

    def __init__(
        self,
        config: IndexerConfig,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        backend: str = "auto",
    ):
        super().__init__()
        if not isinstance(config, IndexerConfig):
            raise TypeError(f"config must be an IndexerConfig, got {type(config).__name__}")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
        if backend not in ("auto", "reference", "triton"):
            raise ValueError(f"backend must be one of ('auto', 'reference', 'triton'), got {backend!r}")
        self.config = config
        self.backend = backend
        c = config
        device = torch.device("cpu") if device is None else torch.device(device)
        linear = dict(bias=False, dtype=dtype, device=device)
        self.wq_b = nn.utils.skip_init(nn.Linear, c.q_lora_rank, c.n_heads * c.head_dim, **linear)
        self.wk = nn.utils.skip_init(nn.Linear, c.k_input_size, c.head_dim, **linear)
        norm_cls = nn.LayerNorm if c.k_norm == "layernorm" else nn.RMSNorm
        self.k_norm = nn.utils.skip_init(norm_cls, c.head_dim, eps=c.norm_eps, dtype=torch.float32, device=device)
        self.weights_proj = nn.utils.skip_init(nn.Linear, c.hidden_size, c.n_heads, **linear)
        rows = c.rope_table_len if c.rope_table_len is not None else c.max_position
        self.register_buffer("cos_sin", yarn_cos_sin(c, rows, device=device), persistent=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Deterministic initialisation from ``torch.Generator().manual_seed(seed)`` (drawn on the CPU)."""
        generator = torch.Generator().manual_seed(int(seed))
        for layer in (self.wq_b, self.wk, self.weights_proj):
            out_features, in_features = layer.weight.shape
            values = torch.randn(out_features, in_features, generator=generator, dtype=torch.float32)
            layer.weight.copy_(values * in_features ** -0.5)
        self.k_norm.weight.fill_(1.0)
        if getattr(self.k_norm, "bias", None) is not None:
            self.k_norm.bias.zero_()

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"n_heads={c.n_heads}, head_dim={c.head_dim}, topk={c.topk}, fmt={c.fmt!r}, rope={c.rope_style}/"
            f"{c.rope_position}/{c.rope_dim}, k_norm={c.k_norm!r}, hadamard={c.use_hadamard}, "
            f"compress_ratio={c.compress_ratio}, candidates={c.candidate_topk_blocks}x{c.candidate_block_size}"
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.wq_b.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.wq_b.weight.device

    def _check_positions(self, positions: torch.Tensor, num_tokens: int) -> None:
        check_index_tensor("positions", positions, shape=(num_tokens,))
        if positions.device != self.cos_sin.device:
            raise ValueError(f"positions must be on device {self.cos_sin.device}, got {positions.device}")
        if num_tokens:
            low, high = (int(v) for v in torch.aminmax(positions))
            if low < 0 or high >= self.cos_sin.shape[0]:
                raise ValueError(
                    f"positions must lie in [0, {self.cos_sin.shape[0]}) (rows of the cos/sin table; raise "
                    f"IndexerConfig.rope_table_len), got values in [{low}, {high}]"
                )

    def _check_input(self, name: str, x: torch.Tensor, features: int, num_tokens: int | None = None) -> None:
        check_tensor(name, x, ndim=2, device=self.device)
        check_floating(name, x)
        if x.shape[1] != features or (num_tokens is not None and x.shape[0] != num_tokens):
            rows = "T" if num_tokens is None else str(num_tokens)
            raise ValueError(f"{name} must have shape [{rows}, {features}], got {list(x.shape)}")

    def norm_k(self, k: torch.Tensor) -> torch.Tensor:
        """``k_norm`` computed in fp32 (parameters read as fp32 whatever the module dtype), cast to ``k``'s dtype."""
        weight = self.k_norm.weight.float()
        shape = (self.config.head_dim,)
        if self.config.k_norm == "layernorm":
            out = F.layer_norm(k.float(), shape, weight, self.k_norm.bias.float(), self.config.norm_eps)
        else:
            out = F.rms_norm(k.float(), shape, weight, self.config.norm_eps)
        return out.to(k.dtype)

    def apply_rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, ..., D]`` (token ``t`` at ``positions[t]``) with the config's style and placement.

        Same arithmetic as ``rope_quant_q``: pair ``(x0, x1)`` becomes ``(x0 cos - x1 sin, x1 cos + x0 sin)``,
        each product and sum one fp32 operation, the results rounded to ``x``'s dtype (bf16 for the
        DeepSeek configurations, where this equals ``rope_quant_q``'s rotation, which always rounds to
        bf16); the other dims are returned unchanged.
        """
        c = self.config
        check_tensor("x", x, min_ndim=2, device=self.cos_sin.device)
        check_floating("x", x)
        if x.shape[-1] != c.head_dim:
            raise ValueError(f"x's last dimension must be head_dim ({c.head_dim}), got {x.shape[-1]}")
        self._check_positions(positions, x.shape[0])
        half = c.rope_dim // 2
        if c.rope_position == "first":
            rope = slice(0, c.rope_dim)
        else:
            rope = slice(c.head_dim - c.rope_dim, c.head_dim)
        table = self.cos_sin.index_select(0, positions.long())  # [T, rope_dim]
        view = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
        cos, sin = table[:, :half].reshape(view), table[:, half:].reshape(view)
        part = x[..., rope].float()
        if c.rope_style == "neox":
            x0, x1 = part[..., :half], part[..., half:]
        else:
            x0, x1 = part[..., 0::2], part[..., 1::2]
        r0 = (x0 * cos - x1 * sin).to(x.dtype)
        r1 = (x1 * cos + x0 * sin).to(x.dtype)
        out = x.clone()
        if c.rope_style == "neox":
            out[..., rope] = torch.cat((r0, r1), dim=-1)
        else:
            out[..., rope] = torch.stack((r0, r1), dim=-1).flatten(-2)
        return out

    def project_q(self, q_latent: torch.Tensor) -> torch.Tensor:
        """``wq_b(q_latent)`` as ``[T, H, D]`` in the module dtype (RoPE not applied)."""
        c = self.config
        self._check_input("q_latent", q_latent, c.q_lora_rank)
        return self.wq_b(q_latent.to(self.dtype)).view(q_latent.shape[0], c.n_heads, c.head_dim)

    def project_k(self, k_input: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``rope(k_norm(wk(k_input)))`` as ``[T, D]`` in the module dtype."""
        self._check_input("k_input", k_input, self.config.k_input_size)
        k = self.norm_k(self.wk(k_input.to(self.dtype)))
        return self.apply_rope(k, positions)

    def head_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """``weights_proj(hidden).float()``, ``[T, H]`` (the head and softmax scales are applied later)."""
        self._check_input("hidden", hidden, self.config.hidden_size)
        return self.weights_proj(hidden.to(self.dtype)).float()

    def project(
        self,
        hidden: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        *,
        k_input: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections of one step.

        Args:
            hidden: ``[T, hidden_size]`` hidden state (input of ``weights_proj`` and, by default, ``wk``).
            q_latent: ``[T, q_lora_rank]`` the MLA's normalised query latent.
            positions: ``[T]`` int positions (rows of ``cos_sin``).
            k_input: ``[T, wk_input_size]`` input of ``wk`` when it is not ``hidden`` (required when
                ``config.wk_input_size`` differs from ``hidden_size``).

        Returns:
            ``(q [T, H, D] before RoPE, k [T, D] after norm and RoPE, weights float32 [T, H])``; q and k
            in the module dtype.
        """
        c = self.config
        self._check_input("hidden", hidden, c.hidden_size)
        num_tokens = hidden.shape[0]
        self._check_input("q_latent", q_latent, c.q_lora_rank, num_tokens)
        if k_input is None:
            if c.k_input_size != c.hidden_size:
                raise ValueError(
                    f"k_input is required: wk takes {c.k_input_size} features (config.wk_input_size), "
                    f"hidden has {c.hidden_size}"
                )
            k_input = hidden
        self._check_input("k_input", k_input, c.k_input_size, num_tokens)
        self._check_positions(positions, num_tokens)
        return self.project_q(q_latent), self.project_k(k_input, positions), self.head_weights(hidden)

    def quantize(
        self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """RoPE + quantisation of q, and the keys the cache will quantise on insert.

        Args:
            q: ``[T, H, D]`` before RoPE (``project``'s q).
            k: ``[N, D]`` keys with RoPE applied (``project``'s k, or a compressor's keys).
            weights: ``float32 [T, H]`` (``project``'s weights).
            positions: ``[T]`` positions of the queries.

        Returns:
            ``(q_quant, q_scale | None, k_for_cache, weights_out)`` as ``SparseAttnIndexer`` takes them:
            without Hadamard ``rope_quant_q(q, positions, cos_sin, weights, D**-0.5, H**-0.5)`` and ``k``
            itself; with Hadamard, ``hadamard(apply_rope(q))`` quantised per (token, head) as
            ``rope_quant_q`` does after its rotation (FP8: ue8m0, floor 1e-10, scale folded as
            ``weights * q_scale * softmax_scale * head_scale``; MXFP4: per-32 scales, ``weights *
            softmax_scale * head_scale``) and ``hadamard(k)``.
        """
        c = self.config
        check_tensor("q", q, ndim=3, device=self.device)
        if tuple(q.shape[1:]) != (c.n_heads, c.head_dim):
            raise ValueError(f"q must have shape [T, {c.n_heads}, {c.head_dim}], got {list(q.shape)}")
        check_tensor("k", k, ndim=2, device=self.device)
        if k.shape[1] != c.head_dim:
            raise ValueError(f"k must have shape [N, {c.head_dim}], got {list(k.shape)}")
        check_tensor("weights", weights, ndim=2, shape=(q.shape[0], c.n_heads), device=self.device)
        self._check_positions(positions, q.shape[0])
        if not c.use_hadamard:
            from .ops.q_quant import rope_quant_q

            q_quant, q_scale, weights_out = rope_quant_q(
                q, positions, self.cos_sin, weights, c.softmax_scale, c.head_scale,
                rope_style=c.rope_style, rope_position=c.rope_position, fmt=c.fmt, backend=self.backend,
            )
            return q_quant, q_scale, k, weights_out
        q_rot = hadamard_transform(self.apply_rope(q, positions))
        k_rot = hadamard_transform(k)
        if c.fmt == "fp8":
            values, scales = quantize_fp8(q_rot, block_size=c.head_dim, scale_fmt="ue8m0", amax_floor=Q_AMAX_FLOOR)
            q_scale = scales.squeeze(-1)  # [T, H]
            weights_out = weights.float() * q_scale * c.softmax_scale * c.head_scale
            return values, None, k_rot, weights_out
        packed, scales = quantize_mxfp4(q_rot)
        return packed, scales, k_rot, weights.float() * c.softmax_scale * c.head_scale

    @torch.no_grad()
    def forward(
        self,
        hidden: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        metadata,
        layer,
        *,
        k: torch.Tensor | None = None,
        k_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Index one step: ``project`` → ``quantize`` → ``layer`` (a ``SparseAttnIndexer``).

        Args:
            hidden, q_latent, positions: as for ``project`` (rows in the metadata's batch order).
            metadata: the step's ``IndexerMetadata`` (``build_metadata``), planned with the config's
                ``compress_ratio``.
            layer: the ``SparseAttnIndexer`` of this layer (its cache format and ``topk_tokens`` must
                match the config).
            k: keys to insert instead of the projected ones, ``[T, D]`` with RoPE applied — with
                ``compress_ratio > 1`` the compressor's keys, row ``t`` holding the key that token ``t``
                completes (rows whose slot is ``-1`` are ignored). Hadamard, when configured, is applied
                to them here.
            k_input: input of ``wk`` when it is not ``hidden`` (unused when ``k`` is given).

        Runs without autograd (indices are not differentiable; train through ``project`` and
        ``scores_fp32``).

        Returns:
            ``int32 [T, topk]``: per token the request-local (compressed) key positions, ascending,
            ``-1``-padded (a view of the layer's index buffer).
        """
        from .layer import SparseAttnIndexer

        c = self.config
        if not isinstance(layer, SparseAttnIndexer):
            raise TypeError(f"layer must be a SparseAttnIndexer, got {type(layer).__name__}")
        if layer.topk_tokens != c.topk:
            raise ValueError(f"layer.topk_tokens ({layer.topk_tokens}) must equal config.topk ({c.topk})")
        if layer.cache.fmt != c.fmt or layer.cache.head_dim != c.head_dim:
            raise ValueError(
                f"layer's cache is {layer.cache.fmt!r} with head_dim {layer.cache.head_dim}; the config wants "
                f"{c.fmt!r} with head_dim {c.head_dim}"
            )
        self._check_input("hidden", hidden, c.hidden_size)
        num_tokens = hidden.shape[0]
        self._check_input("q_latent", q_latent, c.q_lora_rank, num_tokens)
        self._check_positions(positions, num_tokens)
        q = self.project_q(q_latent)
        weights = self.head_weights(hidden)
        if k is None:
            if k_input is None:
                if c.k_input_size != c.hidden_size:
                    raise ValueError(
                        f"k or k_input is required: wk takes {c.k_input_size} features, hidden has {c.hidden_size}"
                    )
                k_input = hidden
            self._check_input("k_input", k_input, c.k_input_size, num_tokens)
            k = self.project_k(k_input, positions)
        else:
            check_tensor("k", k, ndim=2, device=self.device)
            check_floating("k", k)
            if k.shape[1] != c.head_dim:
                raise ValueError(f"k must have shape [T, {c.head_dim}], got {list(k.shape)}")
        q_quant, q_scale, k_for_cache, weights_out = self.quantize(q, k, weights, positions)
        return layer(q_quant, q_scale, k_for_cache, weights_out, metadata)

    def scores_fp32(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Unquantised indexer scores ``float32 [M, N]`` (no causal mask).

        ``logits[i, j] = sum_h weights[i, h] * H**-0.5 * D**-0.5 * relu(q[i, h] . k[j])`` in fp32, for
        RoPE-rotated ``q [M, H, D]``, keys ``k [N, D]`` and ``project``'s ``weights [M, H]``. Rows are
        processed in chunks whose ``[rows, H, N]`` intermediate stays under 256 MiB.
        """
        c = self.config
        check_tensor("q", q, ndim=3)
        check_tensor("k", k, ndim=2, device=q.device)
        check_tensor("weights", weights, ndim=2, device=q.device)
        if q.shape[2] != k.shape[1] or weights.shape != q.shape[:2]:
            raise ValueError(
                f"q [M, H, D], k [N, D] and weights [M, H] must agree, got {list(q.shape)}, {list(k.shape)}, "
                f"{list(weights.shape)}"
            )
        rows, heads = q.shape[:2]
        keys = k.shape[0]
        scale = c.head_scale * c.softmax_scale
        out = torch.empty(rows, keys, dtype=torch.float32, device=q.device)
        kf = k.float()
        step = max(1, _SCORES_CHUNK_BYTES // max(1, heads * keys * 4))
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            dots = torch.einsum("mhd,nd->mhn", q[start:stop].float(), kf).relu_()
            out[start:stop] = torch.einsum("mhn,mh->mn", dots, weights[start:stop].float() * scale)
        return out
