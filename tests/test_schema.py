"""The schema is the one field list: the docs are generated from it and the trace table follows it."""

from pathlib import Path

import torch

import tl_dist as tl
from tl_dist import schema

PY_TYPES = {
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
    "ints": tuple,
    "strs": tuple,
    "shapes": tuple,
}


def test_docs_match_schema():
    docs = Path(__file__).resolve().parents[1] / "docs" / "fields.md"
    assert docs.read_text() == schema.reference_markdown(), (
        "regenerate: python -m tl_dist.schema > docs/fields.md"
    )


def test_trace_columns_follow_schema_kinds():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    trace = tl.trace(model, torch.randn(2, 4))
    assert list(trace.columns) == [f.name for f in schema.OP_FIELDS]
    for f in schema.OP_FIELDS:
        values = trace.columns[f.name]
        assert len(values) == len(trace)
        assert all(isinstance(v, PY_TYPES[f.kind]) for v in values), f.name
    assert list(trace.module_table) == [f.name for f in schema.MODULE_CALL_FIELDS]
