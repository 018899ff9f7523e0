"""Perfetto JSON of one trace: valid, slices nest per track, module slices around their ops (backward ones in
their forward op's module), collectives in flight on lanes, the live activation bytes counter."""

import json

import pytest
import torch
import torch.distributed as dist
from merge_synth import coll, make_trace
from torch import nn

import tl_dist as tl
from tl_dist.views.perfetto import COMM_TID, COUNTER, PHASE_TID


def _load(path):
    return json.loads(open(path).read())["traceEvents"]


def assert_nested(events):
    """No two X slices of one (pid, tid) partly overlap (integer ns, as the UI reads microseconds)."""
    tracks = {}
    for e in events:
        if e["ph"] == "X":
            start = round(e["ts"] * 1000)
            tracks.setdefault((e["pid"], e["tid"]), []).append(
                (start, -(start + round(e["dur"] * 1000)), e["name"])
            )
    for key, slices in tracks.items():
        stack = []
        for start, neg_end, name in sorted(slices):
            end = -neg_end
            while stack and stack[-1][0] <= start:
                stack.pop()
            assert not stack or end <= stack[-1][0], f"{key}: {name} overlaps {stack[-1][1]} partly"
            stack.append((end, name))


def _us(trace, ns):
    return (ns - min(trace.columns["start_ns"])) / 1e3


def test_module_slices_nest_around_their_ops(step_trace, tmp_path):
    t = step_trace
    events = _load(t.to_perfetto(tmp_path / "t.json"))
    assert_nested(events)
    ops = [e for e in events if e["ph"] == "X" and e["cat"] not in ("module", "comm", "wait")]
    assert [e["name"] for e in ops] == list(t.columns["label"])
    cols = t.columns
    for e, start, dur, phase in zip(ops, cols["start_ns"], cols["duration_ns"], cols["phase"]):
        assert e["ts"] == _us(t, start) and e["dur"] == max(dur, 1) / 1e3 and e["tid"] == PHASE_TID[phase]
    modules = {(e["tid"], e["name"]): e for e in events if e.get("cat") == "module"}

    def span(first, last):
        a, b = t[first], t[last]
        return _us(t, a.start_ns), (b.start_ns + max(b.duration_ns, 1) - a.start_ns) / 1e3

    fwd, bwd, opt = PHASE_TID["forward"], PHASE_TID["backward"], PHASE_TID["optimizer"]
    # Forward: the calls as the module table has them (t_1 .. addmm_2 inside the Sequential).
    assert (
        modules[(fwd, "<root> (Sequential)")]["ts"],
        modules[(fwd, "<root> (Sequential)")]["dur"],
    ) == span("t_1", "addmm_2")
    assert (modules[(fwd, "0 (Linear)")]["ts"], modules[(fwd, "0 (Linear)")]["dur"]) == span("t_1", "addmm_1")
    # Backward: from t_3 (the last Linear's grad_fn) to detach_6 (AccumulateGrad of the first Linear's weight);
    # expand_1 before it is sum's backward, outside every module.
    root_bwd = modules[(bwd, "<root> (Sequential)")]
    assert (root_bwd["ts"], root_bwd["dur"]) == span("t_3", "detach_6")
    assert (modules[(bwd, "0 (Linear)")]["ts"], modules[(bwd, "0 (Linear)")]["dur"]) == span(
        "t_7", "detach_6"
    )
    assert (modules[(bwd, "1 (ReLU)")]["ts"], modules[(bwd, "1 (ReLU)")]["dur"]) == span(
        "detach_4", "threshold_backward_1"
    )
    # Optimizer: add_ of each parameter inside its Linear.
    assert (modules[(opt, "2 (Linear)")]["ts"], modules[(opt, "2 (Linear)")]["dur"]) == span(
        "add__3", "add__4"
    )
    assert sum(1 for e in events if e.get("cat") == "module") == 4 + 4 + 3  # root + 3 calls, twice; root + 2


def test_live_activation_bytes_counter():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Tanh()).eval()
    x = torch.randn(5, 4)
    with torch.no_grad():
        kept = tl.trace(model, x)  # every output saved: held to the window's end
        freed = tl.trace(model, x, save=None)
    for t, saved in ((kept, True), (freed, False)):
        events = tl.views.perfetto.trace_events(t)
        points = [(e["ts"], e["args"]["bytes"]) for e in events if e["ph"] == "C" and e["name"] == COUNTER]
        a, r, h = t["addmm_1"], t["relu_1"], t["tanh_1"]

        def end(op):
            return op.start_ns + op.duration_ns

        # Each output is 5x3 float32 = 60 bytes; t_1 (the weight's transpose) is a view of a parameter: none.
        if saved:
            expected = [(a.start_ns, 60), (r.start_ns, 120), (h.start_ns, 180), (end(h), 0)]
        else:  # addmm's output dies with relu, relu's with tanh, tanh's (read by nobody) with itself
            expected = [(a.start_ns, 60), (r.start_ns, 120), (end(r), 60), (h.start_ns, 120), (end(h), 0)]
        assert points == [(_us(t, ns), b) for ns, b in expected]


