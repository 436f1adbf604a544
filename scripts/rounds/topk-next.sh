#!/usr/bin/env bash
# Decode top-k, session 5 round 2 (issue 6): carry-chain counts in the decode searches (`carry_search`), lean
# candidate searches from known brackets (`lean_search`), the split path without its lower-bound launch
# (`split_chunk_bound`) and/or its emit launch (`split_ordered_candidates`), 8-warp split programs, the gather launch
# capped at 128 registers (`pieces_max_registers`).
# GPU tests of the new configs (-x, 60 s per test) while 6 processes compile every sweep variant at each swept row
# count (Triton's disk cache), then `sweep_decode`: the default (`base`) against the variants at R=1/32/64/128 x
# k 2048/512 random, relu_sum and one_bin R=1 and relu_sum R=32/128 at k=2048, every cell checked bitwise first;
# table last.
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
timeout 50 scripts/gpu-check tests/ops/test_topk_kernel.py -n 8 -x \
  -k "(gpu and ((long_rows and 131072 and (-split_chunk_ordered_carry_lean] or -split_w8_chunk_ordered_carry_lean] or -split_chunk_carry_lean] or -pieces_w8_carry_lean] or -pieces_w8_carry_lean_r128] or -stream_carry_lean])) or ((carry or lean or chunk or split_w8 or r128 or ordered) and (reruns or graph_replay)) or (decode_slots and ordered) or (widths_around and (-split_chunk_ordered_carry_lean] or -pieces_w8_carry_lean_r128])))) or search_rounds" \
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
