"""The helpers of DeepGEMM's test files that the indexer tests call, written for the shim."""

import os
import time

import torch


def get_arch_major() -> int:
    """``PEER_ARCH`` when set (10 enumerates the SM100 case lists: FP4, varlen rows, 8 and 16 heads, bf16
    weights); else 9 (Hopper) on the CPU stand-in and the GPU's major compute capability on a GPU."""
    if os.environ.get("PEER_ARCH"):
        return int(os.environ["PEER_ARCH"])
    if os.environ.get("PEER_DEVICE", "cpu") == "cpu":
        return 9
    return torch.cuda.get_device_capability()[0]


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``1 - 2<x, y> / (|x|^2 + |y|^2)`` in float64: 0 for equal tensors."""
    x, y = x.double(), y.double()
    return 1 - 2 * (x * y).sum() / (x * x + y * y).sum()


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    assert torch.equal(a.contiguous().view(bits), b.contiguous().view(bits)), f"{what}: not bitwise equal"


def count_bytes(*tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        elif isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def bench_kineto(fn, kernel_names, num_tests: int = 3, suppress_kineto_output: bool = False, **kwargs):
    """Mean wall time of ``fn`` per call (synchronised), reported for every kernel name asked for."""
    synchronize = torch.cuda.synchronize if os.environ.get("PEER_DEVICE", "cpu") != "cpu" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    for _ in range(num_tests):
        fn()
    synchronize()
    seconds = (time.perf_counter() - start) / num_tests
    return tuple(seconds for _ in kernel_names) if isinstance(kernel_names, tuple) else seconds


def ignore_env(*args, **kwargs):
    return False


def test_filter(*args, **kwargs):
    return True
