"""FP8 Gluon paged decode: the configurations of ``GLUON_SWEEP_CONFIGS`` against the library's default, and the
defaults under several L2 states (where the small shapes' fixed cost goes). H=64, D=128, 64-token pages
permuted over one pool of 16M keys (the logits suite's cases), CUDA-graph medians of 30 replays.

Parts (each appends rows to $OUT/diag_<part>.jsonl as it goes, so a timeout keeps what was measured):
  configs  ``auto`` and every ``GLUON_SWEEP_CONFIGS`` entry at the small shapes (``--large``: the 4M-16M-key
           shapes too), under the suite's flush, each configuration at the row count it is built for (one-row
           ones at next_n = 1, draft-row ones at next_n >= 2); ``auto`` is timed again last (the run-to-run
           spread); ``--variants`` / ``--next-n`` / ``--shape`` narrow it, ``--warm`` only compiles (one call a
           case, nothing timed: parallel warm-up processes fill Triton's cache before a timed run)
  flush    ``auto`` under each L2 state at the suite's shapes and at B = 1, L = 16K-64K (intercept = fixed cost)

Variants: ``auto`` = the library's dispatch (``ops/logits``: Triton or Gluon with the default configuration),
``empty`` = a one-element add (the graph launch and event floor), any other name = ``paged_mqa_logits_gluon``
with that ``GLUON_SWEEP_CONFIGS`` entry. L2 state before each replay (``flush``): ``dirty`` = a 256 MB memset
(the suite's method, ``harness.cold_graph_us``: the L2 ends full of dirty lines whose write-back the kernel
pays), ``clean`` = a 256 MB read (clean lines of another buffer), ``meta`` = clean, then the lengths and block
table read (only the keys cold), ``hot`` = no flush, ``rotating`` = the suite's ``us``: replays cycling through
sets of pages, queries and outputs larger than three L2s (``harness.rotating_graph_us``, DESIGN.md §12; the
configs part takes it with ``--flush rotating``). ``bits``: bitwise equal to ``auto`` at the same shape.

  OUT=/tmp/diag python scripts/gluon_decode_diag.py --part configs --table
  OUT=/tmp/diag python scripts/gluon_decode_diag.py --part configs --large --next-n 2 --variants auto cta3 cta3-copies
"""

import argparse
import dataclasses
import json
import os

import torch

from dsa_indexer.bench import harness
from dsa_indexer.bench.suite_logits import _decode_case, _decode_pool, _rotation, decode_floor
from dsa_indexer.ops import logits as logits_ops
from dsa_indexer.ops.common.gluon import cp_async_fallback
from dsa_indexer.ops.common.runtime import sm_count
from dsa_indexer.ops.logits import gluon_decode
from dsa_indexer.ops.logits.gluon_decode import paged_mqa_logits_gluon

_LARGE, _SMALL = gluon_decode.GLUON_DECODE_CONFIG, gluon_decode.GLUON_DECODE_CONFIG_SMALL
# The configurations compared with the library's choice: the shipped ones, their cp.async forms and the steps
# from an earlier small-shape default to the shipped one (the variants that lost are in benchmarks/devlog/logits.md).
GLUON_SWEEP_CONFIGS = {
    "cta3": _LARGE,
    "persist4-one-row": gluon_decode.GLUON_DECODE_CONFIG_ONE_ROW,
    "persist2-coarse-early": _SMALL,
    "cta3-copies": dataclasses.replace(cp_async_fallback(_LARGE), producer_regs=32),
    "persist4-one-row-copies": cp_async_fallback(gluon_decode.GLUON_DECODE_CONFIG_ONE_ROW),
    # 8 items per SM aimed at, the first table entry after the lengths.
    "persist2": dataclasses.replace(cp_async_fallback(_SMALL), programs_per_sm=8, producer_regs=40,
                                    early_table=False),
    # The first table entry beside the lengths: one cold read less in the chain before the first keys.
    "persist2-early": dataclasses.replace(cp_async_fallback(_SMALL), programs_per_sm=8, producer_regs=40),
    # Twice the tiles a split (4 items per SM aimed at): half the items, so half the per-item query copies.
    "persist2-coarse-early-copies": dataclasses.replace(cp_async_fallback(_SMALL), producer_regs=40),
    "wave3-early": gluon_decode.GLUON_DECODE_CONFIG_WAVE,
    # The one-wave default without the early table entry.
    "wave3": dataclasses.replace(gluon_decode.GLUON_DECODE_CONFIG_WAVE, early_table=False),
}

