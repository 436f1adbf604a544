"""dsa-indexer: the lightning indexer of DeepSeek Sparse Attention.

Every op has a pure-PyTorch reference (any device) and, where it pays, a Triton kernel; the contract
they share is ``docs/contract.md``.
"""

__version__ = "0.1.0"

from .cache import IndexerKCache
from .formats import dequantize_fp8, dequantize_mxfp4, quantize_fp8, quantize_mxfp4

__all__ = [
    "IndexerKCache",
    "apply_candidate_mask",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "indices_to_slots",
    "mqa_logits",
    "pack_seq",
    "paged_mqa_logits",
    "quantize_fp8",
    "quantize_mxfp4",
    "rope_quant_q",
    "select_candidate_blocks",
    "topk",
    "topk_decode",
    "unpack_seq",
]
