"""Decode context parallelism: the exact global top-k merge and the DCP decode step (``ops/dcp/README.md``).

Each rank of ``W`` holds ``1/W`` of every row's columns (interleave 1) and runs its local top-k first.
With >= 2 GPUs (NCCL, one GPU per rank, ``W = 2``): ``merge_topk_global`` captured, whole and per stage
(``pack_us``, ``gather_us``, ``select_us``) beside the local top-k and the single-GPU top-k of the whole rows;
floor: the bytes one rank receives at the NVLink bandwidth measured in the same run (``nvlink_gbs``); and
``decode_step``: one graph of the local paged logits over ``L / W`` keys, the local top-k and the merge, beside
the same step over all ``L`` keys on one GPU. Graphs with collectives replay the same number of times on every
rank, each after a 256 MB memset and a small all-reduce that lines the GPUs up (untimed); median, maximum
over ranks. On one GPU the ranks are simulated (every rank's shard, local top-k and pack on the one GPU, the
all-gather replaced by device copies): ``merge_topk_global_1gpu`` for ``W`` = 2, 4, 8 and ``decode_step_1gpu``.
Merged ids are checked bitwise against the single-GPU top-k before timing.
"""

from __future__ import annotations

import statistics
import sys

import torch

from . import harness

WIDTH = 131072
ROWS = (32, 64)
K = 2048
WORLD = 2
SIMULATED_WORLDS = (2, 4, 8)
STEP = (32, 131072, 2, 2048, "fp8")
REPLAYS = 100
NVLINK_PROBE_BYTES = 32 << 20


def _rows(rows: int, width: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, width, generator=gen).to(device)
    lengths = torch.randint(int(0.8 * width), width + 1, (rows,), generator=gen).to(torch.int32).to(device)
    return logits, lengths


