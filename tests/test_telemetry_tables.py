"""``tl.telemetry.summarize`` on a trace built by hand, op by op, so every number it reports can be written out
here from the definitions in docs/telemetry.md (inclusive module totals, phases, nccl-tests bandwidth, the
union of collectives in flight, dominant-dtype MFU, statistics rows) rather than computed by the code under test.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tl_dist.schema import (
    COLLECTIVE_FIELDS,
    EMPTY_VALUE,
    MODULE_CALL_FIELDS,
    OP_FIELDS,
    STAT_FIELDS,
    empty_columns,
)
from tl_dist.telemetry import (
    OUTSIDE,
    CollectiveRow,
    FuncRow,
    ModuleRow,
    NonfiniteRow,
    NormRow,
    bus_factor,
    module_name,
    peak_flops_for,
    summarize,
)
from tl_dist.trace import Trace

# (func, kind, phase, module_stack, duration_ns, flops, out_bytes, dtype); op i starts at 1000 + 1000 * i.
OPS = [
    ("mm", "compute", "forward", ("", "enc", "enc.0"), 100, 1000, 64, "float32"),  # 0
    ("relu", "compute", "forward", ("", "enc", "enc.1"), 10, 0, 64, "float32"),  # 1
    ("mm", "compute", "forward", ("", "head"), 50, 400, 16, "bfloat16"),  # 2
    ("sum", "compute", "forward", (), 5, 0, 4, "float32"),  # 3: the loss, outside the model
    ("mm", "compute", "backward", ("", "head"), 80, 800, 64, "bfloat16"),  # 4
    ("mm", "compute", "backward", ("", "enc", "enc.0"), 200, 2000, 64, "float32"),  # 5
    ("all_reduce", "collective", "backward", (), 300, 0, 64, "float32"),  # 6
    ("add_", "compute", "optimizer", (), 20, 0, 0, "float32"),  # 7
    # A module that calls itself: its address is twice on the stack, its ops count once.
    ("mm", "compute", "forward", ("", "rec", "rec"), 30, 60, 8, "float32"),  # 8
    # The backward of a module whose forward ran before the window (no module-table row).
    ("mm", "compute", "backward", ("", "enc", "enc.2"), 7, 70, 8, "float32"),  # 9
    ("copy_", "compute", "recompute", ("", "enc", "enc.0"), 3, 0, 8, "float32"),  # 10
]
# (address, type, depth) per module call, in call order.
MODULES = [
    ("", "Net", 0),
    ("enc", "Sequential", 1),
    ("enc.0", "Linear", 2),
    ("enc.1", "ReLU", 2),
    ("head", "Linear", 1),
    ("rec", "Rec", 1),
    ("rec", "Rec", 2),
]


def _table(fields, rows):
    """Columns of ``fields`` holding ``rows`` (dicts of some fields; the others get the kind's zero)."""
    table = empty_columns(fields)
    for row in rows:
        for f in fields:
            table[f.name].append(row.get(f.name, EMPTY_VALUE[f.kind]))
    return table


def _trace(*, metadata=None, collectives=(), stats=(), output_of=None, ops=OPS, modules=MODULES):
    rows = []
    for i, (func, kind, phase, stack, dur, fl, nbytes, dtype) in enumerate(ops):
        rows.append(
            dict(index=i, label=f"{func}_{i}", func=func, kind=kind, phase=phase, module_stack=stack)
            | dict(
                module=stack[-1] if stack else "", duration_ns=dur, flops=fl, out_bytes=nbytes, dtype=dtype
            )
            | dict(start_ns=1000 + 1000 * i, source=f"model.py:{10 + i}", device="cpu")
        )
    # each call returned the ops output_of lists for its address
    calls = [
        dict(
            address=a,
            type=t,
            depth=d,
            out_ops=tuple(op for op, mods in (output_of or {}).items() if a in mods),
        )
        for a, t, d in modules
    ]
    columns, mods = _table(OP_FIELDS, rows), _table(MODULE_CALL_FIELDS, calls)
    ct, st = _table(COLLECTIVE_FIELDS, collectives), _table(STAT_FIELDS, stats)
    meta = {"window_start_ns": 500, "window_end_ns": 20_500} if metadata is None else metadata
    return Trace(columns, mods, collective_table=ct, stats_table=st, output_of=output_of, metadata=meta)


def test_phase_totals_compute_time_and_the_tables_order():
    t = summarize(_trace())
    assert t.op_ns == {"forward": 195, "backward": 587, "optimizer": 20, "recompute": 3}
    assert t.flops == {"forward": 1460, "backward": 2870, "optimizer": 0, "recompute": 0}
    assert t.total_flops == 4330
    assert t.compute_ns == 805 - 300  # everything but the all_reduce
    assert t.wall_ns == 20_000
    assert t.flops_per_second == 4330 / 20e-6
    assert (t.step, t.rank, t.world_size, t.run_id, t.device) == (None, 0, 1, None, "cpu")
    assert t.peak_flops is None and t.mfu is None
    # Longest first.
    assert t.funcs == (
        FuncRow("all_reduce", "backward", 1, 300, 0, 64),
        FuncRow("mm", "backward", 3, 287, 2870, 136),
        FuncRow("mm", "forward", 3, 180, 1460, 88),
        FuncRow("add_", "optimizer", 1, 20, 0, 0),
        FuncRow("relu", "forward", 1, 10, 0, 64),
        FuncRow("sum", "forward", 1, 5, 0, 4),
        FuncRow("copy_", "recompute", 1, 3, 0, 8),
    )


def test_module_rows_are_inclusive_in_call_order_then_phase_order():
    t = summarize(_trace())
    # (module, type, depth, phase, calls, ops, duration_ns, flops, out_bytes), in the order modules were first
    # called, phases in PHASES order; a module with no call in the window, then ops outside modules, last.
    assert t.modules == (
        ModuleRow("", "Net", 0, "forward", 1, 4, 190, 1460, 152),
        ModuleRow("", "Net", 0, "backward", 1, 3, 287, 2870, 136),
        ModuleRow("", "Net", 0, "recompute", 1, 1, 3, 0, 8),
        ModuleRow("enc", "Sequential", 1, "forward", 1, 2, 110, 1000, 128),
        ModuleRow("enc", "Sequential", 1, "backward", 1, 2, 207, 2070, 72),
        ModuleRow("enc", "Sequential", 1, "recompute", 1, 1, 3, 0, 8),
        ModuleRow("enc.0", "Linear", 2, "forward", 1, 1, 100, 1000, 64),
        ModuleRow("enc.0", "Linear", 2, "backward", 1, 1, 200, 2000, 64),
        ModuleRow("enc.0", "Linear", 2, "recompute", 1, 1, 3, 0, 8),
        ModuleRow("enc.1", "ReLU", 2, "forward", 1, 1, 10, 0, 64),
        ModuleRow("head", "Linear", 1, "forward", 1, 1, 50, 400, 16),
        ModuleRow("head", "Linear", 1, "backward", 1, 1, 80, 800, 64),
        ModuleRow("rec", "Rec", 1, "forward", 2, 1, 30, 60, 8),
        ModuleRow("enc.2", "", 2, "backward", 0, 1, 7, 70, 8),
        ModuleRow(OUTSIDE, "", 0, "forward", 0, 1, 5, 0, 4),
        ModuleRow(OUTSIDE, "", 0, "backward", 0, 1, 300, 0, 64),
        ModuleRow(OUTSIDE, "", 0, "optimizer", 0, 1, 20, 0, 0),
    )
    assert t.module_time("enc", ("forward", "backward")) == 317
    assert t.module_time("enc") == 320  # every phase
    assert t.module_time("nope") == 0
    assert t.module_time() == 190 + 287 + 3  # the root module: every op inside the model
    frame = t.frame("modules")
    assert list(frame.columns) == list(ModuleRow._fields)
    assert frame.loc[frame.module == "head", "duration_ns"].tolist() == [50, 80]


@pytest.mark.parametrize(
    "span, wall, idle",
    [
        # op 0 starts at 1000; the last to end is op 10: 1000 + 10,000 + 3 = 11,003
        ({}, 10_003, (0, 0)),
        # each end the shard did not record falls back to the first op's start / the last op's end
        ({"window_start_ns": 500}, 11_003 - 500, (500, 0)),
        ({"window_end_ns": 20_500}, 20_500 - 1000, (0, 20_500 - 11_003)),
    ],
)
def test_wall_time_without_a_window_span_falls_back_to_the_ops(span, wall, idle):
    t = summarize(_trace(metadata={"step": 7, "rank": 2, "world_size": 4, "run_id": "r1", **span}))
    assert t.wall_ns == wall
    assert (t.idle_before_ns, t.idle_after_ns) == idle
    assert t.flops_per_second == pytest.approx(4330 / (wall / 1e9), rel=1e-15)
    assert (t.step, t.rank, t.world_size, t.run_id) == (7, 2, 4, "r1")


@pytest.fixture
def tf32():
    """Sets torch.backends.cuda.matmul.allow_tf32 (a property of torch's cuBLAS module, which monkeypatch
    cannot restore) and puts it back."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    yield lambda on: setattr(matmul, "allow_tf32", on)
    matmul.allow_tf32 = before


def test_mfu_uses_the_peak_of_the_dtype_with_most_flops(tf32):
    # float32 ops: 1000 + 2000 + 60 + 70 = 3130 FLOPs; bfloat16: 400 + 800 = 1200
    meta = {"window_start_ns": 0, "window_end_ns": 1_000_000, "device_name": "NVIDIA H100 80GB HBM3"}
    tf32(False)
    t = summarize(_trace(metadata=meta))
    assert t.device == "NVIDIA H100 80GB HBM3"
    assert t.flops_per_second == 4330 / 1e-3
    assert t.peak_flops == 67e12 and t.mfu == 4.33e6 / 67e12
    tf32(True)  # float32 matmuls on TF32 cores
    assert summarize(_trace(metadata=meta)).peak_flops == 494e12
    given = summarize(_trace(metadata=meta), peak_flops=1e7)
    assert given.peak_flops == 1e7 and given.mfu == 4.33e6 / 1e7
    assert summarize(_trace(metadata=meta), peak_flops=1).mfu == 4.33e6  # any positive number, ints too


def test_a_checkpointed_module_an_unknown_phase_and_a_bfloat16_gpu_window():
    # The recomputation of a checkpointed block runs between its forward and its backward; rows still come in
    # PHASES order. A phase this version does not know (a shard of a newer one) is totalled under its name,
    # after the known ones. Most FLOPs are bfloat16, so the bfloat16 peak gives MFU.
    ops = [
        ("mm", "compute", "forward", ("", "blk"), 10, 100, 8, "bfloat16"),
        ("mm", "compute", "recompute", ("", "blk"), 11, 100, 8, "bfloat16"),
        ("mm", "compute", "backward", ("", "blk"), 12, 200, 16, "bfloat16"),
        ("mm", "compute", "backward", ("", "blk"), 13, 200, 32, "bfloat16"),
        ("add", "compute", "sampling", ("", "blk"), 14, 0, 4, "float32"),
        ("mm", "compute", "forward", ("", "blk"), 15, 90, 8, "float32"),
    ]
    meta = {"window_start_ns": 0, "window_end_ns": 1000, "device_name": "NVIDIA H100 80GB HBM3"}
    t = summarize(_trace(ops=ops, metadata=meta))
    assert t.op_ns == {"forward": 25, "backward": 25, "optimizer": 0, "recompute": 11, "sampling": 14}
    assert t.flops == {"forward": 190, "backward": 400, "optimizer": 0, "recompute": 100, "sampling": 0}
    assert [
        (r.module, r.phase, r.ops, r.duration_ns, r.flops, r.out_bytes) for r in t.modules if r.module
    ] == [
        ("blk", "forward", 2, 25, 190, 16),
        ("blk", "backward", 2, 25, 400, 48),
        ("blk", "recompute", 1, 11, 100, 8),
        ("blk", "sampling", 1, 14, 0, 4),
    ]
    # bfloat16 600 FLOPs, float32 90: the bfloat16 peak, 989 TFLOP/s
    assert t.peak_flops == 989e12 and t.mfu == 690 / 1e-6 / 989e12


def test_device_comes_from_the_first_op_when_the_window_names_no_gpu():
    ops = [("mm", "compute", "forward", (), 1, 10, 8, "float32")] * 2
    trace = _trace(ops=ops, metadata={"window_start_ns": 0, "window_end_ns": 1})
    trace.columns["device"] = ["cuda:0", "cpu"]
    t = summarize(trace)
    assert t.device == "cuda:0"
    assert t.flops_per_second == 20 / 1e-9  # a 1 ns window


@pytest.mark.parametrize("bad", [0, -1.0, True, "1e12", float("nan"), float("inf")])
def test_peak_flops_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match=r"peak_flops must be a positive number \(FLOP/s\) or None, got "):
        summarize(_trace(), peak_flops=bad)


def _coll(func, ranks, *, name="", desc="", numel=(1024, 1024), dtype="float32", issue=0, complete=None):
    return dict(
        func=func,
        group_ranks=ranks,
        group_name=name,
        group_desc=desc,
        in_numel=numel[0],
        out_numel=numel[1],
        dtype=dtype,
        issue_ns=issue,
        complete_ns=complete if complete is not None else -1,
        state="completed" if complete is not None else "issued",
    )


def test_collective_rows_group_names_bandwidth_and_time_in_flight():
    world = (0, 1, 2, 3)
    rows = [
        _coll("all_reduce", world, name="0", desc="default_pg", issue=0, complete=1000),
        _coll("all_reduce", world, name="0", desc="default_pg", issue=5000),  # never completed
        _coll("all_reduce", world, name="0", desc="default_pg", issue=6000, complete=6500),
        _coll("all_gather", (0, 1), name="3", numel=(256, 512), dtype="bfloat16", issue=500, complete=2500),
        _coll("barrier", (0, 1), name="3", numel=(0, 0), issue=2000, complete=2100),
        _coll("broadcast", (0, 2), numel=(100, 100), dtype="int64", issue=3000, complete=3100),
        _coll("send", (0, 2), numel=(10, 0), issue=3010, complete=3011),
        _coll("reduce_scatter", world, name="7", numel=(4096, 1024), issue=3100, complete=3200),
        # Completed the moment it was issued (seen complete at issue), of a dtype torch does not know.
        _coll("all_reduce", (1,), name="9", numel=(10, 10), dtype="not_a_dtype", issue=4000, complete=4000),
    ]
    t = summarize(_trace(collectives=rows))
    # Group shown by description, else name, else its ranks. bytes = larger buffer x itemsize (completed
    # only; 0 for an unknown dtype); algbw = bytes / seconds (0 for no time); busbw = algbw x 2(n-1)/n
    # (all_reduce), (n-1)/n (all_gather, reduce_scatter), 1 (broadcast, p2p, barrier).
    assert t.collectives == (
        CollectiveRow("all_reduce", "default_pg", 4, 3, 2, 8192, 1500, 8192 / 1.5e-6, 8192 / 1.5e-6 * 1.5),
        CollectiveRow("all_gather", "3", 2, 1, 1, 1024, 2000, 1024 / 2e-6, 1024 / 2e-6 * 0.5),
        CollectiveRow("barrier", "3", 2, 1, 1, 0, 100, 0.0, 0.0),
        CollectiveRow("broadcast", "0,2", 2, 1, 1, 800, 100, 800 / 1e-7, 800 / 1e-7),
        CollectiveRow("send", "0,2", 2, 1, 1, 40, 1, 40 / 1e-9, 40 / 1e-9),
        CollectiveRow("reduce_scatter", "7", 4, 1, 1, 16384, 100, 16384 / 1e-7, 16384 / 1e-7 * 0.75),
        CollectiveRow("all_reduce", "9", 1, 1, 1, 0, 0, 0.0, 0.0),
    )
    # comm_ns is the step facts' (tl_dist.step_facts, tested in test_step_facts.py): these blocking rows name no
    # collective op, so only OPS' one all_reduce op (300 ns) is communication.
    assert t.comm_ns == 300
    assert list(t.frame("collectives").columns) == list(CollectiveRow._fields)


def test_a_modules_norms_are_its_last_calls_and_of_one_output_tensor():
    # "shared" called twice (ops 1 then 2); "" (the root) returned two tensors (ops 3 and 2: a dict of logits
    # and loss, logits first). Gradient rows arrive in backward order: call 1's before call 0's.
    stats = [
        dict(op=1, of="out", at=1, norm=3.7),
        dict(op=2, of="out", at=2, norm=2.3),
        dict(op=3, of="out", at=3, norm=9.3),
        dict(op=3, of="grad", at=6, norm=0.6),
        dict(op=2, of="grad", at=7, norm=6.7),
        dict(op=1, of="grad", at=8, norm=2.4),
    ]
    calls = [
        dict(address="", type="Net", depth=0, out_ops=(3, 2)),
        dict(address="shared", type="Linear", depth=1, out_ops=(1,)),
        dict(address="shared", type="Linear", depth=1, out_ops=(2,)),
    ]
    t = _trace(stats=stats, output_of={1: ("shared",), 2: ("shared", ""), 3: ("",)})
    t.module_table = _table(MODULE_CALL_FIELDS, calls)
    norms = {(r.module, r.of): r.norm for r in summarize(t).norms}
    assert norms == {("", "out"): 9.3, ("", "grad"): 0.6, ("shared", "out"): 2.3, ("shared", "grad"): 6.7}


def test_statistics_give_the_last_call_norms_and_nonfinite_counts_per_module():
    stats = [
        # op 1 (enc.1's output, which is also enc's): two calls' rows, the later one is reported
        dict(op=1, of="out", at=2, norm=9.0, mean=9.0, std=9.0, min=9.0, max=9.0),
        dict(op=1, of="out", at=3, norm=3.0, mean=0.5, std=0.25, min=0.0, max=2.0),
        dict(
            op=2, of="out", at=4, norm=1.0, mean=0.1, std=0.2, min=-1.0, max=1.0, inf=2
        ),  # forward -inf: a mask
        dict(op=2, of="grad", at=9, norm=5.0, mean=0.0, std=1.0, min=-2.0, max=2.0, inf=1),
        dict(
            op=4, of="out", at=6, norm=math.inf, mean=0.0, std=0.0, min=0.0, max=math.inf, inf=1
        ),  # backward op
        dict(
            op=3,
            of="out",
            at=5,
            norm=math.nan,
            mean=math.nan,
            std=math.nan,
            min=math.nan,
            max=math.nan,
            nan=4,
        ),
        dict(op=3, of="out", at=7, nan=1),
    ]
    output_of = {1: ("enc.1", "enc"), 2: ("head",)}
    t = summarize(_trace(stats=stats, output_of=output_of))
    assert t.norms == (  # in the module table's order
        NormRow("enc", "out", 3.0, 0.5, 0.25, 0.0, 2.0),
        NormRow("enc.1", "out", 3.0, 0.5, 0.25, 0.0, 2.0),
        NormRow("head", "out", 1.0, 0.1, 0.2, -1.0, 1.0),
        NormRow("head", "grad", 5.0, 0.0, 1.0, -2.0, 2.0),
    )
    # NaN anywhere; Inf in a gradient and in a backward op's output; not the forward -inf of op 2.
    assert t.nonfinite == (
        NonfiniteRow("head", "grad", 1),
        NonfiniteRow("head", "out", 1),
        NonfiniteRow(OUTSIDE, "out", 2),
    )
    # The first value computed that is non-finite: op 3's NaN (at 5), before op 4's Inf (at 6).
    assert t.first_nonfinite == {
        "index": 3,
        "label": "sum_3",
        "func": "sum",
        "kind": "compute",
        "module": OUTSIDE,
        "source": "model.py:13",
        "phase": "forward",
    }
    head_first = summarize(_trace(stats=stats[:5], output_of=output_of)).first_nonfinite
    assert head_first == {
        "index": 4,
        "label": "mm_4",
        "func": "mm",
        "kind": "compute",
        "module": "head",
        "source": "model.py:14",
        "phase": "backward",
    }


def test_without_statistics_the_tables_are_empty():
    t = summarize(_trace())
    # comm_ns (step facts) comes from the ops: OPS' all_reduce op, 300 ns, with or without a collective table.
    assert (t.norms, t.nonfinite, t.first_nonfinite, t.collectives, t.comm_ns) == ((), (), None, (), 300)
    assert t.frame("norms").shape == (0, len(NormRow._fields))


def test_an_empty_window():
    t = summarize(_trace(ops=[], metadata={}))
    assert (t.wall_ns, t.flops_per_second, t.total_flops, t.compute_ns, t.device) == (0, 0.0, 0, 0, "")
    assert t.op_ns == {"forward": 0, "backward": 0, "optimizer": 0, "recompute": 0}
    assert (t.modules, t.funcs) == ((), ())
    # Every table has its columns even when empty (dashboards concatenate frames of many windows).
    for table, row in [
        ("modules", ModuleRow),
        ("funcs", FuncRow),
        ("collectives", CollectiveRow),
        ("norms", NormRow),
        ("nonfinite", NonfiniteRow),
    ]:
        assert list(t.frame(table).columns) == list(row._fields), table
        assert len(t.frame(table)) == 0


def test_frames_hold_the_rows():
    stats = [dict(op=2, of="grad", at=9, norm=5.0, nan=1)]
    rows = [_coll("all_reduce", (0, 1), name="0", issue=0, complete=1000)]
    t = summarize(_trace(stats=stats, output_of={2: ("head",)}, collectives=rows))
    assert t.frame("funcs").iloc[0].tolist() == ["all_reduce", "backward", 1, 300, 0, 64]
    assert t.frame("collectives").iloc[0][["kind", "group", "bytes"]].tolist() == ["all_reduce", "0", 4096]
    assert t.frame("norms").iloc[0][["module", "of", "norm"]].tolist() == ["head", "grad", 5.0]
    assert t.frame("nonfinite").iloc[0].tolist() == ["head", "grad", 1]


def test_module_name_of_ops_rows_and_records():
    assert module_name({"module": "enc.0", "module_stack": ("", "enc", "enc.0")}) == "enc.0"
    assert module_name({"module": "", "module_stack": ("",)}) == "<root>"
    assert module_name({"module_stack": ("",)}) == "<root>"
    assert module_name({"module": "", "module_stack": ()}) == OUTSIDE
    assert module_name({"module_stack": ()}) == OUTSIDE
    assert module_name({}) == OUTSIDE
    assert module_name({"module": "enc"}) == "enc"  # a record that knows its module but not the stack
    # Objects with attributes (an Op, a collective Entry, a failed-op record), some lacking module_stack.
    assert module_name(SimpleNamespace(module="head", module_stack=("", "head"))) == "head"
    assert module_name(SimpleNamespace(module="", module_stack=("",))) == "<root>"
    assert module_name(SimpleNamespace(module="")) == OUTSIDE
    assert module_name(SimpleNamespace(module_stack=("",))) == "<root>"
    trace = _trace()
    assert [module_name(trace[i]) for i in (0, 3)] == ["enc.0", OUTSIDE]


def test_peak_table_falls_back_where_a_device_has_no_tf32(tf32):
    tf32(True)
    assert peak_flops_for("Tesla V100-SXM2-16GB", "float32") == 15.7e12  # no TF32 cores
    assert peak_flops_for("NVIDIA H200", "float16") == 989e12  # TF32 applies to float32 only
    assert peak_flops_for("NVIDIA L4", "bfloat16") == 121e12
    assert peak_flops_for("Tesla T4", "bfloat16") is None  # not in its row
    tf32(False)
    assert peak_flops_for("NVIDIA H200", "float32") == 67e12


def test_bus_factor_edges():
    # nccl-tests: a one-rank all_reduce moves nothing over the bus; an unknown group size leaves algbw as is.
    assert bus_factor("all_reduce", 1) == 0.0 and bus_factor("all_gather", 1) == 0.0
    assert bus_factor("all_reduce", 0) == 1.0 and bus_factor("all_reduce", -1) == 1.0
    assert bus_factor("all_reduce", 8) == 14 / 8 and bus_factor("all_to_all", 4) == 3 / 4
    assert bus_factor("scatter", 2) == 0.5 and bus_factor("gather", 2) == 0.5
    assert bus_factor("broadcast", 8) == 1.0 and bus_factor("reduce", 8) == 1.0


def test_a_window_that_holds_only_the_backward_of_an_earlier_forward():
    # No module was called in the window (the forward ran before it): depths come from the addresses.
    ops = [
        ("mm", "compute", "backward", ("", "enc", "enc.0"), 40, 400, 8, "float32"),
        ("mm", "compute", "backward", ("", "enc"), 2, 20, 4, "float32"),
    ]
    t = summarize(_trace(ops=ops, modules=[]))
    assert t.modules == (
        ModuleRow("", "", 0, "backward", 0, 2, 42, 420, 12),
        ModuleRow("enc", "", 1, "backward", 0, 2, 42, 420, 12),
        ModuleRow("enc.0", "", 2, "backward", 0, 1, 40, 400, 8),
    )


def test_the_report_and_telemetry_give_every_collective_kind_the_same_bus_bandwidth():
    from tl_dist.report.data import Run

    world = (0, 1, 2, 3)
    # (func, in_numel, out_numel) of float32 (4 bytes) on 4 ranks, each 1000 ns; size = larger buffer.
    kinds = [
        ("all_reduce", 1000, 1000),  # 4000 B / 1 us = 4e9 B/s x 2(4-1)/4 = 6e9
        ("all_gather", 250, 1000),  # 4000 B -> 4e9 x 3/4 = 3e9
        ("reduce_scatter", 1000, 250),  # 3e9
        ("all_to_all", 1000, 1000),  # 3e9
        (
            "gather",
            250,
            1000,
        ),  # the gathering rank: 4000 B -> 3e9 (the report once said 1e9: factor 1, input)
        ("scatter", 1000, 250),  # the scattering rank: 3e9
        ("broadcast", 1000, 1000),  # factor 1: 4e9
        ("reduce", 1000, 1000),  # 4e9
        ("send", 1000, 0),  # 4e9
    ]
    rows = [
        _coll(f, world, name=f, numel=(i, o), issue=10_000 * k, complete=10_000 * k + 1000) | {"bytes": 4 * i}
        for k, (f, i, o) in enumerate(kinds)
    ]
    trace = _trace(collectives=rows)
    expected = {
        "all_reduce": 6e9,
        "all_gather": 3e9,
        "reduce_scatter": 3e9,
        "all_to_all": 3e9,
        "gather": 3e9,
        "scatter": 3e9,
        "broadcast": 4e9,
        "reduce": 4e9,
        "send": 4e9,
    }
    telemetry = {r.kind: r.busbw for r in summarize(trace).collectives}
    report = {row["kind"]: row["busbw"] for row in Run.of(trace).bandwidth()}
    assert telemetry == pytest.approx(expected, rel=1e-12)
    assert report == pytest.approx(expected, rel=1e-12)
