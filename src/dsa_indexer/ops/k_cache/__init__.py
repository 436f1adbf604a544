"""Paged K cache ops: quantise-and-insert rows, gather requests' keys contiguously (DESIGN.md §3)."""

from __future__ import annotations

import torch

from ... import backend as _backend
from ..._validation import (
    capturing_graph,
    check_choice,
    check_index_tensor,
    check_positive_finite,
    check_positive_int,
    check_same_device,
    check_tensor,
    value_checks_enabled,
)
from ...cache_layout import KCacheLayout
from ...formats import FP8_DTYPE, K_AMAX_FLOOR, SCALE_FORMATS
from ..common.registration import registered_op
from .reference import gather_k_reference, insert_k_reference

K_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

__all__ = ["gather_k", "insert_k"]


def _insert_k_triton(*args, **kwargs):
    from .triton import insert_k_triton

    return insert_k_triton(*args, **kwargs)


def _gather_k_triton(*args, **kwargs):
    from .triton import gather_k_triton

    return gather_k_triton(*args, **kwargs)


def _check_cache(cache) -> None:
    if not isinstance(cache, KCacheLayout):
        raise TypeError(f"cache must be an IndexerKCache, got {type(cache).__name__}")


def insert_k(
    k: torch.Tensor,
    cache: KCacheLayout,
    slot_mapping: torch.Tensor,
    *,
    scale_fmt: str = "ue8m0",
    amax_floor: float = K_AMAX_FLOOR,
    backend: str = "auto",
) -> None:
    """Quantise each row of ``k`` and write it into ``cache`` at its slot.

    Args:
        k: ``[T, D]`` bf16/fp16/fp32 with ``D = cache.head_dim``; any strides.
        cache: the destination; slot ``s`` is token ``s % block_size`` of page ``s // block_size``.
        slot_mapping: ``[T]`` int64 (int32 accepted), each ``< cache.num_slots``; a negative slot is
            padding and nothing is written for that row (with value checks off, a slot ``>= num_slots``
            too). Two rows with the same slot are the caller's error: the reference keeps the last row,
            kernels promise no order.
        scale_fmt: FP8 scale rounding, ``"ue8m0"`` (power of two) or ``"fp32"``; MXFP4 caches and FP8
            caches storing mxfp8 scale words (``cache.scale_fmt == "mxfp8"``) take only ``"ue8m0"``.
        amax_floor: FP8 amax floor (> 0); MXFP4 uses its format's fixed floor.

    FP8 rows are quantised with one scale over all ``D`` elements and the scale is stored as the 4
    bytes of the fp32 (or, ``cache.scale_fmt == "mxfp8"``, as four equal ue8m0 bytes); MXFP4 rows store
    ``D/2`` packed bytes and ``cache.scale_bytes`` ue8m0 bytes (``D/32`` and ``127`` padding). The slot range
    check reads ``slot_mapping``'s max on the host (one device synchronisation on CUDA) and runs before
    anything is written.
    """
    _check_cache(cache)
    _insert_k_op(k, *cache.op_args(), slot_mapping, scale_fmt, amax_floor, backend)


@registered_op("insert_k", mutates_args=("cache_buffer",))
def _insert_k_op(
    k: torch.Tensor,
    cache_buffer: torch.Tensor,
    block_size: int,
    head_dim: int,
    formats: str,
    slot_mapping: torch.Tensor,
    scale_fmt: str,
    amax_floor: float,
    backend: str,
) -> None:
    cache = KCacheLayout.from_op_args(cache_buffer, block_size, head_dim, formats)
    check_tensor("k", k, dtype=K_DTYPES, shape=(None, cache.head_dim))
    check_index_tensor("slot_mapping", slot_mapping, shape=(k.shape[0],))
    check_same_device(cache=cache.buffer, k=k, slot_mapping=slot_mapping)
    check_choice("scale_fmt", scale_fmt, SCALE_FORMATS)
    if cache.fmt == "mxfp4" and scale_fmt != "ue8m0":
        raise ValueError(f"scale_fmt must be 'ue8m0' for an MXFP4 cache, got {scale_fmt!r}")
    if cache.scale_fmt == "mxfp8" and scale_fmt != "ue8m0":
        raise ValueError(f"scale_fmt must be 'ue8m0' for a cache storing mxfp8 (power-of-two) scales, got {scale_fmt!r}")
    check_positive_finite("amax_floor", amax_floor)
    if slot_mapping.numel() and value_checks_enabled():
        highest = int(slot_mapping.max())
        if highest >= cache.num_slots:
            raise ValueError(f"slot_mapping entries must be < cache.num_slots = {cache.num_slots}, got {highest}")
    implementation = _backend.dispatch(
        insert_k_reference, _insert_k_triton if _backend.triton_available() else None, backend, cache.device
    )
    implementation(k, cache, slot_mapping, scale_fmt=scale_fmt, amax_floor=float(amax_floor))


