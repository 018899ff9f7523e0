"""The schema is the one field list: the docs are generated from it and the trace table follows it."""

from pathlib import Path

import pytest
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


def test_v1_shard_reads_fields_added_later_as_unknown():
    golden = Path(__file__).resolve().parent / "data" / "shards" / "v1" / "linear_relu.h5"
    loaded = tl.load(golden)
    # MODULE_CALL_FIELDS.source was added after this file was written
    assert loaded.module_table["source"] == [""] * len(loaded.module_table["address"])
    assert loaded.module_table["address"]


def test_module_calls_record_their_call_site():
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())

        def forward(self, x):
            return (
                self.inner(x) * 2
            )  # the call site of inner (and, through torch's Sequential, of its layers)

    trace = tl.trace(Outer(), torch.randn(2, 4))
    here = f"{__file__}:"
    sites = dict(zip(trace.module_table["address"], trace.module_table["source"]))
    line = int(sites["inner"].rsplit(":", 1)[1])
    assert sites["inner"].startswith(here) and sites["inner.0"] == sites["inner"] == sites["inner.1"]
    assert trace["addmm_1"].source == sites["inner"]  # op inside torch code -> the user line that led there
    assert trace["mul_1"].source == f"{here}{line}"


def test_every_subpackage_is_packaged():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "tl_dist").rglob("__init__.py")}
    assert found <= listed, f"add to pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"


def test_trace_from_columns_missing_a_field_is_a_schema_error():
    trace = tl.trace(torch.nn.Linear(2, 2), torch.randn(1, 2))
    columns = {k: v for k, v in trace.columns.items() if k != "flops"}
    with pytest.raises(tl.SchemaError, match="flops"):
        tl.Trace(columns, trace.module_table)
