"""Selectors pick ops of a trace: ``tl.func("relu") & tl.in_module("encoder")``.

A selector is used twice: while capturing (``save=<selector>``), against the op being recorded, and afterwards
(``trace.select(selector)``), against the finished trace. While capturing, an op's children are not known yet,
and ``tl.module(...)`` matches once the module returns (the op is then known to be its output).

Example:
    >>> sel = tl.func("relu") & ~tl.in_module("classifier")
    >>> [op.label for op in trace.select(sel)]
    ['relu_1', 'relu_2']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Selector:
    """Base class: a predicate over ops, combinable with ``&``, ``|`` and ``~``."""

    def match(self, op: Any) -> bool:
        raise NotImplementedError

    def __and__(self, other: Selector) -> Selector:
        return _And(self, _check(other, "&"))

    def __or__(self, other: Selector) -> Selector:
        return _Or(self, _check(other, "|"))

    def __invert__(self) -> Selector:
        return _Not(self)


def check_selection(value: Any, name: str) -> Any:
    """``value`` if it is a valid choice of ops for option ``name`` (True: all, None: none, or a selector)."""
    if value is True or value is None or isinstance(value, Selector):
        return value
    raise ValueError(
        f"{name} must be True (all ops), None (none) or a selector such as tl.func('relu'); got {value!r}"
    )


def _check(other: Any, op: str) -> Selector:
    if not isinstance(other, Selector):
        raise TypeError(f"selector {op} expects another selector (tl.func, tl.in_module, ...), got {other!r}")
    return other


def _names(kind: str, values: tuple[Any, ...]) -> tuple[str, ...]:
    if not values:
        raise ValueError(f"tl.{kind}() needs at least one name")
    for v in values:
        if not isinstance(v, str):
            raise TypeError(f"tl.{kind}() expects str names, got {v!r} ({type(v).__name__})")
    return values


class _And(Selector):
    def __init__(self, a: Selector, b: Selector) -> None:
        self.a, self.b = a, b

    def match(self, op: Any) -> bool:
        return self.a.match(op) and self.b.match(op)

    def __repr__(self) -> str:
        return f"({self.a!r} & {self.b!r})"


class _Or(Selector):
    def __init__(self, a: Selector, b: Selector) -> None:
        self.a, self.b = a, b

    def match(self, op: Any) -> bool:
        return self.a.match(op) or self.b.match(op)

    def __repr__(self) -> str:
        return f"({self.a!r} | {self.b!r})"


class _Not(Selector):
    def __init__(self, a: Selector) -> None:
        self.a = a

    def match(self, op: Any) -> bool:
        return not self.a.match(op)

    def __repr__(self) -> str:
        return f"~{self.a!r}"


class func(Selector):  # noqa: N801 - the public spelling is tl.func(...)
    """Ops whose short name is one of ``names``; ``func("relu")`` also matches the in-place ``relu_``, and
    ``func("softmax")`` the ``_softmax`` that ATen runs for ``torch.softmax`` (a composite op reaches the
    dispatcher as its underscored implementation: ``_softmax``, ``_log_softmax``, ``_unsafe_view``).

    Example:
        >>> trace.select(tl.func("relu", "addmm"))
    """

    def __init__(self, *names: str) -> None:
        self.names = frozenset(_names("func", names))
        if "" in self.names:
            raise ValueError("tl.func() names must be op names such as 'relu', got ''")

    def match(self, op: Any) -> bool:
        name = op.func
        names = self.names
        return (
            name in names
            or (name.endswith("_") and name[:-1] in names)
            or (name.startswith("_") and name[1:] in names)
        )

    def __repr__(self) -> str:
        return f"tl.func({', '.join(map(repr, sorted(self.names)))})"


class in_module(Selector):  # noqa: N801
    """Ops issued inside the module at ``address`` or any of its submodules.

    Example:
        >>> trace.select(tl.in_module("encoder.layers.0"))
    """

    def __init__(self, address: str) -> None:
        (self.address,) = _names("in_module", (address,))
        self._prefix = address + "."

    def match(self, op: Any) -> bool:
        address, prefix = self.address, self._prefix
        return any(a == address or a.startswith(prefix) for a in op.module_stack)

    def __repr__(self) -> str:
        return f"tl.in_module({self.address!r})"


class module(Selector):  # noqa: N801
    """Ops whose output is (part of) the output of the module at ``address``.

    Example:
        >>> trace.select(tl.module("layer1.0"))   # the op that produced layer1.0's output
    """

    def __init__(self, address: str) -> None:
        (self.address,) = _names("module", (address,))

    def match(self, op: Any) -> bool:
        return self.address in op.output_of

    def __repr__(self) -> str:
        return f"tl.module({self.address!r})"


class label(Selector):  # noqa: N801
    """Ops with one of the given labels (``"relu_2"``).

    Example:
        >>> trace.select(tl.label("conv2d_1", "relu_1"))
    """

    def __init__(self, *labels: str) -> None:
        self.labels = frozenset(_names("label", labels))

    def match(self, op: Any) -> bool:
        return op.label in self.labels

    def __repr__(self) -> str:
        return f"tl.label({', '.join(map(repr, sorted(self.labels)))})"


class where(Selector):  # noqa: N801
    """Ops for which ``predicate(op)`` is true.

    Example:
        >>> trace.select(tl.where(lambda op: op.flops > 1e6))
    """

    def __init__(self, predicate: Callable[[Any], bool]) -> None:
        if not callable(predicate):
            raise TypeError(f"tl.where() expects a callable taking an op, got {predicate!r}")
        self.predicate = predicate

    def match(self, op: Any) -> bool:
        return bool(self.predicate(op))

    def __repr__(self) -> str:
        return f"tl.where({getattr(self.predicate, '__name__', self.predicate)!r})"
