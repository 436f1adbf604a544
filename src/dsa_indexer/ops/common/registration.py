"""Register a public op with ``torch.library`` where it is defined (namespace ``dsa_indexer``).

``registered_op`` makes the decorated function the body of the custom op ``torch.ops.dsa_indexer.<name>``,
with a fake implementation giving the output shapes (ops that only mutate their arguments get a no-op
fake), so ``torch.compile(fullgraph=True)`` traces through calls without graph breaks: the body, with its
checks that read device values, runs opaque at run time. Eager calls run the Python function directly:
the dispatcher's per-call overhead is measurable against microsecond kernels.

The decorated function's signature must be one ``torch.library`` can describe (tensors, ints, floats,
bools, strings, dtypes, ``Optional`` of those, keyword-only arguments); a public function whose arguments
are richer (a cache object, an optional result) is a thin Python function over its registered ops. An op
with an ``out=`` destination is one body registered twice by ``registered_op_with_out``: ``<name>``
returns a new result, ``<name>_out`` writes the destination.
"""

from __future__ import annotations

import functools
import inspect
import typing
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


def registered_op_with_out(
    name: str, *, fake: Callable, outs: tuple[str, ...] = ("out",)
) -> Callable[[Callable], Callable]:
    """Decorator over one body ``function(..., out: Tensor | None, ...) -> result`` (which returns ``out``
    when it is given): registers ``torch.ops.dsa_indexer.<name>`` (the body's signature without ``outs``,
    returning a new result; ``fake`` gives its shapes from those arguments) and ``<name>_out`` (with
    ``outs`` as tensors it writes, returning nothing). Returns the eager bypass, called with every argument
    of the body, positionally: the body outside ``torch.compile``; while compiling, ``<name>`` when every
    destination is None, else ``<name>_out`` (the result is then the destination, or the tuple of them).
    ``.op`` and ``.out_op`` are the two ``OpOverload``s."""
    def decorate(function: Callable) -> Callable:
        hints = typing.get_type_hints(function)
        parameters = [p.replace(annotation=hints[p.name]) for p in inspect.signature(function).parameters.values()]
        positions = [i for i, p in enumerate(parameters) if p.name in outs]
        if len(positions) != len(outs):
            raise TypeError(f"{function.__name__} must take the destinations {outs}")

        kept = inspect.Signature([p for p in parameters if p.name not in outs], return_annotation=hints["return"])
        written = inspect.Signature([p.replace(annotation=torch.Tensor) if p.name in outs else p for p in parameters],
                                    return_annotation=None)

        def returning(*args, **kwargs):
            full = list(kept.bind(*args, **kwargs).args if kwargs else args)
            for position in positions:
                full.insert(position, None)
            return function(*full)

        def writing(*args, **kwargs) -> None:
            function(*(written.bind(*args, **kwargs).args if kwargs else args))

        returning.__signature__, writing.__signature__ = kept, written
        for form, suffix in ((returning, ""), (writing, "_out")):
            form.__name__ = form.__qualname__ = f"{function.__name__}{suffix}"
            form.__module__ = function.__module__
        op = registered_op(name, fake=fake)(returning).op
        out_op = registered_op(f"{name}_out", mutates_args=outs)(writing).op

        @functools.wraps(function)
        def dispatching(*args):
            if not torch.compiler.is_compiling():
                return function(*args)
            destinations = [args[position] for position in positions]
            if all(d is None for d in destinations):
                return op(*(a for i, a in enumerate(args) if i not in positions))
            out_op(*args)
            return destinations[0] if len(destinations) == 1 else tuple(destinations)

        dispatching.op, dispatching.out_op = op, out_op
        return dispatching

    return decorate
