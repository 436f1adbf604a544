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

from dsa_indexer import backend
from dsa_indexer.ops.logits import _gluon_available
from dsa_indexer.testing import calc_diff

if _gluon_available():
    from dsa_indexer.ops.logits import gluon_decode, gluon_decode_mxfp4
    from dsa_indexer.ops.logits.gluon_decode import GLUON_SWEEP_CONFIGS
else:  # a Triton without Gluon: these tests skip, the dispatch takes Triton
    GLUON_SWEEP_CONFIGS = {}
needs_gluon = pytest.mark.skipif(not _gluon_available(), reason="this Triton has no Gluon (triton.experimental.gluon)")

_HOPPER = (not backend.interpreter_enabled() and torch.cuda.is_available()
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
    """The benchmark's ``gluon-rows1`` configuration (one draft row per program) matches the reference."""
    from dsa_indexer.ops.logits.gluon_decode import GLUON_DECODE_CONFIG

    config = GLUON_DECODE_CONFIG[:4] + (1,) + GLUON_DECODE_CONFIG[5:]
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
@pytest.mark.parametrize("variant", ["persist1", *sorted(GLUON_SWEEP_CONFIGS)])
@pytest.mark.parametrize("next_n", [1, 2])
def test_gluon_decode_sweep_configs_give_the_default_bits_gpu(kernel_device, variant, next_n):
    """Every configuration the benchmark sweep times matches the reference and gives the default's bits
    (each draft row has its own accumulator whatever the schedule). ``persist1``: one persistent program
    per SM, so each program runs many work items (empty ones too) through the same ring and query slots."""
    config = GLUON_SWEEP_CONFIGS.get(variant, GLUON_SWEEP_CONFIGS["cta3-copies"][:8] + (1,))
    lengths = [[max(0, n - 7 * t) for t in range(next_n)] for n in REQUEST_LENGTHS + [0, 3000, 64 * 50]]
    inputs = decode_inputs("fp8", lengths, next_n, kernel_device, heads=64, block_size=64, seed=45)
    result = check_gluon(inputs, clean=True, config=config)
    assert torch.equal(result.view(torch.int32), run_gluon(inputs, True, 8).view(torch.int32))
    if variant == "persist1":
        check_gluon(inputs, clean=False, config=config)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("variant, next_n", [("persist2-early", 2), ("persist2-coarse-early-copies", 1),
                                             ("persist2-coarse-early-copies", 2), ("persist2-coarse-early-copies", 3),
                                             ("persist2-coarse-early", 2)])
def test_gluon_decode_early_table_reads_stay_inside_the_table_gpu(kernel_device, variant, next_n):
    """An output wider than the block table (splits that start past its last column) and short requests
    beside a long one (first entries past a request's length are garbage ids): the early first-entry read
    is masked by the table's width and never used for an item without tiles."""
    lengths = [[max(0, n - 7 * t) for t in range(next_n)] for n in (40001, 0, 65, 3000)]
    inputs = decode_inputs("fp8", lengths, next_n, kernel_device, heads=64, block_size=64, extra_width=5000,
                           seed=49)
    if _asks_tma(GLUON_SWEEP_CONFIGS[variant]):
        inputs = _aligned(inputs)
    check_gluon(inputs, clean=True, config=GLUON_SWEEP_CONFIGS[variant])
    check_gluon(inputs, clean=False, config=GLUON_SWEEP_CONFIGS[variant])


def _asks_tma(config: tuple) -> bool:
    return len(config) > 10 and bool(config[10])


def _aligned(inputs: DecodeInputs) -> DecodeInputs:
    """The same call on an unpadded, 16-byte aligned copy of the cache (a page stride that is a multiple of a
    key row: the TMA page copies' condition)."""
    from dsa_indexer.cache import IndexerKCache

    cache = inputs.cache
    aligned = IndexerKCache(cache.num_blocks, block_size=cache.block_size, head_dim=cache.head_dim, fmt="fp8",
                            buffer=cache.buffer.contiguous())
    return DecodeInputs(inputs.q, inputs.q_scale, aligned, inputs.weights, inputs.context_lens, inputs.block_table,
                        inputs.max_context_len)


TMA_VARIANTS = ["cta3", "persist2-coarse-early", "wave3-early", "persist4-one-row"]  # the defaults


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", ["mixed", "dim64", "long"])
@pytest.mark.parametrize("variant", TMA_VARIANTS)
def test_gluon_decode_tma_pages_give_the_copies_bits_gpu(kernel_device, variant, case):
    """Keys, scales and queries copied by TMA (config field 10) on aligned caches: the reference's tier and
    the bits of the same configuration with cp.async copies. ``mixed``: 64 heads, odd and even tile counts,
    empty splits, rows of different lengths (one row for the one-row configuration, two otherwise), clean or
    not, and the default's bits; ``dim64``: D = 64 (64-byte swizzle, four scale rows a tile), 3 heads (the
    query copies read 16 rows), 128-key pages (two tiles a page), next_n = 3 (an absent second row); ``long``:
    one long request. The padded caches of the other tests fall back to cp.async (the sweep test runs them)."""
    from dsa_indexer.ops.logits.gluon_decode import _tma_pages

    config = GLUON_SWEEP_CONFIGS[variant]
    copies = config[:5] + (4,) + config[6:10] + (0,) + config[11:]  # four cp.async warps, as where TMA cannot run
    next_n = 1 if config[4] == 1 else 2
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
@pytest.mark.parametrize("variant", ["cta3", "persist4-one-row"])
def test_gluon_decode_tma_falls_back_to_copies_gpu(kernel_device, variant):
    """A TMA configuration on caches the descriptors cannot take (padded page stride; 16-key pages with 3
    heads) runs four cp.async warps: the reference's tier, and the default's bits."""
    config = GLUON_SWEEP_CONFIGS[variant]
    lengths = [[max(0, n - 7 * t) for t in range(2)] for n in REQUEST_LENGTHS]
    padded = decode_inputs("fp8", lengths, 2, kernel_device, heads=64, block_size=64, seed=87)
    result = check_gluon(padded, True, config=config)
    assert torch.equal(result.view(torch.int32), run_gluon(padded, True, 8).view(torch.int32))
    small = decode_inputs("fp8", [[13, 0], [700, 701], [0, 40]], 2, kernel_device, heads=3, dim=64, block_size=16,
                          seed=88)
    check_gluon(_aligned(small), False, config=config)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("variant", ["cta3", "cta3-copies", "persist2-coarse-early", "wave3-early", "persist4-one-row"])
@pytest.mark.parametrize("block_size", [64, 16])
def test_gluon_decode_unchecked_wild_pages_and_lengths_gpu(kernel_device, variant, block_size, monkeypatch):
    """Value checks off: the TMA page copies (aligned cache, 64-key pages), the cp.async tile copies and the
    per-key copies (16-key pages) read nothing outside the cache (scripts/gpu-sanitize runs such a call under
    compute-sanitizer) and give the documented logits: a page outside the cache reads as zeros, a length past
    the width or the table stops there."""
    config = GLUON_SWEEP_CONFIGS[variant]
    aligned = _aligned if _asks_tma(config) and block_size == 64 else None
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

    config = GLUON_SWEEP_CONFIGS["cta3"]
    assert _tma_pages(IndexerKCache(4, block_size=64, head_dim=128, fmt="fp8"), config) is not None
    copies = GLUON_SWEEP_CONFIGS["cta3-copies"]
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
    from dsa_indexer.ops.logits.gluon_decode import _PAGE_DESCRIPTORS, _tma_pages, kernel_constants

    config = GLUON_SWEEP_CONFIGS["cta3"]
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

    config = GLUON_SWEEP_CONFIGS["cta3-copies"][:8] + (1 if persistent else 0,)
    inputs = decode_inputs("fp8", [[900, 901], [0, 64], [300, 17]], 2, kernel_device, heads=64, block_size=64,
                           seed=46)
    out = torch.full((6, inputs.max_context_len), POISON, device=kernel_device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_mqa_logits_gluon(*inputs.args(), True, out, config=config)
    inputs.context_lens.copy_(torch.tensor([[5, 640], [63, 0], [300, 299]], dtype=torch.int32))
    graph.replay()
    assert calc_diff(out, run_decode(inputs, "reference", True, 0)) < TIER


@needs_gluon
def test_gluon_decode_rule_by_work_size():
    """FP8: draft rows go to the Gluon kernel from 64K keys, one row from 1M keys (measured crossovers);
    MXFP4 from 1M keys, and draft rows from 128K keys where their one wave fills its slots."""
    preferred = gluon_decode.gluon_decode_preferred
    assert preferred(32, 2, 131072) and preferred(128, 2, 32768) and preferred(1, 2, 131072)
    assert preferred(32, 4, 32768) and not preferred(1, 2, 4096)
    assert preferred(32, 1, 131072) and preferred(128, 1, 32768) and preferred(32, 1, 32768)
    assert not preferred(1, 1, 131072) and not preferred(4, 1, 131072)

    def mxfp4(batch, next_n, length):
        return gluon_decode_mxfp4.gluon_mxfp4_decode_preferred(batch, next_n, length, 132)

    assert mxfp4(32, 1, 32768) and mxfp4(32, 2, 32768) and mxfp4(128, 2, 131072) and mxfp4(300, 2, 4096)
    assert mxfp4(1, 2, 131072) and mxfp4(2, 3, 65536) and mxfp4(4, 2, 32768)
    assert not mxfp4(1, 1, 131072) and not mxfp4(1, 2, 65536) and not mxfp4(100, 2, 2048)


@needs_gluon
def test_gluon_decode_config_by_work_size():
    """The FP8 launcher's default configuration: the one-row one at next_n = 1; with draft rows the
    three-programs-per-SM one from 4M keys, below it the one-wave one where its wave fills at least
    ``GLUON_WAVE_MIN_FILL`` of the slots and the persistent one elsewhere; each is one of the swept (and tested)
    configurations. MXFP4: the one-row configuration at next_n = 1; with draft rows the one-wave one where it
    fills its wave, else the three-programs-per-SM one; each is swept (and tested)."""
    config = gluon_decode.gluon_decode_config
    for batch, length in [(1, 131072), (32, 32768), (128, 131072)]:
        assert config(batch, 1, length, 132) == gluon_decode.GLUON_DECODE_CONFIG_ONE_ROW == (
            4, 8, 2, 32, 1, 1, 24, 64, 4, 0, 1)
    for batch, length, next_n in [(32, 131072, 2), (128, 32768, 2), (128, 131072, 2), (32, 131072, 4)]:
        assert config(batch, next_n, length, 132) == gluon_decode.GLUON_DECODE_CONFIG == (
            4, 8, 2, 32, 2, 1, 24, 80, 0, 0, 1)
    # One wave of 3 x 132 slots: B = 32 at L = 32K fills 384 (12 splits of 43 tiles), B = 1 at 128K 342 (6 tiles),
    # B = 16 at 64K 384; B = 256 at 8K only 256 (a split a request), B = 2 at 1K 64, B = 512 at 4K 512 (two waves,
    # the second 116 items).
    for batch, length, next_n in [(32, 32768, 2), (1, 131072, 2), (16, 65536, 2), (16, 32768, 4)]:
        assert config(batch, next_n, length, 132) == gluon_decode.GLUON_DECODE_CONFIG_WAVE
    for batch, length, next_n in [(256, 8192, 2), (2, 1024, 3), (100, 16384, 2), (512, 4096, 2)]:
        assert config(batch, next_n, length, 132) == gluon_decode.GLUON_DECODE_CONFIG_SMALL
    assert gluon_decode._wave_split(32, 512, 3, 132) == (43, 384 / 396)
    assert gluon_decode._wave_split(1, 2048, 3, 132) == (6, 342 / 396)
    assert gluon_decode._wave_split(512, 64, 3, 132) == (64, 512 / 792)
    assert gluon_decode.GLUON_DECODE_CONFIG_SMALL == (4, 4, 2, 32, 2, 1, 24, 128, 2, 1, 1)
    assert gluon_decode.GLUON_DECODE_CONFIG_WAVE == (4, 3, 2, 32, 2, 1, 24, 80, 0, 1, 1, 1)
    defaults = {gluon_decode.GLUON_DECODE_CONFIG, gluon_decode.GLUON_DECODE_CONFIG_SMALL,
                gluon_decode.GLUON_DECODE_CONFIG_ONE_ROW, gluon_decode.GLUON_DECODE_CONFIG_WAVE}
    assert defaults <= set(GLUON_SWEEP_CONFIGS.values())
    mxfp4 = gluon_decode_mxfp4
    assert mxfp4.GLUON_MXFP4_DECODE_CONFIG_ONE_ROW == (4, 8, 2, 32, 2, 1, 24, 64, 1)
    assert mxfp4.GLUON_MXFP4_DECODE_CONFIG == (4, 8, 2, 32, 2, 1, 24, 80, 1)
    assert mxfp4.GLUON_MXFP4_DECODE_CONFIG_WAVE == (4, 3, 2, 32, 2, 1, 24, 80, 1, 1)
    for batch, length in [(1, 131072), (32, 32768), (128, 131072)]:
        assert mxfp4.gluon_mxfp4_decode_config(batch, 1, length, 132) == mxfp4.GLUON_MXFP4_DECODE_CONFIG_ONE_ROW
    for batch, length, next_n in [(32, 32768, 2), (1, 131072, 2), (16, 32768, 4), (32, 131072, 2), (128, 131072, 2)]:
        assert mxfp4.gluon_mxfp4_decode_config(batch, next_n, length, 132) == mxfp4.GLUON_MXFP4_DECODE_CONFIG_WAVE
    for batch, length, next_n in [(256, 8192, 2), (512, 4096, 2), (100, 16384, 2)]:
        assert mxfp4.gluon_mxfp4_decode_config(batch, next_n, length, 132) == mxfp4.GLUON_MXFP4_DECODE_CONFIG
    from dsa_indexer.bench.suite_logits import GLUON_SWEEP_VARIANTS

    swept = {spec["config"] for spec in GLUON_SWEEP_VARIANTS["mxfp4"].values()}
    assert {mxfp4.GLUON_MXFP4_DECODE_CONFIG, mxfp4.GLUON_MXFP4_DECODE_CONFIG_ONE_ROW,
            mxfp4.GLUON_MXFP4_DECODE_CONFIG_WAVE} <= swept


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
def test_decode_kernel_dispatch_on_hopper_gpu(kernel_device, monkeypatch):
    """``auto`` follows the rule for both formats; ``gluon``/``triton`` force it; the upcast path and shapes
    a Gluon kernel does not take stay on Triton; the public op runs the chosen kernel (same bits as calling
    it directly)."""
    from dsa_indexer.ops.logits import DECODE_KERNEL_ENV, decode_kernel
    from dsa_indexer.ops.logits.gluon_decode_mxfp4 import paged_mqa_logits_gluon_mxfp4

    fp8 = decode_inputs("fp8", [3000, 0], 2, kernel_device, heads=64, block_size=64, seed=47)
    mxfp4 = decode_inputs("mxfp4", [3000, 0], 2, kernel_device, heads=64, block_size=64, seed=47)
    mxfp4_d64 = decode_inputs("mxfp4", [300], 1, kernel_device, heads=64, dim=64, block_size=64, seed=48)
    assert decode_kernel(fp8.q, fp8.cache, 1 << 20) == "gluon"
    assert decode_kernel(fp8.q, fp8.cache, 1024) == "triton"
    assert decode_kernel(fp8.q[:, :1], fp8.cache, 1 << 19) == "gluon"  # 2 x 512K keys
    assert decode_kernel(fp8.q[:, :1], fp8.cache, 1 << 18) == "triton"
    assert decode_kernel(mxfp4.q, mxfp4.cache, 1 << 19) == "gluon"
    assert decode_kernel(mxfp4.q[:, :1], mxfp4.cache, 1 << 19) == "gluon"
    assert decode_kernel(mxfp4.q, mxfp4.cache, 1 << 18) == "triton"
    monkeypatch.setenv(DECODE_KERNEL_ENV, "gluon")
    assert decode_kernel(fp8.q, fp8.cache, 1024) == "gluon"
    assert decode_kernel(mxfp4.q, mxfp4.cache, 1024) == "gluon"
    assert decode_kernel(mxfp4_d64.q, mxfp4_d64.cache, 1 << 30) == "triton"
    mxfp8 = decode_inputs("fp8", [300], 1, kernel_device, heads=64, block_size=64, seed=49, scale_fmt="mxfp8")
    assert decode_kernel(mxfp8.q, mxfp8.cache, 1 << 30) == "triton"
    forced = run_decode(fp8, "triton", True, 8)
    assert torch.equal(forced[:, :fp8.max_context_len].view(torch.int32),
                       run_gluon(fp8, True, 8)[:, :fp8.max_context_len].view(torch.int32))
    width = mxfp4.max_context_len
    direct = torch.full((4, width), POISON, device=kernel_device)
    paged_mqa_logits_gluon_mxfp4(*mxfp4.args(), True, direct)
    assert torch.equal(run_decode(mxfp4, "triton", True, 8)[:, :width].view(torch.int32), direct.view(torch.int32))
    monkeypatch.setenv(FORCE_UPCAST_ENV, "1")
    assert decode_kernel(fp8.q, fp8.cache, 1 << 20) == "triton"
    assert decode_kernel(mxfp4.q, mxfp4.cache, 1 << 20) == "triton"
    monkeypatch.setenv(DECODE_KERNEL_ENV, "triton")
    monkeypatch.delenv(FORCE_UPCAST_ENV)
    assert decode_kernel(fp8.q, fp8.cache, 1 << 20) == "triton"
    assert decode_kernel(mxfp4.q, mxfp4.cache, 1 << 20) == "triton"
