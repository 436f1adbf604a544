"""dsa-indexer: the lightning indexer of DeepSeek Sparse Attention.

Every op has a pure-PyTorch reference (any device) and, where it pays, a Triton kernel; the contract
they share is ``docs/contract.md``. Each public op is also ``torch.ops.dsa_indexer.<name>``, registered
where it is defined, so ``torch.compile`` traces calls to it without graph breaks.
"""

__version__ = "0.1.0"

from .cache import IndexerKCache
from .formats import dequantize_fp8, dequantize_mxfp4, quantize_fp8, quantize_mxfp4
from .indexer import Indexer, IndexerConfig
from .layer import SparseAttnIndexer, StageTimer
from .metadata import IndexerMetadata, MetadataBuilder, build_metadata
from .ops.candidates import apply_candidate_mask, select_candidate_blocks
from .ops.logits import mqa_logits, paged_mqa_logits
from .ops.q_quant import rope_quant_q
from .ops.seq_pack import pack_seq, unpack_seq
from .ops.sparse_logits import sparse_mqa_logits, sparse_paged_mqa_logits, topk_sparse
from .ops.topk import indices_to_slots, topk, topk_decode, topk_decode_slots

__all__ = [
    "Indexer",
    "IndexerConfig",
    "IndexerKCache",
    "IndexerMetadata",
    "MetadataBuilder",
    "SparseAttnIndexer",
    "StageTimer",
    "apply_candidate_mask",
    "build_metadata",
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
    "sparse_mqa_logits",
    "sparse_paged_mqa_logits",
    "topk",
    "topk_decode",
    "topk_decode_slots",
    "topk_sparse",
    "unpack_seq",
]
