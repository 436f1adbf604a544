"""Gluon warp-specialised MXFP4 decode logits (``ops/logits/gluon_decode_mxfp4.py``) against the reference
and the Triton MXFP4 kernel.

Tiers (DESIGN.md §11): calc_diff < 5e-6 against the PyTorch reference on the same quantised inputs with
the ``-inf`` masks equal; the same bits as the Triton kernel (``paged_mqa_logits_triton``) wherever both
sum a row's heads in the same order (64 heads and at most 2 draft rows: the expansion, the contraction
order and the per-row head sum are the same instructions); 20 reruns with identical bits. Outputs go
through padded row strides of a poisoned allocation (the padding keeps its poison; with ``clean=False``
only the valid entries are written), and the paged cache sits in a 0xFF-poisoned allocation with a padded
page stride, so a read of a byte the kernel should not use shows; such a cache takes the cp.async producer
(4-byte copies: the TMA page copies need 64-byte multiple page strides), so the tests of the TMA producer
(the default wherever the cache allows) and of 16-byte copies run on an aligned, unpadded copy of the cache.
Gluon kernels do not run under the Triton interpreter: every test here needs a CUDA GPU with wgmma.
"""

from __future__ import annotations

import pytest
import torch
from test_logits_kernel import NEG_INF, POISON, TIER, DecodeInputs, check_unchecked_call, decode_inputs, run_decode

from dsa_indexer.cache import IndexerKCache
from dsa_indexer.ops.common.runtime import interpreting
from dsa_indexer.testing import calc_diff

_HOPPER = (not interpreting() and torch.cuda.is_available()
           and torch.cuda.get_device_capability()[0] >= 9)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _HOPPER,
                       reason="Gluon kernels cannot run under the Triton interpreter; they need a CUDA GPU with "
                              "wgmma (sm_90+): run scripts/gpu-check on an H100/H200"),
]

REQUEST_LENGTHS = [0, 1, 63, 64, 65, 4999, 12345]


def run_gluon(inputs: DecodeInputs, clean: bool, pad: int, **kwargs) -> torch.Tensor:
    """The Gluon launcher into a poisoned ``[rows, width + pad]`` allocation; returns the allocation."""
    from dsa_indexer.ops.logits.gluon_decode_mxfp4 import paged_mqa_logits_gluon_mxfp4

    rows = inputs.q.shape[0] * inputs.q.shape[1]
    storage = torch.full((rows, inputs.max_context_len + pad), POISON, device=inputs.q.device)
    paged_mqa_logits_gluon_mxfp4(*inputs.args(), clean, storage[:, : inputs.max_context_len], **kwargs)
    return storage


def check_gluon(inputs: DecodeInputs, clean: bool, same_bits_as_triton: bool, pad: int = 8,
                **kwargs) -> torch.Tensor:
    """Reference tier (and the Triton kernel's bits when ``same_bits_as_triton``), padding kept, nothing
    written outside the valid entries when not ``clean``; 20 reruns bitwise. Returns the first result."""
    from dsa_indexer.ops.logits.triton import paged_mqa_logits_triton

    width = inputs.max_context_len
    expected = run_decode(inputs, "reference", True, pad)[:, :width]
    result = run_gluon(inputs, clean, pad, **kwargs)
    assert (result[:, width:] == POISON).all(), "padded row stride was written"
    got = result[:, :width]
    triton_out = torch.full_like(expected, POISON)
    paged_mqa_logits_triton(*inputs.args(), clean, triton_out)
    if clean:
        assert calc_diff(got, expected) < TIER
    else:
        valid = expected != NEG_INF
        assert calc_diff(got[valid], expected[valid]) < TIER
        assert (got[~valid] == POISON).all(), "clean=False wrote outside the valid ranges"
    if same_bits_as_triton:
        assert torch.equal(got.view(torch.int32), triton_out.view(torch.int32)), "bits differ from the Triton kernel"
    else:
        valid = expected != NEG_INF
        assert calc_diff(got[valid], triton_out[valid]) < TIER
    for _ in range(20):
        assert torch.equal(run_gluon(inputs, clean, pad, **kwargs).view(torch.int32), result.view(torch.int32))
    return result


@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("next_n, lens", [(1, "1d"), (2, "1d"), (2, "2d"), (3, "2d"), (4, "1d")])
def test_gluon_mxfp4_decode_matches_reference_and_triton_gpu(kernel_device, next_n, lens, clean):
    lengths = REQUEST_LENGTHS if lens == "1d" else [[max(0, n - 7 * t) for t in range(next_n)] for n in REQUEST_LENGTHS]
    inputs = decode_inputs("mxfp4", lengths, next_n, kernel_device, heads=64, block_size=64, seed=51 + next_n)
    # next_n > 2: the Triton kernel stacks 4 rows into one [64, 256] accumulator (another head-sum tile).
    check_gluon(inputs, clean, same_bits_as_triton=next_n <= 2)


