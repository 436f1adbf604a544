"""Gluon warp-specialised FP8 decode logits (``ops/logits/gluon_decode.py``) and the decode-kernel dispatch.

Tier (DESIGN.md §11): calc_diff < 5e-6 against the reference on the same quantised inputs with the ``-inf``
masks equal (the head sum runs in another order than the reference's), the same tier against the Triton
kernel, and 20 reruns with identical bits. Outputs go through padded row strides of a poisoned allocation
(the padding keeps its poison; with ``clean=False`` only the valid entries are written), and the paged
cache sits in a 0xFF-poisoned allocation (e4m3 NaN), so a read of a byte the kernel should not use shows.
Gluon kernels do not run under the Triton interpreter: those tests need a CUDA GPU with wgmma (sm_90); the
dispatch rule's tests run everywhere.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_logits_kernel import (
    FORCE_UPCAST_ENV,
    NEG_INF,
    POISON,
    TIER,
    DecodeInputs,
    check_unchecked_call,
    decode_inputs,
    run_decode,
)

from dsa_indexer.ops.common.runtime import interpreting
from dsa_indexer.ops.logits import _gluon_available
from dsa_indexer.testing import calc_diff

if _gluon_available():
    from dsa_indexer.ops.common.gluon import cp_async_fallback, wave_fills
    from dsa_indexer.ops.common.splits import wave_split
    from dsa_indexer.ops.logits import gluon_decode, gluon_decode_mxfp4

    # The shipped launches (``gluon_decode_config``), their cp.async forms (what caches TMA cannot take run) and
    # one persistent program per SM (many work items, empty ones too, through one ring and its query slots).
    SHIPPED = {"large": gluon_decode.GLUON_DECODE_CONFIG, "small": gluon_decode.GLUON_DECODE_CONFIG_SMALL,
               "wave": gluon_decode.GLUON_DECODE_CONFIG_WAVE, "one-row": gluon_decode.GLUON_DECODE_CONFIG_ONE_ROW}
    CONFIGS = {**SHIPPED, **{f"{name}-copies": cp_async_fallback(config) for name, config in SHIPPED.items()},
               "persist1": replace(cp_async_fallback(gluon_decode.GLUON_DECODE_CONFIG), persistent_per_sm=1)}
else:  # a Triton without Gluon: these tests skip, the dispatch takes Triton
    SHIPPED = CONFIGS = {}
needs_gluon = pytest.mark.skipif(not _gluon_available(), reason="this Triton has no Gluon (triton.experimental.gluon)")

_HOPPER = (not interpreting() and torch.cuda.is_available()
           and torch.cuda.get_device_capability()[0] == 9)
needs_hopper = pytest.mark.skipif(
    not _HOPPER, reason="Gluon kernels cannot run under the Triton interpreter; they need a CUDA GPU with wgmma "
                        "(sm_90): run scripts/gpu-check on an H100/H200")


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch):
    from dsa_indexer.ops.logits import DECODE_KERNEL_ENV

    monkeypatch.delenv(DECODE_KERNEL_ENV, raising=False)
    monkeypatch.delenv(FORCE_UPCAST_ENV, raising=False)


def run_gluon(inputs: DecodeInputs, clean: bool, pad: int, **kwargs) -> torch.Tensor:
    """The Gluon launcher into a poisoned ``[rows, width + pad]`` allocation; returns the allocation."""
    from dsa_indexer.ops.logits.gluon_decode import paged_mqa_logits_gluon

    rows = inputs.q.shape[0] * inputs.q.shape[1]
    storage = torch.full((rows, inputs.max_context_len + pad), POISON, device=inputs.q.device)
    paged_mqa_logits_gluon(*inputs.args(), clean, storage[:, : inputs.max_context_len], **kwargs)
    return storage


def check_gluon(inputs: DecodeInputs, clean: bool, pad: int = 8, **kwargs) -> torch.Tensor:
    """Tier against the reference (and the Triton kernel), padding kept, nothing written outside the valid
    entries when not ``clean``; 20 reruns bitwise. Returns the first result."""
    from dsa_indexer.ops.logits.triton import paged_mqa_logits_triton

    width = inputs.max_context_len
    expected = run_decode(inputs, "reference", True, pad)[:, :width]
    triton_out = torch.full_like(expected, POISON)
    paged_mqa_logits_triton(*inputs.args(), True, triton_out)
    result = run_gluon(inputs, clean, pad, **kwargs)
    assert (result[:, width:] == POISON).all(), "padded row stride was written"
    got = result[:, :width]
    if clean:
        assert calc_diff(got, expected) < TIER
        assert calc_diff(got, triton_out) < TIER
    else:
        valid = expected != NEG_INF
        assert calc_diff(got[valid], expected[valid]) < TIER
        assert (got[~valid] == POISON).all(), "clean=False wrote outside the valid ranges"
    for _ in range(20):
        assert torch.equal(run_gluon(inputs, clean, pad, **kwargs).view(torch.int32), result.view(torch.int32))
    return result


REQUEST_LENGTHS = [0, 1, 63, 64, 65, 4999, 12345]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("next_n, lens", [(1, "1d"), (2, "1d"), (2, "2d"), (3, "2d"), (4, "1d")])
def test_gluon_decode_matches_reference_gpu(kernel_device, next_n, lens, clean):
    lengths = REQUEST_LENGTHS if lens == "1d" else [[max(0, n - 7 * t) for t in range(next_n)] for n in REQUEST_LENGTHS]
    inputs = decode_inputs("fp8", lengths, next_n, kernel_device, heads=64, block_size=64, seed=31 + next_n)
    check_gluon(inputs, clean)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("next_n", [1, 2])
def test_gluon_decode_single_request_long_context_gpu(kernel_device, next_n):
    inputs = decode_inputs("fp8", [40001], next_n, kernel_device, heads=64, block_size=64, extra_width=70, seed=41)
    check_gluon(inputs, clean=True)


@pytest.mark.gpu
@needs_hopper
def test_gluon_decode_small_pages_heads_and_dim_gpu(kernel_device):
    """Pages smaller than a key tile (one table entry per key), 3 heads (padded to 16), D = 64."""
    inputs = decode_inputs("fp8", [[13, 0], [700, 701], [0, 40]], 2, kernel_device, heads=3, dim=64, block_size=16,
                           seed=42)
    check_gluon(inputs, clean=True)
    check_gluon(inputs, clean=False)


@pytest.mark.gpu
@needs_hopper
def test_gluon_decode_one_row_per_program_gpu(kernel_device):
    """One draft row per program at next_n = 2 (two row groups a request) matches the reference."""
    from dsa_indexer.ops.logits.gluon_decode import GLUON_DECODE_CONFIG

    config = replace(GLUON_DECODE_CONFIG, max_rows=1)
    lengths = [[max(0, n - 7 * t) for t in range(2)] for n in REQUEST_LENGTHS]
    inputs = decode_inputs("fp8", lengths, 2, kernel_device, heads=64, block_size=64, seed=43)
    check_gluon(inputs, clean=True, config=config)


@pytest.mark.gpu
@needs_hopper
def test_gluon_decode_empty_rows_write_minus_inf_gpu(kernel_device):
    inputs = decode_inputs("fp8", [0, 0], 2, kernel_device, heads=64, block_size=64, extra_width=100, seed=44)
    result = run_gluon(inputs, True, 3)
    assert (result[:, :100] == NEG_INF).all() and (result[:, 100:] == POISON).all()
    assert (run_gluon(inputs, False, 3) == POISON).all()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("variant", sorted(CONFIGS))
@pytest.mark.parametrize("next_n", [1, 2])
def test_gluon_decode_configs_give_the_default_bits_gpu(kernel_device, variant, next_n):
    """Every shipped configuration, its cp.async form and ``persist1`` match the reference and give the
    default's bits (each draft row has its own accumulator whatever the schedule)."""
    config = CONFIGS[variant]
    lengths = [[max(0, n - 7 * t) for t in range(next_n)] for n in REQUEST_LENGTHS + [0, 3000, 64 * 50]]
    inputs = decode_inputs("fp8", lengths, next_n, kernel_device, heads=64, block_size=64, seed=45)
    result = check_gluon(inputs, clean=True, config=config)
    assert torch.equal(result.view(torch.int32), run_gluon(inputs, True, 8).view(torch.int32))
    if variant == "persist1":
        check_gluon(inputs, clean=False, config=config)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("variant, next_n", [("small-copies", 1), ("small-copies", 2), ("small-copies", 3),
                                             ("small", 2), ("wave", 2)])
