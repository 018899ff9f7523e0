"""Capture of torch.compile'd models (default Inductor backend, CPU): compiled regions as ops (docs/compile.md).

Each compiled model is compiled once per module (compilation takes seconds here) and compared with the same
compiled model run outside a window from the same parameters: the window must not change what ran.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.flop_counter import FlopCounterMode

import tl_dist as tl
from tl_dist._opinfo import EXTRA_FLOP_FORMULAS
from tl_dist.store import write_shard

tl.watch_compiles()  # before anything below compiles


def _compile_counts() -> dict[str, int]:
    return {
        "frames": counters["frames"]["total"],
        "graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
        "aot": counters["aot_autograd"]["total"],
    }


def _step(model: torch.nn.Module, compiled, x: torch.Tensor) -> tuple[torch.Tensor, dict, dict]:
    """One SGD step of ``compiled`` (a compiled view of ``model``): loss, gradients, new parameters."""
    model.zero_grad(set_to_none=True)
    loss = compiled(x).square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _twin_steps(model: torch.nn.Module, compiled, x: torch.Tensor):
    """The same step outside and inside a window, from the same parameters: (plain, captured, trace)."""
    start = copy.deepcopy(model.state_dict())
    _step(model, compiled, x)  # compiles (forward and backward)
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(start[k])
    plain = _step(model, compiled, x)
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(start[k])
    before = _compile_counts()
    with tl.capture() as cap:
        captured = _step(model, compiled, x)
    assert _compile_counts() == before  # the window compiled nothing, recompiled nothing
    return plain, captured, cap.trace


def _assert_bit_equal(plain, captured) -> None:
    assert torch.equal(plain[0], captured[0])
    for a, b in ((plain[1], captured[1]), (plain[2], captured[2])):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name


def _reference_flops(model: torch.nn.Module, x: torch.Tensor) -> int:
    """FLOPs of an eager forward + backward of the loss, counted by torch's own FlopCounterMode (given torch's
    attention formulas for the CPU attention kernel, which its registry lacks)."""
    eager = copy.deepcopy(model)
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter:
        eager(x).square().mean().backward()
    return counter.get_total_flops()


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.fixture(scope="module")
def mlp_run():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(3, 4)
    compiled = torch.compile(model)
    plain, captured, trace = _twin_steps(model, compiled, x)
    return model, x, plain, captured, trace, compiled


def test_compiled_mlp_step_equals_uncaptured_compiled_step(mlp_run):
    _, _, plain, captured, _, _ = mlp_run
    _assert_bit_equal(plain, captured)


def test_compiled_mlp_regions_are_ops(mlp_run):
    model, x, _, _, trace, _ = mlp_run
    cols = trace.columns
    regions = [i for i, k in enumerate(cols["kind"]) if k == "compiled"]
    assert [cols["func"][i] for i in regions] == ["compiled_forward", "compiled_backward"]
    fwd, bwd = regions
    # Forward: addmm 2*3*4*8 = 192, addmm 2*3*8*2 = 96. Backward: fc2 grad input 2*3*2*8 = 96 and weight
    # 2*2*3*8 = 96, fc1 grad weight 2*8*3*4 = 192 (x needs no gradient).
    assert cols["flops"][fwd] == 288 and cols["flops"][bwd] == 384
    assert cols["flops"][fwd] + cols["flops"][bwd] == _reference_flops(model, x)
    assert cols["phase"][fwd] == "forward" and cols["phase"][bwd] == "backward"
    assert cols["fwd_op"][bwd] == fwd  # the backward region runs the forward region's autograd node
    assert cols["duration_ns"][fwd] > 0 and cols["duration_ns"][bwd] > 0
    assert cols["module"][fwd] == "" and trace.module_table["type"] == ["MLP"]
    # Inputs: both layers' weights and biases and x; first output: the model's output.
    assert sorted(cols["in_shapes"][fwd]) == sorted([(8, 4), (8,), (3, 4), (2, 8), (2,)])
    assert cols["out_shapes"][fwd][0] == (3, 2) and cols["dtype"][fwd] == "float32"
    assert set(cols["params"][fwd]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    # Edges: the loss's square reads the forward region's output; no op of the compiled code is eager.
    square = cols["func"].index("pow") if "pow" in cols["func"] else cols["func"].index("mul")
    assert fwd in cols["parents"][square]
    assert "addmm" not in cols["func"] and "mm" not in cols["func"]


def test_compiled_mlp_inner_ops_carry_modules(mlp_run):
    _, _, _, _, trace, _ = mlp_run
    table = trace.compiled_table
    fwd = trace.columns["kind"].index("compiled")
    rows = [k for k, r in enumerate(table["region"]) if r == fwd]
    by_func = [(table["func"][k], table["module"][k], table["flops"][k]) for k in rows if table["flops"][k]]
    assert by_func == [("addmm", "fc1", 192), ("addmm", "fc2", 96)]
    bwd_flops: dict[str, int] = {}
    for region, module, flops in zip(table["region"], table["module"], table["flops"]):
        if region != fwd:
            bwd_flops[module] = bwd_flops.get(module, 0) + flops
    assert {m: f for m, f in bwd_flops.items() if f} == {"fc2": 192, "fc1": 192}


def test_compiled_region_time_is_split_over_modules_by_flops(mlp_run):
    _, _, _, _, trace, _ = mlp_run
    t = tl.telemetry.summarize(trace)
    cols = trace.columns
    fwd = cols["kind"].index("compiled")
    forward = {r.module: r for r in t.modules if r.phase == "forward"}
    dur = cols["duration_ns"][fwd]
    # fc1 has 192 of the region's 288 FLOPs, fc2 96: 2/3 and 1/3 of its time (fc1 gets the rounding remainder)
    assert forward["fc2"].duration_ns == dur * 96 // 288
    assert forward["fc1"].duration_ns == dur - dur * 96 // 288
    assert forward["fc1"].flops == 192 and forward["fc2"].flops == 96
    assert forward[""].duration_ns >= dur  # the root includes the whole region (and the loss ops after it)


def test_report_module_table_splits_region_time_by_flops(mlp_run):
    from tl_dist.report.data import Run

    _, _, _, _, trace, _ = mlp_run
    cols = trace.columns
    fwd, bwd = [i for i, k in enumerate(cols["kind"]) if k == "compiled"]
    rows = {r["module"]: r for r in Run.of(trace).modules()}
    # fc1: 192 of the forward region's 288 FLOPs and 192 of the backward's 384; fc2 the rest (integer ns, the
    # remainder of each split to the larger share)
    fd, bd = cols["duration_ns"][fwd], cols["duration_ns"][bwd]
    assert rows["fc2"]["forward"] == fd * 96 // 288
    assert rows["fc1"]["forward"] == fd - fd * 96 // 288
    assert rows["fc1"]["backward"] + rows["fc2"]["backward"] == bd
    assert rows["fc1"]["flops"] == 192 + 192 and rows["fc2"]["flops"] == 96 + 192


def test_compiled_trace_round_trips_through_a_shard(mlp_run, tmp_path):
    _, _, _, _, trace, _ = mlp_run
    loaded = tl.load(write_shard(trace, tmp_path / "step.h5"))
    assert loaded.compiled_table == trace.compiled_table
    assert loaded.columns["kind"] == trace.columns["kind"]


def test_traced_compiled_model_saves_and_validates_its_regions(mlp_run):
    model, x, _, _, _, compiled = mlp_run
    trace = tl.trace(compiled, x)
    (region,) = [op for op in trace if op.kind == "compiled"]
    assert torch.equal(trace.output, model(x))  # the eager model gives the same bits here
    assert torch.equal(region.out[0], trace.output)  # the region's first output is the model's output
    report = trace.validate()  # re-runs the compiled region from its saved inputs
    assert report and report.checked == len(trace)


class Block(torch.nn.Module):
    """A tiny pre-norm transformer block; the eager function between attention and MLP breaks the graph."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.GELU(), torch.nn.Linear(16, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = _eager_scale(x)
        return x + self.mlp(x)


