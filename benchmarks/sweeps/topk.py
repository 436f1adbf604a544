"""Top-k tuning sweeps and the phase timeline (GPU only; not part of ``dsa-indexer bench``).

``python benchmarks/sweeps/topk.py sweep_decode [OUT_JSON]`` and ``... sweep_prefill [OUT_JSON]`` time the tuning
variants of ``_decode_sweep_plan`` and ``_prefill_row_configs`` against the default (every cell checked bitwise
first); ``... timeline_decode [--variants=A,B] [--rows=R,S]`` prints the phase timeline of the default (or of sweep
variants) at R = 32 and 128. Shapes and timing as ``dsa_indexer.bench.suite_topk``.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

from dsa_indexer.bench import harness
from dsa_indexer.bench.suite_topk import DECODE_L, PREFILL_S, ROTATION_BYTES, _clean, _cold_us, _decode_rows, _values
from dsa_indexer.ops.topk import reference
from dsa_indexer.ops.topk import triton as kernels


def _decode_sweep_plan() -> tuple[dict, list]:
    """Decode variants of ``sweep_decode`` (names -> ``TopkConfig``) and its cells ``(data, rows, k, names, tag)``:
    none now (add the next ones here, each the default with the changes its name lists, timed in the cells where it
    changes the path taken; ``tag`` tells a repeated cell apart), so ``base`` alone: the split path at R = 1, gather-piece launches
    at R = 8/32/64, row programs at R = 128, random rows at k 2048 and 512, relu_sum and one_bin at R = 1 and
    relu_sum at R = 32/128 (k = 2048)."""
    cells = [("random", num_rows, k, [], "") for num_rows in (1, 8, 32, 64, 128) for k in (2048, 512)]
    cells += [(data, 1, 2048, [], "") for data in ("relu_sum", "one_bin")]
    cells += [("relu_sum", num_rows, 2048, [], "") for num_rows in (32, 128)]
    return {}, cells


def _warm_tasks(configs: dict, cells: list) -> list[tuple[int, str, int]]:
    """The calls ``(rows, name, k)`` that compile every kernel of the sweep once: one per (path the row count
    takes, config without its routing, k of a cell with that row count and variant), since variants that differ only
    in routing share their paths' kernels.
    ``base`` first: the variants mostly reuse its kernels, so that parallel shares do not compile them at once."""
    tasks, seen = [], set()
    for num_rows in sorted({cell[1] for cell in cells}):
        for name in [n for n in configs if any(num_rows == c[1] and n in ("base", *c[3]) for c in cells)]:
            config = configs[name]
            path = kernels.topk_path(config, num_rows, DECODE_L)
            for k in sorted({c[2] for c in cells if c[1] == num_rows and name in ("base", *c[3])}, reverse=True):
                key = (path, replace(config, row_program_rows=0, pieces_max_rows=0), k)
                if key not in seen:
                    seen.add(key)
                    tasks.append((num_rows, name, k))
    return sorted(tasks, key=lambda task: task[1] != "base")


def _time_variants(label, logits, k, ends, inputs, configs, rep_ms, unchecked=()) -> dict:
    """Cold µs of ``topk_triton`` under each of ``configs`` (name -> ``TopkConfig``) on ``logits`` (rows ending at
    ``ends``), each first checked bitwise against the reference (names in ``unchecked`` excepted: timing
    probes); ``None`` for a variant that fails to build or differs (said in a line)."""
    num_rows = logits.shape[0]
    expected = reference.topk(logits, k, None, ends, torch.empty((num_rows, k), dtype=torch.int32, device="cuda"))
    times = {}
    for name, config in configs.items():
        out = torch.empty((num_rows, k), dtype=torch.int32, device="cuda")
        times[name] = None
        try:
            got = kernels.topk_triton(logits, k, None, ends, out, config=config)
            exact = name in unchecked or torch.equal(got, expected)
        except Exception as error:  # a variant that fails to build must not stop the sweep
            print(f"{label} {name}: FAILED {error!r}", flush=True)
            continue
        if not exact:
            print(f"{label} {name}: NOT EXACT", flush=True)
            continue
        times[name] = _cold_us(lambda x, c=config, o=out: kernels.topk_triton(x, k, None, ends, o, config=c),
                               inputs, rep_ms)
    print(f"{label}: " + "  ".join(f"{n} {'-' if t is None else f'{t:.1f}'}" for n, t in times.items()), flush=True)
    return times


def _save_records(records: list[dict], out_path: str | None) -> None:
    import json

    if out_path:
        Path(out_path).write_text(json.dumps({"environment": harness.environment(), "records": records}, indent=1))


def _report_sweep(records: list[dict], names: list[str], kernel_names: list[str], out_path: str | None) -> None:
    """Write ``records`` (when ``out_path``), print the compiled kernels' registers and the markdown table."""
    _save_records(records, out_path)
    for name in kernel_names:
        for cache in getattr(kernels, name).device_caches.values():
            for compiled in cache[0].values():
                print(f"{name}: warps={compiled.metadata.num_warps} pdl={compiled.metadata.launch_pdl} "
                      f"regs={compiled.n_regs} spills={compiled.n_spills}")
    print("\n| shape | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    for record in records:
        cells = [record["us"].get(n) for n in names]
        print(f"| {record['shape']} | " + " | ".join("" if c is None else f"{c:.1f}" for c in cells) + " |")


def sweep_decode(out_path: str | None = None, warm: str | None = None) -> None:
    """Cold µs of the decode variants of ``_decode_sweep_plan`` (``python benchmarks/sweeps/topk.py
    sweep_decode [OUT_JSON]``) and of ``base`` (the committed default) on every cell, each checked bitwise
    against the reference first (probes excepted); a table last. ``warm="i/n"`` only compiles the i-th of n
    shares of ``_warm_tasks`` (each path's kernels once, both k), to run beside the tests in parallel processes
    that fill Triton's cache."""
    configs, cells = _decode_sweep_plan()
    configs = {"base": kernels.DEFAULT_CONFIG, **configs}
    if warm is not None:
        share, shares = (int(x) for x in warm.split("/"))
        for num_rows, name, k in _warm_tasks(configs, cells)[share::shares]:
            logits, lengths = _decode_rows("random", num_rows)
            out = torch.empty((num_rows, k), dtype=torch.int32, device="cuda")
            kernels.topk_triton(logits, k, None, lengths, out, config=configs[name])
            del logits
        torch.cuda.synchronize()
        return
    records = []
    loaded = {}
    for data, num_rows, k, names, tag in cells:
        if (data, num_rows) not in loaded:
            loaded.clear()
            torch.cuda.empty_cache()
            logits, lengths = _decode_rows(data, num_rows)
            copies = max(2, -(-ROTATION_BYTES // logits.numel() // 4))
            loaded[(data, num_rows)] = (logits, lengths, [logits] + [logits.clone() for _ in range(copies - 1)])
        logits, lengths, inputs = loaded[(data, num_rows)]
        label = f"{data} R={num_rows} k={k}{tag}"
        cell_configs = {name: configs[name] for name in ["base", *names]}
        unchecked = [name for name in names if name.startswith("probe")]
        records.append({"shape": label, "us": _time_variants(label, logits, k, lengths, inputs, cell_configs, 5,
                                                             unchecked)})
        _save_records(records, out_path)  # after every shape: a run stopped at its time limit keeps what it measured
    _report_sweep(records, list(configs), ["_split_group_max_kernel", "_row_program_kernel", "_row_pieces_kernel",
                                           "_split_candidates_kernel"], out_path)


# Timeline words (``_TL_*`` in ops/topk/triton.py) per kernel, in phase order within a program (a phase starts where
# the previous one ends); row programs' gather pieces (words 6, ...) lie between the compaction and T.
TIMELINE_PHASES = {
    "maxima": {0: "start", 1: "waited", 4: "maxima"},
    "rows": {0: "start", 1: "waited", 4: "bound", 5: "compacted", "pieces": "piece", 2: "T", 3: "emitted"},
    "pieces": {0: "start", 1: "waited", 4: "gathered", 5: "arrived", 6: "counted", 2: "T", 3: "emitted"},
}


def _phase_table(label: str, stamps: dict[str, torch.Tensor]) -> list[str]:
    """Lines of the phase table of one call's timeline (``stamps``: name -> int64 ns ``[replays, programs, words]``,
    0 = not reached): per kernel and phase, the median over programs and replays of the phase's end and of its
    duration (from the program's previous stamp), and the latest end, in µs from each replay's first maxima program
    start."""
    t0 = stamps["maxima"][:, :, 0].clamp(min=1).min(dim=1).values  # [replays]
    lines = [f"{label}: phase end (median / max over programs, µs from the first maxima start), duration (median)"]
    for name, phases in TIMELINE_PHASES.items():
        if name not in stamps:
            continue
        words = stamps[name]
        order = [w for o in phases for w in (range(6, words.shape[2]) if o == "pieces" else [o])]
        previous = None
        for word in order:
            end = words[:, :, word]
            reached = end > 0
            if not bool(reached.any()):
                continue
            phase = f"piece {word - 6}" if name == "rows" and word >= 6 else phases[word]
            rel = (end - t0[:, None]).double() / 1e3
            median_end = float(rel[reached].median())
            last = float(rel[reached].max())
            duration = ""
            if previous is not None:
                both = reached & (previous > 0)
                if bool(both.any()):
                    duration = f"{float(((end - previous).double() / 1e3)[both].median()):6.2f}"
            lines.append(f"  {name:7s} {phase:10s} end {median_end:7.2f} / {last:7.2f}  dur {duration:>6s}"
                         f"  programs {int(reached[0].sum())}")
            previous = torch.where(reached, end, previous) if previous is not None else end
    return lines


def timeline_decode(replays: int = 7, warm: bool = False, variants: tuple[str, ...] = ("base",),
                    rows: tuple[int, ...] = (32, 128)) -> None:
    """Phase timeline (``_topk_timeline``) of each of ``variants`` (``base``: the default, else a name of
    ``_decode_sweep_plan``) at random R in ``rows``, k = 2048 (L = 128K, lengths ``U[0.8 L, L]``): the call is checked
    bitwise, captured in a CUDA graph and replayed ``replays`` times, each after a 256 MB memset that evicts the L2 (as
    ``harness.cold_graph_us``); prints the phase table (``_phase_table``) and each replay's span (first maxima start
    to last emit). ``warm``: only compile (one eager call per shape)."""
    configs = {"base": kernels.DEFAULT_CONFIG, **_decode_sweep_plan()[0]}
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    k = 2048
    for variant, num_rows in [(v, r) for v in variants for r in rows]:
        config = configs[variant]
        logits, lengths = _decode_rows("random", num_rows)
        out = torch.empty((num_rows, k), dtype=torch.int32, device="cuda")
        timeline: dict[str, torch.Tensor] = {}
        kernels._topk_timeline(logits, k, lengths, out, timeline, config=config)
        if warm:
            continue
        expected = reference.topk(logits, k, None, lengths, torch.empty_like(out))
        if not torch.equal(out, expected):
            print(f"timeline {variant} R={num_rows}: NOT EXACT", flush=True)
            continue
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kernels._topk_timeline(logits, k, lengths, out, timeline, config=config)
        runs = {name: [] for name in timeline}
        for _ in range(replays):
            for buffer in timeline.values():
                buffer.zero_()
            flush.zero_()
            graph.replay()
            torch.cuda.synchronize()
            for name, buffer in timeline.items():
                runs[name].append(buffer.clone())
        stamps = {name: torch.stack(values).cpu() for name, values in runs.items()}
        exact = torch.equal(out, expected)
        print("\n".join(_phase_table(f"timeline {variant} random R={num_rows} k={k} (replays exact: {exact})",
                                      stamps)))
        last = stamps["pieces" if "pieces" in stamps else "rows"][:, :, 3].max(dim=1).values
        first = stamps["maxima"][:, :, 0].clamp(min=1).min(dim=1).values
        spans = " ".join(f"{(end - begin) / 1e3:.1f}" for begin, end in zip(first.tolist(), last.tolist()))
        print(f"  span per replay (µs): {spans}", flush=True)
        del logits, graph
        torch.cuda.empty_cache()


def _prefill_row_configs() -> dict:
    """Whole-row (prefill) variants timed by ``sweep_prefill``: ``base`` the committed default (one launch per
    tile, the widest at 8 warps under an 80-register cap, carry counts with the plateau check every 16 bits);
    ``one_tile`` one launch of the widest tile; ``launch_r168`` / ``launch_w8_r128``: the widest tile at 4 warps
    under 168 registers / 8 warps under 128; ``p8``: the plateau check every 8 bits."""
    return {
        "base": kernels.DEFAULT_CONFIG,
        "one_tile": kernels.TopkConfig(row_tiles=1),
        "launch_r168": kernels.TopkConfig(row_warps=4, row_narrow_warps=4, row_max_registers=168),
        "launch_w8_r128": kernels.TopkConfig(row_max_registers=128),
        "p8": kernels.TopkConfig(row_plateau_every=8),
    }


def sweep_prefill(out_path: str | None = None, rep_ms: int = 5, only: list[str] | None = None,
                  shapes_matching: list[str] | None = None, warm: str | None = None) -> None:
    """Cold µs of ``_prefill_row_configs`` on causal prefill rows (``python benchmarks/sweeps/topk.py
    sweep_prefill [json] [--only=NAME,...] [--shapes=TEXT,...] [--warm=I/N]``): the 8K prompt (row i has i + 1
    columns; random and one_bin, k = 2048 and 512; relu_sum, k = 2048) and S = 2048 query rows over SKV = 8K /
    32K keys (row i has SKV - S + i + 1 columns; 32K rows are wider than the whole-row kernel: only ``base``, the
    default path).
    ``only`` keeps those variants, ``shapes_matching`` the shapes whose label contains one of the texts.
    Each cell is checked bitwise first; table last. ``warm="i/n"`` only compiles the i-th of n shares of the
    variants (on a few 8K-wide rows: the same kernels), to run beside the tests in parallel processes."""
    configs = {n: c for n, c in _prefill_row_configs().items() if not only or n in only}
    if warm is not None:
        share, shares = (int(x) for x in warm.split("/"))
        ends = torch.arange(1, PREFILL_S + 1, 512, dtype=torch.int32, device="cuda")
        logits = torch.randn((ends.numel(), PREFILL_S), device="cuda")
        out = torch.empty((ends.numel(), 2048), dtype=torch.int32, device="cuda")
        for name in list(configs)[share::shares]:
            kernels.topk_triton(logits, 2048, None, ends, out, config=configs[name])
        torch.cuda.synchronize()
        return
    records = []
    shapes = [(f"causal 8K k={k} {data}", data, PREFILL_S, PREFILL_S, k)
              for data, k in (("random", 2048), ("random", 512), ("relu_sum", 2048), ("one_bin", 2048),
                              ("one_bin", 512))]
    shapes += [(f"S=2048 SKV={skv // 1024}K k=2048 random", "random", 2048, skv, 2048) for skv in (8192, 32768)]
    shapes = [s for s in shapes if not shapes_matching or any(text in s[0] for text in shapes_matching)]
    for label, data, num_rows, width, k in shapes:
        ends = torch.arange(width - num_rows + 1, width + 1, dtype=torch.int32, device="cuda")
        logits = _clean(_values(data, (num_rows, width), 7), None, ends)
        copies = max(2, -(-ROTATION_BYTES // logits.numel() // 4))
        inputs = [logits] + [logits.clone() for _ in range(copies - 1)]
        cell_configs = configs if width <= 8192 else {"base": kernels.DEFAULT_CONFIG}
        records.append({"shape": label, "us": _time_variants(label, logits, k, ends, inputs, cell_configs, rep_ms)})
        _save_records(records, out_path)
        del inputs, logits
        torch.cuda.empty_cache()
    _report_sweep(records, list(configs), ["_topk_row_kernel"], out_path)


if __name__ == "__main__":
    if sys.argv[1:2] == ["sweep_decode"] and len(sys.argv) <= 4:
        warm = next((a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith("--warm=")), None)
        paths = [a for a in sys.argv[2:] if not a.startswith("--warm=")]
        sweep_decode(paths[0] if paths else None, warm)
    elif sys.argv[1:2] == ["timeline_decode"] and len(sys.argv) <= 5:
        options = dict(a[2:].split("=", 1) for a in sys.argv[2:] if a.startswith("--") and "=" in a)
        timeline_decode(warm="--warm" in sys.argv[2:], variants=tuple(options.get("variants", "base").split(",")),
                        rows=tuple(int(r) for r in options.get("rows", "32,128").split(",")))
    elif sys.argv[1:2] == ["sweep_prefill"] and len(sys.argv) <= 6:
        options = dict(a[2:].split("=", 1) for a in sys.argv[2:] if a.startswith("--"))
        paths = [a for a in sys.argv[2:] if not a.startswith("--")]
        only = options["only"].split(",") if "only" in options else None
        shapes_matching = options["shapes"].split(",") if "shapes" in options else None
        sweep_prefill(paths[0] if paths else None, only=only, shapes_matching=shapes_matching, warm=options.get("warm"))
    else:
        sys.exit("usage: python benchmarks/sweeps/topk.py sweep_decode [OUT_JSON] [--warm=I/N] | timeline_decode "
                 "[--warm] [--variants=base] [--rows=32,128] | "
                 "sweep_prefill [OUT_JSON] [--only=A,B] [--shapes=T,U] [--warm=I/N]")
