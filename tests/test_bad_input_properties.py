"""Generated bad input against every public op, the layer and the planner (contract §12).

Each example builds a valid call on tiny CPU tensors (reference backend), corrupts one argument (wrong type,
dtype, rank or shape, out-of-range values, a bad scalar or string, another device, a strided view) and calls.
The call must either return a result that obeys the contract (shapes, dtypes and, for the top-k family, the
exact oracle of ``dsa_indexer.testing``) or raise ``ValueError``/``TypeError`` whose message names one of the
function's parameters; a rejected call leaves the cache bytes, ``out`` buffers, the top-k buffer, in-place
operands and the planner's buffers as they were. Any other exception fails the example.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsa_indexer as dsa
from dsa_indexer.cache import IndexerKCache
from dsa_indexer.formats import mxfp4_scale_bytes
from dsa_indexer.metadata import MetadataBuilder
from dsa_indexer.ops.k_cache import gather_k, insert_k
from dsa_indexer.testing import assert_topk_exact

PROPERTY_SETTINGS = settings(
    max_examples=25, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
POISON = -777
HEADS, DIM, BLOCK = 2, 64, 16
INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------------------- mutations

def _poked(value: torch.Tensor, position: int, new) -> torch.Tensor:
    """``value`` with flat entry ``position`` set to ``new`` (widened to int64 / float32 when it does not fit)."""
    if value.numel() == 0:
        return value
    if not value.is_floating_point() and not (-(2**31) <= new <= INT32_MAX) and value.dtype != torch.int64:
        value = value.long()
    result = value.detach().clone(memory_format=torch.contiguous_format)
    result.view(-1)[position % value.numel()] = new
    return result


def _strided(value: torch.Tensor) -> torch.Tensor:
    """The same values through a view whose last dimension has stride 2."""
    if value.dim() == 0:
        return value
    return torch.stack((value, value), dim=-1).select(-1, 0)


def _structural(value: torch.Tensor) -> list:
    """Wrong type, rank, shape and device versions of a tensor argument."""
    variants = [value.tolist(), None, 3, "tensor", value.unsqueeze(0), value.to("meta")]
    if value.dim() >= 1:
        variants += [value[0], value[:-1], torch.cat((value, value[:1])), value.reshape(-1, 1)]
    if value.dim() >= 2:
        variants += [value.reshape(-1), value[..., :-1], value.transpose(0, 1)]
    return variants


def index_values(value: torch.Tensor):
    pokes = st.sampled_from([-(2**31), -7, -2, -1, 0, 1, 5, 17, 33, 1000, INT32_MAX, 2**31, 2**40])
    dtypes = [torch.int16, torch.uint8, torch.float32, torch.bool, torch.int64, torch.int32]
    return st.one_of(
        st.sampled_from(_structural(value) + [value.to(d) for d in dtypes] + [_strided(value)]),
        st.tuples(st.integers(0, 63), pokes).map(lambda p: _poked(value, *p)),
    )


def float_values(value: torch.Tensor):
    dtypes = [torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.float8_e4m3fn, torch.uint8]
    pokes = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e30, -1e30])
    return st.one_of(
        st.sampled_from(_structural(value) + [value.to(d) for d in dtypes] + [_strided(value)]),
        st.tuples(st.integers(0, 255), pokes).map(lambda p: _poked(value, *p)),
    )


def quantised_values(value: torch.Tensor):
    """Stored e4m3 / packed e2m1 / scale-byte tensors: wrong dtypes and shapes."""
    return st.sampled_from(_structural(value) + [value.float(), value.view(torch.int8), _strided(value)])


INTS = st.sampled_from([0, -1, 1, 2, 3, 7, 64, 10**12, 2**31, 2.0, 1.5, True, "2", None])
STRINGS = st.sampled_from(["", "FP8", "fp4", "auto ", "ue8m0x", "Reference", None, 3])
REALS = st.sampled_from([0.0, -1.0, math.inf, -math.inf, math.nan, 1e-30, "1", None, True, 2])
BOOLS = st.sampled_from([0, 1, "yes", None, 2.0])
LENGTH_LISTS = st.sampled_from([[20.0, 12], [20, 12.5], [-1, 12], [20], [20, 12, 5], "20", 20, None,
                                [20, "12"], [True, 12], [2**40, 12], [20, 10**6], [40, 12], [20, 0]])


@dataclass
class Case:
    """One public function: a fresh valid call, the strategies that corrupt each argument, what a rejected call
    must leave untouched and what an accepted one must satisfy."""

    build: Callable[[], dict]
    call: Callable[[dict], object]
    corruptions: dict[str, Callable[[object], st.SearchStrategy]]
    params: tuple[str, ...]
    state: Callable[[dict], list] = lambda args: []
    check: Callable[[dict, object], None] = lambda args, result: None


def _params(*functions) -> tuple[str, ...]:
    return tuple(name for f in functions for name in inspect.signature(f).parameters if name != "self")


def _names_an_argument(message: str, params: tuple[str, ...]) -> bool:
    return any(re.search(rf"(?<![A-Za-z_]){re.escape(name)}(?![A-Za-z_])", message) for name in params)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return tensor.detach().clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def _snapshot(tensors: list) -> list:
    return [(t, _bytes(t)) for t in tensors if isinstance(t, torch.Tensor) and t.device.type != "meta"]


def run_generated_call(case: Case, data) -> None:
    args = case.build()
    name = data.draw(st.sampled_from(sorted(case.corruptions)), label="argument")
    args[name] = data.draw(case.corruptions[name](args[name]), label=name)
    before = _snapshot(case.state(args))
    try:
        result = case.call(args)
    except (ValueError, TypeError) as error:
        assert _names_an_argument(str(error), case.params), f"{type(error).__name__} names no argument: {error}"
        for tensor, saved in before:
            assert torch.equal(_bytes(tensor), saved), f"rejected call ({error}) changed a {list(tensor.shape)} tensor"
        return
    if not any(isinstance(value, torch.Tensor) and value.device.type == "meta" for value in args.values()):
        case.check(args, result)  # a call on meta tensors alone is valid and computes no values


def _expect(result: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    assert isinstance(result, torch.Tensor) and tuple(result.shape) == tuple(shape) and result.dtype == dtype, (
        f"got {getattr(result, 'shape', result)} {getattr(result, 'dtype', '')}, expected {shape} {dtype}")


# ------------------------------------------------------------------------------------------------ formats

def _x(rows=3, dim=DIM, seed=0):
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))


def _check_quantize_fp8(args, result):
    values, scales = result
    x = args["x"]
    _expect(values, x.shape, torch.float8_e4m3fn)
    _expect(scales, (*x.shape[:-1], x.shape[-1] // args["block_size"]), torch.float32)
    assert bool((scales > 0).all() & torch.isfinite(scales).all())


def _check_mxfp4(args, result):
    packed, scales = result
    x = args["x"]
    _expect(packed, (*x.shape[:-1], x.shape[-1] // 2), torch.uint8)
    _expect(scales, (*x.shape[:-1], mxfp4_scale_bytes(x.shape[-1])), torch.uint8)


def _fp8_pair():
    values, scales = dsa.quantize_fp8(_x(), block_size=32)
    return {"values": values, "scales": scales, "block_size": 32}


def _mxfp4_pair():
    packed, scales = dsa.quantize_mxfp4(_x())
    return {"packed": packed, "scales": scales}


FORMAT_CASES = {
    "quantize_fp8": Case(
        build=lambda: {"x": _x(), "block_size": 32, "scale_fmt": "ue8m0", "amax_floor": 1e-4},
        call=lambda a: dsa.quantize_fp8(a["x"], block_size=a["block_size"], scale_fmt=a["scale_fmt"],
                                        amax_floor=a["amax_floor"]),
        corruptions={"x": float_values, "block_size": lambda v: INTS, "scale_fmt": lambda v: STRINGS,
                     "amax_floor": lambda v: REALS},
        params=_params(dsa.quantize_fp8), check=_check_quantize_fp8,
    ),
    "dequantize_fp8": Case(
        build=_fp8_pair,
        call=lambda a: dsa.dequantize_fp8(a["values"], a["scales"], block_size=a["block_size"]),
        corruptions={"values": quantised_values, "scales": float_values, "block_size": lambda v: INTS},
        params=_params(dsa.dequantize_fp8),
        check=lambda a, r: _expect(r, a["values"].shape, torch.float32),
    ),
    "quantize_mxfp4": Case(
        build=lambda: {"x": _x()}, call=lambda a: dsa.quantize_mxfp4(a["x"]), corruptions={"x": float_values},
        params=_params(dsa.quantize_mxfp4), check=_check_mxfp4,
    ),
    "dequantize_mxfp4": Case(
        build=_mxfp4_pair, call=lambda a: dsa.dequantize_mxfp4(a["packed"], a["scales"]),
        corruptions={"packed": quantised_values, "scales": quantised_values},
        params=_params(dsa.dequantize_mxfp4),
        check=lambda a, r: _expect(r, (*a["packed"].shape[:-1], a["packed"].shape[-1] * 2), torch.float32),
    ),
}


# --------------------------------------------------------------------------------------------- q and keys

def _rope_args():
    gen = torch.Generator().manual_seed(1)
    return {"q": torch.randn(3, HEADS, DIM, generator=gen).bfloat16(), "positions": torch.tensor([0, 7, 3]),
            "cos_sin": torch.rand(8, DIM, generator=gen), "weights": torch.rand(3, HEADS, generator=gen),
            "softmax_scale": DIM**-0.5, "head_scale": HEADS**-0.5, "rope_style": "neox", "rope_position": "first",
            "fmt": "fp8"}


def _check_rope(args, result):
    q_quant, q_scale, weights = result
    tokens, heads, dim = args["q"].shape
    _expect(weights, (tokens, heads), torch.float32)
    if args["fmt"] == "fp8":
        _expect(q_quant, (tokens, heads, dim), torch.float8_e4m3fn)
        assert q_scale is None
    else:
        _expect(q_quant, (tokens, heads, dim // 2), torch.uint8)
        _expect(q_scale, (tokens, heads, mxfp4_scale_bytes(dim)), torch.uint8)


def _fp8_cache(num_blocks=4) -> IndexerKCache:
    cache = IndexerKCache(num_blocks, block_size=BLOCK, head_dim=DIM)
    cache.insert(torch.randn(num_blocks * BLOCK, DIM, generator=torch.Generator().manual_seed(2)),
                 torch.arange(num_blocks * BLOCK))
    return cache


def _whole_cache(cache: IndexerKCache):
    """Every slot's stored (values, scales), in slot order."""
    table = torch.arange(cache.num_blocks, dtype=torch.int32).view(1, -1)
    return cache.gather(table, torch.tensor([0, cache.num_slots], dtype=torch.int32), backend="reference")


