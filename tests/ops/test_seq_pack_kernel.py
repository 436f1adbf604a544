"""Triton pack_seq / unpack_seq against the PyTorch reference, byte for byte.

Runs on CUDA (scripts/gpu-check) or on Triton's CPU interpreter (TRITON_INTERPRET=1, tiny shapes).
"""

from __future__ import annotations

import pytest
import torch

from dsa_indexer.ops.seq_pack import pack_seq, unpack_seq
from dsa_indexer.ops.seq_pack import triton as seq_triton

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
PAYLOADS = [
    (torch.float32, float("-inf")),
    (torch.bfloat16, float("nan")),
    (torch.float8_e4m3fn, -448.0),
    (torch.uint8, 165),
    (torch.int64, -7),
]
LENGTHS = [[3, 0, 5], [1], [0, 0], [7, 1, 2, 4], [2, 0, 0, 9, 1]]
TRAILING = [(), (3,), (2, 8), (16,)]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(BITS[tensor.element_size()])


def random_payload(shape, dtype, device, seed: int) -> torch.Tensor:
    """Random bytes, so NaN payloads, -0.0 and subnormals all occur."""
    generator = torch.Generator().manual_seed(seed)
    numel = 1
    for size in shape:
        numel *= size
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape).to(device)


def poison_like(tensor: torch.Tensor, seed: int = 99) -> torch.Tensor:
    return random_payload(tuple(tensor.shape), tensor.dtype, tensor.device, seed)


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(bits(actual), bits(expected))


def both_pack(x, lengths, pad_value, **kwargs):
    expected = pack_seq(x, lengths, pad_value=pad_value, backend="reference", **kwargs)
    actual = pack_seq(x, lengths, pad_value=pad_value, backend="triton", **kwargs)
    assert_same_bytes(actual, expected)
    return actual


@pytest.mark.parametrize("dtype,pad_value", PAYLOADS)
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("trailing", TRAILING)
def test_pack_and_unpack_match_reference(kernel_device, dtype, pad_value, lengths, trailing):
    x = random_payload((sum(lengths) + 2, *trailing), dtype, kernel_device, seed=len(lengths))
    lengths_tensor = torch.tensor(lengths, dtype=torch.int32, device=kernel_device)
    longest = max(lengths)
    for max_len in (longest, longest + 2, max(longest - 1, 0)):
        both_pack(x, lengths_tensor, pad_value, max_len=max_len)
    packed = random_payload((len(lengths), longest + 1, *trailing), dtype, kernel_device, seed=3)
    total = sum(lengths)
    for rows in (total, total + 3, max(total - 2, 0)):
        out = poison_like(torch.empty((rows, *trailing), dtype=dtype, device=kernel_device))
        expected = unpack_seq(packed, lengths_tensor.long(), out=out.clone(), backend="reference")
        actual = unpack_seq(packed, lengths_tensor.long(), out=out, backend="triton")
        assert actual is out
        assert_same_bytes(actual, expected)


def test_unpack_inverts_pack(kernel_device):
    lengths = torch.tensor([5, 1, 0, 3], device=kernel_device)
    x = random_payload((9, 4, 6), torch.bfloat16, kernel_device, seed=4)
    packed = pack_seq(x, lengths, pad_value=0.0, backend="triton")
    assert_same_bytes(unpack_seq(packed, lengths, backend="triton"), x)


def test_pack_out_is_fully_written_and_returned(kernel_device):
    x = random_payload((6, 4), torch.float32, kernel_device, seed=5)
    lengths = torch.tensor([2, 4], device=kernel_device)
    out = poison_like(torch.empty((2, 5, 4), device=kernel_device))
    expected = pack_seq(x, lengths, pad_value=-1.0, out=out.clone(), backend="reference")
    assert pack_seq(x, lengths, pad_value=-1.0, out=out, backend="triton") is out
    assert_same_bytes(out, expected)