K = 1024
POOL_KEYS = 128 * 128 * K  # the suite's pool: its largest case (B = 128, L = 128K)
SMALL_SHAPES = [(1, 128 * K, 2), (32, 32 * K, 2), (32, 32 * K, 1), (1, 128 * K, 1)]
LARGE_SHAPES = [(32, 128 * K, 2), (128, 32 * K, 2), (128, 128 * K, 2)]
LARGE_SHAPES_ONE_ROW = [(32, 128 * K, 1), (128, 32 * K, 1)]
# (B, L, next_n, flush, variants)
FLUSH_CASES = [
    (1, 128 * K, 2, "dirty", ("empty", "auto")),
    (1, 128 * K, 2, "clean", ("empty", "auto")),
    (1, 128 * K, 2, "meta", ("auto",)),
    (1, 128 * K, 2, "hot", ("empty", "auto")),
    *[(1, 128 * K, 1, flush, ("auto",)) for flush in ("dirty", "clean", "hot")],
    *[(1, length * K, 2, flush, ("auto",)) for length in (16, 32, 64) for flush in ("dirty", "clean")],
    *[(batch, length, next_n, flush, ("auto",)) for batch, length, next_n in SMALL_SHAPES[1:3] + LARGE_SHAPES[::2]
      for flush in ("dirty", "clean")],
]


def applies(name, next_n, any_rows=False):
    """Whether variant ``name`` is timed at ``next_n``: a sweep configuration at the row count it is built for
    (one draft row per program or more), or at every row count with ``any_rows``."""
    if name not in GLUON_SWEEP_CONFIGS or any_rows:
        return True
    return (GLUON_SWEEP_CONFIGS[name].max_rows == 1) == (next_n == 1)


def config_cases(large, variants=None, only_next_n=None, only_shapes=None, flush="dirty", any_rows=False):
    """(B, L, next_n, flush, variants) of the configs part; ``only_shapes``: (B, L, next_n) to keep."""
    variants = tuple(variants or ("auto", *GLUON_SWEEP_CONFIGS, "auto-again"))
    shapes = SMALL_SHAPES + (LARGE_SHAPES + LARGE_SHAPES_ONE_ROW if large else [])
    return [(batch, length, next_n, flush, tuple(name for name in variants if applies(name, next_n, any_rows)))
            for batch, length, next_n in shapes if (only_next_n is None or next_n == only_next_n)
            and (not only_shapes or (batch, length, next_n) in only_shapes)]


def decode_call(name, args, out):
    """A no-argument callable running variant ``name`` on the decode arguments ``args`` into ``out`` (the
    arguments are bound now: rotating sets keep their own)."""
    if name in ("auto", "auto-again"):
        return lambda: logits_ops.paged_mqa_logits_triton_dispatch(*args, True, out)
    if name == "empty":
        tiny = torch.zeros(1, device="cuda")
        return lambda: tiny.add_(1)
    config = GLUON_SWEEP_CONFIGS[name]
    return lambda: paged_mqa_logits_gluon(*args, True, out, config=config)


def graph_us(name, args, out, flush, rotation, reps=30):
    """Median µs of CUDA-graph replays of variant ``name`` with the L2 in state ``flush`` before each replay
    (see the module docstring; ``rotation``: the (arguments, output) sets of ``rotating``, the first being
    ``(args, out)``)."""
    if flush == "rotating":
        return harness.rotating_graph_us(
            [decode_call(name, a, out if i == 0 else o) for i, (a, o) in enumerate(rotation)], reps)
    call = decode_call(name, args, out)
    metadata = (args[4], args[5])
    if flush == "dirty":
        return harness.cold_graph_us(call, reps)
    words = torch.zeros(64 << 20, dtype=torch.int32, device="cuda")  # 256 MB, read: clean lines

    def before():
        if flush in ("clean", "meta"):
            words.max()
        if flush == "meta":
            for tensor in metadata:
                tensor.max()

    return harness.cold_graph_us(call, reps, before=before)