def _insert_args():
    return {"cache": _fp8_cache(), "k": _x(4, seed=3).bfloat16(), "slot_mapping": torch.tensor([5, -1, 63, 16]),
            "scale_fmt": "ue8m0", "amax_floor": 1e-4}


def _check_insert(args, result):
    cache, k, slots = args["cache"], args["k"], args["slot_mapping"].tolist()
    values, scales = _whole_cache(cache)
    last_row = {slot: row for row, slot in enumerate(slots) if slot >= 0}
    for slot, row in last_row.items():
        expected_values, expected_scale = dsa.quantize_fp8(k[row : row + 1].float(), block_size=DIM,
                                                           scale_fmt=args["scale_fmt"], amax_floor=args["amax_floor"])
        assert torch.equal(_bytes(values[slot : slot + 1]), _bytes(expected_values)), slot
        assert torch.equal(scales[slot : slot + 1], expected_scale.view(-1)), slot


def _gather_args():
    cache = _fp8_cache()
    return {"cache": cache, "block_table": torch.tensor([[2, 0], [3, 1]], dtype=torch.int32),
            "cu_seq_lens": torch.tensor([0, 5, 22], dtype=torch.int32), "num_tokens": None,
            "out": (torch.full((24, DIM), 1.0).to(torch.float8_e4m3fn), torch.full((24,), -777.0))}


