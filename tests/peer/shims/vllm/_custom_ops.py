"""vLLM's indexer custom ops, served by ``dsa_indexer.compat.vllm_ops``."""

from dsa_indexer.compat.vllm_ops import (  # noqa: F401
    cp_gather_indexer_k_quant_cache,
    indexer_k_quant_and_cache,
    top_k_per_row_decode,
    top_k_per_row_prefill,
)
