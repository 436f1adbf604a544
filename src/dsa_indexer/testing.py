"""Reusable oracles for tests and engines: ``calc_diff``, an exact top-k checker, adversarial logits.

The top-k checker is written independently of ``ops/topk``: per row it finds the k-th largest
selectable value by sorting in float64 (numpy), takes every entry above that threshold and the
lowest-column entries equal to it, and compares the set and structure of the output row.

Generators take ``(shape, generator, device)``; ``generator`` is a ``torch.Generator`` (CPU) or an
int seed. Values are drawn on the CPU and then moved, so a seed gives the same logits on every device.
"""

from __future__ import annotations

import datetime
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "ADVERSARIAL_GENERATORS",
    "all_equal_rows",
    "assert_topk_exact",
    "calc_diff",
    "count_topk_errors",
    "few_distinct_rows",
    "nonfinite_rows",
    "one_bin_rows",
    "relu_sum_rows",
    "run_distributed",
    "signed_zero_rows",
    "sorted_rows",
    "tiny_difference_rows",
    "with_garbage_past_ends",
]


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """``1 - 2<x, y> / (|x|^2 + |y|^2)`` in float64 over the entries finite in both.

    0 means identical, small positive values mean close. The ``-inf`` positions of ``x`` and ``y``
    must be identical (an ``AssertionError`` names the first mismatch): a masked entry is either
    masked in both or a hard failure, never averaged away. NaN and ``+inf`` entries are left out.
    Two all-zero inputs give 0.
    """
    if x.shape != y.shape:
        raise AssertionError(f"calc_diff: shapes differ, {list(x.shape)} vs {list(y.shape)}")
    x64 = x.detach().to(device="cpu", dtype=torch.float64)
    y64 = y.detach().to(device="cpu", dtype=torch.float64)
    x_masked = x64 == -math.inf
    y_masked = y64 == -math.inf
    mismatch = x_masked != y_masked
    if bool(mismatch.any()):
        position = tuple(int(i) for i in torch.nonzero(mismatch)[0])
        raise AssertionError(
            f"calc_diff: -inf masks differ, first at {position}: x = {float(x64[position])}, y = {float(y64[position])}"
        )
    both_finite = torch.isfinite(x64) & torch.isfinite(y64)
    xf = x64[both_finite]
    yf = y64[both_finite]
    denominator = float((xf * xf).sum() + (yf * yf).sum())
    if denominator == 0.0:
        return 0.0
    return 1.0 - 2.0 * float((xf * yf).sum()) / denominator


@dataclass
class _RowVerdict:
    errors: int
    problem: str


def _expected_columns(segment: np.ndarray, k: int) -> np.ndarray:
    """Window-relative columns the contract selects from one row window, ascending."""
    selectable = ~np.isnan(segment) & (segment != -np.inf)
    candidates = segment[selectable]
    picks = min(k, candidates.size)
    if picks == 0:
        return np.empty(0, dtype=np.int64)
    threshold = np.sort(candidates)[::-1][picks - 1]
    above = np.flatnonzero(selectable & (segment > threshold))
    ties = np.flatnonzero(selectable & (segment == threshold))  # ascending, so the lowest columns first
    return np.sort(np.concatenate([above, ties[: picks - above.size]]))


def _judge_row(segment: np.ndarray, row: np.ndarray, k: int) -> _RowVerdict:
    expected = _expected_columns(segment, k)
    padding_at = np.flatnonzero(row == -1)
    first_padding = int(padding_at[0]) if padding_at.size else row.size
    picked = row[row != -1]
    expected_set = set(expected.tolist())
    picked_set = set(picked.tolist())
    missing = sorted(expected_set - picked_set)
    unexpected = sorted(picked_set - expected_set)
    duplicates = picked.size - len(picked_set)
    after_padding = int(np.count_nonzero(row[first_padding:] != -1))
    descending_steps = int(np.count_nonzero(np.diff(picked) < 0))
    errors = max(len(missing), len(unexpected)) + duplicates + after_padding + descending_steps
    if errors == 0:
        return _RowVerdict(0, "")
    details = []
    if missing:
        details.append(f"missing {missing[:8]}")
    if unexpected:
        details.append(f"unexpected {unexpected[:8]}")
    if duplicates:
        details.append(f"{duplicates} duplicate(s)")
    if after_padding:
        details.append(f"{after_padding} entr(ies) after a -1")
    if descending_steps:
        details.append(f"{descending_steps} descending step(s)")
    problem = (
        f"{'; '.join(details)} (expected {expected[:16].tolist()}{'...' if expected.size > 16 else ''}, "
        f"got {row[:16].tolist()}{'...' if row.size > 16 else ''})"
    )
    return _RowVerdict(errors, problem)


