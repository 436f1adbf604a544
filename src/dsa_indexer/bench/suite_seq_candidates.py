"""Benchmarks of pack_seq / unpack_seq and the V4.1 candidate blocks (issue 4, part B).

Every op here is memory-bound: the floor is the fewest bytes it must move over the copy bandwidth
measured in the same run (read + write bytes, like the ceiling). Target: >= 70% of that bandwidth.
The ``torch`` baseline is the package's PyTorch reference on the same inputs. Both sides are timed
without the public wrappers' argument checks (the candidate ops' bounds check reads a value back to
the host, which would put a CPU round trip inside the timed region).

- pack_seq: V3.2 decode Q padding, 8192 requests of 1..4 tokens (next_n = 4), fp8 [64, 128] rows
  (8 KiB): reads the valid rows, writes the whole padded grid.
- unpack_seq: compacting int32 top-2048 rows (8 KiB) of the same batch: reads and writes the valid rows.
- select_candidate_blocks: V4.1 sources, 128K compressed positions per row, blocks of 8, top 2048
  blocks: reads each row's logits once. The default is one launch: the split select (several streaming
  programs per row, the last selects) from 256 rows, one program per row (keys in registers) below; the stage
  records time the two kernels of the two-launch path (rows wider than 16384 blocks) alone, whose
  block-key scratch (1/8 of the logits) is counted as overhead. R 512 (256 MiB) is issue 4's shape, R 64 and 32
  decode batches (32 takes the split kernel: its 128 pieces fit one per SM), R 2048 (1 GiB) a 2048-token prefill
  chunk over the same context.
- apply_candidate_mask: the same rows and the 2048 chosen blocks: writes -inf on every masked
  column (the kept ones are not touched), reads the candidate ids.
- indices_to_slots (kernel owned by ``ops/topk``): 16384 top-2048 rows of 256 requests with 64K-token
  contexts in pages of 64 (a 1 MiB block table, L2-resident): reads the int32 indices (about 3% of
  them -1 padding) and writes the int32 slots, 256 MiB in all; the table and the row-to-request map
  are counted once.

Candidate and slot records carry three times: ``us`` (cold-L2 event time of one call, host launch
included: at R 64 the host's launch cost of the three launches exceeds the GPU time, so this number
is the host's), ``graph_us`` (warm CUDA-graph replays) and ``cold_graph_us`` (one graph replay after
a 256 MB memset that evicts the L2): the last is the honest figure for these capturable ops.

``python -m dsa_indexer.bench.suite_seq_candidates sweep [OUT_DIR] [--quick] [--rows R ...] [--no-slots]
[--select-only] [--subset-rows R ...]`` times the kernel variants (keyword arguments of the Triton functions)
against the current defaults in one process, with torch's ``fill_`` of the mask's bytes as the store-only ceiling;
``... warm VARIANT`` compiles one select variant (run several in parallel before a sweep); ``... timeline [--rows R ...]
[--variants V ...]`` prints the split select's phase timeline (``timeline``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from dsa_indexer.ops.candidates import triton as candidates_triton
from dsa_indexer.ops.candidates.reference import apply_candidate_mask_reference, select_candidate_blocks_reference
from dsa_indexer.ops.seq_pack.reference import pack_seq_reference, unpack_seq_reference
from dsa_indexer.ops.seq_pack.triton import pack_seq_triton, unpack_seq_triton
from dsa_indexer.ops.topk.reference import indices_to_slots as indices_to_slots_reference
from dsa_indexer.ops.topk.triton import indices_to_slots_triton

from . import harness

MIB = 1 << 20


def _random_bytes(shape, dtype, generator) -> torch.Tensor:
    numel = 1
    for size in shape:
        numel *= size
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, device="cuda", generator=generator)
    return raw.view(dtype).view(shape)


def _floor_us(num_bytes: int, ceilings: dict[str, float]) -> float:
    return num_bytes / (ceilings["copy_tbs"] * 1e6)


def _row(op, shape, us, num_bytes, ceilings, torch_us, **extra):
    return harness.record(op, shape, us, _floor_us(num_bytes, ceilings), tbs=num_bytes / us / 1e6,
                          baselines={"torch": torch_us} if torch_us is not None else None,
                          moved_mib=round(num_bytes / MIB, 1), **extra)


def _timed(fn) -> tuple[float, float]:
    """(cold-L2 event time, CUDA-graph replay time) in µs: the second leaves out the host's launch cost."""
    return harness.median_us(fn), harness.median_us(fn, graph=True)


