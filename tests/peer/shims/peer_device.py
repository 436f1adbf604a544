"""pytest plugin: with ``PEER_DEVICE=cpu`` the upstream tests' ``"cuda"`` tensors are made on the CPU.

A torch function mode rewrites ``device=`` arguments, ``Tensor.cuda()`` and ``Tensor.to("cuda")``;
``torch.set_default_device`` is redirected to the CPU, and ``torch.cuda.is_available`` (True),
synchronisation and the memory statistics (no-ops, zeros) are stubbed for the session. With ``PEER_DEVICE=cuda`` nothing is changed.
"""

import os

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _cpu(value):
    return torch.device("cpu") if _is_cuda(value) else value


class _CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_cpu(a) for a in args)
        return func(*args, **kwargs)


_mode = _CudaOnCpu()


def pytest_configure(config):
    if os.environ.get("PEER_DEVICE", "cpu") != "cpu":
        return
    real_set_default_device = torch.set_default_device
    torch.set_default_device = lambda device: real_set_default_device(_cpu(device))
    torch.accelerator.synchronize = lambda *args, **kwargs: None
    torch.cuda.is_available = lambda: True
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.reset_peak_memory_stats = lambda *args, **kwargs: None
    torch.cuda.max_memory_allocated = lambda *args, **kwargs: 0
    torch.cuda.max_memory_reserved = lambda *args, **kwargs: 0
    _mode.__enter__()


def pytest_unconfigure(config):
    if os.environ.get("PEER_DEVICE", "cpu") == "cpu":
        _mode.__exit__(None, None, None)
