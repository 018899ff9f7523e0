"""tl.telemetry.summarize and the capture fixes it relies on: backward ops attributed to modules, phases under
optimizer.step(closure) and checkpoint recomputation, first_nonfinite on attention masks, other threads."""

import threading

import pytest
import torch
import torch.utils.checkpoint as ckpt
from merge_synth import coll, make_trace
from torch import nn

import tl_dist as tl
from tl_dist.telemetry import OUTSIDE, bus_factor, peak_flops_for, summarize


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_summarize_exact_flops_per_phase_and_module():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.capture() as cap:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    trace = cap.trace
    t = summarize(trace)
    # forward: addmm 3x4 @ 4x8 = 2*3*4*8 = 192, addmm 3x8 @ 8x2 = 2*3*8*2 = 96
    # backward: layer 2 grad input 3x2 @ 2x8 = 96 and grad weight 2x3 @ 3x8 = 96; layer 1 (its input needs no
    # grad) grad weight 8x3 @ 3x4 = 192
    assert t.flops == {"forward": 288, "backward": 384, "optimizer": 0, "recompute": 0}
    assert t.total_flops == 672 == sum(trace.columns["flops"])
    for phase in ("forward", "backward", "optimizer"):
        assert t.op_ns[phase] == sum(
            d for d, p in zip(trace.columns["duration_ns"], trace.columns["phase"]) if p == phase
        )
    rows = {(r.module, r.phase): r for r in t.modules}
    assert (rows[("0", "forward")].flops, rows[("0", "backward")].flops) == (192, 192)
    assert (rows[("2", "forward")].flops, rows[("2", "backward")].flops) == (96, 192)
    assert (rows[("", "forward")].flops, rows[("", "backward")].flops) == (288, 384)
    assert (
        rows[("0", "forward")].calls == 1
        and rows[("0", "forward")].depth == 1
        and rows[("0", "forward")].type == "Linear"
    )
    # The root row holds every op inside the model; the rest ran outside modules (sum, seed, update).
    inside = [i for i in range(len(trace)) if trace[i].module_stack]
    assert sum(r.ops for r in t.modules if r.module == "") == len(inside)
    assert sum(r.ops for r in t.modules if r.module == OUTSIDE) == len(trace) - len(inside)
    assert t.wall_ns == trace.metadata["window_end_ns"] - trace.metadata["window_start_ns"] > 0
    assert t.flops_per_second == pytest.approx(672 / (t.wall_ns / 1e9))
    assert t.mfu is None and t.peak_flops is None  # CPU: no peak known
    t2 = summarize(trace, peak_flops=1e9)
    assert t2.mfu == pytest.approx(t2.flops_per_second / 1e9)
    funcs = {(r.func, r.phase): r for r in t.funcs}
    assert funcs[("addmm", "forward")].count == 2 and funcs[("addmm", "forward")].flops == 288
    assert t.frame("modules").shape[0] == len(t.modules)
    with pytest.raises(ValueError, match="peak_flops"):
        summarize(trace, peak_flops=-1)
    with pytest.raises(ValueError, match="table must be one of"):
        t.frame("nope")


