#!/usr/bin/env bash
# Issue 4: the split select's library timeline with the search's first round stamped apart (round 13 follow-up):
# its GPU tests, then the timeline of the default at R 512 / 64.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/cand-next}"; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1 GPU_TEST_TIMEOUT=60
timeout 50 scripts/gpu-check tests/ops/test_candidates_kernel.py -n 2 -k "timeline" > "$OUT/gpu-check.console" 2>&1
echo "timeline: gpu tests rc=$?: $(tail -1 "$OUT/gpu-check.console" 2>/dev/null)"
timeout 60 python3 -m dsa_indexer.bench.suite_seq_candidates timeline --rows 512 64 > "$OUT/timeline.log" 2>&1
echo "timeline: rc=$?"
tail -n 4 "$OUT/timeline.log"
