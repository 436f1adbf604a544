"""Exact, deterministic per-row top-k (DESIGN.md §6) and the position-to-slot mapping.

Public entry points validate every argument before anything is written, then dispatch to the
backend implementation. Checks against tensor *values* (bounds within the logits width, positions
within the block table) cost one vectorised reduction and one host synchronisation each; callers
that capture CUDA graphs validate once outside the graph.
"""

from __future__ import annotations

import torch

from ... import backend as _backend
from ..._validation import (
    INT32_MAX,
    check_index_size,
    check_index_tensor,
    check_k,
    check_positive_int,
    check_row_windows,
    check_same_device,
    check_tensor,
    first_true,
    index_as_int32,
    value_checks_enabled,
)
from ..common.registration import registered_op, registered_op_with_out
from . import reference

__all__ = ["indices_to_slots", "topk", "topk_decode", "topk_decode_slots"]

# bf16 logits widen exactly to fp32, so the selection rule applies to the widened values unchanged.
LOGITS_DTYPES = (torch.float32, torch.bfloat16)


def _topk_triton(*args, **kwargs):
    from .triton import topk_triton

    return topk_triton(*args, **kwargs)


def _topk_decode_triton(*args, **kwargs):
    from .triton import topk_decode_triton

    return topk_decode_triton(*args, **kwargs)


def _topk_decode_slots_triton(logits, seq_lens, next_n, k, block_table, block_size, out):
    from .triton import topk_decode_triton

    return topk_decode_triton(logits, seq_lens, next_n, k, out, slots=(block_table, block_size))


def _indices_to_slots_triton(*args, **kwargs):
    from .triton import indices_to_slots_triton

    return indices_to_slots_triton(*args, **kwargs)


def _triton_or_none(kernel):
    """``kernel`` when Triton is importable (without importing it), else ``None``."""
    return kernel if _backend.triton_available() else None


def _picks_shape(logits, k) -> torch.Tensor:
    """Fake result of the selection ops: int32 ``[rows of logits, k]``."""
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)


def _check_out(out: torch.Tensor | None, num_rows: int, k: int, device: torch.device) -> None:
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, shape=(num_rows, k), device=device)


def _check_decode_rows(logits, seq_lens, next_n: int, k: int, out) -> torch.Tensor:
    """The argument checks of ``topk_decode`` (shared by ``topk_decode_slots``); returns ``seq_lens``
    as int32."""
    check_tensor("logits", logits, dtype=LOGITS_DTYPES, ndim=2)
    check_positive_int("next_n", next_n)
    check_k("k", k)
    check_index_tensor("seq_lens", seq_lens, ndim=(1, 2))
    num_requests = seq_lens.shape[0]
    if seq_lens.dim() == 2:
        check_tensor("seq_lens", seq_lens, shape=(num_requests, next_n))
    num_rows, width = logits.shape
    if num_rows != num_requests * next_n:
        raise ValueError(
            f"logits must have B * next_n = {num_requests} * {next_n} = {num_requests * next_n} rows "
            f"(B from seq_lens), got {num_rows}"
        )
    check_same_device(logits=logits, seq_lens=seq_lens, out=out)
    _check_out(out, num_rows, k, logits.device)
    flat_lens = seq_lens.reshape(-1)
    out_of_range = (flat_lens < 0) | (flat_lens > width)
    if value_checks_enabled() and bool(out_of_range.any()):
        position = first_true(out_of_range)
        raise ValueError(
            f"seq_lens must lie in [0, {width}] (the logits width), "
            f"got {int(flat_lens[position])} at flat position {position}"
        )
    return index_as_int32("seq_lens", seq_lens, check_range=False)


