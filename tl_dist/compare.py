"""``tl.compare(a, b)``: where two traces of the same model diverge, op by op.

Ops are aligned by label (``relu_3`` in one trace is ``relu_3`` in the other: the same op when the model took
the same path) and compared on their saved outputs, all outputs of an op together, in float64:

- ``max_abs_diff``: ``max |a - b|``;
- ``rel_l2``: ``||a - b|| / ||a||`` (0 when both are zero, inf when only ``a`` is);
- ``cosine``: ``a . b / (||a|| ||b||)`` (1 when both are zero, NaN when one is).

Outputs no run reproduces are left out: uninitialised memory (``empty_like``) and kernel scratch space (the
workspace ``mkldnn_rnn_layer`` keeps for backward), as are outputs a kernel left undefined.

Example:
    >>> clean, edited = tl.trace(model, x), tl.trace(model, x, intervene=tl.when(tl.label("relu_2"), tl.scale(0.5)))
    >>> tl.compare(clean, edited).head()          # the ops that diverge most first
    >>> tl.compare(clean, edited, first=True).label
    'relu_2'
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ._common import local_tensor
from ._opinfo import UNINITIALISED, unreproducible_outputs
from .errors import TlDistError
from .trace import Op, Trace

_COLUMNS = (
    "label",
    "index_a",
    "index_b",
    "func",
    "module",
    "max_abs_diff",
    "rel_l2",
    "cosine",
    "differs",
    "note",
)


def _flat(outs: list | None) -> torch.Tensor | None:
    """All saved outputs of one op as one float64 vector (None when nothing was saved)."""
    parts = []
    for t in outs or ():
        if t is None:
            continue
        t = local_tensor(t).detach()  # a DTensor: its shard on this rank
        if t.is_complex():
            t = torch.view_as_real(t)
        parts.append(t.reshape(-1).to(device="cpu", dtype=torch.float64))
    return torch.cat(parts) if parts else None


def _reproducible(outs: list | None, func: str) -> list | None:
    """The saved outputs of a call of ``func`` that another run can reproduce: uninitialised memory and a
    kernel's scratch workspace (:func:`~tl_dist._opinfo.unreproducible_outputs`; their bytes differ between two
    runs of the same model) become None, and trailing Nones (outputs a kernel left undefined) are dropped."""
    if outs is None:
        return None
    skip = unreproducible_outputs(func, outs)
    kept = [None if k in skip else t for k, t in enumerate(outs)]
    while kept and kept[-1] is None:
        kept.pop()
    return kept


def _shapes(outs: list) -> tuple:
    return tuple(None if t is None else tuple(t.shape) for t in outs)


def divergence(
    ta: torch.Tensor, tb: torch.Tensor, atol: float, rtol: float
) -> tuple[float, float, float, bool]:
    """(max abs difference, relative L2, cosine, differs beyond ``atol + rtol * |b|``) of two float64 vectors."""
    if ta.numel() == 0:
        return 0.0, 0.0, 1.0, False
    both_nan = torch.isnan(ta) & torch.isnan(tb)
    diff = torch.where(both_nan, torch.zeros_like(ta), ta - tb)
    max_abs = float(diff.abs().max())
    norm_a, norm_b, norm_d = float(ta.norm()), float(tb.norm()), float(diff.norm())
    if norm_a == 0.0:
        rel = 0.0 if norm_d == 0.0 else math.inf
    else:
        rel = norm_d / norm_a
    if norm_a == 0.0 and norm_b == 0.0:
        cosine = 1.0
    elif norm_a == 0.0 or norm_b == 0.0:
        cosine = math.nan
    else:
        cosine = float(torch.dot(ta, tb)) / (norm_a * norm_b)
    differs = not torch.allclose(tb, ta, atol=atol, rtol=rtol, equal_nan=True)
    return max_abs, rel, cosine, differs


def _rows(a: Trace, b: Trace, atol: float, rtol: float) -> Any:
    """One tuple per label (``_COLUMNS`` order), a's ops in execution order, then b's ops that a lacks."""
    cols_a, cols_b = a.columns, b.columns
    b_labels = b.labels
    for i, lab in enumerate(cols_a["label"]):
        j = b_labels.get(lab)
        base = (lab, i, -1 if j is None else j, cols_a["func"][i], cols_a["module"][i])
        if j is None:
            yield (*base, math.nan, math.nan, math.nan, True, "only in a")
            continue
        outs_a = _reproducible(a.saved.get(i), cols_a["func"][i])
        outs_b = _reproducible(b.saved.get(j), cols_b["func"][j])
        note = (
            ""
            if cols_a["module"][i] == cols_b["module"][j]
            else f"module differs: {cols_b['module'][j]!r} in b"
        )
        if outs_a is None or outs_b is None:
            yield (*base, math.nan, math.nan, math.nan, False, "not saved" if not note else note)
            continue
        if _shapes(outs_a) != _shapes(outs_b):
            yield (
                *base,
                math.nan,
                math.nan,
                math.nan,
                True,
                f"shapes {_shapes(outs_a)} != {_shapes(outs_b)}",
            )
            continue
        ta, tb = _flat(outs_a), _flat(outs_b)
        if ta is None:
            why = "uninitialised memory: not compared" if cols_a["func"][i] in UNINITIALISED else "not saved"
            yield (*base, math.nan, math.nan, math.nan, False, why)
            continue
        yield (*base, *divergence(ta, tb, atol, rtol), note)
    a_labels = a.labels
    for j, lab in enumerate(cols_b["label"]):
        if lab not in a_labels:
            yield (
                lab,
                -1,
                j,
                cols_b["func"][j],
                cols_b["module"][j],
                math.nan,
                math.nan,
                math.nan,
                True,
                "only in b",
            )


def compare(a: Trace, b: Trace, *, first: bool = False, atol: float = 1e-6, rtol: float = 1e-5) -> Any:
    """Per-op divergence of traces ``a`` and ``b`` of the same model (see the module doc for the measures).

    Args:
        a: the reference trace (relative measures are relative to its values).
        b: the other trace, e.g. the same model with an edit (``intervene=``), ``fork().replay()``, another input.
        first: return only the first op (in ``a``'s execution order) whose outputs differ beyond the tolerance,
            as an :class:`~tl_dist.trace.Op` of ``a`` (None when none does), instead of the table.
        atol: absolute tolerance: an op differs when some element has ``|a - b| > atol + rtol * |b|``.
        rtol: relative tolerance.

    Returns:
        A pandas DataFrame, one row per label: ``label index_a index_b func module max_abs_diff rel_l2 cosine
        differs note`` (``note``: ``only in a``, ``only in b``, ``not saved``, differing shapes or modules),
        sorted by ``rel_l2`` then ``max_abs_diff``, largest first; or, with ``first=True``, an Op or None.

    Example:
        >>> tl.compare(trace, trace.fork().do("relu_2", tl.zero_ablate()).replay(), first=True).label
        'relu_2'
    """
    for name, t in (("a", a), ("b", b)):
        if not hasattr(t, "saved") or not hasattr(t, "columns"):
            raise ValueError(f"{name} must be a tl_dist Trace, got {type(t).__name__}")
    for name, v in (("atol", atol), ("rtol", rtol)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"{name} must be a non-negative number, got {v!r}")
    if not isinstance(first, bool):
        raise ValueError(f"first must be a bool, got {first!r}")
    if not a.saved or not b.saved:
        which = "a" if not a.saved else "b"
        raise TlDistError(f"compare needs saved outputs, and trace {which} has none: trace it with save=True")
    rows = _rows(a, b, atol, rtol)
    if first:
        return _first(a, rows)
    import pandas as pd

    frame = pd.DataFrame(list(rows), columns=list(_COLUMNS))
    return frame.sort_values(
        ["rel_l2", "max_abs_diff", "index_a"],
        ascending=[False, False, True],
        na_position="last",
        kind="stable",
    ).reset_index(drop=True)


def _first(a: Trace, rows: Any) -> Op | None:
    for row in rows:
        if row[8] and row[1] >= 0:
            return Op(a, row[1])
    return None
