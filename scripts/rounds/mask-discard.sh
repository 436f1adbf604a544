# Session 10 round 7: the fused mask discards its flag rows; the select's discard through the general helper.
cd "$(dirname "$0")/../.."
OUT=$OUT timeout 200 scripts/gpu-check tests/ops/test_candidates_kernel.py tests/test_graphs.py tests/test_layer.py \
  -n 14 > "$OUT/tests.log" 2>&1
tail -1 "$OUT/tests.log"
OUT=$OUT timeout 120 scripts/gpu-sanitize candidates > "$OUT/sanitize.log" 2>&1; echo "sanitize rc=$?"; tail -2 "$OUT/sanitize.log"
python3 -m dsa_indexer.bench.suite_seq_candidates sweep "$OUT" --quick --rows 512 2048 --no-slots \
  --select-variants default > "$OUT/sweep.log" 2>&1
grep -E "^(select|mask)" "$OUT/sweep.log" | grep -v "^select/" | tail -12
timeout 150 scripts/gpu-bench seq_candidates > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
cp benchmarks/results/seq_candidates.md benchmarks/results/seq_candidates.json "$OUT/"
grep -E "select_candidate_blocks|apply_candidate_mask" benchmarks/results/seq_candidates.md | cut -c1-140
