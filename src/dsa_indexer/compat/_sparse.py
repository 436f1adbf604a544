"""DeepGEMM 2.8's sparse MQA logits entry points over ``ops.sparse_logits`` (re-exported by ``compat.deep_gemm``).

DeepGEMM runs these on SM100 only; here they run wherever our kernels do (Hopper included). Same names,
argument order and returns: bf16 logits ``[rows, num_max_sparse_blocks * sparse_block_kv]`` whose column
``j * sparse_block_kv + o`` scores the token of row-slot ``j``. DeepGEMM's block ids:

- ``get_sparse_mqa_logits_metadata``: absolute ids into the gathered keys. Block ``b`` starts at key
  ``b * sparse_block_kv``, or with ``use_unaligned_ks`` at ``b * sparse_block_kv + ks % sparse_block_kv``.
- ``get_paged_sparse_mqa_logits_metadata``: request-local (context-relative) ids.

A row's valid prefix is ``min(num_max_sparse_blocks, ceil((ke - ks) / sparse_block_kv))`` strictly
increasing ids; DeepGEMM never reads the rest (engines repeat the last valid id there). The metadata
functions turn the ids into our row-relative domain and mark every slot past the valid prefix as
padding, so those columns come back ``-inf``, as do positions outside ``[ks, ke)`` (context length for
decode). The metadata is our own format (``SparseMetadata``, tensors only, no host synchronisation), not
DeepGEMM's schedule; paired decode rows (``indices``) need no pairing here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._validation import check_positive_int, check_tensor
from ..cache import IndexerKCache
from ..formats import FP8_DTYPE
from ..ops.sparse_logits import sparse_mqa_logits, sparse_paged_mqa_logits

__all__ = [
    "SparseMetadata",
    "fp8_fp4_paged_sparse_mqa_logits",
    "fp8_fp4_sparse_mqa_logits",
    "get_paged_sparse_mqa_logits_metadata",
    "get_sparse_mqa_logits_metadata",
]


@dataclass(frozen=True)
class SparseMetadata:
    """What the sparse logits calls need: ``blocks [rows, nb]`` int32 row-relative ids (padding ``-1``),
    ``starts``/``ends [rows]`` (prefill key ranges; decode: ``ends`` = context lengths), the decode
    ``block_table`` (None for prefill), ``head_offset [rows]`` (prefill: row positions below it in the
    first block are outside the row, the aligned-id case) and the ``sparse_block_kv`` it was built for."""

    blocks: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    block_table: torch.Tensor | None
    head_offset: torch.Tensor | None
    sparse_block_kv: int


def _valid_prefix(blocks: torch.Tensor, lengths: torch.Tensor, sparse_block_kv: int) -> torch.Tensor:
    """``blocks`` with every slot past ``min(nb, ceil(length / sparse_block_kv))`` set to -1."""
    count = torch.div(lengths.long().clamp_min(0) + sparse_block_kv - 1, sparse_block_kv, rounding_mode="floor")
    slot = torch.arange(blocks.shape[1], device=blocks.device)
    return torch.where(slot[None, :] < count[:, None], blocks, -1).to(torch.int32)


def _check_common(sparse_kv_block_indices, sparse_block_kv: int, rows: int) -> None:
    check_tensor("sparse_kv_block_indices", sparse_kv_block_indices, dtype=torch.int32, shape=(rows, None))
    check_positive_int("sparse_block_kv", sparse_block_kv)


def get_sparse_mqa_logits_metadata(
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    num_kv_tokens: int,
    sparse_kv_block_indices: torch.Tensor,
    qk_dtype: torch.dtype,
    sparse_block_kv: int,
    use_unaligned_ks: bool = False,
) -> SparseMetadata:
    """Metadata of ``fp8_fp4_sparse_mqa_logits``: ``cu_seq_len_k_start/end [rows]`` int32 key ranges into
    the gathered keys (``num_kv_tokens`` of them), ``sparse_kv_block_indices [rows, nb]`` int32 absolute
    block ids (see the module docstring). ``qk_dtype`` is accepted for the signature."""
    check_tensor("cu_seq_len_k_start", cu_seq_len_k_start, dtype=torch.int32, ndim=1)
    rows = cu_seq_len_k_start.shape[0]
    check_tensor("cu_seq_len_k_end", cu_seq_len_k_end, dtype=torch.int32, shape=(rows,))
    check_positive_int("num_kv_tokens", num_kv_tokens, minimum=0)
    _check_common(sparse_kv_block_indices, sparse_block_kv, rows)
    ks = cu_seq_len_k_start
    first = torch.div(ks, sparse_block_kv, rounding_mode="floor")[:, None]  # the block holding ks
    blocks = sparse_kv_block_indices - first
    head_offset = None
    if use_unaligned_ks:
        starts = ks  # block i starts at i * sbk + ks % sbk: row-relative ids (i - ks // sbk) as they are
    else:
        starts = first[:, 0].to(torch.int32) * sparse_block_kv  # aligned: score from the block boundary,
        head_offset = ks - starts  # and mask the positions before ks
    lengths = cu_seq_len_k_end - ks
    return SparseMetadata(_valid_prefix(blocks, lengths, sparse_block_kv), starts.to(torch.int32),
                          cu_seq_len_k_end, None, head_offset, sparse_block_kv)


def get_paged_sparse_mqa_logits_metadata(
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    indices: torch.Tensor | None,
    page_kv: int,
    sparse_kv_block_indices: torch.Tensor,
    qk_dtype: torch.dtype,
    sparse_block_kv: int,
) -> SparseMetadata:
    """Metadata of ``fp8_fp4_paged_sparse_mqa_logits``: ``context_lens [rows]`` int32 (each row's length),
    ``block_table [rows, pages]`` int32 (a row's pages, ``page_kv`` tokens each), ``indices [rows]`` request
    ids (accepted, not needed), ``sparse_kv_block_indices [rows, nb]`` request-local block ids."""
    check_tensor("context_lens", context_lens, dtype=torch.int32, ndim=1)
    rows = context_lens.shape[0]
    check_tensor("block_table", block_table, dtype=torch.int32, shape=(rows, None))
    if indices is not None:
        check_tensor("indices", indices, shape=(rows,))
    check_positive_int("page_kv", page_kv)
    _check_common(sparse_kv_block_indices, sparse_block_kv, rows)
    blocks = _valid_prefix(sparse_kv_block_indices, context_lens, sparse_block_kv)
    return SparseMetadata(blocks, torch.zeros_like(context_lens), context_lens, block_table, None, sparse_block_kv)


def _unpack(name: str, pair) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeepGEMM's ``(values, scales)``: FP8 e4m3 values (scales fp32 or None), or FP4 int8 packed values with
    int32 words of four ue8m0 bytes -> our uint8 views."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{name} must be a (values, scales) pair, got {type(pair).__name__}")
    values, scales = pair
    check_tensor(name, values, dtype=(FP8_DTYPE, torch.int8))
    if values.dtype == FP8_DTYPE:
        return values, scales
    check_tensor(f"{name} scales", scales, dtype=torch.int32)
    return values.view(torch.uint8), scales.contiguous().view(torch.uint8).view(*scales.shape, 4)


def _check_metadata(metadata, paged: bool, num_max_sparse_blocks: int, sparse_block_kv: int) -> None:
    if not isinstance(metadata, SparseMetadata) or (metadata.block_table is not None) != paged:
        which = "get_paged_sparse_mqa_logits_metadata" if paged else "get_sparse_mqa_logits_metadata"
        raise TypeError(f"metadata must come from {which}, got {type(metadata).__name__}")
    if metadata.blocks.shape[1] != num_max_sparse_blocks or metadata.sparse_block_kv != sparse_block_kv:
        raise ValueError(
            f"metadata was built for {metadata.blocks.shape[1]} blocks of {metadata.sparse_block_kv}, "
            f"the call asks {num_max_sparse_blocks} of {sparse_block_kv}"
        )


def fp8_fp4_sparse_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    metadata: SparseMetadata,
    num_max_sparse_blocks: int,
    sparse_block_kv: int,
    use_unaligned_ks: bool = False,
) -> torch.Tensor:
    """bf16 ``[rows, num_max_sparse_blocks * sparse_block_kv]`` logits of the listed blocks of the gathered
    keys ``kv`` for ``q [rows, H, D | D/2]`` and ``weights [rows, H]`` (bf16 or fp32)."""
    _check_metadata(metadata, False, num_max_sparse_blocks, sparse_block_kv)
    q_values, q_scales = _unpack("q", q)
    kv_values, kv_scales = _unpack("kv", kv)
    check_tensor("weights", weights, dtype=(torch.bfloat16, torch.float32), ndim=2)
    out = sparse_mqa_logits(
        q_values, q_scales, kv_values, kv_scales, weights.float(), metadata.starts, metadata.ends, metadata.blocks,
        sparse_block_kv, logits_dtype=torch.bfloat16,
    )
    if metadata.head_offset is not None:
        position = (metadata.blocks.long()[:, :, None] * sparse_block_kv
                    + torch.arange(sparse_block_kv, device=out.device)).flatten(1)
        out.masked_fill_(position < metadata.head_offset[:, None], float("-inf"))
    return out


def fp8_fp4_paged_sparse_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    metadata: SparseMetadata,
    num_max_sparse_blocks: int,
    sparse_block_kv: int,
) -> torch.Tensor:
    """bf16 ``[rows, num_max_sparse_blocks * sparse_block_kv]`` logits of the listed blocks for
    ``q [rows, 1, H, D | D/2]`` (next_n 1: one row per query token), the fused cache
    ``kv_cache [num_blocks, page_kv, 1, bytes]`` and ``weights [rows, H]`` (bf16 or fp32)."""
    _check_metadata(metadata, True, num_max_sparse_blocks, sparse_block_kv)
    q_values, q_scales = _unpack("q", q)
    check_tensor("q", q_values, ndim=4)
    if q_values.shape[1] != 1:
        raise ValueError(f"q must have next_n (dimension 1) == 1, got shape {list(q_values.shape)}")
    check_tensor("kv_cache", kv_cache, dtype=torch.uint8, ndim=4)
    if kv_cache.shape[2] != 1:
        raise ValueError(f"kv_cache must be [num_blocks, page_kv, 1, bytes], got {list(kv_cache.shape)}")
    fmt = "fp8" if q_values.dtype == FP8_DTYPE else "mxfp4"
    head_dim = q_values.shape[-1] * (1 if fmt == "fp8" else 2)
    cache = IndexerKCache(kv_cache.shape[0], block_size=kv_cache.shape[1], head_dim=head_dim, fmt=fmt,
                          buffer=kv_cache[:, :, 0, :])
    check_tensor("weights", weights, dtype=(torch.bfloat16, torch.float32), ndim=2)
    return sparse_paged_mqa_logits(
        q_values, q_scales, cache, weights.float(), metadata.ends, metadata.block_table, metadata.blocks,
        sparse_block_kv, logits_dtype=torch.bfloat16,
    )
