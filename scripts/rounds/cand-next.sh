#!/usr/bin/env bash
# select_candidate_blocks, session 8 round 4 (issue 4): the split / fused crossover at small row counts (round 3:
# R 32 split 31.5 µs against fused 36.9): default (fused below 256 rows) against other_path (split) at R 1 .. 96.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/cand-next}"; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1
timeout 200 python3 -m dsa_indexer.bench.suite_seq_candidates sweep "$OUT" --quick --rows 1 --select-only \
  --subset-rows 8 16 24 32 33 40 48 64 96 > "$OUT/sweep.log" 2>&1
echo "cand-next: sweep rc=$?"
if [ -f "$OUT/cand_sweep.txt" ]; then cat "$OUT/cand_sweep.txt"; else tail -n 5 "$OUT/sweep.log"; fi
