"""Argument checks shared by every public entry point.

Each check raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, device, range)
with a message that names the argument, what was expected and what was received. Checks run before
any output is written.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
from collections.abc import Sequence

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def _dtype_names(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    value,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | Sequence[int] | None = None,
    min_ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that ``value`` is a tensor with the given dtype(s), rank(s), shape and device.

    ``shape`` entries that are ``None`` are not checked.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if value.dtype not in allowed:
            raise TypeError(f"{name} must have dtype {_dtype_names(allowed)}, got {_dtype_names([value.dtype])}")
    if ndim is not None:
        allowed_ndim = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed_ndim:
            raise ValueError(
                f"{name} must have {' or '.join(map(str, allowed_ndim))} dimensions, got shape {tuple(value.shape)}"
            )
    if min_ndim is not None and value.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {tuple(value.shape)}")
    if shape is not None:
        if value.dim() != len(shape) or any(e is not None and e != s for e, s in zip(shape, value.shape)):
            expected = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
            raise ValueError(f"{name} must have shape {expected}, got {list(value.shape)}")
    if device is not None and value.device != torch.device(device):
        raise ValueError(f"{name} must be on device {device}, got {value.device}")
    return value


def check_floating(name: str, value: torch.Tensor) -> None:
    if not value.is_floating_point() or value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{name} must be a float16, bfloat16 or float32 tensor, got {value.dtype}")


def check_last_dim_multiple(name: str, value: torch.Tensor, multiple: int, what: str) -> None:
    if multiple < 1:
        raise ValueError(f"block size must be >= 1, got {multiple}")
    if value.shape[-1] % multiple != 0:
        raise ValueError(f"{name}'s last dimension must be a multiple of {what}, got {value.shape[-1]}")


def check_positive_int(name: str, value, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_positive_finite(name: str, value) -> float:
    """A real number (not bool) that is finite and ``> 0``; returned as a Python float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    return float(value)


def check_index_size(name: str, value, *, minimum: int = 0) -> int:
    """A size along an indexed dimension (an output width, a padded length): an int in
    ``[minimum, 2**31 - 1]``. Positions are int32, so a larger size could never be indexed, and its
    allocation alone would fail."""
    check_positive_int(name, value, minimum=minimum)
    if value > torch.iinfo(torch.int32).max:
        raise ValueError(f"{name} must be <= 2**31 - 1 (positions are int32), got {value}")
    return value


def check_k(name: str, value) -> int:
    """A per-row pick count: ``1 <= value <= 2**31 - 1`` (``check_index_size``)."""
    return check_index_size(name, value, minimum=1)


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """All non-None tensors live on one device."""
    named = [(n, t) for n, t in tensors.items() if t is not None]
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not named:
        return
    first_name, first = named[0]
    for name, tensor in named[1:]:
        if tensor.device != first.device:
            raise ValueError(f"{name} is on {tensor.device} but {first_name} is on {first.device}")


def check_index_tensor(name: str, value, *, ndim: int | Sequence[int] | None = None, shape=None) -> torch.Tensor:
    return check_tensor(name, value, dtype=INDEX_DTYPES, ndim=ndim, shape=shape)


INT32_MIN, INT32_MAX = torch.iinfo(torch.int32).min, torch.iinfo(torch.int32).max


def index_as_int32(name: str, value: torch.Tensor, *, check_range: bool = True) -> torch.Tensor:
    """An index tensor already checked by ``check_index_tensor`` as int32 (int64 is copied once).

    With ``check_range`` and value checks enabled, an int64 value outside the int32 range is rejected
    first (one host synchronisation, int64 input only). Callers whose own value checks already bound
    every entry that is read pass ``check_range=False``.
    """
    if value.dtype == torch.int32:
        return value
    if check_range and value.numel() and value_checks_enabled():
        low, high = torch.stack((value.min(), value.max())).tolist()
        if low < INT32_MIN or high > INT32_MAX:
            bad = low if low < INT32_MIN else high
            raise ValueError(f"{name} must hold values in the int32 range [-2**31, 2**31 - 1], got {bad}")
    return value.to(torch.int32)


SKIP_VALUE_CHECKS_ENV = "DSA_INDEXER_SKIP_VALUE_CHECKS"
_checked_by_caller = 0


def capturing_graph() -> bool:
    """Whether the current CUDA stream is capturing a graph (no host read of device values may run)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def value_checks_enabled() -> bool:
    """Whether the checks that read device tensors' values on the host may run.

    They are skipped while a CUDA graph is being captured (a host read would break the capture), when
    ``DSA_INDEXER_SKIP_VALUE_CHECKS=1`` (engines that validate their metadata themselves) and inside
    ``checked_by_caller`` (the layer checked its step). The checks of types, dtypes, shapes and devices
    always run. Skipping a check never changes a result or its shape: invalid values then give the
    documented fallbacks (``-1``, zero bytes) instead of an error.
    """
    if _checked_by_caller or os.environ.get(SKIP_VALUE_CHECKS_ENV, "0") == "1":
        return False
    return not capturing_graph()


@contextlib.contextmanager
def checked_by_caller():
    """Within it, ops skip their value checks: the caller (the layer) has checked the whole step once."""
    global _checked_by_caller
    _checked_by_caller += 1
    try:
        yield
    finally:
        _checked_by_caller -= 1


def first_true(mask: torch.Tensor) -> int:
    """Index of the first True entry of a 1-D mask known to hold one (error paths only)."""
    return int(torch.nonzero(mask)[0, 0])


def check_row_windows(
    starts: torch.Tensor | None,
    ends: torch.Tensor | None,
    limit: int,
    *,
    names: tuple[str, str] = ("starts", "ends"),
    limit_name: str = "the logits width",
) -> None:
    """``0 <= starts <= ends <= limit`` entry by entry (None: ``0`` and ``limit``); one host
    synchronisation. ``names`` and ``limit_name`` are the caller's words for the error messages."""
    start_name, end_name = names
    lower = starts if starts is not None else torch.zeros_like(ends)
    upper = ends if ends is not None else torch.full_like(starts, limit)
    negative, crossed, too_long = lower < 0, lower > upper, upper > limit
    if not any(torch.stack((negative.any(), crossed.any(), too_long.any())).tolist()):
        return
    if bool(negative.any()):
        entry = first_true(negative)
        raise ValueError(f"{start_name} must be >= 0, got {start_name}[{entry}] = {int(lower[entry])}")
    if bool(too_long.any()):
        entry = first_true(too_long)
        raise ValueError(f"{end_name} must be <= {limit_name} {limit}, got {end_name}[{entry}] = {int(upper[entry])}")
    entry = first_true(crossed)
    defaults = f" (defaults: {start_name} 0, {end_name} {limit})" if starts is None or ends is None else ""
    raise ValueError(
        f"{start_name} must be <= {end_name}{defaults}, got {start_name}[{entry}] = {int(lower[entry])} > "
        f"{end_name}[{entry}] = {int(upper[entry])}"
    )
