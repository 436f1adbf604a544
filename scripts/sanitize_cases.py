"""Small cases of every kernel, for ``compute-sanitizer`` (run by ``scripts/gpu-sanitize``).

The CUDA demo with both presets (Q RoPE + quantisation, K insert and gather, prefill and paged decode logits
in FP8 and MXFP4, whole-row top-k), the Gluon decode kernels on Hopper (each default configuration, called
directly: the demo's shapes take the Triton kernel), then the wide-row top-k paths (few rows: split; some:
gather pieces; many: row programs), with positions and with slots, then the rows of a causal prompt (whole-row
programs, carry-chain counts on the widest tiles), then the V4.1 candidate blocks on both select kernels (one
program per row; split streaming with the last program selecting) and the mask, then calls with value checks
off on wild metadata (page ids 10**6, -5, 2**31 - 1, lengths past the width and the table, slots past the cache):
insert, gather, paged decode logits (Triton, and each Gluon kernel with TMA and with cp.async copies on Hopper),
slots and candidate blocks; then the DCP kernels (key packs, keyed select, block scores) with the world simulated
on one GPU. Exits non-zero if a result differs from the reference; the sanitizer reports bad accesses. Arguments
pick parts (``demo``, ``gluon``, ``topk``, ``candidates``, ``unchecked``, ``dcp``; default: all), so that a
time-capped run can be split.
"""

from __future__ import annotations

import os
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
    from dsa_indexer.ops.candidates.triton import (
        MaskConfig,
        SelectConfig,
        apply_candidate_mask_triton,
        select_candidate_blocks_triton,
    )

    gen = torch.Generator().manual_seed(2)
    rows, width, num_blocks_k, block_size = 6, 20000, 300, 8
    logits = torch.randn(rows, width, generator=gen).cuda()
    starts = torch.randint(0, 3000, (rows,), generator=gen).to(torch.int32).cuda()
    ends = (starts + torch.randint(0, width - 3000, (rows,), generator=gen).to(torch.int32).cuda()).clamp(max=width)
    expected = dsa.select_candidate_blocks(logits, starts, ends, num_blocks_k, block_size, backend="reference")
    configs = (SelectConfig(split_pieces=0), SelectConfig(split_pieces=8, split_min_rows=0), SelectConfig())
    ok = all(torch.equal(select_candidate_blocks_triton(logits, starts, ends, num_blocks_k, block_size, 1,
                                                        config=config), expected) for config in configs)
    masked, fused, masked_reference = logits.clone(), logits.clone(), logits.clone()
    dsa.apply_candidate_mask(masked, starts, ends, expected, block_size)
    apply_candidate_mask_triton(fused, starts, ends, expected, block_size, 1, config=MaskConfig(fused_flags_min_rows=0))
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


