"""Gluon warp-specialised FP8 decode logits (``ops/logits/gluon_decode.py``) against the PyTorch reference.

Tier (DESIGN.md §11): calc_diff < 5e-6 against the reference on the same quantised inputs with the ``-inf``
masks equal (the head sum runs in another order than the reference's), the same tier against the Triton
kernel, and 20 reruns with identical bits. Outputs go through padded row strides of a poisoned allocation
(the padding keeps its poison; with ``clean=False`` only the valid entries are written), and the paged
cache sits in a 0xFF-poisoned allocation (e4m3 NaN), so a read of a byte the kernel should not use shows.
Gluon kernels do not run under the Triton interpreter: every test here needs a CUDA GPU with wgmma.
"""

from __future__ import annotations

import pytest
import torch

from dsa_indexer import backend
from dsa_indexer.testing import calc_diff
from test_logits_kernel import NEG_INF, POISON, TIER, DecodeInputs, decode_inputs, run_decode

_HOPPER = (not backend.interpreter_enabled() and torch.cuda.is_available()
           and torch.cuda.get_device_capability()[0] >= 9)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _HOPPER,
                       reason="Gluon kernels cannot run under the Triton interpreter; they need a CUDA GPU with "
                              "wgmma (sm_90+): run scripts/gpu-check on an H100/H200"),
]


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


@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("next_n, lens", [(1, "1d"), (2, "1d"), (2, "2d"), (3, "2d"), (4, "1d")])
def test_gluon_decode_matches_reference_gpu(kernel_device, next_n, lens, clean):
    lengths = REQUEST_LENGTHS if lens == "1d" else [[max(0, n - 7 * t) for t in range(next_n)] for n in REQUEST_LENGTHS]
    inputs = decode_inputs("fp8", lengths, next_n, kernel_device, heads=64, block_size=64, seed=31 + next_n)
    check_gluon(inputs, clean)


@pytest.mark.parametrize("next_n", [1, 2])
def test_gluon_decode_single_request_long_context_gpu(kernel_device, next_n):
    inputs = decode_inputs("fp8", [40001], next_n, kernel_device, heads=64, block_size=64, extra_width=70, seed=41)
    check_gluon(inputs, clean=True)


def test_gluon_decode_small_pages_heads_and_dim_gpu(kernel_device):
    """Pages smaller than a key tile (one table entry per key), 3 heads (padded to 16), D = 64."""
    inputs = decode_inputs("fp8", [[13, 0], [700, 701], [0, 40]], 2, kernel_device, heads=3, dim=64, block_size=16,
                           seed=42)
    check_gluon(inputs, clean=True)
    check_gluon(inputs, clean=False)


def test_gluon_decode_one_row_per_program_gpu(kernel_device):
    """The benchmark's ``gluon-rows1`` configuration (one draft row per program) matches the reference."""
    from dsa_indexer.ops.logits.gluon_decode import GLUON_DECODE_CONFIG

    config = GLUON_DECODE_CONFIG[:4] + (1,) + GLUON_DECODE_CONFIG[5:]
    lengths = [[max(0, n - 7 * t) for t in range(2)] for n in REQUEST_LENGTHS]
    inputs = decode_inputs("fp8", lengths, 2, kernel_device, heads=64, block_size=64, seed=43)
    check_gluon(inputs, clean=True, config=config)


def test_gluon_decode_empty_rows_write_minus_inf_gpu(kernel_device):
    inputs = decode_inputs("fp8", [0, 0], 2, kernel_device, heads=64, block_size=64, extra_width=100, seed=44)
    result = run_gluon(inputs, True, 3)
    assert (result[:, :100] == NEG_INF).all() and (result[:, 100:] == POISON).all()
    assert (run_gluon(inputs, False, 3) == POISON).all()