def test_gluon_decode_early_table_reads_stay_inside_the_table_gpu(kernel_device, variant, next_n):
    """An output wider than the block table (splits that start past its last column) and short requests
    beside a long one (first entries past a request's length are garbage ids): the early first-entry read
    is masked by the table's width and never used for an item without tiles."""
    lengths = [[max(0, n - 7 * t) for t in range(next_n)] for n in (40001, 0, 65, 3000)]
    inputs = decode_inputs("fp8", lengths, next_n, kernel_device, heads=64, block_size=64, extra_width=5000,
                           seed=49)
    if CONFIGS[variant].tma_pages:
        inputs = _aligned(inputs)
    check_gluon(inputs, clean=True, config=CONFIGS[variant])
    check_gluon(inputs, clean=False, config=CONFIGS[variant])


def _aligned(inputs: DecodeInputs) -> DecodeInputs:
    """The same call on an unpadded, 16-byte aligned copy of the cache (a page stride that is a multiple of a
    key row: the TMA page copies' condition)."""
    from dsa_indexer.cache import IndexerKCache

    cache = inputs.cache
    aligned = IndexerKCache(cache.num_blocks, block_size=cache.block_size, head_dim=cache.head_dim, fmt="fp8",
                            buffer=cache.buffer.contiguous())
    return DecodeInputs(inputs.q, inputs.q_scale, aligned, inputs.weights, inputs.context_lens, inputs.block_table,
                        inputs.max_context_len)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", ["mixed", "dim64", "long"])
