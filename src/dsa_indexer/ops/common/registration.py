"""Register a public op with ``torch.library`` where it is defined (namespace ``dsa_indexer``).

``registered_op`` makes the decorated function the body of the custom op ``torch.ops.dsa_indexer.<name>``,
with a fake implementation giving the output shapes (ops that only mutate their arguments get a no-op
fake), so ``torch.compile(fullgraph=True)`` traces through calls without graph breaks: the body, with its
checks that read device values, runs opaque at run time. Eager calls run the Python function directly:
the dispatcher's per-call overhead is measurable against microsecond kernels.

The decorated function's signature must be one ``torch.library`` can describe (tensors, ints, floats,
bools, strings, dtypes, ``Optional`` of those, keyword-only arguments); a public function whose arguments
are richer (a cache object, an ``out=`` destination, an optional result) is a thin Python function over
its registered ops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

NAMESPACE = "dsa_indexer"


def _no_result(*args, **kwargs) -> None:
    return None


def registered_op(
    name: str, *, fake: Callable | None = None, mutates_args: Iterable[str] = ()
) -> Callable[[Callable], Callable]:
    """Decorator: register the function as ``torch.ops.dsa_indexer.<name>``; return its eager bypass.

    Args:
        name: the op name (stable: users and tests refer to ``torch.ops.dsa_indexer.<name>``).
        fake: the shape function, called with the op's arguments on fake tensors; ``None`` for an op
            that returns nothing (it only writes ``mutates_args``).
        mutates_args: names of the tensor arguments the op writes.

    The returned function runs the Python body outside ``torch.compile`` and the op while compiling;
    ``.op`` is the ``OpOverload``.
    """
    mutated = tuple(mutates_args)

    def decorate(function: Callable) -> Callable:
        custom = torch.library.custom_op(f"{NAMESPACE}::{name}", function, mutates_args=mutated)
        custom.register_fake(fake if fake is not None else _no_result)
        overload = custom._opoverload

        @functools.wraps(function)
        def dispatching(*args, **kwargs):
            if torch.compiler.is_compiling():
                return overload(*args, **kwargs)
            return function(*args, **kwargs)

        dispatching.op = overload
        return dispatching

    return decorate
