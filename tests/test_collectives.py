"""Collectives as first-class ops: every c10d / functional collective on real gloo ranks, with group, sequence
number, sizes, completion and the ops that read its result."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from dist_helpers import collective_rows, run_ranks
from torch import nn

import tl_dist as tl
from tl_dist._opinfo import op_info
from tl_dist.comm_ops import _SPECS
from tl_dist.schema import COLLECTIVE_FIELDS


class CommModel(nn.Module):
    """A forward that runs every c10d collective plus a functional and a subgroup all-reduce; each result is
    read by the next op (mostly ``sum``), so the trace must show it as that op's parent."""

    def __init__(self, subgroup):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.subgroup = subgroup

    def forward(self, x):
        ws, rank = dist.get_world_size(), dist.get_rank()
        dist.broadcast(x, src=0)
        h = self.fc(x)  # reads the broadcast tensor
        hd = h.detach()
        parts = [torch.empty_like(hd) for _ in range(ws)]
        dist.all_gather(parts, hd)
        g = torch.stack(parts)
        flat = torch.empty(2 * ws, 4)
        dist.all_gather_into_tensor(flat, hd)
        acc = flat.sum()
        rs = torch.empty(2, 4)
        dist.reduce_scatter_tensor(rs, g.reshape(2 * ws, 4).contiguous())
        acc = acc + rs.sum()
        rs2 = torch.empty(2, 4)
        dist.reduce_scatter(rs2, [p.clone() for p in parts], op=dist.ReduceOp.MAX)
        acc = acc + rs2.sum()
        a2a_out = [torch.empty(2) for _ in range(ws)]
        dist.all_to_all(a2a_out, [torch.full((2,), float(rank)) for _ in range(ws)])
        acc = acc + torch.stack(a2a_out).sum()
        a2a_single = torch.empty(2 * ws)
        dist.all_to_all_single(a2a_single, torch.arange(2.0 * ws))
        acc = acc + a2a_single.sum()
        t = torch.ones(4) * (rank + 1)
        dist.reduce(t, dst=1)
        acc = acc + t.sum()
        gathered = [torch.empty(4) for _ in range(ws)] if rank == 2 else None
        dist.gather(t, gathered, dst=2)
        if gathered is not None:
            acc = acc + torch.stack(gathered).sum()
        s = torch.empty(4)
        dist.scatter(s, [torch.full((4,), float(i)) for i in range(ws)] if rank == 3 else None, src=3)
        acc = acc + s.sum()
        # A ring: even ranks send first, odd ranks receive first (no deadlock with any even world size).
        msg, got = torch.full((4,), float(rank)), torch.empty(4)
        # The second hop uses isend/irecv: same ops at the dispatcher, told apart as async.
        if rank % 2 == 0:
            dist.send(msg, (rank + 1) % ws)
            dist.irecv(got, (rank - 1) % ws).wait()
        else:
            dist.recv(got, (rank - 1) % ws)
            dist.isend(msg, (rank + 1) % ws).wait()
        acc = acc + got.sum()
        dist.barrier()
        a = torch.ones(4)
        work = dist.all_reduce(a, async_op=True)
        work.wait()
        acc = acc + a.sum()
        f = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
        acc = acc + f.sum()
        u = torch.ones(4)
        dist.all_reduce(u, group=self.subgroup)
        acc = acc + u.sum()
        return h.sum() + 0 * acc, {"got": got.tolist(), "a": a.tolist(), "u": u.tolist(), "x": x.tolist()}


def _every_collective(rank, world_size, out_dir):
    torch.manual_seed(0)
    # new_group is collective: every rank creates both subgroups, then uses its own.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = CommModel(groups[rank // 2])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.full((2, 4), float(rank))
    with tl.capture() as cap:
        loss, values = model(x)
        loss.backward()
        for p in model.parameters():  # the "step": average gradients by hand
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)
        opt.step()
    return {"rows": collective_rows(cap.trace), "values": values}


