#!/usr/bin/env bash
# Decode top-k, session 6 round 2 (issue 6: R=32 and R=128 at k=2048). Variants of the default (`_decode_sweep_plan`):
# `pdl` (programmatic dependent launch of every kernel), `row16` (16-warp row programs before the gather launch),
# `pieces_r80` (gather launch under 80 registers: 3 programs per SM), `max4k` / `max8k_w16` (maxima launches of
# 4096-column 8-warp / 8192-column 16-warp programs), `combo` (pdl + row16 + pieces_r80). GPU tests of every variant
# (whole rows with PDL; PDL at 1/6/32/128 rows: 20 eager reruns and a two-call graph; many_rows: 32/128 rows of
# 131072, every generator, garbage past the ends; graph replay at 32..128 decode rows; -x, 60 s per test) while 8
# processes compile the sweep's kernels (`_warm_tasks`; Triton's disk cache), then
# `sweep_decode`: `base` against the variants that change each cell's path at random R=32/128/1/64/8 x k 2048/512
# and relu_sum R=32/128 k=2048, every cell checked bitwise first; table last.
# Cap 120 s (tests and compiles 62 s, sweep the rest). Run from the repo root: bash scripts/rounds/topk-next.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/topk-next}"; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1 GPU_TEST_TIMEOUT=60
t0=$(date +%s)
warm_pids=()
for share in 0 1 2 3 4 5 6 7; do
  timeout 62 python3 -m dsa_indexer.bench.suite_topk sweep_decode --warm="$share/8" > "$OUT/warm$share.log" 2>&1 &
  warm_pids+=($!)
done
timeout 62 scripts/gpu-check tests/ops/test_topk_kernel.py -n 8 -x \
  -k "gpu and (many_rows or pdl) and not split_many_rows and not pieces_many_rows" > "$OUT/gpu-check.console" 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/gpu-check.log" 2>/dev/null)"
grep -E "^(FAILED|ERROR)" "$OUT/gpu-check.log" 2>/dev/null | head -5
for pid in "${warm_pids[@]}"; do wait "$pid"; done
echo "warm done $(( $(date +%s) - t0 )) s: $(grep -l -i -E "error|Traceback" "$OUT"/warm*.log 2>/dev/null | tr '\n' ' ')"
left=$(( 116 - ($(date +%s) - t0) )); (( left < 10 )) && left=10
timeout "$left" python3 -m dsa_indexer.bench.suite_topk sweep_decode "$OUT/topk-next_sweep.json" > "$OUT/sweep.log" 2>&1
echo "sweep rc=$? $(( $(date +%s) - t0 )) s"
grep -E "FAILED|NOT EXACT|regs=" "$OUT/sweep.log" | sort | uniq -c | head -40
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
