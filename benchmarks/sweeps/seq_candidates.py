"""Candidate-block / slot tuning sweeps and the split select's phase timeline (GPU only; not part of
``dsa-indexer bench``).

``python benchmarks/sweeps/seq_candidates.py sweep [OUT_DIR] [--quick] [--rows R ...] [--no-slots] [--select-only]
[--subset-rows R ...]`` times the kernel variants against the current defaults in one process, with torch's
``fill_`` of the mask's bytes as the store-only ceiling; ``... warm VARIANT`` compiles one select variant (run
several in parallel before a sweep); ``... timeline [--rows R ...] [--variants V ...]`` prints the split select's
phase timeline (``timeline``). Shapes as ``dsa_indexer.bench.suite_seq_candidates``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from dsa_indexer.bench import harness
from dsa_indexer.bench.suite_seq_candidates import _host_us
from dsa_indexer.ops.candidates import triton as candidates_triton
from dsa_indexer.ops.candidates.reference import select_candidate_blocks_reference
from dsa_indexer.ops.common.runtime import sm_count
from dsa_indexer.ops.topk.triton import indices_to_slots_triton

DEFAULT_SELECT = candidates_triton.DEFAULT_SELECT
_SMS = sm_count(torch.device("cuda")) if torch.cuda.is_available() else 132


# Variants of the select against the default: keyword arguments of ``select_candidate_blocks_triton`` (a config),
# or a function of the row count returning them. The measured choices are in ops/candidates/README.md and
# benchmarks/NOTES_seq_candidates.md.
SELECT_VARIANTS = {
    "default": {},
    # The path the default does not take at this row count (the split / fused crossovers: select_plan).
    "other_path": lambda num_rows: dict(config=candidates_triton.SelectConfig(
        split_pieces=0 if candidates_triton.select_plan(DEFAULT_SELECT, num_rows, 131072, 8, _SMS)
        else DEFAULT_SELECT.split_pieces, split_min_rows=0)),
    "split_8": dict(config=candidates_triton.SelectConfig(split_pieces=8)),
    "sample_1024": dict(config=candidates_triton.SelectConfig(moment_sample=1024)),
}
# The variants timed at the row counts of ``--subset-rows`` (the crossover's shapes).
SUBSET_VARIANTS = ("default", "other_path")


def _select_kwargs(variant, num_rows: int) -> dict:
    return variant(num_rows) if callable(variant) else variant


MASK_VARIANTS = {
    "default": {},
    "unfused": dict(config=candidates_triton.MaskConfig(fused_flags_min_rows=1 << 30)),
}


def _sweep_slots(record, generator, num_rows: int = 16384, k: int = 2048) -> None:
    """indices_to_slots on the suite's shape."""
    num_requests, context, page = 256, 65536, 64
    indices = torch.randint(0, context, (num_rows, k), device="cuda", generator=generator, dtype=torch.int32)
    indices = torch.where(torch.rand((num_rows, k), device="cuda", generator=generator) < 0.03, -1, indices)
    table = torch.randperm(num_requests * context // page, device="cuda", generator=generator).to(torch.int32)
    table = table.view(num_requests, context // page)
    row_to_request = torch.arange(num_rows, device="cuda", dtype=torch.int32) // (num_rows // num_requests)
    slots = indices_to_slots_triton(indices, table, page, row_to_request)
    moved = 2 * indices.numel() * 4 + table.numel() * 4 + row_to_request.numel() * 4
    def to_slots():
        return indices_to_slots_triton(indices, table, page, row_to_request)
    record("indices_to_slots", num_rows, "default", to_slots, moved, torch.equal(to_slots(), slots))


def _sweep_candidates(record, generator, num_rows: int, width: int = 131072, num_blocks_k: int = 2048,
                      select_only: bool = False, select_variants: tuple[str, ...] | None = None) -> None:
    """select / its two stages / mask variants on the suite's candidate shape with ``num_rows`` rows
    (the select variants only with ``select_only``; only ``select_variants`` if given); the default select is
    checked against the reference."""
    block_size = 8
    logits = torch.randn(num_rows, width, device="cuda", generator=generator)
    starts = torch.zeros(num_rows, dtype=torch.int32, device="cuda")
    ends = torch.full((num_rows,), width, dtype=torch.int32, device="cuda")
    out = torch.empty((num_rows, num_blocks_k), dtype=torch.int32, device="cuda")
    select_bytes = num_rows * width * 4 + num_rows * num_blocks_k * 4
    chosen = candidates_triton.select_candidate_blocks_triton(logits, starts, ends, num_blocks_k, block_size, 1)
    reference = select_candidate_blocks_reference(logits, starts, ends, num_blocks_k, block_size, 1)
    if not torch.equal(chosen, reference):
        raise AssertionError(f"select R {num_rows}: the default differs from the reference")
    for name, variant in SELECT_VARIANTS.items():
        if select_variants is not None and name not in select_variants:
            continue
        kwargs = _select_kwargs(variant, num_rows)

        def select(kwargs=kwargs):
            return candidates_triton.select_candidate_blocks_triton(logits, starts, ends, num_blocks_k, block_size,
                                                                    1, out, **kwargs)
        same = torch.equal(select().clone(), chosen)
        record("select", num_rows, name, select, select_bytes, same)
    if select_only:
        return
    keys_bytes = num_rows * width * 4 + num_rows * (width // block_size) * 4
    keys = candidates_triton.block_keys(logits, starts, ends, block_size, 1)
    def stage_keys():
        return candidates_triton.block_keys(logits, starts, ends, block_size, 1)
    record("select/keys", num_rows, "default", stage_keys, keys_bytes, True, graph=False)
    def stage_select():
        return candidates_triton.select_from_keys(keys, starts, ends, num_blocks_k, block_size, 1, out)
    same = torch.equal(stage_select().clone(), chosen)
    record("select/radix", num_rows, "default", stage_select, keys.numel() * 4, same, graph=False)
    mask_bytes = (num_rows * width - num_rows * num_blocks_k * block_size) * 4 + chosen.numel() * 4
    expected = logits.clone()
    candidates_triton.apply_candidate_mask_triton(expected, starts, ends, chosen, block_size, 1)
    for name, kwargs in MASK_VARIANTS.items():
        def mask(kwargs=kwargs):
            candidates_triton.apply_candidate_mask_triton(logits, starts, ends, chosen, block_size, 1, **kwargs)
        mask()
        same = torch.equal(logits.view(torch.int32), expected.view(torch.int32))
        record("mask", num_rows, name, mask, mask_bytes, same, host=True)
    # A practical ceiling for a store-only op: torch's own fill of the same bytes.
    fill = torch.empty(mask_bytes // 4, device="cuda")
    record("mask/torch_fill", num_rows, "fill_", lambda: fill.fill_(float("-inf")), mask_bytes, True)


def warm(variant: str) -> None:
    """Compile one select variant for the sweep's shapes (Triton's on-disk cache), both paths where the row count
    picks the path, so that several processes can compile the variants in parallel before the sweep."""
    width, block_size, num_blocks_k = 131072, 8, 2048
    for num_rows in (1, DEFAULT_SELECT.split_min_rows):
        logits = torch.randn(num_rows, width, device="cuda")
        starts = torch.zeros(num_rows, dtype=torch.int32, device="cuda")
        ends = torch.full((num_rows,), width, dtype=torch.int32, device="cuda")
        out = torch.empty((num_rows, num_blocks_k), dtype=torch.int32, device="cuda")
        candidates_triton.select_candidate_blocks_triton(logits, starts, ends, num_blocks_k, block_size, 1, out,
                                                         **_select_kwargs(SELECT_VARIANTS[variant], num_rows))
    torch.cuda.synchronize()


def sweep(out_dir: str | None, quick: bool = False, rows_list: tuple[int, ...] = (512, 64),
          with_slots: bool = True, select_only: bool = False, subset_rows: tuple[int, ...] = (),
          select_variants: tuple[str, ...] | None = None) -> list[dict]:
    """Time every variant against the default on the suite's shapes (candidate ops at each R of
    ``rows_list``, indices_to_slots if ``with_slots``; only the select variants with ``select_only``; at the R of
    ``subset_rows``, after ``rows_list``, only the ``SUBSET_VARIANTS`` selects; ``select_variants``: only these
    of ``SELECT_VARIANTS``); each checked bit-equal to the default.
    Rows: op, R, variant, event / warm-graph / cold-graph µs, % of the copy floor (on the cold-graph time)."""
    rep = 60 if quick else 120
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    copy_tbs = 2 * n / harness.median_us(lambda: dst.copy_(src)) / 1e6
    src = dst = None  # free the 2 GiB before the sweep
    torch.cuda.empty_cache()
    rows: list[dict] = []

    def record(op, num_rows, variant, fn, num_bytes, same, *, graph=True, host=False):
        us = harness.median_us(fn, rep_ms=rep)
        graph_us = harness.median_us(fn, graph=True, rep_ms=rep) if graph and not quick else None
        cold = harness.cold_graph_us(fn, reps=30) if graph else None
        best = cold if cold is not None else us
        row = {"op": op, "R": num_rows, "variant": variant, "us": round(us, 2),
               "graph_us": None if graph_us is None else round(graph_us, 2),
               "cold_graph_us": None if cold is None else round(cold, 2),
               "floor_us": round(num_bytes / (copy_tbs * 1e6), 2),
               "pct_of_floor": round(100 * num_bytes / (copy_tbs * 1e6) / best, 1), "same_as_default": same}
        if host:
            row["host_us"] = round(_host_us(fn), 2)
        rows.append(row)
        print(row, flush=True)

    generator = torch.Generator(device="cuda").manual_seed(0)
    # The shapes first: the lead's time cap may cut the tail.
    for num_rows in rows_list:
        _sweep_candidates(record, generator, num_rows, select_only=select_only, select_variants=select_variants)
        torch.cuda.empty_cache()
        if with_slots and not select_only and num_rows == rows_list[0]:
            _sweep_slots(record, generator)
    for num_rows in subset_rows:
        _sweep_candidates(record, generator, num_rows, select_only=True, select_variants=SUBSET_VARIANTS)
        torch.cuda.empty_cache()
    if out_dir:
        with open(os.path.join(out_dir, "cand_sweep.json"), "w") as f:
            json.dump({"copy_tbs": copy_tbs, "environment": harness.environment(), "rows": rows}, f, indent=1)
    lines = [f"copy {copy_tbs:.2f} TB/s; % of floor from the cold-graph time (event time where no graph)",
             f"{'op':17} {'R':>6} {'variant':18} {'event us':>9} {'graph us':>9} {'cold g us':>9} {'floor':>7} "
             f"{'%':>6} {'host us':>8} same"]
    for row in rows:
        def cell(value):
            return f"{value:9.1f}" if value is not None else f"{'-':>9}"
        host = row.get("host_us")
        host_cell = f"{host:8.1f}" if host is not None else f"{'-':>8}"
        lines.append(f"{row['op']:17} {row['R']:6} {row['variant']:18} {cell(row['us'])} {cell(row['graph_us'])} "
                     f"{cell(row['cold_graph_us'])} {row['floor_us']:7.1f} {row['pct_of_floor']:6.1f} "
                     f"{host_cell} {row['same_as_default']}")
    table_text = "\n".join(lines)
    if out_dir:
        with open(os.path.join(out_dir, "cand_sweep.txt"), "w") as f:
            f.write(table_text + "\n")
    print(table_text, flush=True)
    return rows


# Split-select variants of the phase timeline: keyword arguments of ``select_fused``.
TIMELINE_VARIANTS = {"default": {}, "sample_1024": dict(config=candidates_triton.SelectConfig(moment_sample=1024))}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else float("nan")


def _timeline_summary(stamps: torch.Tensor) -> dict[str, float]:
    """One call's phases (µs) from the split select's stamps ``[programs, _TL_SLOTS]`` (ns; 0 = not reached)."""
    ct = candidates_triton
    start, arrived = stamps[:, ct._TL_START.value], stamps[:, ct._TL_ARRIVED.value]
    selecting = stamps[stamps[:, ct._TL_EMITTED.value] > 0]
    bounds, searched = selecting[:, ct._TL_BOUNDS.value], selecting[:, ct._TL_SEARCHED.value]
    emitted = selecting[:, ct._TL_EMITTED.value]
    origin = int(start.min())
    us = lambda t: t.double() / 1e3  # noqa: E731
    summary = {
        "span": float(us(emitted.max() - origin)),
        "stream_end": float(us(arrived.max() - origin)),
        "tail": float(us(emitted.max() - arrived.max())),
        "piece_p50": _median(us(arrived - start).tolist()),
        "piece_p90": sorted(us(arrived - start).tolist())[int(0.9 * len(start))],
        "select_p50": _median(us(emitted - selecting[:, ct._TL_ARRIVED.value]).tolist()),
        "bounds_p50": _median(us(bounds - selecting[:, ct._TL_ARRIVED.value]).tolist()),
        "search_p50": _median(us(searched - bounds).tolist()),
        "emit_p50": _median(us(emitted - searched).tolist()),
        "rounds_p50": _median(selecting[:, ct._TL_ROUNDS.value].double().tolist()),
    }
    searching = selecting[selecting[:, ct._TL_FIRST_ROUND_END.value] > 0]
    first_start = searching[:, ct._TL_FIRST_ROUND_START.value]
    first_end = searching[:, ct._TL_FIRST_ROUND_END.value]
    summary["before_first_round_p50"] = _median(us(first_start - searching[:, ct._TL_BOUNDS.value]).tolist())
    summary["first_round_p50"] = _median(us(first_end - first_start).tolist())
    summary["later_rounds_p50"] = _median(us(searching[:, ct._TL_SEARCHED.value] - first_end).tolist())
    return summary


def timeline(rows_list: tuple[int, ...] = (512, 256, 64), variants: tuple[str, ...] = ("default",),
             replays: int = 5) -> list[dict]:
    """Phase timeline of the split select (``select_fused(..., timeline=...)``; ``stamp`` barriers and global-timer
    stamps, GPU only) on the suite's candidate shape (C 131072, blocks of 8, K 2048, random rows) for each of
    ``variants`` (``TIMELINE_VARIANTS``) at each R: the call is checked bitwise against the reference, captured in a
    CUDA graph and replayed ``replays`` times after a 256 MB memset (as ``harness.cold_graph_us``); prints, as
    medians over replays, the span (first start to last emit), when the last piece arrives, the tail after it, the
    pieces' durations and the selecting programs' phases (p50 over rows) with their search rounds, the search split
    into the block reductions before its first round, the first round and the later ones."""
    width, block_size, num_blocks_k = 131072, 8, 2048
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    results = []
    print("| R | variant | span | last arrival | tail | piece p50 / p90 | selection p50 (bounds / search / emit) "
          "| rounds p50 | search p50: before round 1 / round 1 / later rounds |")
    print("| --- | --- | ---: | ---: | ---: | --- | --- | ---: | --- |")
    for num_rows in rows_list:
        logits = torch.randn(num_rows, width, device="cuda")
        starts = torch.zeros(num_rows, dtype=torch.int32, device="cuda")
        ends = torch.full((num_rows,), width, dtype=torch.int32, device="cuda")
        out = torch.empty((num_rows, num_blocks_k), dtype=torch.int32, device="cuda")
        expected = select_candidate_blocks_reference(logits, starts, ends, num_blocks_k, block_size, 1)
        for variant in variants:
            stamps: dict[str, torch.Tensor] = {}

            def select(stamps=stamps, kwargs=TIMELINE_VARIANTS[variant], logits=logits, starts=starts, ends=ends,
                       out=out):
                return candidates_triton.select_fused(logits, starts, ends, num_blocks_k, block_size, 1, out,
                                                      DEFAULT_SELECT.split_pieces, timeline=stamps, **kwargs)
            select()
            if not torch.equal(out, expected):
                raise AssertionError(f"timeline {variant} R {num_rows}: differs from the reference")
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                select()
            runs = []
            for _ in range(replays):
                stamps["split"].zero_()
                flush.zero_()
                graph.replay()
                torch.cuda.synchronize()
                runs.append(_timeline_summary(stamps["split"].cpu()))
            row = {"R": num_rows, "variant": variant,
                   **{key: round(_median([run[key] for run in runs]), 2) for key in runs[0]}}
            results.append(row)
            print(f"| {num_rows} | {variant} | {row['span']:.1f} | {row['stream_end']:.1f} | {row['tail']:.1f} "
                  f"| {row['piece_p50']:.1f} / {row['piece_p90']:.1f} | {row['select_p50']:.1f} "
                  f"({row['bounds_p50']:.1f} / {row['search_p50']:.1f} / {row['emit_p50']:.1f}) "
                  f"| {row['rounds_p50']:.0f} | {row['before_first_round_p50']:.1f} / {row['first_round_p50']:.1f} / "
                  f"{row['later_rounds_p50']:.1f} |", flush=True)
            del graph
        del logits
        torch.cuda.empty_cache()
    return results


def _main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python benchmarks/sweeps/seq_candidates.py",
                                     description="candidate / slot variant sweep and the split select's timeline")
    parser.add_argument("command", choices=["sweep", "warm", "timeline"])
    parser.add_argument("out_dir", nargs="?", help="sweep: output folder; warm: the select variant to compile")
    parser.add_argument("--quick", action="store_true", help="shorter timing loops")
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 64], help="candidate rows R to sweep")
    parser.add_argument("--no-slots", action="store_true", help="leave out indices_to_slots")
    parser.add_argument("--select-only", action="store_true", help="only the select variants")
    parser.add_argument("--variants", nargs="+", default=["default"],
                        help=f"timeline: split-select variants ({', '.join(TIMELINE_VARIANTS)})")
    parser.add_argument("--subset-rows", type=int, nargs="+", default=[],
                        help="rows R (timed after --rows) at which only the SUBSET_VARIANTS selects run")
    parser.add_argument("--select-variants", nargs="+", choices=list(SELECT_VARIANTS),
                        help="sweep: only these select variants (default: all)")
    args = parser.parse_args(argv)
    if args.command == "warm":
        warm(args.out_dir)
    elif args.command == "timeline":
        timeline(tuple(args.rows), tuple(args.variants))
    else:
        sweep(args.out_dir, args.quick, tuple(args.rows), not args.no_slots, args.select_only,
              tuple(args.subset_rows), tuple(args.select_variants) if args.select_variants else None)


if __name__ == "__main__":
    _main(sys.argv[1:])
