"""Decode launch sweep: cold-L2 graph-replay µs of launch variants of the paged decode kernels on a few shapes.

``python benchmarks/sweeps/logits_decode.py [OUT_DIR] [--fmt mxfp4|fp8] [--variants a,b] [--compile-only]``
(CUDA). Each variant's output is compared with the shipped launch's (bits and calc_diff); the shipped launches
are checked against the reference by the suite (``dsa-indexer bench --suite logits``) and the tests. The
variants are the shipped launches and the neighbours they were picked against (benchmarks/NOTES_logits.md).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch

from dsa_indexer.bench import harness
from dsa_indexer.bench.suite_logits import PAGE, _decode_case, _decode_pool, _rotation, decode_floor
from dsa_indexer.ops.common.gluon import cp_async_fallback
from dsa_indexer.ops.logits import triton as kernels
from dsa_indexer.testing import calc_diff

_FP8 = kernels.DecodeConfig()
_MXFP4 = kernels.MXFP4_DECODE_CONFIG


def _gluon_mxfp4_variants() -> dict:
    from dsa_indexer.ops.logits import gluon_decode_mxfp4 as mxfp4

    return {
        "gluon": {"config": mxfp4.GLUON_MXFP4_DECODE_CONFIG, "next_n": (2,)},
        "gluon-wave": {"config": mxfp4.GLUON_MXFP4_DECODE_CONFIG_WAVE, "next_n": (2,)},
        "gluon-one-row": {"config": mxfp4.GLUON_MXFP4_DECODE_CONFIG_ONE_ROW, "next_n": (1,)},
        "gluon-copies": {"config": cp_async_fallback(mxfp4.GLUON_MXFP4_DECODE_CONFIG), "next_n": (2,)},
        "gluon-copies-one-row": {"config": cp_async_fallback(mxfp4.GLUON_MXFP4_DECODE_CONFIG_ONE_ROW),
                                 "next_n": (1,)},
    }


# Shapes (fmt, B, L, next_n) and variants (name -> keyword arguments of ``paged_mqa_logits_triton``; "baseline"
# is the previous kernel when ``dsa_indexer.ops.logits._baseline`` exists, a snapshot kept only for a measuring
# run).
SWEEP_CASES = [
    ("mxfp4", 32, 131072, 1), ("mxfp4", 128, 32768, 2), ("mxfp4", 32, 32768, 1), ("mxfp4", 32, 32768, 2),
    ("mxfp4", 32, 131072, 2),
    ("mxfp4", 1, 131072, 1), ("mxfp4", 1, 131072, 2), ("mxfp4", 128, 131072, 1), ("mxfp4", 128, 131072, 2),
    ("fp8", 32, 131072, 2), ("fp8", 128, 32768, 2), ("fp8", 1, 131072, 2), ("fp8", 32, 32768, 1),
]
SWEEP_VARIANTS = {
    "fp8": {
        "baseline": None,
        "default": {},
        "rows1": {"config": dataclasses.replace(_FP8, max_rows=1)},
        "stages5": {"config": dataclasses.replace(_FP8, num_stages=5)},
        "stages7": {"config": dataclasses.replace(_FP8, num_stages=7)},
        "k64-stages7": {"config": dataclasses.replace(_MXFP4, num_stages=7)},
        "k64-stages9": {"config": dataclasses.replace(_MXFP4, num_stages=9)},
    },
    "mxfp4": {
        "baseline": None,
        "default": {},
        "stages3": {"config": dataclasses.replace(_MXFP4, num_stages=3)},
        "stages9": {"config": dataclasses.replace(_MXFP4, num_stages=9)},
    },
}


def _baseline_kernel():
    try:
        from dsa_indexer.ops.logits import _baseline
    except ImportError:
        return None
    return _baseline.paged_mqa_logits_triton


def _sweep_calls(fmt: str, next_n: int, baseline):
    """(name, function of ``(args, out)`` running the variant on a case, or None when unavailable)
    for the Triton variants, then the Gluon ones that apply to ``next_n``."""
    calls = []
    for name, kwargs in SWEEP_VARIANTS[fmt].items():
        if kwargs is None:
            calls.append((name, None if baseline is None else lambda args, out: baseline(*args, True, out)))
        else:
            calls.append((name, functools.partial(_triton_variant, kwargs=kwargs)))
    for name, spec in (_gluon_mxfp4_variants() if fmt == "mxfp4" else {}).items():
        if next_n in spec["next_n"]:
            calls.append((name, functools.partial(_gluon_variant, config=spec["config"])))
    return calls


def _triton_variant(args, out, *, kwargs):
    return kernels.paged_mqa_logits_triton(*args, True, out, **kwargs)


def _gluon_variant(args, out, *, config):
    from dsa_indexer.ops.logits.gluon_decode_mxfp4 import paged_mqa_logits_gluon_mxfp4

    return paged_mqa_logits_gluon_mxfp4(*args, True, out, config=config)


def sweep(out_dir: str | None = None, formats=("mxfp4", "fp8"), variants=None, compile_only: bool = False) -> None:
    """Cold-L2 graph-replay µs (rotating buffers, as the suite's ``us``) of each decode variant on each sweep
    shape, with its calc_diff against
    the default variant's output (checked against the reference by ``run`` and the tests); prints a table
    last and writes ``logits_sweep.json`` to ``out_dir`` when given. ``variants`` (names) restricts the
    variants; ``compile_only`` runs each once and times nothing (fills Triton's cache, e.g. in parallel
    processes ahead of the timing one)."""
    import json
    import os

    ceilings = None if compile_only else harness.measure_ceilings()
    baseline = _baseline_kernel()
    gen = torch.Generator().manual_seed(1)
    rows = []
    for fmt in formats:
        cache = _decode_pool(fmt, max(b * n for f, b, n, _ in SWEEP_CASES if f == fmt) // PAGE + 64)
        for case_fmt, batch, length, next_n in SWEEP_CASES:
            if case_fmt != fmt:
                continue
            _, _, _, _, args = _decode_case(cache, batch, length, next_n, gen)
            floor_us = None if compile_only else decode_floor(fmt, batch, length, next_n, ceilings)["floor_us"]
            expected = torch.empty((batch * next_n, length), device="cuda")
            kernels.paged_mqa_logits_triton(*args, True, expected)
            others = [] if compile_only else _rotation(args, expected, harness.rotation_count(
                decode_floor(fmt, batch, length, next_n, ceilings)["moved"]))[1:]
            for name, call_with in _sweep_calls(fmt, next_n, baseline):
                if variants is not None and name not in variants:
                    continue
                if compile_only:
                    if name != "baseline":
                        call_with(args, torch.empty_like(expected))
                    continue
                if call_with is None:
                    continue
                out = torch.empty_like(expected)
                us = harness.rotating_graph_us(
                    [functools.partial(call_with, a, o) for a, o in [(args, out), *others]], reps=50)
                try:
                    diff = calc_diff(out, expected)
                except AssertionError as error:  # -inf masks differ
                    diff = str(error)
                row = {"fmt": fmt, "B": batch, "L": length, "next_n": next_n, "variant": name, "us": round(us, 2),
                       "pct_of_floor": round(100 * floor_us / us, 1), "calc_diff_vs_default": diff,
                       "bits_equal_default": torch.equal(out.view(torch.int32), expected.view(torch.int32))}
                rows.append(row)
                print(row, flush=True)
        del cache
        torch.cuda.empty_cache()
    if compile_only:
        return
    if out_dir:
        with open(os.path.join(out_dir, "logits_sweep.json"), "w") as f:
            json.dump({"ceilings": ceilings, "environment": harness.environment(), "rows": rows}, f, indent=1)
    print(f"read {ceilings['read_tbs']:.2f} TB/s")
    print(f"{'fmt':6} {'B':>4} {'L':>7} {'n':>2} {'variant':15} {'us':>9} {'% floor':>8} same bits")
    for row in rows:
        print(f"{row['fmt']:6} {row['B']:4} {row['L']:7} {row['next_n']:2} {row['variant']:15} {row['us']:9.1f} "
              f"{row['pct_of_floor']:8.1f} {row['bits_equal_default']}")


def _main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python benchmarks/sweeps/logits_decode.py",
                                     description="decode variant sweep (the full suite runs through dsa-indexer bench)")
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--fmt", choices=["mxfp4", "fp8"], action="append", help="key formats (default: both)")
    parser.add_argument("--variants", help="comma-separated variant names (default: all)")
    parser.add_argument("--compile-only", action="store_true", help="run each variant once, time nothing")
    args = parser.parse_args(argv)
    variants = args.variants.split(",") if args.variants else None
    known = {name for table in SWEEP_VARIANTS.values() for name in table} | set(_gluon_mxfp4_variants())
    unknown = set(variants or ()) - known
    if unknown:
        parser.error(f"unknown variants: {sorted(unknown)}")
    sweep(args.out_dir, tuple(args.fmt or ("mxfp4", "fp8")), variants, args.compile_only)


if __name__ == "__main__":
    _main(sys.argv[1:])
