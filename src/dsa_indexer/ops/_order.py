"""The total order every selection in the package uses (DESIGN.md §6).

Selectable entries (not NaN, not ``-inf``) are ranked by value descending, then column ascending;
``+0.0`` and ``-0.0`` are equal. The order is expressed as integers so that every backend can
reproduce it exactly: an order-preserving int32 key of the fp32 value, and an int64 composite key
that also breaks ties toward the lower column.
"""

from __future__ import annotations

import torch

UNSELECTABLE = torch.iinfo(torch.int64).min
_ID_SENTINEL = torch.iinfo(torch.int64).max


def selectable(values: torch.Tensor) -> torch.Tensor:
    """True where an fp32 value may be selected: not NaN and not ``-inf``."""
    return ~torch.isnan(values) & (values != float("-inf"))


def float_order_key(values: torch.Tensor) -> torch.Tensor:
    """int32 key with ``key(a) < key(b)`` iff ``a < b`` for non-NaN fp32 values (``-0.0 == +0.0``)."""
    bits = (values.float() + 0.0).view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def float_from_order_key(keys: torch.Tensor) -> torch.Tensor:
    """Inverse of ``float_order_key``."""
    keys = keys.to(torch.int32)
    return torch.where(keys < 0, keys ^ 0x7FFFFFFF, keys).view(torch.float32)


def composite_key(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """int64 key, larger = ranked earlier: value descending, then column ascending.

    ``columns`` must be in ``[0, 2**32)``; unselectable entries get ``UNSELECTABLE``.
    """
    key = (float_order_key(values).to(torch.int64) << 32) | (0xFFFFFFFF - columns.to(torch.int64))
    return torch.where(selectable(values), key, torch.full_like(key, UNSELECTABLE))


def top_ids_ascending(keys: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the ``k`` largest selectable ``keys`` of each row, ascending, then ``-1``.

    ``keys [R, M]`` are ``composite_key`` values (``UNSELECTABLE`` never chosen), unique among the
    selectable entries of a row; ``ids [R, M]`` int64 are what is reported. Returns int64 ``[R, k]``.
    """
    num_rows, num_entries = keys.shape
    chosen = torch.full((num_rows, k), -1, dtype=torch.int64, device=keys.device)
    taken = min(k, num_entries)
    if taken == 0:
        return chosen
    top_keys, top_positions = keys.topk(taken, dim=1)  # [R, taken]
    top_ids = ids.gather(1, top_positions)
    # Unselectable picks sort last as the sentinel, then become -1.
    top_ids = torch.where(top_keys != UNSELECTABLE, top_ids, _ID_SENTINEL).sort(dim=1).values
    chosen[:, :taken] = torch.where(top_ids == _ID_SENTINEL, -1, top_ids)
    return chosen