@pytest.mark.slow
def test_every_collective_four_ranks(tmp_path):
    ws = 4
    results = run_ranks(_every_collective, world_size=ws, tmp_path=tmp_path)
    world = (0, 1, 2, 3)
    for rank, res in enumerate(results):
        rows = res["rows"]
        ring = ["send", "recv"] if rank % 2 == 0 else ["recv", "send"]
        funcs = [r["func"] for r in rows]
        assert funcs == [
            "broadcast",
            "all_gather",
            "all_gather",
            "reduce_scatter",
            "reduce_scatter",
            "all_to_all",
            "all_to_all",
            "reduce",
            "gather",
            "scatter",
            *ring,
            "barrier",
            "all_reduce",  # async
            "all_reduce",  # functional
            "all_reduce",  # subgroup
            "all_reduce",  # step: fc.weight grad
            "all_reduce",  # step: fc.bias grad
        ], f"rank {rank}"
        by = {r["label"]: r for r in rows}
        # Op rows use the normalised name, collective kind, and the real operator.
        assert by["broadcast_1"]["aten"] == "c10d.broadcast_.default"
        assert by["all_gather_2"]["aten"] == "c10d._allgather_base_.default"
        assert by["all_to_all_2"]["aten"] == "c10d.alltoall_base_.default"
        assert by["all_reduce_2"]["aten"] == "_c10d_functional.all_reduce.default"
        assert all(r["kind"] == "collective" and r["row_func"] == r["func"] for r in rows)
        sub = (0, 1) if rank < 2 else (2, 3)
        assert [r["group_ranks"] for r in rows] == [world] * 15 + [sub] + [world] * 2
        assert by["all_reduce_3"]["seq"] == 1  # the subgroup's first collective: its own counter
        world_seqs = [r["seq"] for r in rows if r["group_ranks"] == world]
        assert world_seqs == sorted(world_seqs) and len(set(world_seqs)) == len(world_seqs)
        assert all(
            r["group_desc"] == "default_pg" and r["backend"] == "gloo"
            for r in rows
            if r["group_ranks"] == world
        )
        # Sizes (x is 2x4 float32; ws = 4): broadcast 8 -> 8, all_gather 8 -> 32, reduce_scatter 32 -> 8.
        sizes = {lab: (by[lab]["in_numel"], by[lab]["out_numel"]) for lab in by}
        assert sizes["broadcast_1"] == (8, 8) and by["broadcast_1"]["bytes"] == 32
        assert sizes["all_gather_1"] == (8, 32) and sizes["all_gather_2"] == (8, 32)
        assert sizes["reduce_scatter_1"] == (32, 8) and sizes["reduce_scatter_2"] == (32, 8)
        assert sizes["all_to_all_1"] == (8, 8) and sizes["all_to_all_2"] == (8, 8)
        assert sizes["reduce_1"] == (4, 4)
        assert sizes["gather_1"] == (4, 16 if rank == 2 else 0)
        assert sizes["scatter_1"] == (16 if rank == 3 else 0, 4)
        assert sizes["send_1"] == (4, 0) and sizes["recv_1"] == (0, 4)
        assert sizes["barrier_1"] == (0, 0)
        assert sizes["all_reduce_4"] == (16, 16) and sizes["all_reduce_5"] == (4, 4)
        assert all(r["dtype"] == "float32" for r in rows if r["func"] != "barrier")
        # Roots and peers are global ranks.
        assert [by[k]["root"] for k in ("broadcast_1", "reduce_1", "gather_1", "scatter_1")] == [0, 1, 2, 3]
        assert by["send_1"]["peer"] == (rank + 1) % ws and by["recv_1"]["peer"] == (rank - 1) % ws
        assert by["all_reduce_1"]["root"] == -1 and by["all_reduce_1"]["peer"] == -1
        assert by["reduce_scatter_1"]["reduce_op"] == "sum" and by["reduce_scatter_2"]["reduce_op"] == "max"
        assert by["all_reduce_2"]["reduce_op"] == "sum" and by["broadcast_1"]["reduce_op"] == ""
        # async_op=True and the functional collective are async; the blocking API is not.
        assert [r["is_async"] for r in rows if r["func"] == "all_reduce"] == [True, True, False, False, False]
        assert not by["broadcast_1"]["is_async"]
        assert by["send_1"]["is_async"] == (rank % 2 == 1) and by["recv_1"]["is_async"] == (rank % 2 == 0)
        # Everything completed, after it was issued.
        late = [(r["label"], r["state"]) for r in rows if not r["complete_ns"] >= r["issue_ns"] > 0]
        assert all(r["state"] == "completed" for r in rows) and not late, late
        # Data edges: the ops reading each result are its children.
        assert "addmm" in by["broadcast_1"]["children"]
        assert "stack" in by["all_gather_1"]["children"]
        for lab in ("all_gather_2", "all_to_all_2", "scatter_1", "recv_1"):
            assert "sum" in by[lab]["children"], (lab, by[lab]["children"])
        # Gloo's reduce_scatter copies its result into the output (split + copy_) in whichever thread
        # finishes the work: when that is the waiting user thread the mode sees the copy_, and the reader of
        # the result hangs off it.
        for lab in ("reduce_scatter_1", "reduce_scatter_2"):
            kids, grandkids = by[lab]["children"], by[lab]["grandchildren"]
            assert kids == ("sum",) or (kids == ("copy_",) and "sum" in grandkids), by[lab]
        assert "stack" in by["all_to_all_1"]["children"]
        assert "sum" in by["all_reduce_1"]["children"] and "sum" in by["all_reduce_3"]["children"]
        assert by["all_reduce_2"]["children"] == ("_wrap_tensor_autograd",)
        assert "div_" in by["all_reduce_4"]["children"] and "div_" in by["all_reduce_5"]["children"]
        assert ("stack" in by["gather_1"]["children"]) == (rank == 2)
        assert by["reduce_1"]["inplace"] and by["all_reduce_1"]["inplace"]
        assert by["all_reduce_5"]["bucket"] == -1  # not DDP: issued outside backward
        # The collectives really ran under capture: ring neighbour's value, sums over 4 and 2 ranks.
        assert res["values"]["got"] == [float((rank - 1) % ws)] * 4
        assert res["values"]["a"] == [4.0] * 4 and res["values"]["u"] == [2.0] * 4
        assert res["values"]["x"] == [[0.0] * 4] * 2  # rank 0's x, broadcast
    # Same collective, same (group, seq) on every member.
    for k in range(18):
        keys = {(results[r]["rows"][k]["group_ranks"], results[r]["rows"][k]["seq"]) for r in range(ws)}
        if k == 15:
            assert keys == {((0, 1), 1), ((2, 3), 1)}
        else:
            assert len(keys) == 1, (k, keys)
    # p2p pairs: rank r's send matches rank r+1's recv on seq.
    for r in range(ws):
        send = next(x for x in results[r]["rows"] if x["func"] == "send")
        recv = next(x for x in results[(r + 1) % ws]["rows"] if x["func"] == "recv")
        assert send["seq"] == recv["seq"]


