"""Per-program timeline of the split candidate select (globaltimer stamps): where a row's selection spends its time.

The probe kernel is ``_split_select_kernel`` rebuilt from the library's helpers with stamps between the phases:
program start, streaming done (after the row arrival), and in the selecting program the bounds pass, every search
round (its probes, its counting pass with the block reduction, its narrowing) and the emit. ``MODE`` 1 stops after
the arrival (streaming alone); ``MODE`` 2 adds timed passes over the row's images after the emit (rolled and
unrolled loops, L1 warm or bypassed). Variants: the library's search, the search opened by ``_moment_probes``,
and the counting without carry chains (``CARRY`` 0 / 1). Prints, per row count (512, 256, 64 rows of 128K logits,
blocks of 8, K 2048): the kernel's span, when the streaming ends, the selection's latency by phase, the tail after
the last streaming, a search round's parts and a raw pass, with cold-graph times of the library kernel after a
memset flush and after a clean (read) flush. The stamps perturb the kernel (it runs ~20 % slower than the library
one): read the phases' proportions, not absolute times. Session 8's runs: benchmarks/results/rounds/s8r*_cand_*.
Usage (GPU): PYTHONPATH=src python scripts/cand_timeline.py OUT_DIR
"""
import json
import sys

import torch
import triton
import triton.language as tl

from dsa_indexer.bench import harness
from dsa_indexer.ops.candidates import triton as ct
from dsa_indexer.ops.candidates.reference import select_candidate_blocks_reference


@triton.jit
def _now(anchor):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [anchor], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _sm(anchor):
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [anchor], dtype=tl.int32, is_pure=False,
                                     pack=1)


