"""torch's own parallelism APIs on 2 real gloo ranks, as a user runs them: tensor parallel with sequence
parallel (``parallelize_module``), pipeline parallel (``Schedule1F1B``, ``ScheduleGPipe``), DDP with
``no_sync`` and ``find_unused_parameters``, and a ``recv`` from any source.

Each window is checked against an uncaptured twin run on the same rank (same seed, same inputs): the twin's
collectives are counted by an independent dispatch mode (letting DTensor desugar first, as torch's
CommDebugMode does), and after the step both models' parameters must be bitwise equal. The sequence numbers
recorded per group must be exactly the range the group's counter (``_get_sequence_number_for_group``)
advanced through in the window, and the merge must join every collective with no finding. One multi-process
run covers every style (spawning ranks is most of the cost).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tl_dist as tl

pytestmark = pytest.mark.slow

# The dispatcher's communication ops, by overload packet name, as tl_dist's ``func`` names them.
_FUNCS = {
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "all_gather_into_tensor": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "broadcast_": "broadcast",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
}
_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


class CommCounter(TorchDispatchMode):
    """The twin's collectives in issue order, as (func, phase); ``phase`` is set by the test around each part
    of the step, and "backward" inside the autograd engine."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str]] = []
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its dispatch (and its collectives) with this mode on
        name = func._overloadpacket.__name__
        if func.namespace in _NAMESPACES and name in _FUNCS:
            phase = "backward" if torch._C._current_graph_task_id() != -1 else self.phase
            self.log.append((_FUNCS[name], phase))
        return func(*args, **(kwargs or {}))


class _Phases:
    """Sets the phase of a CommCounter (or nothing, for the captured run) around parts of a step."""

    def __init__(self, counter: CommCounter | None) -> None:
        self.counter = counter

    def __call__(self, phase: str) -> None:
        if self.counter is not None:
            self.counter.phase = phase


def _window(step, groups, run, twin_run, models):
    """Run ``run`` in capture window ``step`` and ``twin_run`` uncaptured under a CommCounter; return what the
    test compares: the recorded collectives, the groups' counter ranges, the twin's log, parameter equality."""
    counter = CommCounter()
    with counter:
        twin_run(_Phases(counter))
    before = {name: g._get_sequence_number_for_group() for name, g in groups.items()}
    with tl.capture(step=step) as cap:
        run(_Phases(None))
    after = {name: g._get_sequence_number_for_group() for name, g in groups.items()}
    names = {name: g.group_name for name, g in groups.items()}
    trace = cap.trace
    rows = [
        {
            "func": c.func,
            "group": c.group_name,
            "seq": c.seq,
            "state": c.state,
            "phase": trace[c.op].phase,
            "module": trace[c.op].module,
            "bucket": c.bucket,
            "peer": c.peer,
            "dtype": c.dtype,
        }
        for c in trace.collectives
    ]
    captured, twin = models

    def local(p):
        return p.to_local() if hasattr(p, "to_local") else p

    equal = all(
        torch.equal(local(a), local(b)) for a, b in zip(captured.parameters(), twin.parameters(), strict=True)
    )
    return {
        "rows": rows,
        "ranges": {names[n]: (before[n], after[n]) for n in groups},
        "twin": counter.log,
        "params_equal": equal,
    }


def _sum_step(model, opt, x):
    """A training step on ``x.sum()`` as a function of the phase setter (see :func:`_window`)."""

    def run(phase):
        phase("forward")
        model(x).sum().backward()
        phase("optimizer")
        opt.step()
        opt.zero_grad()

    return run


