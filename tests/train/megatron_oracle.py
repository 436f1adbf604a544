"""megatron-core 0.19.2's ``FusedDSAIndexerLoss``, loaded from the registry wheel without megatron's imports.

The wheel (2.4 MB, Python 3.12 tag; its DSA files are plain Python) is fetched once with ``pip download``
into ``tests/.cache/`` (ignored by git). Importing ``megatron.core`` whole takes tens of seconds on a
small CPU, so only the four DSA files are read from the zip; their ``megatron`` imports are dropped and
the names those imports bound are given stubs (they appear only in annotations or in code the loss
never runs). Nothing from megatron is committed here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import types
import zipfile
from pathlib import Path

VERSION = "0.19.2"
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "megatron"
_PACKAGE = "megatron/core/transformer/experimental_attention_variant/"
# From dsa.py, the naive fused loss and what it calls.
_DSA_NAMES = {
    "compute_dsa_indexer_loss", "_compute_index_scores", "fused_qk_topk_naive", "fwd_fused_indexer_loss_naive",
    "bwd_fused_indexer_loss_naive", "FusedDSAIndexerLoss", "_FUSED_DSA_INDEXER_LOSS_INPUT_NAMES",
}


def wheel_path() -> Path:
    """The cached wheel, downloaded on first use; raises ``RuntimeError`` with pip's message on failure."""
    found = sorted(CACHE.glob(f"megatron_core-{VERSION}-*.whl"))
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--python-version", "3.12",
               "--only-binary=:all:", f"megatron-core=={VERSION}", "-d", str(CACHE)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    found = sorted(CACHE.glob(f"megatron_core-{VERSION}-*.whl"))
    if result.returncode != 0 or not found:
        raise RuntimeError(f"pip download megatron-core=={VERSION} failed: {result.stderr.strip()[-500:]}")
    return found[0]


def _keep(node: ast.stmt, names: set[str] | None) -> bool:
    if isinstance(node, ast.ImportFrom):
        return not (node.module or "").startswith("megatron")
    if isinstance(node, ast.Import):
        return not any(alias.name.startswith("megatron") for alias in node.names)
    if names is None:
        return isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.Try, ast.Expr))
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return node.name in names
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id in names for t in node.targets)
    return False


def _load(archive: zipfile.ZipFile, name: str, namespace: dict, names: set[str] | None = None) -> types.ModuleType:
    source = archive.read(_PACKAGE + name + ".py").decode()
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if _keep(node, names)]
    module = types.ModuleType(f"megatron_oracle.{name}")
    module.__dict__.update(namespace)
    exec(compile(tree, f"megatron-core-{VERSION}/{_PACKAGE}{name}.py", "exec"), module.__dict__)
    return module


def load_fused_loss():
    """``FusedDSAIndexerLoss`` (the class) from the wheel."""
    stubs = {n: object for n in ("PackedSeqParams", "AttnMaskType", "ProcessGroupCollection")}
    stubs["get_pg_size"] = lambda group=None: 1
    with zipfile.ZipFile(wheel_path()) as archive:
        loss_helpers = _load(archive, "dsa_indexer_loss", {})
        layout = _load(archive, "dsa_layout", stubs)
        masking = _load(archive, "dsa_masking", {**stubs, "dsa_layout": layout})
        dsa = _load(archive, "dsa", {**stubs, "dsa_layout": layout, "dsa_masking": masking,
                                     "dsa_indexer_loss": loss_helpers}, _DSA_NAMES)
    return dsa.FusedDSAIndexerLoss, masking


class _SingleRank:
    def size(self) -> int:
        return 1


class ProcessGroups:
    """The ``pg_collection`` stub: tensor parallelism of size 1."""

    tp = _SingleRank()
