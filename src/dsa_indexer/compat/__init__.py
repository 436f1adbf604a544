"""Drop-in surfaces with the argument lists engines already call: ``deep_gemm`` and ``vllm_ops``."""
