"""pack_seq / unpack_seq against Python-loop oracles, compared bit for bit."""

from __future__ import annotations

import pytest
import torch

from dsa_indexer.ops.seq_pack import pack_seq, unpack_seq

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
PAYLOADS = [
    (torch.float32, float("-inf")),
    (torch.bfloat16, float("-inf")),
    (torch.float8_e4m3fn, 0.0),
    (torch.uint8, 0),
]
LENGTHS = [[3, 0, 5], [1], [0, 0], [7, 1, 2, 4], [2, 0, 0, 9, 1]]
TRAILING = [(), (3,), (2, 5)]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(BITS[tensor.element_size()])


def random_payload(shape, dtype, seed: int) -> torch.Tensor:
    """Random bytes, so NaN payloads, -0.0 and subnormals all occur."""
    generator = torch.Generator().manual_seed(seed)
    numel = 1
    for size in shape:
        numel *= size
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def pad_pattern(pad_value, dtype) -> torch.Tensor:
    return bits(torch.tensor([pad_value], dtype=torch.float64 if dtype.is_floating_point else torch.int64).to(dtype))[0]


def pack_oracle(x, lengths, pad_value, max_len):
    x_bits = bits(x)
    expected = pad_pattern(pad_value, x.dtype).expand(len(lengths), max_len, *x.shape[1:]).clone()
    start = 0
    for seq, length in enumerate(lengths):
        for position in range(min(length, max_len)):
            if 0 <= start + position < x.shape[0]:
                expected[seq, position] = x_bits[start + position]
        start += length
    return expected


def unpack_oracle(packed, lengths, before):
    expected = bits(before).clone()
    packed_bits = bits(packed)
    start = 0
    for seq, length in enumerate(lengths):
        for position in range(length):
            if start + position < expected.shape[0]:
                expected[start + position] = packed_bits[seq, position]
        start += length
    return expected


@pytest.mark.parametrize("dtype,pad_value", PAYLOADS)
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("trailing", TRAILING)
def test_pack_matches_loop_oracle_and_unpack_inverts_it(dtype, pad_value, lengths, trailing):
    extra_rows = 2
    x = random_payload((sum(lengths) + extra_rows, *trailing), dtype, seed=len(lengths))
    lengths_tensor = torch.tensor(lengths, dtype=torch.int32)
    packed = pack_seq(x, lengths_tensor, pad_value=pad_value)
    assert packed.shape == (len(lengths), max(lengths), *trailing)
    assert packed.dtype == dtype
    assert torch.equal(bits(packed), pack_oracle(x, lengths, pad_value, max(lengths)))
    unpacked = unpack_seq(packed, lengths_tensor.to(torch.int64))
    assert unpacked.shape == (sum(lengths), *trailing)
    assert torch.equal(bits(unpacked), bits(x[: sum(lengths)]))


@pytest.mark.parametrize("dtype,pad_value", PAYLOADS)
def test_unpack_matches_loop_oracle_and_ignores_padding(dtype, pad_value):
    lengths = [4, 0, 1, 3]
    packed = random_payload((4, 6, 3), dtype, seed=7)
    result = unpack_seq(packed, torch.tensor(lengths))
    assert torch.equal(bits(result), unpack_oracle(packed, lengths, torch.empty((8, 3), dtype=dtype)))


@pytest.mark.parametrize(
    "dtype,pad_value",
    [
        (torch.float32, float("nan")),
        (torch.float32, -0.0),
        (torch.bfloat16, float("inf")),
        (torch.float8_e4m3fn, -448.0),
        (torch.float8_e4m3fn, float("nan")),
        (torch.uint8, 255),
        (torch.int32, -7),
    ],
)
def test_pad_value_is_stored_byte_exact(dtype, pad_value):
    x = random_payload((3, 2), dtype, seed=1)
    packed = pack_seq(x, torch.tensor([1, 2]), pad_value=pad_value, max_len=4)
    expected_pad = pad_pattern(pad_value, dtype)
    assert torch.equal(bits(packed[0, 1:]), expected_pad.expand(3, 2))
    assert torch.equal(bits(packed[1, 2:]), expected_pad.expand(2, 2))
    assert torch.equal(bits(packed[1, :2]), bits(x[1:3]))


def test_pack_out_is_fully_written_and_returned():
    x = random_payload((6, 4), torch.float32, seed=3)
    lengths = [2, 4]
    out = torch.full((2, 5, 4), 777.0)
    result = pack_seq(x, torch.tensor(lengths), pad_value=-1.0, out=out)
    assert result is out
    assert torch.equal(bits(out), pack_oracle(x, lengths, -1.0, 5))


