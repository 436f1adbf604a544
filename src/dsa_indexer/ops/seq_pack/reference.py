"""PyTorch reference of ``pack_seq`` / ``unpack_seq`` (any device).

Both ops move the payload as same-width integers, so the copy is byte-exact by construction for
every dtype (float8, NaN payloads, ``-0.0``) and needs no float kernel for exotic dtypes. Lengths are
read on the device only; nothing here syncs.
"""

from __future__ import annotations

import torch

_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as integers of the same width (any strides)."""
    return tensor.view(_BITS_DTYPES[tensor.element_size()])


def pad_bits(pad_value: int | float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0-dim integer tensor holding the bit pattern of ``pad_value`` stored as ``dtype``."""
    return as_bits(torch.full((), pad_value, dtype=dtype, device=device))


def pack_seq_reference(
    x: torch.Tensor,
    lengths: torch.Tensor,
    pad_value: int | float,
    max_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [N, ...]`` -> ``[B, max_len, ...]``; row ``b`` holds the ``lengths[b]`` rows of ``x``
    starting at ``sum(lengths[:b])``, then ``pad_value``.

    Positions past ``max_len`` are dropped, and positions whose source row is not in ``[0, N)``
    (possible only with invalid lengths) are padding, so nothing outside ``x`` is read.
    """
    num_seqs = lengths.shape[0]
    trailing = x.shape[1:]
    if out is None:
        out = torch.empty((num_seqs, max_len, *trailing), dtype=x.dtype, device=x.device)
    pad = pad_bits(pad_value, x.dtype, x.device)
    lengths = lengths.to(torch.int64)
    seq_starts = torch.cumsum(lengths, 0) - lengths  # [B]
    position = torch.arange(max_len, device=x.device, dtype=torch.int64)  # [L]
    source_row = seq_starts[:, None] + position[None, :]  # [B, L]
    if x.shape[0] == 0:
        as_bits(out).copy_(pad.expand(out.shape))
        return out
    valid = (position[None, :] < lengths[:, None]) & (source_row >= 0) & (source_row < x.shape[0])
    gathered = as_bits(x)[source_row.clamp(0, x.shape[0] - 1)]  # [B, L, ...]
    valid = valid.view(*valid.shape, *([1] * len(trailing)))
    as_bits(out).copy_(torch.where(valid, gathered, pad))
    return out


def unpack_seq_reference(
    packed: torch.Tensor,
    lengths: torch.Tensor,
    total: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``packed [B, L, ...]`` -> ``[total, ...]``: output row ``sum(lengths[:b]) + t`` is
    ``packed[b, t]`` for ``t < lengths[b]``.

    Only rows ``[0, sum(lengths))`` are written; rows past it keep ``out``'s contents (uninitialised
    when ``out`` is None). Sources with ``t >= L`` (invalid lengths) are skipped, never read.
    """
    num_seqs, seq_capacity = packed.shape[0], packed.shape[1]
    if out is None:
        out = torch.empty((total, *packed.shape[2:]), dtype=packed.dtype, device=packed.device)
    if num_seqs == 0 or seq_capacity == 0 or total == 0:
        return out
    lengths = lengths.to(torch.int64)
    seq_ends = torch.cumsum(lengths, 0)  # [B]
    row = torch.arange(total, device=packed.device, dtype=torch.int64)  # [total]
    # The sequence holding output row i is the first one whose end lies past i.
    seq = torch.searchsorted(seq_ends, row, right=True)  # [total]
    seq_clamped = seq.clamp(max=num_seqs - 1)
    position = row - (seq_ends - lengths)[seq_clamped]
    valid = (seq < num_seqs) & (position >= 0) & (position < seq_capacity)
    gathered = as_bits(packed)[seq_clamped, position.clamp(0, seq_capacity - 1)]  # [total, ...]
    out_bits = as_bits(out)
    valid = valid.view(total, *([1] * (packed.dim() - 2)))
    out_bits.copy_(torch.where(valid, gathered, out_bits))
    return out
