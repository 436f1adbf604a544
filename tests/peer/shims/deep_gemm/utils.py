"""The quantisation helpers of ``deep_gemm.utils`` that the indexer tests call, written for the shim.

FP4 goes through dsa_indexer's own MXFP4 quantiser (docs/contract.md: ties to even, where DeepGEMM's
helper rounds them toward zero; the tests compare against the dequantised values either way). Any
other name imports as a placeholder that raises when called.
"""

import torch

from dsa_indexer.formats import MXFP4_BLOCK, dequantize_mxfp4, quantize_mxfp4


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


def per_token_cast_to_fp4(x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128, use_packed_ue8m0: bool = False):
    """MXFP4 ``x [m, n]`` -> ``(packed int8 [m, n/2], scale words int32 [m, words])``: the only form the
    indexer tests ask for (ue8m0 scales of 32-element blocks, packed four to an int32)."""
    if not (use_ue8m0 and use_packed_ue8m0 and gran_k == MXFP4_BLOCK):
        raise NotImplementedError("the shim makes only ue8m0 scales of 32-element blocks packed in int32 words")
    packed, scales = quantize_mxfp4(x)
    if scales.shape[-1] % 4:
        raise NotImplementedError(f"{scales.shape[-1]} scale bytes per row do not fill whole int32 words")
    return packed.view(torch.int8), scales.contiguous().view(torch.int32)


def cast_back_from_fp4(packed: torch.Tensor, sf: torch.Tensor, gran_k: int = 128, use_packed_ue8m0: bool = False):
    """The float32 values of ``per_token_cast_to_fp4``'s output."""
    if not (use_packed_ue8m0 and gran_k == MXFP4_BLOCK):
        raise NotImplementedError("the shim reads only ue8m0 scales of 32-element blocks packed in int32 words")
    return dequantize_mxfp4(packed.view(torch.uint8), sf.contiguous().view(torch.uint8).view(packed.shape[0], -1))


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def placeholder(*args, **kwargs):
        raise NotImplementedError(f"deep_gemm.utils.{name} is not shimmed (not used by the indexer tests)")

    return placeholder