class _TPModel(nn.Module):
    """Colwise -> Rowwise (output sharded on the sequence) -> SequenceParallel LayerNorm -> Colwise (input
    sharded on the sequence) -> Rowwise: every TP/SP redistribution, and LayerNorm grads that are Partial."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.up2 = nn.Linear(8, 16)
        self.down2 = nn.Linear(16, 8)

    def forward(self, x):
        h = self.norm(self.down(torch.relu(self.up(x))))
        return self.down2(torch.relu(self.up2(h)))


class _DDPModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _tp(rank, ws, step):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (ws,))
    plan = {
        "up": ColwiseParallel(),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "up2": ColwiseParallel(input_layouts=Shard(1)),
        "down2": RowwiseParallel(),
    }
    torch.manual_seed(0)
    base = _TPModel()
    models = [parallelize_module(copy.deepcopy(base), mesh, plan) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    x = torch.randn(2, 4, 8)

    def make(k):
        return _sum_step(models[k], opts[k], x)

    return _window(step, {"tp": mesh.get_group()}, make(0), make(1), models)


def _pipeline(rank, ws, step, schedule_cls):
    from torch.distributed.pipelining import PipelineStage

    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(ws)]
    models = [copy.deepcopy(layers[rank]) for _ in range(2)]
    stages = [PipelineStage(m, rank, ws, torch.device("cpu")) for m in models]
    schedules = [
        schedule_cls(s, n_microbatches=4, loss_fn=lambda out, target: ((out - target) ** 2).sum())
        for s in stages
    ]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def make(k):
        def run(phase):
            phase("forward")
            if rank == 0:
                schedules[k].step(x)
            else:
                schedules[k].step(target=y)
            phase("optimizer")
            opts[k].step()
            opts[k].zero_grad()

        return run

    make(0)(_Phases(None))  # first steps outside the windows: any one-time setup of the stages
    make(1)(_Phases(None))
    return _window(step, {"world": dist.group.WORLD}, make(0), make(1), models)


def _ddp(rank, ws, step):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = _DDPModel()
    models = [DDP(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=0.0001) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    torch.manual_seed(1 + rank)
    xs = [torch.randn(4, 8) for _ in range(3)]

    def make(k):
        def run(phase):
            phase("forward")
            with models[k].no_sync():
                models[k](xs[0]).sum().backward()
            models[k](xs[1]).sum().backward()
            # A recv from any source: the source rank is known only once it completed.
            t = torch.zeros(2)
            if rank == 0:
                dist.recv(t)
            elif rank == 1:
                dist.send(torch.ones(2), 0)
            phase("optimizer")
            opts[k].step()
            opts[k].zero_grad()

        return run

    for k in (0, 1):  # DDP's first iteration runs with one bucket, rebuilt after it: not the one to check
        models[k](xs[2]).sum().backward()
        opts[k].zero_grad()
    return _window(step, {"world": dist.group.WORLD}, make(0), make(1), models)


def _body(rank, world_size, out_dir):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    tl.arm(out_dir / "run")
    results = {
        "tp_sp": _tp(rank, world_size, 1),
        "1f1b": _pipeline(rank, world_size, 2, Schedule1F1B),
        "gpipe": _pipeline(rank, world_size, 3, ScheduleGPipe),
        "ddp": _ddp(rank, world_size, 4),
    }
    tl.disarm()
    return results


def test_parallelism_styles_recorded_completely_and_judged_right(tmp_path):
    results = run_ranks(_body, world_size=2, tmp_path=tmp_path, timeout=240)
    for rank, per in enumerate(results):
        for name, r in per.items():
            rows = r["rows"]
            where = f"rank {rank} {name}"
            assert r["params_equal"], where
            # Every collective the group issued in the window, each number once: the counter's range.
            for group, (lo, hi) in r["ranges"].items():
                seqs = sorted(row["seq"] for row in rows if row["group"] == group)
                assert seqs == list(range(lo + 1, hi + 1)), (where, seqs, lo, hi)
            assert all(row["group"] in r["ranges"] for row in rows), where
            assert all(row["state"] == "completed" for row in rows), (where, rows)
            got = [(row["func"], row["phase"]) for row in rows]
            assert got == r["twin"], (where, got, r["twin"])
    tp = [row for row in results[0]["tp_sp"]["rows"]]
    # Forward: down's output reduce_scatter (Shard(1)), up2's input all_gather, down2's output all_reduce;
    # backward: their gradients; opt.step(): DTensor all-reduces the Partial LayerNorm weight and bias grads.
    assert [(row["func"], row["phase"]) for row in tp] == [
        ("reduce_scatter", "forward"),
        ("all_gather", "forward"),
        ("all_reduce", "forward"),
        ("reduce_scatter", "backward"),
        ("all_gather", "backward"),
        ("all_reduce", "optimizer"),
        ("all_reduce", "optimizer"),
    ]
    # Each belongs to the module whose call (or whose forward hook) issued it; a backward one to the module of
    # the forward redistribution it differentiates; the optimizer's to no module.
    assert [row["module"] for row in tp] == ["down", "up2", "down2", "up2", "down", "", ""]
    # 4 micro-batches over 2 stages: an activation and a gradient per micro-batch, a send/recv pair each.
    for name in ("1f1b", "gpipe"):
        assert sorted(row["func"] for row in results[0][name]["rows"]) == ["recv"] * 4 + ["send"] * 4
    ddp = results[0]["ddp"]["rows"]
    # The used-parameter map (int32, one per parameter) is no gradient bucket; the recv names its source.
    used = [row for row in ddp if row["func"] == "all_reduce" and row["dtype"] == "int32"]
    assert len(used) == 1 and used[0]["bucket"] == -1, ddp
    buckets = [row["bucket"] for row in ddp if row["func"] == "all_reduce" and row["dtype"] == "float32"]
    assert buckets == list(range(len(buckets))) and len(buckets) >= 2, ddp
    assert [row["peer"] for row in ddp if row["func"] == "recv"] == [1]

    g = tl.merge_ranks(tmp_path / "run")
    assert g.findings == [], g.summary()
    frame = g.collectives
    assert set(frame.verdict) == {"matched"}
    assert all(len(r) == 2 for r in frame.ranks)
    for step, name in enumerate(("tp_sp", "1f1b", "gpipe", "ddp"), start=1):
        n_p2p = sum(row["func"] in ("send", "recv") for row in results[0][name]["rows"])
        n = len(results[0][name]["rows"]) - n_p2p
        # A send and its recv join as one; every other collective once per group.
        assert (frame.step == step).sum() == n + n_p2p, (name, frame[frame.step == step])


def _two_d(rank, world_size, out_dir):
    """FSDP2 over the "dp" dimension of a 2 x 2 mesh, tensor parallel over "tp" (torch's 2-D recipe)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tl.arm(out_dir / "run")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    torch.manual_seed(0)
    base = nn.Sequential()
    base.add_module("up", nn.Linear(8, 16))
    base.add_module("down", nn.Linear(16, 8))
    models = []
    for _ in range(2):
        m = parallelize_module(copy.deepcopy(base), mesh["tp"], plan)
        fully_shard(m, mesh=mesh["dp"])
        models.append(m)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    torch.manual_seed(1 + mesh.get_coordinate()[0])  # the same batch within a TP group
    x = torch.randn(4, 8)

    def make(k):
        return _sum_step(models[k], opts[k], x)

    for k in (0, 1):  # FSDP's lazy init outside the window
        make(k)(_Phases(None))
    groups = {"dp": mesh.get_group("dp"), "tp": mesh.get_group("tp")}
    result = _window(1, groups, make(0), make(1), models)
    tl.disarm()
    return result


def test_two_d_fsdp_and_tensor_parallel_four_ranks(tmp_path):
    results = run_ranks(_two_d, world_size=4, tmp_path=tmp_path, timeout=240)
    for rank, r in enumerate(results):
        rows = r["rows"]
        assert r["params_equal"], rank
        for group, (lo, hi) in r["ranges"].items():
            seqs = sorted(row["seq"] for row in rows if row["group"] == group)
            assert seqs == list(range(lo + 1, hi + 1)), (rank, group, seqs, lo, hi)
        assert all(row["group"] in r["ranges"] for row in rows), rank
        assert all(row["state"] == "completed" for row in rows), (rank, rows)
        assert [(row["func"], row["phase"]) for row in rows] == r["twin"], (rank, rows, r["twin"])
        assert {row["group"] for row in rows} == set(r["ranges"]), rank  # both dimensions communicate
    g = tl.merge_ranks(tmp_path / "run")
    assert g.findings == [], g.summary()
    assert set(g.collectives.verdict) == {"matched"}
    assert sorted(map(len, g.collectives.ranks)) == [2] * len(g.collectives)
