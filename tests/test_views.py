"""Views of a trace: summary text and to_pandas (drawing: test_draw.py)."""

import pytest
import torch
from external import have
from torch import nn

import tl_dist as tl
from tl_dist.schema import OP_FIELDS, OUTSIDE, field_names
from tl_dist.views.draw import graph_source
from tl_dist.views.summary import format_count, format_ns, module_rows


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv2(torch.relu(self.bn(self.conv1(x)))) + x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = Block(8)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 5))

    def forward(self, x):
        return self.head(self.block(torch.relu(self.stem(x))))


@pytest.fixture
def trace():
    model = Net().eval()
    with torch.no_grad():
        t = tl.trace(model, torch.randn(2, 3, 4, 4))
    # Known durations make every number in the summary hand-checkable: op i takes (i + 1) microseconds.
    t.columns["duration_ns"] = [1000 * (i + 1) for i in range(len(t))]
    return t


def _inclusive(trace, address):
    # Independent of module_rows: an op belongs to a module (inclusively) when the address is on its stack.
    ops = [i for i in range(len(trace)) if address in trace[i].module_stack or address == ""]
    return ops


# -- summary -------------------------------------------------------------------------------------------------
def test_summary_totals_and_modules_match_the_columns(trace):
    n = len(trace)
    total_ns = 1000 * n * (n + 1) // 2  # sum of (i + 1) us for i < n
    text = trace.summary(top=3)
    first = text.splitlines()[0]
    assert first.startswith(f"tl_dist trace: {n} ops, {len(trace.module_table['address'])} module calls, ")
    assert format_ns(total_ns) in first
    assert format_count(sum(trace.columns["flops"]), "FLOP") in first
    saved = sum(o.nelement() * o.element_size() for outs in trace.saved.values() for o in outs)
    assert saved > 0 and f"{len(trace.saved)} saved ops" in first

    rows = {r["address"]: r for r in module_rows(trace)}
    assert set(rows) == set(trace.module_table["address"])
    for address in ("", "stem", "block", "block.conv1", "block.bn", "head", "head.1"):
        ops = _inclusive(trace, address)
        expected_ns = sum(1000 * (i + 1) for i in ops)
        assert rows[address]["ops"] == len(ops), address
        assert rows[address]["duration_ns"] == expected_ns, address
        assert rows[address]["flops"] == sum(trace[i].flops for i in ops), address
        # The text line of the module: address, type, calls, ops, time, share, FLOPs.
        name = address or "<root>"
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(name + " "))
        cells = line.split()
        assert cells[:4] == [name, rows[address]["type"], "1", str(len(ops))]
        assert f"{100 * expected_ns / total_ns:.1f}%" in cells
    assert rows["block"]["flops"] == trace["convolution_2"].flops + trace["convolution_3"].flops
    assert rows[""]["ops"] == n and rows[""]["duration_ns"] == total_ns


def test_summary_top_ops_are_the_slowest(trace):
    n = len(trace)
    text = trace.summary(top=4)
    lines = text.splitlines()
    start = lines.index("Top 4 ops by time:")
    table = lines[start + 3 : start + 7]
    assert len(table) == 4 and start + 7 == len(lines)
    # Durations grow with the index, so the slowest four are the last four ops, slowest first.
    assert [int(row.split()[0]) for row in table] == [n - 1, n - 2, n - 3, n - 4]
    last = trace[n - 1]
    assert table[0].split()[1] == last.label and format_ns(1000 * n) in table[0]
    assert "test_views.py:" in table[0]  # source file:line of the model code, directory dropped
    assert "Top" not in trace.summary(top=0)


def test_summary_counts_ops_outside_modules():
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with torch.no_grad(), tl.capture(save=True) as cap:
        y = layer(x)
        z = (y * 2).sum()
    rows = {r["address"]: r for r in module_rows(cap.trace)}
    assert rows[OUTSIDE]["ops"] == 2  # mul, sum
    assert rows[""]["ops"] == len(cap.trace) - 2 and rows[""]["type"] == "Linear"
    assert OUTSIDE in cap.trace.summary()
    assert torch.equal(cap.trace["sum_1"].out, z)


