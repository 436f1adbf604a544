#!/usr/bin/env bash
# Session 12 round D: where the FP8 one-wave decode's warps wait at next_n 2 (B=32, L=32K; and next_n 1 beside it):
# ncu source-level stall samples per line, and the kernel-wide stall reasons.
set -uo pipefail
cp scripts/rounds/s12_probe.py $OUT/probe.py
for N in 2 1; do
  ncu --clock-control none --import-source yes --section SourceCounters --section WarpStateStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio" \
    -k regex:paged_mqa_logits_ws -s 2 -c 1 -o $OUT/prof$N python3 $OUT/probe.py 32 32 $N wave3-early > $OUT/ncu$N.log 2>&1
  ncu -i $OUT/prof$N.ncu-rep --page source --csv --print-source cuda,sass > $OUT/prof$N.csv 2>/dev/null
  ncu -i $OUT/prof$N.ncu-rep --page details --print-metric-name name 2>/dev/null | grep -E "issue_stalled" | sort -k3 -g -r | awk '$NF+0 > 0.05' | head -16 > $OUT/stalls$N.txt
  echo "== next_n $N: kernel-wide stall reasons (warps per issue)"; cat $OUT/stalls$N.txt | awk '{print $1, $NF}'
  echo "== next_n $N: per line"; python3 scripts/ncu_source_lines.py $OUT/prof$N.csv 22 | cut -c1-190
done
cd $OUT && tar czf ncu_prof.tgz prof*.csv stalls*.txt ncu*.log && rm -f prof*.csv prof*.ncu-rep
