# Session 10 round 1: the split select's scratch images discarded from the L2; evict-first logits loads.
cd "$(dirname "$0")/../.."
for v in default discard evict_first discard_evict_first; do
  python3 -m dsa_indexer.bench.suite_seq_candidates warm $v > "$OUT/warm_$v.log" 2>&1 &
done
OUT=$OUT timeout 200 scripts/gpu-check tests/ops/test_candidates_kernel.py -n 8 -k "discard or evict_first or split" > "$OUT/tests.log" 2>&1
tail -2 "$OUT/tests.log"
wait
python3 -m dsa_indexer.bench.suite_seq_candidates sweep "$OUT" --quick --rows 512 2048 256 --select-only \
  --select-variants default discard evict_first discard_evict_first > "$OUT/sweep.log" 2>&1
tail -14 "$OUT/sweep.log"
timeout 60 python3 scripts/rounds/cand_discard_mutant.py 2>&1 | tail -2
