"""Sparse consumer benchmarks: a V4.1 consumer layer's decode step over its candidate blocks only,
beside the dense step (every visible key's logit, ``apply_candidate_mask``, top-k), in one run.

Shapes (V4.1): H = 32 index heads, D = 128, 64-token pages, 2048 candidate blocks of 8 per row, top-k 512;
B in {1, 32} x compressed context in {64K, 512K} x FP8 / MXFP4 x next_n in {1, 2}. Every request is at the
full context (row ``t`` sees ``L - next_n + 1 + t`` positions). Each request's candidate list is 2048
distinct random blocks of its context, ascending, the newest block included (what a source layer pins); the
draft rows of a request share it (consecutive tokens' candidates overlap heavily in practice; the sparse
kernel reads each row's blocks itself, so a second row re-reads them, mostly from the L2). Keys are random
finite bytes of the format, queries and weights Gaussian.

Records (``benchmarks/results/sparse_logits.json``), ``shape`` = ``{B, context, blocks, block, k, fmt,
next_n}``, times in µs as cold-L2 medians of CUDA-graph replays after a 256 MB memset (``harness.cold_graph_us``):

- ``consumer_step``: ``sparse_us`` = sparse logits + top-k + column-to-position map (what the layer runs),
  ``dense_us`` = dense logits + candidate mask + ``topk_decode``. Floor: the sparse step's bytes (the keys of
  2048 x 8 positions per request, the block-table row, each row's candidate list, its sparse logits written
  and read once) at the read bandwidth measured in the same run.
- ``sparse_decode_logits``: ``sparse_us`` = the sparse logits alone, ``dense_us`` = the dense step as above,
  ``dense_logits_us`` the dense logits alone. Floor (the issue's): the keys of 2048 blocks of 8 per request
  plus its block-table row, at the read bandwidth.

``us`` (the harness's field) is ``sparse_us``. Before timing, the sparse picks are checked bitwise against the
reference top-k of the sparse kernel's own logits, and those logits against the dense kernel's at the same
positions (calc_diff < 5e-6, ``-inf`` masks equal); ``picks_equal_dense`` records whether the two steps chose
the same positions (they do wherever the logits agree bit for bit). Peak memory: the 512K x 32 cache (2.2 GB
FP8) and the dense logits (128 MiB at next_n 2).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

import dsa_indexer as dsa
from dsa_indexer.ops.sparse_logits import sparse_paged_mqa_logits, topk_sparse
from dsa_indexer.testing import calc_diff

from . import harness
from .suite_step import PAGE, decode_inputs

HEADS = 32
NUM_BLOCKS, BLOCK, TOPK = 2048, 8, 512
SHAPES = [(b, length, fmt, n) for b in (1, 32) for length in (65536, 524288) for fmt in ("fp8", "mxfp4") for n in (1, 2)]
BYTES_PER_KEY = {"fp8": 132, "mxfp4": 68}
TIER = 5e-6


def _inputs(batch: int, length: int, next_n: int, fmt: str, gen: torch.Generator):
    """The decode step's inputs at ``HEADS`` heads (``suite_step.decode_inputs``) and each row's candidate
    blocks."""
    q_stored, q_scale, cache, weights, lens, table = decode_inputs(batch, length, next_n, fmt, gen, heads=HEADS)
    total_blocks = length // BLOCK
    draws = torch.rand(batch, total_blocks - 1, generator=gen).argsort(dim=1)[:, : NUM_BLOCKS - 1]
    blocks = torch.cat([draws, torch.full((batch, 1), total_blocks - 1)], dim=1).sort(dim=1).values
    blocks = blocks.repeat_interleave(next_n, dim=0).to(torch.int32).cuda()  # [B * next_n, NUM_BLOCKS]
    return q_stored, q_scale, cache, weights, lens, table, blocks


def _check(sparse_logits, dense_logits, blocks, sparse_picks, dense_picks, label: str) -> bool:
    expected = topk_sparse(sparse_logits, blocks, BLOCK, TOPK, backend="reference")
    if not torch.equal(sparse_picks, expected):
        raise AssertionError(f"{label}: sparse picks differ from the reference top-k of the sparse logits")
    positions = (blocks.long()[:, :, None] * BLOCK + torch.arange(BLOCK, device="cuda")).flatten(1)
    at_positions = dense_logits.gather(1, positions.clamp_max(dense_logits.shape[1] - 1))
    at_positions = torch.where(torch.isinf(sparse_logits), float("-inf"), at_positions)
    if calc_diff(sparse_logits, at_positions) >= TIER:
        raise AssertionError(f"{label}: sparse logits differ from the dense kernel's beyond the tier")
    return bool(torch.equal(sparse_picks, dense_picks))


def run(ceilings: dict[str, float]) -> Iterator[dict]:
    gen = torch.Generator().manual_seed(0)
    for batch, length, fmt, next_n in SHAPES:
        q, q_scale, cache, weights, lens, table, blocks = _inputs(batch, length, next_n, fmt, gen)
        num_rows = batch * next_n
        dense_logits = torch.empty(num_rows, length, device="cuda")
        sparse_logits = torch.empty(num_rows, NUM_BLOCKS * BLOCK, device="cuda")
        dense_picks = torch.empty(num_rows, TOPK, dtype=torch.int32, device="cuda")
        sparse_picks = torch.empty(num_rows, TOPK, dtype=torch.int32, device="cuda")
        ends = lens.reshape(-1)

        def sparse_logits_step():
            sparse_paged_mqa_logits(q, q_scale, cache, weights, lens, table, blocks, BLOCK, out=sparse_logits)

        def sparse_step():
            sparse_logits_step()
            topk_sparse(sparse_logits, blocks, BLOCK, TOPK, out=sparse_picks)

        def dense_logits_step():
            dsa.paged_mqa_logits(q, q_scale, cache, weights, lens, table, length, clean=False, out=dense_logits)

        def dense_step():
            dense_logits_step()
            dsa.apply_candidate_mask(dense_logits, None, ends, blocks, BLOCK)
            dsa.topk_decode(dense_logits, lens, next_n, TOPK, out=dense_picks)

        label = f"{fmt} B={batch} L={length} next_n={next_n}"
        sparse_step()
        dense_step()
        same = _check(sparse_logits, dense_logits, blocks, sparse_picks, dense_picks, label)
        sparse_us = harness.cold_graph_us(sparse_step)
        sparse_logits_us = harness.cold_graph_us(sparse_logits_step)
        dense_us = harness.cold_graph_us(dense_step)
        dense_logits_us = harness.cold_graph_us(dense_logits_step)
        shape = {"B": batch, "context": length, "blocks": NUM_BLOCKS, "block": BLOCK, "k": TOPK, "fmt": fmt,
                 "next_n": next_n}
        key_bytes = batch * NUM_BLOCKS * BLOCK * BYTES_PER_KEY[fmt] + batch * (length // PAGE) * 4
        step_bytes = key_bytes + num_rows * NUM_BLOCKS * 4 + 2 * num_rows * NUM_BLOCKS * BLOCK * 4
        read = ceilings["read_tbs"] * 1e6
        yield harness.record(
            "consumer_step", shape, sparse_us, step_bytes / read, tbs=step_bytes / sparse_us / 1e6,
            sparse_us=round(sparse_us, 2), dense_us=round(dense_us, 2), speedup=round(dense_us / sparse_us, 2),
            picks_equal_dense=same,
        )
        yield harness.record(
            "sparse_decode_logits", shape, sparse_logits_us, key_bytes / read, tbs=key_bytes / sparse_logits_us / 1e6,
            sparse_us=round(sparse_logits_us, 2), dense_us=round(dense_us, 2), dense_logits_us=round(dense_logits_us, 2),
        )
        del cache, dense_logits, sparse_logits, q, q_scale, weights
        torch.cuda.empty_cache()