@pytest.mark.parametrize("next_n", [1, 2])
def test_gluon_mxfp4_decode_block_exponent_spreads_gpu(kernel_device, next_n):
    """Random packed bytes (every code, both signs) and block exponents spread over 0..60 (exact, rounded
    and dropped blocks), as in the Triton PTX-expansion test: the Triton kernel's bits."""
    inputs = decode_inputs("mxfp4", [0, 1, 65, 700, 3001], next_n, kernel_device, heads=64, block_size=64, seed=61)
    gen = torch.Generator(device=kernel_device).manual_seed(62)
    values, scales = inputs.cache.values_view(), inputs.cache.scales_view()
    values.copy_(torch.randint(0, 256, values.shape, generator=gen, device=kernel_device, dtype=torch.uint8))
    scales.copy_(torch.randint(70, 131, scales.shape, generator=gen, device=kernel_device, dtype=torch.uint8))
    check_gluon(inputs, True, same_bits_as_triton=True)


@pytest.mark.parametrize("next_n", [1, 2])
def test_gluon_mxfp4_decode_aligned_cache_uses_16_byte_copies_gpu(kernel_device, next_n):
    """The cp.async producer on a 16-byte aligned cache with an unpadded page stride (16-byte copies) gives the
    bits of the same pages in the poisoned, padded cache (4-byte copies) and of the TMA page copies."""
    from dsa_indexer.ops.common.gluon import cp_async_fallback
    from dsa_indexer.ops.logits.gluon_decode_mxfp4 import GLUON_MXFP4_DECODE_CONFIG, GLUON_MXFP4_DECODE_CONFIG_ONE_ROW

    lengths = [[max(0, n - 5 * t) for t in range(next_n)] for n in REQUEST_LENGTHS]
    inputs = decode_inputs("mxfp4", lengths, next_n, kernel_device, heads=64, block_size=64, seed=63)
    aligned_inputs = _aligned(inputs)
    cache = aligned_inputs.cache
    assert cache.buffer.data_ptr() % 16 == 0 and cache.page_stride % 16 == 0 and inputs.cache.page_stride % 16
    default = GLUON_MXFP4_DECODE_CONFIG_ONE_ROW if next_n == 1 else GLUON_MXFP4_DECODE_CONFIG
    copies = cp_async_fallback(default)  # four cp.async warps, as where TMA cannot run
    result = check_gluon(aligned_inputs, True, same_bits_as_triton=True, config=copies)
    assert torch.equal(result.view(torch.int32), run_gluon(inputs, True, 8).view(torch.int32))
    assert torch.equal(result.view(torch.int32), run_gluon(aligned_inputs, True, 8).view(torch.int32))


@pytest.mark.parametrize("next_n", [1, 2])
def test_gluon_mxfp4_decode_single_request_long_context_gpu(kernel_device, next_n):
    inputs = decode_inputs("mxfp4", [40001], next_n, kernel_device, heads=64, block_size=64, extra_width=70, seed=64)
    check_gluon(inputs, True, same_bits_as_triton=True)


def test_gluon_mxfp4_decode_small_pages_and_heads_gpu(kernel_device):
    """Pages smaller than a key tile (one table entry per key), 3 heads (padded to 16): reference tier."""
    inputs = decode_inputs("mxfp4", [[13, 0], [700, 701], [0, 40]], 2, kernel_device, heads=3, block_size=16,
                           seed=65)
    check_gluon(inputs, True, same_bits_as_triton=False)
    check_gluon(inputs, False, same_bits_as_triton=False)


@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("variant", ["draft-rows", "wave", "one-row"])
@pytest.mark.parametrize("copies", [False, True])
def test_gluon_mxfp4_decode_shipped_configs_gpu(kernel_device, variant, copies, next_n):
    """Every shipped configuration, and its cp.async form (what caches TMA cannot take run), matches the
    reference and the Triton kernel's bits on an aligned cache (next_n = 2: one program per row gives the
    same per-row sums)."""
    from dsa_indexer.ops.common.gluon import cp_async_fallback
    from dsa_indexer.ops.logits import gluon_decode_mxfp4 as mxfp4

    config = {"draft-rows": mxfp4.GLUON_MXFP4_DECODE_CONFIG, "wave": mxfp4.GLUON_MXFP4_DECODE_CONFIG_WAVE,
              "one-row": mxfp4.GLUON_MXFP4_DECODE_CONFIG_ONE_ROW}[variant]
    lengths = [[max(0, n - 7 * t) for t in range(next_n)] for n in REQUEST_LENGTHS]
    inputs = _aligned(decode_inputs("mxfp4", lengths, next_n, kernel_device, heads=64, block_size=64, seed=66))
    check_gluon(inputs, True, same_bits_as_triton=True, config=cp_async_fallback(config) if copies else config)


