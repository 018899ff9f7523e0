"""Tabular views of a trace (pandas), driven by the schema."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..schema import OP_FIELDS

if TYPE_CHECKING:
    from ..trace import Trace


def columns_frame(columns: dict[str, list], fields: tuple) -> Any:
    """A DataFrame with one column per schema field: strings as categoricals, tuples as tuples."""
    import pandas as pd

    data = {}
    for f in fields:
        values = columns[f.name]
        if f.kind == "str":
            data[f.name] = pd.Categorical(values)
        elif f.kind in ("ints", "strs", "shapes"):
            data[f.name] = pd.Series(values, dtype=object)
        else:
            data[f.name] = values
    frame = pd.DataFrame(data)
    for f in fields:
        if f.kind in ("int", "float", "bool") and len(frame):
            frame[f.name] = frame[f.name].astype({"int": "int64", "float": "float64", "bool": "bool"}[f.kind])
    return frame


def to_pandas(trace: Trace) -> Any:
    """One row per op of ``trace``, columns as in ``schema.OP_FIELDS``, indexed by op index."""
    cols = dict(trace.columns)
    cols["out_shapes"] = [tuple(tuple(s) for s in shapes) for shapes in cols["out_shapes"]]
    cols["in_shapes"] = [tuple(tuple(s) for s in shapes) for shapes in cols["in_shapes"]]
    frame = columns_frame(cols, OP_FIELDS)
    return frame.set_index(frame["index"].rename(None))
