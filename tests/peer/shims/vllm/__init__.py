"""Stand-in for the ``vllm`` package: the indexer ops route to ``dsa_indexer.compat`` (see tests/peer/README.md).

Submodules that are not shimmed import as placeholders: importing a name works, calling it raises.
"""

import importlib.abc
import importlib.machinery
import sys
import types

import torch

from dsa_indexer.compat import vllm_ops


class _Placeholder:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str) -> "_Placeholder":
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Placeholder(f"{self._name}.{attribute}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is not shimmed (not part of the indexer API)")


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, attribute: str) -> _Placeholder:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Placeholder(f"{self.__name__}.{attribute}")


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: answers only for ``vllm.*`` modules no shim file provides."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("vllm."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(finder, _PlaceholderFinder) for finder in sys.meta_path):
    sys.meta_path.append(_PlaceholderFinder())

# The tests call some ops through torch.ops._C, as vLLM registers them.
torch.ops._C.top_k_per_row_prefill = vllm_ops.top_k_per_row_prefill
torch.ops._C.top_k_per_row_decode = vllm_ops.top_k_per_row_decode
