"""Benchmarks of pack_seq / unpack_seq and the V4.1 candidate blocks.

Every op here is memory-bound: the floor is the fewest bytes it must move over the copy bandwidth
measured in the same run (read + write bytes, like the ceiling). Target: >= 70% of that bandwidth.
The ``torch`` baseline is the package's PyTorch reference on the same inputs. Both sides are timed
without the public wrappers' argument checks (the candidate ops' bounds check reads a value back to
the host, which would put a CPU round trip inside the timed region).

- pack_seq: V3.2 decode Q padding, 8192 requests of 1..4 tokens (next_n = 4), fp8 [64, 128] rows
  (8 KiB): reads the valid rows, writes the whole padded grid.
- unpack_seq: compacting int32 top-2048 rows (8 KiB) of the same batch: reads and writes the valid rows.
- select_candidate_blocks: V4.1 sources, 128K compressed positions per row, blocks of 8, top 2048
  blocks: reads each row's logits once. The default is one launch: the split select (several streaming
  programs per row, the last selects) from 256 rows, one program per row (keys in registers) below; the stage
  records time the two kernels of the two-launch path (rows wider than 16384 blocks) alone, whose
  block-key scratch (1/8 of the logits) is counted as overhead. R 512 (256 MiB) is the reference shape, R 64 and 32
  decode batches (32 takes the split kernel: its 128 pieces fit one per SM), R 2048 (1 GiB) a 2048-token prefill
  chunk over the same context.
- apply_candidate_mask: the same rows and the 2048 chosen blocks: writes -inf on every masked
  column (the kept ones are not touched), reads the candidate ids.
- indices_to_slots (kernel owned by ``ops/topk``): 16384 top-2048 rows of 256 requests with 64K-token
  contexts in pages of 64 (a 1 MiB block table, L2-resident): reads the int32 indices (about 3% of
  them -1 padding) and writes the int32 slots, 256 MiB in all; the table and the row-to-request map
  are counted once.

Candidate and slot records carry three times: ``us`` (cold-L2 event time of one call, host launch
included: at R 64 the host's launch cost of the three launches exceeds the GPU time, so this number
is the host's), ``graph_us`` (warm CUDA-graph replays) and ``cold_graph_us`` (one graph replay after
a 256 MB memset that evicts the L2): the last is the honest figure for these capturable ops.

Tuning sweeps and the split select's phase timeline live outside the package:
``benchmarks/sweeps/seq_candidates.py``.
"""

from __future__ import annotations

import time

import torch

from dsa_indexer.ops.candidates import triton as candidates_triton
from dsa_indexer.ops.candidates.reference import apply_candidate_mask_reference, select_candidate_blocks_reference
from dsa_indexer.ops.seq_pack.reference import pack_seq_reference, unpack_seq_reference
from dsa_indexer.ops.seq_pack.triton import pack_seq_triton, unpack_seq_triton
from dsa_indexer.ops.topk.reference import indices_to_slots as indices_to_slots_reference
from dsa_indexer.ops.topk.triton import indices_to_slots_triton

from . import harness

MIB = 1 << 20


def _random_bytes(shape, dtype, generator) -> torch.Tensor:
    numel = 1
    for size in shape:
        numel *= size
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, device="cuda", generator=generator)
    return raw.view(dtype).view(shape)


def _floor_us(num_bytes: int, ceilings: dict[str, float]) -> float:
    return num_bytes / (ceilings["copy_tbs"] * 1e6)


def _row(op, shape, us, num_bytes, ceilings, torch_us, **extra):
    return harness.record(op, shape, us, _floor_us(num_bytes, ceilings), tbs=num_bytes / us / 1e6,
                          baselines={"torch": torch_us} if torch_us is not None else None,
                          moved_mib=round(num_bytes / MIB, 1), **extra)


def _timed(fn) -> tuple[float, float]:
    """(cold-L2 event time, CUDA-graph replay time) in µs: the second leaves out the host's launch cost."""
    return harness.median_us(fn), harness.median_us(fn, graph=True)


def _host_us(fn, calls: int = 50) -> float:
    """Host time per call of ``fn`` in µs (launches only, the GPU is not waited for within the loop)."""
    fn()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - begin
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _bench_seq_pack(ceilings, generator) -> list[dict]:
    num_seqs, max_len = 8192, 4
    lengths = torch.randint(1, max_len + 1, (num_seqs,), device="cuda", generator=generator, dtype=torch.int32)
    total = int(lengths.sum())
    q = _random_bytes((total, 64, 128), torch.float8_e4m3fn, generator)
    row_bytes = 64 * 128
    packed = torch.empty((num_seqs, max_len, 64, 128), dtype=torch.float8_e4m3fn, device="cuda")
    pack_bytes = total * row_bytes + num_seqs * max_len * row_bytes
    shape = {"B": num_seqs, "L": max_len, "rows": total, "row_bytes": row_bytes, "dtype": "fp8"}
    rows = []
    us, graph_us = _timed(lambda: pack_seq_triton(q, lengths, 0.0, max_len, packed))
    ref = harness.median_us(lambda: pack_seq_reference(q, lengths, 0.0, max_len, packed))
    rows.append(_row("pack_seq", shape, us, pack_bytes, ceilings, ref, graph_us=round(graph_us, 2)))
    indices = _random_bytes((num_seqs, max_len, 2048), torch.int32, generator)
    flat = torch.empty((total, 2048), dtype=torch.int32, device="cuda")
    unpack_bytes = 2 * total * 2048 * 4
    shape = {"B": num_seqs, "L": max_len, "rows": total, "row_bytes": 2048 * 4, "dtype": "int32"}
    us, graph_us = _timed(lambda: unpack_seq_triton(indices, lengths, total, flat))
    ref = harness.median_us(lambda: unpack_seq_reference(indices, lengths, total, flat))
    rows.append(_row("unpack_seq", shape, us, unpack_bytes, ceilings, ref, graph_us=round(graph_us, 2)))
    return rows


