"""Indexer logits (DESIGN.md §5): ragged prefill ``mqa_logits`` and paged decode ``paged_mqa_logits``.

The key format is inferred from the dtypes: ``float8_e4m3fn`` values mean FP8 (fp32 scale per key,
or its mxfp8 word of four ue8m0 bytes; Q scale folded into the weights, ``q_scale`` None), ``uint8``
values mean packed MXFP4 (ue8m0 scale bytes per 32 elements for Q and K, padded to 4-byte words).
Every tensor of a call must agree on it. Weights are fp32 or bf16 (widened exactly); the logits are
fp32 or, with ``logits_dtype=torch.bfloat16``, the fp32 values rounded once to bf16.

Some checks need the values of device tensors (``ks``/``ke`` against the key count, context lengths
against the output width and block table, the block-table entries that will be read); each op does
them with one vectorised reduction and a single host synchronisation before anything is written.

Paged decode on Hopper has two GPU kernels per key format, chosen per call from host integers
(``decode_kernel``): the Gluon warp-specialised one (``gluon_decode.py`` for FP8, ``gluon_decode_mxfp4.py``
for MXFP4) where it is faster, the Triton one otherwise.
"""

from __future__ import annotations

import functools
import os

import torch

from ... import backend as _backend
from ..._validation import (
    check_index_tensor,
    check_positive_int,
    check_row_windows,
    check_same_device,
    check_tensor,
    value_checks_enabled,
)
from ...cache_layout import KCacheLayout
from ...formats import FP8_DTYPE, MXFP4_BLOCK, mxfp4_scale_bytes, ue8m0_to_fp32
from ..common.logits_checks import check_decode_lengths, check_q_scale, key_format
from ..common.registration import registered_op_with_out
from ..common.runtime import capability, interpreting
from . import reference

__all__ = ["mqa_logits", "paged_mqa_logits", "decode_kernel", "DECODE_KERNEL_ENV"]


def _mqa_logits_triton(*args, **kwargs):
    from .triton import mqa_logits_triton

    return mqa_logits_triton(*args, **kwargs)


# Which GPU kernel runs paged decode: "auto" (the rule below), "gluon" (wherever a Gluon kernel can run)
# or "triton". For tests and benchmarks.
DECODE_KERNEL_ENV = "DSA_INDEXER_DECODE_KERNEL"
DECODE_KERNELS = ("auto", "gluon", "triton")


@functools.cache
def _gluon_available() -> bool:
    """Whether this Triton ships Gluon (3.4 and later). Only its absence sends decode to Triton: an import
    error inside our Gluon modules surfaces instead of silently changing the kernel."""
    import importlib.util

    try:
        return importlib.util.find_spec("triton.experimental.gluon") is not None
    except ModuleNotFoundError:
        return False


def _gluon_takes_shape(cache: KCacheLayout, heads: int) -> bool:
    """The Gluon kernels' limits: at most 128 heads (one wgmma N tile); FP8 fp32 scale words and a
    power-of-two ``head_dim`` in [32, 512], MXFP4 ``head_dim == 128``. Other caches and shapes (mxfp8
    scale words, MXFP4 at D = 64) run the Triton kernel."""
    if heads > 128:
        return False
    head_dim = cache.head_dim
    if cache.fmt == "fp8":
        return cache.scale_fmt == "fp32" and 32 <= head_dim <= 512 and head_dim & (head_dim - 1) == 0
    return head_dim == 128


def decode_kernel(q: torch.Tensor, cache: KCacheLayout, max_context_len: int) -> str:
    """``"gluon"`` or ``"triton"``: the kernel the triton backend runs for this paged decode call.

    A Gluon (warp-specialised, wgmma) kernel needs a CUDA GPU of capability 9.x (Hopper's wgmma), e4m3
    dots (not the upcast path), a Triton with Gluon and a shape it takes (``_gluon_takes_shape``); under
    ``auto`` it also has to win for this work size (host integers only): FP8
    ``gluon_decode.gluon_decode_preferred``, MXFP4 ``gluon_decode_mxfp4.gluon_mxfp4_decode_preferred``.
    ``DSA_INDEXER_DECODE_KERNEL`` forces either (``gluon`` falls back to Triton where no Gluon kernel can
    run)."""
    choice = os.environ.get(DECODE_KERNEL_ENV) or "auto"
    if choice not in DECODE_KERNELS:
        raise ValueError(f"environment variable {DECODE_KERNEL_ENV} must be one of {DECODE_KERNELS}, got {choice!r}")
    if choice == "triton" or q.device.type != "cuda" or interpreting():
        return "triton"
    from ..common.codecs import use_upcast  # imports Triton

    if (capability(q.device)[0] != 9 or use_upcast(q.device)
            or not _gluon_takes_shape(cache, q.shape[2]) or not _gluon_available()):
        return "triton"
    if choice == "gluon":
        return "gluon"
    batch, next_n = q.shape[:2]
    if cache.fmt == "fp8":
        from .gluon_decode import gluon_decode_preferred

        preferred = gluon_decode_preferred(batch, next_n, max_context_len)
    else:
        from .gluon_decode_mxfp4 import gluon_mxfp4_decode_preferred

        preferred = gluon_mxfp4_decode_preferred(batch, next_n, max_context_len)
    return "gluon" if preferred else "triton"