def _slots_past_int32(block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Entries whose pages hold slots past the int32 range (slots are int32); ``block_size <= 2**31 - 1``, so
    the int64 product cannot overflow."""
    return block_table.to(torch.int64) * block_size + (block_size - 1) > INT32_MAX


def _raise_for_pages(block_table: torch.Tensor, bad_page: torch.Tensor, block_size: int) -> None:
    if bool(bad_page.any()):
        request, column = (int(i) for i in torch.nonzero(bad_page)[0])
        raise ValueError(
            f"block_table entries must give int32 slots (page * block_size + block_size - 1 <= 2**31 - 1 with "
            f"block_size {block_size}), got block_table[{request}, {column}] = {int(block_table[request, column])}"
        )


def topk(
    logits: torch.Tensor,
    k: int,
    *,
    starts: torch.Tensor | None = None,
    ends: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Exact top-k of each row of ``logits``; returns int32 ``[R, k]`` (``out`` when given).

    Args:
        logits: float32 or bfloat16 ``[R, C]``, any strides (offset, column-strided and stride-0 expanded views).
        k: picks per row, ``1 <= k <= 2**31 - 1`` (may exceed ``C``; the extra columns are ``-1``).
        starts, ends: int32 or int64 ``[R]``, ``0 <= starts <= ends <= C``; row ``r`` considers columns
            ``[starts[r], ends[r])``. ``None`` means ``0`` and ``C``. Columns outside are never used.
        out: int32 ``[R, k]`` destination, fully written.

    Row ``r`` selects the first ``min(k, #selectable)`` entries ordered by value descending, then
    column ascending (NaN and ``-inf`` are not selectable; ``+0.0 == -0.0``) and lists their columns
    relative to ``starts[r]`` (domain ``[0, ends[r] - starts[r])``), ascending, then ``-1`` up to ``k``.
    The result is bitwise deterministic.
    """
    return _topk_op(logits, k, starts, ends, out, backend)


@registered_op_with_out("topk", fake=lambda logits, k, *args: _picks_shape(logits, k))
def _topk_op(
    logits: torch.Tensor, k: int, starts: torch.Tensor | None, ends: torch.Tensor | None, out: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """``topk`` with every argument given: its checks, then the backend's implementation."""
    check_tensor("logits", logits, dtype=LOGITS_DTYPES, ndim=2)
    check_k("k", k)
    num_rows, width = logits.shape
    if starts is not None:
        check_index_tensor("starts", starts, shape=(num_rows,))
    if ends is not None:
        check_index_tensor("ends", ends, shape=(num_rows,))
    check_same_device(logits=logits, starts=starts, ends=ends, out=out)
    _check_out(out, num_rows, k, logits.device)
    if (starts is not None or ends is not None) and value_checks_enabled():
        check_row_windows(starts, ends, width)
    # The window check bounds every entry by the width, so the conversion needs no range check.
    starts = None if starts is None else index_as_int32("starts", starts, check_range=False)
    ends = None if ends is None else index_as_int32("ends", ends, check_range=False)
    implementation = _backend.dispatch(reference.topk, _triton_or_none(_topk_triton), backend, logits.device)
    if out is None:
        out = torch.empty((num_rows, k), dtype=torch.int32, device=logits.device)
    return implementation(logits, k, starts, ends, out)


def topk_decode(
    logits: torch.Tensor,
    seq_lens: torch.Tensor,
    next_n: int,
    k: int,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Top-k of decode rows; returns int32 ``[B * next_n, k]`` of request-local positions.

    Args:
        logits: float32 or bfloat16 ``[B * next_n, C]``, any strides; row ``b * next_n + t`` is token ``t`` of
            request ``b``.
        seq_lens: int32 or int64 ``[B]`` request lengths ``L_b`` (row ``t`` sees
            ``max(L_b - next_n + t + 1, 0)`` columns) or ``[B, next_n]`` per-row lengths; every length
            in ``[0, C]``.
        next_n: query tokens per request, ``>= 1``.
        k: picks per row, ``1 <= k <= 2**31 - 1``.
        out: int32 ``[B * next_n, k]`` destination, fully written.

    Same selection rule as ``topk`` with ``starts = 0`` and ``ends`` the row's visible length.
    """
    return _topk_decode_op(logits, seq_lens, next_n, k, out, backend)


@registered_op_with_out("topk_decode", fake=lambda logits, seq_lens, next_n, k, backend: _picks_shape(logits, k))
def _topk_decode_op(
    logits: torch.Tensor, seq_lens: torch.Tensor, next_n: int, k: int, out: torch.Tensor | None, backend: str
) -> torch.Tensor:
    """``topk_decode`` with every argument given: its checks, then the backend's implementation."""
    seq_lens = _check_decode_rows(logits, seq_lens, next_n, k, out)
    implementation = _backend.dispatch(
        reference.topk_decode, _triton_or_none(_topk_decode_triton), backend, logits.device
    )
    if out is None:
        out = torch.empty((logits.shape[0], k), dtype=torch.int32, device=logits.device)
    return implementation(logits, seq_lens, next_n, k, out)


def indices_to_slots(
    indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    row_to_request: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Physical cache slots of request-local positions; returns int32 ``[R, k]``.

    Args:
        indices: int32 or int64 ``[R, k]`` request-local positions, or ``-1`` (padding, kept as ``-1``).
        block_table: int32 or int64 ``[B, max_blocks]``; page ``j`` of request ``b`` is
            ``block_table[b, j]``; every page's slots within the int32 range
            (``page * block_size + block_size - 1 <= 2**31 - 1``).
        block_size: tokens per page, ``1 <= block_size <= 2**31 - 1``.
        row_to_request: int32 or int64 ``[R]`` request of each row, in ``[0, B)``.

    Slot of position ``p`` in row ``r``: ``block_table[row_to_request[r], p // block_size] *
    block_size + p % block_size``. Positions whose page index reaches ``max_blocks`` and pages whose
    slots leave the int32 range are rejected (one host read). Every output is ``-1`` or a slot in
    ``[0, 2**31)``: a position on a negative (unallocated) page id gives ``-1``. That the non-negative page
    ids lie within the cache is the caller's duty (the op does not know the cache). With value checks off,
    positions past the table, requests outside it and slots past int32 give ``-1`` too, and no kernel reads
    outside the table.
    """
    return _indices_to_slots_op(indices, block_table, block_size, row_to_request, backend)


@registered_op("indices_to_slots", fake=lambda indices, *args: torch.empty_like(indices, dtype=torch.int32))
def _indices_to_slots_op(
    indices: torch.Tensor, block_table: torch.Tensor, block_size: int, row_to_request: torch.Tensor, backend: str
) -> torch.Tensor:
    return _indices_to_slots(indices, block_table, block_size, row_to_request, backend)


def _indices_to_slots(indices, block_table, block_size, row_to_request, backend):
    """``indices_to_slots`` with every argument given: its checks, then the backend's implementation."""
    check_index_tensor("indices", indices, ndim=2)
    check_index_tensor("block_table", block_table, ndim=2)
    check_index_size("block_size", block_size, minimum=1)
    num_rows = indices.shape[0]
    num_requests, max_blocks = block_table.shape
    check_index_tensor("row_to_request", row_to_request, shape=(num_rows,))
    check_same_device(indices=indices, block_table=block_table, row_to_request=row_to_request)
    # int64 because max_blocks * block_size may exceed the int32 range; positions are int32.
    num_positions = min(max_blocks * block_size, INT32_MAX + 1)
    bad_index = (indices < -1) | (indices.to(torch.int64) >= num_positions)
    bad_request = (row_to_request < 0) | (row_to_request >= num_requests)
    bad_page = _slots_past_int32(block_table, block_size)
    if value_checks_enabled() and bool(bad_index.any() | bad_request.any() | bad_page.any()):
        _raise_for_pages(block_table, bad_page, block_size)
        if bool(bad_request.any()):
            row = first_true(bad_request)
            raise ValueError(
                f"row_to_request must lie in [0, {num_requests}) (rows of block_table), "
                f"got row_to_request[{row}] = {int(row_to_request[row])}"
            )
        row, column = (int(i) for i in torch.nonzero(bad_index)[0])
        raise ValueError(
            f"indices must be -1 or positions in [0, min(max_blocks * block_size, 2**31) = {num_positions}), "
            f"got indices[{row}, {column}] = {int(indices[row, column])}"
        )
    indices = index_as_int32("indices", indices, check_range=False)
    row_to_request = index_as_int32("row_to_request", row_to_request, check_range=False)
    block_table = index_as_int32("block_table", block_table)
    implementation = _backend.dispatch(
        reference.indices_to_slots, _triton_or_none(_indices_to_slots_triton), backend, indices.device
    )
    return implementation(indices, block_table, block_size, row_to_request)


def topk_decode_slots(
    logits: torch.Tensor,
    seq_lens: torch.Tensor,
    next_n: int,
    k: int,
    block_table: torch.Tensor,
    block_size: int,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``topk_decode`` that writes physical cache slots instead of positions (for sparse attention).

    Args:
        logits, seq_lens, next_n, k, out: as in ``topk_decode`` (``out``: int32 ``[B * next_n, k]``).
        block_table: int32 or int64 ``[B, max_blocks]``; position ``p`` of request ``b`` lives in page
            ``block_table[b, p // block_size]``; every page's slots within the int32 range (as for
            ``indices_to_slots``). Every visible length must be ``<= max_blocks * block_size``.
        block_size: tokens per page, ``1 <= block_size <= 2**31 - 1``.

    Returns int32 ``[B * next_n, k]``: ``indices_to_slots(topk_decode(...), block_table, block_size,
    row // next_n)`` bit for bit (``-1`` padding kept; a pick on a negative page id gives ``-1``),
    computed in the top-k launch on GPUs. With value checks off a length past the logits width counts
    as the width, and a pick past the table gives ``-1``.
    """
    return _topk_decode_slots_op(logits, seq_lens, next_n, k, block_table, block_size, out, backend)


@registered_op_with_out("topk_decode_slots", fake=lambda logits, seq_lens, next_n, k, *args: _picks_shape(logits, k))
def _topk_decode_slots_op(
    logits: torch.Tensor, seq_lens: torch.Tensor, next_n: int, k: int, block_table: torch.Tensor, block_size: int,
    out: torch.Tensor | None, backend: str,
) -> torch.Tensor:
    """``topk_decode_slots`` with every argument given: its checks, then the backend's implementation."""
    seq_lens = _check_decode_rows(logits, seq_lens, next_n, k, out)
    check_index_tensor("block_table", block_table, ndim=2)
    check_index_size("block_size", block_size, minimum=1)
    num_requests, max_blocks = block_table.shape
    if num_requests != seq_lens.shape[0]:
        raise ValueError(f"block_table must have B = {seq_lens.shape[0]} rows (B from seq_lens), got {num_requests}")
    check_same_device(logits=logits, block_table=block_table)
    if value_checks_enabled():
        visible = reference.decode_row_ends(seq_lens, next_n)
        too_long = visible.to(torch.int64) > max_blocks * block_size
        bad_page = _slots_past_int32(block_table, block_size)
        if bool(too_long.any() | bad_page.any()):
            _raise_for_pages(block_table, bad_page, block_size)
            row = first_true(too_long)
            raise ValueError(
                f"block_table holds max_blocks * block_size = {max_blocks * block_size} positions, but row {row} "
                f"sees {int(visible[row])}"
            )
    block_table = index_as_int32("block_table", block_table)
    implementation = _backend.dispatch(
        reference.topk_decode_slots, _triton_or_none(_topk_decode_slots_triton), backend, logits.device
    )
    if out is None:
        out = torch.empty((logits.shape[0], k), dtype=torch.int32, device=logits.device)
    return implementation(logits, seq_lens, next_n, k, block_table, block_size, out)