@torch.compiler.disable
def _eager_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5


def test_compiled_block_with_graph_break():
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 3, 8)
    plain, captured, trace = _twin_steps(model, torch.compile(model), x)
    _assert_bit_equal(plain, captured)
    cols = trace.columns
    kinds = [(cols["func"][i], cols["phase"][i]) for i, k in enumerate(cols["kind"]) if k == "compiled"]
    assert kinds.count(("compiled_forward", "forward")) == 2
    assert kinds.count(("compiled_backward", "backward")) == 2
    first, second = [i for i, f in enumerate(cols["func"]) if f == "compiled_forward"]
    # The graph break runs eagerly between the regions: its mul reads the first region and feeds the second.
    between = [
        i for i in range(first + 1, second) if cols["func"][i] == "mul" and cols["phase"][i] == "forward"
    ]
    assert len(between) == 1 and first in cols["parents"][between[0]]
    assert between[0] in cols["parents"][second]
    # FLOPs of the four regions and the eager mul add up to torch's count of the eager step.
    assert sum(cols["flops"]) == _reference_flops(model, x)
    modules = {m for m, f in zip(trace.compiled_table["module"], trace.compiled_table["flops"]) if f}
    assert {"attn", "mlp.0", "mlp.2"} <= modules


class Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.body = MLP()
        self.body.fc1 = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(torch.relu(self.inp(x))))


