#!/usr/bin/env bash
# MXFP4 Gluon decode, session 5 round (issue 5; NOTES_logits.md "MXFP4 Gluon decode, TMA producer and
# shuffle-free e_max"): the producer as one warp issuing two TMA copies a tile (`tma*`:
# GLUON_MXFP4_CANDIDATE_CONFIGS, config field 9), e_max without quad shuffles (`*-local`, field 10) and a
# control (`copies-p24`: cp.async producer at 24 registers, draft rows), against the defaults. GPU tests of the
# new configs (-x, 60 s per test) while 8 processes compile every swept kernel (one per shape, Triton's disk
# cache), then the sweep: CUDA-graph medians of 30 replays after the suite's 256 MB memset
# (harness.cold_graph_us), suite shapes (H=64, D=128, 64-token pages permuted over one 16M-key pool), every
# variant checked bitwise against the default first; table last.
# Cap 120 s (tests and compiles 60 s, sweep the rest). Run from the repo root on an H200:
#   bash scripts/rounds/logits-mxfp4-next.sh   (writes under $OUT)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/logits-mxfp4-next}"; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1 GPU_TEST_TIMEOUT=60
t0=$(date +%s)
cat > "$OUT/sweep.py" <<'PY'
"""python sweep.py warm CASE_INDEX | python sweep.py time: the MXFP4 Gluon decode variants of this round."""
import json
import os
import sys

import torch

from dsa_indexer.bench import harness
from dsa_indexer.bench.suite_logits import _decode_case, _decode_pool
from dsa_indexer.ops.logits import gluon_decode_mxfp4 as g

K = 1024
CASES = [(32, 32 * K, 1), (32, 128 * K, 1), (128, 32 * K, 1), (128, 128 * K, 1),
         (32, 32 * K, 2), (32, 128 * K, 2), (128, 32 * K, 2), (128, 128 * K, 2)]
TMA = g.GLUON_MXFP4_CANDIDATE_CONFIGS
VARIANTS = {  # None: the library's default for the row count
    1: {"default": None, "ahead": (4, 8, 2, 32, 2, 4, 40, 80, 1),
        **{name: TMA[name] for name in ("tma-one-row", "tma-one-row-s8", "tma-ahead", "tma-one-row-local")}},
    2: {"default": None, **{name: TMA[name] for name in ("tma", "tma-local", "copies-p24")}},
}
READ_TBPS = 4.13  # session 4's measured read rate (NOTES_logits.md Run 9): the byte floor's bandwidth


def run(indices, timed):
    gen = torch.Generator().manual_seed(5)
    cache = _decode_pool("mxfp4", 128 * 128 * K // 64 + 64)
    records = []
    for index in indices:
        batch, length, next_n = CASES[index]
        args = _decode_case(cache, batch, length, next_n, gen)[4]
        assert g._tma_pages(cache, TMA["tma"]) is not None, "the pool cannot take TMA page copies"
        outputs, record = {}, {"shape": f"B={batch} L={length // K}K n={next_n}", "us": {}, "bits": {}}
        floor_us = (batch * length * 68 + batch * next_n * length * 4) / (READ_TBPS * 1e6)
        for name, config in list(VARIANTS[next_n].items()) + ([("default-again", None)] if timed else []):
            out = torch.empty((batch * next_n, length), device="cuda")
            call = lambda out=out, config=config: g.paged_mqa_logits_gluon_mxfp4(*args, True, out, config=config)
            call()
            torch.cuda.synchronize()
            outputs.setdefault(name, out)
            record["bits"][name] = bool(torch.equal(out.view(torch.int32), outputs["default"].view(torch.int32)))
            if timed:
                record["us"][name] = harness.cold_graph_us(call, reps=30)
                print(f"{record['shape']} {name}: {record['us'][name]:.2f} us "
                      f"({100 * floor_us / record['us'][name]:.1f} % of byte floor) bits={record['bits'][name]}",
                      flush=True)
        record["floor_us"] = floor_us
        records.append(record)
        if not timed:
            print(f"warm {record['shape']}: bits {record['bits']}", flush=True)
        else:
            with open(os.path.join(os.environ["OUT"], "sweep.jsonl"), "a") as log:
                log.write(json.dumps(record) + "\n")
    return records


if __name__ == "__main__":
    if sys.argv[1] == "warm":
        run([int(sys.argv[2])], timed=False)
    else:
        run(range(len(CASES)), timed=True)
PY
warm_pids=()
for case in 0 1 2 3 4 5 6 7; do
  timeout 60 python3 "$OUT/sweep.py" warm "$case" > "$OUT/warm$case.log" 2>&1 &
  warm_pids+=($!)
done
timeout 60 scripts/gpu-check tests/ops/test_logits_gluon_mxfp4.py -n 8 -x -k "candidates" \
  > "$OUT/gpu-check.console" 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/gpu-check.log" 2>/dev/null)"
grep -E "^(FAILED|ERROR)" "$OUT/gpu-check.log" 2>/dev/null | head -5
for pid in "${warm_pids[@]}"; do wait "$pid" || echo "a warm process failed (pid $pid)"; done
differing=$(grep -h "^warm" "$OUT"/warm*.log | grep -c "False")
errors=$(grep -l -E "Error|Traceback" "$OUT"/warm*.log 2>/dev/null | tr '\n' ' ')
echo "warm done $(( $(date +%s) - t0 )) s: $differing cases with differing bits; errors in: $errors"
left=$(( 117 - ($(date +%s) - t0) )); (( left < 10 )) && left=10
timeout "$left" python3 "$OUT/sweep.py" time > "$OUT/sweep.log" 2>&1
echo "sweep rc=$? $(( $(date +%s) - t0 )) s"
grep -E "Error|bits=False" "$OUT/sweep.log" | head -5
python3 - "$OUT/sweep.jsonl" <<'PY'
import json, os, sys
records = [json.loads(line) for line in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
for next_n in (1, 2):
    rows = [r for r in records if r["shape"].endswith(f"n={next_n}")]
    if not rows:
        continue
    names = list(dict.fromkeys(n for r in rows for n in r["us"]))
    print(f"\n| shape (µs, % of byte floor; x = default/variant; * = bits differ) | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for r in rows:
        base = r["us"]["default"]
        cells = [f"{r['us'][n]:.1f} ({100 * r['floor_us'] / r['us'][n]:.1f}, {base / r['us'][n]:.3f}x)"
                 + ("" if r["bits"].get(n, True) else " *") for n in names if n in r["us"]]
        print(f"| {r['shape']} | " + " | ".join(cells) + " |")
PY
