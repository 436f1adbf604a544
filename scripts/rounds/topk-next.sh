#!/usr/bin/env bash
# Decode top-k, session 6 round 4 (issue 6: R=32 and R=128 at k=2048). The default now takes PDL only off the split
# path (`pdl_split=False`; the `pdl_split` variant is the committed PDL-everywhere default of rounds 2-3). Variants:
# `lookback` (`pieces_lookback=True`: the gather pieces' candidates in one buffer per row at look-back offsets, no
# mapping by the last piece) and `lookback_d3` (with it, the candidates' T search three bits a round:
# `search_digit_bits=3`; at R=1 and R=128, where no gather launch runs, the three-bit search alone).
# 103 GPU tests (-x, 40 s per test, 55 s in all): lookback and lookback_d3 on the many-rows tests (32/128 rows x 9
# generators x k 2048/512, garbage past the ends; decode graph replay at 32/64/128 rows), the timeline probe (default,
# lookback); default / pdl_split / lookback / lookback_d3 on the PDL reruns and two-call graph at 1/6/32/128 rows;
# lookback on every wide-path test; graph replay on every wide path; the search rounds (2 and 3 bits, carry 0/1/4),
# while 10 processes compile the sweep's and the timeline's kernels (Triton's disk cache). Then the phase timeline
# (`timeline_decode`: base, lookback, lookback_d3 at R=32, k=2048), then `sweep_decode` (27 timings in 10 cells: base
# against lookback and lookback_d3 at random R=32, 64 (k 2048 / 512), 8, relu_sum R=32; against pdl_split and
# lookback_d3 at R=1 (k 2048 / 512; pdl_split twice); against lookback_d3 at R=128); table last.
# Cap 110 s (tests and compiles 55 s, timeline ~12 s, sweep the rest). Run from the repo root: bash scripts/rounds/topk-next.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/topk-next}"; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1 GPU_TEST_TIMEOUT=40
t0=$(date +%s)
warm_pids=()
for share in 0 1 2 3 4 5 6; do
  timeout 55 python3 -m dsa_indexer.bench.suite_topk sweep_decode --warm="$share/7" > "$OUT/warm$share.log" 2>&1 &
  warm_pids+=($!)
done
for variant in base lookback lookback_d3; do
  timeout 55 python3 -m dsa_indexer.bench.suite_topk timeline_decode --warm --variants="$variant" --rows=32 \
    > "$OUT/warm_timeline_$variant.log" 2>&1 &
  warm_pids+=($!)
done
tests="(gpu and (many_rows or pdl or graph or lookback) and not split_many_rows and not pieces_many_rows"
tests+=" and not no_pdl and not default_many_rows and not rows_pdl) or search_rounds"
timeout 55 scripts/gpu-check tests/ops/test_topk_kernel.py -n 8 -x -k "$tests" > "$OUT/gpu-check.console" 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/gpu-check.log" 2>/dev/null)"
grep -E "^(FAILED|ERROR)" "$OUT/gpu-check.log" 2>/dev/null | head -5
for pid in "${warm_pids[@]}"; do wait "$pid"; done
echo "warm done $(( $(date +%s) - t0 )) s: $(grep -l -i -E "error|Traceback" "$OUT"/warm*.log 2>/dev/null | tr '\n' ' ')"
timeout 25 python3 -m dsa_indexer.bench.suite_topk timeline_decode --variants=base,lookback,lookback_d3 --rows=32 \
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
