"""Sparse indexer logits: each row scores only the keys of its candidate blocks (V4.1 consumer layers).

``sparse_mqa_logits`` (ragged prefill over gathered keys) and ``sparse_paged_mqa_logits`` (paged
decode) write ``[rows, num_blocks * block_size]`` logits: column ``j * block_size + o`` of row ``r``
scores the row-relative position ``blocks[r, j] * block_size + o``. ``topk_sparse`` selects over them
and returns those **positions** (the dense top-k's index domain). The per-key arithmetic is the dense
ops' (docs/contract.md §4); the rules are §13 of the contract.

Candidate rows must be *ascending, then padding*: non-decreasing block ids with ``-1`` only at the end
(what ``select_candidate_blocks`` writes; DeepGEMM's repeat-the-last-block padding also fits). An entry
equal to the one before it is padding, as is ``-1``. Checked with one vectorised reduction (skipped
under CUDA-graph capture and ``DSA_INDEXER_SKIP_VALUE_CHECKS=1``, like every value check).
"""

from __future__ import annotations

import torch

from ... import backend as _backend
from ..._validation import (
    check_index_tensor,
    check_positive_int,
    check_row_windows,
    check_same_device,
    check_tensor,
    first_true,
    index_as_int32,
    value_checks_enabled,
)
from ...cache_layout import KCacheLayout
from ...formats import FP8_DTYPE, MXFP4_BLOCK, mxfp4_scale_bytes, ue8m0_to_fp32
from ..common.logits_checks import check_decode_lengths, check_q_scale, key_format
from ..common.registration import registered_op_with_out
from ..topk import topk
from . import reference

__all__ = ["columns_to_positions", "sparse_mqa_logits", "sparse_paged_mqa_logits", "topk_sparse", "LOGITS_DTYPES"]

LOGITS_DTYPES = (torch.float32, torch.bfloat16)


def _sparse_mqa_logits_triton(*args):
    from .triton import sparse_mqa_logits_triton

    return sparse_mqa_logits_triton(*args)


def _sparse_paged_mqa_logits_triton(*args):
    from .triton import sparse_paged_mqa_logits_triton

    return sparse_paged_mqa_logits_triton(*args)


def _columns_to_positions_triton(*args):
    from .triton import columns_to_positions_triton

    return columns_to_positions_triton(*args)


def _triton_or_none(kernel):
    return kernel if _backend.triton_available() else None


def check_candidate_rows(blocks: torch.Tensor) -> None:
    """Each row of ``blocks`` is non-decreasing with ``-1`` only as a tail, ids ``>= -1``; one host read."""
    if blocks.numel() == 0:
        return
    later, earlier = blocks[:, 1:], blocks[:, :-1]
    negative = (blocks < -1).any(dim=1)
    decreasing = ((later < earlier) & (later != -1)).any(dim=1)
    live_after_padding = ((earlier == -1) & (later != -1)).any(dim=1)
    bad = negative | decreasing | live_after_padding
    if not bool(bad.any()):
        return
    row = first_true(bad)
    raise ValueError(
        "blocks rows must be non-decreasing block ids >= 0 followed by -1 padding (a repeat of the previous id "
        f"is padding too), got row {row} = {blocks[row].tolist()[:16]}"
    )


def _check_blocks(blocks, num_rows: int, block_size: int) -> None:
    check_tensor("blocks", blocks, dtype=torch.int32, shape=(num_rows, None))
    check_positive_int("block_size", block_size)
    if blocks.shape[1] > 1 and blocks.stride(1) != 1:
        raise ValueError(f"blocks must have column stride 1, got strides {blocks.stride()}")


def _prepare_out(out, rows: int, columns: int, device: torch.device, logits_dtype: torch.dtype) -> torch.Tensor:
    if logits_dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits_dtype must be torch.float32 or torch.bfloat16, got {logits_dtype}")
    if out is None:
        return torch.empty((rows, columns), dtype=logits_dtype, device=device)
    check_tensor("out", out, dtype=logits_dtype, shape=(rows, columns), device=device)
    if columns > 1 and out.stride(1) != 1:
        raise ValueError(f"out must have column stride 1, got strides {out.stride()}")
    return out


