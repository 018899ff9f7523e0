"""Core behaviour of tl.trace on a small model: rows, labels, parents, saving, selectors, cleanup."""

import pytest
import torch
from torch import nn

import tl_dist as tl
from tl_dist import _fastpath


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        y = y + 1
        y.relu_()
        return self.fc(y.mean((2, 3)))


@pytest.fixture
def small():
    return Small().eval(), torch.randn(2, 3, 8, 8)


def test_rows_labels_and_parents(small):
    model, x = small
    with torch.no_grad():
        trace = tl.trace(model, x)
    funcs = [op.func for op in trace]
    assert funcs[0] == "convolution"
    assert trace["convolution_1"].module == "conv"
    assert trace["convolution_1"].params == ("conv.weight", "conv.bias")
    relu_inplace = trace["relu__1"]
    add = trace["add_1"]
    assert relu_inplace.parents == (add.index,)
    assert add.index in trace["relu_1"].children
    # 2x3x8x8 input, 8 out channels, 3x3x3 kernel: 2 * (2*8*8*8) * 27 = 55296
    assert trace["convolution_1"].flops == 55296
    assert trace["addmm_1"].flops == 2 * 2 * 8 * 4
    assert torch.equal(trace.output, model(x))


def test_saved_value_survives_inplace(small):
    model, x = small
    with torch.no_grad():
        trace = tl.trace(model, x)
        expected = torch.relu(model.bn(model.conv(x))) + 1
    # add_1's output was later overwritten by relu_ in place; the saved value is the pre-relu_ one.
    assert torch.equal(trace["add_1"].out, expected)
    assert torch.equal(trace["relu__1"].out, expected.relu())


def test_save_selector_and_metadata_only(small):
    model, x = small
    trace = tl.trace(model, x, save=tl.func("relu"))
    saved = {trace[i].label for i in trace.saved}
    assert saved == {"relu_1", "relu__1"}
    assert trace["add_1"].out is None
    meta = tl.trace(model, x, save=None)
    assert not meta.saved and len(meta) == len(trace)


def test_module_selector_saves_module_output(small):
    model, x = small
    trace = tl.trace(model, x, save=tl.module("bn"))
    bn_call = trace.module("bn")
    assert torch.equal(bn_call.out, model.bn(model.conv(x)))
    assert [op.label for op in trace.select(tl.module("bn"))] == [trace[next(iter(trace.saved))].label]


def test_nothing_left_installed_after_error(small):
    model, x = small
    from torch.nn.modules import module as nn_module
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            self.inner(x)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as err:
        tl.trace(Boom(), x)
    partial = err.value.tl_trace
    assert len(partial) > 5 and partial[0].func == "convolution"
    assert not _get_current_dispatch_mode_stack()
    assert not nn_module._global_forward_hooks and not nn_module._global_forward_pre_hooks


def test_bad_arguments_name_the_argument(small):
    model, x = small
    with pytest.raises(ValueError, match="save"):
        tl.trace(model, x, save="relu")
    with pytest.raises(ValueError, match="model"):
        tl.trace(lambda t: t, x)
    with pytest.raises(ValueError, match="kwargs"):
        tl.trace(model, x, kwargs=[1])
    trace = tl.trace(model, x)
    with pytest.raises(KeyError, match="relu_1"):
        trace["relu_9"]


def _tensor_refs(trace):
    """Weak references to the trace, its recorder and every tensor it saved (outputs, gradients)."""
    import weakref

    refs = [weakref.ref(trace)]
    if getattr(trace, "_recorder", None) is not None:
        refs.append(weakref.ref(trace._recorder))
    refs += [
        weakref.ref(t)
        for kept in (trace.saved, trace.grads)
        for v in kept.values()
        for t in v
        if t is not None
    ]
    return refs


class _WeakSink:
    """Keeps only weak references to the windows it is given (a sink that exported and forgot them)."""

    def __init__(self):
        self.refs = []

    def on_window(self, trace, telemetry):
        self.refs += _tensor_refs(trace)

    def close(self):
        pass