def test_pack_explicit_max_len_longer_than_longest_row_pads():
    x = random_payload((3, 2), torch.bfloat16, seed=4)
    packed = pack_seq(x, torch.tensor([1, 2]), pad_value=float("-inf"), max_len=6)
    assert packed.shape == (2, 6, 2)
    assert torch.equal(bits(packed), pack_oracle(x, [1, 2], float("-inf"), 6))


def test_pack_explicit_max_len_shorter_than_a_row_truncates_it():
    x = random_payload((7, 2), torch.float32, seed=5)
    packed = pack_seq(x, torch.tensor([5, 2]), pad_value=0.0, max_len=3)
    assert torch.equal(bits(packed), pack_oracle(x, [5, 2], 0.0, 3))


def test_pack_with_max_len_never_reads_past_x():
    # Lengths summing past N are the caller's error; sources outside x must read as padding.
    x = random_payload((4, 2), torch.float32, seed=6)
    packed = pack_seq(x, torch.tensor([2, 5]), pad_value=-3.0, max_len=5)
    assert torch.equal(bits(packed), pack_oracle(x, [2, 5], -3.0, 5))


@pytest.mark.parametrize("max_len", [None, 4])
def test_pack_zero_size_batch(max_len):
    x = random_payload((3, 2), torch.float32, seed=8)
    packed = pack_seq(x, torch.zeros(0, dtype=torch.int32), pad_value=0.0, max_len=max_len)
    assert packed.shape == (0, max_len or 0, 2)


def test_pack_all_zero_lengths_gives_zero_width_grid():
    packed = pack_seq(torch.zeros(0, 5, dtype=torch.uint8), torch.zeros(3, dtype=torch.int64), pad_value=9)
    assert packed.shape == (3, 0, 5)


def test_pack_empty_x_with_max_len_is_all_padding():
    packed = pack_seq(torch.zeros(0, 2, dtype=torch.uint8), torch.zeros(2, dtype=torch.int32), pad_value=9, max_len=3)
    assert torch.equal(packed, torch.full((2, 3, 2), 9, dtype=torch.uint8))


def test_pack_and_unpack_accept_strided_views():
    base = random_payload((9, 8), torch.float32, seed=9)
    x = base[::2, 1::3]  # [5, 3], neither dim contiguous
    lengths = torch.tensor([2, 3])
    packed = pack_seq(x, lengths, pad_value=0.5)
    assert torch.equal(bits(packed), pack_oracle(x.contiguous(), [2, 3], 0.5, 3))
    strided_packed = random_payload((3, 2, 6), torch.float32, seed=10).transpose(0, 1)  # [2, 3, 6]
    result = unpack_seq(strided_packed[:, :, ::2], lengths)
    assert torch.equal(bits(result), unpack_oracle(strided_packed[:, :, ::2].contiguous(), [2, 3], torch.empty(5, 3)))


def test_unpack_total_upper_bound_leaves_tail_rows_untouched():
    packed = random_payload((2, 3, 2), torch.float32, seed=11)
    out = torch.full((7, 2), -777.0)
    before = out.clone()
    result = unpack_seq(packed, torch.tensor([1, 3], dtype=torch.int32), out=out)
    assert result is out
    assert torch.equal(bits(out), unpack_oracle(packed, [1, 3], before))
    assert torch.equal(out[4:], before[4:])


def test_unpack_total_without_out_sizes_the_result():
    packed = random_payload((2, 3), torch.uint8, seed=12)
    result = unpack_seq(packed, torch.tensor([2, 1]), total=3)
    assert torch.equal(result, torch.stack([packed[0, 0], packed[0, 1], packed[1, 0]]))


@pytest.mark.parametrize("total", [None, 0])
def test_unpack_zero_size_batch(total):
    result = unpack_seq(torch.zeros(0, 4, 3), torch.zeros(0, dtype=torch.int32), total=total)
    assert result.shape == (0, 3)


def test_unpack_all_zero_lengths_writes_nothing():
    out = torch.full((2, 1), 5, dtype=torch.uint8)
    unpack_seq(torch.zeros(3, 4, 1, dtype=torch.uint8), torch.zeros(3, dtype=torch.int64), out=out)
    assert torch.equal(out, torch.full((2, 1), 5, dtype=torch.uint8))


def _pack_args(**overrides):
    args = {
        "x": torch.arange(12, dtype=torch.float32).view(6, 2),
        "lengths": torch.tensor([2, 3], dtype=torch.int32),
        "pad_value": 0.0,
        "max_len": None,
        "out": torch.full((2, 3, 2), -777.0),
        "backend": "auto",
    }
    args.update(overrides)
    return args