@pytest.mark.parametrize("top", [-1, 2.5, True, "3"])
def test_summary_rejects_bad_top(trace, top):
    with pytest.raises(ValueError, match="top must be a non-negative int"):
        trace.summary(top=top)


# -- to_pandas -----------------------------------------------------------------------------------------------
def test_to_pandas_one_row_per_op_schema_columns_and_dtypes(trace):
    df = trace.to_pandas()
    assert len(df) == len(trace)
    assert list(df.columns) == list(field_names(OP_FIELDS))
    expected = {"int": "int64", "float": "float64", "bool": "bool", "str": "category"}
    for f in OP_FIELDS:
        assert str(df[f.name].dtype) == expected.get(f.kind, "object"), f.name
    assert list(df.index) == list(range(len(trace)))
    conv = trace["convolution_2"]
    row = df.loc[conv.index]
    assert row["label"] == "convolution_2" and row["module"] == "block.conv1"
    assert row["flops"] == conv.flops and row["out_shapes"] == ((2, 8, 4, 4),)
    assert row["parents"] == conv.parents and row["params"] == ("block.conv1.weight",)
    assert df.groupby("module", observed=True)["duration_ns"].sum()["block.conv1"] == conv.duration_ns


def test_summary_module_called_twice_and_failed_trace():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.ReLU()

        def forward(self, x):
            return self.act(self.fc(self.act(x)))

    with torch.no_grad():
        t = tl.trace(Twice(), torch.randn(3, 4))
    rows = {r["address"]: r for r in module_rows(t)}
    # act runs one relu per call: 2 calls, 2 ops, its time the sum of both relus.
    assert rows["act"]["calls"] == 2 and rows["act"]["ops"] == 2
    assert rows["act"]["duration_ns"] == t["relu_1"].duration_ns + t["relu_2"].duration_ns
    line = next(ln for ln in t.summary().splitlines() if ln.strip().startswith("act "))
    assert line.split()[:4] == ["act", "ReLU", "2", "2"]

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) @ torch.randn(5, 5)  # shapes do not match: mm raises

    with pytest.raises(RuntimeError) as err:
        tl.trace(Boom(), torch.randn(3, 4))
    partial = err.value.tl_trace
    # The failing mm would have been op len(partial): the ops before it were recorded, it was not.
    expected = f"failed at op {len(partial)} (mm in {OUTSIDE}): RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    assert partial.summary().splitlines()[1].startswith(expected)


@pytest.mark.needs("dot", optional=True)
def test_summary_and_draw_of_a_loaded_shard_read_no_tensor(trace, tmp_path):
    from tl_dist.store import LazyTensors, write_shard

    shard = write_shard(trace, tmp_path / "t.h5")
    loaded = tl.load(shard)
    assert isinstance(loaded.saved, LazyTensors)
    text = loaded.summary(top=3)
    assert loaded.saved._cache == {}  # summary counted saved bytes from the op table, not the file
    # Every op saved, all outputs: out_bytes of the table equals the tensors' own sizes.
    expected = trace.summary(top=3)
    assert text.splitlines()[0] == expected.splitlines()[0]
    assert text.splitlines()[1:] == expected.splitlines()[1:]
    assert graph_source(loaded, depth=1) == graph_source(trace, depth=1)
    if have("dot"):
        from test_draw import svg_groups

        mem = svg_groups(trace.draw(tmp_path / "mem.svg", depth=1))
        disk = svg_groups(loaded.draw(tmp_path / "disk.svg", depth=1))
        assert mem == disk


def test_summary_of_forward_and_backward():
    model = Net()
    with tl.capture() as cap:
        model(torch.randn(2, 3, 4, 4)).sum().backward()
    t = cap.trace
    assert {"forward", "backward"} <= set(t.columns["phase"])
    # In the per-module table a backward op counts with the module of its forward op: only the input, the
    # loss (a top-level sum), the seed gradient and the sum's backward are outside modules.
    outside = [i for i in range(len(t)) if not t[i].module_stack]
    assert [t[i].func for i in outside if t[i].phase == "backward"] == ["ones_like", "expand"]
    assert t[outside[-3]].func == "sum"
    rows = {r["address"]: r for r in module_rows(t)}
    assert rows[OUTSIDE]["ops"] == len(outside)
    assert rows[""]["ops"] == len(t) - len(outside)
