"""The index-dtype policy (docs/contract.md §12): every index or length tensor an op reads may be int32
or int64, an int64 one gives the int32 call's result bit for bit, an int64 value outside the int32
range is refused naming the argument, and index outputs are int32."""

from __future__ import annotations

import pytest
import torch

import dsa_indexer as dsa
from dsa_indexer.distributed import pack_local_candidates, select_global_topk


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _logits(rows: int, width: int, seed: int) -> torch.Tensor:
    # Few distinct values: ties exercise the column tie-break.
    return torch.randint(-3, 4, (rows, width), generator=torch.Generator().manual_seed(seed)).float()


def _fp8_cache() -> dsa.IndexerKCache:
    cache = dsa.IndexerKCache(4, block_size=4, head_dim=128)
    keys = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    cache.insert(keys, torch.arange(16))
    return cache


def _fp8_q(rows: int, heads: int = 2) -> torch.Tensor:
    q = torch.randn(rows, heads, 128, generator=torch.Generator().manual_seed(2))
    return dsa.quantize_fp8(q, amax_floor=1e-10)[0]


def _calls():
    """``name -> (call, int32 index arguments)``; ``call(**indices)`` returns what the op produced."""
    cache = _fp8_cache()
    k_values, k_scales = cache.gather(int32([[0, 1, 2, 3]]), int32([0, 16]))
    weights = torch.rand(3, 2, generator=torch.Generator().manual_seed(3))
    table = int32([[2, 0], [3, 1]])
    generator = torch.Generator().manual_seed(4)
    q_bf16, cos_sin = torch.randn(2, 1, 128, generator=generator), torch.rand(8, 64, generator=generator)
    decode_q, decode_weights = _fp8_q(4).view(2, 2, 2, 128), torch.rand(4, 2, generator=generator)

    def mask(starts, ends, candidate_blocks):
        logits = _logits(4, 10, 7)
        dsa.apply_candidate_mask(logits, starts, ends, candidate_blocks, 2, row_repeat=2)
        return logits

    def insert(slot_mapping):
        target = dsa.IndexerKCache(4, block_size=4, head_dim=128)
        target.insert(torch.ones(3, 128), slot_mapping)
        return target.buffer

    def plan(block_table):
        meta = dsa.build_metadata([5, 9, 12], [1, 1, 6], block_table, block_size=4)
        (chunk,) = meta.prefill_chunks
        # The planner's slot_mapping stays int64 (what engines hand a cache write): compared as values.
        return (meta.decode.block_table, chunk.block_table, chunk.ks, chunk.ke, chunk.cu_seq_lens,
                meta.slot_mapping.int())

    return {
        "topk": (lambda starts, ends: dsa.topk(_logits(3, 8, 0), 4, starts=starts, ends=ends),
                 dict(starts=int32([0, 2, 5]), ends=int32([8, 6, 5]))),
        "topk_decode": (lambda seq_lens: dsa.topk_decode(_logits(4, 8, 1), seq_lens, 2, 3), dict(seq_lens=int32([3, 8]))),
        "topk_decode_2d": (lambda seq_lens: dsa.topk_decode(_logits(4, 8, 1), seq_lens, 2, 3),
                           dict(seq_lens=int32([[0, 5], [8, 7]]))),
        "topk_decode_slots": (lambda seq_lens, block_table: dsa.topk_decode_slots(_logits(4, 8, 2), seq_lens, 2, 3,
                                                                                  block_table, 4),
                              dict(seq_lens=int32([5, 8]), block_table=table)),
        "indices_to_slots": (lambda indices, block_table, row_to_request: dsa.indices_to_slots(indices, block_table, 4,
                                                                                              row_to_request),
                             dict(indices=int32([[0, 5, -1], [7, -1, -1], [3, 4, 6]]), block_table=table,
                                  row_to_request=int32([0, 1, 1]))),
        "select_candidate_blocks": (lambda starts, ends: dsa.select_candidate_blocks(_logits(4, 10, 3), starts, ends, 2, 2,
                                                                                     row_repeat=2),
                                    dict(starts=int32([0, 3]), ends=int32([9, 10]))),
        "apply_candidate_mask": (mask, dict(starts=int32([0, 3]), ends=int32([9, 10]),
                                            candidate_blocks=int32([[0, 3], [-1, 1], [2, 9], [0, 0]]))),
        "mqa_logits": (lambda ks, ke: dsa.mqa_logits(_fp8_q(3), None, k_values, k_scales, weights, ks, ke),
                       dict(ks=int32([0, 4, 16]), ke=int32([16, 9, 16]))),
        "paged_mqa_logits": (lambda context_lens, block_table: dsa.paged_mqa_logits(
            decode_q, None, cache, decode_weights, context_lens, block_table, 8),
            dict(context_lens=int32([5, 8]), block_table=table)),
        "gather": (lambda block_table, cu_seq_lens: cache.gather(block_table, cu_seq_lens),
                   dict(block_table=table, cu_seq_lens=int32([0, 5, 12]))),
        "insert": (insert, dict(slot_mapping=int32([15, -1, 4]))),
        "pack_seq": (lambda lengths: dsa.pack_seq(torch.arange(6.0), lengths, pad_value=-1.0), dict(lengths=int32([2, 0, 4]))),
        "unpack_seq": (lambda lengths: dsa.unpack_seq(torch.arange(12.0).view(3, 4), lengths), dict(lengths=int32([2, 0, 4]))),
        "rope_quant_q": (lambda positions: dsa.rope_quant_q(q_bf16, positions, cos_sin, torch.ones(2, 1), 1.0, 1.0),
                         dict(positions=int32([7, 0]))),
        "build_metadata": (plan, dict(block_table=int32([[0, 1, 0], [2, 3, 4], [5, 6, 7]]))),
        # Its global ids are int64 by design (ids past 2**31 - 1 are never selectable): compared as values.
        "pack_local_candidates": (lambda local_topk, starts: [t.float() for t in pack_local_candidates(
            _logits(2, 8, 5), local_topk, 1, 2, 1, starts)],
                                  dict(local_topk=int32([[0, 2, -1], [1, -1, -1]]), starts=int32([0, 3]))),
        "select_global_topk": (lambda global_ids: select_global_topk(_logits(2, 4, 6), global_ids, 2),
                               dict(global_ids=int32([[5, 1, -1, 3], [0, 2, 4, 6]]))),
    }