def _row_verdicts(logits, indices, k, starts, ends):
    if logits.dim() != 2:
        raise AssertionError(f"logits must be 2-D, got shape {list(logits.shape)}")
    num_rows, width = logits.shape
    if tuple(indices.shape) != (num_rows, k):
        raise AssertionError(f"indices must have shape [{num_rows}, {k}], got {list(indices.shape)}")
    values = logits.detach().to(device="cpu", dtype=torch.float64).numpy()
    rows = indices.detach().to(device="cpu", dtype=torch.int64).numpy()
    lower = np.zeros(num_rows, np.int64) if starts is None else starts.detach().cpu().to(torch.int64).numpy()
    upper = np.full(num_rows, width, np.int64) if ends is None else ends.detach().cpu().to(torch.int64).numpy()
    for r in range(num_rows):
        yield r, _judge_row(values[r, lower[r] : upper[r]], rows[r], k)


def count_topk_errors(
    logits: torch.Tensor,
    indices: torch.Tensor,
    k: int,
    *,
    starts: torch.Tensor | None = None,
    ends: torch.Tensor | None = None,
) -> int:
    """Number of wrong or missing picks in ``indices [R, k]`` under the §6 contract (0 = exact).

    Per row: ``max(#expected columns absent, #output columns not expected)`` (a pick swapped for a
    wrong one counts once; out-of-range entries are unexpected), plus one per duplicate, per entry
    after the first ``-1``, and per descending step. Only ``logits[r, starts[r]:ends[r]]`` is read.
    A wrong shape raises ``AssertionError``.
    """
    return sum(verdict.errors for _, verdict in _row_verdicts(logits, indices, k, starts, ends))


def assert_topk_exact(
    logits: torch.Tensor,
    indices: torch.Tensor,
    k: int,
    *,
    starts: torch.Tensor | None = None,
    ends: torch.Tensor | None = None,
) -> None:
    """Raise ``AssertionError`` naming the first bad row and what is wrong with it, if any."""
    bad_rows = 0
    first_message = ""
    total_errors = 0
    for r, verdict in _row_verdicts(logits, indices, k, starts, ends):
        if verdict.errors:
            if not bad_rows:
                first_message = f"row {r}: {verdict.problem}"
            bad_rows += 1
            total_errors += verdict.errors
    if bad_rows:
        raise AssertionError(
            f"top-k not exact: {total_errors} error(s) in {bad_rows} row(s); first bad {first_message}"
        )


GeneratorOrSeed = torch.Generator | int
Shape = Sequence[int]


def _generator(generator: GeneratorOrSeed) -> torch.Generator:
    if isinstance(generator, torch.Generator):
        return generator
    return torch.Generator().manual_seed(generator)


