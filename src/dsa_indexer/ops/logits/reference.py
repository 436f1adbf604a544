"""PyTorch reference of the logits family (DESIGN.md §5): the definition every backend must match.

FP8:    ``logits[i, j] = (sum_h w[i, h] * relu(q[i, h, :] . k[j, :])) * k_scale[j]``
MXFP4:  ``logits[i, j] =  sum_h w[i, h] * relu(deq(q[i, h, :]) . deq(k[j, :]))``

Everything is accumulated in fp32. The dot products see exact inputs even when a CUDA matmul runs
in TF32: e4m3 values (3 mantissa bits) and dequantised e2m1 values (1 mantissa bit times a power of
two) are representable in TF32. The weighted head sum is done elementwise for the same reason.

The work is chunked over rows (requests for decode) and keys so that the fp32 intermediates stay
within ``budget_bytes`` whatever the call size. The reference always writes ``-inf`` outside each
row's valid range; with ``clean=False`` the contract leaves those entries unspecified, so callers
must not rely on that. Arguments are assumed validated by the public wrappers in ``__init__.py``.
"""

from __future__ import annotations

import torch

from ...cache_layout import KCacheLayout
from ...formats import FP8_DTYPE, dequantize_mxfp4, ue8m0_to_fp32
from ..common.logits_checks import decode_row_lengths

# fp32 intermediates of one chunk (scores, decoded queries and keys) stay below this many bytes.
INTERMEDIATE_BUDGET_BYTES = 256 << 20
KEYS_PER_CHUNK = 4096
_FP32_BYTES = 4


def decode_queries(q: torch.Tensor, q_scale: torch.Tensor | None) -> torch.Tensor:
    """``q [..., D]`` e4m3 or ``[..., D/2]`` packed e2m1 (+ ``q_scale [..., S]``) -> fp32 ``[..., D]``."""
    if q.dtype == FP8_DTYPE:
        return q.float()
    return dequantize_mxfp4(q, q_scale)