def _host_us(fn, calls: int = 50) -> float:
    """Host time per call of ``fn`` in µs (launches only, the GPU is not waited for within the loop)."""
    fn()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - begin
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _bench_seq_pack(ceilings, generator) -> list[dict]:
    num_seqs, max_len = 8192, 4
    lengths = torch.randint(1, max_len + 1, (num_seqs,), device="cuda", generator=generator, dtype=torch.int32)
    total = int(lengths.sum())
    q = _random_bytes((total, 64, 128), torch.float8_e4m3fn, generator)
    row_bytes = 64 * 128
    packed = torch.empty((num_seqs, max_len, 64, 128), dtype=torch.float8_e4m3fn, device="cuda")
    pack_bytes = total * row_bytes + num_seqs * max_len * row_bytes
    shape = {"B": num_seqs, "L": max_len, "rows": total, "row_bytes": row_bytes, "dtype": "fp8"}
    rows = []
    us, graph_us = _timed(lambda: pack_seq_triton(q, lengths, 0.0, max_len, packed))
    ref = harness.median_us(lambda: pack_seq_reference(q, lengths, 0.0, max_len, packed))
    rows.append(_row("pack_seq", shape, us, pack_bytes, ceilings, ref, graph_us=round(graph_us, 2)))
    indices = _random_bytes((num_seqs, max_len, 2048), torch.int32, generator)
    flat = torch.empty((total, 2048), dtype=torch.int32, device="cuda")
    unpack_bytes = 2 * total * 2048 * 4
    shape = {"B": num_seqs, "L": max_len, "rows": total, "row_bytes": 2048 * 4, "dtype": "int32"}
    us, graph_us = _timed(lambda: unpack_seq_triton(indices, lengths, total, flat))
    ref = harness.median_us(lambda: unpack_seq_reference(indices, lengths, total, flat))
    rows.append(_row("unpack_seq", shape, us, unpack_bytes, ceilings, ref, graph_us=round(graph_us, 2)))
    return rows


def _bench_candidates(ceilings, generator, num_rows: int, *, with_torch: bool, stages: bool) -> list[dict]:
    width, block_size, num_blocks_k = 131072, 8, 2048
    logits = torch.randn(num_rows, width, device="cuda", generator=generator)
    starts = torch.zeros(num_rows, dtype=torch.int32, device="cuda")
    ends = torch.full((num_rows,), width, dtype=torch.int32, device="cuda")
    out = torch.empty((num_rows, num_blocks_k), dtype=torch.int32, device="cuda")
    shape = {"R": num_rows, "C": width, "block": block_size, "K": num_blocks_k}
    rows = []
    select_bytes = num_rows * width * 4 + num_rows * num_blocks_k * 4

    def select(impl):
        return impl(logits, starts, ends, num_blocks_k, block_size, 1, out)

    us, graph_us = _timed(lambda: select(candidates_triton.select_candidate_blocks_triton))
    ref = harness.median_us(lambda: select(select_candidate_blocks_reference)) if with_torch else None
    cold = harness.cold_graph_us(lambda: select(candidates_triton.select_candidate_blocks_triton))
    rows.append(_row("select_candidate_blocks", shape, us, select_bytes, ceilings, ref, graph_us=round(graph_us, 2),
                     cold_graph_us=round(cold, 2)))
    if stages:
        keys = candidates_triton.block_keys(logits, starts, ends, block_size, 1)
        us = harness.median_us(lambda: candidates_triton.block_keys(logits, starts, ends, block_size, 1))
        rows.append(_row("select/block_keys", shape, us, num_rows * width * 4 + keys.numel() * 4, ceilings, None))
        us = harness.median_us(lambda: candidates_triton.select_from_keys(
            keys, starts, ends, num_blocks_k, block_size, 1, out))
        rows.append(_row("select/radix", shape, us, keys.numel() * 4, ceilings, None))
    chosen = select(candidates_triton.select_candidate_blocks_triton).clone()
    masked = num_rows * width - num_rows * num_blocks_k * block_size
    mask_bytes = masked * 4 + chosen.numel() * 4
    def mask(impl):
        impl(logits, starts, ends, chosen, block_size, 1)

    us, graph_us = _timed(lambda: mask(candidates_triton.apply_candidate_mask_triton))
    ref = harness.median_us(lambda: mask(apply_candidate_mask_reference)) if with_torch else None
    cold = harness.cold_graph_us(lambda: mask(candidates_triton.apply_candidate_mask_triton))
    host = _host_us(lambda: mask(candidates_triton.apply_candidate_mask_triton))
    rows.append(_row("apply_candidate_mask", shape, us, mask_bytes, ceilings, ref, graph_us=round(graph_us, 2),
                     cold_graph_us=round(cold, 2), host_us=round(host, 2)))
    return rows