@pytest.mark.parametrize("variant", sorted(SHIPPED))
def test_gluon_decode_tma_pages_give_the_copies_bits_gpu(kernel_device, variant, case):
    """Keys, scales and queries copied by TMA (``tma_pages``) on aligned caches: the reference's tier and
    the bits of the same configuration with cp.async copies. ``mixed``: 64 heads, odd and even tile counts,
    empty splits, rows of different lengths (one row for the one-row configuration, two otherwise), clean or
    not, and the default's bits; ``dim64``: D = 64 (64-byte swizzle, four scale rows a tile), 3 heads (the
    query copies read 16 rows), 128-key pages (two tiles a page), next_n = 3 (an absent second row); ``long``:
    one long request. The padded caches of the other tests fall back to cp.async (the sweep test runs them)."""
    from dsa_indexer.ops.logits.gluon_decode import _tma_pages

    config = SHIPPED[variant]
    copies = cp_async_fallback(config)  # four cp.async warps, as where TMA cannot run
    next_n = 1 if config.max_rows == 1 else 2
    if case == "mixed":
        lengths = [[max(0, n - 7 * t) for t in range(next_n)] for n in REQUEST_LENGTHS + [128, 129, 191, 192, 3200]]
        inputs = decode_inputs("fp8", lengths, next_n, kernel_device, heads=64, block_size=64, seed=81)
    elif case == "dim64":
        inputs = decode_inputs("fp8", [[max(0, n - 3 * t) for t in range(3)] for n in (13, 700, 0, 4000)], 3,
                               kernel_device, heads=3, dim=64, block_size=128, seed=85)
    else:
        inputs = decode_inputs("fp8", [40001], next_n, kernel_device, heads=64, block_size=64, extra_width=70,
                               seed=86)
    inputs = _aligned(inputs)
    assert _tma_pages(inputs.cache, config) is not None and _tma_pages(inputs.cache, copies) is None
    for clean in (True, False) if case == "mixed" else (True,):
        result = check_gluon(inputs, clean, config=config)
        assert torch.equal(result.view(torch.int32), run_gluon(inputs, clean, 8, config=copies).view(torch.int32))
        if case == "mixed":
            assert torch.equal(result.view(torch.int32), run_gluon(inputs, clean, 8).view(torch.int32))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("variant", ["large", "one-row"])