def decode_keys(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Keys as fp32 ``[..., D]`` and, for FP8, the per-key scale ``[...]`` applied after the head sum."""
    if values.dtype == FP8_DTYPE:
        return values.float(), scales
    return dequantize_mxfp4(values, scales), None


def weighted_relu_head_sum(
    queries: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, key_scales: torch.Tensor | None
) -> torch.Tensor:
    """``queries [G, R, H, D]``, ``keys [G, n, D]``, ``weights [G, R, H]``, ``key_scales [G, n] | None``
    -> fp32 ``[G, R, n]``: ``sum_h weights * relu(queries . keys)`` (times ``key_scales``)."""
    groups, rows, heads, dim = queries.shape
    weights = weights.float()  # bf16 weights widen exactly
    scores = torch.matmul(queries.reshape(groups, rows * heads, dim), keys.transpose(1, 2))  # [G, R*H, n]
    scores = scores.view(groups, rows, heads, -1).relu_().mul_(weights.unsqueeze(-1))  # [G, R, H, n]
    logits = scores.sum(dim=2)  # [G, R, n]
    if key_scales is not None:
        logits.mul_(key_scales.unsqueeze(1))
    return logits


def rows_per_chunk(heads: int, dim: int, keys: int, budget_bytes: int) -> int:
    """Query rows whose fp32 scores ``[rows, H, keys]`` and decoded queries ``[rows, H, D]`` fit the
    budget beside the decoded keys ``[keys, D]`` (at least one row)."""
    per_row = heads * (keys + dim) * _FP32_BYTES
    return max(1, (budget_bytes - keys * dim * _FP32_BYTES) // per_row)


def mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    clean: bool,
    out: torch.Tensor,
    *,
    budget_bytes: int = INTERMEDIATE_BUDGET_BYTES,
    keys_per_chunk: int = KEYS_PER_CHUNK,
) -> torch.Tensor:
    """Ragged prefill logits into ``out [M, N]`` fp32 or bf16 (row stride may be padded).

    ``q [M, H, D]`` e4m3 (``q_scale`` None) or ``[M, H, D/2]`` packed e2m1 with ``q_scale
    [M, H, S]`` ue8m0; ``k [N, D]`` e4m3 with ``k_scale [N]`` fp32, or ``[N, D/2]`` with
    ``k_scale [N, S]``; ``weights [M, H]`` fp32 or bf16. Row ``i`` scores keys ``j`` in
    ``[ks[i], ke[i])`` (indices into ``k``); every other entry becomes ``-inf``. The fp32 sums are
    rounded once into a bf16 ``out``.
    """
    num_rows, heads = weights.shape
    num_keys = k.shape[0]
    dim = q.shape[-1] * (1 if q.dtype == FP8_DTYPE else 2)
    key_step = max(1, min(num_keys, keys_per_chunk))
    row_step = rows_per_chunk(heads, dim, key_step, budget_bytes)
    for key_start in range(0, num_keys, key_step):
        key_end = min(key_start + key_step, num_keys)
        keys, key_scales = decode_keys(k[key_start:key_end], k_scale[key_start:key_end])  # [n, D], [n]
        columns = torch.arange(key_start, key_end, device=k.device)
        for row_start in range(0, num_rows, row_step):
            row_end = min(row_start + row_step, num_rows)
            rows = slice(row_start, row_end)
            queries = decode_queries(q[rows], None if q_scale is None else q_scale[rows])  # [r, H, D]
            logits = weighted_relu_head_sum(
                queries.unsqueeze(0),
                keys.unsqueeze(0),
                weights[rows].unsqueeze(0),
                None if key_scales is None else key_scales.unsqueeze(0),
            )[0]  # [r, n]
            valid = (columns >= ks[rows, None]) & (columns < ke[rows, None])
            out[rows, key_start:key_end] = torch.where(valid, logits, float("-inf"))
    return out


def requests_per_chunk(next_n: int, heads: int, dim: int, keys: int, budget_bytes: int) -> int:
    """Requests whose fp32 scores ``[next_n, H, keys]``, decoded queries ``[next_n, H, D]`` and
    gathered keys ``[keys, D]`` fit the budget (at least one request)."""
    per_request = (next_n * heads * (keys + dim) + keys * dim) * _FP32_BYTES
    return max(1, budget_bytes // per_request)


def paged_mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    cache: KCacheLayout,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    clean: bool,
    out: torch.Tensor,
    *,
    budget_bytes: int = INTERMEDIATE_BUDGET_BYTES,
    keys_per_chunk: int = KEYS_PER_CHUNK,
) -> torch.Tensor:
    """Paged decode logits into ``out [B * next_n, max_context_len]`` fp32 or bf16 (row stride may be padded).

    ``q [B, next_n, H, D]`` e4m3 or ``[B, next_n, H, D/2]`` packed e2m1 with ``q_scale
    [B, next_n, H, S]``; ``weights [B * next_n, H]`` fp32 or bf16; ``context_lens [B] | [B, next_n]``;
    ``block_table [B, max_blocks]`` page ids. Row ``b * next_n + t`` scores request-local positions
    ``p < len[b, t]``, read from token ``p % block_size`` of page ``block_table[b, p // block_size]``;
    other entries become ``-inf``.

    Block-table entries at or past a request's longest row are never dereferenced: gathers for
    those positions are redirected to page 0 and their results masked. The bytes of the valid
    positions come through ``cache.values_view()`` / ``scales_view()``, so a page stride larger than
    the packed page is honoured.

    Unchecked metadata (value checks off) reads nothing outside the cache, as in the kernels: lengths
    count at most ``max_blocks * block_size`` positions, and a page id outside ``[0, num_blocks)``
    reads as zero bytes (an all-zero key).
    """
    batch, next_n = q.shape[:2]
    heads = weights.shape[1]
    block_size = cache.block_size
    max_blocks = block_table.shape[1]
    out_by_request = out.unflatten(0, (batch, next_n))  # [B, next_n, max_context_len], a view of out
    row_lengths = decode_row_lengths(context_lens, next_n)  # [B, next_n]
    if cache.num_blocks == 0 or max_blocks == 0:
        # The wrapper has checked that no row can then see a position.
        out_by_request.fill_(float("-inf"))
        return out
    row_lengths = row_lengths.clamp_max(max_blocks * block_size)
    request_extents = row_lengths.amax(dim=1)  # [B]: positions the longest row reads
    weights_by_request = weights.unflatten(0, (batch, next_n))  # [B, next_n, H]
    values_pages, scales_pages = cache.values_view(), cache.scales_view()
    key_step = max(1, min(max_context_len, keys_per_chunk))
    request_step = requests_per_chunk(next_n, heads, cache.head_dim, key_step, budget_bytes)
    for key_start in range(0, max_context_len, key_step):
        key_end = min(key_start + key_step, max_context_len)
        positions = torch.arange(key_start, key_end, device=q.device)  # [n]
        page_columns = (positions // block_size).clamp_max(max_blocks - 1)
        token_offsets = positions % block_size
        for request_start in range(0, batch, request_step):
            requests = slice(request_start, min(request_start + request_step, batch))
            read = positions < request_extents[requests, None]  # [b, n]
            pages = torch.where(read, block_table[requests][:, page_columns].long(), 0)  # [b, n]
            readable = ((pages >= 0) & (pages < cache.num_blocks))[..., None]  # [b, n, 1]
            pages = torch.where(readable[..., 0], pages, 0)
            value_bytes = values_pages[pages, token_offsets] * readable  # [b, n, value_bytes]
            scale_bytes = scales_pages[pages, token_offsets] * readable  # [b, n, scale_bytes]
            if cache.fmt == "fp8":
                # Four bytes per token: the little-endian fp32 scale, or four equal ue8m0 bytes (mxfp8).
                if cache.scale_fmt == "mxfp8":
                    scale_bytes = ue8m0_to_fp32(scale_bytes[..., 0])
                else:
                    scale_bytes = scale_bytes.view(torch.float32)[..., 0]
                value_bytes = value_bytes.view(FP8_DTYPE)
            keys, key_scales = decode_keys(value_bytes, scale_bytes)  # [b, n, D], [b, n] | None
            request_scales = None if q_scale is None else q_scale[requests]
            queries = decode_queries(q[requests], request_scales)  # [b, next_n, H, D]
            request_weights = weights_by_request[requests]  # [b, next_n, H]
            logits = weighted_relu_head_sum(queries, keys, request_weights, key_scales)  # [b, next_n, n]
            valid = positions < row_lengths[requests, :, None]
            out_by_request[requests, :, key_start:key_end] = torch.where(valid, logits, float("-inf"))
    return out
