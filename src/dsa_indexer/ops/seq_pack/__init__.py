"""Pack a ragged batch of rows into a padded ``[B, max_len, ...]`` grid and back (DESIGN §7).

The layer uses them when a decode batch is not uniform (a short prefill classified as a decode):
Q is padded to ``[B, next_n]``, scored and selected on the grid, and the indices are compacted back.

Host reads: ``pack_seq`` needs ``max(lengths)`` and ``unpack_seq`` needs ``sum(lengths)``. When the
caller passes ``max_len`` / ``total`` (or an ``out`` whose shape gives them) the ops do no host read
and are CUDA-graph capturable; the lengths are then the caller's duty (non-negative, summing to at
most ``N`` rows, each at most the padded length). Invalid lengths never make the ops read or write
outside their tensors. Without them, one host read both sizes the output and validates the lengths.
"""

from __future__ import annotations

import math

import torch

from ... import backend as _backend
from ..._validation import check_index_size, check_index_tensor, check_same_device, check_tensor
from ..common.registration import registered_op_with_out
from .reference import pack_seq_reference, unpack_seq_reference

__all__ = ["pack_seq", "unpack_seq"]


def _pack_seq_triton(*args, **kwargs):
    from .triton import pack_seq_triton

    return pack_seq_triton(*args, **kwargs)


def _unpack_seq_triton(*args, **kwargs):
    from .triton import unpack_seq_triton

    return unpack_seq_triton(*args, **kwargs)


def _check_payload(name: str, tensor: torch.Tensor, *, min_ndim: int) -> None:
    check_tensor(name, tensor, min_ndim=min_ndim)
    if tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must have a floating-point or integer dtype, got {tensor.dtype}")


def _check_pad_value(pad_value, dtype: torch.dtype) -> None:
    """``pad_value`` must be stored exactly (byte for byte) in ``dtype``."""
    if isinstance(pad_value, bool) or not isinstance(pad_value, (int, float)):
        raise TypeError(f"pad_value must be an int or a float, got {type(pad_value).__name__}")
    if not dtype.is_floating_point:
        if not isinstance(pad_value, int):
            raise TypeError(f"pad_value must be an int for {dtype} payloads, got {pad_value!r}")
        info = torch.iinfo(dtype)
        if not info.min <= pad_value <= info.max:
            raise ValueError(f"pad_value must be in [{info.min}, {info.max}] for {dtype} payloads, got {pad_value}")
        return
    try:
        as_float = float(pad_value)
    except OverflowError:
        as_float = math.inf
    # A CPU round trip (no device sync); float8_e4m3fn saturates inf to 448, so it shows up as inexact.
    stored = torch.tensor(as_float, dtype=torch.float64).to(dtype).to(torch.float64).item()
    exact = (math.isnan(stored) and math.isnan(as_float)) or (stored == as_float and as_float == pad_value)
    if not exact:
        raise ValueError(
            f"pad_value must be exactly representable in {dtype}, got {pad_value!r} (stored as {stored!r})"
        )


def _host_length_stats(lengths: torch.Tensor) -> tuple[int, int, int]:
    """(min, max, sum) of ``lengths`` in one host read; (0, 0, 0) for an empty batch."""
    if lengths.numel() == 0:
        return 0, 0, 0
    as_int64 = lengths.to(torch.int64)
    low, high, total = torch.stack((as_int64.min(), as_int64.max(), as_int64.sum())).tolist()
    return low, high, total


def _integral_pad(x, pad_value):
    """The pad an integer payload takes: the op schema passes ``pad_value`` as a float (an int in eager calls)."""
    integer_payload = isinstance(x, torch.Tensor) and not x.dtype.is_floating_point
    if integer_payload and isinstance(pad_value, float) and pad_value.is_integer():
        return int(pad_value)
    return pad_value


def _compiled_size(name: str, value: int | None) -> int:
    if value is None:
        raise ValueError(f"{name} must be given when the op is compiled (the output size depends on tensor values)")
    return value


