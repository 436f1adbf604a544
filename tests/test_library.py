"""torch.library registration: opcheck of every op, and torch.compile(fullgraph=True) equals eager."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import dsa_indexer as dsa
from dsa_indexer import library

D, H = 128, 2


def small_inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, D, generator=gen)
    q = torch.randn(4, H, D, generator=gen).bfloat16()
    positions = torch.tensor([0, 3, 7, 1])
    cos_sin = torch.randn(16, 64, generator=gen)
    weights = torch.randn(4, H, generator=gen)
    q8, _, w8 = dsa.rope_quant_q(q, positions, cos_sin, weights, 0.1, 0.5)
    k8, k_scale = dsa.quantize_fp8(torch.randn(6, D, generator=gen))
    k_scale = k_scale.squeeze(1)
    ks = torch.tensor([0, 0, 2, 1], dtype=torch.int32)
    ke = torch.tensor([1, 6, 4, 1], dtype=torch.int32)
    cache = dsa.IndexerKCache(3, block_size=4)
    cache.insert(torch.randn(12, D, generator=gen), torch.arange(12))
    logits = torch.randn(4, 10, generator=gen)
    return dict(x=x, q=q, positions=positions, cos_sin=cos_sin, weights=weights, q8=q8, w8=w8, k8=k8,
                k_scale=k_scale, ks=ks, ke=ke, cache=cache, logits=logits)


def op_cases():
    i = small_inputs()
    cache = i["cache"]
    table = torch.tensor([[2, 0, 1], [1, 2, 0]], dtype=torch.int32)
    lens = torch.tensor([[9, 10], [3, 4]], dtype=torch.int32)
    fmt = (cache.buffer, cache.block_size, cache.head_dim, cache.fmt)
    blocks = torch.tensor([[0, 2, -1], [1, 1, 1], [0, 1, 4], [-1, -1, -1]], dtype=torch.int32)
    return {
        "quantize_fp8": (library.quantize_fp8_op, (i["x"], 128, "ue8m0", 1e-4)),
        "dequantize_fp8": (library.dequantize_fp8_op, (*dsa.quantize_fp8(i["x"]), 128)),
        "quantize_mxfp4": (library.quantize_mxfp4_op, (i["x"],)),
        "dequantize_mxfp4": (library.dequantize_mxfp4_op, dsa.quantize_mxfp4(i["x"])),
        "rope_quant_q": (library.rope_quant_q_op, (i["q"], i["positions"], i["cos_sin"], i["weights"], 0.1, 0.5,
                                                    "neox", "first", "fp8", "auto")),
        "insert_k": (library.insert_k_op, (i["x"], cache.buffer.clone(), 4, D, "fp8", torch.tensor([0, 5, -1]),
                                           "ue8m0", 1e-4, "auto")),
        "gather_k": (library.gather_k_op, (*fmt, table, torch.tensor([0, 5, 8], dtype=torch.int32), 8, "auto")),
        "mqa_logits": (library.mqa_logits_op, (i["q8"], None, i["k8"], i["k_scale"], i["w8"], i["ks"], i["ke"], True,
                                               "auto")),
        "mqa_logits_out": (library.mqa_logits_out_op, (i["q8"], None, i["k8"], i["k_scale"], i["w8"], i["ks"], i["ke"],
                                                       True, torch.empty(4, 6), "auto")),
        "paged_mqa_logits": (library.paged_mqa_logits_op, (i["q8"].view(2, 2, H, D), None, *fmt, i["w8"], lens, table,
                                                           12, True, "auto")),
        "topk": (library.topk_op, (i["logits"], 3, i["ks"], i["ke"] + 2, "auto")),
        "topk_out": (library.topk_out_op, (i["logits"], 3, None, None, torch.empty(4, 3, dtype=torch.int32), "auto")),
        "topk_decode": (library.topk_decode_op, (i["logits"], torch.tensor([9, 4], dtype=torch.int32), 2, 3, "auto")),
        "topk_decode_slots": (library.topk_decode_slots_op, (i["logits"], torch.tensor([9, 4], dtype=torch.int32), 2, 3,
                                                             torch.tensor([[2, 0, 1], [1, 2, 0]], dtype=torch.int32), 4,
                                                             "auto")),
        "indices_to_slots": (library.indices_to_slots_op, (torch.tensor([[0, 5, -1]], dtype=torch.int32), table, 4,
                                                           torch.tensor([1], dtype=torch.int32), "auto")),
        "pack_seq": (library.pack_seq_op, (i["x"], torch.tensor([1, 2]), 0.0, 2, "auto")),
        "unpack_seq": (library.unpack_seq_op, (i["x"].view(3, 1, D), torch.tensor([1, 0, 1]), 2, "auto")),
        "select_candidate_blocks": (library.select_candidate_blocks_op, (i["logits"], None, i["ke"], 2, 2, 1, "auto")),
        "sparse_mqa_logits": (library.sparse_mqa_logits_op, (i["q8"], None, i["k8"], i["k_scale"], i["w8"], i["ks"],
                                                             i["ke"], blocks, 2, torch.bfloat16, "auto")),
        "sparse_paged_mqa_logits": (library.sparse_paged_mqa_logits_op, (i["q8"].view(2, 2, H, D), None, *fmt, i["w8"],
                                                                         lens, table, blocks, 2, torch.float32, "auto")),
        "topk_sparse": (library.topk_sparse_op, (i["logits"][:, :6], blocks, 2, 4, "auto")),
        "apply_candidate_mask": (library.apply_candidate_mask_op, (i["logits"].clone(), None, i["ke"],
                                                                   torch.tensor([[0], [1], [0], [2]], dtype=torch.int32),
                                                                   2, 1, "auto")),
    }


def takes_fp8(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)


@pytest.mark.parametrize("name", sorted(op_cases()))
def test_opcheck(name):
    op, args = op_cases()[name]
    # opcheck's schema test compares inputs with arithmetic that CPU float8 lacks; for those ops the
    # declared mutations are checked by hand below instead.
    utils = ("test_faketensor", "test_aot_dispatch_dynamic") if takes_fp8(args) else (
        "test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    opcheck(op, args, test_utils=utils)
    if takes_fp8(args):
        before = [a.view(torch.uint8).clone() if a.dtype == torch.float8_e4m3fn else a.clone()
                  for a in args if isinstance(a, torch.Tensor)]
        op(*args)
        after = [a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a for a in args if isinstance(a, torch.Tensor)]
        mutated = set(op._opoverload._schema.arguments[i].name for i, a in enumerate(op._opoverload._schema.arguments)
                      if a.alias_info is not None and a.alias_info.is_write)
        names = [a.name for a, v in zip(op._opoverload._schema.arguments, args) if isinstance(v, torch.Tensor)]
        for name_, b, a in zip(names, before, after):
            if name_ not in mutated:
                assert torch.equal(b, a), f"{name} wrote its input {name_}"


def indexer_step(q8, w8, k8, k_scale, ks, ke, cache, table, lens):
    prefill = dsa.mqa_logits(q8, None, k8, k_scale, w8, ks, ke)
    picks = dsa.topk(prefill, 3, starts=ks, ends=ke)
    decode = dsa.paged_mqa_logits(q8.view(2, 2, H, D), None, cache, w8, lens, table, 12)
    decode_picks = dsa.topk_decode(decode, lens, 2, 3)
    owners = torch.tensor([0, 0, 1, 1], dtype=torch.int32, device=table.device)
    blocks = torch.tensor([[0, 2, -1], [1, 1, 1], [0, 1, 4], [-1, -1, -1]], dtype=torch.int32, device=table.device)
    sparse = dsa.sparse_paged_mqa_logits(q8.view(2, 2, H, D), None, cache, w8, lens, table, blocks, 2)
    sparse_picks = dsa.topk_sparse(sparse, blocks, 2, 3)
    return picks, decode_picks, dsa.indices_to_slots(decode_picks, table, 4, owners), sparse, sparse_picks


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_function_equals_eager(compiler, device):
    i = small_inputs()
    cache = dsa.IndexerKCache(3, block_size=4, device=device)
    cache.buffer.copy_(i["cache"].buffer)
    table = torch.tensor([[2, 0, 1], [1, 2, 0]], dtype=torch.int32)
    lens = torch.tensor([[9, 10], [3, 4]], dtype=torch.int32)
    tensors = (i["q8"], i["w8"], i["k8"], i["k_scale"], i["ks"], i["ke"])
    args = (*(t.to(device) for t in tensors), cache, table.to(device), lens.to(device))
    eager = indexer_step(*args)
    compiled = torch.compile(indexer_step, fullgraph=True, backend=compiler)(*args)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)


def test_compiled_sizes_that_depend_on_values_must_be_given():
    def pack(x, lengths):
        return dsa.pack_seq(x, lengths, pad_value=0.0)

    with pytest.raises(Exception, match="max_len must be given"):
        torch.compile(pack, fullgraph=True, backend="aot_eager")(torch.randn(3, 4), torch.tensor([1, 2]))
