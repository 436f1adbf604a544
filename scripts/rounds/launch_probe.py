"""Session 10 probe: the decode timed as the anchors were (do_bench: a 256 MB memset, then the kernel launched directly,
events around it) against the suites' cold CUDA-graph replay, and the launchers' host time (is the launch queued
behind the memset?). Prints a table."""
import time

import torch
import triton.testing

from dsa_indexer.bench import harness
from dsa_indexer.bench.suite_logits import PAGE, _decode_case, _decode_pool, decode_floor
from dsa_indexer.ops.logits import triton as kernels
from dsa_indexer.ops.logits.gluon_decode import gluon_decode_config, paged_mqa_logits_gluon

ceilings = harness.measure_ceilings()
gen = torch.Generator().manual_seed(1)
cache = _decode_pool("fp8", 32 * 32768 // PAGE + 64)
tiny = torch.zeros(1, device="cuda")


def host_us(call, reps=200):
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    elapsed = (time.perf_counter() - start) / reps * 1e6
    torch.cuda.synchronize()
    return elapsed


def row(name, call, floor_us):
    graph = harness.cold_graph_us(call)
    eager = [triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median") * 1e3 for _ in range(3)]
    host = host_us(call)
    pct = "" if floor_us is None else f"{100 * floor_us / min(eager):6.1f} {100 * floor_us / graph:6.1f}"
    print(f"{name:34} graph {graph:7.2f}  do_bench {' '.join(f'{e:7.2f}' for e in eager)}  host {host:6.1f}  {pct}",
          flush=True)


print("read", round(ceilings["read_tbs"], 2), "TB/s; columns: cold graph µs, do_bench µs (3 runs), launcher host µs,"
      " % of floor by the best do_bench and by the graph")
row("empty (tiny.add_)", lambda: tiny.add_(1), None)
for batch, length, next_n in [(1, 131072, 1), (1, 131072, 2), (32, 32768, 1), (32, 32768, 2)]:
    _, _, _, _, args = _decode_case(cache, batch, length, next_n, gen)
    out = torch.empty((batch * next_n, length), device="cuda")
    floor_us = decode_floor("fp8", batch, length, next_n, ceilings)["floor_us"]
    config = gluon_decode_config(batch, next_n, length)
    row(f"B={batch} L={length} n={next_n} gluon", lambda: paged_mqa_logits_gluon(*args, True, out, config=config),
        floor_us)
    if batch == 1:
        row(f"B={batch} L={length} n={next_n} triton", lambda: kernels.paged_mqa_logits_triton(*args, True, out),
            floor_us)