def test_gluon_decode_tma_falls_back_to_copies_gpu(kernel_device, variant):
    """A TMA configuration on caches the descriptors cannot take (padded page stride; 16-key pages with 3
    heads) runs four cp.async warps: the reference's tier, and the default's bits."""
    config = SHIPPED[variant]
    lengths = [[max(0, n - 7 * t) for t in range(2)] for n in REQUEST_LENGTHS]
    padded = decode_inputs("fp8", lengths, 2, kernel_device, heads=64, block_size=64, seed=87)
    result = check_gluon(padded, True, config=config)
    assert torch.equal(result.view(torch.int32), run_gluon(padded, True, 8).view(torch.int32))
    small = decode_inputs("fp8", [[13, 0], [700, 701], [0, 40]], 2, kernel_device, heads=3, dim=64, block_size=16,
                          seed=88)
    check_gluon(_aligned(small), False, config=config)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("variant", ["large", "large-copies", "small", "wave", "one-row"])
@pytest.mark.parametrize("block_size", [64, 16])
def test_gluon_decode_unchecked_wild_pages_and_lengths_gpu(kernel_device, variant, block_size, monkeypatch):
    """Value checks off: the TMA page copies (aligned cache, 64-key pages), the cp.async tile copies and the
    per-key copies (16-key pages) read nothing outside the cache (scripts/gpu-sanitize runs such a call under
    compute-sanitizer) and give the documented logits: a page outside the cache reads as zeros, a length past
    the width or the table stops there."""
    config = CONFIGS[variant]
    aligned = _aligned if config.tma_pages and block_size == 64 else None
    monkeypatch.setenv("DSA_INDEXER_SKIP_VALUE_CHECKS", "1")
    check_unchecked_call("fp8", lambda inputs, clean: run_gluon(inputs, clean, 8, config=config), kernel_device,
                         block_size, aligned)


def test_gluon_decode_tma_pages_only_where_the_cache_allows():
    """The TMA descriptors are made only for 16-byte aligned caches of 64-key multiple pages whose page stride
    is a multiple of a key row of at most 128 bytes, and only when the configuration asks."""
    if not _gluon_available():
        pytest.skip("this Triton has no Gluon (triton.experimental.gluon)")
    from dsa_indexer.cache import IndexerKCache
    from dsa_indexer.ops.logits.gluon_decode import _tma_pages

    config = CONFIGS["large"]
    assert _tma_pages(IndexerKCache(4, block_size=64, head_dim=128, fmt="fp8"), config) is not None
    copies = CONFIGS["large-copies"]
    assert _tma_pages(IndexerKCache(4, block_size=64, head_dim=128, fmt="fp8"), copies) is None
    assert _tma_pages(IndexerKCache(4, block_size=64, head_dim=64, fmt="fp8"), config) is not None
    assert _tma_pages(IndexerKCache(4, block_size=16, head_dim=128, fmt="fp8"), config) is None
    assert _tma_pages(IndexerKCache(4, block_size=64, head_dim=256, fmt="fp8"), config) is None
    padded = decode_inputs("fp8", [100], 1, "cpu", heads=4, block_size=64)
    assert _tma_pages(padded.cache, config) is None


