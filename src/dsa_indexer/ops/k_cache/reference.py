"""PyTorch reference of the paged K cache insert and gather (DESIGN.md §3); runs on any device."""

from __future__ import annotations

import torch

from ...cache_layout import KCacheLayout
from ...formats import mxfp8_scale_words, quantize_fp8, quantize_mxfp4


def rows_to_write(slot_mapping: torch.Tensor, num_slots: int | None = None) -> torch.Tensor:
    """Rows of ``slot_mapping [T]`` that the insert writes -> int64 ``[W]``, ordered by slot.

    A row is written when its slot is ``>= 0`` (and ``< num_slots`` when given: an unchecked slot past
    the cache writes nothing, as in the kernel) and no later row has the same slot (last write wins).
    The count ``W`` depends on the data, so this synchronises with the device on CUDA.
    """
    slots = slot_mapping.long()
    order = torch.sort(slots, stable=True).indices  # rows grouped by slot, in row order inside a group
    sorted_slots = slots[order]
    last_of_slot = torch.ones_like(sorted_slots, dtype=torch.bool)
    last_of_slot[:-1] = sorted_slots[:-1] != sorted_slots[1:]
    inside = sorted_slots >= 0
    if num_slots is not None:
        inside &= sorted_slots < num_slots
    return order[last_of_slot & inside]


def insert_k_reference(
    k: torch.Tensor,
    cache: KCacheLayout,
    slot_mapping: torch.Tensor,
    *,
    scale_fmt: str,
    amax_floor: float,
) -> None:
    """Quantise rows of ``k [T, D]`` and write them at slots ``slot_mapping [T]`` of ``cache``.

    FP8: ``quantize_fp8(row, block_size=D, scale_fmt, amax_floor)``; the value bytes go to the
    slot's values, the fp32 scale's 4 bytes (native little-endian order) to its scale bytes, or with a
    ``scale_fmt="mxfp8"`` cache four copies of the power-of-two scale's ue8m0 byte.
    MXFP4: ``quantize_mxfp4(row)``; packed bytes and the padded scale bytes. Negative slots are skipped.
    """
    rows = rows_to_write(slot_mapping, cache.num_slots)
    slots = slot_mapping.index_select(0, rows).long()
    page, token = slots // cache.block_size, slots % cache.block_size
    source = k.index_select(0, rows)
    if cache.fmt == "fp8":
        values, scales = quantize_fp8(source, block_size=cache.head_dim, scale_fmt=scale_fmt, amax_floor=amax_floor)
        scale_bytes = mxfp8_scale_words(scales[:, 0]) if cache.scale_fmt == "mxfp8" else scales.view(torch.uint8)
        value_bytes = values.view(torch.uint8)
    else:
        value_bytes, scale_bytes = quantize_mxfp4(source)
    cache.values_view()[page, token] = value_bytes
    cache.scales_view()[page, token] = scale_bytes


def gather_k_reference(
    cache: KCacheLayout,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    values_out: torch.Tensor,
    scales_out: torch.Tensor,
) -> None:
    """Copy request ``b``'s positions ``[0, cu[b+1] - cu[b])`` to rows ``[cu[b], cu[b+1])`` of the outputs.

    Position ``p`` of request ``b`` is token ``p % block_size`` of page ``block_table[b, p // block_size]``.
    ``values_out [R, value_bytes]`` (float8_e4m3fn or uint8) and ``scales_out`` (float32 ``[R]`` or
    uint8 ``[R, scale_bytes]``) have ``R >= cu[-1]`` rows; rows ``[cu[-1], R)`` keep their bytes. No host read.
    Unchecked tables (value checks off) read nothing outside the cache, as in the kernel: a position whose
    table column is outside the table or whose page id is outside ``[0, num_blocks)`` gathers zero bytes.
    """
    num_rows = values_out.shape[0]
    batch, max_blocks = block_table.shape
    if num_rows == 0 or batch == 0 or cache.num_blocks == 0:
        return
    device = values_out.device
    cu = cu_seq_lens.long()
    row = torch.arange(num_rows, device=device)
    # Rows past cu[-1] are looked up with clamped indices and then discarded by `written`.
    request = torch.searchsorted(cu[1:], row, right=True).clamp_max(batch - 1)
    position = row - cu[request]
    written = row < cu[-1]
    block = position // cache.block_size
    listed = (block >= 0) & (block < max_blocks)
    page = block_table.long()[request, torch.where(listed, block, 0)]
    readable = (listed & (page >= 0) & (page < cache.num_blocks)).unsqueeze(-1)  # [R, 1]
    page = torch.where(readable[:, 0], page, 0)
    token = position % cache.block_size
    gathered_values = cache.values_view()[page, token] * readable  # [R, value_bytes]
    gathered_scales = cache.scales_view()[page, token] * readable  # [R, scale_bytes]
    if scales_out.dtype == torch.float32:
        # Move the fp32 scales as int32 bit patterns so every byte is copied exactly.
        scale_destination = scales_out.view(torch.int32).unsqueeze(-1)
        gathered_scales = gathered_scales.view(torch.int32)
    else:
        scale_destination = scales_out
    value_destination = values_out.view(torch.uint8)
    keep = written.unsqueeze(-1)
    value_destination.copy_(torch.where(keep, gathered_values, value_destination))
    scale_destination.copy_(torch.where(keep, gathered_scales, scale_destination))