def _bench_indices_to_slots(ceilings, generator) -> list[dict]:
    num_rows, k, num_requests, context, block_size = 16384, 2048, 256, 65536, 64
    pages = context // block_size
    indices = torch.randint(0, context, (num_rows, k), device="cuda", generator=generator, dtype=torch.int32)
    padding = torch.rand((num_rows, k), device="cuda", generator=generator) < 0.03
    indices = torch.where(padding, -1, indices)
    table = torch.randperm(num_requests * pages, device="cuda", generator=generator).to(torch.int32)
    table = table.view(num_requests, pages)
    row_to_request = torch.arange(num_rows, device="cuda", dtype=torch.int32) // (num_rows // num_requests)
    args = (indices, table, block_size, row_to_request)
    if not torch.equal(indices_to_slots_triton(*args), indices_to_slots_reference(*args)):
        raise AssertionError("indices_to_slots: Triton slots differ from the reference")
    moved = 2 * indices.numel() * 4 + table.numel() * 4 + row_to_request.numel() * 4
    shape = {"R": num_rows, "k": k, "B": num_requests, "pages": pages, "block": block_size}
    us, graph_us = _timed(lambda: indices_to_slots_triton(*args))
    cold = harness.cold_graph_us(lambda: indices_to_slots_triton(*args))
    ref = harness.median_us(lambda: indices_to_slots_reference(*args))
    return [_row("indices_to_slots", shape, us, moved, ceilings, ref, graph_us=round(graph_us, 2),
                 cold_graph_us=round(cold, 2))]


def run(ceilings: dict[str, float]) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = _bench_seq_pack(ceilings, generator)
    rows += _bench_candidates(ceilings, generator, 512, with_torch=True, stages=True)
    rows += _bench_candidates(ceilings, generator, 64, with_torch=False, stages=True)
    rows += _bench_candidates(ceilings, generator, 32, with_torch=False, stages=False)
    rows += _bench_candidates(ceilings, generator, 2048, with_torch=False, stages=False)
    rows += _bench_indices_to_slots(ceilings, generator)
    return rows