def _inflight(rank, world_size, out_dir):
    """An async all-reduce that cannot complete while the window is open (rank 0 joins only after rank 1's
    window closed): it must come back `issued`, and closing the window must not wait for it."""
    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(8)
    if rank == 1:
        with tl.capture() as cap:
            work = dist.all_reduce(t, async_op=True)
            y = t * 2  # reads the buffer before completion: still a child
        frame = cap.trace.collectives_frame()
        store.set("window_closed", "1")
        work.wait()
        return {
            "state": frame.state.tolist(),
            "complete": frame.complete_ns.tolist(),
            "label": frame.label.tolist(),
            "children": [cap.trace[i].func for i in cap.trace.collectives[0].children],
            "value": t.tolist(),
            "y": y.shape[0],
        }
    store.wait(["window_closed"])
    dist.all_reduce(t)
    return {"value": t.tolist()}


@pytest.mark.slow
def test_inflight_collective_stays_issued(tmp_path):
    results = run_ranks(_inflight, world_size=2, tmp_path=tmp_path, timeout=90)
    assert results[1]["state"] == ["issued"] and results[1]["complete"] == [-1]
    assert results[1]["label"] == ["all_reduce_1"] and results[1]["children"] == ["mul"]
    assert results[0]["value"] == results[1]["value"] == [2.0] * 8


