"""``torch.library`` registration of the public ops (namespace ``dsa_indexer``).

Each op is a ``torch.library.custom_op`` whose body is the public Python function, with a fake
(meta) implementation giving output shapes, so ``torch.compile(fullgraph=True)`` traces through calls
of the public API without graph breaks (the argument checks that read device values run inside the
opaque op, at run time). Destination-passing variants ``<op>_out`` mutate their ``out`` argument.
Eager calls go straight to the Python function: ``dispatching`` wraps each public function so that
only a function being compiled goes through the dispatcher (its per-call overhead is measurable
against microsecond kernels).

Ops whose output size depends on tensor values (``gather_k`` without ``num_tokens``, ``pack_seq``
without ``max_len``, ``unpack_seq`` without ``total``) need those sizes when compiled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.library import custom_op

from . import formats
from .cache import SCALE_FORMATS, IndexerKCache, scale_bytes_per_token, value_bytes_per_token
from .ops import candidates as _candidates
from .ops import k_cache as _k_cache
from .ops import logits as _logits
from .ops import q_quant as _q_quant
from .ops import seq_pack as _seq_pack
from .ops import sparse_logits as _sparse_logits
from .ops import topk as _topk

NAMESPACE = "dsa_indexer"


def _fmt_key(cache: IndexerKCache) -> str:
    """The cache's formats as one op argument: ``fmt``, or ``fmt:scale_fmt`` for a non-default scale format."""
    return cache.fmt if cache.scale_fmt == SCALE_FORMATS[cache.fmt][0] else f"{cache.fmt}:{cache.scale_fmt}"


def _cache(buffer: torch.Tensor, block_size: int, head_dim: int, fmt: str) -> IndexerKCache:
    key_fmt, _, scale_fmt = fmt.partition(":")
    return IndexerKCache(buffer.shape[0], block_size=block_size, head_dim=head_dim, fmt=key_fmt,
                         scale_fmt=scale_fmt or None, buffer=buffer)


def _fp32_logits_only(name: str, kwargs: dict) -> None:
    if kwargs.get("logits_dtype", torch.float32) != torch.float32:
        raise ValueError(f"logits_dtype other than torch.float32 is not supported for {name} when compiled, "
                         f"got {kwargs['logits_dtype']}")


def _empty_q_scale(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,), dtype=torch.uint8)


