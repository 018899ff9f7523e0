"""Collectives inside torch.compile'd graphs (docs/compile.md "Collectives inside compiled regions").

Two real gloo ranks. Each job runs the same compiled step outside a window (the twin) and inside one, from the
same parameters: the captured step must equal the twin bit for bit, the window's collective rows must number
what the process group's own sequence counter advanced by, and the merge must join them with 0 findings.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import tl_dist as tl

pytestmark = pytest.mark.slow


class _AllReduceNet(torch.nn.Module):
    """A Linear whose output is summed over the ranks with a functional collective (traced into the graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 6)
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        h = funcol.all_reduce(self.fc(x), "sum", dist.group.WORLD)
        return self.head(torch.relu(h))


class _EarlyNet(torch.nn.Module):
    """Compiled before ``watch_compiles`` (a class of its own: Dynamo would reuse its graph for another instance of
    the same forward's code)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(self.fc(x), "sum", dist.group.WORLD).relu()


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _seq() -> int:
    import torch.distributed as dist

    return int(dist.group.WORLD._get_sequence_number_for_group())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _twin(model: torch.nn.Module, step, out_dir: Path) -> dict:
    """Compile (two steps), then the same step outside and inside an armed window from the same parameters."""
    from torch._dynamo.utils import counters

    start = copy.deepcopy(model.state_dict())

    def run() -> tuple:
        model.zero_grad(set_to_none=True)
        loss = step()
        # FSDP2's gradients are DTensors: their local shards are what this rank holds.
        return loss.detach(), {n: _local(p.grad).clone() for n, p in model.named_parameters()}

    def reset() -> None:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(start[k])

    run()
    run()  # compiles forward and backward (and compiled autograd's graph on its first two backwards)
    reset()
    plain = run()
    reset()
    frames = dict(counters["frames"])
    tl.arm(out_dir / "run")  # one window: one shard per rank
    before = _seq()
    with tl.capture() as cap:
        captured = run()
    after = _seq()
    tl.disarm()
    trace = cap.trace
    cols = trace.columns
    regions = [i for i, k in enumerate(cols["kind"]) if k == "compiled"]
    inside = []
    for c in trace.collectives:
        # The region whose run contains the collective's issue.
        owner = [
            r
            for r in regions
            if cols["start_ns"][r] <= c.issue_ns <= cols["start_ns"][r] + cols["duration_ns"][r]
        ]
        inside.append(
            {
                "func": c.func,
                "ranks": tuple(c.group_ranks),
                "seq": c.seq,
                "numel": c.in_numel,
                "dtype": c.dtype,
                "is_async": c.is_async,
                "state": c.state,
                "region": cols["func"][owner[0]] if len(owner) == 1 else None,
                "in_region": len(owner) == 1
                and c.issue_ns <= c.complete_ns <= cols["start_ns"][owner[0]] + cols["duration_ns"][owner[0]],
                "region_reads_it": len(owner) == 1 and c.op in cols["parents"][owner[0]],
                "op_before_region": len(owner) == 1 and c.op < owner[0],
            }
        )
    return {
        "equal": torch.equal(plain[0], captured[0])
        and all(torch.equal(plain[1][n], captured[1][n]) for n in plain[1]),
        "compiled_nothing": dict(counters["frames"]) == frames,
        "seq_before": before,
        "seq_after": after,
        "regions": [cols["func"][i] for i in regions],
        "unknown": trace.metadata.get("compiled_unknown", 0),  # region runs of graphs tl_dist did not see
        "collectives": inside,
    }


def _functional_job(rank: int, world_size: int, out_dir: Path) -> dict:
    # Compiled before watch_compiles: tl_dist never sees its graph (it still records its collectives).
    torch.manual_seed(1)
    early = torch.compile(_EarlyNet())
    x1 = torch.randn(3, 4)
    for _ in range(2):
        early(x1).sum().backward()
    tl.watch_compiles()
    torch.manual_seed(0)
    model = _AllReduceNet()
    compiled = torch.compile(model)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))

    def step() -> torch.Tensor:
        loss = compiled(x).square().mean()
        loss.backward()
        return loss

    result = _twin(model, step, out_dir)
    # tl.trace saves every op: validate re-runs regions from their saved inputs, but not one that communicates.
    traced = tl.trace(compiled, x)
    result["validate"] = traced.validate().skipped
    result["traced_regions"] = [op.label for op in traced if op.kind == "compiled"]
    before = _seq()
    with tl.capture() as cap:
        early(x1).sum().backward()
    result["early"] = (
        cap.trace.metadata.get("compiled_unknown"),
        [c.func for c in cap.trace.collectives],
        _seq() - before,
    )
    return result


def test_functional_all_reduce_in_a_compiled_graph_is_recorded_and_merged(tmp_path):
    from dist_helpers import run_ranks

    results = run_ranks(_functional_job, world_size=2, tmp_path=tmp_path, timeout=600.0)
    for res in results:
        assert res["equal"] and res["compiled_nothing"] and res["unknown"] == 0
        assert res["regions"] == ["compiled_forward", "compiled_backward"]
        # Independent count: the group's own sequence counter advanced once per collective the window issued.
        assert len(res["collectives"]) == res["seq_after"] - res["seq_before"] == 2
        assert [c["seq"] for c in res["collectives"]] == list(
            range(res["seq_before"] + 1, res["seq_after"] + 1)
        )
        for c in res["collectives"]:
            assert (c["func"], c["ranks"], c["dtype"], c["is_async"], c["state"]) == (
                "all_reduce",
                (0, 1),
                "float32",
                True,
                "completed",
            )
            # fc's output (3 x 6) in forward; its gradient (all_reduce's backward is an all_reduce) in backward
            assert c["numel"] == 18
            assert c["in_region"] and c["region_reads_it"] and c["op_before_region"]
        assert [c["region"] for c in res["collectives"]] == ["compiled_forward", "compiled_backward"]
        # The traced forward issued its all_reduce inside its region.
        (region,) = res["traced_regions"]
        assert res["validate"][region].startswith("compiled region issuing collectives")
        # The graph compiled before watch_compiles: 2 region runs without a record, both all_reduces recorded.
        assert res["early"] == (2, ["all_reduce", "all_reduce"], 2)
    merged = tl.merge_ranks(tmp_path / "run")
    assert merged.findings == []
    frame = merged.collectives
    assert len(frame) == 2 and set(frame["verdict"]) == {"matched"}


def _ddp_python_reducer_job(rank: int, world_size: int, out_dir: Path) -> dict:
    from torch._dynamo import compiled_autograd

    tl.watch_compiles()
    # DDP's Python reducer: its gradient all-reduces are functional collectives in post-accumulate-grad hooks,
    # which compiled autograd traces into the backward graph (Inductor fuses them into one bucket).
    torch._dynamo.config.optimize_ddp = "python_reducer"
    torch.manual_seed(0)
    model = _MLP()
    compiled = torch.compile(torch.nn.parallel.DistributedDataParallel(model))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))

    def step() -> torch.Tensor:
        loss = compiled(x).square().mean()
        with compiled_autograd._enable(torch.compile(backend="inductor")):
            loss.backward()
        return loss

    result = _twin(model, step, out_dir)
    result["grad"] = model.fc1.weight.grad.clone()
    return result


def test_compiled_ddp_python_reducer_all_reduce_in_the_backward_graph(tmp_path):
    from dist_helpers import run_ranks

    results = run_ranks(_ddp_python_reducer_job, world_size=2, tmp_path=tmp_path, timeout=600.0)
    for res in results:
        assert res["equal"] and res["compiled_nothing"] and res["unknown"] == 0
        # The forward region, then compiled autograd's backward graph (a graph without autograd of its own)
        assert res["regions"] == ["compiled_forward", "compiled_inference"]
        assert len(res["collectives"]) == res["seq_after"] - res["seq_before"] == 1
        (c,) = res["collectives"]
        # One fused bucket of every gradient: 8*4 + 8 + 2*8 + 2 = 58 elements
        assert (c["func"], c["ranks"], c["numel"], c["dtype"], c["state"]) == (
            "all_reduce",
            (0, 1),
            58,
            "float32",
            "completed",
        )
        assert c["region"] == "compiled_inference" and c["in_region"] and c["region_reads_it"]
    assert torch.equal(results[0]["grad"], results[1]["grad"])  # the all-reduced gradients agree
    merged = tl.merge_ranks(tmp_path / "run")
    assert merged.findings == []
    assert list(merged.collectives["verdict"]) == ["matched"]


def _fsdp2_job(rank: int, world_size: int, out_dir: Path) -> dict:
    from torch.distributed.fsdp import fully_shard

    tl.watch_compiles()
    torch.manual_seed(0)
    model = _MLP()
    for module in (model.fc1, model.fc2, model):
        fully_shard(module)
    compiled = torch.compile(model)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))

    def step() -> torch.Tensor:
        loss = compiled(x).square().mean()
        loss.backward()
        return loss

    return _twin(model, step, out_dir)


def test_compiled_fsdp2_collectives_run_in_its_hooks_between_regions(tmp_path):
    from dist_helpers import run_ranks

    results = run_ranks(_fsdp2_job, world_size=2, tmp_path=tmp_path, timeout=600.0)
    for res in results:
        assert res["equal"] and res["compiled_nothing"]
        # Dynamo runs FSDP2's hooks eagerly: their all-gathers and reduce-scatters run between regions, not
        # inside one. fc1 holds 8*4 + 8 = 40 parameters (a shard of 20 per rank), fc2 2*8 + 2 = 18 (9): gathered
        # in forward, again in backward (resharded after forward), then their gradients reduce-scattered.
        assert len(res["collectives"]) == res["seq_after"] - res["seq_before"] == 6
        assert [(c["func"], c["numel"]) for c in res["collectives"]] == [
            ("all_gather", 20),
            ("all_gather", 9),
            ("all_gather", 9),
            ("all_gather", 20),
            ("reduce_scatter", 18),
            ("reduce_scatter", 40),
        ]
        assert all(c["region"] is None and c["state"] == "completed" for c in res["collectives"])
        assert "compiled_forward" in res["regions"] and "compiled_backward" in res["regions"]
    merged = tl.merge_ranks(tmp_path / "run")
    assert merged.findings == []
    assert set(merged.collectives["verdict"]) == {"matched"} and len(merged.collectives) == 6


@pytest.fixture
def world_of_one():
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("world_of_one")
def test_a_region_output_its_collective_wrote_can_be_written_in_place_after_it():
    """A compiled function returning its all_reduce's buffer, then written in place in the window: the region's
    collective writes are forgotten with the region, and the later in-place write is a write like any other."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    tl.watch_compiles()

    @torch.compile
    def doubled_sum(x):
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD)

    x = torch.randn(8)
    doubled_sum(x)
    with tl.capture() as cap:
        y = doubled_sum(x)
        y.add_(1)
        z = y * 3
    assert [(op.label, op.parents) for op in cap.trace] == [
        ("all_reduce_1", ()),
        ("compiled_inference_1", (0,)),
        ("add__1", (1,)),
        ("mul_1", (2,)),
    ]
    assert torch.equal(z, (x * 2 + 1) * 3)
