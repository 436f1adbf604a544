#!/usr/bin/env bash
# Logits decode (Gluon FP8), the next round (issue 5; NOTES_logits.md "Next round candidate: per-thread stage
# release"): the three FP8 defaults against the same schedules with each consumer thread releasing a ring stage
# itself (GLUON_SWEEP_CONFIGS `cta3-release`, `persist2-coarse-early-release`, `persist4-one-row-release`, config
# field 11: no warpgroup bar.sync before the release), each timed at the row count it is built for and
# bit-checked against auto. Cap 110 s:
#   1. GPU tests of the release variants (-k release, -x: TMA on aligned caches and cp.async on padded ones, n = 1
#      and 2, persistent and not, a 2-stage persistent ring), while ~10 processes compile every kernel the sweep
#      times (one per variant and shape: Triton's disk cache);                                      <= 58 s
#   2. `scripts/gluon_decode_diag.py --part configs --large` over auto, the three release configs, auto-again:
#      the suite's shapes (H=64, D=128, 64-token pages permuted over one 16M-key pool, 256 MB memset before
#      each of 30 CUDA-graph replays); compact table printed;                                       ~25 s
#   3. with the time left, Nsight Compute stall counters (--clock-control none) of FP8 cta3 and cta3-release at
#      B=32 L=128K n=2 ($OUT/ncu.csv, summary lines); table again.
# Run from the repo root: bash scripts/rounds/logits-next.sh   (writes under $OUT)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/logits-next}"; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1 GPU_TEST_TIMEOUT=50
diag=scripts/gluon_decode_diag.py
variants=(auto cta3-release persist2-coarse-early-release persist4-one-row-release)
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }

# 1. Compile (one process per variant and shape, 10 at a time) beside the tests.
jobs_file="$OUT/warm_jobs.txt"; : > "$jobs_file"
for shape in 32,128,2 128,32,2 128,128,2 1,128,2 32,32,2 32,32,1 1,128,1 32,128,1 128,32,1; do
  for variant in "${variants[@]}"; do
    next_n=${shape##*,}
    case "$variant" in
      persist4-one-row-release) [[ $next_n == 1 ]] || continue ;;
      *-release) [[ $next_n != 1 ]] || continue ;;
    esac
    echo "$variant $shape" >> "$jobs_file"
  done
done
( timeout 58 xargs -P 10 -L 1 bash -c 'python3 '"$diag"' --part configs --large --warm --variants "$0" --shape "$1" \
    > "$OUT/warm_${0}_${1//,/_}.log" 2>&1' < "$jobs_file" ) &
warm_pid=$!
timeout 58 scripts/gpu-check tests/ops/test_logits_gluon.py -n 6 -x -k "release" > "$OUT/gpu-check.console" 2>&1
echo "logits-next: gpu tests rc=$? $(elapsed) s: $(tail -1 "$OUT/gpu-check.log" 2>/dev/null)"
grep -E "^(FAILED|ERROR)" "$OUT/gpu-check.log" 2>/dev/null | head -5
wait "$warm_pid" || echo "logits-next: compile step rc=$? (timeout: the sweep compiles the rest)"
echo "logits-next: compiled $(elapsed) s, $(wc -l < "$jobs_file") jobs; errors in: $(grep -l -E "Error|Traceback" "$OUT"/warm_*.log 2>/dev/null | xargs -r -n1 basename | tr '\n' ' ')"

