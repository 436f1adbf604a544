"""DeepGEMM's indexer API over dsa-indexer ops: same names, argument order, layouts and returns.

``fp8_fp4_mqa_logits``, ``get_paged_mqa_logits_metadata`` and ``fp8_fp4_paged_mqa_logits`` accept the
tensors an engine passes to DeepGEMM (FP4 values as ``int8`` views of the packed bytes, FP4 scales as
``int32`` words holding four ue8m0 bytes, the fused ``[num_blocks, block_size, 1, bytes]`` cache) and
return logits whose row stride is padded to a multiple of 256 elements, as DeepGEMM's are.

Two call orders of ``fp8_fp4_mqa_logits`` are taken, told apart by the type of the sixth argument:
DeepGEMM main's ``(..., clean_logits: bool, max_seqlen_k: int, logits_dtype)`` and the DeepGEMM 2.8
fork vLLM 0.34 builds, ``(..., max_seqlen_k: int, logits_dtype)``. The paged call takes varlen rows
(``indices``: one query row per entry, its request id) and any ``next_n``. Differences: the schedule
metadata is accepted and not needed (our decode kernel schedules itself), and the semantics are exact
and deterministic (docs/contract.md) on every GPU Triton supports.
"""

from __future__ import annotations

import torch

from .._validation import (
    check_index_tensor,
    check_positive_int,
    check_row_windows,
    check_tensor,
    first_true,
    value_checks_enabled,
)
from ..cache import IndexerKCache
from ..formats import FP8_DTYPE
from ..ops.logits import mqa_logits, paged_mqa_logits
from ._sparse import (
    SparseMetadata,
    fp8_fp4_paged_sparse_mqa_logits,
    fp8_fp4_sparse_mqa_logits,
    get_paged_sparse_mqa_logits_metadata,
    get_sparse_mqa_logits_metadata,
)

__all__ = [
    "SparseMetadata",
    "fp8_fp4_mqa_logits",
    "fp8_fp4_paged_mqa_logits",
    "fp8_fp4_paged_sparse_mqa_logits",
    "fp8_fp4_sparse_mqa_logits",
    "get_paged_mqa_logits_metadata",
    "get_paged_sparse_mqa_logits_metadata",
    "get_sparse_mqa_logits_metadata",
]

_ROW_ALIGN = 256


