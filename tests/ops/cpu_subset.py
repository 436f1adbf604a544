"""Parameter lists whose variant cases run on the GPU machine only.

The interpreter takes seconds per kernel-variant case; ``make test`` (CI, 2 cores) runs the cases named in
``keep`` and leaves the others, marked ``slow``, to ``scripts/gpu-check``, which runs every test on CUDA.
"""

from __future__ import annotations

import pytest


def cpu_subset(values, ids, keep) -> list:
    """``values`` as ``pytest.param``s named by ``ids``; those whose id is not in ``keep`` are marked slow."""
    unknown = set(keep) - set(ids)
    assert not unknown, f"cpu_subset keeps unknown ids {sorted(unknown)}"
    return [pytest.param(value, id=name, marks=() if name in keep else pytest.mark.slow)
            for value, name in zip(values, ids)]