def test_collectives_in_flight(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        a, b = torch.ones(4), torch.ones(8)
        with tl.capture() as cap:
            w1 = dist.all_reduce(a, async_op=True)
            w2 = dist.all_reduce(b, async_op=True)
            w1.wait()
            w2.wait()
            dist.all_reduce(a)
    finally:
        dist.destroy_process_group()
    t = cap.trace
    events = _load(t.to_perfetto(tmp_path / "c.json"))
    assert_nested(events)
    comm = [e for e in events if e.get("cat") == "comm"]
    ct = t.collective_table
    assert [e["name"] for e in comm] == ["all_reduce seq 1", "all_reduce seq 2", "all_reduce seq 3"]
    for e, issue, complete, nbytes in zip(comm, ct["issue_ns"], ct["complete_ns"], (16, 32, 16)):
        assert (
            e["ts"] == _us(t, issue) and e["dur"] == (complete - issue) / 1e3 and e["args"]["bytes"] == nbytes
        )
    assert [e["args"]["async"] for e in comm] == [True, True, False]


def test_collectives_in_flight_together_take_lanes():
    # Two async all_reduces in flight together (DDP's buckets), then a blocking one after both completed.
    t0 = 10**12
    script = [
        coll(is_async=True, issue=t0, complete=t0 + 5_000_000),
        coll(is_async=True, issue=t0 + 1_000_000, complete=t0 + 6_000_000),
        coll(issue=t0 + 7_000_000, complete=t0 + 8_000_000),
    ]
    events = tl.views.perfetto.trace_events(make_trace(0, script, t0=t0 - 10_000))
    comm = [e for e in events if e.get("cat") == "comm"]
    assert [e["tid"] for e in comm] == [COMM_TID, COMM_TID + 1, COMM_TID]
    assert_nested([e for e in events if e.get("cat") == "comm"])
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[COMM_TID] == "collectives" and names[COMM_TID + 1] == "collectives 2"


def test_save_writes_a_shard_any_trace_can_become(step_trace, tmp_path):
    path = step_trace.save(tmp_path / "step.h5")
    assert path == str(tmp_path / "step.h5")
    back = tl.load(path)
    assert back.columns == step_trace.columns and back.module_table == step_trace.module_table
    assert back.to_pandas().equals(step_trace.to_pandas())
    with pytest.raises(ValueError, match="path: folder .*nowhere does not exist"):
        step_trace.save(tmp_path / "nowhere" / "x.h5")


def test_merged_export_has_each_ranks_module_slices_and_counter(tmp_path):
    from tl_dist.store import write_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    for rank in (0, 1):
        with tl.capture(save=tl.func("relu")) as cap:
            model(torch.randn(5, 4)).sum().backward()
        cap.trace.metadata.update(rank=rank, world_size=2, step=7)
        (tmp_path / "run" / f"rank{rank:05d}").mkdir(parents=True)
        write_shard(cap.trace, tmp_path / "run" / f"rank{rank:05d}" / "step00000007.h5")
    g = tl.merge_ranks(tmp_path / "run")
    events = _load(g.to_perfetto(tmp_path / "m.json"))
    assert_nested(events)
    for rank in (0, 1):
        alone = tl.views.perfetto.trace_events(
            tl.load(tmp_path / "run" / f"rank{rank:05d}" / "step00000007.h5")
        )

        def of(evs, ph, pid=rank):
            return [e for e in evs if e["ph"] == ph and e["pid"] == pid]

        # The same module slices and live-bytes levels as the shard's own export (the saved relu held to
        # the end of the window), on the merged export's clock.
        assert [e["name"] for e in of(events, "X") if e["cat"] == "module"] == [
            e["name"] for e in of(alone, "X") if e["cat"] == "module"
        ]
        assert [e["args"]["bytes"] for e in of(events, "C")] == [e["args"]["bytes"] for e in of(alone, "C")]
        assert (
            of(alone, "C")[-1]["args"]["bytes"] == 0 and max(e["args"]["bytes"] for e in of(alone, "C")) > 0
        )