def _gather_out_spec(cache: KCacheLayout) -> tuple[torch.dtype, int, torch.dtype, tuple[int, ...]]:
    """``(values dtype, values width, scales dtype, scales trailing shape)`` of a gather for ``cache``."""
    if cache.fmt == "fp8":
        if cache.scale_fmt == "mxfp8":
            return FP8_DTYPE, cache.head_dim, torch.uint8, (4,)
        return FP8_DTYPE, cache.head_dim, torch.float32, ()
    return torch.uint8, cache.value_bytes, torch.uint8, (cache.scale_bytes,)


def _check_gather_tables(cache: KCacheLayout, block_table: torch.Tensor, cu_seq_lens: torch.Tensor) -> int:
    """Host-side checks of ``cu_seq_lens`` and the used block-table entries; returns ``cu_seq_lens[-1]``."""
    cu = cu_seq_lens.long()
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seq_lens must start at 0, got {int(cu[0])}")
    lengths = cu.diff()
    if lengths.numel() == 0:
        return 0
    decreasing = (lengths < 0).nonzero()
    if decreasing.numel():
        at = int(decreasing[0, 0])
        raise ValueError(
            f"cu_seq_lens must be non-decreasing, got cu_seq_lens[{at + 1}] = {int(cu[at + 1])} "
            f"< cu_seq_lens[{at}] = {int(cu[at])}"
        )
    max_blocks = block_table.shape[1]
    pages_needed = (lengths + cache.block_size - 1) // cache.block_size  # [B]
    most_pages = int(pages_needed.max())
    if most_pages > max_blocks:
        raise ValueError(f"block_table must have at least {most_pages} columns for these cu_seq_lens, got {max_blocks}")
    used = torch.arange(max_blocks, device=block_table.device) < pages_needed.unsqueeze(-1)  # [B, max_blocks]
    used_pages = block_table[used]
    if used_pages.numel():
        low, high = int(used_pages.min()), int(used_pages.max())
        if low < 0 or high >= cache.num_blocks:
            raise ValueError(
                f"block_table entries used by cu_seq_lens must lie in [0, {cache.num_blocks}) (cache.num_blocks), "
                f"got values in [{low}, {high}]"
            )
    return int(cu[-1])


