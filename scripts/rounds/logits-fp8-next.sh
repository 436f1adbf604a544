#!/usr/bin/env bash
# FP8 Gluon decode, session 5 round (issue 5: next_n = 2 to >= 80 % of the byte floor): both draft rows as ONE
# [64 keys, D] x [D, 2 x 64 heads] wgmma a tile (queries stacked on N: the key tile read from shared memory once,
# half the wgmma instructions and waits; `_consumer_stacked`, config field 10). Cap 120 s. GPU tests of the new
# configurations (-x, 45 s a test, 60 s in all) while 7 processes compile every kernel the sweep times (Triton's
# disk cache), then `scripts/gluon_decode_diag.py --part configs --large --next-n 2`: the default (auto = cta3
# from 4M keys, persist2-coarse-early below) against cta3, cta2 (the unstacked control at two programs per SM),
# cta2-stacked, cta2-stacked-s6, persist2-coarse-early(-stacked), each checked bit-equal to auto; table last.
# Run from the repo root: bash scripts/rounds/logits-fp8-next.sh   (writes under $OUT)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/logits-fp8-next}"; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1 GPU_TEST_TIMEOUT=45
diag=scripts/gluon_decode_diag.py
variants=(auto cta3 cta2 cta2-stacked cta2-stacked-s6 persist2-coarse-early persist2-coarse-early-stacked)
t0=$(date +%s)
warm_pids=()
for variant in "${variants[@]}"; do
  timeout 70 python3 "$diag" --part configs --large --next-n 2 --warm --variants "$variant" \
    > "$OUT/warm_$variant.log" 2>&1 &
  warm_pids+=($!)
done
timeout 60 scripts/gpu-check tests/ops/test_logits_gluon.py -n 8 -x -k "stacked or cta2" \
  > "$OUT/gpu-check.console" 2>&1
echo "logits-fp8-next: gpu tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/gpu-check.log" 2>/dev/null)"
grep -E "^(FAILED|ERROR)" "$OUT/gpu-check.log" 2>/dev/null | head -5
for pid in "${warm_pids[@]}"; do wait "$pid" || echo "logits-fp8-next: a warm process failed (pid $pid)"; done
echo "logits-fp8-next: compiled $(( $(date +%s) - t0 )) s: $(grep -l -i -E "error|Traceback" "$OUT"/warm_*.log 2>/dev/null | tr '\n' ' ')"
left=$(( 117 - ($(date +%s) - t0) )); (( left < 10 )) && left=10
timeout "$left" python3 "$diag" --part configs --large --next-n 2 --variants "${variants[@]}" auto-again \
  > "$OUT/sweep.log" 2>&1
echo "logits-fp8-next: sweep rc=$? $(( $(date +%s) - t0 )) s"
grep -E "Error|error" "$OUT/sweep.log" | head -5
python3 "$diag" --table | tee "$OUT/table.txt"
