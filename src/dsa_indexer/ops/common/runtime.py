"""Host-side facts launch planning needs: the interpreter switch, the SM count, the device's capability.

Nothing here initialises CUDA at import; the per-device answers are cached on first use.
"""

from __future__ import annotations

import functools
import os

import torch

# The SM count launch planning assumes for tensors on the CPU (Triton's interpreter): an H100's / H200's 132,
# so interpreter runs plan the same grids as the GPUs the kernels are tuned for.
INTERPRETER_SMS = 132


def interpreting() -> bool:
    """Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def device_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device when it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _multiprocessors_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def sm_count(device: torch.device) -> int:
    """SMs of ``device``: the CUDA device's count, ``INTERPRETER_SMS`` for any other device."""
    return _multiprocessors_of(device_index(device)) if device.type == "cuda" else INTERPRETER_SMS


def capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` compute capability of the CUDA ``device``."""
    return _capability_of(device_index(device))


def next_pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two ``>= max(n, minimum)`` (1 for ``n <= 1``)."""
    return max(minimum, 1 << max(0, (int(n) - 1).bit_length()))