def test_bus_bandwidth_follows_nccl_tests():
    mib = 1 << 20
    ms = 1_000_000
    t0 = 10**12
    # Four ranks; float32 (4 bytes per element).
    rows = [
        coll(func="all_reduce", numel=mib // 4, issue=t0, complete=t0 + ms, group=(0, 1, 2, 3)),
        coll(
            func="all_gather",
            numel=mib // 4,
            out_numel=mib,
            issue=t0,
            complete=t0 + 2 * ms,
            group=(0, 1, 2, 3),
        ),
        coll(func="broadcast", numel=mib // 4, issue=t0 + 5 * ms, complete=t0 + 6 * ms, group=(0, 1, 2, 3)),
    ]
    t = summarize(make_trace(0, rows, world_size=4))
    by_kind = {r.kind: r for r in t.collectives}
    # all_reduce: 1 MiB in 1 ms -> algbw 1,048,576 / 0.001 = 1.048576e9 B/s; busbw x 2*3/4 = 1.572864e9
    assert by_kind["all_reduce"].algbw == pytest.approx(1.048576e9)
    assert by_kind["all_reduce"].busbw == pytest.approx(1.572864e9)
    # all_gather: size is the gathered 4 MiB, 2 ms -> 2.097152e9 B/s; busbw x 3/4 = 1.572864e9
    assert by_kind["all_gather"].bytes == 4 * mib and by_kind["all_gather"].algbw == pytest.approx(2.097152e9)
    assert by_kind["all_gather"].busbw == pytest.approx(1.572864e9)
    # broadcast: busbw = algbw
    assert by_kind["broadcast"].busbw == by_kind["broadcast"].algbw == pytest.approx(1.048576e9)
    # in flight: [0, 2 ms) and [5, 6 ms): 3 ms, the overlap of the first two counted once
    assert t.comm_ns == 3 * ms
    assert bus_factor("reduce_scatter", 8) == 7 / 8 and bus_factor("send", 2) == 1.0


def test_peak_table():
    assert peak_flops_for("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops_for("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert peak_flops_for("NVIDIA A100-SXM4-40GB", "float16") == 312e12
    assert peak_flops_for("cpu", "float32") is None


class Block(nn.Module):
    """A transformer block whose loss is computed inside the model, so every op but the seed is in a module."""

    def __init__(self, checkpointed=None):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 3)
        self.checkpointed = checkpointed

    def forward(self, x, y):
        if self.checkpointed is None:
            h = self.layer(x)
        else:
            h = ckpt.checkpoint(self.layer, x, use_reentrant=self.checkpointed)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _block_step(model, input_grad=False):
    torch.manual_seed(1)
    # Reentrant checkpointing needs an input that requires grad to backpropagate into the block at all.
    x, y = torch.randn(2, 5, 16, requires_grad=input_grad), torch.randint(0, 3, (2, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.capture() as cap:
        model(x, y).backward()
        opt.step()
    return cap.trace


def test_backward_ops_belong_to_the_module_of_their_forward_op():
    model = Block().train()
    trace = _block_step(model)
    cols = trace.columns
    backward = [i for i, p in enumerate(cols["phase"]) if p == "backward"]
    seed = [i for i in backward if not cols["module_stack"][i]]
    assert [cols["func"][i] for i in seed] == ["ones_like"]  # only the loss seed lacks a module
    for i in backward:
        fwd = cols["fwd_op"][i]
        if fwd >= 0:
            assert (cols["module"][i], cols["module_stack"][i]) == (
                cols["module"][fwd],
                cols["module_stack"][fwd],
            )
    assert {cols["module"][i] for i in backward if cols["func"][i] == "mm"} >= {
        "head",
        "layer.linear1",
        "layer.linear2",
    }
    t = summarize(trace)
    fb = ("forward", "backward")
    total = sum(d for d, p in zip(cols["duration_ns"], cols["phase"]) if p in fb)
    assert t.module_time("", fb) == total - sum(cols["duration_ns"][i] for i in seed)
    # Inclusive: a parent holds at least each child, in each phase.
    rows = {(r.module, r.phase): r.duration_ns for r in t.modules}
    for (module, phase), ns in rows.items():
        if module not in ("", OUTSIDE) and phase in fb:
            parent = module.rpartition(".")[0]
            assert rows[(parent, phase)] >= ns
    # summary() adds up the same way: nothing but the seed and the optimizer's ops outside modules.
    opt_ops = sum(p == "optimizer" for p in cols["phase"])
    assert f"{OUTSIDE}" in trace.summary(top=0)
    assert sum(r.ops for r in t.modules if r.module == OUTSIDE) == len(seed) + opt_ops


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_recomputation_is_its_own_phase(reentrant):
    plain = _block_step(Block().train(), input_grad=True)
    trace = _block_step(Block(checkpointed=reentrant).train(), input_grad=True)
    cols = trace.columns
    recompute = [i for i, p in enumerate(cols["phase"]) if p == "recompute"]
    forward_layer = [
        i for i, p in enumerate(cols["phase"]) if p == "forward" and "layer" in cols["module_stack"][i]
    ]
    assert recompute and len(recompute) >= len(forward_layer) - 2
    assert all(cols["module_stack"][i][:2] == ("", "layer") for i in recompute)
    # No module call rows for the recomputation: the same calls as without checkpointing.
    assert trace.module_table["address"] == plain.module_table["address"]
    t = summarize(trace)
    assert t.op_ns["recompute"] == sum(cols["duration_ns"][i] for i in recompute) > 0
    root = sum(r.duration_ns for r in t.modules if r.module == "")
    assert root == max(
        sum(r.duration_ns for r in t.modules if r.module == m)
        for m in {r.module for r in t.modules} - {OUTSIDE}
    )


def test_phases_under_optimizer_step_with_closure():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)

    def closure():
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    with tl.capture() as cap:
        opt.step(closure)
    cols = cap.trace.columns
    by_phase = {}
    for f, p in zip(cols["func"], cols["phase"]):
        by_phase.setdefault(p, []).append(f)
    assert by_phase["forward"].count("addmm") == 2 and "sum" in by_phase["forward"]
    assert "mm" in by_phase["backward"] and by_phase["backward"][:2] == ["ones_like", "expand"]
    # The update: the profiler markers around step() and one add_ per parameter.
    assert (
        by_phase["optimizer"][0] == "_record_function_enter_new"
        and by_phase["optimizer"][-1] == "_record_function_exit"
    )
    assert by_phase["optimizer"].count("add_") == 4
    assert "addmm" not in by_phase["optimizer"] and "mm" not in by_phase["optimizer"]


class MaskedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])  # -inf above the diagonal
        h, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
        return self.out(h).sum()


def test_first_nonfinite_ignores_attention_masks_and_finds_a_nan():
    model = MaskedAttention()
    x = torch.randn(2, 4, 8)
    with tl.capture(stats=tl.where(lambda op: True)) as cap:
        model(x).backward()
    trace = cap.trace
    assert trace.first_nonfinite() is None  # the mask's -inf is deliberate
    masked = trace.first_nonfinite(forward_inf=True)
    assert masked is not None and masked.phase == "forward" and masked.stats["out"]["inf"] > 0
    assert summarize(trace).first_nonfinite is None
    with torch.no_grad():
        model.out.weight[0, 3] = float("nan")
    with tl.capture(stats=True) as cap:
        model(x).backward()
    bad = cap.trace.first_nonfinite()
    assert (
        bad.module == "out" and bad.func == "mm" and bad.phase == "forward"
    )  # Linear on 3-d input: view, mm
    t = summarize(cap.trace)
    assert t.first_nonfinite["label"] == bad.label and t.first_nonfinite["module"] == "out"
    assert {(r.module, r.of) for r in t.nonfinite} >= {("out", "out")}
    with pytest.raises(ValueError, match="forward_inf"):
        trace.first_nonfinite(forward_inf=1)


class Waiting(nn.Module):
    """Lets another thread run while this module's forward is on the stack."""

    def __init__(self, go, done):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.go, self.done = go, done

    def forward(self, x):
        h = self.fc(x)
        self.go.set()
        assert self.done.wait(30)
        return h.relu()


def test_other_threads_stay_out_of_the_window():
    go, done = threading.Event(), threading.Event()
    model = Waiting(go, done)
    other = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)

    def background():  # an EMA model / evaluator in the same process
        assert go.wait(30)
        other(torch.randn(2, 4)).sum().backward()
        other_opt.step()
        done.set()

    thread = threading.Thread(target=background)
    thread.start()
    with tl.capture() as cap:
        model(torch.randn(2, 4)).sum()
    thread.join()
    trace = cap.trace
    assert trace.module_table["address"] == ["", "fc"]
    assert set(trace.columns["module"]) <= {"", "fc"} and "tanh" not in trace.columns["func"]
    assert set(trace.columns["phase"]) == {"forward"}  # the other thread's optimizer step did not leak


