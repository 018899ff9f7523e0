"""Causal selectors: the ops that feed, or are fed by, the ops another selector picks.

``tl.upstream(sel)`` matches every op some match of ``sel`` depends on through data (its parents, their
parents, ...): the op-level receptive field. ``tl.downstream(sel)`` matches every op that depends on a match:
the projective field. A match itself is included only when it feeds (or is fed by) another match; add it with
``| sel``. Both combine with ``&``, ``|`` and ``~`` like any selector, and need a finished trace: they work in
``trace.select``, ``trace.fork().do(...)`` and replays, not as capture options (later ops are not known while
the model runs).

Example:
    >>> feeds_head = trace.select(tl.upstream(tl.module("head")) & tl.func("addmm"))
    >>> after_relu = trace.select(tl.downstream(tl.label("relu_1")) & tl.in_module("layer2"))
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from .selectors import Selector


class _Causal(Selector):
    needs_trace = True
    _direction = ""

    def __init__(self, inner: Selector) -> None:
        if not isinstance(inner, Selector):
            raise TypeError(
                f"tl.{self._direction}() expects a selector such as tl.label('relu_1'), got {inner!r}"
            )
        self.inner = inner
        self._cache: tuple[Any, int, frozenset[int]] | None = (
            None  # (weak trace, its length, the ops matched)
        )

    def match(self, op: Any) -> bool:
        trace = getattr(op, "_trace", None)
        if trace is None:
            raise TypeError(
                f"{self!r} needs a finished trace: use it with trace.select(...) or trace.fork().do(...), not while "
                "capturing"
            )
        cache = self._cache
        if cache is None or cache[0]() is not trace or cache[1] != len(trace):
            cache = self._cache = (weakref.ref(trace), len(trace), frozenset(self._closure(trace)))
        return op.index in cache[2]

    def _closure(self, trace: Any) -> set[int]:
        edges = trace.columns["parents"] if self._direction == "upstream" else trace.children
        seeds = [op.index for op in trace if self.inner.match(op)]
        found: set[int] = set()
        stack = [n for s in seeds for n in edges[s]]
        while stack:
            i = stack.pop()
            if i not in found:
                found.add(i)
                stack.extend(edges[i])
        return found

    def __repr__(self) -> str:
        return f"tl.{self._direction}({self.inner!r})"


class upstream(_Causal):  # noqa: N801 - the public spelling is tl.upstream(...)
    """Ops that a match of ``inner`` depends on through data (transitively): its receptive field.

    Example:
        >>> trace.select(tl.upstream(tl.label("addmm_1")))
    """

    _direction = "upstream"


class downstream(_Causal):  # noqa: N801
    """Ops that depend through data (transitively) on a match of ``inner``: its projective field.

    Example:
        >>> trace.select(tl.downstream(tl.module("layer1")) & tl.func("relu"))
    """

    _direction = "downstream"


def selector_parts(selector: Selector) -> Iterator[Selector]:
    """``selector`` and every selector it is built from (through ``&``, ``|``, ``~`` and causal selectors)."""
    stack = [selector]
    while stack:
        s = stack.pop()
        yield s
        stack.extend(
            p for p in (getattr(s, "a", None), getattr(s, "b", None), getattr(s, "inner", None)) if p
        )


def check_capture_selector(value: Any, name: str) -> None:
    """ValueError naming option ``name`` when selector ``value`` needs a finished trace (a causal selector)."""
    if not isinstance(value, Selector):
        return
    for part in selector_parts(value):
        if getattr(part, "needs_trace", False):
            raise ValueError(
                f"{name}: {part!r} needs the finished trace (later ops are not known while the model runs); use "
                "it with trace.select(...) or trace.fork().do(...)"
            )