# The defaults (runs 4 and 5 of session 3: 16-byte keys / mask / slot paths, mask fused with its
# flags from 256 rows, streaming stores; run 6 of session 4: the fused one-launch select with the
# interpolation search and prefetch; session 5: the split select of 4 pieces from 256 rows, its emit prescanned,
# carry-chain counts in both searches) against the switches that turn them off and the runners-up. The
# variants that lost (register / split-histogram select, 4-warp radix, 16-warp mask, kept blocks rewritten, scalar
# block keys; fused: two bits a round, no prefetch, 32 warps, bracket compaction, rolled steps, one id run per
# thread; split: keys in registers, 16 pieces, 16 warps, a scan per emit chunk; compare counts) are gone; their
# numbers are in benchmarks/NOTES_seq_candidates.md. A variant is a dict of keyword arguments or a function of the
# row count returning one.
SELECT_VARIANTS = {
    "default": {},
    # The path the default does not take at this row count (the split / fused crossovers: _default_pieces).
    "other_path": lambda num_rows: dict(
        fused_pieces=0 if candidates_triton._default_pieces(num_rows, torch.device("cuda"))
        else candidates_triton._SPLIT_PIECES),
    "split_8": dict(fused_pieces=8),  # session 5 round 2: R 512 130.9 against 127.7 µs, R 256 85.7 against 85.9
    # Session 8: the search's first round placed by the row's moments, the default of both kernels (the split
    # select's pieces sum them while streaming). Fused R 128 52.6 -> 49.8 µs, R 64 43.5 -> 42.5; split R 512 128.1
    # -> 126.1, R 256 86.2 -> 82.5 (summed in the split select's bounds pass instead, it lost: +5 µs a row).
    "no_moments": dict(moment_probes=False),
    # Session 9 round 8: the split select's moments from 256 of a row's images (the default) against 1024; the pieces
    # summing every image (session 8's default) lost (R 2048 365-382 against 361.8 µs).
    "sample_1024": dict(moment_sample=1024),
    # Session 10 round 1 (split select, the defaults since): the selected rows' scratch images dropped from the L2
    # unwritten, and the pieces' logits loads with an evict-first L2 hint; R 2048 336.9 µs against 357.9 / 355.2 with
    # one of them and 382.6 without both (cold graph), R 512 117.0 against 119.9 / 118.7 / 120.9. The fused kernel's
    # loads with the same hint (round 2: R 128 46.2 against 48.1 µs, R 64 40.7 against 40.9).
    "no_discard": dict(fused_piece_discard=False),
    "no_evict_first": dict(fused_evict_first=False),
}
# The variants timed at the row counts of ``--subset-rows`` (the crossover's shapes).
SUBSET_VARIANTS = ("default", "other_path")


def _select_kwargs(variant, num_rows: int) -> dict:
    return variant(num_rows) if callable(variant) else variant


MASK_VARIANTS = {
    "default": {},
    "unfused": dict(fused_flags=False),
    "not_streaming": dict(streaming=False),
    # Session 10: the fused mask's flag rows dropped from the L2 unwritten once masked (the default) against kept.
    "keep_flags": dict(discard_flags=False),
}
SLOT_VARIANTS = {"default": {}, "unaligned_1024x4": dict(aligned_rows=False, block=1024)}


def _sweep_slots(record, generator, num_rows: int = 16384, k: int = 2048) -> None:
    """indices_to_slots variants on the suite's shape."""
    num_requests, context, page = 256, 65536, 64
    indices = torch.randint(0, context, (num_rows, k), device="cuda", generator=generator, dtype=torch.int32)
    indices = torch.where(torch.rand((num_rows, k), device="cuda", generator=generator) < 0.03, -1, indices)
    table = torch.randperm(num_requests * context // page, device="cuda", generator=generator).to(torch.int32)
    table = table.view(num_requests, context // page)
    row_to_request = torch.arange(num_rows, device="cuda", dtype=torch.int32) // (num_rows // num_requests)
    slots = indices_to_slots_triton(indices, table, page, row_to_request)
    moved = 2 * indices.numel() * 4 + table.numel() * 4 + row_to_request.numel() * 4
    for name, kwargs in SLOT_VARIANTS.items():
        def to_slots(kwargs=kwargs):
            return indices_to_slots_triton(indices, table, page, row_to_request, **kwargs)
        record("indices_to_slots", num_rows, name, to_slots, moved, torch.equal(to_slots(), slots))


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
    for num_rows in (1, candidates_triton._SPLIT_MIN_ROWS):
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
    del src, dst
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
TIMELINE_VARIANTS = {"default": {}, "no_moments": dict(moment_probes=False)}


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
    """Phase timeline of the split select (``select_fused(..., timeline=...)``; ``_stamp`` barriers and global-timer
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

            def select(stamps=stamps, kwargs=TIMELINE_VARIANTS[variant]):
                return candidates_triton.select_fused(logits, starts, ends, num_blocks_k, block_size, 1, out,
                                                      pieces=candidates_triton._SPLIT_PIECES, timeline=stamps,
                                                      **kwargs)
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

    parser = argparse.ArgumentParser(prog="python -m dsa_indexer.bench.suite_seq_candidates",
                                     description="candidate / slot variant sweep (the suite runs through "
                                                 "dsa-indexer bench)")
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
