"""What a capture window records: one frozen dataclass taken by ``tl.capture``, ``tl.arm`` and the Lightning
callback, so the option list is written and checked once."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from .causal import check_capture_selector
from .edits import check_interventions
from .selectors import check_selection


@dataclass(frozen=True)
class CaptureOptions:
    """What each capture window records (besides every op's metadata, timing and FLOPs, always recorded).

    Args:
        save: op outputs to keep: ``True`` all, ``None`` none (metadata only), or a selector
            (``tl.func("relu") | tl.in_module("classifier")``).
        save_grads: forward ops whose output gradient (of the loss backward runs on in the window) is kept:
            ``True``, ``None`` or a selector.
        stats: ops whose output statistics (mean, std, min, max, L2 norm, zero fraction, NaN and Inf counts) are
            recorded, and their gradient's when backward runs: ``True`` (forward ops that compute values),
            ``None`` or a selector (any op, backward and optimizer ops included).
        source: record file:line of the user code that issued each op.
        keep_graph: keep saved outputs attached to autograd, so a loss can be built from them.
        intervene: edits applied as the model runs: ``tl.when(selector, edit)`` or a list of them, applied in
            order (see :mod:`tl_dist.edits` and ``docs/interventions.md``).

    Example:
        >>> opts = tl.CaptureOptions(stats=True, save=tl.func("softmax"))
        >>> tl.arm("runs/job42", options=opts, every=50)
        >>> with tl.capture(options=opts) as cap: ...
    """

    save: Any = None
    save_grads: Any = None
    stats: Any = None
    source: bool = True
    keep_graph: bool = False
    intervene: Any = None

    def __post_init__(self) -> None:
        for name in ("save", "save_grads", "stats"):
            check_selection(getattr(self, name), name)
            check_capture_selector(getattr(self, name), name)
        object.__setattr__(self, "intervene", check_interventions(self.intervene))  # frozen: normalised once
        for name in ("source", "keep_graph"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")

    @property
    def records_tensors(self) -> bool:
        """Whether windows keep tensors (outputs or gradients), not only metadata and statistics."""
        return self.save is not None or self.save_grads is not None

    def updated(self, **changes: Any) -> CaptureOptions:
        """A copy with the given options changed; a name that is not an option raises ValueError. Options made
        only of bools and Nones are one shared instance per combination (frozen: every window that asks for
        them, such as ``tl.trace``'s defaults or ``tl.capture(save=True)``, can use it).

        Example:
            >>> DEFAULT_OPTIONS.updated(save=True) is DEFAULT_OPTIONS.updated(save=True)
            True
        """
        unknown = sorted(set(changes) - set(_NAMES))
        if unknown:
            raise ValueError(f"unknown capture options {unknown}; options: {list(_NAMES)}")
        values = tuple(changes[name] if name in changes else getattr(self, name) for name in _NAMES)
        if not _plain(values):
            return replace(self, **changes)
        opts = _SHARED.get(values)
        if opts is None:
            opts = _SHARED[values] = CaptureOptions(*values)
        return opts


_NAMES = tuple(f.name for f in fields(CaptureOptions))
# The shared options of bools and Nones, by their values: making and checking one costs ~50 us with the caches
# a forward emptied, as much as a small model's window records.
_SHARED: dict[tuple, CaptureOptions] = {}
_PLAIN_TYPES = frozenset((bool, type(None)))


def _plain(values: tuple) -> bool:
    # By type, not by value: 1 == True, and a window asking for source=1 must be told it is not a bool.
    return _PLAIN_TYPES.issuperset(map(type, values))


DEFAULT_OPTIONS = CaptureOptions()
"""The defaults (frozen: one instance serves every window and session that sets nothing)."""


def check_options(value: Any, name: str = "options") -> CaptureOptions:
    """``value`` if it is a :class:`CaptureOptions`, else a ValueError naming the argument."""
    if not isinstance(value, CaptureOptions):
        raise ValueError(f"{name} must be a tl.CaptureOptions, got {type(value).__name__}")
    return value