def gather_k(
    cache: KCacheLayout,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    *,
    num_tokens: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather requests' keys from ``cache`` into one contiguous, ragged key buffer.

    Args:
        cache: the source cache.
        block_table: ``[B, max_blocks]`` int32 (int64 accepted); row ``b`` lists request ``b``'s pages.
            Only the first ``ceil(len_b / block_size)`` entries of a row are read; they must lie in
            ``[0, cache.num_blocks)`` (with value checks off, a position whose entry is outside the cache or
            past the table gathers zero bytes, and rows stop at the destination's).
        cu_seq_lens: ``[B + 1]`` int32 (int64 accepted), non-decreasing from 0;
            ``len_b = cu_seq_lens[b + 1] - cu_seq_lens[b]``.
        num_tokens: rows ``N`` of the returned tensors (``>= cu_seq_lens[-1]``); default
            ``cu_seq_lens[-1]``. Rows past ``cu_seq_lens[-1]`` of a fresh result are zero. Not allowed
            together with ``out``, whose row count is ``N``.
        out: ``(values, scales)`` destinations shaped like the result, with ``N >= cu_seq_lens[-1]``;
            written and returned. Rows ``[cu_seq_lens[-1], N)`` keep their bytes.

    Returns:
        FP8 ``(values float8_e4m3fn [N, D], scales float32 [N])`` (a ``scale_fmt="mxfp8"`` cache: the raw
        scale words ``uint8 [N, 4]``, as vLLM's gather copies them; ``mqa_logits`` takes them) or MXFP4
        ``(values uint8 [N, D/2], scales uint8 [N, cache.scale_bytes])``: position ``p`` of request ``b`` (token
        ``p % block_size`` of page ``block_table[b, p // block_size]``) lands in row ``cu_seq_lens[b] + p``.

    The checks of ``cu_seq_lens`` and of the used block-table entries read them on the host (device
    synchronisations on CUDA), as does the default ``N`` (a size, read with value checks off too; under
    ``torch.compile`` or CUDA graph capture pass ``num_tokens`` or ``out``).
    """
    _check_cache(cache)
    if out is None:
        return _gather_k_op(*cache.op_args(), block_table, cu_seq_lens, num_tokens, backend)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"out must be a (values, scales) pair of tensors, got {type(out).__name__}")
    if num_tokens is not None:
        raise ValueError(f"num_tokens must be None when out is given (out fixes the rows), got {num_tokens}")
    _gather_k_out_op(*cache.op_args(), block_table, cu_seq_lens, out[0], out[1], backend)
    return out[0], out[1]


def _gather_k_shapes(cache_buffer, block_size, head_dim, formats, block_table, cu_seq_lens, num_tokens, backend):
    if num_tokens is None:
        raise ValueError("num_tokens must be given when gather_k is compiled (the output size depends on tensor values)")
    values_dtype, values_width, scales_dtype, scales_tail = _gather_out_spec(
        KCacheLayout.from_op_args(cache_buffer, block_size, head_dim, formats)
    )
    return (
        cache_buffer.new_empty((num_tokens, values_width), dtype=values_dtype),
        cache_buffer.new_empty((num_tokens, *scales_tail), dtype=scales_dtype),
    )


@registered_op("gather_k", fake=_gather_k_shapes)
def _gather_k_op(
    cache_buffer: torch.Tensor,
    block_size: int,
    head_dim: int,
    formats: str,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    num_tokens: int | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    cache = KCacheLayout.from_op_args(cache_buffer, block_size, head_dim, formats)
    return _gather_k(cache, block_table, cu_seq_lens, num_tokens, None, backend)


@registered_op("gather_k_out", mutates_args=("values_out", "scales_out"))
def _gather_k_out_op(
    cache_buffer: torch.Tensor,
    block_size: int,
    head_dim: int,
    formats: str,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    values_out: torch.Tensor,
    scales_out: torch.Tensor,
    backend: str,
) -> None:
    cache = KCacheLayout.from_op_args(cache_buffer, block_size, head_dim, formats)
    _gather_k(cache, block_table, cu_seq_lens, None, (values_out, scales_out), backend)


def _gather_k(cache, block_table, cu_seq_lens, num_tokens, out, backend):
    """``gather_k`` after the cache check: the argument checks, then the backend's gather."""
    check_index_tensor("block_table", block_table, ndim=2)
    check_index_tensor("cu_seq_lens", cu_seq_lens, shape=(block_table.shape[0] + 1,))
    check_same_device(cache=cache.buffer, block_table=block_table, cu_seq_lens=cu_seq_lens)
    values_dtype, values_width, scales_dtype, scales_tail = _gather_out_spec(cache)
    if num_tokens is not None:
        check_positive_int("num_tokens", num_tokens, minimum=0)
    if out is not None:
        values_out, scales_out = out
        check_tensor("out[0] (values)", values_out, dtype=values_dtype, shape=(None, values_width), device=cache.device)
        scales_shape = (values_out.shape[0], *scales_tail)
        check_tensor("out[1] (scales)", scales_out, dtype=scales_dtype, shape=scales_shape, device=cache.device)
    total = _check_gather_tables(cache, block_table, cu_seq_lens) if value_checks_enabled() else None
    if out is not None:
        num_rows = values_out.shape[0]
    else:
        num_rows = total if num_tokens is None else num_tokens
    if num_rows is None:
        if capturing_graph():
            raise ValueError("num_tokens or out must be given during CUDA graph capture (the default reads the total)")
        num_rows = int(cu_seq_lens[-1])
    if total is not None and total > num_rows:
        source = "out rows" if out is not None else "num_tokens"
        raise ValueError(f"{source} must be >= cu_seq_lens[-1] = {total}, got {num_rows}")
    if out is None:
        values_out = torch.zeros((num_rows, values_width), dtype=values_dtype, device=cache.device)
        scales_out = torch.zeros((num_rows, *scales_tail), dtype=scales_dtype, device=cache.device)
    implementation = _backend.dispatch(
        gather_k_reference, _gather_k_triton if _backend.triton_available() else None, backend, cache.device
    )
    implementation(cache, block_table, cu_seq_lens, values_out, scales_out)
    return values_out, scales_out