def test_dropped_trace_is_freed_by_reference_counting(small, tmp_path):
    # No reference cycles: a discarded trace and its saved tensors go at once, not at the next GC pass
    # (a cycle kept activations alive -- device memory on a GPU -- and made Python's collections walk whole
    # traces). Every way of making a trace: tl.trace, tl.capture of a training step, forks and replays, and an
    # armed window once its sinks are done with it.
    import gc

    model, x = small
    train = Small()
    opt = torch.optim.SGD(train.parameters(), lr=0.1, momentum=0.9)

    def captured(**options):
        with tl.capture(**options) as cap:
            opt.zero_grad()
            train(x).sum().backward()
            opt.step()
        return cap.trace

    def with_backward():
        trace = tl.trace(train, x, save_grads=True)
        trace.log_backward(trace.output.sum())
        return trace

    base = tl.trace(model, x)
    edit = [tl.when(tl.label("relu_1"), tl.zero_ablate())]
    makers = {
        "tl.trace": lambda: tl.trace(model, x),
        "tl.trace + log_backward": with_backward,
        "tl.capture": captured,
        "tl.capture(save, stats, save_grads)": lambda: captured(save=True, stats=True, save_grads=True),
        "replay": base.replay,
        "fork().do().replay()": lambda: base.fork().do("relu_1", tl.zero_ablate()).replay(),
        "fork().do().rerun()": lambda: base.fork().do("relu_1", tl.zero_ablate()).rerun(model, x),
        "tl.trace(intervene=)": lambda: tl.trace(model, x, intervene=edit),
    }
    gc.collect()
    gc.disable()
    try:
        for name, make in makers.items():
            trace = make()
            refs = _tensor_refs(trace)
            assert len(refs) > 2 or name == "tl.capture", name  # it saved something to free
            del trace
            assert [r for r in refs if r() is not None] == [], name
        sink = _WeakSink()
        tl.arm(tmp_path, sinks=[sink], options=tl.CaptureOptions(save=True, save_grads=True))
        try:
            for step in range(2):
                with tl.capture(step=step) as cap:
                    opt.zero_grad()
                    train(x).sum().backward()
                    opt.step()
                del cap
            assert tl.flush()
        finally:
            tl.disarm()
        assert len(sink.refs) > 4  # both windows reached the sink with their tensors
        assert [r for r in sink.refs if r() is not None] == []
    finally:
        gc.enable()


class _ReusesFreedBuffer(nn.Module):
    """Writes in place into a storage, drops it, then reads a new storage at the same address, made below the
    mode (as FSDP2's copy-in buffers are). Both view one bytearray, so the address is the same every time,
    where the allocator reuses a freed block only most of the time."""

    def forward(self, x):
        memory = bytearray(x.numel() * x.element_size())
        dropped = torch.frombuffer(memory, dtype=x.dtype)
        dropped.add_(1)
        address = dropped.untyped_storage().data_ptr()
        total = x.sum()  # the last op's outputs are held until the next op: release `dropped`
        del dropped
        fresh = torch.frombuffer(memory, dtype=x.dtype)
        self.reused = fresh.untyped_storage().data_ptr() == address
        return fresh.fill_(3.0).sum() + total


@pytest.mark.parametrize("pure_python", ["0", "1"], ids=["compiled", "python"])
def test_no_edge_from_a_write_into_a_freed_buffer_at_the_same_address(monkeypatch, pure_python):
    """A data-flow edge joins tensors that share a storage, not an address: the write into the dropped buffer
    says nothing about the new tensor's value (the FSDP2 all_gather that once gained the next copy-in's split)."""
    monkeypatch.setenv(_fastpath.PURE_PYTHON_ENV, pure_python)
    model = _ReusesFreedBuffer()
    trace = tl.trace(model, torch.randn(4096), save=None)
    assert model.reused
    assert [op.label for op in trace] == ["add__1", "sum_1", "fill__1", "sum_2", "add_1"]
    assert trace["fill__1"].parents == ()


