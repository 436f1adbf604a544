"""Top-k benchmarks: decode rows of 128K columns and the rows of one causal 8K prompt.

Decode: fp32 logits ``[rows, 131072]``, row lengths uniform in ``[0.8 L, L]``, ``-inf`` past each end
(clean logits, so ``torch.topk`` over full rows is the fair "what a user writes" baseline). Prefill:
``[8192, 8192]``, row ``i`` has ``i + 1`` valid columns. Data: ``random`` (normal), ``relu_sum``
(indexer-like, half exact zeros) and ``one_bin`` (every value shares its top 22 bits).

Before timing, every shape is checked: the Triton output must equal the reference bit for bit and
``count_topk_errors`` must be 0. Times are medians of CUDA-graph replays (``harness.median_us``) of a
graph that cycles through copies of the inputs totalling more than 4x the L2, so every call starts
cold; ``warm_us`` replays one input (L2-resident when it fits). Floor: the valid logits read once at
the measured read bandwidth.

Tuning sweeps and the phase timeline live outside the package: ``benchmarks/sweeps/topk.py``.
"""

from __future__ import annotations

import torch

from dsa_indexer.ops.topk import reference
from dsa_indexer.ops.topk.triton import topk_triton
from dsa_indexer.testing import count_topk_errors, one_bin_rows, relu_sum_rows

from . import harness

ROTATION_BYTES = 256 << 20
REP_MS = 20
DECODE_L = 131072
DECODE_ROWS = (1, 32, 64, 128)
PREFILL_S = 8192
DATA = ("random", "relu_sum", "one_bin")


def _values(data: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    if data == "random":
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).cuda()
    if data == "relu_sum":
        return relu_sum_rows(shape, seed, "cuda")
    return one_bin_rows(shape, seed, "cuda")


def _clean(values: torch.Tensor, starts: torch.Tensor | None, ends: torch.Tensor) -> torch.Tensor:
    columns = torch.arange(values.shape[1], device=values.device)
    outside = columns >= ends[:, None]
    if starts is not None:
        outside |= columns < starts[:, None]
    return values.masked_fill(outside, float("-inf"))


def _decode_rows(data: str, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean decode logits ``[num_rows, DECODE_L]`` and their lengths, uniform in ``[0.8 L, L]``."""
    lengths = torch.randint(int(0.8 * DECODE_L), DECODE_L + 1, (num_rows,),
                            generator=torch.Generator().manual_seed(num_rows), dtype=torch.int32).cuda()
    return _clean(_values(data, (num_rows, DECODE_L), num_rows), None, lengths), lengths


def _cold_us(call, inputs: list[torch.Tensor], rep_ms: int = REP_MS) -> float:
    """Median graph-replay time of ``call(x)``, cycling through ``inputs``."""
    step = [0]

    def one():
        call(inputs[step[0] % len(inputs)])
        step[0] += 1

    return harness.median_us(one, graph=True, rep_ms=rep_ms)


def _measure(logits, k, starts, ends, valid_elements, ceilings):
    num_rows = logits.shape[0]
    out = torch.empty((num_rows, k), dtype=torch.int32, device="cuda")
    got = topk_triton(logits, k, starts, ends, out).clone()
    expected = reference.topk(logits, k, starts, ends, torch.empty_like(out))
    exact = torch.equal(got, expected)
    errors = count_topk_errors(logits, got, k, starts=starts, ends=ends)
    if not exact or errors:
        raise AssertionError(f"top-k not exact on {list(logits.shape)} k={k}: bitwise={exact}, errors={errors}")
    copies = max(2, -(-ROTATION_BYTES // logits.numel() // 4))
    inputs = [logits] + [logits.clone() for _ in range(copies - 1)]
    ours = _cold_us(lambda x: topk_triton(x, k, starts, ends, out), inputs)
    torch_us = _cold_us(lambda x: torch.topk(x, k, dim=1), inputs)
    warm = harness.median_us(lambda: topk_triton(logits, k, starts, ends, out), graph=True, rep_ms=REP_MS)
    del inputs
    read_bytes = 4 * valid_elements
    floor_us = read_bytes / (ceilings["read_tbs"] * 1e6)
    return ours, floor_us, read_bytes / ours / 1e6, torch_us, warm


def run(ceilings: dict[str, float]) -> list[dict]:
    rows = []
    for data in DATA:
        for num_rows in DECODE_ROWS:
            logits, lengths = _decode_rows(data, num_rows)
            for k in (2048, 512):
                us, floor_us, tbs, torch_us, warm = _measure(logits, k, None, lengths, int(lengths.sum()), ceilings)
                rows.append(harness.record("topk", {"rows": num_rows, "L": DECODE_L, "k": k, "data": data}, us,
                                           floor_us, tbs=tbs, baselines={"torch": torch_us}, warm_us=round(warm, 2)))
            del logits
        ends = torch.arange(1, PREFILL_S + 1, dtype=torch.int32, device="cuda")
        logits = _clean(_values(data, (PREFILL_S, PREFILL_S), 7), None, ends)
        for k in (2048, 512) if data == "random" else (2048,):
            us, floor_us, tbs, torch_us, warm = _measure(logits, k, None, ends, int(ends.sum()), ceilings)
            rows.append(harness.record("topk_prefill", {"S": PREFILL_S, "k": k, "data": data}, us, floor_us,
                                       tbs=tbs, baselines={"torch": torch_us}, warm_us=round(warm, 2)))
        del logits
        torch.cuda.empty_cache()
    return rows
