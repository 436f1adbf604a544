"""Key splits of the decode kernels: how many key tiles one program (or work item) covers, from host integers.

The Triton decode kernels (``ops.logits``, ``ops.sparse_logits``) take power-of-two splits (``split_tiles``, a
compile-time constant); the Gluon ones may take one-wave splits of any size (``wave_split``, a runtime value).
Nothing is read back from the device.
"""

from __future__ import annotations

import torch
import triton

from .runtime import sm_count


def split_tiles(work_groups: int, key_tiles: int, device: torch.device, per_sm: int, lo: int, hi: int) -> int:
    """Key tiles per split, a power of two: about ``per_sm`` programs per SM over the whole call, within
    ``[lo, hi]`` and no more than one request needs (``key_tiles``); ``work_groups`` programs share a split."""
    tiles = min(hi, triton.next_power_of_2(key_tiles),
                max(lo, triton.cdiv(work_groups * key_tiles, sm_count(device) * per_sm)))
    return triton.next_power_of_2(tiles)


def wave_split(work_groups: int, key_tiles: int, per_sm: int, sms: int) -> tuple[int, float]:
    """One wave of one-item programs, ``per_sm`` a SM: (key tiles per split, any count: each row group's tiles
    in as many even splits as the wave's slots allow; the share of the slots of the waves the items take, so
    more row groups than slots, which need a second, partly empty wave, count as a poor fill)."""
    slots = per_sm * sms
    tiles = triton.cdiv(key_tiles, max(1, slots // work_groups))
    items = work_groups * triton.cdiv(key_tiles, tiles)
    return tiles, items / (triton.cdiv(items, slots) * slots)
