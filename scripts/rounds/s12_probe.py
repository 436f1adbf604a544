"""One FP8 Gluon decode call of a sweep configuration, three times (ncu profiles the third): B, L in K, next_n, name."""
import sys

import torch

from dsa_indexer.bench.suite_logits import _decode_inputs, _decode_pool
from dsa_indexer.ops.logits.gluon_decode import GLUON_SWEEP_CONFIGS, paged_mqa_logits_gluon

batch, length, next_n, name = int(sys.argv[1]), int(sys.argv[2]) * 1024, int(sys.argv[3]), sys.argv[4]
cache = _decode_pool("fp8", batch * length // 64 + 64)
args = _decode_inputs(cache, batch, length, next_n, torch.Generator().manual_seed(1))[2]
out = torch.empty(batch * next_n, length, device="cuda")
for _ in range(3):
    paged_mqa_logits_gluon(*args, True, out, config=GLUON_SWEEP_CONFIGS[name])
torch.cuda.synchronize()
