"""``current_platform``: the real CUDA device, or (``PEER_DEVICE=cpu``) an SM90 stand-in whose
"cuda" tensors live on the CPU."""

import os

import torch


class _Platform:
    def _on_cpu(self) -> bool:
        return os.environ.get("PEER_DEVICE", "cpu") == "cpu"

    def is_cuda(self) -> bool:
        return self._on_cpu() or torch.cuda.is_available()

    def is_cuda_alike(self) -> bool:
        return self.is_cuda()

    def is_rocm(self) -> bool:
        return False

    def get_device_capability(self) -> tuple[int, int]:
        if self._on_cpu():
            return (9, 0)
        return torch.cuda.get_device_capability()

    def _capability(self) -> int:
        major, minor = self.get_device_capability()
        return major * 10 + minor

    def has_device_capability(self, capability) -> bool:
        if isinstance(capability, tuple):
            capability = capability[0] * 10 + capability[1]
        return self.is_cuda() and self._capability() >= capability

    def is_device_capability_family(self, capability: int) -> bool:
        return self.is_cuda() and self._capability() // 10 == capability // 10


current_platform = _Platform()
