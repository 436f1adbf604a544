"""Stand-in for the ``deep_gemm`` package: the indexer functions of ``dsa_indexer.compat.deep_gemm``.

Any other name imports as a placeholder that raises when called.
"""

import os

import torch

from dsa_indexer.compat.deep_gemm import (  # noqa: F401
    fp8_fp4_mqa_logits,
    fp8_fp4_paged_mqa_logits,
    get_paged_mqa_logits_metadata,
)


def get_num_sms() -> int:
    if os.environ.get("PEER_DEVICE", "cpu") == "cpu":
        return 132
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def placeholder(*args, **kwargs):
        raise NotImplementedError(f"deep_gemm.{name} is not shimmed (not part of the indexer API)")

    return placeholder
