#!/usr/bin/env bash
# Session 12 round E: MXFP4 Gluon decode with a runtime split size and the one-wave draft-row configuration:
# its GPU tests, then the MXFP4 sweep (rotating) of the draft-row configurations and the one-row default.
set -uo pipefail
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/ops/test_logits_gluon_mxfp4.py tests/ops/test_logits_gluon.py \
  -k "mxfp4 or config_by_work_size" 2>&1 | tail -3
python3 -m dsa_indexer.bench.suite_logits sweep $OUT --fmt mxfp4 --variants gluon,gluon-wave,gluon-one-row 2>&1 | tail -14
