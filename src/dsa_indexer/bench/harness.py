"""Timing, ceilings and result records shared by the benchmark suites (DESIGN.md §12).

Times are medians of ``triton.testing.do_bench`` (which clears the L2 before every call, so decode-sized
kernels are measured cold) or of CUDA-graph replays for launches too short for event timing: after a
256 MB memset (``cold_graph_us``, the anchors' state: an L2 full of dirty lines) or cycling through buffer
sets larger than the L2 (``rotating_graph_us``, DESIGN.md §12). Ceilings
are measured in the same process: a device-to-device copy (read + write bandwidth), a read-only pass
(a reduction), an FP8 matrix product through ``torch._scaled_mm`` and a bf16 one through ``torch.mm``.
"""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

import torch


def median_us(fn, *, graph: bool = False, warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median time of ``fn()`` in microseconds (CUDA: device events)."""
    import triton.testing

    if graph:
        ms = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    else:
        ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return ms * 1e3


def cold_graph_us(fn, reps: int = 100, *, before=None) -> float:
    """Median µs of CUDA-graph replays of ``fn``, each after a 256 MB memset that evicts the L2 (or, given
    ``before``, after calling it instead: another L2 state, untimed)."""
    if before is None:
        flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
        before = flush.zero_
    return _replays_median_us(_captured([fn]), reps, before)


def _captured(calls) -> list:
    """One CUDA graph per call of ``calls``, each run once eagerly first (compilation, allocator)."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graphs = []
    for fn in calls:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graphs.append(graph)
    return graphs


def _replays_median_us(graphs: list, reps: int, before) -> float:
    """Median µs of ``reps`` replays of ``graphs`` in turn, each timed by events after ``before()``."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i, (start, end) in enumerate(events):
        before()
        start.record()
        graphs[i % len(graphs)].replay()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return times[reps // 2] * 1e3


# ~100 µs at the H200's clock: longer than the host needs to queue an event, a graph replay and an event.
_SPACER_CYCLES = 200_000


def rotating_graph_us(calls, reps: int = 100) -> float:
    """Median µs of CUDA-graph replays cycling through ``calls``, each on its own buffers (DESIGN.md §12:
    cold L2 by rotating buffers larger than it). Only a spin kernel (no memory traffic) runs between replays:
    it keeps the GPU busy while the host queues the next replay, so the timed region holds the kernels, not
    the host's launch. Each replay finds the L2 holding the previous calls' lines: its own inputs are not
    there once the buffers of the other calls exceed the L2, and the lines it evicts are clean reads and the
    previous outputs, not a flush's dirty bytes."""
    graphs = _captured(calls)
    for graph in graphs:  # one pass untimed: every replay then follows the previous call's, as timed
        graph.replay()
    return _replays_median_us(graphs, reps, lambda: torch.cuda._sleep(_SPACER_CYCLES))


def rotation_count(bytes_per_call: int, minimum: int = 2) -> int:
    """How many buffer sets ``rotating_graph_us`` cycles through: enough that the bytes of the other sets
    are at least three times this GPU's L2."""
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(minimum, 1 + -(-3 * l2_bytes // max(1, bytes_per_call)))


def measure_ceilings() -> dict[str, float]:
    """Copy and read bandwidth (TB/s) and FP8 and bf16 matmul rates (TFLOP/s) of this GPU, now."""
    n = 1 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_us = median_us(lambda: dst.copy_(src))
    words = src.view(torch.int32)
    read_us = median_us(lambda: words.max())
    size = 8192
    a = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    mm_us = median_us(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    a16 = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b16 = torch.randn(size, size, device="cuda", dtype=torch.bfloat16).t()
    mm16_us = median_us(lambda: torch.mm(a16, b16))
    del src, dst, a, b, a16, b16
    torch.cuda.empty_cache()
    return {
        "copy_tbs": 2 * n / copy_us / 1e6,
        "read_tbs": n / read_us / 1e6,
        "fp8_tflops": 2 * size**3 / mm_us / 1e6,
        "bf16_tflops": 2 * size**3 / mm16_us / 1e6,
    }


def environment() -> dict[str, str]:
    import importlib.util

    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    triton_version = "not installed"
    if importlib.util.find_spec("triton") is not None:
        import triton

        triton_version = triton.__version__
    return {
        "gpu": device,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def _significant(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant figures: a CPU's 0.0123 TFLOP/s stays visible, a GPU's 412.3 keeps a decimal."""
    return float(f"{value:.{digits}g}")


def record(op: str, shape: dict, us: float, floor_us: float, *, tflops: float | None = None,
           tbs: float | None = None, baselines: dict[str, float] | None = None, **extra) -> dict:
    """One result row in the committed JSON format."""
    row = {
        "op": op,
        "shape": shape,
        "us": round(us, 2),
        "floor_us": round(floor_us, 2),
        "pct_of_floor": round(100 * floor_us / us, 1) if us else None,
        "tflops": None if tflops is None else _significant(tflops),
        "tbs": None if tbs is None else _significant(tbs),
        "baselines": {name: round(value, 2) for name, value in (baselines or {}).items()},
    }
    row.update(environment())
    row.update(extra)
    return row


_STANDARD_KEYS = {"op", "shape", "us", "floor_us", "pct_of_floor", "tflops", "tbs", "baselines", "gpu", "torch", "triton",
                  "python", "date"}


def render_markdown(name: str, payload: dict) -> str:
    """The Markdown table of a results JSON: one row per record, extra record fields in ``notes``."""
    env = payload["environment"]
    ceilings = payload["ceilings"]
    lines = [
        f"# {name}", "",
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}. "
        f"Ceilings measured in the same run: copy {ceilings['copy_tbs']:.2f} TB/s, read {ceilings['read_tbs']:.2f} TB/s, "
        f"FP8 matmul {ceilings['fp8_tflops']:.0f} TFLOP/s"
        + (f", bf16 matmul {ceilings['bf16_tflops']:.0f} TFLOP/s." if "bf16_tflops" in ceilings else "."), "",
        "| op | shape | µs | floor µs | % of floor | TFLOP/s | TB/s | baselines (µs) | notes |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in payload["records"]:
        shape = ", ".join(f"{k}={v}" for k, v in r["shape"].items())
        base = ", ".join(f"{k} {v}" for k, v in r["baselines"].items())
        notes = "; ".join(f"{k}={v}" for k, v in r.items() if k not in _STANDARD_KEYS)
        lines.append(
            f"| {r['op']} | {shape} | {r['us']} | {r['floor_us']} | {r['pct_of_floor']} | "
            f"{r['tflops'] or ''} | {r['tbs'] or ''} | {base} | {notes} |"
        )
    return "\n".join(lines) + "\n"


def write_results(name: str, rows: list[dict], ceilings: dict[str, float], folder: Path) -> Path:
    """Write ``<folder>/<name>.json`` and a Markdown table beside it; return the JSON path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    payload = {"ceilings": ceilings, "environment": environment(), "records": rows}
    path.write_text(json.dumps(payload, indent=1))
    path.with_suffix(".md").write_text(render_markdown(name, payload))
    return path