def ceilings_for(out_dir):
    """The run's ceilings, measured once and shared by the parts through $OUT/ceilings.json."""
    path = os.path.join(out_dir, "ceilings.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    ceilings = harness.measure_ceilings()
    with open(path, "w") as f:
        json.dump(ceilings, f)
    return ceilings


def warm(cases):
    """Compile every kernel ``cases`` would time (one call each, on the same shapes: the split, and so the
    compiled constants, depends on the shape)."""
    gen = torch.Generator().manual_seed(5)
    cache = _decode_pool("fp8", POOL_KEYS // 64 + 64)
    for batch, length, next_n, _, variants in cases:
        args = _decode_case(cache, batch, length, next_n, gen)[4]
        out = torch.empty((batch * next_n, length), device="cuda")
        for name in variants:
            if name != "auto-again":
                decode_call(name, args, out)()
        torch.cuda.synchronize()
        print(f"warm B={batch} L={length} n={next_n}: {' '.join(variants)}", flush=True)


def run_part(part, cases, out_dir):
    ceilings = ceilings_for(out_dir)
    gen = torch.Generator().manual_seed(5)
    cache = _decode_pool("fp8", POOL_KEYS // 64 + 64)
    with open(os.path.join(out_dir, f"diag_{part}.jsonl"), "a") as log:
        for batch, length, next_n, flush, variants in cases:
            args = _decode_case(cache, batch, length, next_n, gen)[4]
            auto = torch.empty((batch * next_n, length), device="cuda")
            decode_call("auto", args, auto)()
            rotation = None
            if flush == "rotating":
                moved = decode_floor("fp8", batch, length, next_n, ceilings)["moved"]
                rotation = _rotation(args, auto, harness.rotation_count(moved))
            for name in variants:
                out = auto if name in ("auto", "empty") else torch.empty_like(auto)
                try:
                    us = graph_us(name, args, out, flush, rotation)
                except Exception as error:  # noqa: BLE001 - a failing variant must not hide the others
                    print(f"{name} B={batch} L={length} n={next_n}: {type(error).__name__}: {error}"[:300], flush=True)
                    continue
                if name in GLUON_SWEEP_CONFIGS:
                    config = dataclasses.asdict(GLUON_SWEEP_CONFIGS[name])
                elif name.startswith("auto"):
                    kernel = logits_ops.decode_kernel(args[0], cache, length)
                    config = (kernel if kernel == "triton"
                              else dataclasses.asdict(gluon_decode.gluon_decode_config(
                                  batch, next_n, length, sm_count(args[0].device))))
                else:
                    config = None
                floor_us = decode_floor("fp8", batch, length, next_n, ceilings)["floor_us"]
                row = {"part": part, "B": batch, "L": length, "next_n": next_n, "flush": flush, "variant": name,
                       "config": config, "us": round(us, 2), "floor_us": round(floor_us, 2),
                       "pct_of_floor": round(100 * floor_us / us, 1),
                       "same_bits": None if name == "empty"
                       else torch.equal(out.view(torch.int32), auto.view(torch.int32))}
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(row, flush=True)
            del auto
    torch.cuda.synchronize()


def print_table(out_dir):
    rows = []
    for part in ("configs", "flush"):
        path = os.path.join(out_dir, f"diag_{part}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                rows += [json.loads(line) for line in f if line.strip()]
    base = {(r["part"], r["B"], r["L"], r["next_n"], r["flush"]): r["us"] for r in rows if r["variant"] == "auto"}
    print(f"{'part':7} {'B':>3} {'L':>6} {'n':>1} {'flush':5} {'variant':21} {'us':>7} {'%floor':>6} {'vs auto':>7} "
          "bits")
    for r in rows:
        ref = base.get((r["part"], r["B"], r["L"], r["next_n"], r["flush"]))
        speedup = f"{ref / r['us']:7.3f}" if ref and r["variant"] not in ("auto", "empty") else f"{'':7}"
        bits = {True: "same", False: "DIFF", None: "-"}[r["same_bits"]]
        print(f"{r['part']:7} {r['B']:3} {r['L'] // K:5}K {r['next_n']:1} {r['flush']:5} {r['variant']:21} "
              f"{r['us']:7.2f} {r['pct_of_floor']:6.1f} {speedup} {bits}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("configs", "flush"))
    parser.add_argument("--large", action="store_true", help="configs: the 4M-16M-key shapes too")
    parser.add_argument("--variants", nargs="+", help="configs: these variants only (auto, auto-again, sweep names)")
    parser.add_argument("--next-n", type=int, help="configs: the shapes with this next_n only")
    parser.add_argument("--shape", action="append", metavar="B,L_IN_K,NEXT_N",
                        help="configs: this shape only (repeatable), e.g. 32,128,2")
    parser.add_argument("--flush", choices=("dirty", "clean", "rotating"), default="dirty",
                        help="configs: the L2 state before each replay (default: dirty, the memset)")
    parser.add_argument("--any-rows", action="store_true",
                        help="configs: time every configuration at every next_n (one-row ones run draft rows in groups)")
    parser.add_argument("--warm", action="store_true", help="configs: compile the kernels only (nothing timed)")
    parser.add_argument("--table", action="store_true", help="print the table of every part measured in $OUT")
    options = parser.parse_args()
    out_dir = os.environ.get("OUT", "/tmp/gluon_decode_diag")
    os.makedirs(out_dir, exist_ok=True)
    shapes = [tuple(int(x) for x in shape.split(",")) for shape in options.shape or ()]
    shapes = [(batch, length * K, next_n) for batch, length, next_n in shapes]
    cases = (config_cases(options.large, options.variants, options.next_n, shapes, options.flush, options.any_rows)
             if options.part == "configs" else FLUSH_CASES)
    if options.part and options.warm:
        warm(cases)
    elif options.part:
        run_part(options.part, cases, out_dir)
    if options.table:
        print_table(out_dir)


if __name__ == "__main__":
    main()
