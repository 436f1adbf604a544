#!/usr/bin/env bash
# Session 12 round A: GPU tests of the new overlap variants and the one-wave TMA case, then the FP8 draft-row
# configs with and without the row overlap (rotating), then the MXFP4 draft-row sweep.
set -uo pipefail
V="auto wave3-early wave3-early-overlap cta3 cta3-overlap persist2-coarse-early persist2-coarse-early-overlap auto-again"
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/ops/test_logits_gluon.py -k "overlap or tma_pages_give" 2>&1 | tail -5
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/ops/test_logits_gluon_mxfp4.py -k "sweep" 2>&1 | tail -3
# compile in parallel first (Triton cache), then time
for s in 32,32,2 1,128,2 32,128,2 128,32,2 128,128,2; do
  python3 scripts/gluon_decode_diag.py --part configs --warm --shape $s --variants $V > /dev/null 2>&1 &
done; wait
python3 scripts/gluon_decode_diag.py --part configs --flush rotating --large --next-n 2 --variants $V > $OUT/diag.log 2>&1
python3 scripts/gluon_decode_diag.py --table 2>&1 | tail -45
python3 -m dsa_indexer.bench.suite_logits sweep $OUT --fmt mxfp4 --variants gluon,gluon-overlap 2>&1 | tail -12
