#!/usr/bin/env bash
# Session 12 round B: what saturates in the FP8 Gluon decode at next_n 2 against next_n 1 (same one-wave config),
# ncu (clean L2 between kernels, kernel only): sections, then pipe utilisation and shared-memory bank metrics.
set -uo pipefail
cat > $OUT/probe.py <<'PY'
import sys, torch
from dsa_indexer.bench.suite_logits import _decode_pool, _decode_inputs
from dsa_indexer.ops.logits.gluon_decode import paged_mqa_logits_gluon, GLUON_SWEEP_CONFIGS
batch, length, next_n, name = int(sys.argv[1]), int(sys.argv[2]) * 1024, int(sys.argv[3]), sys.argv[4]
cache = _decode_pool("fp8", batch * length // 64 + 64)
args = _decode_inputs(cache, batch, length, next_n, torch.Generator().manual_seed(1))[2]
out = torch.empty(batch * next_n, length, device="cuda")
for _ in range(3):
    paged_mqa_logits_gluon(*args, True, out, config=GLUON_SWEEP_CONFIGS[name])
torch.cuda.synchronize()
PY
ncu --query-metrics 2>/dev/null | grep -i -E "gmma|pipe_tensor|data_bank|shared" | head -40 > $OUT/metric_names.txt
cases="32,128,2,wave3-early 32,128,1,wave3-early 32,128,1,persist4-one-row 32,32,2,wave3-early"
for c in $cases; do
  IFS=, read B L N V <<< "$c"
  tag="B${B}_L${L}K_n${N}_${V}"
  ncu --clock-control none -k regex:paged_mqa_logits_ws -s 2 -c 1 \
    --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section Occupancy \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    python3 $OUT/probe.py $B $L $N $V > $OUT/sec_$tag.txt 2>&1
  ncu --clock-control none -k regex:paged_mqa_logits_ws -s 2 -c 1 \
    --metrics "regex:sm__pipe_.*cycles_active.avg.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_.*sum$,regex:l1tex__data_bank_(reads|writes).avg.pct_of_peak_sustained_elapsed,regex:smsp__inst_executed.sum$,regex:l1tex__data_pipe_lsu_wavefronts_mem_shared.*sum$" \
    python3 $OUT/probe.py $B $L $N $V > $OUT/met_$tag.txt 2>&1
  echo "== $tag"; grep -E "Duration|DRAM Throughput|Issue Slots Busy|Eligible Warps|No Eligible|Achieved Occupancy|Shared Memory|pct_of_peak|Tensor" $OUT/sec_$tag.txt | head -14
  grep -E "pct|pipe_tensor|inst_executed.sum|mem_shared" $OUT/met_$tag.txt | grep -v " 0$" | awk '$NF+0 > 0.5 || /inst_executed.sum|mem_shared/' | head -30
done
cd $OUT && tar czf ncu_logs.tgz *.txt && rm -f sec_*.txt met_*.txt
