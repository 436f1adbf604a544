"""Backend choice: argument, environment override, and refusal of impossible requests."""

from __future__ import annotations

import pytest
import torch

from dsa_indexer import backend


def reference_impl():
    return "reference"


def triton_impl():
    return "triton"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_auto_on_cpu_is_reference():
    assert backend.dispatch(reference_impl, triton_impl, "auto", torch.device("cpu"))() == "reference"


@pytest.mark.skipif(not backend.triton_available(), reason="triton is not installed")
def test_auto_on_cuda_is_triton_when_a_kernel_exists():
    assert backend.dispatch(reference_impl, triton_impl, "auto", torch.device("cuda"))() == "triton"
    assert backend.dispatch(reference_impl, None, "auto", torch.device("cuda"))() == "reference"


def test_environment_sets_what_auto_means(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "reference")
    assert backend.dispatch(reference_impl, triton_impl, "auto", torch.device("cuda"))() == "reference"
    assert backend.dispatch(reference_impl, triton_impl, "triton", torch.device("cuda"))() == "triton"


def test_explicit_triton_on_cpu_without_interpreter_raises():
    with pytest.raises(ValueError, match="backend='triton'"):
        backend.dispatch(reference_impl, triton_impl, "triton", torch.device("cpu"))


@pytest.mark.skipif(not backend.triton_available(), reason="triton is not installed")
def test_explicit_triton_on_cpu_with_interpreter_is_allowed(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.dispatch(reference_impl, triton_impl, "triton", torch.device("cpu"))() == "triton"
    assert backend.dispatch(reference_impl, triton_impl, "auto", torch.device("cpu"))() == "reference"


@pytest.mark.parametrize("value", ["cuda", "", "Triton"])
def test_unknown_backend_names_the_source(monkeypatch, value):
    with pytest.raises(ValueError, match="backend must be one of"):
        backend.requested_backend(value or "fast")
    if value:
        monkeypatch.setenv(backend.ENV_VAR, value)
        with pytest.raises(ValueError, match=backend.ENV_VAR):
            backend.requested_backend("auto")


def test_import_does_not_initialise_cuda():
    import subprocess
    import sys

    code = "import dsa_indexer, torch; print(torch.cuda.is_initialized())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_value_checks_can_be_turned_off_but_shape_checks_cannot(monkeypatch):
    from dsa_indexer import topk
    from dsa_indexer._validation import SKIP_VALUE_CHECKS_ENV, value_checks_enabled

    logits = torch.randn(2, 8)
    bad_ends = torch.tensor([8, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="ends"):
        topk(logits, 2, ends=bad_ends)
    monkeypatch.setenv(SKIP_VALUE_CHECKS_ENV, "1")
    assert not value_checks_enabled()
    with pytest.raises(TypeError, match="ends"):
        topk(logits, 2, ends=bad_ends.float())


def test_explicit_backend_beats_the_environment_variable(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    assert backend.requested_backend("reference") == "reference"
    assert backend.requested_backend("auto") == "triton"
    monkeypatch.setenv(backend.ENV_VAR, "bogus")
    assert backend.requested_backend("reference") == "reference"
    with pytest.raises(ValueError, match="DSA_INDEXER_BACKEND"):
        backend.requested_backend("auto")
