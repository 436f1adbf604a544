"""Triton kernels of ``pack_seq`` / ``unpack_seq`` (twins of ``reference.py``): byte copies.

The payload's trailing dims are flattened into one row of ``width`` elements, moved as same-width integers
(widened to 2-, 4- or 8-byte words where the row bytes, strides and offsets allow; a pad value is replicated
into a word the same way). One kernel (``_seq_copy_kernel``, the direction a compile-time flag) walks the
padded grid ``[B, L]`` as ``B * L`` rows in tiles; each program keeps a running prefix sum of the lengths, read
on the device only: no host synchronisation, CUDA-graph capturable. Details: ``README.md``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from .reference import as_bits

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PREFIX_BLOCK = 1024  # lengths summed per step of a program's first prefix


@dataclasses.dataclass(frozen=True)
class SeqCopyConfig:
    """Launch rule of the copy kernel: tiles of at most ``tile_bytes`` (``BLOCK_R`` grid rows, at most
    ``max_tile_rows``, x ``BLOCK_W`` words) and at most ``max_programs`` programs along the rows (each then walks
    several tiles), ``num_warps`` a program."""

    tile_bytes: int = 32768
    max_programs: int = 1024
    max_tile_rows: int = 1024
    num_warps: int = 8


@dataclasses.dataclass(frozen=True)
class SeqCopyLaunch:
    """One call's launch: tile shape (``block_r`` grid rows x ``block_w`` words), tiles a program walks, and the
    grid (``row_programs`` x ``width_programs``)."""

    block_r: int
    block_w: int
    tiles_per_program: int
    row_programs: int
    width_programs: int


# The rule the launchers use (the tests swap in small tiles and few programs).
SEQ_COPY_CONFIG = SeqCopyConfig()


@triton.jit
def _tile_sequence_starts(lengths_ptr, num_seqs, first_seq, seq, prefix, BLOCK_R: tl.constexpr):
    """(start, length) of the sequences ``seq`` [BLOCK_R] (each in ``[first_seq, first_seq + BLOCK_R)``
    or past ``num_seqs``), given ``prefix = sum(lengths[:first_seq])``."""
    local = first_seq + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    local_len = tl.load(lengths_ptr + local, mask=local < num_seqs, other=0).to(tl.int64)  # [BLOCK_R]
    exclusive = tl.cumsum(local_len, axis=0) - local_len  # [BLOCK_R]
    slot = tl.minimum(seq - first_seq, BLOCK_R - 1).to(tl.int32)  # [BLOCK_R]
    start = prefix + tl.gather(exclusive, slot, axis=0)  # [BLOCK_R]
    length = tl.gather(local_len, slot, axis=0)  # [BLOCK_R]
    return start, length


@triton.jit
def _length_prefix(lengths_ptr, end, PREFIX_BLOCK: tl.constexpr):
    """``sum(lengths[:end])`` as int64."""
    total = tl.zeros([PREFIX_BLOCK], dtype=tl.int64)
    first = end * 0
    while first < end:
        idx = first + tl.arange(0, PREFIX_BLOCK)  # [PREFIX_BLOCK]
        total += tl.load(lengths_ptr + idx, mask=idx < end, other=0).to(tl.int64)
        first += PREFIX_BLOCK
    return tl.sum(total, axis=0)


@triton.jit
def _advance_prefix(lengths_ptr, num_seqs, prefix, first_seq, next_first_seq, BLOCK_R: tl.constexpr):
    """``prefix + sum(lengths[first_seq:next_first_seq])`` (at most BLOCK_R sequences apart)."""
    local = first_seq + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    keep = (local < next_first_seq) & (local < num_seqs)
    return prefix + tl.sum(tl.load(lengths_ptr + local, mask=keep, other=0).to(tl.int64), axis=0)


@triton.jit(do_not_specialize=["pad_word", "num_ragged_rows", "num_seqs", "max_len", "tiles_per_program"])
def _seq_copy_kernel(
    ragged_ptr, lengths_ptr, padded_ptr, pad_word,
    num_ragged_rows, num_seqs, max_len, width, tiles_per_program,
    ragged_stride_row, ragged_stride_col,
    padded_stride_seq, padded_stride_pos, padded_stride_col,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, PREFIX_BLOCK: tl.constexpr, PACK: tl.constexpr,
):
    """Ragged rows ``[num_ragged_rows, width]`` <-> padded grid ``[num_seqs, max_len, width]``: ``PACK``
    copies ragged -> padded (every grid row written, ``pad_word`` where no ragged row), else padded ->
    ragged (valid rows only; ``pad_word`` unused)."""
    grid_rows = num_seqs.to(tl.int64) * max_len
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)  # [BLOCK_W]
    col_ok = cols < width
    pad = pad_word.to(padded_ptr.dtype.element_ty)
    first_tile = tl.program_id(0).to(tl.int64) * tiles_per_program
    first_seq = (first_tile * BLOCK_R) // max_len
    prefix = _length_prefix(lengths_ptr, first_seq, PREFIX_BLOCK)
    tile = first_tile
    while tile < first_tile + tiles_per_program:
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] grid rows b * L + t
        in_grid = rows < grid_rows
        seq = rows // max_len
        pos = rows - seq * max_len
        start, length = _tile_sequence_starts(lengths_ptr, num_seqs, first_seq, seq, prefix, BLOCK_R)
        ragged_row = start + pos  # [BLOCK_R]
        valid = in_grid & (pos < length) & (ragged_row >= 0) & (ragged_row < num_ragged_rows)
        ragged = ragged_ptr + ragged_row[:, None] * ragged_stride_row + cols[None, :] * ragged_stride_col
        padded_row = seq * padded_stride_seq + pos * padded_stride_pos  # [BLOCK_R]
        padded = padded_ptr + padded_row[:, None] + cols[None, :] * padded_stride_col
        valid_words = valid[:, None] & col_ok[None, :]  # [BLOCK_R, BLOCK_W]
        if PACK:
            words = tl.load(ragged, mask=valid_words, other=pad)
            tl.store(padded, words, mask=in_grid[:, None] & col_ok[None, :])
        else:
            tl.store(ragged, tl.load(padded, mask=valid_words), mask=valid_words)
        next_first_seq = ((tile + 1) * BLOCK_R) // max_len
        prefix = _advance_prefix(lengths_ptr, num_seqs, prefix, first_seq, next_first_seq, BLOCK_R)
        first_seq = next_first_seq
        tile += 1


def _row_view(tensor: torch.Tensor, lead: int) -> torch.Tensor | None:
    """``tensor`` viewed as ``[*shape[:lead], width]`` without a copy, or None when its strides forbid it."""
    width = math.prod(tensor.shape[lead:])
    try:
        return tensor.view(*tensor.shape[:lead], width)
    except RuntimeError:
        return None


def _word_bytes(views: list[torch.Tensor]) -> int:
    """The widest word (bytes) that divides every row, stride and offset of the integer ``views``."""
    itemsize = views[0].element_size()
    row_bytes = views[0].shape[-1] * itemsize
    for word in (8, 4, 2):
        if word <= itemsize or row_bytes % word:
            continue
        if all(
            v.stride(-1) == 1
            and (v.storage_offset() * itemsize) % word == 0
            and all((s * itemsize) % word == 0 for s in v.stride()[:-1])
            for v in views
        ):
            return word
    return itemsize


def _as_words(views: list[torch.Tensor]) -> list[torch.Tensor]:
    word = _word_bytes(views)
    if word == views[0].element_size():
        return views
    return [v.view(_WORDS[word]) for v in views]


def _pad_word(pad_value: int | float, dtype: torch.dtype, word_dtype: torch.dtype) -> int:
    """The bit pattern of ``pad_value`` stored as ``dtype``, repeated to fill one word (a signed int)."""
    repeats = word_dtype.itemsize // dtype.itemsize
    return int(torch.full((repeats,), pad_value, dtype=dtype).view(word_dtype).item())


def seq_copy_launch(grid_rows: int, width: int, word_bytes: int) -> SeqCopyLaunch:
    """The launch of a copy of ``grid_rows`` rows of ``width`` words of ``word_bytes`` (host integers only)."""
    config = SEQ_COPY_CONFIG
    block_w = min(triton.next_power_of_2(width), max(1, config.tile_bytes // word_bytes))
    block_r = min(triton.next_power_of_2(grid_rows), max(1, config.tile_bytes // (block_w * word_bytes)),
                  config.max_tile_rows)
    width_programs = triton.cdiv(width, block_w)
    tiles = triton.cdiv(grid_rows, block_r)
    tiles_per_program = triton.cdiv(tiles, max(1, config.max_programs // width_programs))
    return SeqCopyLaunch(block_r, block_w, tiles_per_program, triton.cdiv(tiles, tiles_per_program), width_programs)


def pack_seq_triton(
    x: torch.Tensor,
    lengths: torch.Tensor,
    pad_value: int | float,
    max_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of ``pack_seq_reference``: ``x [N, ...]`` -> ``[B, max_len, ...]``."""
    num_seqs, trailing = lengths.shape[0], x.shape[1:]
    if out is None:
        out = torch.empty((num_seqs, max_len, *trailing), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    dst = _row_view(as_bits(out), 2)
    target = dst if dst is not None else as_bits(torch.empty_like(out, memory_format=torch.contiguous_format)).view(
        num_seqs, max_len, -1)
    src = _row_view(as_bits(x), 1) if x.shape[0] else None
    if src is None:
        src = as_bits(x).reshape(x.shape[0], -1) if x.shape[0] else target[0]
    src, target = _as_words([src, target])
    width = target.shape[-1]
    launch = seq_copy_launch(num_seqs * max_len, width, target.element_size())
    _seq_copy_kernel[(launch.row_programs, launch.width_programs)](
        src, lengths, target, _pad_word(pad_value, x.dtype, target.dtype),
        x.shape[0], num_seqs, max_len, width, launch.tiles_per_program,
        src.stride(0), src.stride(1),
        target.stride(0), target.stride(1), target.stride(2),
        BLOCK_R=launch.block_r, BLOCK_W=launch.block_w, PREFIX_BLOCK=_PREFIX_BLOCK, PACK=True,
        num_warps=SEQ_COPY_CONFIG.num_warps,
    )
    if dst is None:
        as_bits(out).copy_(target.view(as_bits(out).dtype).view(out.shape))
    return out


def unpack_seq_triton(
    packed: torch.Tensor,
    lengths: torch.Tensor,
    total: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of ``unpack_seq_reference``: ``packed [B, L, ...]`` -> ``[total, ...]``."""
    num_seqs, max_len = packed.shape[0], packed.shape[1]
    if out is None:
        out = torch.empty((total, *packed.shape[2:]), dtype=packed.dtype, device=packed.device)
    if out.numel() == 0 or packed.numel() == 0:
        return out
    dst = _row_view(as_bits(out), 1)
    target = dst if dst is not None else as_bits(out).contiguous().view(total, -1)
    src = _row_view(as_bits(packed), 2)
    if src is None:
        src = as_bits(packed).reshape(num_seqs, max_len, -1)
    src, target = _as_words([src, target])
    width = target.shape[-1]
    launch = seq_copy_launch(num_seqs * max_len, width, target.element_size())
    _seq_copy_kernel[(launch.row_programs, launch.width_programs)](
        target, lengths, src, 0,
        total, num_seqs, max_len, width, launch.tiles_per_program,
        target.stride(0), target.stride(1),
        src.stride(0), src.stride(1), src.stride(2),
        BLOCK_R=launch.block_r, BLOCK_W=launch.block_w, PREFIX_BLOCK=_PREFIX_BLOCK, PACK=False,
        num_warps=SEQ_COPY_CONFIG.num_warps,
    )
    if dst is None:
        as_bits(out).copy_(target.view(as_bits(out).dtype).view(out.shape))
    return out
