"""Q RoPE + quantisation and the paged K cache insert / gather: µs and GB/s against copy bandwidth.

All three ops move bytes and do little arithmetic, so the floor is the bytes they must move (inputs read
once, outputs written once) at the device-to-device copy bandwidth measured in the same run, and
``pct_of_floor`` is the share of that bandwidth reached. Each shape moves >= 256 MiB. Before timing,
each variant's Triton result is checked byte for byte against the reference on the benchmarked inputs
(a variant that fails is reported and not timed).
Every launch variant (tile size, warps) is timed; ``default`` marks the one the wrappers use. The
"torch" baseline is the PyTorch reference twin called directly (no argument checks).
"""

from __future__ import annotations

import torch

from dsa_indexer.cache import IndexerKCache
from dsa_indexer.ops.k_cache.reference import gather_k_reference, insert_k_reference
from dsa_indexer.ops.k_cache.triton import GatherConfig, InsertConfig, gather_k_triton, insert_k_triton
from dsa_indexer.ops.q_quant.reference import rope_quant_q_reference
from dsa_indexer.ops.q_quant.triton import RopeQuantConfig, rope_quant_q_triton

from . import harness

# Launch variants per format (fields of RopeQuantConfig, InsertConfig, GatherConfig); the first of each list is the
# wrapper's default (for MXFP4 the encode on bf16 pairs), then for MXFP4 the fp32 path (what fp16 / fp32 inputs
# run) and, for insert, the other launch that measured close (H200). Variants measured slower in earlier runs
# (benchmarks/devlog/quant_cache.md) are left out.
ROPE_VARIANTS = {
    "fp8": [dict(block_heads=64, num_warps=8), dict(block_heads=32, num_warps=4)],
    "mxfp4": [dict(block_heads=64, num_warps=4), dict(block_heads=64, num_warps=4, bf16x2=False)],
}
INSERT_VARIANTS = {
    "fp8": [dict(block_tokens=32, num_warps=4)],
    "mxfp4": [dict(block_tokens=32, num_warps=2), dict(block_tokens=32, num_warps=2, bf16x2=False),
              dict(block_tokens=64, num_warps=4)],
}
GATHER_VARIANTS = [dict(block_rows=64, num_warps=4)]


_SHORT_KNOBS = {"block_heads": "heads", "block_tokens": "tokens", "block_rows": "rows", "num_warps": "warps"}


def variant_label(record: dict) -> str:
    """``heads=64,warps=4,no_bf16x2`` (flags named when given: ``no_`` when turned off),
    `` *`` for the wrapper's default."""
    parts = [key if value is True else f"no_{key}" if value is False else f"{_SHORT_KNOBS.get(key, key)}={value}"
             for key, value in record["variant"].items()]
    return ",".join(parts) + (" *" if record["default"] else "")