@custom_op(f"{NAMESPACE}::quantize_fp8", mutates_args=())
def quantize_fp8_op(
    x: torch.Tensor, block_size: int, scale_fmt: str, amax_floor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return formats.quantize_fp8(x, block_size=block_size, scale_fmt=scale_fmt, amax_floor=amax_floor)


@quantize_fp8_op.register_fake
def _(x, block_size, scale_fmt, amax_floor):
    return (
        torch.empty_like(x, dtype=formats.FP8_DTYPE),
        x.new_empty((*x.shape[:-1], x.shape[-1] // block_size), dtype=torch.float32),
    )


@custom_op(f"{NAMESPACE}::dequantize_fp8", mutates_args=())
def dequantize_fp8_op(values: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    return formats.dequantize_fp8(values, scales, block_size=block_size)


@dequantize_fp8_op.register_fake
def _(values, scales, block_size):
    return torch.empty_like(values, dtype=torch.float32)


@custom_op(f"{NAMESPACE}::quantize_mxfp4", mutates_args=())
def quantize_mxfp4_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return formats.quantize_mxfp4(x)


@quantize_mxfp4_op.register_fake
def _(x):
    lead = x.shape[:-1]
    return (
        x.new_empty((*lead, x.shape[-1] // 2), dtype=torch.uint8),
        x.new_empty((*lead, formats.mxfp4_scale_bytes(x.shape[-1])), dtype=torch.uint8),
    )


@custom_op(f"{NAMESPACE}::dequantize_mxfp4", mutates_args=())
def dequantize_mxfp4_op(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return formats.dequantize_mxfp4(packed, scales)


@dequantize_mxfp4_op.register_fake
def _(packed, scales):
    return packed.new_empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=torch.float32)


@custom_op(f"{NAMESPACE}::rope_quant_q", mutates_args=())
def rope_quant_q_op(
    q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    weights: torch.Tensor,
    softmax_scale: float,
    head_scale: float,
    rope_style: str,
    rope_position: str,
    fmt: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q_quant, q_scale, weights_out = _q_quant.rope_quant_q(
        q, positions, cos_sin, weights, softmax_scale, head_scale,
        rope_style=rope_style, rope_position=rope_position, fmt=fmt, backend=backend,
    )
    return q_quant, _empty_q_scale(q) if q_scale is None else q_scale, weights_out


@rope_quant_q_op.register_fake
def _(q, positions, cos_sin, weights, softmax_scale, head_scale, rope_style, rope_position, fmt, backend):
    tokens, heads, dim = q.shape
    weights_out = q.new_empty((tokens, heads), dtype=torch.float32)
    if fmt == "fp8":
        return q.new_empty(q.shape, dtype=formats.FP8_DTYPE), _empty_q_scale(q), weights_out
    return (
        q.new_empty((tokens, heads, dim // 2), dtype=torch.uint8),
        q.new_empty((tokens, heads, formats.mxfp4_scale_bytes(dim)), dtype=torch.uint8),
        weights_out,
    )


@custom_op(f"{NAMESPACE}::insert_k", mutates_args=("cache_buffer",))
def insert_k_op(
    k: torch.Tensor,
    cache_buffer: torch.Tensor,
    block_size: int,
    head_dim: int,
    fmt: str,
    slot_mapping: torch.Tensor,
    scale_fmt: str,
    amax_floor: float,
    backend: str,
) -> None:
    _k_cache.insert_k(
        k, _cache(cache_buffer, block_size, head_dim, fmt), slot_mapping,
        scale_fmt=scale_fmt, amax_floor=amax_floor, backend=backend,
    )


@insert_k_op.register_fake
def _(k, cache_buffer, block_size, head_dim, fmt, slot_mapping, scale_fmt, amax_floor, backend):
    return None


@custom_op(f"{NAMESPACE}::gather_k", mutates_args=())
def gather_k_op(
    cache_buffer: torch.Tensor,
    block_size: int,
    head_dim: int,
    fmt: str,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    num_tokens: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _k_cache.gather_k(
        _cache(cache_buffer, block_size, head_dim, fmt), block_table, cu_seq_lens, num_tokens=num_tokens, backend=backend
    )


@gather_k_op.register_fake
def _(cache_buffer, block_size, head_dim, fmt, block_table, cu_seq_lens, num_tokens, backend):
    if fmt == "fp8:mxfp8":
        return (
            cache_buffer.new_empty((num_tokens, head_dim), dtype=formats.FP8_DTYPE),
            cache_buffer.new_empty((num_tokens, 4), dtype=torch.uint8),
        )
    if fmt == "fp8":
        return (
            cache_buffer.new_empty((num_tokens, head_dim), dtype=formats.FP8_DTYPE),
            cache_buffer.new_empty((num_tokens,), dtype=torch.float32),
        )
    return (
        cache_buffer.new_empty((num_tokens, value_bytes_per_token(fmt, head_dim)), dtype=torch.uint8),
        cache_buffer.new_empty((num_tokens, scale_bytes_per_token(fmt, head_dim)), dtype=torch.uint8),
    )


@custom_op(f"{NAMESPACE}::mqa_logits_out", mutates_args=("out",))
def mqa_logits_out_op(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    clean: bool,
    out: torch.Tensor,
    backend: str,
) -> None:
    _logits.mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, clean=clean, out=out, backend=backend)


@mqa_logits_out_op.register_fake
def _(q, q_scale, k, k_scale, weights, ks, ke, clean, out, backend):
    return None


@custom_op(f"{NAMESPACE}::mqa_logits", mutates_args=())
def mqa_logits_op(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    clean: bool,
    backend: str,
) -> torch.Tensor:
    return _logits.mqa_logits(q, q_scale, k, k_scale, weights, ks, ke, clean=clean, backend=backend)


@mqa_logits_op.register_fake
def _(q, q_scale, k, k_scale, weights, ks, ke, clean, backend):
    return q.new_empty((q.shape[0], k.shape[0]), dtype=torch.float32)


@custom_op(f"{NAMESPACE}::paged_mqa_logits", mutates_args=())
def paged_mqa_logits_op(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    cache_buffer: torch.Tensor,
    block_size: int,
    head_dim: int,
    fmt: str,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    clean: bool,
    backend: str,
) -> torch.Tensor:
    return _logits.paged_mqa_logits(
        q, q_scale, _cache(cache_buffer, block_size, head_dim, fmt), weights, context_lens, block_table,
        max_context_len, clean=clean, backend=backend,
    )


@paged_mqa_logits_op.register_fake
def _(q, q_scale, cache_buffer, block_size, head_dim, fmt, weights, context_lens, block_table, max_context_len, clean,
      backend):
    return q.new_empty((q.shape[0] * q.shape[1], max_context_len), dtype=torch.float32)


@custom_op(f"{NAMESPACE}::sparse_mqa_logits", mutates_args=())
def sparse_mqa_logits_op(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    logits_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    return _sparse_logits.sparse_mqa_logits(
        q, q_scale, k, k_scale, weights, ks, ke, blocks, block_size, logits_dtype=logits_dtype, backend=backend
    )


@sparse_mqa_logits_op.register_fake
def _(q, q_scale, k, k_scale, weights, ks, ke, blocks, block_size, logits_dtype, backend):
    return q.new_empty((q.shape[0], blocks.shape[1] * block_size), dtype=logits_dtype)


@custom_op(f"{NAMESPACE}::sparse_paged_mqa_logits", mutates_args=())
def sparse_paged_mqa_logits_op(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    cache_buffer: torch.Tensor,
    block_size: int,
    head_dim: int,
    fmt: str,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    blocks: torch.Tensor,
    candidate_block_size: int,
    logits_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    return _sparse_logits.sparse_paged_mqa_logits(
        q, q_scale, _cache(cache_buffer, block_size, head_dim, fmt), weights, context_lens, block_table, blocks,
        candidate_block_size, logits_dtype=logits_dtype, backend=backend,
    )


@sparse_paged_mqa_logits_op.register_fake
def _(q, q_scale, cache_buffer, block_size, head_dim, fmt, weights, context_lens, block_table, blocks,
      candidate_block_size, logits_dtype, backend):
    return q.new_empty((q.shape[0] * q.shape[1], blocks.shape[1] * candidate_block_size), dtype=logits_dtype)


@custom_op(f"{NAMESPACE}::topk_sparse", mutates_args=())
def topk_sparse_op(logits: torch.Tensor, blocks: torch.Tensor, block_size: int, k: int, backend: str) -> torch.Tensor:
    return _sparse_logits.topk_sparse(logits, blocks, block_size, k, backend=backend)


@topk_sparse_op.register_fake
def _(logits, blocks, block_size, k, backend):
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)


@custom_op(f"{NAMESPACE}::topk_out", mutates_args=("out",))
def topk_out_op(
    logits: torch.Tensor, k: int, starts: torch.Tensor | None, ends: torch.Tensor | None, out: torch.Tensor, backend: str
) -> None:
    _topk.topk(logits, k, starts=starts, ends=ends, out=out, backend=backend)


@topk_out_op.register_fake
def _(logits, k, starts, ends, out, backend):
    return None


@custom_op(f"{NAMESPACE}::topk", mutates_args=())
def topk_op(logits: torch.Tensor, k: int, starts: torch.Tensor | None, ends: torch.Tensor | None, backend: str) -> torch.Tensor:
    return _topk.topk(logits, k, starts=starts, ends=ends, backend=backend)


@topk_op.register_fake
def _(logits, k, starts, ends, backend):
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)


@custom_op(f"{NAMESPACE}::topk_decode", mutates_args=())
def topk_decode_op(logits: torch.Tensor, seq_lens: torch.Tensor, next_n: int, k: int, backend: str) -> torch.Tensor:
    return _topk.topk_decode(logits, seq_lens, next_n, k, backend=backend)


@topk_decode_op.register_fake
def _(logits, seq_lens, next_n, k, backend):
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)


@custom_op(f"{NAMESPACE}::topk_decode_slots", mutates_args=())
def topk_decode_slots_op(
    logits: torch.Tensor, seq_lens: torch.Tensor, next_n: int, k: int, block_table: torch.Tensor, block_size: int,
    backend: str,
) -> torch.Tensor:
    return _topk.topk_decode_slots(logits, seq_lens, next_n, k, block_table, block_size, backend=backend)


@topk_decode_slots_op.register_fake
def _(logits, seq_lens, next_n, k, block_table, block_size, backend):
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)


@custom_op(f"{NAMESPACE}::indices_to_slots", mutates_args=())
def indices_to_slots_op(
    indices: torch.Tensor, block_table: torch.Tensor, block_size: int, row_to_request: torch.Tensor, backend: str
) -> torch.Tensor:
    return _topk.indices_to_slots(indices, block_table, block_size, row_to_request, backend=backend)


@indices_to_slots_op.register_fake
def _(indices, block_table, block_size, row_to_request, backend):
    return torch.empty_like(indices, dtype=torch.int32)


@custom_op(f"{NAMESPACE}::pack_seq", mutates_args=())
def pack_seq_op(x: torch.Tensor, lengths: torch.Tensor, pad_value: float, max_len: int, backend: str) -> torch.Tensor:
    pad = int(pad_value) if not x.dtype.is_floating_point else pad_value
    return _seq_pack.pack_seq(x, lengths, pad_value=pad, max_len=max_len, backend=backend)


@pack_seq_op.register_fake
def _(x, lengths, pad_value, max_len, backend):
    return x.new_empty((lengths.shape[0], max_len, *x.shape[1:]))


@custom_op(f"{NAMESPACE}::unpack_seq", mutates_args=())
def unpack_seq_op(packed: torch.Tensor, lengths: torch.Tensor, total: int, backend: str) -> torch.Tensor:
    return _seq_pack.unpack_seq(packed, lengths, total=total, backend=backend)


@unpack_seq_op.register_fake
def _(packed, lengths, total, backend):
    return packed.new_empty((total, *packed.shape[2:]))


@custom_op(f"{NAMESPACE}::select_candidate_blocks", mutates_args=())
def select_candidate_blocks_op(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    num_blocks_k: int,
    block_size: int,
    row_repeat: int,
    backend: str,
) -> torch.Tensor:
    return _candidates.select_candidate_blocks(
        logits, starts, ends, num_blocks_k, block_size, row_repeat=row_repeat, backend=backend
    )


@select_candidate_blocks_op.register_fake
def _(logits, starts, ends, num_blocks_k, block_size, row_repeat, backend):
    return logits.new_empty((logits.shape[0], num_blocks_k), dtype=torch.int32)


@custom_op(f"{NAMESPACE}::apply_candidate_mask", mutates_args=("logits",))
def apply_candidate_mask_op(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    candidate_blocks: torch.Tensor,
    block_size: int,
    row_repeat: int,
    backend: str,
) -> None:
    _candidates.apply_candidate_mask(
        logits, starts, ends, candidate_blocks, block_size, row_repeat=row_repeat, backend=backend
    )


@apply_candidate_mask_op.register_fake
def _(logits, starts, ends, candidate_blocks, block_size, row_repeat, backend):
    return None


def _needs(name: str, value) -> None:
    if value is None:
        raise ValueError(f"{name} must be given when the op is compiled (the output size depends on tensor values)")


def _compiled_call(name: str, args: tuple, kwargs: dict):
    """The custom-op call equivalent to the public function ``name`` called with ``args, kwargs``."""
    backend = kwargs.get("backend", "auto")
    if name == "quantize_fp8":
        (x,) = args
        return quantize_fp8_op(
            x, kwargs.get("block_size", 128), kwargs.get("scale_fmt", "ue8m0"), kwargs.get("amax_floor", formats.K_AMAX_FLOOR)
        )
    if name == "dequantize_fp8":
        return dequantize_fp8_op(*args, kwargs.get("block_size", 128))
    if name == "quantize_mxfp4":
        return quantize_mxfp4_op(*args)
    if name == "dequantize_mxfp4":
        return dequantize_mxfp4_op(*args)
    if name == "rope_quant_q":
        q_quant, q_scale, weights_out = rope_quant_q_op(
            *args, kwargs.get("rope_style", "neox"), kwargs.get("rope_position", "first"), kwargs.get("fmt", "fp8"), backend
        )
        return q_quant, (None if kwargs.get("fmt", "fp8") == "fp8" else q_scale), weights_out
    if name == "mqa_logits":
        _fp32_logits_only(name, kwargs)
        out = kwargs.get("out")
        if out is not None:
            mqa_logits_out_op(*args, kwargs.get("clean", True), out, backend)
            return out
        return mqa_logits_op(*args, kwargs.get("clean", True), backend)
    if name == "paged_mqa_logits":
        _fp32_logits_only(name, kwargs)
        q, q_scale, cache, *rest = args
        if kwargs.get("out") is not None:
            raise ValueError("out= is not supported for paged_mqa_logits when compiled; use the returned tensor")
        return paged_mqa_logits_op(
            q, q_scale, cache.buffer, cache.block_size, cache.head_dim, _fmt_key(cache), *rest, kwargs.get("clean", True),
            backend
        )
    if name in ("sparse_mqa_logits", "sparse_paged_mqa_logits", "topk_sparse"):
        if kwargs.get("out") is not None:
            raise ValueError(f"out= is not supported for {name} when compiled; use the returned tensor")
        if name == "topk_sparse":
            return topk_sparse_op(*args, backend)
        dtype = kwargs.get("logits_dtype", torch.float32)
        if name == "sparse_mqa_logits":
            return sparse_mqa_logits_op(*args, dtype, backend)
        q, q_scale, cache, *rest = args
        return sparse_paged_mqa_logits_op(
            q, q_scale, cache.buffer, cache.block_size, cache.head_dim, cache.fmt, *rest, dtype, backend
        )
    if name == "topk":
        logits, k = args
        starts, ends, out = kwargs.get("starts"), kwargs.get("ends"), kwargs.get("out")
        if out is not None:
            topk_out_op(logits, k, starts, ends, out, backend)
            return out
        return topk_op(logits, k, starts, ends, backend)
    if name == "topk_decode":
        if kwargs.get("out") is not None:
            raise ValueError("out= is not supported for topk_decode when compiled; use the returned tensor")
        return topk_decode_op(*args, backend)
    if name == "topk_decode_slots":
        if kwargs.get("out") is not None:
            raise ValueError("out= is not supported for topk_decode_slots when compiled; use the returned tensor")
        return topk_decode_slots_op(*args, backend)
    if name == "indices_to_slots":
        return indices_to_slots_op(*args, backend)
    if name == "pack_seq":
        _needs("max_len", kwargs.get("max_len"))
        return pack_seq_op(*args, float(kwargs["pad_value"]), kwargs["max_len"], backend)
    if name == "unpack_seq":
        _needs("total", kwargs.get("total"))
        return unpack_seq_op(*args, kwargs["total"], backend)
    if name == "select_candidate_blocks":
        if kwargs.get("out") is not None:
            raise ValueError("out= is not supported for select_candidate_blocks when compiled; use the returned tensor")
        return select_candidate_blocks_op(*args, kwargs.get("row_repeat", 1), backend)
    if name == "apply_candidate_mask":
        return apply_candidate_mask_op(*args, kwargs.get("row_repeat", 1), backend)
    raise KeyError(name)


def dispatching(function: Callable) -> Callable:
    """``function`` in eager mode; its custom op while ``torch.compile`` traces."""
    name = function.__name__

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            return _compiled_call(name, args, kwargs)
        return function(*args, **kwargs)

    return wrapper


def insert_k_compiled(k: torch.Tensor, cache: IndexerKCache, slot_mapping: torch.Tensor, **kwargs) -> None:
    """``IndexerKCache.insert`` as a custom op (used by the cache while compiling)."""
    insert_k_op(
        k, cache.buffer, cache.block_size, cache.head_dim, _fmt_key(cache), slot_mapping,
        kwargs.get("scale_fmt", "ue8m0"), kwargs.get("amax_floor", formats.K_AMAX_FLOOR), kwargs.get("backend", "auto"),
    )


def gather_k_compiled(cache: IndexerKCache, block_table, cu_seq_lens, *, num_tokens=None, backend="auto"):
    """``IndexerKCache.gather`` as a custom op (used by the cache while compiling)."""
    _needs("num_tokens", num_tokens)
    return gather_k_op(cache.buffer, cache.block_size, cache.head_dim, _fmt_key(cache), block_table, cu_seq_lens, num_tokens,
                       backend)