@triton.jit
def _probe_kernel(
    logits_ptr, ends_ptr, out_ptr, keys_ptr, arrivals_ptr, stamps_ptr,
    num_blocks_k, stride_row, out_stride_row,
    BLOCK_SIZE: tl.constexpr, BLOCK_J: tl.constexpr, STEPS: tl.constexpr, STEP_NB: tl.constexpr,
    PIECES: tl.constexpr, LANES: tl.constexpr, PAD_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    CARRY: tl.constexpr, MODE: tl.constexpr, MOMENTS: tl.constexpr,
):
    program = tl.program_id(0)
    tl.store(stamps_ptr + program * 16 + 1, _now(program))
    row = (program // PIECES).to(tl.int64)
    piece = program % PIECES
    length = tl.load(ends_ptr + row)
    num_blocks = ((length + BLOCK_SIZE - 1) // BLOCK_SIZE).to(tl.int32)
    NB: tl.constexpr = PIECES * STEPS * STEP_NB
    keys_row = keys_ptr + row * NB
    ct._stream_piece_images(keys_row, logits_ptr + row * stride_row, 0, 1, num_blocks - 1,
                            piece * (STEPS * STEP_NB), STEPS, STEP_NB, BLOCK_SIZE, BLOCK_J, True, False)
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel", scope="gpu")
    t1 = _now(arrived)
    rec = stamps_ptr + program * 16
    tl.store(rec + 0, _sm(program).to(tl.int64))
    tl.store(rec + 2, t1)
    tl.store(rec + 3, (arrived == PIECES - 1).to(tl.int64))
    if MODE != 1:
        _select_stamped(keys_row, rec, num_blocks, num_blocks_k, out_ptr + row * out_stride_row, arrived, NB,
                        PIECES, LANES, PAD_BLOCK, CHUNK, CARRY, MOMENTS)
    if MODE == 2:
        if arrived == PIECES - 1:
            _pass_probes(keys_row, rec, NB, CHUNK)


@triton.jit
def _rolled_pass(keys_row, NB: tl.constexpr, CHUNK: tl.constexpr, CACHE: tl.constexpr):
    lanes = tl.arange(0, CHUNK)
    total = tl.zeros([CHUNK], tl.int32)
    for c in range(NB // CHUNK):
        total += tl.load(keys_row + c * CHUNK + lanes, cache_modifier=CACHE) >> 8
    return tl.sum(total, axis=0)


@triton.jit
def _unrolled_pass(keys_row, NB: tl.constexpr, CHUNK: tl.constexpr):
    lanes = tl.arange(0, CHUNK)
    total = tl.zeros([CHUNK], tl.int32)
    for c in tl.static_range(NB // CHUNK):
        total += tl.load(keys_row + c * CHUNK + lanes) >> 8
    return tl.sum(total, axis=0)


@triton.jit
def _pass_probes(keys_row, rec, NB: tl.constexpr, CHUNK: tl.constexpr):
    """Stamps around passes over the row's images: rolled (one chunk a trip), unrolled, rolled in chunks of
    2 * CHUNK, rolled again (L1 warm?), rolled past L1 (.cg)."""
    check = _rolled_pass(keys_row, NB, CHUNK, "")
    tl.store(rec + 8, _now(check))
    check += _unrolled_pass(keys_row, NB, CHUNK)
    tl.store(rec + 9, _now(check))
    check += _rolled_pass(keys_row, NB, 2 * CHUNK, "")
    tl.store(rec + 10, _now(check))
    check += _rolled_pass(keys_row, NB, CHUNK, "")
    tl.store(rec + 11, _now(check))
    check += _rolled_pass(keys_row, NB, CHUNK, ".cg")
    tl.store(rec + 12, _now(check))
    tl.store(rec + 12, check.to(tl.int64) * 0 + tl.load(rec + 12))


@triton.jit
def _select_stamped(keys_row, rec, num_blocks, num_blocks_k, out_row, arrived, NB: tl.constexpr,
                    PIECES: tl.constexpr, LANES: tl.constexpr, PAD_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                    CARRY: tl.constexpr, MOMENTS: tl.constexpr):
    if arrived == PIECES - 1:
        lanes = tl.arange(0, CHUNK)
        present = tl.zeros([CHUNK], tl.int32)
        lowest = tl.full([CHUNK], 0xFFFFFFFF, tl.uint32)
        highest = tl.zeros([CHUNK], tl.uint32)
        finite = tl.zeros([CHUNK], tl.float32)
        total = tl.zeros([CHUNK], tl.float32)
        squares = tl.zeros([CHUNK], tl.float32)
        for c in range(NB // CHUNK):
            images = ct._load_images(keys_row, c * CHUNK + lanes)
            present += (images != 0).to(tl.int32)
            lowest = tl.minimum(lowest, tl.where(images != 0, images, 0xFFFFFFFF))
            highest = tl.maximum(highest, images)
            if MOMENTS:
                is_finite, value, square = ct._moment_terms(images)
                finite += is_finite
                total += value
                squares += square
        selectable = tl.sum(present, axis=0)
        row_finite, row_total, row_squares = tl.reduce((finite, total, squares), 0, ct._add_triples)
        low = tl.min(lowest, axis=0).to(tl.int64)
        high = tl.max(highest, axis=0).to(tl.int64) + 1
        t2 = _now(selectable)
        k = num_blocks_k - 1
        low_count = selectable
        high_count = selectable * 0
        rounds = selectable * 0
        probe_ns = t2 * 0
        count_ns = t2 * 0
        narrow_ns = t2 * 0
        while (low_count > k) & (high - low > 1):
            ta = _now(rounds)
            below, above, middle, halving = ct._probes(k, selectable, low, low_count, high, high_count,
                                                       (rounds == 0).to(tl.int32), row_finite, row_total,
                                                       row_squares, MOMENTS)
            tb = _now((below + above + middle + halving).to(tl.int32))
            first, second = ct._scratch_probe_counts(keys_row, below, above, middle, halving, NB, CHUNK, CARRY)
            tc = _now(first + second)
            low, low_count, high, high_count = ct._narrow_by_probes(below, above, middle, halving, first, second,
                                                                    k, low, low_count, high, high_count)
            td = _now(low_count + high_count)
            probe_ns += tb - ta
            count_ns += tc - tb
            narrow_ns += td - tc
            rounds += 1
        tl.store(rec + 13, probe_ns)
        tl.store(rec + 14, count_ns)
        tl.store(rec + 15, narrow_ns)
        t = low.to(tl.uint32)
        t3 = _now(rounds)
        ct._emit_prescanned(keys_row, t, num_blocks, num_blocks_k, out_row, 1, NB, CHUNK, LANES, PAD_BLOCK)
        tl.debug_barrier()
        t4 = _now(rounds)
        tl.store(rec + 4, t2)
        tl.store(rec + 5, t3)
        tl.store(rec + 6, t4)
        tl.store(rec + 7, rounds.to(tl.int64))


def _launch(logits, ends, out, keys, arrivals, stamps, mode, moments=False, carry=4):
    rows, width = logits.shape
    nb = width // 8
    pieces, step_nb = ct._SPLIT_PIECES, ct._SPLIT_STEP // 8
    chunk = ct._SPLIT_CHUNK
    arrivals.zero_()
    _probe_kernel[(rows * pieces,)](
        logits, ends, out, keys, arrivals, stamps, 2048, logits.stride(0), out.stride(0),
        BLOCK_SIZE=8, BLOCK_J=8, STEPS=nb // pieces // step_nb, STEP_NB=step_nb, PIECES=pieces, LANES=chunk // 4,
        PAD_BLOCK=ct._PAD_BLOCK, CHUNK=chunk, CARRY=carry, MODE=mode, MOMENTS=moments,
        num_warps=ct._SPLIT_WARPS,
        maxnreg=ct._SPLIT_MAX_REGISTERS)


def _pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _summary(stamps, mode):
    s = stamps.cpu().tolist()
    t_begin = min(r[1] for r in s)
    stream_end = max(r[2] for r in s) - t_begin
    piece_us = [(r[2] - r[1]) / 1e3 for r in s]
    out = {"stream_end_us": stream_end / 1e3, "piece_us_p50": _pct(piece_us, 0.5), "piece_us_p90": _pct(piece_us, 0.9),
           "first_piece_end_us": (min(r[2] for r in s) - t_begin) / 1e3,
           "sms": len({r[0] for r in s})}
    if mode in (0, 2):
        sel = [r for r in s if r[3] == 1]
        end = max(r[6] for r in sel) - t_begin
        out.update({
            "span_us": end / 1e3, "tail_us": (end - stream_end) / 1e3,
            "select_us_p10": _pct([(r[6] - r[2]) / 1e3 for r in sel], 0.1),
            "select_us_p50": _pct([(r[6] - r[2]) / 1e3 for r in sel], 0.5),
            "select_us_p90": _pct([(r[6] - r[2]) / 1e3 for r in sel], 0.9),
            "bounds_us_p50": _pct([(r[4] - r[2]) / 1e3 for r in sel], 0.5),
            "search_us_p50": _pct([(r[5] - r[4]) / 1e3 for r in sel], 0.5),
            "emit_us_p50": _pct([(r[6] - r[5]) / 1e3 for r in sel], 0.5),
            "rounds_p50": _pct([r[7] for r in sel], 0.5), "rounds_max": max(r[7] for r in sel),
            "us_per_round_p50": _pct([(r[5] - r[4]) / 1e3 / max(r[7], 1) for r in sel], 0.5),
            "last_select_start_us": (max(r[2] for r in sel) - t_begin) / 1e3,
            "round_probes_us_p50": _pct([r[13] / 1e3 / max(r[7], 1) for r in sel], 0.5),
            "round_count_us_p50": _pct([r[14] / 1e3 / max(r[7], 1) for r in sel], 0.5),
            "round_narrow_us_p50": _pct([r[15] / 1e3 / max(r[7], 1) for r in sel], 0.5),
        })
        # Selection busy time integrated over the kernel: how many selections run at once, on average.
        out["select_slot_us_total"] = sum((r[6] - r[2]) / 1e3 for r in sel)
        out["stream_slot_us_total"] = sum(piece_us)
    if mode == 2:
        for name, a, b in (("rolled", 6, 8), ("unrolled", 8, 9), ("rolled_chunk_x2", 9, 10), ("rolled_again", 10, 11),
                           ("rolled_cg", 11, 12)):
            out[f"pass_{name}_us_p50"] = _pct([(r[b] - r[a]) / 1e3 for r in sel], 0.5)
    return out


def main(out_dir):
    torch.manual_seed(0)
    results = {}
    clean_src = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def clean_flush():
        clean_src.view(torch.int32).max()

    for rows in (512, 256, 64):
        width = 131072
        logits = torch.randn(rows, width, device="cuda")
        starts = torch.zeros(rows, dtype=torch.int32, device="cuda")
        ends = torch.full((rows,), width, dtype=torch.int32, device="cuda")
        out = torch.empty(rows, 2048, dtype=torch.int32, device="cuda")
        keys = torch.empty(rows, width // 8, dtype=torch.int32, device="cuda")
        arrivals = torch.zeros(rows, dtype=torch.int32, device="cuda")
        stamps = torch.zeros(rows * ct._SPLIT_PIECES, 16, dtype=torch.int64, device="cuda")
        reference = select_candidate_blocks_reference(logits, starts, ends, 2048, 8, 1)
        entry = {}
        for mode, moments, carry in ((0, False, 4), (1, False, 4), (2, False, 4), (0, True, 4), (0, False, 0),
                                     (0, False, 1)):
            tag = f"probe_mode{mode}{'_moments' if moments else ''}{'' if carry == 4 else f'_carry{carry}'}"
            _launch(logits, ends, out, keys, arrivals, stamps, mode, moments, carry)
            torch.cuda.synchronize()
            if mode != 1 and not torch.equal(out, reference):
                raise AssertionError(f"probe R {rows}: differs from the reference")
            flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
            runs = []
            for _ in range(5):
                flush.zero_()
                _launch(logits, ends, out, keys, arrivals, stamps, mode, moments, carry)
                torch.cuda.synchronize()
                runs.append(_summary(stamps, mode))
            runs.sort(key=lambda r: r.get("span_us", r["stream_end_us"]))
            entry[tag] = runs[len(runs) // 2]
            if mode == 2:
                continue
            entry[f"{tag}_cold_memset_us"] = harness.cold_graph_us(
                lambda m=mode, o=moments, y=carry: _launch(logits, ends, out, keys, arrivals, stamps, m, o, y))
            entry[f"{tag}_cold_clean_us"] = harness.cold_graph_us(
                lambda m=mode, o=moments, y=carry: _launch(logits, ends, out, keys, arrivals, stamps, m, o, y),
                before=clean_flush)

        def library():
            return ct.select_candidate_blocks_triton(logits, starts, ends, 2048, 8, 1, out)
        library()
        if not torch.equal(out, reference):
            raise AssertionError(f"library R {rows}: differs from the reference")
        entry["library_cold_memset_us"] = harness.cold_graph_us(library)
        entry["library_cold_clean_us"] = harness.cold_graph_us(library, before=clean_flush)
        entry["floor_us"] = (rows * width * 4 + rows * 2048 * 4) / 4.25e6
        results[rows] = entry
        print(f"R {rows}: " + json.dumps(entry, indent=None, default=lambda x: round(x, 2)), flush=True)
    with open(f"{out_dir}/cand_timeline.json", "w") as f:
        json.dump(results, f, indent=1)
    print("\n| R | probe | library memset | library clean | floor | probe memset | probe span | stream end | tail "
          "| select p50 (bounds / search / emit) | rounds p50 | µs a round | stream-only memset / clean |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |")
    for rows, e in results.items():
        q = e["probe_mode1"]
        for suffix in ("", "_moments", "_carry0", "_carry1"):
            p = e[f"probe_mode0{suffix}"]
            print(f"| {rows} | {suffix or 'default'} | {e['library_cold_memset_us']:.1f} "
                  f"| {e['library_cold_clean_us']:.1f} | {e['floor_us']:.1f} "
                  f"| {e[f'probe_mode0{suffix}_cold_memset_us']:.1f} | {p['span_us']:.1f} | {p['stream_end_us']:.1f} "
                  f"| {p['tail_us']:.1f} | {p['select_us_p50']:.1f} ({p['bounds_us_p50']:.1f} / "
                  f"{p['search_us_p50']:.1f} / {p['emit_us_p50']:.1f}) | {p['rounds_p50']} "
                  f"| {p['us_per_round_p50']:.2f} | {e['probe_mode1_cold_memset_us']:.1f} / "
                  f"{e['probe_mode1_cold_clean_us']:.1f} (stream end {q['stream_end_us']:.1f}) |")

    print("\n| R | probe | µs a round: probes | counts (pass + reduction) | narrowing |")
    print("| --- | --- | ---: | ---: | ---: |")
    for rows, e in results.items():
        for tag in ("probe_mode0", "probe_mode0_moments", "probe_mode0_carry0", "probe_mode0_carry1"):
            p = e[tag]
            print(f"| {rows} | {tag} | {p['round_probes_us_p50']:.2f} | {p['round_count_us_p50']:.2f} | "
                  f"{p['round_narrow_us_p50']:.2f} |")
    print("\n| R | one pass over the row's images, µs (p50): rolled | unrolled | rolled, chunk x2 | rolled again | "
          "rolled .cg |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for rows, e in results.items():
        p = e["probe_mode2"]
        print(f"| {rows} | {p['pass_rolled_us_p50']:.2f} | {p['pass_unrolled_us_p50']:.2f} | "
              f"{p['pass_rolled_chunk_x2_us_p50']:.2f} | {p['pass_rolled_again_us_p50']:.2f} | "
              f"{p['pass_rolled_cg_us_p50']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