def one_bin_rows(
    shape: Shape, generator: GeneratorOrSeed, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Values in ``[1, 1 + 2**-13)`` that share the top 22 bits of their fp32 pattern.

    Only the 10 low mantissa bits vary, so every entry lands in one coarse radix bin (the overflow
    case of fixed-size candidate buffers) and rows wider than 1024 hold many exact ties.
    """
    low_bits = torch.randint(0, 1 << 10, tuple(shape), generator=_generator(generator), dtype=torch.int32)
    return (low_bits | 0x3F800000).view(torch.float32).to(device)


def all_equal_rows(
    shape: Shape, generator: GeneratorOrSeed, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Every entry of a row equal to one random per-row value."""
    num_rows, width = shape
    per_row = torch.randn(num_rows, 1, generator=_generator(generator))
    return per_row.expand(num_rows, width).contiguous().to(device)


def few_distinct_rows(
    shape: Shape, generator: GeneratorOrSeed, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Entries drawn from 10 distinct values, so most picks are decided by column ties."""
    rng = _generator(generator)
    palette = torch.randn(10, generator=rng)
    return palette[torch.randint(0, 10, tuple(shape), generator=rng)].to(device)


def sorted_rows(
    shape: Shape, generator: GeneratorOrSeed, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Random rows sorted ascending (even rows) and descending (odd rows)."""
    ascending = torch.randn(tuple(shape), generator=_generator(generator)).sort(dim=1).values
    odd = torch.arange(shape[0])[:, None] % 2 == 1
    return torch.where(odd, ascending.flip(1), ascending).to(device)


def tiny_difference_rows(
    shape: Shape, generator: GeneratorOrSeed, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Distinct values ``1 + 1e-6 * j`` for a random permutation of ``j``: neighbours 1e-6 apart."""
    steps = torch.rand(tuple(shape), generator=_generator(generator), dtype=torch.float64).argsort(dim=1)
    return (1.0 + 1e-6 * steps.to(torch.float64)).to(torch.float32).to(device)


def signed_zero_rows(
    shape: Shape, generator: GeneratorOrSeed, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """About 45% ``+0.0``, 45% ``-0.0`` and 10% negative values: zeros must tie across signs."""
    rng = _generator(generator)
    draw = torch.rand(tuple(shape), generator=rng)
    negatives = -torch.rand(tuple(shape), generator=rng) - 1e-3
    zeros = torch.where(draw < 0.45, torch.tensor(0.0), torch.tensor(-0.0))
    return torch.where(draw < 0.9, zeros, negatives).to(device)


def nonfinite_rows(
    shape: Shape, generator: GeneratorOrSeed, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Normal values mixed with about 10% NaN, 5% ``+inf`` and 10% ``-inf``."""
    rng = _generator(generator)
    draw = torch.rand(tuple(shape), generator=rng)
    values = torch.randn(tuple(shape), generator=rng)
    values = torch.where(draw < 0.10, torch.tensor(math.nan), values)
    values = torch.where((draw >= 0.10) & (draw < 0.15), torch.tensor(math.inf), values)
    values = torch.where((draw >= 0.15) & (draw < 0.25), torch.tensor(-math.inf), values)
    return values.to(device)


def relu_sum_rows(
    shape: Shape, generator: GeneratorOrSeed, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Indexer-like scores ``sum_h w_h * relu(s_h)`` over 4 heads with shifted scores.

    About half the entries are exact zeros (every head's ReLU is 0), some of them ``-0.0`` from
    negative weights, and the rest are ordinary sums.
    """
    rng = _generator(generator)
    heads = 4
    scores = torch.randn(*shape, heads, generator=rng) - 1.0
    weights = torch.randn(heads, generator=rng)
    return (torch.relu(scores) * weights).sum(dim=-1).to(device)


def with_garbage_past_ends(
    logits: torch.Tensor,
    ends: torch.Tensor,
    values: Sequence[float] = (math.nan, 1e30, -math.inf),
    *,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """A copy of ``logits [R, C]`` whose columns ``>= ends[r]`` (and ``< starts[r]`` when given) hold
    garbage, cycling through ``values`` by column. Top-k must ignore them."""
    width = logits.shape[1]
    columns = torch.arange(width, device=logits.device)
    outside = columns >= ends.to(logits.device)[:, None]
    if starts is not None:
        outside |= columns < starts.to(logits.device)[:, None]
    garbage = torch.tensor(list(values), dtype=logits.dtype, device=logits.device)[columns % len(values)]
    return torch.where(outside, garbage, logits)


ADVERSARIAL_GENERATORS: dict[str, Callable[..., torch.Tensor]] = {
    "one_bin": one_bin_rows,
    "all_equal": all_equal_rows,
    "few_distinct": few_distinct_rows,
    "sorted": sorted_rows,
    "tiny_difference": tiny_difference_rows,
    "signed_zero": signed_zero_rows,
    "nonfinite": nonfinite_rows,
    "relu_sum": relu_sum_rows,
}


def _distributed_worker(rank, fn, world_size, store_path, backend, args, results_dir):
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(results_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args, backend: str = "gloo", timeout_s: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes joined in a process group.

    The group is initialised from a file store in a fresh temporary folder (no ports), on ``gloo``
    (CPU) or ``nccl`` (one GPU per rank). ``fn`` must be importable by the children (a module-level
    function). Returns the ranks' return values, in rank order; a failing rank raises here, and a run
    that exceeds ``timeout_s`` is terminated and raises ``TimeoutError``.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(
            _distributed_worker,
            args=(fn, world_size, os.path.join(folder, "store"), backend, args, folder),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.terminate()
                raise TimeoutError(f"distributed run of {getattr(fn, '__name__', fn)} exceeded {timeout_s} s")
        return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
