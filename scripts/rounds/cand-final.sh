# Session 10 round 3: the fused select's evict-first default checked (candidate, graph, layer and library GPU tests),
# compute-sanitizer over the candidate kernels (the discard path included), then the seq_candidates suite.
cd "$(dirname "$0")/../.."
OUT=$OUT timeout 200 scripts/gpu-check tests/ops/test_candidates_kernel.py tests/test_graphs.py tests/test_layer.py \
  tests/test_library.py -n 14 > "$OUT/tests.log" 2>&1
tail -1 "$OUT/tests.log"
OUT=$OUT timeout 200 scripts/gpu-sanitize candidates > "$OUT/sanitize.log" 2>&1; echo "sanitize rc=$?"; tail -3 "$OUT/sanitize.log"
timeout 150 scripts/gpu-bench seq_candidates > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
cp benchmarks/results/seq_candidates.md benchmarks/results/seq_candidates.json "$OUT/"
grep "select_candidate_blocks" benchmarks/results/seq_candidates.md | cut -c1-150
