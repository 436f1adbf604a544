"""Which Triton programs write which bytes, under the interpreter: a write-write conflict between two programs is a
race on a GPU, which the interpreter (programs one at a time) otherwise hides."""

from __future__ import annotations

import collections
import contextlib

import numpy as np
import pytest
import torch


@contextlib.contextmanager
def recorded_program_writes():
    """Yield ``{address: {program id, ...}}``, filled by every masked store of the kernels run inside."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "create_masked_store"):
        pytest.skip("this Triton's interpreter has no InterpreterBuilder.create_masked_store to record")
    writes: dict[int, set] = collections.defaultdict(set)
    original = builder.create_masked_store

    def store(self, ptrs, value, mask, *args):
        for address in np.unique(ptrs.data[mask.data.astype(bool)]):
            writes[int(address)].add(self.grid_idx)
        return original(self, ptrs, value, mask, *args)

    builder.create_masked_store = store
    try:
        yield writes
    finally:
        builder.create_masked_store = original


def conflicting_writes(writes: dict[int, set], tensor: torch.Tensor) -> dict[int, set]:
    """The addresses inside ``tensor``'s storage that more than one program wrote."""
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    return {address: programs for address, programs in writes.items() if start <= address < end and len(programs) > 1}