def test_torch_compile_module_is_transparent():
    model = mlp()
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(3, 4)
    with pytest.warns(RuntimeWarning, match="torch.compile'd module ran inside a capture window"):
        trace = tl.trace(compiled, x)
    # The first call compiles it (in the window): "eager" runs the graph's ops, recorded one by one, but the
    # submodules ran inside the compiled graph, where module hooks do not run: the calls are the root's.
    assert trace.module_table["address"] == [""] and trace.module_table["type"] == ["Sequential"]
    assert [op.func for op in trace if op.func in ("addmm", "relu")] == ["addmm", "relu", "addmm"]
    assert torch.equal(trace.output, model(x))
    assert "0.weight" in {p for op in trace for p in op.params}


def test_selector_that_matches_nothing_warns():
    with pytest.warns(UserWarning, match=r"save=tl.func\('relux'\) matched no op"):
        tl.trace(mlp(), torch.randn(2, 4), save=tl.func("relux"))


def test_every_module_output_has_a_norm_views_included():
    # nn.Linear on 3-D input returns a view (_unsafe_view of a mm); the Sequential returns its last child's.
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))

    x = torch.randn(2, 5, 4)
    # Reference: plain PyTorch, no capture: each module's output and the gradient of y.sum() w.r.t. it.
    ref, outs = model(), {}

    def keep(name):
        def hook(_mod, _inp, out):
            out.retain_grad()
            outs[name] = out

        return hook

    for name, mod in ref.named_modules():
        mod.register_forward_hook(keep(name))
    ref(x).sum().backward()
    m = model()
    with tl.capture(options=tl.CaptureOptions(stats=True)) as cap:
        m(x).sum().backward()
    norms = {(r.module, r.of): r.norm for r in summarize(cap.trace).norms}
    for name, out in outs.items():
        assert norms[(name, "out")] == pytest.approx(torch.linalg.vector_norm(out).item(), rel=1e-6), name
        assert norms[(name, "grad")] == pytest.approx(torch.linalg.vector_norm(out.grad).item(), rel=1e-6), (
            name
        )