def sparse_mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    *,
    out: torch.Tensor | None = None,
    logits_dtype: torch.dtype = torch.float32,
    backend: str = "auto",
) -> torch.Tensor:
    """Sparse ragged prefill logits: row ``i`` scores the keys of its candidate blocks within ``[ks[i], ke[i])``.

    Args:
        q, q_scale, k, k_scale, weights, ks, ke: as for ``mqa_logits`` (``q [M, H, D]`` e4m3 or
            ``[M, H, D/2]`` packed e2m1 with ``q_scale [M, H, S]``; ``k [N, ...]`` gathered keys; FP8 ``k_scale``
            fp32 ``[N]`` or mxfp8 words ``uint8 [N, 4]``; weights fp32 or bf16).
        blocks: int32 ``[M, nb]`` candidate block ids, row-relative (block ``b`` covers row positions
            ``[b * block_size, (b + 1) * block_size)``, i.e. keys ``ks[i] + those``), ascending then padding.
        block_size: positions per candidate block.
        out: optional ``[M, nb * block_size]`` destination of dtype ``logits_dtype`` (row stride free).
        logits_dtype: ``torch.float32`` or ``torch.bfloat16`` (the fp32 logit rounded once).
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.

    Returns:
        ``[M, nb * block_size]``: column ``j * block_size + o`` holds the logit of key
        ``ks[i] + blocks[i, j] * block_size + o``, or ``-inf`` where that entry is padding or the position
        is outside ``[0, ke[i] - ks[i])``. Every column is written.
    """
    args = (q, q_scale, k, k_scale, weights, ks, ke, blocks, block_size)
    return _sparse_mqa_logits_op(*args, out, logits_dtype, backend)


