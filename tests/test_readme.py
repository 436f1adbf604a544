"""The README's API example runs as written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsa_indexer.testing import assert_topk_exact


def _python_blocks(section: str) -> list[str]:
    """The ```python blocks of a README section, in order."""
    text = (Path(__file__).parent.parent / "README.md").read_text()
    body = text[text.index(section):]
    body = body[: body.find("\n## ", len(section))]
    return [block.split("```", 1)[0] for block in body.split("```python")[1:]]


def test_readme_api_example_runs():
    code = _python_blocks("## The API in ten lines")[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    indices, slots = namespace["indices"], namespace["slots"]
    assert indices.shape == (4, 512) and indices.dtype == torch.int32
    assert bool((indices[:, 1:] > indices[:, :-1]).all())
    assert bool((slots >= 0).all())


def test_readme_training_example_runs():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    section = text[text.index("## Training"):]
    start = section.index("```python") + len("```python")
    namespace: dict = {}
    exec(compile(section[start: section.index("```", start)], "README.md", "exec"), namespace)
    loss, q = namespace["loss"], namespace["q"]
    assert loss.dtype == torch.float32 and loss.item() > 0
    assert q.grad is not None and q.grad.shape == q.shape and bool(q.grad.abs().sum() > 0)


def test_readme_prefill_recipe_runs_with_arange_bounds():
    """The prefill block passes ``torch.arange``'s int64 ``ks``/``ke`` to both ``mqa_logits`` and ``topk``."""
    api, prefill = _python_blocks("## The API in ten lines")
    namespace: dict = {}
    exec(compile(api + prefill, "README.md", "exec"), namespace)
    ks, ke, logits, indices = (namespace[name] for name in ("ks", "ke", "logits", "prefill_indices"))
    assert ks.dtype == ke.dtype == torch.int64
    assert indices.shape == (4, 2048) and indices.dtype == torch.int32
    assert_topk_exact(logits, indices, 2048, starts=ks, ends=ke)
    # Row t sees exactly its 997 + t keys (no -inf among them): the first 997 + t columns, then -1.
    for row, visible in enumerate(ke.tolist()):
        assert torch.equal(indices[row, :visible], torch.arange(visible, dtype=torch.int32))
        assert bool((indices[row, visible:] == -1).all())


def test_the_license_ships_with_the_package_metadata():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (root / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert any(c.startswith("Programming Language :: Python :: 3") for c in project["classifiers"])