CALLS = _calls()


def _flat(result) -> list[torch.Tensor]:
    return [tensor for tensor in (result if isinstance(result, tuple | list) else (result,)) if tensor is not None]


@pytest.mark.parametrize("name", sorted(CALLS))
def test_int64_indices_give_the_int32_result(name):
    call, indices = CALLS[name]
    expected = _flat(call(**indices))
    for argument in indices:
        widened = {**indices, argument: indices[argument].long()}
        got = _flat(call(**widened))
        for want, have in zip(expected, got, strict=True):
            assert have.dtype == want.dtype, (argument, have.dtype, want.dtype)
            assert torch.equal(have, want), argument
    for tensor in expected:
        assert tensor.dtype not in (torch.int64, torch.int16), "index outputs are int32"


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: dsa.indices_to_slots(int32([[0]]), torch.tensor([[2**32 + 1]]), 4, int32([0])), "block_table"),
        (lambda: dsa.topk_decode_slots(torch.zeros(1, 4), int32([1]), 1, 1, torch.tensor([[-(2**31) - 1]]), 4),
         "block_table"),
        (lambda: dsa.apply_candidate_mask(torch.zeros(1, 4), None, int32([4]), torch.tensor([[2**33]]), 2),
         "candidate_blocks"),
        (lambda: dsa.build_metadata([4], [4], torch.tensor([[2**31]]), block_size=4), "block_table"),
        (lambda: pack_local_candidates(torch.zeros(1, 4), torch.tensor([[2**31]]), 0, 1, 1), "local_topk"),
        (lambda: dsa.topk(torch.zeros(1, 4), 1, ends=torch.tensor([2**32])), "ends"),
        (lambda: dsa.topk_decode(torch.zeros(1, 4), torch.tensor([2**32 + 2]), 1, 1), "seq_lens"),
    ],
    ids=["indices_to_slots", "topk_decode_slots", "apply_candidate_mask", "build_metadata", "pack_local_candidates",
         "topk", "topk_decode"],
)
def test_int64_values_outside_int32_are_refused_naming_the_argument(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


def test_int64_bounds_reach_the_triton_top_k_as_int32(kernel_device):
    logits = _logits(3, 8, 0).to(kernel_device)
    starts, ends = int32([0, 2, 5]).to(kernel_device), int32([8, 6, 5]).to(kernel_device)
    expected = dsa.topk(logits, 4, starts=starts, ends=ends, backend="reference")
    got = dsa.topk(logits, 4, starts=starts.long(), ends=ends.long(), backend="triton")
    assert got.dtype == torch.int32 and torch.equal(got, expected)