def _unchecked_decode_ok(fmt: str, gen: torch.Generator) -> bool:
    """Paged decode logits on wild pages and lengths: the Triton kernel and (Hopper) each Gluon kernel, TMA page
    copies and cp.async copies, against the reference on the same call (unreadable pages read as zeros)."""
    from dsa_indexer.bench.suite_logits import REFERENCE_BOUND
    from dsa_indexer.ops.logits import gluon_decode, gluon_decode_mxfp4, reference
    from dsa_indexer.ops.logits.triton import paged_mqa_logits_triton
    from dsa_indexer.testing import calc_diff

    cache = dsa.IndexerKCache(16, block_size=64, fmt=fmt, device="cuda")
    cache.insert(torch.randn(cache.num_slots, 128, generator=gen).cuda(), torch.arange(cache.num_slots).cuda())
    heads, next_n = 64, 2
    if fmt == "fp8":
        q = torch.randn(2, next_n, heads, 128, generator=gen).to(torch.float8_e4m3fn).cuda()
        q_scale = None
    else:
        q = torch.randint(0, 256, (2, next_n, heads, 64), generator=gen, dtype=torch.uint8).cuda()
        q_scale = torch.randint(120, 130, (2, next_n, heads, 4), generator=gen, dtype=torch.uint8).cuda()
    weights = torch.randn(2 * next_n, heads, generator=gen).cuda()
    table = torch.tensor([[3, 10**6, 7, 2**31 - 1, 0, -1, 9, 11], [-5, 2, 4, 6, 8, 10, 12, 14]],
                         dtype=torch.int32).cuda()
    lens = torch.tensor([[700, 10**7], [640, 100]], dtype=torch.int32).cuda()
    args = (q, q_scale, cache, weights, lens, table, 900)
    expected = reference.paged_mqa_logits(*args, True, torch.empty((2 * next_n, 900), device="cuda"))
    valid = expected != float("-inf")
    outputs = [paged_mqa_logits_triton(*args, True, torch.full_like(expected, 7.0))]
    if torch.cuda.get_device_capability()[0] == 9:
        from dsa_indexer.ops.common.gluon import cp_async_fallback

        gluon, config = ((gluon_decode.paged_mqa_logits_gluon, gluon_decode.GLUON_DECODE_CONFIG) if fmt == "fp8"
                         else (gluon_decode_mxfp4.paged_mqa_logits_gluon_mxfp4,
                               gluon_decode_mxfp4.GLUON_MXFP4_DECODE_CONFIG))
        configs = (config, cp_async_fallback(config))
        outputs += [gluon(*args, True, torch.full_like(expected, 7.0), config=config) for config in configs]
    return all(calc_diff(out[valid], expected[valid]) < REFERENCE_BOUND
               and bool((out[~valid] == float("-inf")).all()) for out in outputs)


def unchecked_cases() -> bool:
    """Value checks off (``DSA_INDEXER_SKIP_VALUE_CHECKS=1``) on wild metadata: every kernel stays inside its
    buffers (the sanitizer's part) and gives the reference's documented result."""
    gen = torch.Generator().manual_seed(4)
    previous = os.environ.get("DSA_INDEXER_SKIP_VALUE_CHECKS")
    os.environ["DSA_INDEXER_SKIP_VALUE_CHECKS"] = "1"
    try:
        ok = True
        for fmt in ("fp8", "mxfp4"):
            caches = [dsa.IndexerKCache(8, block_size=64, fmt=fmt, device="cuda") for _ in range(2)]
            keys = torch.randn(6, 128, generator=gen).cuda()
            slots = torch.tensor([5, 8 * 64, 10**9, -3, 2**31, 100]).cuda()
            for cache, backend in zip(caches, ("triton", "reference")):
                cache.insert(keys, slots, backend=backend)
            ok &= torch.equal(caches[0].buffer, caches[1].buffer)
            table = torch.tensor([[3, 10**6], [-5, 2**31 - 1]], dtype=torch.int32).cuda()
            cu = torch.tensor([0, 100, 250], dtype=torch.int32).cuda()
            gathered = [caches[0].gather(table, cu, num_tokens=200, backend=backend) for backend in ("triton", "reference")]
            ok &= all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*gathered))
            ok &= _unchecked_decode_ok(fmt, gen)
        logits = torch.randn(8, 20000, generator=gen).cuda()
        seq_lens = torch.tensor([20000, 10**7, 5000, 300], dtype=torch.int32).cuda()
        table = torch.randperm(4 * 160, generator=gen).view(4, 160).int().cuda()  # 10240 of the 20000 positions
        table[:, ::7] = -1
        table[1, 3] = 2**30
        ok &= torch.equal(dsa.topk_decode_slots(logits, seq_lens, 2, 2048, table, 64),
                          dsa.topk_decode_slots(logits, seq_lens, 2, 2048, table, 64, backend="reference"))
        indices = torch.randint(-1, 20000, (8, 2048), generator=gen, dtype=torch.int32).cuda()
        rows = torch.tensor([0, 1, 2, 3, 9, -4, 0, 1], dtype=torch.int32).cuda()
        ok &= torch.equal(dsa.indices_to_slots(indices, table, 64, rows),
                          dsa.indices_to_slots(indices, table, 64, rows, backend="reference"))
        starts = torch.tensor([-5, 300, 25000, 0, 7, 0, 0, 1], dtype=torch.int32).cuda()
        ends = torch.tensor([10**6, 2**31 - 1, 30000, 19999, 20001, 0, 100, 5], dtype=torch.int32).cuda()
        clamped_starts = starts.clamp(0, 20000)
        clamped_ends = torch.maximum(ends, clamped_starts).clamp(max=20000)
        expected = dsa.select_candidate_blocks(logits, clamped_starts, clamped_ends, 300, 8, backend="reference")
        ok &= torch.equal(dsa.select_candidate_blocks(logits, starts, ends, 300, 8), expected)
        masked, masked_reference = logits.clone(), logits.clone()
        dsa.apply_candidate_mask(masked, starts, ends, expected, 8)
        dsa.apply_candidate_mask(masked_reference, clamped_starts, clamped_ends, expected, 8, backend="reference")
        ok &= torch.equal(masked.view(torch.int32), masked_reference.view(torch.int32))
        torch.cuda.synchronize()
        return ok
    finally:
        if previous is None:
            del os.environ["DSA_INDEXER_SKIP_VALUE_CHECKS"]
        else:
            os.environ["DSA_INDEXER_SKIP_VALUE_CHECKS"] = previous


