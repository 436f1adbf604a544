"""Small cases of every kernel, for ``compute-sanitizer`` (run by ``scripts/gpu-sanitize``).

The CUDA demo with both presets (Q RoPE + quantisation, K insert and gather, prefill and paged decode
logits in FP8 and MXFP4, whole-row top-k), again with the decode logits forced onto the Gluon kernels on
Hopper, then the wide-row top-k paths (few rows: split; some: gather pieces; many: row programs), with
positions and with slots. Exits non-zero if a result differs from the
reference; the sanitizer reports bad accesses. Arguments pick parts (``demo``, ``gluon``, ``topk``;
default: all), so that a time-capped run can be split.
"""

from __future__ import annotations

import os
import sys

import torch

import dsa_indexer as dsa
from dsa_indexer.cli import main
from dsa_indexer.ops.logits import DECODE_KERNEL_ENV


def wide_topk_cases() -> bool:
    gen = torch.Generator().manual_seed(0)
    width, k, next_n, block = 20000, 64, 2, 64
    ok = True
    for requests in (1, 6, 40):
        logits = torch.randn(requests * next_n, width, generator=gen).cuda()
        seq_lens = torch.randint(width // 2, width + 1, (requests,), generator=gen).to(torch.int32).cuda()
        table = torch.randperm(requests * (width // block + 1), generator=gen).view(requests, -1).int().cuda()
        ok &= torch.equal(dsa.topk_decode(logits, seq_lens, next_n, k),
                          dsa.topk_decode(logits, seq_lens, next_n, k, backend="reference"))
        ok &= torch.equal(dsa.topk_decode_slots(logits, seq_lens, next_n, k, table, block),
                          dsa.topk_decode_slots(logits, seq_lens, next_n, k, table, block, backend="reference"))
    return ok


PARTS = ("demo", "gluon", "topk")

if __name__ == "__main__":
    parts = sys.argv[1:] or list(PARTS)
    if unknown := set(parts) - set(PARTS):
        sys.exit(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    demo = ["demo", "--device", "cuda", "--requests", "2", "--prompt-len", "384", "--decode-steps", "2", "--topk", "32"]
    codes = []
    if "demo" in parts:
        codes += [main(demo + ["--config", config]) for config in ("v32", "v41")]
    if "gluon" in parts and torch.cuda.get_device_capability()[0] == 9:
        os.environ[DECODE_KERNEL_ENV] = "gluon"
        codes += [main(demo + ["--config", config]) for config in ("v32", "v41")]
        del os.environ[DECODE_KERNEL_ENV]
    torch.cuda.synchronize()
    topk_ok = wide_topk_cases() if "topk" in parts else True
    print(f"sanitize cases {parts}: demo exit codes {codes}, wide top-k equal to the reference: {topk_ok}")
    sys.exit(0 if not any(codes) and topk_ok else 1)
