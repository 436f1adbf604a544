"""The one place where an op's implementation is chosen.

``backend="auto"`` picks Triton for CUDA tensors when Triton is importable and the op has a Triton
kernel, and the PyTorch reference otherwise. The ``DSA_INDEXER_BACKEND`` environment variable
(``auto`` | ``reference`` | ``triton``) only changes what ``"auto"`` means: an explicit ``backend=`` wins.
Nothing here touches CUDA at import.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

from .ops.common.runtime import interpreting

BACKENDS = ("auto", "reference", "triton")
ENV_VAR = "DSA_INDEXER_BACKEND"


def triton_available() -> bool:
    """Triton can be imported (it may still lack a GPU driver: see ``ops.common.runtime.interpreting``)."""
    return importlib.util.find_spec("triton") is not None


def requested_backend(backend: str) -> str:
    """``backend``, or for ``"auto"`` the value of ``DSA_INDEXER_BACKEND`` when set."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    default = os.environ.get(ENV_VAR) or "auto"
    if default not in BACKENDS:
        raise ValueError(f"environment variable {ENV_VAR} must be one of {BACKENDS}, got {default!r}")
    return default


def resolve(backend: str, device: torch.device, has_triton_kernel: bool) -> str:
    """``"reference"`` or ``"triton"`` for an op whose tensors live on ``device``."""
    chosen = requested_backend(backend)
    if chosen == "reference":
        return "reference"
    triton_runnable = has_triton_kernel and triton_available() and (device.type == "cuda" or interpreting())
    if chosen == "triton":
        if not triton_runnable:
            raise ValueError(
                "backend='triton' needs Triton installed, a kernel for this op, and CUDA tensors "
                f"(or TRITON_INTERPRET=1); got device {device}, triton installed={triton_available()}, "
                f"kernel available={has_triton_kernel}"
            )
        return "triton"
    return "triton" if triton_runnable and device.type == "cuda" else "reference"


def dispatch(reference: Callable, triton_impl: Callable | None, backend: str, device: torch.device) -> Callable:
    """The implementation to call for ``backend`` on ``device``."""
    if resolve(backend, device, triton_impl is not None) == "triton":
        return triton_impl
    return reference
