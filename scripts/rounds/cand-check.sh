# Session 10 round 2: the whole GPU suite on the new split defaults, the fused kernel's evict-first variant, the
# mutation check of the discard test, then the seq_candidates suite.
cd "$(dirname "$0")/../.."
python3 -m dsa_indexer.bench.suite_seq_candidates warm fused_evict_first > "$OUT/warm.log" 2>&1 &
OUT=$OUT timeout 330 scripts/gpu-check tests -n 14 > "$OUT/tests.log" 2>&1
tail -1 "$OUT/tests.log"
wait
python3 -m dsa_indexer.bench.suite_seq_candidates sweep "$OUT" --quick --rows 64 128 --select-only \
  --select-variants default fused_evict_first > "$OUT/sweep.log" 2>&1
tail -6 "$OUT/sweep.log"
timeout 150 python3 scripts/rounds/cand_discard_mutant.py > "$OUT/mutant.log" 2>&1; echo "mutant rc=$?"; tail -3 "$OUT/mutant.log"
timeout 150 scripts/gpu-bench seq_candidates > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
cp benchmarks/results/seq_candidates.md benchmarks/results/seq_candidates.json "$OUT/"
grep "select_candidate_blocks" benchmarks/results/seq_candidates.md | cut -c1-150
