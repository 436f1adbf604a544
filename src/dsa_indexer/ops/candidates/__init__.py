"""V4.1 two-level candidates (DESIGN §9): a source layer picks the best blocks of each row, the
consumer layers mask their logits to those blocks before their own top-k.

Bounds: row ``r`` uses ``starts[r // row_repeat]`` and ``ends[r // row_repeat]`` (``row_repeat``
lets the ``next_n`` rows of a decode request share one entry), with ``0 <= starts <= ends <= C``.
Checking those values costs one vectorised reduction and one host synchronisation; callers that
capture CUDA graphs validate once outside the graph.
"""

from __future__ import annotations

import torch

from ... import backend as _backend
from ..._validation import (
    check_index_tensor,
    check_k,
    check_positive_int,
    check_row_windows,
    check_same_device,
    check_tensor,
    index_as_int32,
    value_checks_enabled,
)
from ..common.registration import registered_op, registered_op_with_out
from .reference import apply_candidate_mask_reference, select_candidate_blocks_reference

__all__ = ["apply_candidate_mask", "select_candidate_blocks"]


def _select_candidate_blocks_triton(*args, **kwargs):
    from .triton import select_candidate_blocks_triton

    return select_candidate_blocks_triton(*args, **kwargs)


def _apply_candidate_mask_triton(*args, **kwargs):
    from .triton import apply_candidate_mask_triton

    return apply_candidate_mask_triton(*args, **kwargs)