def dcp_cases() -> bool:
    """The DCP kernels against their references: the key pack (with row starts), the scored pack (strided
    scores), the keyed select of 3 simulated ranks' packs, and the block scores with the newest block pinned."""
    from dsa_indexer.ops.dcp import dcp_block_scores, pack_candidate_keys, pack_scored_keys, select_global_topk_keys

    world, rows, width, k = 3, 6, 300, 40
    ok = True
    packs = {}
    for backend in ("reference", "triton"):
        device = "cuda" if backend == "triton" else "cpu"
        logits = torch.randn(world, rows, width, generator=torch.Generator().manual_seed(6)).to(device)
        local = torch.arange(k, dtype=torch.int32).repeat(world, rows, 1).to(device)
        local[:, ::2, -3:] = -1
        starts = torch.tensor([0, 3, 7, 0, 250, 1], dtype=torch.int32, device=device)
        keys = torch.stack([pack_candidate_keys(logits[r], local[r], r, world, 1, starts, backend=backend)
                            for r in range(world)])
        scored = pack_scored_keys(logits[0, :, : 2 * k : 2], local[0], 1, world, 2, backend=backend)
        picks = select_global_topk_keys(keys, k, backend=backend)
        ends = torch.tensor([300, 120, 0, 299, 5, 64], dtype=torch.int32, device=device)
        blocks = dcp_block_scores(logits[0], None, ends, 4, 80, 1, ends * world, 4 * world,
                                  out=torch.empty(rows, 80, device=device), backend=backend)
        packs[backend] = [t.cpu() for t in (keys, scored, picks, blocks)]
    for want, got in zip(packs["reference"], packs["triton"]):
        ok &= torch.equal(want, got)
    return ok


PARTS = ("demo", "gluon", "topk", "candidates", "unchecked", "dcp")

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
    unchecked_ok = unchecked_cases() if "unchecked" in parts else True
    dcp_ok = dcp_cases() if "dcp" in parts else True
    print(f"sanitize cases {parts}: demo exit codes {codes}, Gluon decode within the tier: {gluon_ok}, "
          f"top-k equal to the reference: {topk_ok}, candidate blocks equal to the reference: {candidates_ok}, "
          f"unchecked wild metadata as documented: {unchecked_ok}, DCP kernels equal to the reference: {dcp_ok}")
    sys.exit(0 if not any(codes) and gluon_ok and topk_ok and candidates_ok and unchecked_ok and dcp_ok else 1)
