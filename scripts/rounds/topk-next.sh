#!/usr/bin/env bash
# Decode top-k, session 6 round (prepared in session 5; issue 6): routing only. `split_all` takes the split path (two
# launches: group maxima; candidates, T and emit) at every row count, `pieces_to_128` the gather-piece launches up to
# 128 rows; the crossover against the default (split below 8 rows, gather pieces 8..64, row programs above) sets
# `row_program_rows` / `pieces_max_rows`.
# GPU tests of both routings at 32..128 rows of 131072 (every generator, reruns, graph replay; -x, 60 s per test)
# while 6 processes compile each path's kernels once per k (`_warm_tasks`; Triton's disk cache), then `sweep_decode`:
# `base` against the variants at R=8/16/24/32/64/128 x k 2048/512 random (R=1 `base` alone) and relu_sum R=32/128
# k=2048, every cell checked bitwise first; table last.
# Cap 110 s (tests 50 s, sweep the rest). Run from the repo root: bash scripts/rounds/topk-next.sh   (writes under $OUT)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/topk-next}"; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1 GPU_TEST_TIMEOUT=60
t0=$(date +%s)
warm_pids=()
for share in 0 1 2 3 4 5; do
  timeout 50 python3 -m dsa_indexer.bench.suite_topk sweep_decode --warm="$share/6" > "$OUT/warm$share.log" 2>&1 &
  warm_pids+=($!)
done
timeout 50 scripts/gpu-check tests/ops/test_topk_kernel.py -n 8 -x -k "gpu and many_rows" \
  > "$OUT/gpu-check.console" 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/gpu-check.log" 2>/dev/null)"
grep -E "^(FAILED|ERROR)" "$OUT/gpu-check.log" 2>/dev/null | head -5
for pid in "${warm_pids[@]}"; do wait "$pid"; done
echo "warm done $(( $(date +%s) - t0 )) s: $(grep -l -i -E "error|Traceback" "$OUT"/warm*.log 2>/dev/null | tr '\n' ' ')"
left=$(( 106 - ($(date +%s) - t0) )); (( left < 10 )) && left=10
timeout "$left" python3 -m dsa_indexer.bench.suite_topk sweep_decode "$OUT/topk-next_sweep.json" > "$OUT/sweep.log" 2>&1
echo "sweep rc=$? $(( $(date +%s) - t0 )) s"
grep -E "FAILED|NOT EXACT|regs=" "$OUT/sweep.log" | sort | uniq -c | head -30
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
