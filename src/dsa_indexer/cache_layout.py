"""The byte layout of the paged indexer K cache (``KCacheLayout``; ``cache.IndexerKCache`` adds its ops).

One page holds ``block_size`` tokens; its bytes are not interleaved::

    FP8:   [block_size x D  e4m3 values][block_size x 4 B scale word]         (D + 4 bytes per token)
    MXFP4: [block_size x D/2 packed e2m1][block_size x S ue8m0 scale bytes]    (D/2 + S per token)

The FP8 scale word is the fp32 scale (``scale_fmt="fp32"``) or, with ``scale_fmt="mxfp8"``, the
power-of-two scale ``2**e`` as four equal ue8m0 bytes ``e + 127``. MXFP4 has ``D/32`` scale bytes
padded with ``127`` to ``S = 4 * ceil(D / 128)`` (whole 4-byte words, DeepGEMM's layout: 36-byte
rows at D = 64, 68 at D = 128).

The buffer is ``uint8 [num_blocks, block_size, bytes_per_token]``; its page stride ``stride(0)`` may
exceed ``block_size * bytes_per_token`` when pages sit inside a larger allocation. Slot ``s`` is
token ``s % block_size`` of page ``s // block_size``.
"""

from __future__ import annotations

import torch

from ._validation import (
    check_choice,
    check_index_tensor,
    check_positive_int,
    check_same_device,
    check_tensor,
    first_true,
    value_checks_enabled,
)
from .formats import MXFP4_BLOCK, mxfp4_scale_bytes

FORMATS = ("fp8", "mxfp4")
# Scale formats each key format stores; the first is the default.
SCALE_FORMATS = {"fp8": ("fp32", "mxfp8"), "mxfp4": ("ue8m0",)}


def value_bytes_per_token(fmt: str, head_dim: int) -> int:
    return head_dim if fmt == "fp8" else head_dim // 2


def scale_bytes_per_token(fmt: str, head_dim: int) -> int:
    return 4 if fmt == "fp8" else mxfp4_scale_bytes(head_dim)


def bytes_per_token(fmt: str, head_dim: int) -> int:
    """132 for FP8 with D = 128, 68 for MXFP4 (36 at D = 64)."""
    return value_bytes_per_token(fmt, head_dim) + scale_bytes_per_token(fmt, head_dim)