def _aligned(inputs: DecodeInputs) -> DecodeInputs:
    """The same call on an unpadded, 16-byte aligned copy of the cache (page stride 64 * 68 bytes: the TMA
    page copies' condition)."""
    cache = inputs.cache
    aligned = IndexerKCache(cache.num_blocks, block_size=cache.block_size, head_dim=cache.head_dim, fmt="mxfp4",
                            buffer=cache.buffer.contiguous())
    return DecodeInputs(inputs.q, inputs.q_scale, aligned, inputs.weights, inputs.context_lens, inputs.block_table,
                        inputs.max_context_len)


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("block_size", [64, 16])
def test_gluon_mxfp4_decode_unchecked_wild_pages_and_lengths_gpu(kernel_device, block_size, tma, monkeypatch):
    """Value checks off, page ids outside the cache and lengths past the width and the table: the TMA page copies
    (aligned cache, 64-key pages), the cp.async tile copies and the per-key copies (16-key pages) read nothing
    outside the cache and give the documented logits (unreadable pages read as zeros, lengths stop at the
    width and the table)."""
    from dsa_indexer.ops.common.gluon import cp_async_fallback
    from dsa_indexer.ops.logits.gluon_decode_mxfp4 import GLUON_MXFP4_DECODE_CONFIG

    config = GLUON_MXFP4_DECODE_CONFIG if tma else cp_async_fallback(GLUON_MXFP4_DECODE_CONFIG)
    monkeypatch.setenv("DSA_INDEXER_SKIP_VALUE_CHECKS", "1")
    check_unchecked_call("mxfp4", lambda inputs, clean: run_gluon(inputs, clean, 8, config=config), kernel_device,
                         block_size, _aligned if tma and block_size == 64 else None)


@pytest.mark.parametrize("case", ["tile_counts", "not_clean", "long", "exponent_spreads"])
@pytest.mark.parametrize("next_n", [1, 2])
def test_gluon_mxfp4_decode_tma_pages_gpu(kernel_device, next_n, case):
    """The defaults (TMA page copies) on an aligned cache: the Triton kernel's bits for odd and even tile
    counts, empty splits, clean or not, one long request, random bytes with block exponents over 0..60."""
    from dsa_indexer.ops.logits.gluon_decode_mxfp4 import GLUON_MXFP4_DECODE_CONFIG, _tma_pages

    if case == "long":
        inputs = decode_inputs("mxfp4", [40001], next_n, kernel_device, heads=64, block_size=64, extra_width=70,
                               seed=72)
    else:
        lengths = REQUEST_LENGTHS + [128, 129, 191, 192]
        lengths = [[max(0, n - 7 * t) for t in range(next_n)] for n in lengths] if next_n == 2 else lengths
        inputs = decode_inputs("mxfp4", lengths, next_n, kernel_device, heads=64, block_size=64, seed=73)
    inputs = _aligned(inputs)
    if case == "exponent_spreads":
        gen = torch.Generator(device=kernel_device).manual_seed(74)
        values, scales = inputs.cache.values_view(), inputs.cache.scales_view()
        values.copy_(torch.randint(0, 256, values.shape, generator=gen, device=kernel_device, dtype=torch.uint8))
        scales.copy_(torch.randint(70, 131, scales.shape, generator=gen, device=kernel_device, dtype=torch.uint8))
    assert _tma_pages(inputs.cache, GLUON_MXFP4_DECODE_CONFIG) is not None
    check_gluon(inputs, case != "not_clean", same_bits_as_triton=True)


@pytest.mark.parametrize("next_n", [1, 2])
def test_gluon_mxfp4_decode_tma_falls_back_to_copies_gpu(kernel_device, next_n):
    """The defaults on caches the descriptors cannot take (padded page stride, or pages smaller than a tile)
    run the cp.async producer: the reference tier, and the Triton kernel's bits at 64 heads."""
    from dsa_indexer.ops.logits.gluon_decode_mxfp4 import GLUON_MXFP4_DECODE_CONFIG, _tma_pages

    padded = decode_inputs("mxfp4", REQUEST_LENGTHS, next_n, kernel_device, heads=64, block_size=64, seed=75)
    small = decode_inputs("mxfp4", [13, 0, 700, 40], next_n, kernel_device, heads=3, block_size=16, seed=76)
    config = GLUON_MXFP4_DECODE_CONFIG
    assert _tma_pages(padded.cache, config) is None and _tma_pages(_aligned(small).cache, config) is None
    check_gluon(padded, True, same_bits_as_triton=True)
    check_gluon(_aligned(small), True, same_bits_as_triton=False)
    check_gluon(_aligned(small), False, same_bits_as_triton=False)


