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
    """Yield ``{(launch, address): {program id, ...}}``, filled by every masked store of the kernels run inside
    (``launch`` counts the kernel launches from 0: launches run in order, so only the programs of one launch can
    race)."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    builder = getattr(interpreter, "InterpreterBuilder", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if builder is None or not hasattr(builder, "create_masked_store") or executor is None:
        pytest.skip("this Triton's interpreter has no InterpreterBuilder.create_masked_store / GridExecutor to hook")
    writes: dict[tuple[int, int], set] = collections.defaultdict(set)
    launches = [-1]
    original_store, original_call = builder.create_masked_store, executor.__call__

    def store(self, ptrs, value, mask, *args):
        for address in np.unique(ptrs.data[mask.data.astype(bool)]):
            writes[launches[0], int(address)].add(self.grid_idx)
        return original_store(self, ptrs, value, mask, *args)

    def call(self, *args, **kwargs):
        launches[0] += 1
        return original_call(self, *args, **kwargs)

    builder.create_masked_store, executor.__call__ = store, call
    try:
        yield writes
    finally:
        builder.create_masked_store, executor.__call__ = original_store, original_call


def conflicting_writes(writes: dict[tuple[int, int], set], tensor: torch.Tensor | None = None) -> dict[tuple, set]:
    """The ``(launch, address)`` entries (inside ``tensor``'s storage, or anywhere) that more than one program of
    that launch wrote."""
    if tensor is None:
        return {key: programs for key, programs in writes.items() if len(programs) > 1}
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    return {(launch, address): programs for (launch, address), programs in writes.items()
            if start <= address < end and len(programs) > 1}
