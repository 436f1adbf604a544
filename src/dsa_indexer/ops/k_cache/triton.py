"""Triton kernels of the paged K cache: quantise-and-insert rows, gather requests' keys contiguously.

Both honour the cache's byte layout (``dsa_indexer.cache``): page ``p`` starts ``p * page_stride`` bytes
after the buffer's first byte; inside it come ``block_size`` value rows, then ``block_size`` scale rows.
Quantisation uses the encode helpers of ``ops/common/codecs`` (bit-exact with ``dsa_indexer.formats``); MXFP4
of bf16 keys with unit dim stride encodes on bf16 pairs, other keys on fp32 values. The block size and head dim
are compile-time constants. ``gather_k`` needs no host read: each row finds its request by a binary search of
``cu_seq_lens``. Details: ``README.md``.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ...cache_layout import KCacheLayout
from ...formats import FP8_MAX
from ..common.codecs import (
    bf16x2_block_amax,
    e4m3_bytes,
    finite_amax,
    fp8_scale_exponent,
    load_bf16_words,
    load_pairs,
    mxfp4_pack_pairs,
    pow2,
    quantize_store_bf16_words,
    store_mxfp4_rows,
    store_scale_padding,
)
from ..common.runtime import interpreting

_FP8_MAX = tl.constexpr(FP8_MAX)

__all__ = ["gather_k_triton", "insert_k_triton", "InsertConfig", "GatherConfig", "insert_config"]


@dataclasses.dataclass(frozen=True)
class InsertConfig:
    """Launch of the insert kernel (defaults: FP8): ``block_tokens`` rows a program (a power of two).
    ``bf16x2`` (MXFP4): bf16 keys whose layout allows it are encoded on bf16 pairs; False runs the fp32 path
    (tests, benchmarks); the results are the same."""

    block_tokens: int = 32
    num_warps: int = 4
    bf16x2: bool = True


# MXFP4: 32 tokens with 2 warps, the fastest measured on an H200.
MXFP4_INSERT_CONFIG = InsertConfig(num_warps=2)


def insert_config(fmt: str) -> InsertConfig:
    """The insert launch the wrapper uses for a cache in ``fmt`` (``"fp8"`` or ``"mxfp4"``)."""
    return MXFP4_INSERT_CONFIG if fmt == "mxfp4" else InsertConfig()


@dataclasses.dataclass(frozen=True)
class GatherConfig:
    """Launch of the gather kernel: ``block_rows`` destination rows a program."""

    block_rows: int = 64
    num_warps: int = 4


@triton.jit(do_not_specialize=["num_tokens", "num_slots"])
def _insert_k_kernel(
    k_ptr, slots_ptr, cache_ptr,
    num_tokens, num_slots, stride_kt, stride_kd, stride_slots,
    page_stride, amax_floor,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MXFP4: tl.constexpr,
    MXFP8: tl.constexpr, UE8M0: tl.constexpr, BLOCK_T: tl.constexpr, BF16X2: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """One program: rows ``[program_id(0) * BLOCK_T, +BLOCK_T)`` of ``k``; rows with a negative slot write nothing,
    nor (unchecked slot mappings) rows whose slot is ``>= num_slots``.

    ``BF16X2`` (MXFP4 of bf16 ``k`` with unit dim stride and even row stride): rows are loaded as bf16 pair
    words (``load_bf16_words``) and quantised by ``quantize_store_bf16_words``."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    slot = tl.load(slots_ptr + rows * stride_slots, mask=rows < num_tokens, other=-1).to(tl.int64)
    write = (slot >= 0) & (slot < num_slots)
    slot = tl.where(write, slot, 0)
    page = cache_ptr + (slot // BLOCK_SIZE) * page_stride  # [BLOCK_T] first byte of the row's page
    token = slot % BLOCK_SIZE
    if MXFP4:
        SCALE_BYTES: tl.constexpr = (HEAD_DIM + 127) // 128 * 4  # D/32 bytes padded to whole words
        nb: tl.constexpr = BLOCK_D // 32
        k_rows = k_ptr + rows * stride_kt  # [BLOCK_T]
        if BF16X2:
            value_rows = page + token * (HEAD_DIM // 2)
            scale_rows = page + BLOCK_SIZE * (HEAD_DIM // 2) + token * SCALE_BYTES
            words = load_bf16_words(k_rows.to(tl.pointer_type(tl.uint32), bitcast=True), 0, write, HEAD_DIM // 2, nb)
            amax = bf16x2_block_amax(words, INTERPRETER)  # [BLOCK_T, NB]
            if tl.max(amax) < 0x7F80:  # every value of the program finite
                quantize_store_bf16_words(value_rows, scale_rows, write, words, amax, HEAD_DIM, True, INTERPRETER)
            else:
                quantize_store_bf16_words(value_rows, scale_rows, write, words, amax, HEAD_DIM, False, INTERPRETER)
        else:
            even, odd = load_pairs(k_rows, 0, stride_kd, write, HEAD_DIM // 2, nb)  # [BLOCK_T, NB, 4, 4]
            packed, scales = mxfp4_pack_pairs(even, odd, INTERPRETER)  # [BLOCK_T, NB, 4, 4], [BLOCK_T, NB]
            store_mxfp4_rows(page + token * (HEAD_DIM // 2),
                             page + BLOCK_SIZE * (HEAD_DIM // 2) + token * SCALE_BYTES, write, packed, scales,
                             HEAD_DIM)
        store_scale_padding(page + BLOCK_SIZE * (HEAD_DIM // 2) + token * SCALE_BYTES, write, HEAD_DIM)
    else:
        dim = tl.arange(0, BLOCK_D)
        dim_ok = dim < HEAD_DIM
        x = tl.load(k_ptr + rows[:, None] * stride_kt + dim[None, :] * stride_kd,
                    mask=write[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_D]
        amax = tl.maximum(finite_amax(x, 1), tl.cast(amax_floor, tl.float32))  # [BLOCK_T]
        if UE8M0:
            exponent = fp8_scale_exponent(amax)
            scale = pow2(exponent)
            scaled = x * pow2(-exponent)[:, None]
        else:
            scale = tl.div_rn(amax, _FP8_MAX)
            scaled = tl.div_rn(x, scale[:, None])
        tl.store(page[:, None] + token[:, None] * HEAD_DIM + dim[None, :], e4m3_bytes(scaled, INTERPRETER),
                 mask=write[:, None] & dim_ok[None, :])
        byte = tl.arange(0, 4)
        if MXFP8:
            # Four equal ue8m0 bytes: the power-of-two scale's exponent field.
            scale_bytes = tl.broadcast_to(((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF)[:, None], (BLOCK_T, 4))
        else:
            scale_bytes = (scale.to(tl.int32, bitcast=True)[:, None] >> (byte * 8)[None, :]) & 0xFF  # [BLOCK_T, 4]
        scale_rows = page + BLOCK_SIZE * HEAD_DIM + token * 4  # [BLOCK_T]
        tl.store(scale_rows[:, None] + byte[None, :], scale_bytes.to(tl.uint8), mask=write[:, None])


@triton.jit(do_not_specialize=["num_requests", "search_steps", "num_rows", "table_columns", "num_blocks"])
def _gather_k_kernel(
    cache_ptr, block_table_ptr, cu_ptr, values_ptr, scales_ptr,
    num_requests, search_steps, stride_cu, num_rows, table_columns, num_blocks,
    stride_bt_request, stride_bt_block, page_stride,
    stride_values_row, stride_values_byte, stride_scales_row, stride_scales_byte,
    BLOCK_SIZE: tl.constexpr, VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    """One program: destination rows ``[program_id(0) * BLOCK_ROWS, +BLOCK_ROWS)``, those below ``cu[-1]``.

    Unchecked tables stay inside the buffers: rows stop at the destination's ``num_rows``, and a position whose
    table column lies outside ``[0, table_columns)`` or whose page id lies outside ``[0, num_blocks)`` is not
    read: its row receives zero bytes."""
    first_row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS
    total = tl.minimum(tl.load(cu_ptr + num_requests * stride_cu).to(tl.int64), num_rows)
    if first_row < total:
        rows = first_row + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
        row_ok = rows < total
        low = tl.zeros([BLOCK_ROWS], dtype=tl.int32)
        high = tl.zeros([BLOCK_ROWS], dtype=tl.int32) + num_requests
        step = 0
        while step < search_steps:  # a while loop: the interpreter cannot range() over a runtime int
            middle = (low + high) // 2
            right = tl.load(cu_ptr + middle * stride_cu).to(tl.int64) <= rows
            low = tl.where(right, middle, low)
            high = tl.where(right, high, middle)
            step += 1
        position = rows - tl.load(cu_ptr + low * stride_cu).to(tl.int64)  # [BLOCK_ROWS] request-local position
        column = position // BLOCK_SIZE
        listed = row_ok & (column.to(tl.uint64) < table_columns.to(tl.uint64))
        page_id = tl.load(block_table_ptr + low.to(tl.int64) * stride_bt_request + column * stride_bt_block,
                          mask=listed, other=-1)
        readable = page_id.to(tl.uint32) < num_blocks.to(tl.uint32)  # [BLOCK_ROWS]
        page = cache_ptr + page_id.to(tl.int64) * page_stride  # [BLOCK_ROWS]
        token = position % BLOCK_SIZE
        values_out = values_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
        scales_out = scales_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)

        byte = tl.arange(0, BLOCK_V)
        byte_mask = row_ok[:, None] & (byte < VALUE_BYTES)[None, :]
        values = tl.load(page[:, None] + token[:, None] * VALUE_BYTES + byte[None, :],
                         mask=byte_mask & readable[:, None], other=0)
        tl.store(values_out + rows[:, None] * stride_values_row + byte[None, :] * stride_values_byte, values,
                 mask=byte_mask)  # [BLOCK_ROWS, BLOCK_V]

        byte = tl.arange(0, BLOCK_S)
        byte_mask = row_ok[:, None] & (byte < SCALE_BYTES)[None, :]
        scale_rows = page + BLOCK_SIZE * VALUE_BYTES + token * SCALE_BYTES  # [BLOCK_ROWS]
        scales = tl.load(scale_rows[:, None] + byte[None, :], mask=byte_mask & readable[:, None], other=0)
        tl.store(scales_out + rows[:, None] * stride_scales_row + byte[None, :] * stride_scales_byte, scales,
                 mask=byte_mask)  # [BLOCK_ROWS, BLOCK_S]


def insert_k_triton(
    k: torch.Tensor,
    cache: KCacheLayout,
    slot_mapping: torch.Tensor,
    *,
    scale_fmt: str,
    amax_floor: float,
    config: InsertConfig | None = None,
) -> None:
    """Triton twin of ``insert_k_reference``; ``config`` overrides ``insert_config(cache.fmt)`` (tests,
    benchmarks). The bf16-pair encode applies to bf16 ``k`` with unit dim stride, even row stride, 4-byte
    aligned, and a cache whose buffer and page stride are 4-byte aligned (other ``k`` take the fp32 path).

    Rows sharing a slot are written in no promised order. No host synchronisation.
    """
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    mxfp4 = cache.fmt == "mxfp4"
    config = config or insert_config(cache.fmt)
    words_ok = (k.dtype == torch.bfloat16 and k.stride(1) == 1 and k.stride(0) % 2 == 0 and k.data_ptr() % 4 == 0
                and cache.buffer.data_ptr() % 4 == 0 and cache.page_stride % 4 == 0)  # 4-byte loads and stores
    _insert_k_kernel[(triton.cdiv(num_tokens, config.block_tokens),)](
        k, slot_mapping, cache.buffer,
        num_tokens, cache.num_slots, k.stride(0), k.stride(1), slot_mapping.stride(0),
        cache.page_stride, amax_floor,
        BLOCK_SIZE=cache.block_size, HEAD_DIM=cache.head_dim, BLOCK_D=triton.next_power_of_2(cache.head_dim),
        MXFP4=mxfp4, MXFP8=cache.scale_fmt == "mxfp8", UE8M0=scale_fmt == "ue8m0", BLOCK_T=config.block_tokens,
        BF16X2=mxfp4 and config.bf16x2 and words_ok,
        INTERPRETER=interpreting(),
        num_warps=config.num_warps, enable_fp_fusion=False,
    )


def gather_k_triton(
    cache: KCacheLayout,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    values_out: torch.Tensor,
    scales_out: torch.Tensor,
    *,
    config: GatherConfig | None = None,
) -> None:
    """Triton twin of ``gather_k_reference``; ``config`` overrides ``GatherConfig()`` (tests, benchmarks).

    Any destination strides. No host synchronisation: the grid covers ``values_out``'s rows.
    """
    num_rows = values_out.shape[0]
    num_requests = block_table.shape[0]
    if num_rows == 0 or num_requests == 0 or cache.num_blocks == 0:
        return
    if scales_out.dtype == torch.float32:  # FP8 fp32 scale words, copied as their 4 bytes
        stride_scales_row, stride_scales_byte = scales_out.stride(0) * scales_out.element_size(), 1
    else:
        stride_scales_row, stride_scales_byte = scales_out.stride(0), scales_out.stride(1)
    config = config or GatherConfig()
    _gather_k_kernel[(triton.cdiv(num_rows, config.block_rows),)](
        cache.buffer, block_table, cu_seq_lens, values_out, scales_out,
        num_requests, num_requests.bit_length(), cu_seq_lens.stride(0), num_rows, block_table.shape[1], cache.num_blocks,
        block_table.stride(0), block_table.stride(1), cache.page_stride,
        values_out.stride(0), values_out.stride(1), stride_scales_row, stride_scales_byte,
        BLOCK_SIZE=cache.block_size, VALUE_BYTES=cache.value_bytes, SCALE_BYTES=cache.scale_bytes,
        BLOCK_V=triton.next_power_of_2(cache.value_bytes), BLOCK_S=triton.next_power_of_2(cache.scale_bytes),
        BLOCK_ROWS=config.block_rows,
        num_warps=config.num_warps,
    )
