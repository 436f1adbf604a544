"""Decode context parallelism: the exact global top-k merge beside the local top-k (issue 7; >= 2 GPUs).

Each of ``W`` ranks (NCCL, one GPU each) holds ``1/W`` of every row's columns (interleave 1), runs the
local top-k on its shard and then ``merge_topk_global`` (pack, all-gather, select). Before timing, the
merged ids are checked against the single-GPU top-k of the whole rows (bitwise). Everything is timed as
an engine runs decode: CUDA-graph replays (the merge's collectives captured too; capture skips the
host-reading argument exchange). The merge graph also restores the local ids it overwrites (a 0.25-0.5
MB copy). Merge and all-gather graphs are replayed a fixed number of times on every rank (collectives
must match), timed with events, median, maximum over ranks; the local top-k uses ``do_bench`` graph
replays. The floor of the merge is the captured all-gather alone of the bytes it exchanges (score and
id per candidate).
"""

from __future__ import annotations

import statistics

import torch

from . import harness

WIDTH = 131072
ROWS = (32, 64)
K = 2048
REPLAYS = 100


def _replay_median_us(graph: torch.cuda.CUDAGraph) -> float:
    times = []
    for _ in range(REPLAYS + 10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[10:])


def _captured(call) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def _rank_timings(rank: int, world: int, rows: int, width: int, k: int) -> dict:
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

    local_us = harness.median_us(lambda: topk_decode(shard, shard_lengths, 1, k, out=merged), graph=True)
    single_gpu_us = harness.median_us(lambda: topk_decode(logits, lengths, 1, k), graph=True)

    def merge_step():
        merged.copy_(local_topk)
        merge_topk_global(shard, merged, k)

    merge_graph = _captured(merge_step)
    payload = torch.empty(rows, k, 3, dtype=torch.int32, device="cuda")
    gathered = torch.empty(world, rows, k, 3, dtype=torch.int32, device="cuda")
    gather_graph = _captured(lambda: dist.all_gather_into_tensor(gathered, payload))
    merge_us = _replay_median_us(merge_graph)
    exact &= bool(torch.equal(merged, topk_decode(logits, lengths, 1, k)))
    return {"exact": exact, "local": local_us, "single": single_gpu_us, "merge": merge_us,
            "gather": _replay_median_us(gather_graph)}


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
        slowest = {key: max(r[key] for r in per_rank) for key in ("local", "single", "merge", "gather")}
        rows_out.append(harness.record(
            "merge_topk_global", {"world": world, "rows": rows, "L": WIDTH, "k": K}, slowest["merge"],
            slowest["gather"], baselines={"single_gpu_topk": slowest["single"]},
            local_topk_us=round(slowest["local"], 2), local_plus_merge_us=round(slowest["local"] + slowest["merge"], 2),
        ))
    return rows_out