def paged_mqa_logits_triton_dispatch(q, q_scale, cache, weights, context_lens, block_table, max_context_len, clean, out):
    """The triton backend of ``paged_mqa_logits`` (arguments already checked): the Gluon or the Triton kernel, as
    ``decode_kernel`` picks for this call."""
    if decode_kernel(q, cache, max_context_len) == "gluon":
        if cache.fmt == "fp8":
            from .gluon_decode import paged_mqa_logits_gluon as gluon_kernel
        else:
            from .gluon_decode_mxfp4 import paged_mqa_logits_gluon_mxfp4 as gluon_kernel
        return gluon_kernel(q, q_scale, cache, weights, context_lens, block_table, max_context_len, clean, out)
    from .triton import paged_mqa_logits_triton

    return paged_mqa_logits_triton(q, q_scale, cache, weights, context_lens, block_table, max_context_len, clean,
                                   out)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


LOGITS_DTYPES = (torch.float32, torch.bfloat16)
WEIGHTS_DTYPES = (torch.float32, torch.bfloat16)


def _check_logits_dtype(logits_dtype) -> None:
    if logits_dtype not in LOGITS_DTYPES:
        raise TypeError(f"logits_dtype must be one of {LOGITS_DTYPES}, got {logits_dtype!r}")


def _prepare_out(out, rows: int, columns: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``out`` checked as ``dtype`` ``[rows, columns]`` with unit column stride and a row stride of at
    least ``columns`` (padding allowed), or a fresh tensor."""
    if out is None:
        return torch.empty((rows, columns), dtype=dtype, device=device)
    check_tensor("out", out, dtype=dtype, shape=(rows, columns), device=device)
    if columns > 1 and out.stride(1) != 1:
        raise ValueError(f"out must have column stride 1, got strides {out.stride()}")
    if rows > 1 and out.stride(0) < columns:
        raise ValueError(f"out must have a row stride >= {columns} (its width), got strides {out.stride()}")
    return out


def mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    *,
    clean: bool = True,
    out: torch.Tensor | None = None,
    logits_dtype: torch.dtype = torch.float32,
    backend: str = "auto",
) -> torch.Tensor:
    """Ragged prefill logits: query row ``i`` against the gathered keys ``[ks[i], ke[i])``.

    FP8:   ``logits[i, j] = (sum_h weights[i, h] * relu(q[i, h] . k[j])) * k_scale[j]``
    MXFP4: ``logits[i, j] =  sum_h weights[i, h] * relu(deq(q[i, h]) . deq(k[j]))``

    Args:
        q: ``[M, H, D]`` float8_e4m3fn, or ``[M, H, D/2]`` uint8 packed e2m1.
        q_scale: None (FP8: the Q scale is already in ``weights``), or uint8 ``[M, H, S]`` ue8m0 with
            ``S = mxfp4_scale_bytes(D)`` (``D/32`` scale bytes padded to whole 4-byte words).
        k: ``[N, D]`` float8_e4m3fn, or ``[N, D/2]`` uint8 packed e2m1 (the ragged gathered keys).
        k_scale: FP8: float32 ``[N]``, or the mxfp8 scale words uint8 ``[N, 4]`` (four equal ue8m0 bytes,
            as ``gather_k`` returns them from a ``scale_fmt="mxfp8"`` cache); MXFP4: uint8 ``[N, S]`` ue8m0.
        weights: float32 or bfloat16 ``[M, H]`` per-head weights (bf16 widens exactly to fp32).
        ks, ke: int32 ``[M]``, ``0 <= ks[i] <= ke[i] <= N``: the key range of row ``i`` (indices into ``k``).
        clean: when True every entry outside ``[ks[i], ke[i])`` is ``-inf``; when False those entries
            are unspecified (a backend may leave them unwritten) and must not be read.
        out: optional ``logits_dtype`` ``[M, N]`` destination; its row stride may exceed ``N`` (only the
            ``[M, N]`` region is written).
        logits_dtype: ``torch.float32`` or ``torch.bfloat16``: the fp32 logit rounded once (to nearest
            even) to bf16.
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.

    Returns:
        ``logits_dtype`` ``[M, N]`` logits (``out`` when given).
    """
    return _mqa_logits_op(q, q_scale, k, k_scale, weights, ks, ke, clean, out, logits_dtype, backend)


@registered_op_with_out(
    "mqa_logits",
    fake=lambda q, q_scale, k, k_scale, weights, ks, ke, clean, logits_dtype, backend: q.new_empty(
        (q.shape[0], k.shape[0]), dtype=logits_dtype
    ),
)
def _mqa_logits_op(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    clean: bool,
    out: torch.Tensor | None,
    logits_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """``mqa_logits`` with every argument given: its checks, then the backend's implementation."""
    fmt = key_format(q)
    check_tensor("q", q, ndim=3)
    num_rows, heads, q_width = q.shape
    if q_width == 0:
        raise ValueError(f"q's last dimension (D, or D/2 for MXFP4) must be > 0, got shape {list(q.shape)}")
    if fmt == "mxfp4" and q_width % (MXFP4_BLOCK // 2):
        raise ValueError(
            f"q's last dimension (D/2) must be a multiple of {MXFP4_BLOCK // 2} for MXFP4, got {q_width}"
        )
    key_dtype = FP8_DTYPE if fmt == "fp8" else torch.uint8
    check_tensor("k", k, dtype=key_dtype, ndim=2)
    check_tensor("k", k, shape=(None, q_width))
    num_keys = k.shape[0]
    if fmt == "fp8":
        check_q_scale(q_scale, fmt, ())
        check_tensor("k_scale", k_scale, dtype=(torch.float32, torch.uint8))
        check_tensor("k_scale", k_scale, shape=(num_keys,) if k_scale.dtype == torch.float32 else (num_keys, 4))
    else:
        scales_per_row = mxfp4_scale_bytes(q_width * 2)
        check_q_scale(q_scale, fmt, (num_rows, heads, scales_per_row))
        check_tensor("k_scale", k_scale, dtype=torch.uint8, shape=(num_keys, scales_per_row))
    check_tensor("weights", weights, dtype=WEIGHTS_DTYPES, shape=(num_rows, heads))
    check_index_tensor("ks", ks, shape=(num_rows,))
    check_index_tensor("ke", ke, shape=(num_rows,))
    _check_bool("clean", clean)
    _check_logits_dtype(logits_dtype)
    check_same_device(q=q, q_scale=q_scale, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke)
    implementation = _backend.dispatch(
        reference.mqa_logits, _mqa_logits_triton if _backend.triton_available() else None, backend, q.device
    )
    if value_checks_enabled():
        check_row_windows(ks, ke, num_keys, names=("ks", "ke"), limit_name="the number of keys")
    out = _prepare_out(out, num_rows, num_keys, q.device, logits_dtype)
    if fmt == "fp8" and k_scale.dtype == torch.uint8:
        # mxfp8 words: the first of the four equal ue8m0 bytes is the scale (exact; [N] elements).
        k_scale = ue8m0_to_fp32(k_scale[:, 0])
    return implementation(q, q_scale, k, k_scale, weights, ks, ke, clean, out)


def paged_mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    cache: KCacheLayout,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    *,
    clean: bool = True,
    out: torch.Tensor | None = None,
    logits_dtype: torch.dtype = torch.float32,
    backend: str = "auto",
) -> torch.Tensor:
    """Paged decode logits: row ``b * next_n + t`` against request ``b``'s cached keys.

    Row ``(b, t)`` scores request-local positions ``p < len[b, t]``; position ``p`` is token
    ``p % block_size`` of page ``block_table[b, p // block_size]``. The math is that of
    ``mqa_logits``.

    Args:
        q: ``[B, next_n, H, D]`` float8_e4m3fn, or ``[B, next_n, H, D/2]`` uint8 packed e2m1;
            ``D`` is ``cache.head_dim`` and the format must be ``cache.fmt``.
        q_scale: None (FP8), or uint8 ``[B, next_n, H, S]`` ue8m0 (MXFP4; ``S = cache.scale_bytes``).
        cache: the paged ``IndexerKCache`` (FP8 scale words fp32 or mxfp8).
        weights: float32 or bfloat16 ``[B * next_n, H]`` (bf16 widens exactly to fp32).
        context_lens: int32 ``[B, next_n]`` (the length of each row), or ``[B]`` (the request length
            ``L``; row ``t`` then sees ``max(L - next_n + t + 1, 0)`` positions).
        block_table: int32 ``[B, max_blocks]`` page ids. Entries for pages a request reads must be in
            ``[0, cache.num_blocks)``; entries past the request's length are never read (may be -1).
            With value checks off, an entry outside the cache reads as zero bytes and a row reads at most
            ``max_blocks * block_size`` positions (contract §12): nothing outside the cache is read.
        max_context_len: output width, ``>=`` every row's length.
        clean: when True every entry at ``p >= len[b, t]`` is ``-inf``; when False those entries are
            unspecified (a backend may leave them unwritten) and must not be read.
        out: optional ``logits_dtype`` ``[B * next_n, max_context_len]`` destination; its row stride may
            exceed the width (only that region is written).
        logits_dtype: ``torch.float32`` or ``torch.bfloat16`` (the fp32 logit rounded once to bf16).
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.

    Returns:
        ``logits_dtype`` ``[B * next_n, max_context_len]`` logits (``out`` when given).
    """
    if not isinstance(cache, KCacheLayout):
        raise TypeError(f"cache must be an IndexerKCache, got {type(cache).__name__}")
    args = (q, q_scale, *cache.op_args(), weights, context_lens, block_table, max_context_len, clean)
    return _paged_mqa_logits_op(*args, out, logits_dtype, backend)


@registered_op_with_out(
    "paged_mqa_logits",
    fake=lambda q, q_scale, cache_buffer, block_size, head_dim, formats, weights, context_lens, block_table,
    max_context_len, clean, logits_dtype, backend: q.new_empty(
        (q.shape[0] * q.shape[1], max_context_len), dtype=logits_dtype
    ),
)
def _paged_mqa_logits_op(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    cache_buffer: torch.Tensor,
    block_size: int,
    head_dim: int,
    formats: str,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    clean: bool,
    out: torch.Tensor | None,
    logits_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    cache = KCacheLayout.from_op_args(cache_buffer, block_size, head_dim, formats)
    return _paged_mqa_logits(
        q, q_scale, cache, weights, context_lens, block_table, max_context_len, clean, out, logits_dtype, backend
    )


def _paged_mqa_logits(q, q_scale, cache, weights, context_lens, block_table, max_context_len, clean, out, logits_dtype, backend):
    """``paged_mqa_logits`` with every argument given: its checks, then the backend's implementation."""
    fmt = key_format(q)
    if fmt != cache.fmt:
        raise ValueError(f"cache must hold keys in q's format {fmt!r} (q has dtype {q.dtype}), got {cache.fmt!r}")
    check_tensor("q", q, ndim=4)
    batch, next_n, heads, q_width = q.shape
    if next_n < 1:
        raise ValueError(f"q must have next_n (dimension 1) >= 1, got shape {list(q.shape)}")
    if q_width != cache.value_bytes:
        raise ValueError(
            f"q's last dimension must be {cache.value_bytes} for a {fmt} cache with head_dim "
            f"{cache.head_dim}, got {q_width}"
        )
    check_q_scale(q_scale, fmt, (batch, next_n, heads, cache.scale_bytes))
    check_tensor("weights", weights, dtype=WEIGHTS_DTYPES, shape=(batch * next_n, heads))
    check_index_tensor("context_lens", context_lens, ndim=(1, 2))
    check_tensor("context_lens", context_lens, shape=(batch,) if context_lens.dim() == 1 else (batch, next_n))
    check_index_tensor("block_table", block_table, ndim=2)
    check_tensor("block_table", block_table, shape=(batch, None))
    check_positive_int("max_context_len", max_context_len, minimum=0)
    _check_bool("clean", clean)
    _check_logits_dtype(logits_dtype)
    check_same_device(
        q=q,
        q_scale=q_scale,
        cache=cache.buffer,
        weights=weights,
        context_lens=context_lens,
        block_table=block_table,
    )
    implementation = _backend.dispatch(
        reference.paged_mqa_logits,
        paged_mqa_logits_triton_dispatch if _backend.triton_available() else None,
        backend,
        q.device,
    )
    if value_checks_enabled():
        check_decode_lengths(context_lens, block_table, next_n, max_context_len, cache)
    out = _prepare_out(out, batch * next_n, max_context_len, q.device, logits_dtype)
    return implementation(q, q_scale, cache, weights, context_lens, block_table, max_context_len, clean, out)
