"""vLLM's DeepGEMM wrappers for the indexer, over ``dsa_indexer.compat.deep_gemm``.

The argument lists are vLLM 0.34's: ``fp8_fp4_mqa_logits`` passes ``max_seqlen_k`` as the sixth
positional argument (the DeepGEMM 2.8 order), the paged call takes ``indices=`` varlen rows, and the
metadata is sized for ``num_sms // 2`` slots at next_n 4 on SM90, as vLLM sizes it.
"""

import os

import torch

from dsa_indexer.compat import deep_gemm
from vllm.platforms import current_platform


def get_num_sms() -> int:
    if os.environ.get("PEER_DEVICE", "cpu") == "cpu":
        return 132
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """The power of two at or above ``|x|``."""
    return torch.exp2(torch.ceil(torch.log2(x.abs())))


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``1 - 2<x, y> / (|x|^2 + |y|^2)`` in float64: 0 for equal tensors."""
    x, y = x.double(), y.double()
    return 1 - 2 * (x * y).sum() / (x * x + y * y).sum()


def mqa_logits_use_mx_scales() -> bool:
    """Our ops read FP8 K caches with fp32 scale words on every GPU: no MX-scaled inputs needed."""
    return False


def mqa_logits_mx_inputs(q, q_scale, weights, logits_dtype):
    return q_scale, weights


def native_next_n_supported(next_n: int) -> bool:
    """The paged logits take any next_n."""
    return next_n >= 1


def fp8_fp4_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k, logits_dtype=torch.float32):
    return deep_gemm.fp8_fp4_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k, logits_dtype=logits_dtype)


def get_paged_mqa_logits_metadata(context_lens, block_size, num_sms, indices=None):
    next_n = context_lens.shape[1] if context_lens.dim() == 2 else 1
    slots = num_sms // 2 if next_n == 4 and current_platform.is_device_capability_family(90) else num_sms
    return deep_gemm.get_paged_mqa_logits_metadata(context_lens, block_size, slots, indices=indices)


def fp8_fp4_paged_mqa_logits(
    q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len,
    logits_dtype=torch.float32, indices=None,
):
    return deep_gemm.fp8_fp4_paged_mqa_logits(
        q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len,
        logits_dtype=logits_dtype, indices=indices,
    )