def _check_gather(args, result):
    cache, table, cu = args["cache"], args["block_table"], args["cu_seq_lens"].tolist()
    values, scales = result
    stored_values, stored_scales = _whole_cache(cache)
    for b in range(table.shape[0]):
        for p in range(cu[b + 1] - cu[b]):
            slot = int(table[b, p // BLOCK]) * BLOCK + p % BLOCK
            assert torch.equal(_bytes(values[cu[b] + p]), _bytes(stored_values[slot])) and scales[cu[b] + p] == stored_scales[slot]


def _out_pair(value):
    return st.sampled_from([(value[0].float(), value[1]), (value[0][:3], value[1][:3]), (value[0],), value[0], None,
                            (value[0], value[1].double()), (value[0][:, :-1], value[1])])


KEY_CASES = {
    "rope_quant_q": Case(
        build=_rope_args,
        call=lambda a: dsa.rope_quant_q(a["q"], a["positions"], a["cos_sin"], a["weights"], a["softmax_scale"],
                                        a["head_scale"], rope_style=a["rope_style"], rope_position=a["rope_position"],
                                        fmt=a["fmt"], backend="reference"),
        corruptions={"q": float_values, "positions": index_values, "cos_sin": float_values, "weights": float_values,
                     "softmax_scale": lambda v: REALS, "head_scale": lambda v: REALS, "rope_style": lambda v: STRINGS,
                     "rope_position": lambda v: STRINGS, "fmt": lambda v: STRINGS},
        params=_params(dsa.rope_quant_q), check=_check_rope,
    ),
    "insert": Case(
        build=_insert_args,
        call=lambda a: insert_k(a["k"], a["cache"], a["slot_mapping"], scale_fmt=a["scale_fmt"],
                                amax_floor=a["amax_floor"], backend="reference"),
        corruptions={"k": float_values, "slot_mapping": index_values, "scale_fmt": lambda v: STRINGS,
                     "amax_floor": lambda v: REALS},
        params=_params(insert_k), state=lambda a: [a["cache"].buffer], check=_check_insert,
    ),
    "gather": Case(
        build=_gather_args,
        call=lambda a: a["cache"].gather(a["block_table"], a["cu_seq_lens"], num_tokens=a["num_tokens"], out=a["out"],
                                         backend="reference"),
        corruptions={"block_table": index_values, "cu_seq_lens": index_values, "num_tokens": lambda v: INTS,
                     "out": _out_pair},
        params=_params(gather_k),
        state=lambda a: [a["cache"].buffer, *(a["out"] if isinstance(a["out"], tuple) else [a["out"]])],
        check=_check_gather,
    ),
}


# ------------------------------------------------------------------------------------------------- logits

def _mqa_args():
    gen = torch.Generator().manual_seed(4)
    q = dsa.quantize_fp8(torch.randn(3, HEADS, DIM, generator=gen), block_size=DIM, amax_floor=1e-10)[0]
    k, k_scale = dsa.quantize_fp8(torch.randn(10, DIM, generator=gen), block_size=DIM)
    return {"q": q, "q_scale": None, "k": k, "k_scale": k_scale.view(-1), "weights": torch.rand(3, HEADS, generator=gen),
            "ks": torch.tensor([0, 2, 10], dtype=torch.int32), "ke": torch.tensor([10, 7, 10], dtype=torch.int32),
            "clean": True, "out": torch.full((3, 10), float(POISON))}


def _check_windows(logits: torch.Tensor, lower: list[int], upper: list[int]) -> None:
    """``clean=True``: every entry outside a row's window is ``-inf`` (inside, NaN weights may give NaN)."""
    for row, (start, end) in enumerate(zip(lower, upper)):
        outside = torch.ones(logits.shape[1], dtype=torch.bool)
        outside[start:end] = False
        assert bool((logits[row, outside] == -math.inf).all()), row


def _check_mqa(args, result):
    rows, num_keys = args["q"].shape[0], args["k"].shape[0]
    _expect(result, (rows, num_keys), torch.float32)
    if args["clean"] is True:
        _check_windows(result, args["ks"].tolist(), args["ke"].tolist())


def _paged_args():
    gen = torch.Generator().manual_seed(5)
    q = dsa.quantize_fp8(torch.randn(2, 2, HEADS, DIM, generator=gen), block_size=DIM, amax_floor=1e-10)[0]
    return {"q": q, "q_scale": None, "cache": _fp8_cache(), "weights": torch.rand(4, HEADS, generator=gen),
            "context_lens": torch.tensor([20, 9], dtype=torch.int32),
            "block_table": torch.tensor([[2, 0, -1], [3, -1, -1]], dtype=torch.int32), "max_context_len": 24,
            "clean": True, "out": torch.full((4, 24), float(POISON))}


def _check_paged(args, result):
    batch, next_n = args["q"].shape[:2]
    _expect(result, (batch * next_n, args["max_context_len"]), torch.float32)
    lens = args["context_lens"]
    if args["clean"] is True:
        if lens.dim() == 1:
            visible = [max(int(lens[b]) - next_n + t + 1, 0) for b in range(batch) for t in range(next_n)]
        else:
            visible = lens.reshape(-1).tolist()
        _check_windows(result, [0] * len(visible), visible)


def _optional_scale(value):
    return st.sampled_from([torch.zeros(3, HEADS, 2, dtype=torch.uint8), torch.zeros(2, 2, HEADS, 2, dtype=torch.uint8),
                            torch.zeros(1)])


def _other_cache(value):
    return st.sampled_from([IndexerKCache(4, block_size=BLOCK, head_dim=DIM, fmt="mxfp4"),
                            IndexerKCache(4, block_size=BLOCK, head_dim=2 * DIM), IndexerKCache(1, block_size=BLOCK,
                                                                                                  head_dim=DIM),
                            value.buffer, None])


LOGITS_CASES = {
    "mqa_logits": Case(
        build=_mqa_args,
        call=lambda a: dsa.mqa_logits(a["q"], a["q_scale"], a["k"], a["k_scale"], a["weights"], a["ks"], a["ke"],
                                      clean=a["clean"], out=a["out"], backend="reference"),
        corruptions={"q": quantised_values, "q_scale": _optional_scale, "k": quantised_values, "k_scale": float_values,
                     "weights": float_values, "ks": index_values, "ke": index_values, "clean": lambda v: BOOLS,
                     "out": float_values},
        params=_params(dsa.mqa_logits), state=lambda a: [a["out"]], check=_check_mqa,
    ),
    "paged_mqa_logits": Case(
        build=_paged_args,
        call=lambda a: dsa.paged_mqa_logits(a["q"], a["q_scale"], a["cache"], a["weights"], a["context_lens"],
                                            a["block_table"], a["max_context_len"], clean=a["clean"], out=a["out"],
                                            backend="reference"),
        corruptions={"q": quantised_values, "q_scale": _optional_scale, "cache": _other_cache, "weights": float_values,
                     "context_lens": index_values, "block_table": index_values, "max_context_len": lambda v: INTS,
                     "clean": lambda v: BOOLS, "out": float_values},
        params=_params(dsa.paged_mqa_logits),
        state=lambda a: [a["out"], getattr(a["cache"], "buffer", None)], check=_check_paged,
    ),
}


# -------------------------------------------------------------------------------------------------- top-k

def _logits(rows, width, seed):
    return torch.randint(-3, 4, (rows, width), generator=torch.Generator().manual_seed(seed)).float()


def _decode_ends(seq_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    if seq_lens.dim() == 2:
        return seq_lens.reshape(-1)
    return torch.tensor([max(int(length) - next_n + t + 1, 0) for length in seq_lens.tolist() for t in range(next_n)])


def _check_topk(args, result):
    _expect(result, (args["logits"].shape[0], args["k"]), torch.int32)
    assert_topk_exact(args["logits"], result, args["k"], starts=args["starts"], ends=args["ends"])


def _check_topk_decode(args, result):
    _expect(result, (args["logits"].shape[0], args["k"]), torch.int32)
    assert_topk_exact(args["logits"], result, args["k"], ends=_decode_ends(args["seq_lens"], args["next_n"]))


def _slots_oracle(indices: torch.Tensor, block_table: torch.Tensor, block_size: int, requests: list[int]) -> list:
    """Position ``p`` of row ``r``: its page's slot, or -1 for padding and for an unallocated (negative) page."""
    expected = []
    for row, request in zip(indices.tolist(), requests):
        slots = []
        for p in row:
            page = int(block_table[request, p // block_size]) if p >= 0 else -1
            slots.append(page * block_size + p % block_size if page >= 0 else -1)
        expected.append(slots)
    return expected


def _check_decode_slots(args, result):
    _expect(result, (args["logits"].shape[0], args["k"]), torch.int32)
    indices = dsa.topk_decode(args["logits"], args["seq_lens"], args["next_n"], args["k"], backend="reference")
    assert_topk_exact(args["logits"], indices, args["k"], ends=_decode_ends(args["seq_lens"], args["next_n"]))
    requests = [row // args["next_n"] for row in range(indices.shape[0])]
    assert result.tolist() == _slots_oracle(indices, args["block_table"], args["block_size"], requests)


def _check_indices_to_slots(args, result):
    _expect(result, tuple(args["indices"].shape), torch.int32)
    requests = args["row_to_request"].tolist()
    assert result.tolist() == _slots_oracle(args["indices"], args["block_table"], args["block_size"], requests)


def _topk_args():
    return {"logits": _logits(3, 8, 0), "k": 4, "starts": torch.tensor([0, 2, 5], dtype=torch.int32),
            "ends": torch.tensor([8, 6, 5], dtype=torch.int32), "out": torch.full((3, 4), POISON, dtype=torch.int32)}


def _decode_args():
    return {"logits": _logits(4, 12, 1), "seq_lens": torch.tensor([5, 12], dtype=torch.int32), "next_n": 2, "k": 3,
            "out": torch.full((4, 3), POISON, dtype=torch.int32)}


def _decode_slot_args():
    return {**_decode_args(), "block_table": torch.tensor([[3, 4, -1], [1, 0, 2]], dtype=torch.int32), "block_size": 4}


TOPK_CASES = {
    "topk": Case(
        build=_topk_args,
        call=lambda a: dsa.topk(a["logits"], a["k"], starts=a["starts"], ends=a["ends"], out=a["out"],
                                backend="reference"),
        corruptions={"logits": float_values, "k": lambda v: INTS, "starts": index_values, "ends": index_values,
                     "out": index_values},
        params=_params(dsa.topk), state=lambda a: [a["out"]], check=_check_topk,
    ),
    "topk_decode": Case(
        build=_decode_args,
        call=lambda a: dsa.topk_decode(a["logits"], a["seq_lens"], a["next_n"], a["k"], out=a["out"],
                                       backend="reference"),
        corruptions={"logits": float_values, "seq_lens": index_values, "next_n": lambda v: INTS, "k": lambda v: INTS,
                     "out": index_values},
        params=_params(dsa.topk_decode), state=lambda a: [a["out"]], check=_check_topk_decode,
    ),
    "topk_decode_slots": Case(
        build=_decode_slot_args,
        call=lambda a: dsa.topk_decode_slots(a["logits"], a["seq_lens"], a["next_n"], a["k"], a["block_table"],
                                             a["block_size"], out=a["out"], backend="reference"),
        corruptions={"logits": float_values, "seq_lens": index_values, "next_n": lambda v: INTS, "k": lambda v: INTS,
                     "block_table": index_values, "block_size": lambda v: INTS, "out": index_values},
        params=_params(dsa.topk_decode_slots), state=lambda a: [a["out"]], check=_check_decode_slots,
    ),
    "indices_to_slots": Case(
        build=lambda: {"indices": torch.tensor([[0, 5, -1], [7, -1, -1], [3, 4, 11]], dtype=torch.int32),
                       "block_table": torch.tensor([[2, 0, 5], [3, 1, -1]], dtype=torch.int32), "block_size": 4,
                       "row_to_request": torch.tensor([0, 1, 0], dtype=torch.int32)},
        call=lambda a: dsa.indices_to_slots(a["indices"], a["block_table"], a["block_size"], a["row_to_request"],
                                            backend="reference"),
        corruptions={"indices": index_values, "block_table": index_values, "block_size": lambda v: INTS,
                     "row_to_request": index_values},
        params=_params(dsa.indices_to_slots), check=_check_indices_to_slots,
    ),
}


# ---------------------------------------------------------------------------------- padding and candidates

def _lengths_are_the_callers_duty(lengths: list[int], limit: int, rows: int) -> bool:
    """With the sizes given the ops read no lengths on the host (capturable): lengths outside ``[0, limit]`` or
    summing past ``rows`` are the caller's duty, and only the shapes are promised (nothing is touched outside
    the tensors)."""
    return min(lengths, default=0) < 0 or max(lengths, default=0) > limit or sum(lengths) > rows


def _check_pack(args, result):
    lengths = args["lengths"].tolist()
    x = args["x"]
    max_len = args["max_len"] if args["max_len"] is not None else max(lengths, default=0)
    _expect(result, (len(lengths), max_len, *x.shape[1:]), x.dtype)
    if _lengths_are_the_callers_duty(lengths, max_len, x.shape[0]):
        return
    start = 0
    for b, length in enumerate(lengths):
        padding = torch.full(result[b, length:].shape, -1.0).to(x.dtype)
        assert torch.equal(_bytes(result[b, :length]), _bytes(x[start : start + length]))
        assert torch.equal(_bytes(result[b, length:]), _bytes(padding))
        start += length


def _check_unpack(args, result):
    packed, lengths = args["packed"], args["lengths"].tolist()
    _expect(result, tuple(args["out"].shape), packed.dtype)
    if _lengths_are_the_callers_duty(lengths, packed.shape[1], result.shape[0]):
        return
    rows = torch.cat([packed[b, :length] for b, length in enumerate(lengths)])
    assert torch.equal(_bytes(result[: len(rows)]), _bytes(rows))


def _check_candidates(args, result):
    logits, starts, ends, repeat = args["logits"], args["starts"], args["ends"], args["row_repeat"]
    _expect(result, (logits.shape[0], args["num_blocks_k"]), torch.int32)
    for row, ids in enumerate(result.tolist()):
        start = 0 if starts is None else int(starts[row // repeat])
        blocks = -(-(int(ends[row // repeat]) - start) // args["block_size"])
        chosen = [i for i in ids if i != -1]
        assert ids == chosen + [-1] * (len(ids) - len(chosen)) and chosen == sorted(set(chosen)), ids
        assert all(0 <= i < blocks for i in chosen), (row, ids)
        if not bool(torch.isinf(logits).any()):  # the pinned newest block yields only to +inf blocks
            assert blocks == 0 or blocks - 1 in chosen, (row, ids)


def _mask_args():
    return {"logits": _logits(4, 10, 3), "starts": torch.tensor([0, 3], dtype=torch.int32),
            "ends": torch.tensor([9, 10], dtype=torch.int32),
            "candidate_blocks": torch.tensor([[0, 3], [-1, 1], [2, 9], [0, 0]], dtype=torch.int32), "block_size": 2,
            "row_repeat": 2}


def _check_mask(args, result):
    logits, starts, ends, repeat, size = args["logits"], args["starts"], args["ends"], args["row_repeat"], args["block_size"]
    original = _logits(4, 10, 3)
    for row in range(logits.shape[0]):
        start = 0 if starts is None else int(starts[row // repeat])
        listed = {int(b) for b in args["candidate_blocks"][row] if b >= 0}
        for column in range(logits.shape[1]):
            keep = start <= column < int(ends[row // repeat]) and (column - start) // size in listed
            assert logits[row, column] == (original[row, column] if keep else -math.inf), (row, column)


SEQ_CASES = {
    "pack_seq": Case(
        build=lambda: {"x": torch.arange(6.0), "lengths": torch.tensor([2, 0, 4], dtype=torch.int32), "max_len": 5},
        call=lambda a: dsa.pack_seq(a["x"], a["lengths"], pad_value=-1.0, max_len=a["max_len"], backend="reference"),
        corruptions={"x": float_values, "lengths": index_values, "max_len": lambda v: INTS},
        params=_params(dsa.pack_seq), check=_check_pack,
    ),
    "unpack_seq": Case(
        build=lambda: {"packed": torch.arange(12.0).view(3, 4), "lengths": torch.tensor([2, 0, 4], dtype=torch.int32),
                       "out": torch.full((7,), float(POISON))},
        call=lambda a: dsa.unpack_seq(a["packed"], a["lengths"], out=a["out"], backend="reference"),
        corruptions={"packed": float_values, "lengths": index_values, "out": float_values},
        params=_params(dsa.unpack_seq), state=lambda a: [a["out"]], check=_check_unpack,
    ),
    "select_candidate_blocks": Case(
        build=lambda: {"logits": _logits(4, 10, 2), "starts": torch.tensor([0, 3], dtype=torch.int32),
                       "ends": torch.tensor([9, 10], dtype=torch.int32), "num_blocks_k": 2, "block_size": 2,
                       "row_repeat": 2, "out": torch.full((4, 2), POISON, dtype=torch.int32)},
        call=lambda a: dsa.select_candidate_blocks(a["logits"], a["starts"], a["ends"], a["num_blocks_k"], a["block_size"],
                                                   row_repeat=a["row_repeat"], out=a["out"], backend="reference"),
        corruptions={"logits": float_values, "starts": index_values, "ends": index_values,
                     "num_blocks_k": lambda v: INTS, "block_size": lambda v: INTS, "row_repeat": lambda v: INTS,
                     "out": index_values},
        params=_params(dsa.select_candidate_blocks), state=lambda a: [a["out"]], check=_check_candidates,
    ),
    "apply_candidate_mask": Case(
        build=_mask_args,
        call=lambda a: dsa.apply_candidate_mask(a["logits"], a["starts"], a["ends"], a["candidate_blocks"],
                                                a["block_size"], row_repeat=a["row_repeat"], backend="reference"),
        corruptions={"starts": index_values, "ends": index_values, "candidate_blocks": index_values,
                     "block_size": lambda v: INTS, "row_repeat": lambda v: INTS},
        params=_params(dsa.apply_candidate_mask), state=lambda a: [a["logits"]], check=_check_mask,
    ),
}


# ------------------------------------------------------------------------------------------ sparse logits

SPARSE_BLOCK = 4


def _sparse_rows_oracle(dense: torch.Tensor, lengths: list[int], blocks: torch.Tensor) -> torch.Tensor:
    """Column ``j * bs + o`` of row ``r``: the dense logit at position ``blocks[r, j] * bs + o`` when the entry
    is live (``>= 0`` and above the entry before it) and the position below the row's length, else ``-inf``."""
    out = torch.full((blocks.shape[0], blocks.shape[1] * SPARSE_BLOCK), -math.inf)
    for r, row in enumerate(blocks.tolist()):
        previous = -1
        for j, b in enumerate(row):
            if b >= 0 and b > previous:
                for o in range(SPARSE_BLOCK):
                    if b * SPARSE_BLOCK + o < lengths[r]:
                        out[r, j * SPARSE_BLOCK + o] = dense[r, b * SPARSE_BLOCK + o]
            previous = max(previous, b)
    return out


def _sparse_mqa_args():
    args = _mqa_args()
    del args["clean"]
    args["ks"] = torch.tensor([0, 0, 0], dtype=torch.int32)
    args["blocks"] = torch.tensor([[0, 2, -1], [1, 1, 1], [-1, -1, -1]], dtype=torch.int32)
    args["block_size"] = SPARSE_BLOCK
    args["out"] = torch.full((3, 3 * SPARSE_BLOCK), float(POISON))
    return args


def _check_sparse_mqa(args, result):
    blocks = args["blocks"]
    _expect(result, (blocks.shape[0], blocks.shape[1] * args["block_size"]), torch.float32)
    dense = dsa.mqa_logits(args["q"], args["q_scale"], args["k"], args["k_scale"], args["weights"], args["ks"],
                           args["ke"], backend="reference")
    lengths = (args["ke"] - args["ks"]).tolist()
    starts = args["ks"].tolist()
    shifted = torch.stack([torch.roll(dense[r], -starts[r]) for r in range(dense.shape[0])])
    assert torch.equal(result, _sparse_rows_oracle(shifted, lengths, blocks))


def _sparse_paged_args():
    args = _paged_args()
    del args["clean"], args["max_context_len"]
    args["blocks"] = torch.tensor([[0, 3, 4], [4, -1, -1], [1, 2, 2], [-1, -1, -1]], dtype=torch.int32)
    args["block_size"] = SPARSE_BLOCK
    args["out"] = torch.full((4, 3 * SPARSE_BLOCK), float(POISON))
    return args


def _check_sparse_paged(args, result):
    blocks = args["blocks"]
    _expect(result, (blocks.shape[0], blocks.shape[1] * args["block_size"]), torch.float32)
    width = int(args["context_lens"].max())
    dense = dsa.paged_mqa_logits(args["q"], args["q_scale"], args["cache"], args["weights"], args["context_lens"],
                                 args["block_table"], width, backend="reference")
    next_n = args["q"].shape[1]
    lengths = _decode_ends(args["context_lens"], next_n).tolist()
    padded = torch.full((dense.shape[0], blocks.shape[1] * SPARSE_BLOCK + 64), -math.inf)
    padded[:, :width] = dense
    assert torch.equal(result, _sparse_rows_oracle(padded, lengths, blocks))


def _topk_sparse_args():
    logits = _logits(3, 12, 2)
    blocks = torch.tensor([[0, 2, 5], [1, 1, -1], [3, -1, -1]], dtype=torch.int32)
    live = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0]], dtype=torch.bool).repeat_interleave(SPARSE_BLOCK, dim=1)
    return {"logits": logits.masked_fill(~live, -math.inf), "blocks": blocks, "block_size": SPARSE_BLOCK, "k": 5,
            "out": torch.full((3, 5), POISON, dtype=torch.int32)}


def _check_topk_sparse(args, result):
    """Each pick is -1 or a position of a listed block, and the picks are the §5 top-k of the columns mapped
    to positions (the columns of a -1 entry give -1)."""
    logits, blocks, bs, k = args["logits"], args["blocks"], args["block_size"], args["k"]
    _expect(result, (logits.shape[0], k), torch.int32)
    columns = dsa.topk(logits, k, backend="reference").long()
    ids = blocks.long().gather(1, columns.clamp(min=0) // bs)
    expected = torch.where((columns >= 0) & (ids >= 0), ids * bs + columns.clamp(min=0) % bs, -1)
    assert torch.equal(result, expected.to(torch.int32))


SPARSE_CASES = {
    "sparse_mqa_logits": Case(
        build=_sparse_mqa_args,
        call=lambda a: dsa.sparse_mqa_logits(a["q"], a["q_scale"], a["k"], a["k_scale"], a["weights"], a["ks"], a["ke"],
                                             a["blocks"], a["block_size"], out=a["out"], backend="reference"),
        corruptions={"q": quantised_values, "q_scale": _optional_scale, "k": quantised_values, "k_scale": float_values,
                     "weights": float_values, "ks": index_values, "ke": index_values, "blocks": index_values,
                     "block_size": lambda v: INTS, "out": float_values},
        params=_params(dsa.sparse_mqa_logits), state=lambda a: [a["out"]], check=_check_sparse_mqa,
    ),
    "sparse_paged_mqa_logits": Case(
        build=_sparse_paged_args,
        call=lambda a: dsa.sparse_paged_mqa_logits(a["q"], a["q_scale"], a["cache"], a["weights"], a["context_lens"],
                                                   a["block_table"], a["blocks"], a["block_size"], out=a["out"],
                                                   backend="reference"),
        corruptions={"q": quantised_values, "q_scale": _optional_scale, "cache": _other_cache, "weights": float_values,
                     "context_lens": index_values, "block_table": index_values, "blocks": index_values,
                     "block_size": lambda v: INTS, "out": float_values},
        params=_params(dsa.sparse_paged_mqa_logits),
        state=lambda a: [a["out"], getattr(a["cache"], "buffer", None)], check=_check_sparse_paged,
    ),
    "topk_sparse": Case(
        build=_topk_sparse_args,
        call=lambda a: dsa.topk_sparse(a["logits"], a["blocks"], a["block_size"], a["k"], out=a["out"],
                                       backend="reference"),
        corruptions={"logits": float_values, "blocks": index_values, "block_size": lambda v: INTS,
                     "k": lambda v: INTS, "out": index_values},
        params=_params(dsa.topk_sparse), state=lambda a: [a["out"]], check=_check_topk_sparse,
    ),
}


OP_CASES = {**FORMAT_CASES, **KEY_CASES, **LOGITS_CASES, **TOPK_CASES, **SEQ_CASES, **SPARSE_CASES}


@pytest.mark.parametrize("name", sorted(OP_CASES))
@PROPERTY_SETTINGS
@given(data=st.data())
def test_bad_input_to_an_op_is_refused_cleanly_or_obeys_the_contract(name, data):
    run_generated_call(OP_CASES[name], data)


# ------------------------------------------------------------------------------- planner, layer, the cache

SEQ_LENS, QUERY_LENS = [20, 12], [1, 12]  # a decode (20 keys) before a 12-token prefill


def _check_plan(args, meta):
    """Every token is planned once; decode rows read the request's own pages for every key they see; each new
    token's slot is its completed key's page slot (or -1)."""
    seq_lens, query_lens = [int(s) for s in args["seq_lens"]], [int(q) for q in args["query_lens"]]
    table, block_size = args["block_table"], args.get("block_size", BLOCK)
    ratio = args.get("compress_ratio", 1)
    assert meta.num_tokens == sum(query_lens)
    if meta.decode is not None:
        for row in range(meta.decode.batch_size):
            visible = int(meta.decode.context_lens[row].max())
            pages = -(-visible // block_size)
            assert meta.decode.block_table[row, :pages].tolist() == table[row, :pages].tolist(), row
    slots = []
    for r, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        for p in range(seq_len - query_len, seq_len):
            key = (p + 1) // ratio - 1
            slots.append(int(table[r, key // block_size]) * block_size + key % block_size if (p + 1) % ratio == 0 else -1)
    assert meta.slot_mapping.tolist() == slots


def _plan_args():
    return {"seq_lens": list(SEQ_LENS), "query_lens": list(QUERY_LENS),
            "block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), "block_size": BLOCK, "num_spec_tokens": 0,
            "compress_ratio": 1, "workspace_tokens": None, "decode_layout": "native", "num_cache_blocks": 8}


def _builder() -> MetadataBuilder:
    return MetadataBuilder(max_decode_requests=2, max_next_n=2, max_blocks_per_request=2, block_size=BLOCK,
                           num_cache_blocks=8)


def _build_args():
    return {"builder": _builder(), "seq_lens": list(SEQ_LENS), "query_lens": list(QUERY_LENS),
            "block_table": torch.tensor([[0, 1, 4], [2, 3, 5]], dtype=torch.int32)}


def _builder_state(args) -> list:
    builder = args["builder"]
    return [builder._context_lens, builder._global_context_lens, builder._decode_lens, builder._row_to_request,
            builder._block_table, builder._slots]


PLANNER_CASES = {
    "build_metadata": Case(
        build=_plan_args,
        call=lambda a: dsa.build_metadata(a["seq_lens"], a["query_lens"], a["block_table"], block_size=a["block_size"],
                                          num_spec_tokens=a["num_spec_tokens"], compress_ratio=a["compress_ratio"],
                                          workspace_tokens=a["workspace_tokens"], decode_layout=a["decode_layout"],
                                          num_cache_blocks=a["num_cache_blocks"]),
        corruptions={"seq_lens": lambda v: LENGTH_LISTS, "query_lens": lambda v: LENGTH_LISTS,
                     "block_table": index_values, "block_size": lambda v: INTS, "num_spec_tokens": lambda v: INTS,
                     "compress_ratio": lambda v: INTS, "workspace_tokens": lambda v: INTS,
                     "decode_layout": lambda v: STRINGS, "num_cache_blocks": lambda v: INTS},
        params=_params(dsa.build_metadata), check=_check_plan,
    ),
    "MetadataBuilder.build": Case(
        build=_build_args,
        call=lambda a: a["builder"].build(a["seq_lens"], a["query_lens"], a["block_table"]),
        corruptions={"seq_lens": lambda v: LENGTH_LISTS, "query_lens": lambda v: LENGTH_LISTS,
                     "block_table": index_values},
        params=_params(MetadataBuilder.__init__, MetadataBuilder.build), state=_builder_state, check=_check_plan,
    ),
}


def test_every_public_function_has_a_case():
    functions = {name for name in dsa.__all__ if inspect.isfunction(getattr(dsa, name))}
    assert functions <= set(OP_CASES) | set(PLANNER_CASES), functions - set(OP_CASES) - set(PLANNER_CASES)


@pytest.mark.parametrize("name", sorted(PLANNER_CASES))
@PROPERTY_SETTINGS
@given(data=st.data())
def test_bad_batches_are_refused_before_planning_or_planned_right(name, data):
    run_generated_call(PLANNER_CASES[name], data)


def _layer_args():
    cache = IndexerKCache(8, block_size=BLOCK, head_dim=DIM)
    buffer = torch.full((16, 8), POISON, dtype=torch.int32)
    layer = dsa.SparseAttnIndexer(cache, 8, buffer, workspace_tokens=64, backend="reference")
    meta = dsa.build_metadata(SEQ_LENS, QUERY_LENS, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), block_size=BLOCK)
    gen = torch.Generator().manual_seed(6)
    tokens = sum(QUERY_LENS)
    q = dsa.quantize_fp8(torch.randn(tokens, HEADS, DIM, generator=gen), block_size=DIM, amax_floor=1e-10)[0]
    return {"layer": layer, "q_quant": q, "q_scale": None, "k": torch.randn(tokens, DIM, generator=gen).bfloat16(),
            "weights": torch.rand(tokens, HEADS, generator=gen), "metadata": meta}


def _other_metadata(value):
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return st.sampled_from([
        dsa.build_metadata(SEQ_LENS, QUERY_LENS, table, block_size=BLOCK, compress_ratio=2),
        dsa.build_metadata(SEQ_LENS, QUERY_LENS, table, block_size=BLOCK, dcp_world_size=2),
        dsa.build_metadata([20, 30], [1, 30], torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), block_size=BLOCK),
        dsa.build_metadata([20, 12, 5], [1, 12, 5], torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32),
                           block_size=BLOCK),
        None, "metadata",
    ])


def _check_layer(args, result):
    """Rows of the step's tokens hold ascending request-local positions each token may see, then -1; the rows
    past the step keep their poison."""
    buffer, meta = args["layer"].topk_indices_buffer, args["metadata"]
    seen = [SEQ_LENS[0]] + list(range(1, QUERY_LENS[1] + 1))
    assert meta.num_tokens == len(seen)
    for token, visible in enumerate(seen):
        row = [i for i in buffer[token].tolist() if i != -1]
        assert buffer[token].tolist() == row + [-1] * (8 - len(row)) and row == sorted(set(row)), token
        assert all(0 <= i < visible for i in row) and len(row) <= min(8, visible), token
    assert bool((buffer[len(seen):] == POISON).all())


LAYER_CASE = Case(
    build=_layer_args,
    call=lambda a: a["layer"](a["q_quant"], a["q_scale"], a["k"], a["weights"], a["metadata"]),
    corruptions={"q_quant": quantised_values, "q_scale": _optional_scale, "k": float_values, "weights": float_values,
                 "metadata": _other_metadata},
    params=_params(dsa.SparseAttnIndexer.__init__, dsa.SparseAttnIndexer.forward),
    state=lambda a: [a["layer"].cache.buffer, a["layer"].topk_indices_buffer],
    check=_check_layer,
)


@PROPERTY_SETTINGS
@given(data=st.data())
def test_bad_layer_calls_write_nothing_or_obey_the_contract(data):
    run_generated_call(LAYER_CASE, data)


def _check_slots_for(args, result):
    row, positions = args["block_table_row"], args["positions"]
    expected = []
    for p in positions.tolist():
        page = int(row[p // BLOCK]) if p >= 0 else -1
        expected.append(page * BLOCK + p % BLOCK if page >= 0 else -1)
    assert result.tolist() == expected


SLOTS_FOR_CASE = Case(
    build=lambda: {"cache": IndexerKCache(8, block_size=BLOCK, head_dim=DIM),
                   "block_table_row": torch.tensor([3, 5, -1], dtype=torch.int32), "positions": torch.tensor([0, 5, 17, -1])},
    call=lambda a: a["cache"].slots_for(a["block_table_row"], a["positions"]),
    corruptions={"block_table_row": index_values, "positions": index_values},
    params=_params(IndexerKCache.slots_for), check=_check_slots_for,
)


@PROPERTY_SETTINGS
@given(data=st.data())
def test_bad_positions_for_slots_for_are_refused_or_mapped_to_valid_slots(data):
    run_generated_call(SLOTS_FOR_CASE, data)
