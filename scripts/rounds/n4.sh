# Session 10 round 5: DRAM bytes read by the dispatched decode at next_n 1 / 2 / 4 (is K read once per request?).
cd "$(dirname "$0")/../.."
python3 scripts/rounds/n4_traffic.py > "$OUT/warm.log" 2>&1   # compile outside the profiler
timeout 240 ncu --clock-control none -k regex:paged_mqa_logits --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
  python3 scripts/rounds/n4_traffic.py > "$OUT/ncu.log" 2>&1
echo "ncu rc=$?"
grep -E "paged_mqa_logits|dram__bytes|gpu__time|cache bytes" "$OUT/ncu.log" | sed 's/  */ /g' | cut -c1-120
