"""vLLM's indexer custom ops over dsa-indexer: same names and argument lists, in place like vLLM's.

``indexer_k_quant_and_cache``, ``cp_gather_indexer_k_quant_cache``, ``top_k_per_row_prefill`` and
``top_k_per_row_decode``. Our top-k writes each row's indices ascending with ties to the lower column
(vLLM's order is unspecified); the selected set is the same wherever vLLM's is exact.
"""

from __future__ import annotations

import torch

from .._validation import check_positive_int, check_tensor
from ..cache import IndexerKCache
from ..ops.k_cache import gather_k, insert_k
from ..ops.topk import topk, topk_decode

__all__ = [
    "cp_gather_indexer_k_quant_cache",
    "indexer_k_quant_and_cache",
    "top_k_per_row_decode",
    "top_k_per_row_prefill",
]


def _fp8_cache(kv_cache: torch.Tensor, head_dim: int, scale_fmt: str = "fp32") -> IndexerKCache:
    if kv_cache.dim() != 3 or kv_cache.dtype != torch.uint8:
        raise ValueError(f"kv_cache must be uint8 [num_blocks, block_size, bytes], got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    return IndexerKCache(kv_cache.shape[0], block_size=kv_cache.shape[1], head_dim=head_dim, buffer=kv_cache,
                         scale_fmt=scale_fmt)


# vLLM's scale formats -> (the cache's scale words, insert_k's scale rounding).
_SCALE_FORMATS = {None: ("fp32", "fp32"), "fp32": ("fp32", "fp32"), "ue8m0": ("fp32", "ue8m0"), "mxfp8": ("mxfp8", "ue8m0")}


def indexer_k_quant_and_cache(
    k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, quant_block_size: int, scale_fmt: str | None
) -> None:
    """Quantise ``k [T, D]`` to FP8 and write it into the paged ``kv_cache [nb, bs, D + 4]`` at ``slot_mapping``.

    ``scale_fmt``: ``"ue8m0"`` (power-of-two scale stored as its fp32), ``"mxfp8"`` (power-of-two scale
    stored as four equal ue8m0 bytes, what SM100 engines write), ``None`` or ``"fp32"`` (fp32 scale).
    """
    if scale_fmt not in _SCALE_FORMATS:
        raise ValueError(f"scale_fmt must be one of {tuple(_SCALE_FORMATS)}, got {scale_fmt!r}")
    if quant_block_size != k.shape[-1]:
        raise ValueError(f"quant_block_size must equal head_dim ({k.shape[-1]}), got {quant_block_size}")
    cache_scales, rounding = _SCALE_FORMATS[scale_fmt]
    insert_k(k, _fp8_cache(kv_cache, k.shape[-1], cache_scales), slot_mapping, scale_fmt=rounding)


def cp_gather_indexer_k_quant_cache(
    kv_cache: torch.Tensor,
    dst_k: torch.Tensor,
    dst_scale: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
) -> None:
    """Gather requests' FP8 keys into ``dst_k [T, D]`` (e4m3 or its bytes) and ``dst_scale [T, 4]``: each
    token's 4 scale bytes as stored (an fp32, or four ue8m0 bytes in an mxfp8 cache)."""
    values = dst_k if dst_k.dtype == torch.float8_e4m3fn else dst_k.view(torch.float8_e4m3fn)
    if dst_scale.dim() != 2 or dst_scale.shape[1] != 4 or dst_scale.dtype != torch.uint8:
        raise ValueError(f"dst_scale must be uint8 [T, 4], got {dst_scale.dtype} {tuple(dst_scale.shape)}")
    scales = dst_scale.view(torch.float32).squeeze(1)
    gather_k(_fp8_cache(kv_cache, dst_k.shape[1]), block_table, cu_seq_lens, out=(values, scales))


def _strided_logits(logits: torch.Tensor, num_rows: int, stride0: int, stride1: int) -> torch.Tensor:
    """``logits`` read as ``[num_rows, logits.shape[1]]`` with the caller's strides, which must stay
    inside ``logits``' storage."""
    check_tensor("logits", logits, ndim=2)
    check_positive_int("num_rows", num_rows, minimum=0)
    check_positive_int("stride0", stride0, minimum=0)
    check_positive_int("stride1", stride1, minimum=0)
    width = logits.shape[1]
    if num_rows == 0 or width == 0:
        return logits.as_strided((num_rows, width), (stride0, stride1))
    capacity = logits.untyped_storage().nbytes() // logits.element_size() - logits.storage_offset()
    last = (num_rows - 1) * stride0 + (width - 1) * stride1
    if last >= capacity:
        raise ValueError(
            f"stride0 ({stride0}) and stride1 ({stride1}) reach element {last} of logits for {num_rows} rows of "
            f"{width} columns, past the {capacity} elements of its storage"
        )
    if (stride0, stride1) != (logits.stride(0), logits.stride(1)) or num_rows > logits.shape[0]:
        return logits.as_strided((num_rows, width), (stride0, stride1))
    return logits[:num_rows]


def top_k_per_row_prefill(
    logits: torch.Tensor,
    row_starts: torch.Tensor,
    row_ends: torch.Tensor,
    indices: torch.Tensor,
    num_rows: int,
    stride0: int,
    stride1: int,
    top_k: int,
) -> None:
    """Top-k of columns ``[row_starts, row_ends)`` per row into ``indices [num_rows, top_k]`` (relative to
    the row start, ``-1``-padded)."""
    rows = _strided_logits(logits, num_rows, stride0, stride1)
    topk(rows, top_k, starts=row_starts[:num_rows], ends=row_ends[:num_rows], out=indices[:num_rows, :top_k])


def top_k_per_row_decode(
    logits: torch.Tensor,
    next_n: int,
    seq_lens: torch.Tensor,
    indices: torch.Tensor,
    num_rows: int,
    stride0: int,
    stride1: int,
    top_k: int,
) -> None:
    """Decode top-k: row ``r`` of request ``r // next_n`` sees ``seq_len - next_n + r % next_n + 1`` columns
    (1-D ``seq_lens``) or its own length (2-D ``[B, next_n]``)."""
    rows = _strided_logits(logits, num_rows, stride0, stride1)
    topk_decode(rows, seq_lens, next_n, top_k, out=indices[:num_rows, :top_k])
