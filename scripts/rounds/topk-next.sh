#!/usr/bin/env bash
# Decode top-k, session 6 round 5 (issue 6: R=32 and R=128 at k=2048): top-2 group summaries. Variant `top2`
# (`group_top2=True`): the row-program paths' maxima launch also stores each group's maximum's column and its second
# key; a qualifying group whose second key does not reach the bound gives its maximum without re-reading its logits
# (gather launch at 8..64 rows, 16-warp row programs at 128). The split path (R=1) is unchanged.
# 77 GPU tests (-x, 40 s per test, 50 s in all; the top2 configs: many-rows generators at 32/128 rows, many-rows
# reruns and graph replay, PDL eager reruns and graph at 1/6/32/128 rows, every wide-path test with the forced gather
# launch and 16-warp row programs, the timeline probe) while 10 processes compile the sweep's 8 warm tasks and the
# timeline's kernels (Triton's disk cache). Then the phase timeline (`timeline_decode`: base, top2 at R=32 and 128,
# k=2048), then `sweep_decode` (24 timings in 12 cells: base against top2 at random R=32, 128, 8, 64 (k 2048 / 512),
# relu_sum and one_bin R=32/128 k=2048); table last.
# Cap 110 s (tests and compiles 50 s, timeline ~15 s, sweep the rest). Run from the repo root: bash scripts/rounds/topk-next.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/topk-next}"; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1 GPU_TEST_TIMEOUT=40
t0=$(date +%s)
warm_pids=()
for share in 0 1 2 3 4 5 6 7; do
  timeout 50 python3 -m dsa_indexer.bench.suite_topk sweep_decode --warm="$share/8" > "$OUT/warm$share.log" 2>&1 &
  warm_pids+=($!)
done
for variant in base top2; do
  timeout 50 python3 -m dsa_indexer.bench.suite_topk timeline_decode --warm --variants="$variant" --rows=32,128 \
    > "$OUT/warm_timeline_$variant.log" 2>&1 &
  warm_pids+=($!)
done
timeout 50 scripts/gpu-check tests/ops/test_topk_kernel.py -n 8 -x -k "gpu and top2" > "$OUT/gpu-check.console" 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/gpu-check.log" 2>/dev/null)"
grep -E "^(FAILED|ERROR)" "$OUT/gpu-check.log" 2>/dev/null | head -5
for pid in "${warm_pids[@]}"; do wait "$pid"; done
echo "warm done $(( $(date +%s) - t0 )) s: $(grep -l -i -E "error|Traceback" "$OUT"/warm*.log 2>/dev/null | tr '\n' ' ')"
timeout 20 python3 -m dsa_indexer.bench.suite_topk timeline_decode --variants=base,top2 --rows=32,128 \
  > "$OUT/timeline.log" 2>&1
echo "timeline rc=$? $(( $(date +%s) - t0 )) s"
left=$(( 107 - ($(date +%s) - t0) )); (( left < 10 )) && left=10
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
