#!/usr/bin/env bash
# Decode top-k, session 6 round 3 (issue 6: R=32 and R=128 at k=2048). The default now launches every kernel with
# programmatic dependent launch (`pdl`); round 2's losing knobs are gone. 71 GPU tests of the default and of `no_pdl`
# (many_rows: 32/128 rows of 131072, every generator, garbage past the ends, decode graph replay, the timeline probe;
# the split and pieces many_rows configs deselected, unchanged since round 1; pdl: 20 eager reruns and a two-call graph
# at 1/6/32/128 rows; graph: graph replay on every wide path; -x, 40 s per test, 42 s in all) while 8 processes
# compile the sweep's and the timeline's kernels (Triton's disk cache), then the phase timeline
# (`timeline_decode`: R=32 and R=128, k=2048, graph replays after an L2 flush, phase table), then `sweep_decode`:
# `base` (pdl) against `no_pdl` at random R=1 (k 2048 / 512, each cell twice), R=32 and R=128 (k=2048); table last.
# Cap 100 s (tests and compiles 42 s, timeline ~10 s, sweep the rest). Run from the repo root: bash scripts/rounds/topk-next.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/topk-next}"; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1 GPU_TEST_TIMEOUT=40
t0=$(date +%s)
warm_pids=()
for share in 0 1 2 3 4 5 6; do
  timeout 42 python3 -m dsa_indexer.bench.suite_topk sweep_decode --warm="$share/7" > "$OUT/warm$share.log" 2>&1 &
  warm_pids+=($!)
done
timeout 42 python3 -m dsa_indexer.bench.suite_topk timeline_decode --warm > "$OUT/warm_timeline.log" 2>&1 &
warm_pids+=($!)
tests="gpu and (many_rows or pdl or graph) and not split_many_rows and not pieces_many_rows"
timeout 42 scripts/gpu-check tests/ops/test_topk_kernel.py -n 8 -x -k "$tests" > "$OUT/gpu-check.console" 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/gpu-check.log" 2>/dev/null)"
grep -E "^(FAILED|ERROR)" "$OUT/gpu-check.log" 2>/dev/null | head -5
for pid in "${warm_pids[@]}"; do wait "$pid"; done
echo "warm done $(( $(date +%s) - t0 )) s: $(grep -l -i -E "error|Traceback" "$OUT"/warm*.log 2>/dev/null | tr '\n' ' ')"
timeout 25 python3 -m dsa_indexer.bench.suite_topk timeline_decode > "$OUT/timeline.log" 2>&1
echo "timeline rc=$? $(( $(date +%s) - t0 )) s"
left=$(( 97 - ($(date +%s) - t0) )); (( left < 10 )) && left=10
timeout "$left" python3 -m dsa_indexer.bench.suite_topk sweep_decode "$OUT/topk-next_sweep.json" > "$OUT/sweep.log" 2>&1
echo "sweep rc=$? $(( $(date +%s) - t0 )) s"
grep -E "FAILED|NOT EXACT|regs=" "$OUT/sweep.log" | sort | uniq -c | head -20
cat "$OUT/timeline.log"
grep "^|" "$OUT/sweep.log"
if ! grep -q "^| shape" "$OUT/sweep.log" && [ -f "$OUT/topk-next_sweep.json" ]; then  # stopped at the cap: the cells measured so far
  python3 - "$OUT/topk-next_sweep.json" <<'PY'
import json, sys
records = json.load(open(sys.argv[1]))["records"]
names = list(dict.fromkeys(n for r in records for n in r["us"]))
print("| shape | " + " | ".join(names) + " |")
for r in records:
    print(f"| {r['shape']} | " + " | ".join("" if r['us'].get(n) is None else f"{r['us'][n]:.1f}" for n in names) + " |")
PY
fi
