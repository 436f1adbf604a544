"""Session 10 probe: DRAM bytes the dispatched paged decode reads at next_n 1, 2 and 4 (FP8 and MXFP4, B=32, L=32K),
against the cache bytes (one read of K per request). Run under ncu (one launch per case, profiled cold)."""
import torch
from dsa_indexer.bench.suite_logits import _decode_case, _decode_pool, PAGE
from dsa_indexer.ops import logits as logits_ops

gen = torch.Generator().manual_seed(1)
for fmt in ("fp8", "mxfp4"):
    cache = _decode_pool(fmt, 32 * 32768 // PAGE + 64)
    for next_n in (1, 2, 4):
        _, _, _, _, args = _decode_case(cache, 32, 32768, next_n, gen)
        out = torch.empty((32 * next_n, 32768), device="cuda")
        torch.cuda.synchronize()
        logits_ops.paged_mqa_logits(*args, out=out)
        torch.cuda.synchronize()
        print(fmt, next_n, "cache bytes", 32 * 32768 * (132 if fmt == "fp8" else 68), flush=True)
    del cache
    torch.cuda.empty_cache()