PACK_ERRORS = [
    ({"x": [[1.0]]}, TypeError, "x"),
    ({"x": torch.zeros(6, 2, dtype=torch.bool), "out": None, "pad_value": 0}, TypeError, "x"),
    ({"x": torch.tensor(1.0), "out": None}, ValueError, "x"),
    ({"lengths": torch.tensor([2.0, 3.0])}, TypeError, "lengths"),
    ({"lengths": torch.tensor([[2, 3]])}, ValueError, "lengths"),
    ({"lengths": torch.tensor([2, 3], device="meta")}, ValueError, "lengths"),
    ({"pad_value": "0"}, TypeError, "pad_value"),
    ({"pad_value": True}, TypeError, "pad_value"),
    ({"pad_value": 0.1, "x": torch.zeros(6, 2, dtype=torch.bfloat16), "out": None}, ValueError, "pad_value"),
    ({"pad_value": 1e40}, ValueError, "pad_value"),
    ({"pad_value": 10**400}, ValueError, "pad_value"),
    ({"pad_value": float("-inf"), "x": torch.zeros(6, 2, dtype=torch.float8_e4m3fn), "out": None}, ValueError,
     "pad_value"),
    ({"pad_value": 1000.0, "x": torch.zeros(6, 2, dtype=torch.float8_e4m3fn), "out": None}, ValueError, "pad_value"),
    ({"pad_value": 256, "x": torch.zeros(6, 2, dtype=torch.uint8), "out": None}, ValueError, "pad_value"),
    ({"pad_value": -1, "x": torch.zeros(6, 2, dtype=torch.uint8), "out": None}, ValueError, "pad_value"),
    ({"pad_value": 1.0, "x": torch.zeros(6, 2, dtype=torch.uint8), "out": None}, TypeError, "pad_value"),
    ({"max_len": -1, "out": None}, ValueError, "max_len"),
    ({"max_len": 2.0, "out": None}, TypeError, "max_len"),
    ({"out": torch.zeros(2, 3, 2, dtype=torch.float64)}, TypeError, "out"),
    ({"out": torch.zeros(2, 3, 3)}, ValueError, "out"),
    ({"max_len": 4}, ValueError, "out"),
    ({"out": torch.zeros(2, 3, 2, device="meta")}, ValueError, "out"),
    ({"lengths": torch.tensor([2, -1]), "out": None}, ValueError, "lengths"),
    ({"lengths": torch.tensor([4, 3]), "out": None}, ValueError, "lengths"),
    ({"backend": "cuda"}, ValueError, "backend"),
]


@pytest.mark.parametrize("overrides,error,name", PACK_ERRORS)
def test_pack_rejects_bad_arguments_without_writing(overrides, error, name):
    args = _pack_args(**overrides)
    out = args["out"]
    before = out.clone() if isinstance(out, torch.Tensor) and out.device.type == "cpu" else None
    with pytest.raises(error, match=name):
        pack_seq(args.pop("x"), args.pop("lengths"), **args)
    if before is not None:
        assert torch.equal(bits(out), bits(before))


def _unpack_args(**overrides):
    args = {
        "packed": torch.arange(12, dtype=torch.float32).view(2, 3, 2),
        "lengths": torch.tensor([2, 3], dtype=torch.int64),
        "total": None,
        "out": torch.full((5, 2), -777.0),
        "backend": "auto",
    }
    args.update(overrides)
    return args


UNPACK_ERRORS = [
    ({"packed": "packed"}, TypeError, "packed"),
    ({"packed": torch.zeros(6, dtype=torch.float32), "out": None}, ValueError, "packed"),
    ({"packed": torch.zeros(2, 3, 2, dtype=torch.complex64), "out": None}, TypeError, "packed"),
    ({"lengths": torch.tensor([2, 3, 0])}, ValueError, "lengths"),
    ({"lengths": torch.tensor([2.0, 3.0])}, TypeError, "lengths"),
    ({"lengths": torch.tensor([2, 3], device="meta")}, ValueError, "lengths"),
    ({"total": -2, "out": None}, ValueError, "total"),
    ({"total": 5.0, "out": None}, TypeError, "total"),
    ({"total": 4}, ValueError, "out"),
    ({"out": torch.zeros(5, 2, dtype=torch.int32)}, TypeError, "out"),
    ({"out": torch.zeros(5, 3)}, ValueError, "out"),
    ({"lengths": torch.tensor([4, 1]), "out": None}, ValueError, "lengths"),
    ({"lengths": torch.tensor([-1, 1]), "out": None}, ValueError, "lengths"),
    ({"backend": "fast"}, ValueError, "backend"),
]


@pytest.mark.parametrize("overrides,error,name", UNPACK_ERRORS)
def test_unpack_rejects_bad_arguments_without_writing(overrides, error, name):
    args = _unpack_args(**overrides)
    out = args["out"]
    before = out.clone() if isinstance(out, torch.Tensor) else None
    with pytest.raises(error, match=name):
        unpack_seq(args.pop("packed"), args.pop("lengths"), **args)
    if before is not None:
        assert torch.equal(bits(out), bits(before))