def pack_seq(
    x: torch.Tensor,
    lengths: torch.Tensor,
    *,
    pad_value: int | float,
    max_len: int | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Pad the ragged rows of ``x`` into one row of the grid per sequence.

    Args:
        x: ``[N, ...]`` payload (any float, float8 or integer dtype, any strides); sequence ``b`` is
            ``x[sum(lengths[:b]) : sum(lengths[:b + 1])]``. Rows past ``sum(lengths)`` are ignored.
        lengths: ``[B]`` int32 or int64, ``0 <= lengths[b] <= max_len``, ``sum(lengths) <= N``.
        pad_value: written at positions ``t >= lengths[b]``; must be exactly representable in
            ``x.dtype`` (an int in ``[0, 255]`` for uint8; float8_e4m3fn has no inf). Stored
            byte-exactly.
        max_len: padded length L, ``<= 2**31 - 1``; default ``out.shape[1]``, else ``max(lengths)`` (a host read).
        out: optional ``[B, L, ...]`` destination of ``x.dtype``; every entry is written.
        backend: ``"auto" | "reference" | "triton"``.

    Returns:
        ``[B, L, ...]`` with ``result[b, t] = x[sum(lengths[:b]) + t]`` for ``t < lengths[b]``.
    """
    if isinstance(x, torch.Tensor) and not x.dtype.is_floating_point and isinstance(pad_value, float):
        # The op schema carries the pad as a float: an integer payload's pad is checked to be an int here.
        raise TypeError(f"pad_value must be an int for {x.dtype} payloads, got {pad_value!r}")
    return _pack_seq_op(x, lengths, pad_value, max_len, out, backend)


@registered_op_with_out(
    "pack_seq",
    fake=lambda x, lengths, pad_value, max_len, backend: x.new_empty(
        (lengths.shape[0], _compiled_size("max_len", max_len), *x.shape[1:])
    ),
)
def _pack_seq_op(
    x: torch.Tensor, lengths: torch.Tensor, pad_value: float, max_len: int | None, out: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """``pack_seq`` with every argument given: its checks, then the backend's implementation."""
    pad_value = _integral_pad(x, pad_value)
    _check_payload("x", x, min_ndim=1)
    check_index_tensor("lengths", lengths, ndim=1)
    _check_pad_value(pad_value, x.dtype)
    if max_len is not None:
        check_index_size("max_len", max_len)
    if out is not None:
        check_tensor("out", out, dtype=x.dtype, shape=(lengths.shape[0], max_len, *x.shape[1:]))
        max_len = out.shape[1]
    check_same_device(x=x, lengths=lengths, out=out)
    if max_len is None:
        shortest, max_len, total = _host_length_stats(lengths)
        if shortest < 0:
            raise ValueError(f"lengths must be >= 0, got a length of {shortest}")
        if total > x.shape[0]:
            raise ValueError(f"lengths must sum to at most x.shape[0] = {x.shape[0]}, got a sum of {total}")
    impl = _backend.dispatch(
        pack_seq_reference, _pack_seq_triton if _backend.triton_available() else None, backend, x.device
    )
    return impl(x, lengths, pad_value, max_len, out)


def unpack_seq(
    packed: torch.Tensor,
    lengths: torch.Tensor,
    *,
    total: int | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Compact the valid prefix of each grid row back into one ragged batch (inverse of ``pack_seq``).

    Args:
        packed: ``[B, L, ...]`` payload (any float, float8 or integer dtype, any strides).
        lengths: ``[B]`` int32 or int64, ``0 <= lengths[b] <= L``.
        total: output rows, ``<= 2**31 - 1``; default ``out.shape[0]``, else ``sum(lengths)`` (a host read). May
            exceed ``sum(lengths)`` (a fixed-size buffer): rows past the sum are not written.
        out: optional ``[total, ...]`` destination of ``packed.dtype``.
        backend: ``"auto" | "reference" | "triton"``.

    Returns:
        ``[total, ...]`` with row ``sum(lengths[:b]) + t`` equal to ``packed[b, t]`` for
        ``t < lengths[b]``; rows ``[sum(lengths), total)`` keep ``out``'s contents (uninitialised
        when ``out`` is None).
    """
    return _unpack_seq_op(packed, lengths, total, out, backend)


@registered_op_with_out(
    "unpack_seq",
    fake=lambda packed, lengths, total, backend: packed.new_empty(
        (_compiled_size("total", total), *packed.shape[2:])
    ),
)
def _unpack_seq_op(
    packed: torch.Tensor, lengths: torch.Tensor, total: int | None, out: torch.Tensor | None, backend: str
) -> torch.Tensor:
    """``unpack_seq`` with every argument given: its checks, then the backend's implementation."""
    _check_payload("packed", packed, min_ndim=2)
    check_index_tensor("lengths", lengths, shape=(packed.shape[0],))
    if total is not None:
        check_index_size("total", total)
    if out is not None:
        check_tensor("out", out, dtype=packed.dtype, shape=(total, *packed.shape[2:]))
        total = out.shape[0]
    check_same_device(packed=packed, lengths=lengths, out=out)
    if total is None:
        shortest, longest, total = _host_length_stats(lengths)
        if shortest < 0:
            raise ValueError(f"lengths must be >= 0, got a length of {shortest}")
        if longest > packed.shape[1]:
            raise ValueError(f"lengths must be <= packed.shape[1] = {packed.shape[1]}, got a length of {longest}")
    impl = _backend.dispatch(
        unpack_seq_reference, _unpack_seq_triton if _backend.triton_available() else None, backend, packed.device
    )
    return impl(packed, lengths, total, out)
