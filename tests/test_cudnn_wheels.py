"""``scripts/cudnn-wheels`` without network or pip: its parts, manifest, stash and reassembly on stand-in wheels."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cudnn-wheels"


@pytest.fixture(scope="module")
def wheels_script():
    loader = importlib.machinery.SourceFileLoader("cudnn_wheels", str(SCRIPT))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


@pytest.fixture
def packed(tmp_path, wheels_script):
    """Three stand-in wheels packed into parts of at most 3000 bytes."""
    made = tmp_path / "made"
    made.mkdir()
    wheels = []
    for i, size in enumerate((2500, 10, 4000)):
        wheel = made / f"pkg{i}-1.0-py3-none-any.whl"
        wheel.write_bytes(os.urandom(size))
        wheels.append(wheel)
    folder = tmp_path / ".cudnn-wheels"
    manifest = wheels_script.pack(wheels, folder, 3000)
    return wheels, folder, manifest


def test_pack_cuts_one_tar_into_parts_with_a_manifest(packed):
    wheels, folder, manifest = packed
    assert json.loads((folder / "MANIFEST.json").read_text()) == manifest
    assert manifest["wheels"] == [wheel.name for wheel in wheels]
    sizes = [part["bytes"] for part in manifest["parts"]]
    assert len(sizes) >= 3 and max(sizes) <= 3000 and all(size == 3000 for size in sizes[:-1])
    assert sorted(path.name for path in folder.glob("part-*")) == sorted(part["name"] for part in manifest["parts"])


def test_stash_collects_parts_across_calls_and_assemble_restores_the_wheels(packed, tmp_path, wheels_script):
    wheels, folder, manifest = packed
    names = [part["name"] for part in manifest["parts"]]
    carried = {name: (folder / name).read_bytes() for name in names}
    kept = tmp_path / "kept"
    for name in names[1:]:
        (folder / name).unlink()
    assert wheels_script.stash(folder, kept) == names[1:]
    (folder / names[0]).unlink()
    for name in names[1:]:
        (folder / name).write_bytes(carried[name])
    assert wheels_script.stash(folder, kept) == []
    restored = wheels_script.assemble(manifest, kept, tmp_path / "out")
    assert [path.read_bytes() for path in restored] == [wheel.read_bytes() for wheel in wheels]


def test_a_damaged_part_is_refused(packed, tmp_path, wheels_script):
    _, folder, manifest = packed
    part = folder / manifest["parts"][0]["name"]
    part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(SystemExit):
        wheels_script.stash(folder, tmp_path / "kept")


def test_pythonpath_puts_the_target_and_the_dsl_packages_first(monkeypatch, wheels_script):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    target = Path("/tmp/site-cudnn")
    assert wheels_script.pythonpath(target).split(os.pathsep) == [
        str(target), str(target / "nvidia_cutlass_dsl" / "dsl_packages"), "/elsewhere"]
