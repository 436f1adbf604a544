#!/usr/bin/env bash
# select_candidate_blocks, session 5 round 2 (issue 4): the split select is the default from _SPLIT_MIN_ROWS (256)
# rows, the fused kernel below; candidates: carry-chain counts in the search (`fused_carry`, fused and split) and the
# split select's prescanned emit (`fused_piece_prescan`), with 8 and 4 pieces per row. GPU tests of the new and
# changed configurations (-x, 40 s per test) while 7 processes compile the sweep's variants (Triton's disk cache),
# then `sweep --quick --rows 512 64 --subset-rows 256 128 --select-only`: every variant at R 512 and 64, the
# crossover's variants (default, other_path, split_4, *_carry_prescan) at R 256 and 128; each variant checked
# bit-equal to the default, the default to the reference first; table last.
# Cap 100 s (tests 50 s, sweep the rest: 26 cells, ~1 s each).
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
# other_path runs the default's kernels (the path of the other row counts): compiled by `default`.
for variant in default split_4 fused_carry split_8_carry split_4_carry split_8_carry_prescan split_4_carry_prescan; do
  timeout 60 python3 -m "$suite" warm "$variant" > "$OUT/warm_$variant.log" 2>&1 &
  warm_pids+=($!)
done
selected="select_split or default_path or all_equal_unselectable_and_too_wide or aligned_starts"
selected+=" or fused_matches_reference or v41_shapes_fused_select"
timeout 50 scripts/gpu-check tests/ops/test_candidates_kernel.py -n 8 -x -k "$selected" > "$OUT/gpu-check.console" 2>&1
echo "cand-next: gpu tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/gpu-check.log" 2>/dev/null)"
grep -E "^(FAILED|ERROR)" "$OUT/gpu-check.log" 2>/dev/null | head -5
for pid in "${warm_pids[@]}"; do wait "$pid" || echo "cand-next: a warm process failed (pid $pid)"; done
echo "cand-next: compiled $(( $(date +%s) - t0 )) s: $(grep -l -i -E "error|Traceback" "$OUT"/warm_*.log 2>/dev/null | tr '\n' ' ')"
left=$(( 97 - ($(date +%s) - t0) )); (( left < 10 )) && left=10
timeout "$left" python3 -m "$suite" sweep "$OUT" --quick --rows 512 64 --subset-rows 256 128 --select-only \
  > "$OUT/sweep.log" 2>&1
echo "cand-next: sweep rc=$? $(( $(date +%s) - t0 )) s"
if [ -f "$OUT/cand_sweep.txt" ]; then cat "$OUT/cand_sweep.txt"; else grep "^{" "$OUT/sweep.log" | cut -c1-220; tail -n 5 "$OUT/sweep.log"; fi