def test_pack_into_non_contiguous_out(kernel_device):
    x = random_payload((7, 3, 2), torch.float8_e4m3fn, kernel_device, seed=6)
    lengths = torch.tensor([3, 0, 4], device=kernel_device)
    base = poison_like(torch.empty((3, 2, 5, 4), dtype=torch.float8_e4m3fn, device=kernel_device))
    out = base.permute(0, 2, 3, 1)[:, :, :3]  # [3, 5, 3, 2]: the trailing dims are not one flat row
    before = base.clone()
    expected = pack_seq(x, lengths, pad_value=0.0, max_len=5, backend="reference")
    assert pack_seq(x, lengths, pad_value=0.0, out=out, backend="triton") is out
    assert_same_bytes(out, expected)
    assert torch.equal(bits(base[..., 3]), bits(before[..., 3]))


def test_strided_payloads_match_reference(kernel_device):
    base = random_payload((9, 8, 3), torch.float32, kernel_device, seed=7)
    x = base[::2, 1::3]  # [5, 3, 3], rows not viewable as one flat row
    lengths = torch.tensor([2, 3], device=kernel_device)
    both_pack(x, lengths, 0.5)
    both_pack(base[::2, :, 1], lengths, float("nan"))  # [5, 8] with a row stride and an element stride
    packed = random_payload((3, 2, 6, 2), torch.float32, kernel_device, seed=8).transpose(0, 1)[:, :, ::2]
    expected = unpack_seq(packed, lengths, backend="reference")
    assert_same_bytes(unpack_seq(packed, lengths, backend="triton"), expected)


def test_unpack_into_non_contiguous_out_keeps_its_tail(kernel_device):
    packed = random_payload((2, 3, 4), torch.int32, kernel_device, seed=9)
    lengths = torch.tensor([1, 3], device=kernel_device)
    base = poison_like(torch.empty((4, 7), dtype=torch.int32, device=kernel_device))
    out = base.t()  # [7, 4], element stride 7
    before = base.clone()
    expected = unpack_seq(packed, lengths, out=out.clone(), backend="reference")
    unpack_seq(packed, lengths, out=out, backend="triton")
    assert_same_bytes(out, expected)
    assert torch.equal(base[:, 4:], before[:, 4:])


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_unaligned_storage_offsets_use_narrower_words(kernel_device, offset):
    base = random_payload((9 * 16 + offset,), torch.uint8, kernel_device, seed=offset)
    x = base[offset:].view(9, 16)
    lengths = torch.tensor([4, 0, 5], device=kernel_device)
    packed = both_pack(x, lengths, 3)
    out_base = poison_like(torch.empty(9 * 16 + offset, dtype=torch.uint8, device=kernel_device))
    out = out_base[offset:].view(9, 16)
    before = out_base.clone()
    unpack_seq(packed, lengths, out=out, backend="triton")
    assert torch.equal(out, x)
    assert torch.equal(out_base[:offset], before[:offset])


def test_lengths_past_the_payload_read_padding(kernel_device):
    # Invalid lengths (the caller's duty with max_len given) never read outside x.
    x = random_payload((4, 2), torch.float32, kernel_device, seed=10)
    both_pack(x, torch.tensor([2, 5], device=kernel_device), -3.0, max_len=5)
    both_pack(x, torch.tensor([3, -2, 4], device=kernel_device), -3.0, max_len=4)


def test_unpack_with_lengths_past_the_grid_or_negative_stays_inside(kernel_device):
    # Wild lengths (unchecked, total given): only grid rows t < min(lengths[b], L) are read, and only output
    # rows in [0, total) are written; the result is the reference's, bit for bit.
    packed = random_payload((3, 4, 2), torch.float32, kernel_device, seed=12)
    lengths = torch.tensor([3, 10**6, -4], device=kernel_device)
    outs = [poison_like(torch.empty(9, 2, device=kernel_device)) for _ in range(2)]
    for out, backend in zip(outs, ("reference", "triton")):
        unpack_seq(packed, lengths, out=out, backend=backend)
    assert_same_bytes(outs[1], outs[0])
    assert torch.equal(outs[0][:3], packed[0, :3]) and torch.equal(outs[0][3:7], packed[1])


