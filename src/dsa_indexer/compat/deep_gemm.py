"""DeepGEMM's indexer API over dsa-indexer ops: same names, argument order, layouts and returns.

``fp8_fp4_mqa_logits``, ``get_paged_mqa_logits_metadata`` and ``fp8_fp4_paged_mqa_logits`` accept the
tensors an engine passes to DeepGEMM (FP4 values as ``int8`` views of the packed bytes, FP4 scales as
``int32`` words holding four ue8m0 bytes, the fused ``[num_blocks, block_size, 1, bytes]`` cache) and
return logits whose row stride is padded to a multiple of 256 elements, as DeepGEMM's are. Differences:
the schedule metadata is accepted and not needed (our decode kernel schedules itself), and the
semantics are exact and deterministic (docs/contract.md) on every GPU Triton supports.
"""

from __future__ import annotations

import torch

from ..cache import IndexerKCache
from ..formats import FP8_DTYPE
from ..ops.logits import mqa_logits, paged_mqa_logits

__all__ = ["fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits", "get_paged_mqa_logits_metadata"]

_ROW_ALIGN = 256


def _padded_logits(rows: int, columns: int, device: torch.device) -> torch.Tensor:
    stride = -(-(columns + _ROW_ALIGN) // _ROW_ALIGN) * _ROW_ALIGN
    return torch.empty((rows, stride), dtype=torch.float32, device=device)[:, :columns]


def _unpack_q(q: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values, scales)`` in our dtypes: FP8 stays; FP4 int8 values -> uint8, int32 scales -> bytes."""
    if not isinstance(q, (tuple, list)) or len(q) != 2:
        raise TypeError(f"q must be a (values, scales | None) pair, got {type(q).__name__}")
    values, scales = q
    if values.dtype == FP8_DTYPE:
        return values, scales
    if values.dtype != torch.int8 or scales is None or scales.dtype != torch.int32:
        raise TypeError(
            "q must be (float8_e4m3fn values, None) or (int8 packed FP4 values, int32 scales), "
            f"got ({values.dtype}, {None if scales is None else scales.dtype})"
        )
    return values.view(torch.uint8), scales.contiguous().view(torch.uint8).view(*scales.shape, 4)


def fp8_fp4_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
    logits_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Ragged prefill logits ``[M, N]`` (or ``[M, max_seqlen_k]`` row-start relative when
    ``max_seqlen_k > 0``, which needs ``clean_logits=False``); fp32 only."""
    if logits_dtype != torch.float32:
        raise ValueError(f"logits_dtype must be torch.float32, got {logits_dtype}")
    q_values, q_scales = _unpack_q(q)
    kv_values, kv_scales = kv
    if kv_values.dtype == torch.int8:
        kv_values = kv_values.view(torch.uint8)
        kv_scales = kv_scales.contiguous().view(torch.uint8).view(*kv_scales.shape, 4)
    ks, ke = cu_seq_len_k_start, cu_seq_len_k_end
    if max_seqlen_k > 0:
        if clean_logits:
            raise ValueError("clean_logits must be False when max_seqlen_k > 0 (compressed logits)")
        return _compressed_mqa_logits(q_values, q_scales, kv_values, kv_scales, weights, ks, ke, max_seqlen_k)
    out = _padded_logits(q_values.shape[0], kv_values.shape[0], q_values.device)
    return mqa_logits(q_values, q_scales, kv_values, kv_scales, weights, ks, ke, clean=clean_logits, out=out)


def _compressed_mqa_logits(q, q_scales, k, k_scales, weights, ks, ke, width: int) -> torch.Tensor:
    """Column ``c`` of row ``i`` is key ``ks[i] + c``: rows are grouped by their start so each group is one
    ragged call over a window of the keys."""
    out = _padded_logits(q.shape[0], width, q.device)
    for start in torch.unique(ks).tolist():
        rows = (ks == start).nonzero().squeeze(1)
        stop = min(start + width, k.shape[0])
        window = mqa_logits(
            q[rows], None if q_scales is None else q_scales[rows], k[start:stop], k_scales[start:stop],
            weights[rows], torch.zeros_like(ks[rows]), (ke[rows] - start).clamp(max=stop - start), clean=False,
        )
        out[rows, : stop - start] = window
    return out


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_kv: int, num_sms: int) -> torch.Tensor:
    """DeepGEMM's schedule tensor ``int32 [num_sms + 1, 2]``. Our kernel needs no schedule; the tensor
    is returned (zeros) so engines that allocate and pass it keep working."""
    if context_lens.dim() != 2:
        raise ValueError(f"context_lens must be [B, next_n] (2-D), got shape {tuple(context_lens.shape)}")
    return torch.zeros((num_sms + 1, 2), dtype=torch.int32, device=context_lens.device)


def _cache_from_fused(kv_cache: torch.Tensor, head_dim: int, fmt: str) -> IndexerKCache:
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.dtype != torch.uint8:
        raise ValueError(f"kv_cache must be uint8 [num_blocks, block_size, 1, bytes], got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    return IndexerKCache(num_blocks, block_size=block_size, head_dim=head_dim, fmt=fmt, buffer=kv_cache[:, :, 0, :])


def fp8_fp4_paged_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
    logits_dtype: torch.dtype = torch.float32,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode logits ``[B * next_n, max_context_len]`` for ``q [B, next_n, H, D | D/2]``."""
    if logits_dtype != torch.float32:
        raise ValueError(f"logits_dtype must be torch.float32, got {logits_dtype}")
    if indices is not None:
        raise ValueError("indices (varlen decode rows) are not supported; pass native [B, next_n] rows")
    q_values, q_scales = _unpack_q(q)
    fmt = "fp8" if q_values.dtype == FP8_DTYPE else "mxfp4"
    head_dim = q_values.shape[-1] * (1 if fmt == "fp8" else 2)
    cache = _cache_from_fused(kv_cache, head_dim, fmt)
    rows = q_values.shape[0] * q_values.shape[1]
    out = _padded_logits(rows, max_context_len, q_values.device)
    return paged_mqa_logits(
        q_values, q_scales, cache, weights, context_lens, block_table, max_context_len, clean=clean_logits, out=out
    )


from ._sparse import *  # noqa: E402, F403  (the DeepGEMM 2.8 sparse entry points, a separate module)
