# Session 10 round 4: the select variants against the new defaults (discard + evict-first) at R 512 / 2048 / 256.
cd "$(dirname "$0")/../.."
V="default other_path split_8 no_moments sample_1024 no_discard no_evict_first"
for v in $V; do python3 -m dsa_indexer.bench.suite_seq_candidates warm $v > "$OUT/warm_$v.log" 2>&1 & done
wait
python3 -m dsa_indexer.bench.suite_seq_candidates sweep "$OUT" --quick --rows 512 2048 256 --select-only \
  --select-variants $V > "$OUT/sweep.log" 2>&1
tail -23 "$OUT/sweep.log"