class KCacheLayout:
    """Paged, quantised K cache of the indexer: its buffer and byte layout (``IndexerKCache`` adds insert and gather).

    Args:
        num_blocks: pages in the cache.
        block_size: tokens per page (64 by default).
        head_dim: K dimension D (128 for every DeepSeek configuration).
        fmt: ``"fp8"`` (e4m3 values, one scale word per token) or ``"mxfp4"`` (e2m1, ue8m0 per 32).
        scale_fmt: how scales are stored: FP8 ``"fp32"`` (default) or ``"mxfp8"`` (four equal ue8m0
            bytes; insertion then needs power-of-two scales), MXFP4 ``"ue8m0"``. ``None``: the default.
        device: where the buffer lives.
        buffer: an existing ``uint8 [num_blocks, block_size, bytes_per_token]`` view to use instead
            of allocating (its page stride may be larger than the packed page).
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        block_size: int = 64,
        head_dim: int = 128,
        fmt: str = "fp8",
        scale_fmt: str | None = None,
        device: torch.device | str | None = None,
        buffer: torch.Tensor | None = None,
    ):
        check_positive_int("num_blocks", num_blocks, minimum=0)
        check_positive_int("block_size", block_size)
        check_positive_int("head_dim", head_dim)
        check_choice("fmt", fmt, FORMATS)
        if scale_fmt is None:
            scale_fmt = SCALE_FORMATS[fmt][0]
        if scale_fmt not in SCALE_FORMATS[fmt]:
            raise ValueError(f"scale_fmt must be one of {SCALE_FORMATS[fmt]} for fmt={fmt!r}, got {scale_fmt!r}")
        if fmt == "mxfp4" and head_dim % MXFP4_BLOCK:
            raise ValueError(f"head_dim must be a multiple of {MXFP4_BLOCK} for fmt='mxfp4', got {head_dim}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.head_dim = head_dim
        self.fmt = fmt
        self.scale_fmt = scale_fmt
        self.bytes_per_token = bytes_per_token(fmt, head_dim)
        shape = (num_blocks, block_size, self.bytes_per_token)
        if buffer is None:
            buffer = torch.zeros(shape, dtype=torch.uint8, device=device)
        else:
            check_tensor("buffer", buffer, dtype=torch.uint8, shape=shape)
            if device is not None and buffer.device != torch.device(device):
                raise ValueError(f"buffer is on {buffer.device} but device={device} was requested")
            if buffer.stride(2) != 1 or buffer.stride(1) != self.bytes_per_token:
                raise ValueError(
                    f"buffer must have token stride {self.bytes_per_token} and byte stride 1, "
                    f"got strides {buffer.stride()}"
                )
            if num_blocks > 1 and buffer.stride(0) < block_size * self.bytes_per_token:
                raise ValueError(
                    f"buffer page stride must be >= {block_size * self.bytes_per_token}, got {buffer.stride(0)}"
                )
            # Kernels read the scale region as 4-byte words (fp32 FP8 scales, int32 MXFP4 scale groups).
            if num_blocks > 1 and buffer.stride(0) % 4:
                raise ValueError(f"buffer page stride must be a multiple of 4 bytes, got {buffer.stride(0)}")
            if buffer.storage_offset() % 4:
                raise ValueError(f"buffer must start 4-byte aligned, got storage offset {buffer.storage_offset()}")
        self.buffer = buffer

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes the cache's pages span in their allocation (padding between pages included)."""
        if self.num_blocks == 0:
            return 0
        return (self.num_blocks - 1) * self.page_stride + self.block_size * self.bytes_per_token

    @staticmethod
    def blocks_for(num_tokens: int, *, block_size: int = 64) -> int:
        """Pages needed to hold ``num_tokens`` keys."""
        return -(-num_tokens // block_size)

    def slots_for(self, block_table_row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """int64 ``[N]`` physical slots of request-local key ``positions [N]`` given the request's pages
        ``block_table_row [max_blocks]``: ``page * block_size + position % block_size``.

        ``positions`` are integers in ``[-1, max_blocks * block_size)``; ``-1`` (padding) gives ``-1``.
        A negative page id (an unallocated page) gives ``-1`` too, which ``insert`` skips. Page ids read
        must be ``< num_blocks``. The range checks read the values on the host (one synchronisation);
        with value checks off (``DSA_INDEXER_SKIP_VALUE_CHECKS=1``, graph capture) every position or page
        outside its range gives ``-1`` instead of an error.
        """
        check_index_tensor("block_table_row", block_table_row, ndim=1)
        check_index_tensor("positions", positions, ndim=1)
        check_same_device(block_table_row=block_table_row, positions=positions)
        positions = positions.to(torch.int64)
        capacity = block_table_row.shape[0] * self.block_size
        in_row = (positions >= 0) & (positions < capacity)
        if capacity:
            pages = block_table_row.to(torch.int64)[torch.where(in_row, positions // self.block_size, 0)]
        else:
            pages = torch.full_like(positions, -1)
        past_cache = in_row & (pages >= self.num_blocks)
        outside_row = (positions < -1) | (positions >= capacity)
        if value_checks_enabled() and any(torch.stack((outside_row.any(), past_cache.any())).tolist()):
            if bool(outside_row.any()):
                entry = first_true(outside_row)
                raise ValueError(
                    f"positions must be -1 or in [0, {capacity}) (block_table_row's {block_table_row.shape[0]} pages "
                    f"of block_size {self.block_size}), got positions[{entry}] = {int(positions[entry])}"
                )
            entry = first_true(past_cache)
            page = int(positions[entry]) // self.block_size
            raise ValueError(
                f"block_table_row entries must be < num_blocks = {self.num_blocks}, got block_table_row[{page}] = "
                f"{int(pages[entry])} (for positions[{entry}])"
            )
        live = in_row & (pages >= 0) & (pages < self.num_blocks)
        return torch.where(live, pages * self.block_size + positions % self.block_size, -1)

    @property
    def page_stride(self) -> int:
        """Bytes between consecutive pages (``buffer.stride(0)``)."""
        return self.buffer.stride(0) if self.num_blocks > 1 else self.block_size * self.bytes_per_token

    @property
    def value_bytes(self) -> int:
        return value_bytes_per_token(self.fmt, self.head_dim)

    @property
    def scale_bytes(self) -> int:
        return scale_bytes_per_token(self.fmt, self.head_dim)

    def _region(self, byte_offset: int, width: int) -> torch.Tensor:
        storage_offset = self.buffer.storage_offset() + byte_offset
        return torch.as_strided(
            self.buffer, (self.num_blocks, self.block_size, width), (self.page_stride, width, 1), storage_offset
        )

    def values_view(self) -> torch.Tensor:
        """``uint8 [num_blocks, block_size, value_bytes]``: the value bytes of every slot (a view)."""
        return self._region(0, self.value_bytes)

    def scales_view(self) -> torch.Tensor:
        """``uint8 [num_blocks, block_size, scale_bytes]``: the scale bytes of every slot (a view)."""
        return self._region(self.block_size * self.value_bytes, self.scale_bytes)

    def deepgemm_view(self) -> torch.Tensor:
        """``uint8 [num_blocks, block_size, 1, bytes_per_token]`` view that DeepGEMM-style APIs expect."""
        return torch.as_strided(
            self.buffer,
            (self.num_blocks, self.block_size, 1, self.bytes_per_token),
            (self.page_stride, self.bytes_per_token, self.bytes_per_token, 1),
            self.buffer.storage_offset(),
        )

    def op_args(self) -> tuple[torch.Tensor, int, int, str]:
        """The cache as custom-op arguments ``(buffer, block_size, head_dim, formats)``; ``formats`` is ``fmt``, or
        ``fmt:scale_fmt`` for a non-default scale format (``from_op_args`` inverts it)."""
        formats = self.fmt if self.scale_fmt == SCALE_FORMATS[self.fmt][0] else f"{self.fmt}:{self.scale_fmt}"
        return self.buffer, self.block_size, self.head_dim, formats

    @classmethod
    def from_op_args(cls, buffer: torch.Tensor, block_size: int, head_dim: int, formats: str) -> KCacheLayout:
        """The cache ``op_args`` described, without the constructor's checks (they passed when it was made)."""
        fmt, _, scale_fmt = formats.partition(":")
        layout = cls.__new__(cls)
        layout.num_blocks, layout.block_size, layout.head_dim = buffer.shape[0], block_size, head_dim
        layout.fmt, layout.scale_fmt = fmt, scale_fmt or SCALE_FORMATS[fmt][0]
        layout.bytes_per_token, layout.buffer = bytes_per_token(fmt, head_dim), buffer
        return layout

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_blocks={self.num_blocks}, block_size={self.block_size}, head_dim={self.head_dim}, "
            f"fmt={self.fmt!r}, scale_fmt={self.scale_fmt!r}, device={self.device})"
        )