def _bytes_equal(a, b) -> bool:
    return all((x is None and y is None) or torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


def _rows(op, shape, moved_bytes, variants, launch, reference_us, copy_tbs, matches_reference):
    """Time every variant of ``launch`` whose result passes ``matches_reference(result)``; a failing
    non-default variant is reported and left out, a failing default stops the suite."""
    floor_us = moved_bytes / (copy_tbs * 1e6)
    rows = []
    for index, knobs in enumerate(variants):
        if not matches_reference(launch(**knobs)):
            message = f"{op} {shape['fmt']} {knobs}: Triton result differs from the reference"
            if index == 0:
                raise AssertionError(message)
            print(f"MISMATCH (not timed): {message}")
            continue
        us = harness.median_us(lambda: launch(**knobs))
        rows.append(harness.record(op, shape, us, floor_us, tbs=moved_bytes / us / 1e6,
                                   baselines={"torch": reference_us}, variant=knobs, default=index == 0,
                                   moved_bytes=moved_bytes))
    return rows


def _rope_quant_q(copy_tbs) -> list[dict]:
    num_tokens, num_heads, head_dim, rope_dim = 16384, 64, 128, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(num_tokens, num_heads, head_dim, device="cuda", generator=gen).to(torch.bfloat16)
    positions = torch.arange(num_tokens, device="cuda")
    angles = torch.rand(num_tokens, rope_dim // 2, device="cuda", generator=gen) * 6.283
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    weights = torch.randn(num_tokens, num_heads, device="cuda", generator=gen).to(torch.bfloat16)
    rows = []
    for fmt, rope_style, rope_position in (("fp8", "neox", "first"), ("mxfp4", "interleaved", "trailing")):
        options = dict(rope_style=rope_style, rope_position=rope_position, fmt=fmt)
        args = (q, positions, cos_sin, weights, head_dim**-0.5, num_heads**-0.5)
        expected = rope_quant_q_reference(*args, **options)
        out_bytes = num_tokens * num_heads * (head_dim if fmt == "fp8" else head_dim // 2 + head_dim // 32)
        moved = (q.numel() * 2 + weights.numel() * 2 + positions.numel() * 8 + num_tokens * rope_dim * 4
                 + out_bytes + num_tokens * num_heads * 4)
        reference_us = harness.median_us(lambda: rope_quant_q_reference(*args, **options))
        shape = dict(T=num_tokens, H=num_heads, D=head_dim, fmt=fmt, style=rope_style, position=rope_position)
        rows += _rows("rope_quant_q", shape, moved, ROPE_VARIANTS[fmt],
                      lambda **knobs: rope_quant_q_triton(*args, **options, config=RopeQuantConfig(**knobs)),
                      reference_us, copy_tbs,
                      lambda result: _bytes_equal(result, expected))
        del expected
    return rows


def _page_permuted_slots(num_tokens: int, block_size: int, gen) -> torch.Tensor:
    """Slots of ``num_tokens`` tokens filling randomly permuted pages in order (what a prefill writes)."""
    pages = torch.randperm(num_tokens // block_size, device="cuda", generator=gen)
    return (pages[:, None] * block_size + torch.arange(block_size, device="cuda")).flatten()


def _insert_k(copy_tbs) -> list[dict]:
    num_tokens, block_size, head_dim = 1 << 20, 64, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    k = torch.randn(num_tokens, head_dim, device="cuda", generator=gen).to(torch.bfloat16)
    slots = _page_permuted_slots(num_tokens, block_size, gen)
    rows = []
    for fmt in ("fp8", "mxfp4"):
        cache = IndexerKCache(num_tokens // block_size, block_size=block_size, head_dim=head_dim, fmt=fmt,
                              device="cuda")
        twin = IndexerKCache(cache.num_blocks, block_size=block_size, head_dim=head_dim, fmt=fmt, device="cuda")
        options = dict(scale_fmt="ue8m0", amax_floor=1e-4)
        insert_k_reference(k, twin, slots, **options)
        moved = k.numel() * 2 + slots.numel() * 8 + num_tokens * cache.bytes_per_token
        reference_us = harness.median_us(lambda: insert_k_reference(k, twin, slots, **options))
        shape = dict(T=num_tokens, D=head_dim, block_size=block_size, fmt=fmt)
        rows += _rows("insert_k", shape, moved, INSERT_VARIANTS[fmt],
                      lambda **knobs: insert_k_triton(k, cache, slots, **options, config=InsertConfig(**knobs)),
                      reference_us, copy_tbs,
                      lambda _: torch.equal(cache.buffer, twin.buffer))
        del cache, twin
    return rows


def _gather_k(copy_tbs) -> list[dict]:
    block_size, head_dim, num_requests = 64, 128, 64
    gen = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    for fmt, num_tokens in (("fp8", 1 << 20), ("mxfp4", 1 << 21)):
        cache = IndexerKCache(num_tokens // block_size + num_requests, block_size=block_size, head_dim=head_dim,
                              fmt=fmt, device="cuda")
        cache.buffer.copy_(torch.randint(0, 256, cache.buffer.shape, device="cuda", generator=gen,
                                         dtype=torch.uint8))
        cuts = torch.sort(torch.randperm(num_tokens - 1, device="cuda", generator=gen)[: num_requests - 1] + 1).values
        cu = torch.cat((torch.zeros(1, device="cuda", dtype=torch.int64), cuts,
                        torch.full((1,), num_tokens, device="cuda"))).to(torch.int32)
        lengths = cu.diff().long()
        max_pages = int(((lengths + block_size - 1) // block_size).max())
        pages = torch.randperm(cache.num_blocks, device="cuda", generator=gen)
        starts = torch.cat((torch.zeros(1, device="cuda", dtype=torch.int64),
                            ((lengths + block_size - 1) // block_size).cumsum(0)[:-1]))
        table = pages[(starts[:, None] + torch.arange(max_pages, device="cuda")).clamp_max(cache.num_blocks - 1)]
        table = table.to(torch.int32)
        if fmt == "fp8":
            out = (torch.empty((num_tokens, head_dim), dtype=torch.float8_e4m3fn, device="cuda"),
                   torch.empty((num_tokens,), dtype=torch.float32, device="cuda"))
        else:
            out = (torch.empty((num_tokens, cache.value_bytes), dtype=torch.uint8, device="cuda"),
                   torch.empty((num_tokens, cache.scale_bytes), dtype=torch.uint8, device="cuda"))
        expected = tuple(t.clone() for t in out)
        gather_k_reference(cache, table, cu, *expected)
        moved = 2 * num_tokens * cache.bytes_per_token + table.numel() * 4 + cu.numel() * 4
        reference_us = harness.median_us(lambda: gather_k_reference(cache, table, cu, *expected))
        shape = dict(N=num_tokens, B=num_requests, D=head_dim, block_size=block_size, fmt=fmt)
        rows += _rows("gather_k", shape, moved, GATHER_VARIANTS,
                      lambda **knobs: gather_k_triton(cache, table, cu, *out, config=GatherConfig(**knobs)), reference_us, copy_tbs,
                      lambda _: _bytes_equal(out, expected))
        del cache, out, expected
    return rows


def run(ceilings: dict[str, float]) -> list[dict]:
    copy_tbs = ceilings["copy_tbs"]
    rows = _rope_quant_q(copy_tbs) + _insert_k(copy_tbs) + _gather_k(copy_tbs)
    print(f"{'op':<13} {'fmt':<6} {'variant':<50} {'us':>8} {'GB/s':>7} {'%copy':>6} {'torch us':>9}")
    for r in rows:
        print(f"{r['op']:<13} {r['shape']['fmt']:<6} {variant_label(r):<50} {r['us']:>8.1f} {r['tbs'] * 1e3:>7.0f} "
              f"{r['pct_of_floor']:>6} {r['baselines']['torch']:>9.1f}")
    return rows
