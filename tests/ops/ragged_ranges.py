"""Row ranges ``(ks, ke)`` for ragged prefill logits, shared by the reference and kernel tests."""

from __future__ import annotations

import torch


def causal_ranges(num_rows: int, num_keys: int) -> list[tuple[int, int]]:
    """Row ``i`` of the last ``num_rows`` queries sees keys ``[0, num_keys - num_rows + 1 + i)``."""
    return [(0, max(0, num_keys - num_rows + 1 + i)) for i in range(num_rows)]


def varied_ranges(num_rows: int, num_keys: int, seed: int) -> list[tuple[int, int]]:
    """Empty rows (at 0, inside, at the end), full rows, rows touching either end, random windows."""
    fixed = [(0, 0), (0, num_keys), (num_keys, num_keys), (num_keys - 1, num_keys), (0, 1), (3, 3)]
    gen = torch.Generator().manual_seed(seed)
    ranges = []
    for row in range(num_rows):
        if row < len(fixed):
            ranges.append(fixed[row])
        else:
            a, b = sorted(torch.randint(0, num_keys + 1, (2,), generator=gen).tolist())
            ranges.append((a, b))
    return ranges