def test_modules_parameters_and_buffers_are_named_as_torch_names_them():
    # Each window names the model with a walk of its own: it must give what torch's named_* walks give, the
    # first name of anything shared, and no '_orig_mod' of a compiled submodule.
    from tl_dist._modules import ModuleTracker

    class Recorder:  # the tracker reads these of its recorder
        n_ops = 0
        locate = None

    shared = nn.Linear(2, 2)
    model = nn.Module()
    model.a = shared
    model.block = nn.Sequential(nn.Linear(2, 2, bias=False), nn.BatchNorm1d(2))
    model.b = shared  # the same module at a second address
    model.register_module("absent", None)
    model.compiled = torch.compile(nn.Sequential(nn.Linear(2, 2)))
    model.register_buffer("scale", torch.ones(2))
    model.tied = nn.Linear(2, 2)
    model.tied.weight = model.block[0].weight  # one parameter, two names
    model.stats = nn.Module()
    late = nn.Linear(2, 2)
    model.stats.register_buffer("weight_seen", late.weight)  # met as a buffer first, then as a parameter
    model.late = late

    def strip(name):
        return ".".join(part for part in name.split(".") if part != "_orig_mod")

    want_names, want_params = {}, {}
    for name, mod in model.named_modules(remove_duplicate=False):
        want_names.setdefault(id(mod), "net." + strip(name) if name else "net")
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        want_params.setdefault(id(t), "net." + strip(name))
    recorder = Recorder()
    tracker = ModuleTracker(recorder, [("net", model)])
    assert tracker.names == want_names
    assert tracker.params == want_params
    # spot checks by hand: shared module and tied weight keep their first names; compiled wrapper stripped
    assert tracker.names[id(shared)] == "net.a"
    assert tracker.params[id(model.tied.weight)] == "net.block.0.weight"
    assert tracker.names[id(model.compiled._orig_mod[0])] == "net.compiled.0"
    assert tracker.params[id(late.weight)] == "net.late.weight"  # parameter names before buffer names
    assert list(tracker.names) == list(want_names)  # the same walk order


class _Rotate(nn.Module):  # as transformers' kernelized functions: one instance, held by no model
    def forward(self, x):
        return torch.cat((-x[..., 1:], x[..., :1]), dim=-1)


_ROTATE = _Rotate()


class _Layer(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.act = act  # a class, built anew at every call

    def forward(self, x):
        return self.act()(_ROTATE(self.proj(x)))


def test_a_module_outside_the_tree_belongs_to_each_caller_in_turn():
    # One unregistered instance called by two layers (Llama's rotary embedding under transformers 5 with the
    # kernels package) must land in each layer; so must modules built on the fly, whatever id they reuse.
    model = nn.Sequential(_Layer(nn.ReLU), _Layer(nn.Tanh), _Layer(nn.ReLU)).eval()
    x = torch.randn(2, 4)
    trace = tl.trace(model, x)
    cols = trace.columns
    by_func = {}
    for i in range(len(trace)):
        by_func.setdefault(cols["func"][i], []).append((cols["module"][i], cols["module_stack"][i]))
    # the three cats (one per layer), and the activation of each layer, by hand
    assert [m for m, _ in by_func["cat"]] == ["0.<_Rotate>", "1.<_Rotate>", "2.<_Rotate>"]
    assert [s for _, s in by_func["cat"]] == [("", str(i), f"{i}.<_Rotate>") for i in range(3)]
    acts = [m for f in ("relu", "tanh") for m, _ in by_func.get(f, [])]
    assert sorted(acts) == ["0.<ReLU>", "1.<Tanh>", "2.<ReLU>"]
    # the module-call table: each call of the shared instance under its caller, with that layer's value
    rotate_calls = [c for c in trace.module_calls() if "_Rotate" in c.address]
    assert [c.address for c in rotate_calls] == ["0.<_Rotate>", "1.<_Rotate>", "2.<_Rotate>"]
    h = x
    with torch.no_grad():
        for layer, call, act in zip(model, rotate_calls, (torch.relu, torch.tanh, torch.relu)):
            p = h @ layer.proj.weight.T + layer.proj.bias
            rotated = torch.cat((-p[..., 1:], p[..., :1]), dim=-1)
            assert torch.allclose(call.out, rotated, atol=1e-6)
            h = act(rotated)


def test_a_shared_module_outside_the_tree_recomputed_under_checkpoint_keeps_its_caller():
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([_Layer(nn.ReLU), _Layer(nn.ReLU)])

        def forward(self, x):
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False)
            return x

    model = Net()
    with tl.capture() as cap:
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    cols = cap.trace.columns
    cats = [(cols["phase"][i], cols["module"][i]) for i in range(len(cap.trace)) if cols["func"][i] == "cat"]
    assert cats == [
        ("forward", "layers.0.<_Rotate>"),
        ("forward", "layers.1.<_Rotate>"),
        ("recompute", "layers.1.<_Rotate>"),  # backward reaches the last layer first
        ("recompute", "layers.0.<_Rotate>"),
    ]