@needs_gluon
def test_gluon_page_descriptors_are_built_once_per_cache_and_buffer():
    """The launchers' host state is memoised: a cache's TMA descriptors are built once (they describe its
    buffer, so a new buffer gets new ones), and go with the cache; the compile-time constants are one
    read-only mapping per configuration."""
    import gc

    from dsa_indexer.cache import IndexerKCache
    from dsa_indexer.ops.common.gluon import _PAGE_DESCRIPTORS
    from dsa_indexer.ops.logits.gluon_decode import _tma_pages, kernel_constants

    config = CONFIGS["large"]
    cache = IndexerKCache(4, block_size=64, head_dim=128, fmt="fp8")
    first = _tma_pages(cache, config)
    assert _tma_pages(cache, config) is first
    assert first[0].base.data_ptr() == cache.buffer.data_ptr()
    other = IndexerKCache(4, block_size=64, head_dim=128, fmt="fp8")
    assert _tma_pages(other, config)[0].base.data_ptr() == other.buffer.data_ptr()
    cache.buffer = torch.zeros_like(cache.buffer)
    rebuilt = _tma_pages(cache, config)
    assert rebuilt is not first and rebuilt[0].base.data_ptr() == cache.buffer.data_ptr()
    mxfp4 = IndexerKCache(4, block_size=64, head_dim=128, fmt="mxfp4")
    mxfp4_pages = gluon_decode_mxfp4._tma_pages(mxfp4, gluon_decode_mxfp4.GLUON_MXFP4_DECODE_CONFIG)
    assert mxfp4_pages is gluon_decode_mxfp4._tma_pages(mxfp4, gluon_decode_mxfp4.GLUON_MXFP4_DECODE_CONFIG)
    assert mxfp4_pages[0].block_shape == [64, 64]
    held = len(_PAGE_DESCRIPTORS)
    del cache, other, mxfp4, first, rebuilt, mxfp4_pages
    gc.collect()
    assert len(_PAGE_DESCRIPTORS) == held - 3
    constants = kernel_constants(64, 128, 64, 2, True, 16, config, query_slots=1, tma_pages=True)
    assert kernel_constants(64, 128, 64, 2, True, 16, config, query_slots=1, tma_pages=True) is constants
    with pytest.raises(TypeError):
        constants["ROWS"] = 1


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("persistent", [False, True])
def test_gluon_decode_replays_in_a_cuda_graph_with_changed_lengths_gpu(kernel_device, persistent):
    """The launcher reads nothing back to the host: captured once, replayed after the lengths change in
    place, it matches the reference on the new values."""
    from dsa_indexer.ops.logits.gluon_decode import paged_mqa_logits_gluon

    config = replace(CONFIGS["large-copies"], persistent_per_sm=1 if persistent else 0)
    inputs = decode_inputs("fp8", [[900, 901], [0, 64], [300, 17]], 2, kernel_device, heads=64, block_size=64,
                           seed=46)
    out = torch.full((6, inputs.max_context_len), POISON, device=kernel_device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_mqa_logits_gluon(*inputs.args(), True, out, config=config)
    inputs.context_lens.copy_(torch.tensor([[5, 640], [63, 0], [300, 299]], dtype=torch.int32))
    graph.replay()
    assert calc_diff(out, run_decode(inputs, "reference", True, 0)) < TIER


# Work sizes and Hopper SM counts (H20 78, H100 PCIe 114, H100 SXM / H200 132, the full die 144) the dispatch
# properties are checked on.
SM_COUNTS = (78, 114, 132, 144)
BATCHES = (1, 2, 3, 5, 8, 13, 16, 31, 32, 50, 64, 100, 128, 200, 256, 512, 1024)
LENGTHS = (1, 64, 1000, 4096, 10000, 16384, 32768, 50000, 65536, 100000, 131072, 262144, 1 << 20, 1 << 21)
NEXT_NS = (1, 2, 3, 4, 8)


def _rule(fmt: str):
    return gluon_decode.gluon_decode_preferred if fmt == "fp8" else gluon_decode_mxfp4.gluon_mxfp4_decode_preferred


def _never_back_to_triton(choices: list[bool]) -> bool:
    return all(earlier <= later for earlier, later in zip(choices, choices[1:]))


@needs_gluon
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_gluon_decode_rule_is_monotone_in_work_size(fmt):
    """More keys per request, more requests or more draft rows never turn a Gluon choice back into Triton.
    The rule reads the call's host integers only, no SM count, so this holds on every Hopper part; it gives
    both kernels some work sizes."""
    import inspect

    rule = _rule(fmt)
    assert list(inspect.signature(rule).parameters) == ["batch", "next_n", "max_context_len"]
    grid = {(b, n, length): rule(b, n, length) for b in BATCHES for n in NEXT_NS for length in LENGTHS}
    for n in NEXT_NS:
        for b in BATCHES:
            assert _never_back_to_triton([grid[b, n, length] for length in LENGTHS]), (b, n)
        for length in LENGTHS:
            assert _never_back_to_triton([grid[b, n, length] for b in BATCHES]), (n, length)
    for b in BATCHES:
        for length in LENGTHS:
            assert _never_back_to_triton([grid[b, n, length] for n in NEXT_NS]), (b, length)
    assert set(grid.values()) == {False, True}


@needs_gluon
@pytest.mark.parametrize("sms", SM_COUNTS)
def test_gluon_decode_configs_are_shipped_ones_and_one_wave_only_where_it_fills(sms):
    """Whatever the SM count, each launcher's default configuration is one of its shipped configurations (each
    tested against the reference on the GPU), and a one-wave configuration is picked only where its wave is
    filled."""
    mxfp4 = gluon_decode_mxfp4
    fp8_swept = set(SHIPPED.values())
    mxfp4_swept = {mxfp4.GLUON_MXFP4_DECODE_CONFIG, mxfp4.GLUON_MXFP4_DECODE_CONFIG_WAVE,
                   mxfp4.GLUON_MXFP4_DECODE_CONFIG_ONE_ROW}
    for b in BATCHES:
        for n in NEXT_NS:
            for length in LENGTHS:
                fp8_config = gluon_decode.gluon_decode_config(b, n, length, sms)
                mxfp4_config = mxfp4.gluon_mxfp4_decode_config(b, n, length, sms)
                assert fp8_config in fp8_swept and mxfp4_config in mxfp4_swept, (b, n, length)
                for config, wave in ((fp8_config, gluon_decode.GLUON_DECODE_CONFIG_WAVE),
                                     (mxfp4_config, mxfp4.GLUON_MXFP4_DECODE_CONFIG_WAVE)):
                    if config == wave:
                        assert wave_fills(config, b, n, length, sms), (b, n, length)


@needs_gluon
@pytest.mark.parametrize("sms", SM_COUNTS)
def test_wave_split_covers_every_key_tile_within_one_wave_where_it_can(sms):
    """The one-wave split: even splits that cover each row group's key tiles exactly (no empty split), as many
    per group as the slots allow, one wave whenever the row groups fit the slots, and a fill in (0, 1]."""
    for per_sm in (1, 3, 4):
        slots = per_sm * sms
        for groups in (1, 2, 3, 7, 50, 100, slots - 1, slots, slots + 1, 3 * slots + 5):
            for key_tiles in (1, 2, 63, 64, 512, 2048, 4097):
                tiles, fill = wave_split(groups, key_tiles, per_sm, sms)
                splits = -(-key_tiles // tiles)
                assert tiles >= 1 and (splits - 1) * tiles < key_tiles <= splits * tiles
                assert splits <= max(1, slots // groups)
                assert 0 < fill <= 1
                if groups <= slots:
                    assert groups * splits <= slots


def test_decode_kernel_is_triton_off_hopper_and_when_forced(monkeypatch):
    """CPU tensors and the interpreter always take the Triton kernel; the environment switch is
    validated."""
    from dsa_indexer.ops.logits import DECODE_KERNEL_ENV, decode_kernel

    for fmt in ("fp8", "mxfp4"):
        inputs = decode_inputs(fmt, [40], 2, "cpu", heads=4, block_size=64)
        monkeypatch.delenv(DECODE_KERNEL_ENV, raising=False)
        assert decode_kernel(inputs.q, inputs.cache, 1 << 30) == "triton"
        monkeypatch.setenv(DECODE_KERNEL_ENV, "gluon")
        assert decode_kernel(inputs.q, inputs.cache, 1 << 30) == "triton"
    monkeypatch.setenv(DECODE_KERNEL_ENV, "cuda")
    with pytest.raises(ValueError, match=DECODE_KERNEL_ENV):
        decode_kernel(inputs.q, inputs.cache, 1 << 30)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_decode_dispatch_follows_the_rule_and_each_choice_gives_the_reference_bits_gpu(kernel_device, monkeypatch, fmt):
    """``auto`` answers what the rule says for every work size on this card; forced ``gluon`` and ``triton``
    each give the reference's values within the tier with equal ``-inf`` masks and repeat their own bits, and
    the public op under ``auto`` gives the bits of the kernel it chose."""
    from dsa_indexer.ops.logits import DECODE_KERNEL_ENV, decode_kernel

    inputs = decode_inputs(fmt, [3000, 0], 2, kernel_device, heads=64, block_size=64, seed=47)
    batch = inputs.q.shape[0]
    for rows in (1, 2):
        for length in LENGTHS:
            expected_kernel = "gluon" if _rule(fmt)(batch, rows, length) else "triton"
            assert decode_kernel(inputs.q[:, :rows], inputs.cache, length) == expected_kernel, (rows, length)
    width = inputs.max_context_len
    expected = run_decode(inputs, "reference", True, 8)[:, :width]
    results = {}
    for kernel in ("gluon", "triton"):
        monkeypatch.setenv(DECODE_KERNEL_ENV, kernel)
        assert decode_kernel(inputs.q, inputs.cache, width) == kernel
        got = run_decode(inputs, "triton", True, 8)[:, :width]
        assert calc_diff(got, expected) < TIER
        assert torch.equal(got == NEG_INF, expected == NEG_INF)
        assert torch.equal(run_decode(inputs, "triton", True, 8)[:, :width].view(torch.int32), got.view(torch.int32))
        results[kernel] = got
    monkeypatch.delenv(DECODE_KERNEL_ENV)
    chosen = decode_kernel(inputs.q, inputs.cache, width)
    assert torch.equal(run_decode(inputs, "triton", True, 8)[:, :width].view(torch.int32), results[chosen].view(torch.int32))


@pytest.mark.gpu
@needs_hopper
def test_decode_kernel_stays_triton_where_gluon_cannot_run_gpu(kernel_device, monkeypatch):
    """The upcast path, a forced ``triton`` and shapes no Gluon kernel takes (MXFP4 ``head_dim`` 64) stay on
    Triton at any work size; a forced ``gluon`` takes the Gluon kernel at any work size."""
    from dsa_indexer.ops.logits import DECODE_KERNEL_ENV, decode_kernel

    fp8 = decode_inputs("fp8", [3000, 0], 2, kernel_device, heads=64, block_size=64, seed=47)
    mxfp4 = decode_inputs("mxfp4", [3000, 0], 2, kernel_device, heads=64, block_size=64, seed=47)
    mxfp4_d64 = decode_inputs("mxfp4", [300], 1, kernel_device, heads=64, dim=64, block_size=64, seed=48)
    largest, smallest = max(LENGTHS), min(LENGTHS)
    monkeypatch.setenv(DECODE_KERNEL_ENV, "gluon")
    for inputs in (fp8, mxfp4):
        assert decode_kernel(inputs.q, inputs.cache, smallest) == "gluon"
    assert decode_kernel(mxfp4_d64.q, mxfp4_d64.cache, largest) == "triton"
    mxfp8 = decode_inputs("fp8", [300], 1, kernel_device, heads=64, block_size=64, seed=49, scale_fmt="mxfp8")
    assert decode_kernel(mxfp8.q, mxfp8.cache, largest) == "triton"
    monkeypatch.setenv(FORCE_UPCAST_ENV, "1")
    for inputs in (fp8, mxfp4):
        assert decode_kernel(inputs.q, inputs.cache, largest) == "triton"
    monkeypatch.delenv(FORCE_UPCAST_ENV)
    monkeypatch.setenv(DECODE_KERNEL_ENV, "triton")
    for inputs in (fp8, mxfp4):
        assert decode_kernel(inputs.q, inputs.cache, largest) == "triton"