def test_specs_match_the_operator_schemas():
    """Every spec names arguments that exist in its operator's schema on this torch (catches renames)."""
    for (ns, name), spec in _SPECS.items():
        packet = getattr(getattr(torch.ops, ns), name)
        op = packet.default
        info = op_info(op)
        arg_names = {a.name for a in op._schema.arguments}
        for arg in (spec.inputs, spec.outputs, spec.reduce_op, spec.root, spec.peer):
            assert arg in (None, "return") or arg in arg_names, (ns, name, arg, arg_names)
        assert {"process_group", "group_name"} & arg_names, (ns, name)
        assert info.func == spec.func and info.kind == "collective"
        if spec.outputs not in (None, "return"):
            assert info.mutated, (ns, name)  # copy-on-write must know the collective writes its output
    wait = op_info(torch.ops._c10d_functional.wait_tensor.default)
    assert wait.kind == "compute" and wait.func == "wait_tensor"


def test_trace_without_collectives_has_empty_table():
    trace = tl.trace(nn.Linear(3, 2), torch.randn(1, 3))
    assert trace.collectives == []
    frame = trace.collectives_frame()
    assert len(frame) == 0 and list(frame.columns)[:2] == ["op", "label"]


def _through_shards(rank, world_size, out_dir):
    tl.arm(out_dir / "run")
    try:
        with tl.capture(step=3) as cap:
            t = torch.full((6,), float(rank + 1))
            dist.all_reduce(t)
            y = t * 2
            dist.broadcast(y, src=1)
            work = dist.all_reduce(y, op=dist.ReduceOp.MAX, async_op=True)
            work.wait()
            z = y + 1
    finally:
        tl.disarm()
    return {"table": {k: list(v) for k, v in cap.trace.collective_table.items()}, "z": z.tolist()}


@pytest.mark.slow
def test_collectives_round_trip_through_shards(tmp_path):
    results = run_ranks(_through_shards, world_size=2, tmp_path=tmp_path)
    loaded = [tl.load(tmp_path / "run" / f"rank{r:05d}" / "step00000003.h5") for r in range(2)]
    for rank, (res, trace) in enumerate(zip(results, loaded)):
        assert trace.rank == rank and trace.step == 3
        table = trace.collective_table
        for f in COLLECTIVE_FIELDS:
            got = [tuple(v) if f.kind == "ints" else v for v in table[f.name]]
            want = [tuple(v) if f.kind == "ints" else v for v in res["table"][f.name]]
            assert got == want, f.name
        assert [c.func for c in trace.collectives] == ["all_reduce", "broadcast", "all_reduce"]
        assert [c.label for c in trace.collectives] == ["all_reduce_1", "broadcast_1", "all_reduce_2"]
        assert [c.reduce_op for c in trace.collectives] == ["sum", "", "max"]
        assert [c.is_async for c in trace.collectives] == [False, False, True]
        # Data edges survive the shard: mul reads all_reduce_1, add reads all_reduce_2 (which wrote y).
        assert [trace[i].func for i in trace.collectives[0].children] == ["mul"]
        assert "add" in [trace[i].func for i in trace.collectives[2].children]
        assert res["z"] == [7.0] * 6  # (1 + 2) * 2 broadcast from rank 1, max over equal values, + 1
    assert [c.seq for c in loaded[0].collectives] == [c.seq for c in loaded[1].collectives]
    assert all(
        c.group_ranks == loaded[1].collectives[i].group_ranks for i, c in enumerate(loaded[0].collectives)
    )