@registered_op_with_out(
    "sparse_mqa_logits",
    fake=lambda q, q_scale, k, k_scale, weights, ks, ke, blocks, block_size, logits_dtype, backend: q.new_empty(
        (q.shape[0], blocks.shape[1] * block_size), dtype=logits_dtype
    ),
)
def _sparse_mqa_logits_op(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    out: torch.Tensor | None,
    logits_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """``sparse_mqa_logits`` with every argument given: its checks, then the backend's implementation."""
    fmt = key_format(q)
    check_tensor("q", q, ndim=3)
    num_rows, heads, q_width = q.shape
    if q_width == 0 or (fmt == "mxfp4" and q_width % (MXFP4_BLOCK // 2)):
        raise ValueError(f"q's last dimension must be D (FP8) or D/2 with D a multiple of 32 (MXFP4), got {q_width}")
    check_tensor("k", k, dtype=FP8_DTYPE if fmt == "fp8" else torch.uint8, shape=(None, q_width))
    num_keys = k.shape[0]
    if fmt == "fp8":
        check_q_scale(q_scale, fmt, ())
        check_tensor("k_scale", k_scale, dtype=(torch.float32, torch.uint8))
        check_tensor("k_scale", k_scale, shape=(num_keys,) if k_scale.dtype == torch.float32 else (num_keys, 4))
    else:
        scales_per_row = mxfp4_scale_bytes(q_width * 2)
        check_q_scale(q_scale, fmt, (num_rows, heads, scales_per_row))
        check_tensor("k_scale", k_scale, dtype=torch.uint8, shape=(num_keys, scales_per_row))
        if num_keys > 1 and k_scale.stride(1) != 1:
            raise ValueError(f"k_scale must have column stride 1, got strides {k_scale.stride()}")
    check_tensor("weights", weights, dtype=(torch.float32, torch.bfloat16), shape=(num_rows, heads))
    check_index_tensor("ks", ks, shape=(num_rows,))
    check_index_tensor("ke", ke, shape=(num_rows,))
    _check_blocks(blocks, num_rows, block_size)
    check_same_device(q=q, q_scale=q_scale, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke, blocks=blocks)
    implementation = _backend.dispatch(
        reference.sparse_mqa_logits, _triton_or_none(_sparse_mqa_logits_triton), backend, q.device
    )
    out = _prepare_out(out, num_rows, blocks.shape[1] * block_size, q.device, logits_dtype)
    ks, ke = index_as_int32("ks", ks), index_as_int32("ke", ke)
    if value_checks_enabled():
        check_row_windows(ks, ke, num_keys, names=("ks", "ke"), limit_name="the number of keys")
        check_candidate_rows(blocks)
    if fmt == "fp8" and k_scale.dtype == torch.uint8:
        # mxfp8 scale words: the first byte is the ue8m0 exponent (all four are equal); widened exactly.
        k_scale = ue8m0_to_fp32(k_scale[:, 0])
    return implementation(q, q_scale, k, k_scale, weights, ks, ke, blocks, block_size, out)


def sparse_paged_mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    cache: KCacheLayout,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    *,
    out: torch.Tensor | None = None,
    logits_dtype: torch.dtype = torch.float32,
    backend: str = "auto",
) -> torch.Tensor:
    """Sparse paged decode logits: row ``b * next_n + t`` scores the positions of its candidate blocks.

    Args:
        q, q_scale, cache, weights, context_lens, block_table: as for ``paged_mqa_logits``
            (``q [B, next_n, H, ...]``, ``weights [B * next_n, H]``, ``context_lens [B] | [B, next_n]``).
        blocks: int32 ``[B * next_n, nb]`` request-local candidate block ids of each row (block ``b`` covers
            positions ``[b * block_size, (b + 1) * block_size)``), ascending then padding.
        block_size: positions per candidate block (any size; a block may straddle cache pages).
        out, logits_dtype, backend: as for ``sparse_mqa_logits``.

    Returns:
        ``[B * next_n, nb * block_size]``: column ``j * block_size + o`` holds the logit of position
        ``blocks[r, j] * block_size + o``, or ``-inf`` where the entry is padding or the position is not
        below the row's length. Only block-table entries of live positions are read.
    """
    if not isinstance(cache, KCacheLayout):
        raise TypeError(f"cache must be an IndexerKCache, got {type(cache).__name__}")
    args = (q, q_scale, *cache.op_args(), weights, context_lens, block_table, blocks, block_size)
    return _sparse_paged_mqa_logits_op(*args, out, logits_dtype, backend)


@registered_op_with_out(
    "sparse_paged_mqa_logits",
    fake=lambda q, q_scale, cache_buffer, cache_block_size, head_dim, formats, weights, context_lens, block_table,
    blocks, block_size, logits_dtype, backend: q.new_empty(
        (q.shape[0] * q.shape[1], blocks.shape[1] * block_size), dtype=logits_dtype
    ),
)
def _sparse_paged_mqa_logits_op(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    cache_buffer: torch.Tensor,
    cache_block_size: int,
    head_dim: int,
    formats: str,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    out: torch.Tensor | None,
    logits_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    cache = KCacheLayout.from_op_args(cache_buffer, cache_block_size, head_dim, formats)
    return _sparse_paged_mqa_logits(
        q, q_scale, cache, weights, context_lens, block_table, blocks, block_size, out, logits_dtype, backend
    )


def _sparse_paged_mqa_logits(q, q_scale, cache, weights, context_lens, block_table, blocks, block_size, out, logits_dtype, backend):
    """``sparse_paged_mqa_logits`` with every argument given: its checks, then the backend's implementation."""
    fmt = key_format(q)
    if fmt != cache.fmt:
        raise ValueError(f"cache must hold keys in q's format {fmt!r} (q has dtype {q.dtype}), got {cache.fmt!r}")
    check_tensor("q", q, ndim=4)
    batch, next_n, heads, q_width = q.shape
    if next_n < 1:
        raise ValueError(f"q must have next_n (dimension 1) >= 1, got shape {list(q.shape)}")
    if q_width != cache.value_bytes:
        raise ValueError(f"q's last dimension must be {cache.value_bytes} for this {fmt} cache, got {q_width}")
    check_q_scale(q_scale, fmt, (batch, next_n, heads, cache.scale_bytes))
    check_tensor("weights", weights, dtype=(torch.float32, torch.bfloat16), shape=(batch * next_n, heads))
    check_index_tensor("context_lens", context_lens, ndim=(1, 2))
    check_tensor("context_lens", context_lens, shape=(batch,) if context_lens.dim() == 1 else (batch, next_n))
    check_index_tensor("block_table", block_table, ndim=2)
    check_tensor("block_table", block_table, shape=(batch, None))
    _check_blocks(blocks, batch * next_n, block_size)
    check_same_device(q=q, q_scale=q_scale, cache=cache.buffer, weights=weights, context_lens=context_lens,
                      block_table=block_table, blocks=blocks)
    implementation = _backend.dispatch(
        reference.sparse_paged_mqa_logits, _triton_or_none(_sparse_paged_mqa_logits_triton), backend, q.device
    )
    out = _prepare_out(out, batch * next_n, blocks.shape[1] * block_size, q.device, logits_dtype)
    context_lens = index_as_int32("context_lens", context_lens)
    block_table = index_as_int32("block_table", block_table)
    if value_checks_enabled():
        check_decode_lengths(context_lens, block_table, next_n, torch.iinfo(torch.int32).max, cache)
        check_candidate_rows(blocks)
    return implementation(q, q_scale, cache, weights, context_lens, block_table, blocks, block_size, out)


def topk_sparse(
    logits: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    k: int,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Top-k over sparse logits, as row-relative **positions** (the dense top-k's index domain).

    Args:
        logits: float32 ``[R, nb * block_size]`` from ``sparse_mqa_logits`` / ``sparse_paged_mqa_logits``.
        blocks: the int32 ``[R, nb]`` candidate rows those logits were computed with.
        block_size: positions per candidate block.
        k: picks per row (``>= 1``, may exceed the width).
        out: optional int32 ``[R, k]`` destination, fully written.
        backend: ``"auto"``, ``"reference"`` or ``"triton"`` (the top-k; the column-to-position map is
            the same tensor arithmetic on every backend).

    Returns:
        int32 ``[R, k]``: the selected positions ``blocks[r, c // block_size] * block_size + c % block_size``
        of the §5 top-k of each row's columns ``c``, ascending, ``-1``-padded. Live columns are ascending
        in position, so ties go to the lower position: for candidate rows of the required form this equals
        the dense top-k over the candidate-masked dense logits whenever the logits agree.
    """
    return _topk_sparse_op(logits, blocks, block_size, k, out, backend)


@registered_op_with_out(
    "topk_sparse",
    fake=lambda logits, blocks, block_size, k, backend: logits.new_empty((logits.shape[0], k), dtype=torch.int32),
)
def _topk_sparse_op(
    logits: torch.Tensor, blocks: torch.Tensor, block_size: int, k: int, out: torch.Tensor | None, backend: str
) -> torch.Tensor:
    """``topk_sparse`` with every argument given: its checks, then the backend's implementation."""
    check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    _check_blocks(blocks, logits.shape[0], block_size)
    check_positive_int("k", k)
    if logits.shape[1] != blocks.shape[1] * block_size:
        raise ValueError(
            f"logits must have nb * block_size = {blocks.shape[1]} * {block_size} columns, got {logits.shape[1]}"
        )
    if out is not None:
        check_tensor("out", out, dtype=torch.int32, shape=(logits.shape[0], k), device=logits.device)
    check_same_device(logits=logits, blocks=blocks, out=out)
    columns = topk(logits, k, backend=backend)
    return columns_to_positions(columns, blocks, block_size, out=out, backend=backend)


def columns_to_positions(
    columns: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Sparse-logit columns -> row-relative positions: the map ``topk_sparse`` applies to its top-k.

    Args:
        columns: int32 ``[R, k]`` columns of ``[R, nb * block_size]`` sparse logits, ``-1`` for none; each
            one ``< nb * block_size`` (not checked: the top-k's output is).
        blocks: int32 ``[R, nb]`` the candidate rows of those logits.
        block_size: positions per candidate block.
        out: optional int32 ``[R, k]`` destination (may be ``columns`` itself).
        backend: ``"auto"``, ``"reference"`` or ``"triton"``.

    Returns:
        int32 ``[R, k]``: ``blocks[r, c // block_size] * block_size + c % block_size``, ``-1`` kept.
    """
    return _columns_to_positions_op(columns, blocks, block_size, out, backend)


@registered_op_with_out("columns_to_positions", fake=lambda columns, *args: torch.empty_like(columns))
def _columns_to_positions_op(
    columns: torch.Tensor, blocks: torch.Tensor, block_size: int, out: torch.Tensor | None, backend: str
) -> torch.Tensor:
    """``columns_to_positions`` with every argument given: its checks, then the backend's implementation."""
    check_tensor("columns", columns, dtype=torch.int32, ndim=2)
    _check_blocks(blocks, columns.shape[0], block_size)
    if out is None:
        out = torch.empty_like(columns)
    check_tensor("out", out, dtype=torch.int32, shape=tuple(columns.shape))
    check_same_device(columns=columns, blocks=blocks, out=out)
    if blocks.shape[1] == 0 or columns.shape[1] == 0:
        return reference.columns_to_positions(columns, blocks, block_size, out)
    implementation = _backend.dispatch(
        reference.columns_to_positions, _triton_or_none(_columns_to_positions_triton), backend, columns.device
    )
    return implementation(columns, blocks, block_size, out)