def test_model_with_one_compiled_submodule():
    torch.manual_seed(0)
    model = Outer()
    model.body = torch.compile(model.body)
    x = torch.randn(3, 4)
    plain, captured, trace = _twin_steps(model, model, x)
    _assert_bit_equal(plain, captured)
    cols = trace.columns
    assert trace.module_table["address"] == ["", "inp", "body", "out"]
    assert trace.module_table["type"] == ["Outer", "Linear", "MLP", "Linear"]
    eager_addmm = [cols["module"][i] for i, f in enumerate(cols["func"]) if f == "addmm"]
    assert eager_addmm == ["inp", "out"]  # the layers around the compiled one ran eagerly
    regions = [i for i, k in enumerate(cols["kind"]) if k == "compiled"]
    assert [cols["module"][i] for i in regions] == ["body", "body"]
    assert cols["module_stack"][regions[0]] == ("", "body")
    table = trace.compiled_table
    assert {m for m, f in zip(table["module"], table["flops"]) if f} == {"body.fc1", "body.fc2"}
    # 2*3*8*8 + 2*3*8*2 = 480 forward FLOPs inside body
    assert cols["flops"][regions[0]] == 480
    eager = copy.deepcopy(model)
    eager.body = eager.body._orig_mod
    assert sum(cols["flops"]) == _reference_flops(eager, x)
    t = tl.telemetry.summarize(trace)
    forward = {r.module: r for r in t.modules if r.phase == "forward"}
    assert (
        forward["body.fc1"].duration_ns + forward["body.fc2"].duration_ns == cols["duration_ns"][regions[0]]
    )


def _ddp_compiled(rank, world_size, out_dir):
    from pathlib import Path

    tl.arm(Path(out_dir) / "run")  # the twin's window is the armed session's first window: one shard per rank
    torch.manual_seed(0)
    model = MLP()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    plain, captured, trace = _twin_steps(model, torch.compile(ddp), x)
    tl.disarm()
    cols = trace.columns
    equal = torch.equal(plain[0], captured[0]) and all(
        torch.equal(plain[k][n], captured[k][n]) for k in (1, 2) for n in plain[k]
    )
    return {
        "equal": equal,
        "regions": [cols["func"][i] for i, k in enumerate(cols["kind"]) if k == "compiled"],
        "collectives": [(c.func, c.in_numel) for c in trace.collectives],
        "grad": captured[1]["fc1.weight"],
    }


@pytest.mark.slow
def test_ddp_compiled_job_on_two_ranks(tmp_path):
    from dist_helpers import run_ranks

    results = run_ranks(_ddp_compiled, world_size=2, tmp_path=tmp_path, timeout=600.0)
    for res in results:
        assert res["equal"]  # each rank's captured step equals its uncaptured compiled step bit for bit
        assert res["regions"] == ["compiled_forward", "compiled_backward"]
        # DDP's one bucket all-reduce of every gradient: 8*4 + 8 + 2*8 + 2 = 58 elements
        assert res["collectives"] == [("all_reduce", 58)]
    assert torch.equal(results[0]["grad"], results[1]["grad"])  # the all-reduced gradients agree
    merged = tl.merge_ranks(tmp_path / "run")
    assert merged.findings == []