# 2. The sweep.
left=$(( 104 - $(elapsed) )); (( left < 15 )) && left=15
timeout "$left" python3 "$diag" --part configs --large --variants "${variants[@]}" auto-again > "$OUT/sweep.log" 2>&1
echo "logits-next: sweep rc=$? $(elapsed) s"
grep -E "Error|error" "$OUT/sweep.log" | head -3
python3 "$diag" --table > "$OUT/table_full.txt" 2>&1
cat > "$OUT/table.py" <<'PY'
"""Compact table of $OUT/diag_configs.jsonl: one line per shape, µs (% of byte floor), * = bits differ from auto."""
import json, os
path = os.path.join(os.environ["OUT"], "diag_configs.jsonl")
rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
names = list(dict.fromkeys(r["variant"] for r in rows))
print("| B L n | " + " | ".join(names) + " |")
for shape in dict.fromkeys((r["B"], r["L"], r["next_n"]) for r in rows):
    cells = {r["variant"]: f"{r['us']:.2f} ({r['pct_of_floor']:.1f})" + ("" if r["same_bits"] in (True, None) else " *")
             for r in rows if (r["B"], r["L"], r["next_n"]) == shape}
    print(f"| {shape[0]} {shape[1] // 1024}K {shape[2]} | " + " | ".join(cells.get(n, "-") for n in names) + " |")
PY
python3 "$OUT/table.py" | tee "$OUT/table.txt"

# 3. Stall counters with the time left.
ncu_bin=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
left=$(( 106 - $(elapsed) ))
if [[ -n "$ncu_bin" ]] && (( left >= 12 )); then
  cat > "$OUT/ncu_case.py" <<'PY'
"""One launch each, B=32 L=128K next_n = 2: FP8 cta3 and cta3-release."""
import torch
from dsa_indexer.bench.suite_logits import _decode_case, _decode_pool
from dsa_indexer.ops.logits.gluon_decode import GLUON_SWEEP_CONFIGS, paged_mqa_logits_gluon

K = 1024
gen = torch.Generator().manual_seed(5)
cache = _decode_pool("fp8", 32 * 128 * K // 64 + 64)
args = _decode_case(cache, 32, 128 * K, 2, gen)[4]
out = torch.empty((32 * 2, 128 * K), device="cuda")
for name in ("cta3", "cta3-release"):
    paged_mqa_logits_gluon(*args, True, out, config=GLUON_SWEEP_CONFIGS[name])
torch.cuda.synchronize()
PY
  metrics="gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum"
  metrics+=",sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed"
  metrics+=",smsp__average_warp_latency_per_inst_issued.ratio"
  metrics+=",regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
  timeout "$left" "$ncu_bin" --clock-control none -k regex:ws_kernel -c 2 --metrics "$metrics" --csv --page raw \
    python3 "$OUT/ncu_case.py" > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
  echo "logits-next: ncu rc=$? $(elapsed) s"
  python3 - "$OUT/ncu.csv" <<'PY'
import csv, sys
lines = [line for line in open(sys.argv[1]) if line.startswith('"')]
rows = list(csv.reader(lines))
if len(rows) < 3:
    sys.exit("ncu: no rows")
header, data = rows[0], rows[2:]
names = ["cta3 n2", "cta3-release n2"]
def value(row, name):
    return row[header.index(name)] if name in header else "?"
for label, row in zip(names, data):
    stalls = sorted(((float(value(row, h).replace(",", "") or 0), h) for h in header
                     if h.startswith("smsp__average_warps_issue_stalled_")), reverse=True)[:5]
    top = " ".join(f"{h.split('stalled_')[1].split('_per_issue')[0]}={v:.2f}" for v, h in stalls)
    print(f"ncu {label}: {value(row, 'gpu__time_duration.sum')} ns, issue {value(row, 'smsp__issue_active.avg.pct_of_peak_sustained_active')}%,"
          f" inst {value(row, 'smsp__inst_executed.sum')}, warps {value(row, 'sm__warps_active.avg.pct_of_peak_sustained_active')}%,"
          f" dram {value(row, 'dram__throughput.avg.pct_of_peak_sustained_elapsed')}%,"
          f" cyc/inst {value(row, 'smsp__average_warp_latency_per_inst_issued.ratio')}; stalls/issue: {top}")
PY
else
  echo "logits-next: ncu skipped (binary '${ncu_bin}', ${left} s left)"
fi
echo "logits-next: done $(elapsed) s"
cat "$OUT/table.txt"
