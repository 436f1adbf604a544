"""The README's API example runs as written."""

from __future__ import annotations

from pathlib import Path

import torch


def test_readme_api_example_runs():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    section = text[text.index("## The API in ten lines"):]
    code = section[section.index("```python") + len("```python"): section.index("```", section.index("```python") + 9)]
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