def _check_bound(name: str, bounds, num_rows: int, row_repeat: int) -> None:
    check_index_tensor(name, bounds, ndim=1)
    needed = -(-num_rows // row_repeat)
    if bounds.shape[0] < needed:
        raise ValueError(
            f"{name} must have at least ceil(R / row_repeat) = {needed} entries for R = {num_rows} rows "
            f"and row_repeat = {row_repeat}, got {bounds.shape[0]}"
        )


def _check_bounds(starts, ends, num_rows: int, row_repeat: int) -> None:
    if starts is not None:
        _check_bound("starts", starts, num_rows, row_repeat)
    _check_bound("ends", ends, num_rows, row_repeat)


def _check_used_windows(starts, ends, num_rows: int, row_repeat: int, width: int) -> None:
    """``0 <= starts <= ends <= width`` on the entries that rows use (one host synchronisation)."""
    used = -(-num_rows // row_repeat)
    check_row_windows(None if starts is None else starts[:used], ends[:used], width)


def _bounds_as_int32(starts, ends) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Bounds as int32; the window check bounded every entry a row reads (unused ones are never read)."""
    starts = None if starts is None else index_as_int32("starts", starts, check_range=False)
    return starts, index_as_int32("ends", ends, check_range=False)


def select_candidate_blocks(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    num_blocks_k: int,
    block_size: int,
    *,
    row_repeat: int = 1,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Choose the ``num_blocks_k`` best blocks of every row.

    Args:
        logits: ``[R, C]`` float32, any strides. Columns outside ``[starts, ends)`` are never used
            (they may hold garbage or NaN).
        starts: ``[R']`` int32 or int64 first column of each row's context, or None for 0.
        ends: ``[R']`` int32 or int64 end column (exclusive); ``R' >= ceil(R / row_repeat)`` and
            ``0 <= starts <= ends <= C`` on the entries rows use (checked; ``starts == ends`` is a
            row without context).
        num_blocks_k: blocks to keep per row, ``1 <= num_blocks_k <= 2**31 - 1``.
        block_size: positions per block (>= 1); block ``b`` is ``[starts + b * bs, starts + (b+1) * bs)``
            clipped to ``ends``.
        row_repeat: rows sharing one bounds entry (>= 1).
        out: optional int32 ``[R, num_blocks_k]`` destination.
        backend: ``"auto" | "reference" | "triton"``.

    Returns:
        int32 ``[R, num_blocks_k]``: block ids in ``[0, ceil((ends - starts) / bs))``, ascending, then
        ``-1``. Block score = max of its selectable logits (not NaN, not ``-inf``); the newest block
        ``(ends - starts - 1) // bs`` is pinned to ``+inf`` (always chosen when ``ends > starts``);
        the top blocks by (score descending, block id ascending) among those scoring above ``-inf``
        are chosen. A row with no context is all ``-1``.
    """
    args = (logits, starts, ends, num_blocks_k, block_size, row_repeat)
    return _select_candidate_blocks_op(*args, out, backend)


@registered_op_with_out(
    "select_candidate_blocks",
    fake=lambda logits, starts, ends, num_blocks_k, *args: logits.new_empty(
        (logits.shape[0], num_blocks_k), dtype=torch.int32
    ),
)
def _select_candidate_blocks_op(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    num_blocks_k: int,
    block_size: int,
    row_repeat: int,
    out: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """``select_candidate_blocks`` with every argument given: its checks, then the backend's implementation."""
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    check_k("num_blocks_k", num_blocks_k)
    check_positive_int("block_size", block_size)
    check_positive_int("row_repeat", row_repeat)
    _check_bounds(starts, ends, logits.shape[0], row_repeat)
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, shape=(logits.shape[0], num_blocks_k))
    check_same_device(logits=logits, starts=starts, ends=ends, out=out)
    if value_checks_enabled():
        _check_used_windows(starts, ends, logits.shape[0], row_repeat, logits.shape[1])
    starts, ends = _bounds_as_int32(starts, ends)
    impl = _backend.dispatch(
        select_candidate_blocks_reference,
        _select_candidate_blocks_triton if _backend.triton_available() else None,
        backend,
        logits.device,
    )
    return impl(logits, starts, ends, num_blocks_k, block_size, row_repeat, out)


def apply_candidate_mask(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    candidate_blocks: torch.Tensor,
    block_size: int,
    *,
    row_repeat: int = 1,
    backend: str = "auto",
) -> None:
    """In place, keep only the logits of each row's candidate blocks inside its bounds.

    Args:
        logits: ``[R, C]`` float32, any strides; modified in place.
        starts, ends, block_size, row_repeat: as for ``select_candidate_blocks``.
        candidate_blocks: ``[R, K]`` int32 or int64 block ids (any order), within the int32 range. ``-1`` (any negative id) is
            padding; an id at or past the row's block count ``ceil((ends - starts) / bs)`` names no
            column of the row and is ignored.
        backend: ``"auto" | "reference" | "triton"``.

    Every column outside ``[starts, ends)`` or outside the listed blocks becomes ``-inf``; the
    others are untouched. The mask therefore also cleans the logits outside the row bounds.
    """
    _apply_candidate_mask_op(logits, starts, ends, candidate_blocks, block_size, row_repeat, backend)


@registered_op("apply_candidate_mask", mutates_args=("logits",))
def _apply_candidate_mask_op(
    logits: torch.Tensor,
    starts: torch.Tensor | None,
    ends: torch.Tensor,
    candidate_blocks: torch.Tensor,
    block_size: int,
    row_repeat: int,
    backend: str,
) -> None:
    _apply_candidate_mask(logits, starts, ends, candidate_blocks, block_size, row_repeat, backend)


def _apply_candidate_mask(logits, starts, ends, candidate_blocks, block_size, row_repeat, backend):
    """``apply_candidate_mask`` with every argument given: its checks, then the backend's implementation."""
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    check_positive_int("block_size", block_size)
    check_positive_int("row_repeat", row_repeat)
    _check_bounds(starts, ends, logits.shape[0], row_repeat)
    check_index_tensor("candidate_blocks", candidate_blocks, shape=(logits.shape[0], None))
    check_same_device(logits=logits, starts=starts, ends=ends, candidate_blocks=candidate_blocks)
    if value_checks_enabled():
        _check_used_windows(starts, ends, logits.shape[0], row_repeat, logits.shape[1])
    starts, ends = _bounds_as_int32(starts, ends)
    candidate_blocks = index_as_int32("candidate_blocks", candidate_blocks)
    impl = _backend.dispatch(
        apply_candidate_mask_reference,
        _apply_candidate_mask_triton if _backend.triton_available() else None,
        backend,
        logits.device,
    )
    impl(logits, starts, ends, candidate_blocks, block_size, row_repeat)
