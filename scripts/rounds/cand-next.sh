#!/usr/bin/env bash
# select_candidate_blocks, session 5 round (issue 4): the fused kernel's streaming steps as a loop (`fused_rolled`)
# and block ids laid out in one run per thread (`fused_thread_runs`: a cheap emit), alone, together and at steps
# of 8192; the split select (`fused_pieces`: 4 / 8 / 16 programs per row, the last to finish selects; 16 warps with
# the keys in registers, or 8 / 16 warps re-reading them in chunks of 2048 / 4096). GPU tests of the new
# configurations (-x, 40 s per test) while 15 processes compile every sweep variant (Triton's disk cache), then
# `sweep --quick --rows 512 64 --select-only`: the default against the variants, each checked bit-equal to the
# default (the default against the reference) first; table last.
# Cap 120 s (tests 60 s, sweep the rest: 15 variants x 2 shapes, ~1 s each).
# Run from the repo root: bash scripts/rounds/cand-next.sh   (writes under $OUT)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/cand-next}"; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1 GPU_TEST_TIMEOUT=40
suite=dsa_indexer.bench.suite_seq_candidates
t0=$(date +%s)
warm_pids=()
for variant in default two_launch step_8192 rolled thread_runs rolled_runs runs_8192 rolled_runs_8192 \
    split_4 split_8 split_16 split_4_chunk split_8_chunk split_16_chunk split_8_chunk_16w; do
  timeout 60 python3 -m "$suite" warm "$variant" > "$OUT/warm_$variant.log" 2>&1 &
  warm_pids+=($!)
done
selected="layout_variants or two_slots_per_lane or select_split_runs"
selected+=" or (v41_shapes_fused_select and (rolled or runs or split))"
timeout 60 scripts/gpu-check tests/ops/test_candidates_kernel.py -n 8 -x -k "$selected" > "$OUT/gpu-check.console" 2>&1
echo "cand-next: gpu tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/gpu-check.log" 2>/dev/null)"
grep -E "^(FAILED|ERROR)" "$OUT/gpu-check.log" 2>/dev/null | head -5
for pid in "${warm_pids[@]}"; do wait "$pid" || echo "cand-next: a warm process failed (pid $pid)"; done
echo "cand-next: compiled $(( $(date +%s) - t0 )) s: $(grep -l -i -E "error|Traceback" "$OUT"/warm_*.log 2>/dev/null | tr '\n' ' ')"
left=$(( 117 - ($(date +%s) - t0) )); (( left < 10 )) && left=10
timeout "$left" python3 -m "$suite" sweep "$OUT" --quick --rows 512 64 --select-only > "$OUT/sweep.log" 2>&1
echo "cand-next: sweep rc=$? $(( $(date +%s) - t0 )) s"
if [ -f "$OUT/cand_sweep.txt" ]; then cat "$OUT/cand_sweep.txt"; else grep "^{" "$OUT/sweep.log" | cut -c1-220; tail -n 5 "$OUT/sweep.log"; fi