WINDOW_WITHOUT_DYNAMO = r"""
import contextlib, io, sys, torch
import tl_dist as tl

m = torch.nn.Linear(4, 2)
with tl.capture() as cap:
    m(torch.randn(3, 4)).sum().backward()
assert len(cap.trace) > 0
print("imported" if "torch._dynamo" in sys.modules else "not imported")
from torch._dynamo.utils import counters

def make():  # a new code object each time: Dynamo caches compiled frames by code object
    namespace = {}
    exec(
        "def g(x):\n"
        "    y = x * 2\n"
        "    print(y)\n"  # a graph break: eager ops (printing) run with Dynamo's frame callback on
        "    return y.relu()\n",
        namespace,
    )
    return torch.compile(namespace["g"], backend="eager")

x = torch.randn(3)
with contextlib.redirect_stdout(io.StringIO()):
    make()(x)  # the first compile also meets torch's own frames (printing)
    before = counters["frames"]["total"]
    make()(x)
    outside = counters["frames"]["total"] - before
    with tl.capture() as cap:
        make()(x)
print(outside, counters["frames"]["total"] - before - outside, cap.trace.columns["func"][-2:])
"""


def test_a_window_neither_imports_dynamo_nor_is_compiled_by_it():
    # The capture's dispatch mode opts out of torch's per-op torch._disable_dynamo wrapper (which imports
    # Dynamo, ~1.5 s, at a process's first window); its code is marked for Dynamo to skip instead. A fresh
    # process, so that nothing imported Dynamo before.
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", WINDOW_WITHOUT_DYNAMO], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    imported, counts = done.stdout.strip().splitlines()
    assert imported == "not imported"
    outside, inside, last = counts.split(" ", 2)
    assert int(inside) == int(outside) > 0  # the same frames compiled in a window as outside: none of ours
    assert last == "['mul', 'relu']"  # the compiled function's ops after the break (eager backend)


def test_a_window_silences_torchs_global_hook_warning_and_leaves_the_filters_as_they_were():
    # torch warns at a compiled module's call that global hooks fire for its wrapper too; inside a window the
    # hooks are tl_dist's (which count wrapper and module as one call), so the user must not see it there.
    import warnings

    from torch.nn.modules.module import register_module_forward_hook

    compiled = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    x = torch.randn(3, 2)
    compiled(x)
    message = "when there are global hooks"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="the user's own filter", category=DeprecationWarning)
        before = list(warnings.filters)
        with tl.capture() as cap:
            compiled(x)
        assert list(warnings.filters) == before  # nothing of the window's is left
        with pytest.raises(RuntimeError, match="the user's code failed"), tl.capture():
            compiled(x)
            raise RuntimeError("the user's code failed")
        assert list(warnings.filters) == before  # nor when the window ends in an exception
        assert [str(w.message) for w in caught if message in str(w.message)] == []
        assert cap.trace.module_table["address"] == [""]
        handle = register_module_forward_hook(
            lambda *args: None
        )  # a hook of the user's: torch's warning stands
        try:
            compiled(x)
        finally:
            handle.remove()
        assert len([w for w in caught if message in str(w.message)]) == 1
        # the same filter already the user's: the window neither moves nor removes it
        warnings.filterwarnings(
            "ignore",
            message=r"Using `torch\.compile\(module\)` when there are global hooks",
            category=UserWarning,
        )
        warnings.simplefilter("always", RuntimeWarning)
        before = list(warnings.filters)
        with tl.capture():
            compiled(x)
        assert list(warnings.filters) == before


def test_a_model_compiled_for_the_first_time_inside_a_window_is_compiled():
    # tl.arm(every=N) captures step 0, where a compiled model compiles. Dynamo inlines the global module hooks
    # into the frame it traces: a hook that called into torch._C there broke the graph before the first op,
    # and Dynamo then ran that frame eagerly for the rest of the process.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(model)
    x = torch.randn(4, 8)
    breaks = sum(counters["graph_break"].values())
    before = _compile_counts()
    with tl.capture() as first:
        compiled(x).sum().backward()
    after = _compile_counts()
    assert sum(counters["graph_break"].values()) == breaks
    assert after["graphs"] == before["graphs"] + 1 and after["aot"] == before["aot"] + 1
    assert [op.func for op in first.trace if op.kind == "compiled"] == [
        "compiled_forward",
        "compiled_backward",
    ]
    compiled(x).sum().backward()  # outside: at most one recompile (the hooks it was traced with are gone)
    settled = _compile_counts()
    assert settled["graphs"] <= after["graphs"] + 1
    with tl.capture() as later:
        compiled(x).sum().backward()
    assert _compile_counts()["graphs"] == settled["graphs"]
    assert [op.func for op in later.trace if op.kind == "compiled"] == [
        "compiled_forward",
        "compiled_backward",
    ]
