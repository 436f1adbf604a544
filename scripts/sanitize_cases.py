"""Small cases of every kernel, for ``compute-sanitizer`` (run by ``scripts/gpu-sanitize``).

The CUDA demo with both presets (Q RoPE + quantisation, K insert and gather, prefill and paged decode logits
in FP8 and MXFP4, whole-row top-k), the Gluon decode kernels on Hopper (each default configuration, called
directly: the demo's shapes take the Triton kernel), then the wide-row top-k paths (few rows: split; some:
gather pieces; many: row programs), with positions and with slots, then the rows of a causal prompt (whole-row
programs, carry-chain counts on the widest tiles), then the V4.1 candidate blocks on both select kernels (one
program per row; split streaming with the last program selecting) and the mask. Exits non-zero if a result
differs from the reference; the sanitizer reports bad accesses. Arguments pick parts (``demo``, ``gluon``,
``topk``, ``candidates``; default: all), so that a time-capped run can be split.
"""

from __future__ import annotations

import sys

import torch

import dsa_indexer as dsa
from dsa_indexer.cli import main


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


def prefill_topk_case() -> bool:
    """The rows of a 6000-token causal prompt (row i has i + 1 columns), k 2048: every whole-row tile width."""
    gen = torch.Generator().manual_seed(1)
    length, k = 6000, 2048
    logits = torch.randn(length, length, generator=gen).cuda()
    ends = torch.arange(1, length + 1, dtype=torch.int32).cuda()
    return torch.equal(dsa.topk(logits, k, ends=ends), dsa.topk(logits, k, ends=ends, backend="reference"))


def candidate_cases() -> bool:
    """Candidate blocks of 8 over ragged windows of 20000-column rows, K 300: the fused select, the split select of 8
    pieces and the default (6 rows: the split select of 4 pieces); both split selects discard their rows' scratch
    images (rows of 4096 blocks: whole 128-byte lines) and load the logits evict-first; the mask by the default path
    (separate flags at 6 rows) and by the fused one (each row builds, then discards, its own flags)."""
    from dsa_indexer.ops.candidates.triton import apply_candidate_mask_triton, select_candidate_blocks_triton

    gen = torch.Generator().manual_seed(2)
    rows, width, num_blocks_k, block_size = 6, 20000, 300, 8
    logits = torch.randn(rows, width, generator=gen).cuda()
    starts = torch.randint(0, 3000, (rows,), generator=gen).to(torch.int32).cuda()
    ends = (starts + torch.randint(0, width - 3000, (rows,), generator=gen).to(torch.int32).cuda()).clamp(max=width)
    expected = dsa.select_candidate_blocks(logits, starts, ends, num_blocks_k, block_size, backend="reference")
    ok = all(torch.equal(select_candidate_blocks_triton(logits, starts, ends, num_blocks_k, block_size, 1,
                                                        fused_pieces=pieces), expected) for pieces in (0, 8, None))
    masked, fused, masked_reference = logits.clone(), logits.clone(), logits.clone()
    dsa.apply_candidate_mask(masked, starts, ends, expected, block_size)
    apply_candidate_mask_triton(fused, starts, ends, expected, block_size, 1, fused_flags=True)
    dsa.apply_candidate_mask(masked_reference, starts, ends, expected, block_size, backend="reference")
    return ok and all(torch.equal(result.view(torch.int32), masked_reference.view(torch.int32))
                      for result in (masked, fused))


def gluon_cases() -> bool:
    """The Gluon decode kernels called directly with each default configuration (FP8: the large-shape, small-shape,
    one-wave and one-row ones; MXFP4: draft rows, one wave and one row), TMA page copies, clean and not, on 3
    requests of 3008 keys in a 200-page pool: calc_diff against the reference under the kernel tier (the valid
    entries only when not clean)."""
    from dsa_indexer.bench.suite_logits import REFERENCE_BOUND, _decode_case, _decode_pool
    from dsa_indexer.ops.logits import gluon_decode, gluon_decode_mxfp4, reference
    from dsa_indexer.testing import calc_diff

    gen = torch.Generator().manual_seed(3)
    cases = [("fp8", gluon_decode.paged_mqa_logits_gluon, config, next_n)
             for config, next_n in ((gluon_decode.GLUON_DECODE_CONFIG, 2), (gluon_decode.GLUON_DECODE_CONFIG_SMALL, 2),
                                    (gluon_decode.GLUON_DECODE_CONFIG_WAVE, 2),
                                    (gluon_decode.GLUON_DECODE_CONFIG_ONE_ROW, 1))]
    cases += [("mxfp4", gluon_decode_mxfp4.paged_mqa_logits_gluon_mxfp4, config, next_n)
              for config, next_n in ((gluon_decode_mxfp4.GLUON_MXFP4_DECODE_CONFIG, 2),
                                     (gluon_decode_mxfp4.GLUON_MXFP4_DECODE_CONFIG_WAVE, 2),
                                     (gluon_decode_mxfp4.GLUON_MXFP4_DECODE_CONFIG_ONE_ROW, 1))]
    ok = True
    for fmt, decode, config, next_n in cases:
        args = _decode_case(_decode_pool(fmt, 200), 3, 3008, next_n, gen)[4]
        expected = reference.paged_mqa_logits(*args, True, torch.empty((3 * next_n, 3008), device="cuda"))
        for clean in (True, False):
            out = torch.full_like(expected, 7.0)
            decode(*args, clean, out, config=config)
            valid = expected != float("-inf")
            ok &= calc_diff(out[valid], expected[valid]) < REFERENCE_BOUND
            ok &= torch.equal(out[~valid], torch.full_like(out[~valid], float("-inf") if clean else 7.0))
    return ok


PARTS = ("demo", "gluon", "topk", "candidates")

if __name__ == "__main__":
    parts = sys.argv[1:] or list(PARTS)
    if unknown := set(parts) - set(PARTS):
        sys.exit(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    demo = ["demo", "--device", "cuda", "--requests", "2", "--prompt-len", "384", "--decode-steps", "2", "--topk", "32"]
    codes = []
    if "demo" in parts:
        codes += [main(demo + ["--config", config]) for config in ("v32", "v41")]
    gluon_ok = gluon_cases() if "gluon" in parts and torch.cuda.get_device_capability()[0] == 9 else True
    torch.cuda.synchronize()
    topk_ok = wide_topk_cases() and prefill_topk_case() if "topk" in parts else True
    candidates_ok = candidate_cases() if "candidates" in parts else True
    print(f"sanitize cases {parts}: demo exit codes {codes}, Gluon decode within the tier: {gluon_ok}, "
          f"top-k equal to the reference: {topk_ok}, candidate blocks equal to the reference: {candidates_ok}")
    sys.exit(0 if not any(codes) and gluon_ok and topk_ok and candidates_ok else 1)
