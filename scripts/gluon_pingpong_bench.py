"""FP8 Gluon decode: the ping-pong configurations (two consumer warpgroups per program) against the current
defaults (``cta3`` from 4M keys, ``persist2`` below; ``persist4-one-row`` at next_n = 1), called through
``paged_mqa_logits_gluon`` with each ``config`` (``GLUON_SWEEP_CONFIGS``). Cold-L2 CUDA-graph medians of 30
replays, H=64, D=128, 64-token pages permuted; floor = ``decode_floor`` (bytes or MMA, measured in this
run); ``same-bits``: bitwise equal to the default configuration's output. Table last; rows also go to
$OUT/pingpong_bench.json.

  python scripts/gluon_pingpong_bench.py                 # time everything
  python scripts/gluon_pingpong_bench.py --warm NAME...  # compile only (Triton's disk cache)
"""

import argparse
import json
import os

import torch

from dsa_indexer.bench import harness
from dsa_indexer.bench.suite_logits import _decode_case, _decode_pool, decode_floor
from dsa_indexer.ops.logits.gluon_decode import GLUON_SWEEP_CONFIGS, gluon_decode_config, paged_mqa_logits_gluon

# (B, L, next_n): the draft-row shapes under the 80 % target first, then one row and a small shape.
SHAPES = ((32, 131072, 2), (128, 32768, 2), (128, 131072, 2), (32, 32768, 2), (32, 32768, 4), (32, 131072, 1))
VARIANTS = ("default", "cta3", "persist2", "pingpong", "pingpong-persist")


def config_of(name, batch, length, next_n):
    return gluon_decode_config(batch, next_n, length) if name == "default" else GLUON_SWEEP_CONFIGS[name]


def cases():
    gen = torch.Generator().manual_seed(5)
    cache = _decode_pool("fp8", max(b * n_len for b, n_len, _ in SHAPES) // 64 + 64)
    for batch, length, next_n in SHAPES:
        yield batch, length, next_n, _decode_case(cache, batch, length, next_n, gen)[4]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--warm", nargs="+", help="compile these variants only")
    options = parser.parse_args()
    names = options.warm or VARIANTS
    ceilings = None if options.warm else harness.measure_ceilings()
    rows = []
    for batch, length, next_n, args in cases():
        default = torch.empty((batch * next_n, length), device="cuda")
        paged_mqa_logits_gluon(*args, True, default, config=config_of("default", batch, length, next_n))
        for name in names:
            config = config_of(name, batch, length, next_n)
            out = torch.empty_like(default)
            call = lambda: paged_mqa_logits_gluon(*args, True, out, config=config)  # noqa: E731
            if options.warm:
                call()
                continue
            try:
                us = harness.cold_graph_us(call, reps=30)
            except Exception as error:  # noqa: BLE001 - a failing variant must not hide the others
                print(f"{name} B={batch} L={length} n={next_n}: {type(error).__name__}: {error}"[:300], flush=True)
                continue
            floor = decode_floor("fp8", batch, length, next_n, ceilings)
            row = {"B": batch, "L": length, "next_n": next_n, "variant": name, "config": list(config),
                   "us": round(us, 2), "floor_us": round(floor["floor_us"], 1), "bound": floor["bound"],
                   "pct_of_floor": round(100 * floor["floor_us"] / us, 1),
                   "same_bits": torch.equal(out.view(torch.int32), default.view(torch.int32))}
            rows.append(row)
            print(row, flush=True)
    torch.cuda.synchronize()
    if options.warm:
        return
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "pingpong_bench.json"), "w") as f:
            json.dump({"ceilings": ceilings, "environment": harness.environment(), "rows": rows}, f, indent=1)
    print(f"read {ceilings['read_tbs']:.2f} TB/s, fp8 {ceilings['fp8_tflops']:.0f} TFLOP/s")
    print(f"{'B':>4} {'L':>7} {'n':>2} {'variant':17} {'us':>8} {'floor':>7} {'%floor':>7} {'vs default':>10} "
          "same-bits")
    base = {(r["B"], r["L"], r["next_n"]): r["us"] for r in rows if r["variant"] == "default"}
    for r in rows:
        ref = base.get((r["B"], r["L"], r["next_n"]))
        speedup = f"{ref / r['us']:10.3f}" if ref else f"{'':10}"
        print(f"{r['B']:4} {r['L']:7} {r['next_n']:2} {r['variant']:17} {r['us']:8.1f} {r['floor_us']:7.1f} "
              f"{r['pct_of_floor']:7.1f} {speedup} {r['same_bits']}")


if __name__ == "__main__":
    main()
