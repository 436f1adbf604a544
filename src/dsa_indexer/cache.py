"""``IndexerKCache``: the paged indexer K cache (layout in ``cache_layout``) with its insert and gather ops."""

from __future__ import annotations

import torch

from .cache_layout import (
    FORMATS,
    SCALE_FORMATS,
    KCacheLayout,
    bytes_per_token,
    scale_bytes_per_token,
    value_bytes_per_token,
)
from .ops.k_cache import gather_k, insert_k

__all__ = [
    "FORMATS",
    "SCALE_FORMATS",
    "IndexerKCache",
    "KCacheLayout",
    "bytes_per_token",
    "scale_bytes_per_token",
    "value_bytes_per_token",
]


class IndexerKCache(KCacheLayout):
    __doc__ = KCacheLayout.__doc__

    def insert(self, k: torch.Tensor, slot_mapping: torch.Tensor, *, backend: str = "auto") -> None:
        """Quantise ``k [T, D]`` (bf16/fp16/fp32) and write row ``t`` at slot ``slot_mapping[t]`` (``insert_k``).

        Slots ``< 0`` are padding and skipped.
        """
        insert_k(k, self, slot_mapping, backend=backend)

    def gather(
        self,
        block_table: torch.Tensor,
        cu_seq_lens: torch.Tensor,
        *,
        num_tokens: int | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        backend: str = "auto",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather requests' keys contiguously: request ``b`` fills rows ``[cu[b], cu[b+1])`` (``gather_k``).

        Returns FP8 ``(values float8_e4m3fn [N, D], scales float32 [N])`` (``scale_fmt="mxfp8"``: the
        raw scale words, ``uint8 [N, 4]``) or MXFP4 ``(values uint8 [N, D/2], scales uint8 [N, S])``.
        """
        return gather_k(self, block_table, cu_seq_lens, num_tokens=num_tokens, out=out, backend=backend)