def _bench_candidates(ceilings, generator, num_rows: int, *, with_torch: bool, stages: bool) -> list[dict]:
    width, block_size, num_blocks_k = 131072, 8, 2048
    logits = torch.randn(num_rows, width, device="cuda", generator=generator)
    starts = torch.zeros(num_rows, dtype=torch.int32, device="cuda")
    ends = torch.full((num_rows,), width, dtype=torch.int32, device="cuda")
    out = torch.empty((num_rows, num_blocks_k), dtype=torch.int32, device="cuda")
    shape = {"R": num_rows, "C": width, "block": block_size, "K": num_blocks_k}
    rows = []
    select_bytes = num_rows * width * 4 + num_rows * num_blocks_k * 4

    def select(impl):
        return impl(logits, starts, ends, num_blocks_k, block_size, 1, out)

    us, graph_us = _timed(lambda: select(candidates_triton.select_candidate_blocks_triton))
    ref = harness.median_us(lambda: select(select_candidate_blocks_reference)) if with_torch else None
    cold = harness.cold_graph_us(lambda: select(candidates_triton.select_candidate_blocks_triton))
    rows.append(_row("select_candidate_blocks", shape, us, select_bytes, ceilings, ref, graph_us=round(graph_us, 2),
                     cold_graph_us=round(cold, 2)))
    if stages:
        keys = candidates_triton.block_keys(logits, starts, ends, block_size, 1)
        us = harness.median_us(lambda: candidates_triton.block_keys(logits, starts, ends, block_size, 1))
        rows.append(_row("select/block_keys", shape, us, num_rows * width * 4 + keys.numel() * 4, ceilings, None))
        us = harness.median_us(lambda: candidates_triton.select_from_keys(
            keys, starts, ends, num_blocks_k, block_size, 1, out))
        rows.append(_row("select/radix", shape, us, keys.numel() * 4, ceilings, None))
    chosen = select(candidates_triton.select_candidate_blocks_triton).clone()
    masked = num_rows * width - num_rows * num_blocks_k * block_size
    mask_bytes = masked * 4 + chosen.numel() * 4
    def mask(impl):
        impl(logits, starts, ends, chosen, block_size, 1)

    us, graph_us = _timed(lambda: mask(candidates_triton.apply_candidate_mask_triton))
    ref = harness.median_us(lambda: mask(apply_candidate_mask_reference)) if with_torch else None
    cold = harness.cold_graph_us(lambda: mask(candidates_triton.apply_candidate_mask_triton))
    host = _host_us(lambda: mask(candidates_triton.apply_candidate_mask_triton))
    rows.append(_row("apply_candidate_mask", shape, us, mask_bytes, ceilings, ref, graph_us=round(graph_us, 2),
                     cold_graph_us=round(cold, 2), host_us=round(host, 2)))
    return rows


def _bench_indices_to_slots(ceilings, generator) -> list[dict]:
    num_rows, k, num_requests, context, block_size = 16384, 2048, 256, 65536, 64
    pages = context // block_size
    indices = torch.randint(0, context, (num_rows, k), device="cuda", generator=generator, dtype=torch.int32)
    padding = torch.rand((num_rows, k), device="cuda", generator=generator) < 0.03
    indices = torch.where(padding, -1, indices)
    table = torch.randperm(num_requests * pages, device="cuda", generator=generator).to(torch.int32)
    table = table.view(num_requests, pages)
    row_to_request = torch.arange(num_rows, device="cuda", dtype=torch.int32) // (num_rows // num_requests)
    args = (indices, table, block_size, row_to_request)
    if not torch.equal(indices_to_slots_triton(*args), indices_to_slots_reference(*args)):
        raise AssertionError("indices_to_slots: Triton slots differ from the reference")
    moved = 2 * indices.numel() * 4 + table.numel() * 4 + row_to_request.numel() * 4
    shape = {"R": num_rows, "k": k, "B": num_requests, "pages": pages, "block": block_size}
    us, graph_us = _timed(lambda: indices_to_slots_triton(*args))
    cold = harness.cold_graph_us(lambda: indices_to_slots_triton(*args))
    ref = harness.median_us(lambda: indices_to_slots_reference(*args))
    return [_row("indices_to_slots", shape, us, moved, ceilings, ref, graph_us=round(graph_us, 2),
                 cold_graph_us=round(cold, 2))]


def run(ceilings: dict[str, float]) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = _bench_seq_pack(ceilings, generator)
    rows += _bench_candidates(ceilings, generator, 512, with_torch=True, stages=True)
    rows += _bench_candidates(ceilings, generator, 64, with_torch=False, stages=True)
    rows += _bench_candidates(ceilings, generator, 32, with_torch=False, stages=False)
    rows += _bench_candidates(ceilings, generator, 2048, with_torch=False, stages=False)
    rows += _bench_indices_to_slots(ceilings, generator)
    return rows
