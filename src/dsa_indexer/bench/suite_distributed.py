"""Decode context parallelism: the exact global top-k merge beside the local top-k (issue 7; >= 2 GPUs).

Each of ``W`` ranks (NCCL, one GPU each) holds ``1/W`` of every row's columns (interleave 1), runs the
local top-k on its shard and then ``merge_topk_global`` (pack, all-gather, select). Before timing, the
merged ids are checked against the single-GPU top-k of the whole rows (bitwise). Times are medians of
CUDA events around each call (collectives cannot be replayed per rank by ``do_bench``: ranks would
disagree on the repetition count), maximum over ranks. The floor of the merge is the all-gather alone
of the bytes it exchanges (score and id per candidate), timed the same way; the local top-k is timed
with ``do_bench`` (cold L2).
"""

from __future__ import annotations

import statistics

import torch

from . import harness

WIDTH = 131072
ROWS = (32, 64)
K = 2048
ITERATIONS = 50


def _event_median_us(call, iterations: int = ITERATIONS, before=None) -> float:
    times = []
    for _ in range(iterations + 5):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[5:])


def _rank_timings(rank: int, world: int, rows: int, width: int, k: int) -> dict:
    import os

    import torch.distributed as dist

    from dsa_indexer import topk_decode
    from dsa_indexer.distributed import global_to_local, local_lengths, merge_topk_global

    gen = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, width, generator=gen).cuda()
    lengths = torch.randint(int(0.8 * width), width + 1, (rows,), generator=gen).to(torch.int32).cuda()
    owner, local = global_to_local(torch.arange(width, device="cuda"), world, 1)
    mine = (owner == rank).nonzero().squeeze(1)
    shard = logits[:, mine[local[mine].argsort()]].contiguous()
    shard_lengths = local_lengths(lengths, rank, world, 1)
    local_topk = topk_decode(shard, shard_lengths, 1, k)
    merged = local_topk.clone()
    merge_topk_global(shard, merged, k)
    exact = bool(torch.equal(merged, topk_decode(logits, lengths, 1, k)))

    local_us = harness.median_us(lambda: topk_decode(shard, shard_lengths, 1, k, out=merged))
    single_gpu_us = harness.median_us(lambda: topk_decode(logits, lengths, 1, k))

    def reset():
        merged.copy_(local_topk)

    merge_us = _event_median_us(lambda: merge_topk_global(shard, merged, k), before=reset)
    os.environ["DSA_INDEXER_SKIP_VALUE_CHECKS"] = "1"
    unchecked_us = _event_median_us(lambda: merge_topk_global(shard, merged, k), before=reset)
    del os.environ["DSA_INDEXER_SKIP_VALUE_CHECKS"]
    payload = torch.empty(rows, k, 3, dtype=torch.int32, device="cuda")
    gathered = torch.empty(world, rows, k, 3, dtype=torch.int32, device="cuda")
    gather_us = _event_median_us(lambda: dist.all_gather_into_tensor(gathered, payload))
    return {"exact": exact, "local": local_us, "single": single_gpu_us, "merge": merge_us,
            "unchecked": unchecked_us, "gather": gather_us}


def run(ceilings: dict[str, float]) -> list[dict]:
    from dsa_indexer.testing import run_distributed

    world = 2
    if torch.cuda.device_count() < world:
        raise ValueError(f"the distributed suite needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    rows_out = []
    for rows in ROWS:
        per_rank = run_distributed(_rank_timings, world, rows, WIDTH, K, backend="nccl", timeout_s=600)
        if not all(r["exact"] for r in per_rank):
            raise AssertionError(f"merged top-k differs from the single-GPU top-k at rows={rows}")
        slowest = {key: max(r[key] for r in per_rank) for key in ("local", "single", "merge", "unchecked", "gather")}
        rows_out.append(harness.record(
            "merge_topk_global", {"world": world, "rows": rows, "L": WIDTH, "k": K}, slowest["merge"],
            slowest["gather"], baselines={"single_gpu_topk": slowest["single"]},
            local_topk_us=round(slowest["local"], 2), merge_without_value_checks_us=round(slowest["unchecked"], 2),
            step_us=round(slowest["local"] + slowest["unchecked"], 2),
        ))
    return rows_out
