#!/usr/bin/env bash
# Session 8 closing check (issues 4 and 5): the whole GPU test suite on the final candidates code (the small-row
# split default, the fused select's moments opening), then the seq_candidates suite (records in benchmarks/results).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/cand-next}"; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1
t0=$(date +%s)
timeout 330 scripts/gpu-check tests -n 14 > "$OUT/gpu-check.console" 2>&1
echo "final: gpu tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/gpu-check.console" 2>/dev/null)"
grep -E "^(FAILED|ERROR)" "$OUT/gpu-check.log" 2>/dev/null | head -10
OUT= timeout 200 scripts/gpu-bench seq_candidates > "$OUT/bench.log" 2>&1
echo "final: bench rc=$? $(( $(date +%s) - t0 )) s"
tar czf "$OUT/results.tgz" benchmarks/results/seq_candidates.* 2>/dev/null
grep -E "select_candidate|apply_candidate" benchmarks/results/seq_candidates.md | cut -c1-150
