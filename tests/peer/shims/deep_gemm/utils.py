"""The quantisation helpers of ``deep_gemm.utils`` that the indexer tests call (FP8), written for the shim.

The FP4 helpers (SM100 cases only) and anything else import as placeholders that raise when called.
"""

import torch


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def per_custom_dims_cast_to_fp8(x: torch.Tensor, dims: tuple, use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with one scale per index of ``dims`` (the amax over the other dims / 448, floored at 1e-4,
    optionally rounded up to a power of two); returns ``(values, scales squeezed)``."""
    reduced = tuple(d for d in range(x.dim()) if d not in dims)
    scale = x.abs().float().amax(dim=reduced, keepdim=True).clamp(min=1e-4) / 448.0
    if use_ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return (x * (1.0 / scale)).to(torch.float8_e4m3fn), scale.squeeze()


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def placeholder(*args, **kwargs):
        raise NotImplementedError(f"deep_gemm.utils.{name} is not shimmed (SM100 FP4 helpers are not)")

    return placeholder