def _saved_values(rank, world_size, out_dir):
    with tl.capture(save=True) as cap:
        y = torch.ones(4) * (rank + 1)
        dist.all_reduce(y)  # overwrites mul_1's output in place
        f = funcol.all_reduce(y, "sum", dist.group.WORLD)
        z = f + 1
        g = funcol.all_gather_tensor(y, 0, dist.group.WORLD).wait()  # an explicit wait_tensor
    trace = cap.trace
    report = trace.validate()
    gather = next(c for c in trace.collectives if c.func == "all_gather")
    wait = trace["wait_tensor_1"]
    return {
        "gather": (gather.state, gather.complete_ns, gather.out_numel, gather.is_async),
        "wait_end": wait.start_ns + wait.duration_ns,
        "wait_parents": [trace[i].label for i in wait.parents],
        "g": g.tolist(),
        "mul": trace["mul_1"].out.tolist(),
        "all_reduce_1": trace["all_reduce_1"].out.tolist(),
        "all_reduce_2": trace["all_reduce_2"].out.tolist(),
        "add": trace["add_1"].out.tolist(),
        "z": z.tolist(),
        "mismatches": len(report.mismatches),
        "skipped": dict(report.skipped),
    }


@pytest.mark.slow
def test_saved_values_around_in_place_collectives(tmp_path):
    results = run_ranks(_saved_values, world_size=2, tmp_path=tmp_path)
    for rank, res in enumerate(results):
        # c10d's schema does not mark allreduce_'s write; tl_dist declares it, so the value mul_1 produced is
        # copied before the collective overwrites it.
        assert res["mul"] == [float(rank + 1)] * 4
        assert res["all_reduce_1"] == [3.0] * 4  # 1 + 2
        assert res["all_reduce_2"] == [6.0] * 4 and res["add"] == res["z"] == [7.0] * 4
        # Replaying a collective would need every member: validate skips them and checks the rest.
        assert res["mismatches"] == 0
        assert {"all_reduce_1", "all_reduce_2"} <= set(res["skipped"])
        # A functional collective completes at the wait_tensor user code calls on it (same clock, exact).
        assert res["gather"] == ("completed", res["wait_end"], 8, True)
        assert res["wait_parents"] == ["all_gather_1"] and res["g"] == [3.0] * 8


def _rank1_raises(rank, world_size, out_dir):
    if rank == 1:
        raise ValueError("rank one refuses")
    dist.all_reduce(torch.ones(1))  # waits for rank 1 forever (gloo's timeout is the helper's 60 s)
    return {"rank": rank}


@pytest.mark.slow
def test_run_ranks_reports_the_failing_rank(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(_rank1_raises, world_size=2, tmp_path=tmp_path, timeout=60)
    message = str(info.value)
    assert "--- rank 1 raised" in message and "ValueError: rank one refuses" in message
    # Rank 0, stuck in the all-reduce with the dead rank, fails (gloo: peer closed) or is killed soon after.
    assert "rank 0" in message and time.monotonic() - t0 < 45


def test_undescribable_collective_warns_and_keeps_its_op_row():
    # A collective call tl_dist cannot describe (here: its process group is not one) must not break the
    # user's step: its op row stays, it gets no collective row, and one warning names it.
    from tl_dist._recorder import Recorder
    from tl_dist.comm_ops import comm_op

    rec = Recorder(save=None, keep_graph=False, source=False, roots=[], save_grads=None, stats=None)
    comm = comm_op(torch.ops.c10d.allreduce_.default)
    outs = [torch.ones(2)]
    with pytest.warns(RuntimeWarning, match="could not describe collective all_reduce"):
        assert rec.comm.record(0, comm, (outs, object()), {}, None, outs, 0, 1) is outs
    assert rec.comm.columns()["op"] == []