def test_gluon_mxfp4_decode_empty_rows_write_minus_inf_gpu(kernel_device):
    inputs = decode_inputs("mxfp4", [0, 0], 2, kernel_device, heads=64, block_size=64, extra_width=100, seed=67)
    result = run_gluon(inputs, True, 3)
    assert (result[:, :100] == NEG_INF).all() and (result[:, 100:] == POISON).all()
    assert (run_gluon(inputs, False, 3) == POISON).all()


def test_gluon_mxfp4_decode_rejects_other_head_dims_gpu(kernel_device):
    inputs = decode_inputs("mxfp4", [40], 1, kernel_device, heads=64, dim=64, block_size=64, seed=68)
    with pytest.raises(ValueError, match="head_dim 128"):
        run_gluon(inputs, True, 0)


def test_gluon_mxfp4_decode_reruns_at_deepgemm_sm100_shape_gpu(kernel_device, monkeypatch):
    """DeepGEMM's SM100 paged case through ``compat.deep_gemm`` (its unpadded cache: TMA pages): 4096 requests
    of 5.7K-10.6K keys, next_n 6 with random per-row lengths, 64 heads, bf16 weights and logits. Forced Gluon
    gives the Triton kernel's bits and repeats them (the valid region: the rest is not written); on an H100
    its reruns once differed in runs of 4-8 keys of a tile."""
    from dsa_indexer.compat import deep_gemm
    from dsa_indexer.ops.logits import DECODE_KERNEL_ENV

    batch, next_n, heads, dim, page, average = 4096, 6, 64, 128, 64, 8192
    gen = torch.Generator(device=kernel_device).manual_seed(5)
    lengths = torch.randint(int(0.7 * average), int(1.3 * average), (batch,), generator=gen, device=kernel_device,
                            dtype=torch.int32)
    pages = (lengths + page - 1) // page
    width = int(pages.max()) * page
    num_blocks = int(pages.sum())
    cache = torch.randint(0, 256, (num_blocks, page * (dim // 2 + 4)), generator=gen, device=kernel_device,
                          dtype=torch.uint8)
    cache[:, page * dim // 2:] = torch.randint(120, 129, (num_blocks, page * 4), generator=gen, device=kernel_device,
                                               dtype=torch.uint8)
    firsts = torch.cumsum(pages, 0) - pages
    columns = torch.arange(int(pages.max()), device=kernel_device)
    order = torch.randperm(num_blocks, generator=gen, device=kernel_device).to(torch.int32)
    table = torch.where(columns < pages[:, None], order[(firsts[:, None] + columns).clamp(max=num_blocks - 1)], 0)
    q = torch.randint(0, 256, (batch, next_n, heads, dim // 2), generator=gen, device=kernel_device,
                      dtype=torch.uint8).view(torch.int8)
    q_scale = torch.randint(120, 129, (batch, next_n, heads, 4), generator=gen, device=kernel_device,
                            dtype=torch.uint8).view(torch.int32).squeeze(-1)
    row_lengths = ((lengths[:, None] + 1) * torch.rand(batch, next_n, generator=gen, device=kernel_device)).int()
    row_lengths[:, -1] = lengths
    weights = torch.randn(batch * next_n, heads, generator=gen, device=kernel_device).bfloat16()
    schedule = deep_gemm.get_paged_mqa_logits_metadata(row_lengths, page, 132)
    valid = torch.arange(width, device=kernel_device) < row_lengths.reshape(-1, 1)

    def logits():
        result = deep_gemm.fp8_fp4_paged_mqa_logits((q, q_scale), cache.view(num_blocks, page, 1, -1), weights,
                                                    row_lengths, table.to(torch.int32), schedule, width,
                                                    clean_logits=False, logits_dtype=torch.bfloat16)
        return result.masked_fill(~valid, 0).view(torch.int16)

    monkeypatch.setenv(DECODE_KERNEL_ENV, "triton")
    expected = logits()
    monkeypatch.setenv(DECODE_KERNEL_ENV, "gluon")
    for _ in range(8):
        assert torch.equal(logits(), expected)
