"""Shared fixtures: where Triton kernels run in this session, and output poisoning.

Kernel tests take the ``kernel_device`` fixture: ``cuda`` on a GPU machine (``scripts/gpu-check``),
``cpu`` under ``TRITON_INTERPRET=1`` (what ``make test`` sets for CI). Shapes for the interpreter stay
tiny; tests marked ``gpu`` use realistic sizes and only run on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from dsa_indexer import backend
from dsa_indexer.ops.common.runtime import interpreting


def _kernel_device() -> str | None:
    if not backend.triton_available():
        return None
    if interpreting():
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


KERNEL_DEVICE = _kernel_device()
ON_GPU = KERNEL_DEVICE == "cuda"


@pytest.fixture
def kernel_device() -> str:
    if KERNEL_DEVICE is None:
        pytest.skip("Triton kernels need a CUDA device or TRITON_INTERPRET=1 (make test sets it)")
    return KERNEL_DEVICE


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu-check on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip_gpu)


@pytest.fixture
def without_interpreter(monkeypatch):
    """Backend choice as on a machine without ``TRITON_INTERPRET`` (for checks that ``backend='triton'``
    on CPU tensors is refused; under the interpreter that call legitimately runs the kernel)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