def _padded_logits(rows: int, columns: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    stride = -(-(columns + _ROW_ALIGN) // _ROW_ALIGN) * _ROW_ALIGN
    return torch.empty((rows, stride), dtype=dtype, device=device)[:, :columns]


def _check_logits_dtype(logits_dtype) -> torch.dtype:
    if not isinstance(logits_dtype, torch.dtype):
        raise TypeError(f"logits_dtype must be a torch.dtype, got {type(logits_dtype).__name__}")
    return logits_dtype


def _words_as_bytes(scales: torch.Tensor) -> torch.Tensor:
    """int32 ``[...]`` words of four ue8m0 bytes -> uint8 ``[..., 4]``."""
    return scales.contiguous().view(torch.uint8).view(*scales.shape, 4)


def _unpack_q(q) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values, scales)`` in our dtypes: FP8 stays; FP4 int8 values -> uint8, int32 scales -> bytes."""
    if not isinstance(q, (tuple, list)) or len(q) != 2:
        raise TypeError(f"q must be the (values, scales | None) tuple, got {type(q).__name__}")
    values, scales = q
    check_tensor("q[0]", values)
    if values.dtype == FP8_DTYPE:
        return values, scales
    if values.dtype != torch.int8 or not isinstance(scales, torch.Tensor) or scales.dtype != torch.int32:
        raise TypeError(
            "q must be (float8_e4m3fn values, None) or (int8 packed FP4 values, int32 scales), "
            f"got ({values.dtype}, {scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__})"
        )
    return values.view(torch.uint8), _words_as_bytes(scales)


def _unpack_kv(kv) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)``: FP8 values keep fp32 scales (int32 mxfp8 words -> uint8 ``[N, 4]``); FP4 int8
    values -> uint8 with int32 scale words -> uint8 ``[N, 4]``."""
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise TypeError(f"kv must be the (values, scales) tuple, got {type(kv).__name__}")
    values, scales = kv
    check_tensor("kv[0]", values, dtype=(FP8_DTYPE, torch.int8))
    check_tensor("kv[1]", scales, dtype=(torch.float32, torch.int32))
    if values.dtype == torch.int8:
        values = values.view(torch.uint8)
    return values, _words_as_bytes(scales) if scales.dtype == torch.int32 else scales


def _call_form(sixth, seventh, logits_dtype) -> tuple[bool, int, torch.dtype]:
    """``(clean, max_seqlen_k, logits_dtype)`` from the arguments in either order (see the module doc).

    ``bool`` is a subclass of ``int``, so it is tested first: ``True``/``False`` is DeepGEMM main's
    ``clean_logits``, any other int is the 2.8 fork's ``max_seqlen_k``.
    """
    if isinstance(sixth, bool):
        return sixth, check_positive_int("max_seqlen_k", seventh, minimum=0), logits_dtype
    if not isinstance(sixth, int):
        raise TypeError(
            "clean_logits (the sixth argument) must be a bool (DeepGEMM main's clean_logits) or an int "
            f"(max_seqlen_k, the DeepGEMM 2.8 order vLLM 0.34 calls), got {type(sixth).__name__}"
        )
    width = check_positive_int("max_seqlen_k", sixth, minimum=0)
    if isinstance(seventh, torch.dtype):
        if logits_dtype != torch.float32 and logits_dtype != seventh:
            raise TypeError(f"logits_dtype given twice: {seventh} (seventh argument) and {logits_dtype}")
        logits_dtype = seventh
    elif seventh != 0:
        raise TypeError(
            f"max_seqlen_k given twice: the sixth argument ({sixth}, an int) is max_seqlen_k in the "
            f"DeepGEMM 2.8 order, and max_seqlen_k={seventh!r} was passed as well"
        )
    # The 2.8 order has no clean flag: its logits are never cleaned.
    return False, width, logits_dtype


def fp8_fp4_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    clean_logits: bool | int = True,
    max_seqlen_k: int | torch.dtype = 0,
    logits_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Ragged prefill logits of ``q [M, H, D | D/2]`` against ``kv [N, D | D/2]``.

    ``max_seqlen_k == 0``: ``[M, N]`` logits, entries outside ``[ks[i], ke[i])`` ``-inf`` when
    ``clean_logits``, else (and always in the 2.8 order) unspecified. ``max_seqlen_k > 0`` (needs
    ``clean_logits=False``, or the 2.8 order): compressed ``[M, max_seqlen_k]`` logits, column ``c`` of
    row ``i`` is key ``ks[i] + c`` for ``c < ke[i] - ks[i]``, the tail unspecified; ``ks``/``ke`` must
    satisfy ``0 <= ks <= ke <= N`` and ``ke - ks <= max_seqlen_k`` (checked on the host: this form reads
    ``ks`` there anyway, and makes one native call per distinct ``ks``).
    ``logits_dtype``: ``torch.float32`` or ``torch.bfloat16``.
    """
    clean, width, logits_dtype = _call_form(clean_logits, max_seqlen_k, logits_dtype)
    _check_logits_dtype(logits_dtype)
    q_values, q_scales = _unpack_q(q)
    kv_values, kv_scales = _unpack_kv(kv)
    ks, ke = cu_seq_len_k_start, cu_seq_len_k_end
    if width > 0:
        if clean:
            raise ValueError("clean_logits must be False when max_seqlen_k > 0 (compressed logits)")
        return _compressed_mqa_logits(q_values, q_scales, kv_values, kv_scales, weights, ks, ke, width, logits_dtype)
    out = _padded_logits(q_values.shape[0], kv_values.shape[0], q_values.device, logits_dtype)
    return mqa_logits(q_values, q_scales, kv_values, kv_scales, weights, ks, ke, clean=clean, out=out, logits_dtype=logits_dtype)


def _compressed_mqa_logits(q, q_scales, k, k_scales, weights, ks, ke, width: int, logits_dtype: torch.dtype) -> torch.Tensor:
    """Column ``c`` of row ``i`` is key ``ks[i] + c``: rows are grouped by their start so each group is one
    ragged call over a window of the keys."""
    check_tensor("q[0]", q, ndim=3)
    rows, num_keys = q.shape[0], k.shape[0]
    check_index_tensor("cu_seq_len_k_start", ks, shape=(rows,))
    check_index_tensor("cu_seq_len_k_end", ke, shape=(rows,))
    check_row_windows(ks, ke, num_keys, names=("ks", "ke"), limit_name="the number of keys")
    too_long = (ke - ks) > width
    if bool(too_long.any()):
        entry = first_true(too_long)
        raise ValueError(
            f"ke - ks must be <= max_seqlen_k {width}, got ke[{entry}] - ks[{entry}] = {int(ke[entry] - ks[entry])}"
        )
    out = _padded_logits(rows, width, q.device, logits_dtype)
    for start in torch.unique(ks).tolist():
        group = (ks == start).nonzero().squeeze(1)
        stop = min(start + width, num_keys)
        window = mqa_logits(
            q[group], None if q_scales is None else q_scales[group], k[start:stop], k_scales[start:stop],
            weights[group], torch.zeros_like(ks[group]), ke[group] - start, clean=False, logits_dtype=logits_dtype,
        )
        out[group, : stop - start] = window
    return out


def get_paged_mqa_logits_metadata(
    context_lens: torch.Tensor, block_kv: int, num_sms: int, indices: torch.Tensor | None = None
) -> torch.Tensor:
    """DeepGEMM's schedule tensor ``int32 [num_sms + 1, 2]`` for ``context_lens [B, next_n]`` (or ``[B]``),
    any ``next_n`` and any positive slot count ``num_sms`` (vLLM passes ``num_sms // 2`` at next_n 4 on
    SM90). With ``indices`` (varlen rows, ``[R]``) ``context_lens`` is ``[R, 1]`` or ``[R]``. Our kernel
    needs no schedule; the tensor is returned (zeros) so engines that allocate and pass it keep working."""
    check_index_tensor("context_lens", context_lens, ndim=(1, 2))
    check_positive_int("block_kv", block_kv)
    check_positive_int("num_sms", num_sms)
    if indices is not None:
        next_n = 1 if context_lens.dim() == 1 else context_lens.shape[1]
        _check_varlen_indices(indices, context_lens.shape[0], next_n, context_lens.device)
    return torch.zeros((num_sms + 1, 2), dtype=torch.int32, device=context_lens.device)


def _check_varlen_indices(indices, rows: int, next_n: int, device: torch.device) -> None:
    check_index_tensor("indices", indices, ndim=1)
    check_tensor("indices", indices, device=device)
    if next_n != 1:
        raise ValueError(f"indices (varlen rows) need one query per row (next_n 1), got next_n {next_n}")
    if indices.shape[0] != rows:
        raise ValueError(f"indices must have one entry per query row ({rows}), got shape {list(indices.shape)}")


def _cache_from_fused(kv_cache: torch.Tensor, head_dim: int, fmt: str) -> IndexerKCache:
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.dtype != torch.uint8:
        raise ValueError(f"kv_cache must be uint8 [num_blocks, block_size, 1, bytes], got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    return IndexerKCache(num_blocks, block_size=block_size, head_dim=head_dim, fmt=fmt, buffer=kv_cache[:, :, 0, :])


def _varlen_block_table(block_table: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Per-row page table: ``block_table`` as is when it has one row per query row (DeepGEMM's form),
    else its request rows gathered by ``indices``."""
    rows = indices.shape[0]
    check_index_tensor("block_table", block_table, ndim=2)
    if block_table.shape[0] == rows:
        return block_table
    requests = block_table.shape[0]
    if value_checks_enabled():
        outside = (indices < 0) | (indices >= requests)
        if bool(outside.any()):
            entry = first_true(outside)
            raise ValueError(
                f"indices must be in [0, {requests}) (block_table's request rows), got indices[{entry}] = {int(indices[entry])}"
            )
    # Clamped so that a skipped check cannot make the gather read outside the table.
    return block_table.index_select(0, indices.clamp(0, max(requests - 1, 0)))


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
    """Paged decode logits ``[B * next_n, max_context_len]`` for ``q [B, next_n, H, D | D/2]``, any ``next_n``.

    ``context_lens`` is ``[B, next_n]`` (each row's length) or ``[B]`` (the request length ``L``; row
    ``t`` sees ``L - next_n + t + 1`` keys); ``block_table`` is ``[B, max_blocks]``.

    Varlen rows (``indices`` int ``[R]``): ``q`` is ``[R, 1, H, D | D/2]``, query row ``r`` belongs to
    request ``indices[r]`` (any number of rows per request, in any order), ``context_lens`` is ``[R, 1]``
    or ``[R]`` (each row's own length) and ``block_table`` is ``[R, max_blocks]`` (one row per query
    row, as DeepGEMM takes it) or ``[num_requests, max_blocks]`` (gathered by ``indices``; any other row
    count than ``R`` means this form).
    """
    _check_logits_dtype(logits_dtype)
    q_values, q_scales = _unpack_q(q)
    check_tensor("q[0]", q_values, ndim=4)
    check_tensor("schedule_meta", schedule_meta, dtype=torch.int32, ndim=2)
    check_positive_int("max_context_len", max_context_len, minimum=0)
    fmt = "fp8" if q_values.dtype == FP8_DTYPE else "mxfp4"
    head_dim = q_values.shape[-1] * (1 if fmt == "fp8" else 2)
    cache = _cache_from_fused(kv_cache, head_dim, fmt)
    rows = q_values.shape[0] * q_values.shape[1]
    if indices is not None:
        _check_varlen_indices(indices, q_values.shape[0], q_values.shape[1], q_values.device)
        check_index_tensor("context_lens", context_lens, ndim=(1, 2))
        block_table = _varlen_block_table(block_table, indices)
    out = _padded_logits(rows, max_context_len, q_values.device, logits_dtype)
    return paged_mqa_logits(
        q_values, q_scales, cache, weights, context_lens, block_table, max_context_len, clean=clean_logits, out=out,
        logits_dtype=logits_dtype,
    )