def test_empty_inputs(kernel_device):
    lengths = torch.zeros(3, dtype=torch.int64, device=kernel_device)
    x = torch.zeros(0, 2, dtype=torch.uint8, device=kernel_device)
    assert_same_bytes(pack_seq(x, lengths, pad_value=9, max_len=3, backend="triton"),
                      torch.full((3, 3, 2), 9, dtype=torch.uint8, device=kernel_device))
    assert pack_seq(x, lengths, pad_value=9, backend="triton").shape == (3, 0, 2)
    empty_batch = torch.zeros(0, dtype=torch.int32, device=kernel_device)
    assert pack_seq(x, empty_batch, pad_value=9, max_len=4, backend="triton").shape == (0, 4, 2)
    out = torch.full((2, 1), 5, dtype=torch.uint8, device=kernel_device)
    unpack_seq(torch.zeros(3, 4, 1, dtype=torch.uint8, device=kernel_device), lengths, out=out, backend="triton")
    assert torch.equal(out, torch.full((2, 1), 5, dtype=torch.uint8, device=kernel_device))
    assert unpack_seq(torch.zeros(0, 4, 3, device=kernel_device), empty_batch, backend="triton").shape == (0, 3)


@pytest.mark.parametrize("num_seqs,width,programs", [(1500, 1, 60), (40, 5, 3), (40, 40, 3)])
def test_many_sequences_and_many_tiles_per_program(kernel_device, monkeypatch, num_seqs, width, programs):
    # Small tiles and few programs: each program walks several tiles; with 1500 sequences the later
    # programs start past the first 1024 lengths of their prefix sum.
    monkeypatch.setattr(seq_triton, "SEQ_COPY_CONFIG", seq_triton.SeqCopyConfig(tile_bytes=64, max_programs=programs))
    generator = torch.Generator().manual_seed(width)
    lengths = torch.randint(0, 3, (num_seqs,), generator=generator).to(kernel_device)
    total = int(lengths.sum())
    x = random_payload((total + 1, width), torch.int16, kernel_device, seed=width)
    packed = both_pack(x, lengths, -1, max_len=3)
    out = poison_like(torch.empty((total + 2, width), dtype=torch.int16, device=kernel_device))
    expected = unpack_seq(packed, lengths, out=out.clone(), backend="reference")
    assert_same_bytes(unpack_seq(packed, lengths, out=out, backend="triton"), expected)


@pytest.mark.gpu
def test_decode_sized_payloads_and_reruns_are_bitwise_stable():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 5, (2048,), generator=generator, dtype=torch.int32).cuda()
    total = int(lengths.sum())
    q = random_payload((total, 64, 128), torch.float8_e4m3fn, "cuda", seed=1)
    scales = random_payload((total, 32, 4), torch.uint8, "cuda", seed=2)
    indices = random_payload((total + 5, 2048), torch.int32, "cuda", seed=3)
    first = both_pack(q, lengths, 0.0, max_len=4)
    both_pack(scales, lengths, 0, max_len=4)
    both_pack(indices[1:], lengths, -1, max_len=6)
    for _ in range(20):
        assert_same_bytes(pack_seq(q, lengths, pad_value=0.0, max_len=4, backend="triton"), first)
    unpacked = unpack_seq(first, lengths, total=total, backend="triton")
    assert_same_bytes(unpacked, q)
    for _ in range(20):
        assert_same_bytes(unpack_seq(first, lengths, total=total, backend="triton"), q)


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_lengths():
    lengths = torch.tensor([1, 4, 2, 0], dtype=torch.int32, device="cuda")
    x = random_payload((12, 8, 32), torch.bfloat16, "cuda", seed=4)
    packed = torch.empty((4, 4, 8, 32), dtype=torch.bfloat16, device="cuda")
    unpacked = poison_like(torch.empty((12, 8, 32), dtype=torch.bfloat16, device="cuda"))
    pack_seq(x, lengths, pad_value=0.0, out=packed, backend="triton")
    unpack_seq(packed, lengths, out=unpacked, backend="triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pack_seq(x, lengths, pad_value=0.0, out=packed, backend="triton")
        unpack_seq(packed, lengths, out=unpacked, backend="triton")
    for new_lengths in ([4, 4, 4, 0], [0, 1, 0, 3], [2, 2, 2, 2]):
        lengths.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        unpacked.copy_(poison_like(unpacked, seed=sum(new_lengths)))
        before = unpacked.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert_same_bytes(packed, pack_seq(x, lengths, pad_value=0.0, max_len=4, backend="reference"))
        total = sum(new_lengths)
        assert_same_bytes(unpacked[:total], x[:total])
        assert_same_bytes(unpacked[total:], before[total:])