def _shard(logits: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    from dsa_indexer.dcp_positions import global_to_local

    owner, local = global_to_local(torch.arange(logits.shape[1], device=logits.device), world, 1)
    mine = (owner == rank).nonzero().squeeze(1)
    return logits[:, mine[local[mine].argsort()]].contiguous()


def _merge_bytes(world: int, rows: int, k: int) -> int:
    """What one rank receives in the all-gather: the other ranks' int64 keys."""
    return (world - 1) * rows * k * 8


def _local_stage_bytes(world: int, rows: int, k: int) -> int:
    """HBM bytes of pack (ids and scores read, keys written) and select (keys read, lists, ids written)."""
    return rows * k * (4 + 4 + 8) + world * rows * k * (8 + 4 + 4) + rows * k * 4


# One GPU: ranks simulated.

def _simulated_merge(world: int, rows: int, width: int, k: int, ceilings: dict[str, float]) -> dict:
    from dsa_indexer import topk_decode
    from dsa_indexer.dcp_positions import local_lengths
    from dsa_indexer.ops.dcp import pack_candidate_keys, select_global_topk_keys

    logits, lengths = _rows(rows, width)
    gathered = torch.empty(world, rows, k, dtype=torch.int64, device="cuda")
    scratch = torch.empty(world * rows * k, dtype=torch.int32, device="cuda")
    shards = []
    for rank in range(world):
        shard = _shard(logits, rank, world)
        shard_lengths = local_lengths(lengths, rank, world, 1)
        local = topk_decode(shard, shard_lengths, 1, k)
        pack_candidate_keys(shard, local, rank, world, 1, out=gathered[rank])
        shards.append((shard, shard_lengths, local))
    others = gathered[1:].clone()
    merged = torch.empty(rows, k, dtype=torch.int32, device="cuda")
    single_topk = topk_decode(logits, lengths, 1, k)
    shard, shard_lengths, local = shards[0]
    send = torch.empty(rows, k, dtype=torch.int64, device="cuda")

    def pack():
        pack_candidate_keys(shard, local, 0, world, 1, out=send)

    def copy():  # the all-gather's writes into this rank's buffer
        gathered[0].copy_(send)
        gathered[1:].copy_(others)

    def select():
        select_global_topk_keys(gathered, k, out=merged, scratch=scratch)

    def merge():
        pack()
        copy()
        select()

    merge()
    if not torch.equal(merged, single_topk):
        raise AssertionError(f"simulated merge (world {world}, rows {rows}) differs from the single-GPU top-k")
    local_out = torch.empty_like(merged)
    stages = {name: harness.cold_graph_us(fn) for name, fn in
              (("pack", pack), ("copy", copy), ("select", select), ("merge", merge))}
    merge_graph_ids = merged.clone()
    if not torch.equal(merge_graph_ids, single_topk):
        raise AssertionError(f"captured simulated merge (world {world}, rows {rows}) differs from the single-GPU top-k")
    local_us = harness.cold_graph_us(lambda: topk_decode(shard, shard_lengths, 1, k, out=local_out))
    single_us = harness.cold_graph_us(lambda: topk_decode(logits, lengths, 1, k, out=local_out))
    floor = _local_stage_bytes(world, rows, k) / (ceilings["copy_tbs"] * 1e6)
    return harness.record(
        "merge_topk_global_1gpu", {"world": world, "rows": rows, "L": width, "k": k},
        stages["pack"] + stages["select"], floor, baselines={"single_gpu_topk": single_us},
        collective="device copies (ranks simulated on 1 GPU)", pack_us=round(stages["pack"], 2),
        copy_us=round(stages["copy"], 2), select_us=round(stages["select"], 2),
        merge_graph_us=round(stages["merge"], 2), local_topk_us=round(local_us, 2),
        pack_select_pct_of_local_topk=round(100 * (stages["pack"] + stages["select"]) / local_us, 1),
    )


def _step_inputs(batch: int, length: int, next_n: int, fmt: str, world: int, rank: int):
    """Rank ``rank``'s decode inputs: a cache of its ``L / W`` keys per request and its local lengths."""
    from dsa_indexer.dcp_positions import local_lengths

    from .suite_step import decode_inputs

    q, q_scale, cache, weights, lens, table = decode_inputs(batch, length // world, next_n, fmt,
                                                      torch.Generator().manual_seed(rank))
    global_lens = torch.tensor([length - next_n + 1 + t for t in range(next_n)], dtype=torch.int32).repeat(batch, 1)
    lens = local_lengths(global_lens, rank, world, 1).cuda()
    return q, q_scale, cache, weights, lens, table


def _simulated_step(ceilings: dict[str, float]) -> dict:
    import dsa_indexer as dsa
    from dsa_indexer.ops.dcp import pack_candidate_keys, select_global_topk_keys

    from .suite_step import decode_inputs

    batch, length, next_n, k, fmt = STEP
    rows = batch * next_n
    q, q_scale, cache, weights, lens, table = decode_inputs(batch, length, next_n, fmt, torch.Generator().manual_seed(0))
    logits = torch.empty(rows, length, device="cuda")
    picks = torch.empty(rows, k, dtype=torch.int32, device="cuda")

    def single_step():
        dsa.paged_mqa_logits(q, q_scale, cache, weights, lens, table, length, out=logits)
        dsa.topk_decode(logits, lens, next_n, k, out=picks)

    single_us = harness.cold_graph_us(single_step)
    del q, q_scale, cache, weights, logits
    torch.cuda.empty_cache()

    q, q_scale, cache, weights, lens, table = _step_inputs(batch, length, next_n, fmt, WORLD, 0)
    width = length // WORLD
    logits = torch.empty(rows, width, device="cuda")
    send = torch.empty(rows, k, dtype=torch.int64, device="cuda")
    gathered = torch.empty(WORLD, rows, k, dtype=torch.int64, device="cuda")
    scratch = torch.empty(WORLD * rows * k, dtype=torch.int32, device="cuda")
    dsa.paged_mqa_logits(q, q_scale, cache, weights, lens, table, width, out=logits)
    dsa.topk_decode(logits, lens, next_n, k, out=picks)
    # The other rank's keys: this rank's picks of other rows, as rank 1's ids (distinct ids, other scores).
    others = pack_candidate_keys(logits.roll(1, 0), picks.roll(1, 0), 1, WORLD, 1).unsqueeze(0)

    def dcp_step():
        dsa.paged_mqa_logits(q, q_scale, cache, weights, lens, table, width, out=logits)
        dsa.topk_decode(logits, lens, next_n, k, out=picks)
        pack_candidate_keys(logits, picks, 0, WORLD, 1, out=send)
        gathered[0].copy_(send)
        gathered[1:].copy_(others)
        select_global_topk_keys(gathered, k, out=picks, scratch=scratch)

    dcp_us = harness.cold_graph_us(dcp_step)
    moved = batch * width * 132 + rows * width * 4 * 2
    return harness.record(
        "decode_step_1gpu", {"B": batch, "L": length, "next_n": next_n, "k": k, "fmt": fmt, "world": WORLD},
        dcp_us, moved / (ceilings["read_tbs"] * 1e6), baselines={"single_gpu_step": single_us},
        collective="device copies (rank 0 of 2 simulated on 1 GPU)",
    )


def _simulated_ranks(ceilings: dict[str, float]) -> list[dict]:
    rows_out = [_simulated_merge(world, rows, WIDTH, K, ceilings) for rows in ROWS for world in SIMULATED_WORLDS]
    rows_out.append(_simulated_step(ceilings))
    return rows_out


# Two GPUs and more: NCCL.

def _lockstep_us(graph: torch.cuda.CUDAGraph, flush: torch.Tensor, line_up: torch.Tensor) -> float:
    """Median µs of ``REPLAYS`` replays of a graph holding collectives, every rank replaying in turn."""
    import torch.distributed as dist

    times = []
    for _ in range(REPLAYS + 10):
        flush.zero_()
        dist.all_reduce(line_up)
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
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def _rank_timings(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import dsa_indexer as dsa
    from dsa_indexer.dcp_positions import local_lengths
    from dsa_indexer.distributed import DcpMergeWorkspace, merge_topk_global
    from dsa_indexer.ops.dcp import pack_candidate_keys, select_global_topk_keys

    from .suite_step import decode_inputs

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    line_up = torch.zeros(1, device="cuda")

    def timed(call) -> float:
        return _lockstep_us(_captured(call), flush, line_up)

    probe = torch.empty(NVLINK_PROBE_BYTES // 8, dtype=torch.int64, device="cuda")
    probe_out = torch.empty(world * probe.numel(), dtype=torch.int64, device="cuda")
    probe_us = timed(lambda: dist.all_gather_into_tensor(probe_out, probe))
    result = {"nvlink_gbs": (world - 1) * NVLINK_PROBE_BYTES / probe_us / 1e3, "merge": {}}
    del probe, probe_out

    for rows in ROWS:
        logits, lengths = _rows(rows, WIDTH)
        shard = _shard(logits, rank, world)
        shard_lengths = local_lengths(lengths, rank, world, 1)
        local_topk = dsa.topk_decode(shard, shard_lengths, 1, K)
        workspace = DcpMergeWorkspace(rows, K, device="cuda")
        merged = local_topk.clone()
        merge_topk_global(shard, merged, K, workspace=workspace)
        expected = dsa.topk_decode(logits, lengths, 1, K)
        exact = bool(torch.equal(merged, expected))
        send, gathered = workspace.send.view(rows, K), workspace.gathered
        scratch = workspace.scratch

        def merge_step():
            merged.copy_(local_topk)
            merge_topk_global(shard, merged, K, workspace=workspace)

        timings = {
            "merge": timed(merge_step),
            "restore": timed(lambda: merged.copy_(local_topk)),
            "pack": timed(lambda: pack_candidate_keys(shard, local_topk, rank, world, 1, out=send)),
            "gather": timed(lambda: dist.all_gather_into_tensor(gathered, workspace.send)),
            "select": timed(lambda: select_global_topk_keys(gathered.view(world, rows, K), K, out=merged,
                                                            scratch=scratch)),
        }
        merge_step()
        exact &= bool(torch.equal(merged, expected))
        out = torch.empty_like(merged)
        timings["local"] = harness.cold_graph_us(lambda: dsa.topk_decode(shard, shard_lengths, 1, K, out=out))
        timings["single"] = harness.cold_graph_us(lambda: dsa.topk_decode(logits, lengths, 1, K, out=out))
        timings["exact"] = exact
        result["merge"][rows] = timings
        del logits, shard, workspace
        torch.cuda.empty_cache()

    batch, length, next_n, k, fmt = STEP
    rows = batch * next_n
    q, q_scale, cache, weights, lens, table = decode_inputs(batch, length, next_n, fmt, torch.Generator().manual_seed(0))
    logits = torch.empty(rows, length, device="cuda")
    picks = torch.empty(rows, k, dtype=torch.int32, device="cuda")

    def single_step():
        dsa.paged_mqa_logits(q, q_scale, cache, weights, lens, table, length, out=logits)
        dsa.topk_decode(logits, lens, next_n, k, out=picks)

    result["single_step"] = harness.cold_graph_us(single_step)
    del q, q_scale, cache, weights, logits
    torch.cuda.empty_cache()
    q, q_scale, cache, weights, lens, table = _step_inputs(batch, length, next_n, fmt, world, rank)
    width = length // world
    logits = torch.empty(rows, width, device="cuda")
    workspace = DcpMergeWorkspace(rows, k, device="cuda")

    def dcp_step():
        dsa.paged_mqa_logits(q, q_scale, cache, weights, lens, table, width, out=logits)
        dsa.topk_decode(logits, lens, next_n, k, out=picks)
        merge_topk_global(logits, picks, k, workspace=workspace)

    result["dcp_step"] = timed(dcp_step)
    return result


def run(ceilings: dict[str, float]) -> list[dict]:
    from dsa_indexer.testing import run_distributed

    rows_out = _simulated_ranks(ceilings)
    torch.cuda.empty_cache()  # the ranks' processes need the memory of GPU 0
    if torch.cuda.device_count() < WORLD:
        print(f"distributed: ranks simulated on 1 GPU only; the NCCL merge and the DCP step need >= {WORLD} GPUs "
              f"(this machine has {torch.cuda.device_count()})", file=sys.stderr)
        return rows_out
    per_rank = run_distributed(_rank_timings, WORLD, backend="nccl", timeout_s=900)
    nvlink_gbs = min(r["nvlink_gbs"] for r in per_rank)
    for rows in ROWS:
        timings = [r["merge"][rows] for r in per_rank]
        if not all(t["exact"] for t in timings):
            raise AssertionError(f"merged top-k differs from the single-GPU top-k at rows={rows}")
        slowest = {key: max(t[key] for t in timings) for key in ("merge", "restore", "pack", "gather", "select",
                                                                  "local", "single")}
        merge_us = max(slowest["merge"] - slowest["restore"], 0.0)
        moved = _merge_bytes(WORLD, rows, K)
        rows_out.append(harness.record(
            "merge_topk_global", {"world": WORLD, "rows": rows, "L": WIDTH, "k": K}, merge_us,
            moved / (nvlink_gbs * 1e3), baselines={"single_gpu_topk": slowest["single"]},
            local_topk_us=round(slowest["local"], 2), local_plus_merge_us=round(slowest["local"] + merge_us, 2),
            merge_pct_of_local_topk=round(100 * merge_us / slowest["local"], 1),
            pack_us=round(slowest["pack"], 2), gather_us=round(slowest["gather"], 2),
            select_us=round(slowest["select"], 2), bytes_moved=moved, nvlink_gbs=round(nvlink_gbs, 1),
            merge_graph_us=round(slowest["merge"], 2), restore_us=round(slowest["restore"], 2),
        ))
    batch, length, next_n, k, fmt = STEP
    dcp_us = max(r["dcp_step"] for r in per_rank)
    moved = batch * (length // WORLD) * 132 + batch * next_n * (length // WORLD) * 4 * 2
    rows_out.append(harness.record(
        "decode_step", {"B": batch, "L": length, "next_n": next_n, "k": k, "fmt": fmt, "world": WORLD}, dcp_us,
        moved / (ceilings["read_tbs"] * 1e6), baselines={"single_gpu_step": max(r["single_step"] for r in per_rank)},
        collective="nccl",
    ))
    return rows_out