def test_a_window_makes_its_op_table_on_first_read() -> None:
    # Closing a window leaves the transpose of its rows to whoever reads the table first (a sink's worker
    # thread, or no one): the trace's length is known without it, and the table is made once.
    x = torch.ones(3)
    with tl.capture() as cap:
        y = x * 2
        torch.relu(y + 1)
    trace = cap.trace
    assert trace._columns is None
    assert len(trace) == 3
    assert trace._columns is None
    assert trace.columns["label"] == ["mul_1", "add_1", "relu_1"]
    assert trace.columns["out_shapes"] == [((3,),), ((3,),), ((3,),)]
    assert trace.columns is trace.columns
    assert [op.label for op in trace] == ["mul_1", "add_1", "relu_1"]


def test_a_pending_table_keeps_the_ops_it_was_made_for() -> None:
    # A trace's pending table reads its recorder's rows when first read; rows the recorder got since (another
    # trace of the same window ran log_backward) are not this trace's.
    from tl_dist.schema import OP_FIELDS, field_names
    from tl_dist.trace import PendingColumns, Trace

    names = field_names(OP_FIELDS)
    grown = {name: list(range(5)) for name in names}
    trace = Trace(PendingColumns(lambda: grown, 3), {})
    assert len(trace) == 3
    assert trace.columns["index"] == [0, 1, 2]
    assert set(trace.columns) == set(names)


def test_options_of_bools_and_nones_are_one_shared_instance_and_still_checked(small):
    # The options of tl.trace's defaults and of tl.capture(save=True) are made once and shared; one made of the
    # same values compares equal, and a value equal to a bool but not one (1 == True) is still refused.
    from tl_dist.options import DEFAULT_OPTIONS

    model, x = small
    shared = DEFAULT_OPTIONS.updated(save=True)
    assert shared is DEFAULT_OPTIONS.updated(save=True) == tl.CaptureOptions(save=True)
    assert tl.capture(save=True).options is shared
    assert tl.capture(save=True, stats=True).options == tl.CaptureOptions(save=True, stats=True)
    relu = tl.func("relu")
    assert tl.capture(save=relu).options.save is relu
    tl.trace(model, x, source=True)
    with pytest.raises(ValueError, match="source must be a bool, got 1"):
        tl.trace(model, x, source=1)
    with pytest.raises(ValueError, match="keep_graph must be a bool, got 0"):
        tl.capture(keep_graph=0)


@pytest.mark.parametrize("pure", ["1", "0"], ids=["python", "compiled"])
def test_saved_outputs_are_the_windows_own_tensors_not_the_users(monkeypatch, pure):
    # A saved output is detached from the tensor the op returned: an in-place op returns the tensor it wrote,
    # here the user's, and a later change to that tensor's shape (t_) must not change the saved value's.
    monkeypatch.setenv(_fastpath.PURE_PYTHON_ENV, pure)

    class Scale(nn.Module):
        def forward(self, x):
            y = x.mul_(2)
            return y.sum(0)

    x = torch.ones(2, 3)
    with torch.no_grad():
        trace = tl.trace(Scale(), x)
    x.t_()
    mul, total = trace["mul__1"].out, trace["sum_1"].out
    assert mul is not x and mul.shape == (2, 3) and torch.equal(mul, torch.full((2, 3), 2.0))
    assert torch.equal(total, torch.full((3,), 4.0)) and not total.requires_grad
    # With grad on, the saved outputs are cut off from the graph (keep_graph=False).
    w = nn.Linear(3, 2)
    trace = tl.trace(w, torch.ones(1, 3))
    assert all(not t.requires_grad and t.grad_fn is None for outs in trace.saved.values() for t in outs)
