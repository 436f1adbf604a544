#!/usr/bin/env bash
# Session 12 round C: FP8 draft rows with the weights in shared memory (four programs a SM at cap 64): GPU tests
# of the new configurations, then the draft-row shapes under rotating buffers.
set -uo pipefail
V="auto wave3-early wave3-early-smemw wave4-early-smemw cta3 cta4-smemw auto-again"
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/ops/test_logits_gluon.py -k "smemw" 2>&1 | tail -3
for s in 32,32,2 1,128,2 32,128,2 128,32,2 128,128,2; do
  python3 scripts/gluon_decode_diag.py --part configs --warm --shape $s --variants $V > /dev/null 2>&1 &
done; wait
python3 scripts/gluon_decode_diag.py --part configs --flush rotating --large --next-n 2 --variants $V > $OUT/diag.log 2>&1
python3 scripts/gluon_decode_diag.py --table 2>&1 | tail -40
