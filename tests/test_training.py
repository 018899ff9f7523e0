"""Training-step capture: phases, backward links, per-op gradients, keep_graph losses, log_backward."""

import copy

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import tl_dist as tl
from tl_dist import _fastpath


class ConvNet(nn.Module):
    """CNN with BatchNorm (train mode), a residual add and an in-place relu_ on the sum."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.act = nn.ReLU()
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        y = self.act(self.bn1(self.conv1(x)))
        z = self.bn2(self.conv2(y)) + y
        z = z.relu_() if torch.is_grad_enabled() else z.relu()
        return self.head(z.mean((2, 3)))


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(5, 7, batch_first=True)
        self.head = nn.Linear(7, 2)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def _block():
    return nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)


def _reference_grads(model, x, addresses, loss_fn):
    """Module outputs (via forward hooks) and d loss / d output from torch.autograd.grad, no tl_dist."""
    outs = {}
    handles = []
    for address in addresses:
        mod = model.get_submodule(address)

        def hook(module, args, output, address=address):
            outs[address] = output[0] if isinstance(output, tuple) else output

        handles.append(mod.register_forward_hook(hook))
    loss = loss_fn(model(x))
    for h in handles:
        h.remove()
    grads = torch.autograd.grad(loss, [outs[a] for a in addresses])
    return dict(zip(addresses, grads))


def _captured_grads(model, x, addresses, loss_fn):
    with tl.Capture(save_grads=True) as cap:
        loss_fn(model(x)).backward()
    trace = cap.trace
    found = {}
    for address in addresses:
        call = trace.module(address)
        out_op = trace.module_table["out_ops"][call.row][0]
        pos = trace.module_table["out_pos"][call.row][0]
        grad = trace[out_op].grad
        found[address] = grad[pos] if isinstance(grad, tuple) else grad
        assert trace[out_op].phase == "forward"
    return trace, found


def _loss(out):
    return (out**2).mean()


@pytest.mark.parametrize(
    "name, build, x, addresses",
    [
        ("cnn", ConvNet, (2, 3, 6, 6), ["conv1", "bn1", "act", "conv2", "bn2", "head"]),
        ("transformer", _block, (2, 5, 16), ["self_attn", "norm1", "linear1", "linear2", "norm2"]),
        ("lstm", LSTMNet, (3, 4, 5), ["lstm", "head"]),
    ],
)
def test_grads_equal_autograd_grad(name, build, x, addresses):
    model = build().train()
    x = torch.randn(*x)
    expected = _reference_grads(copy.deepcopy(model), x, addresses, _loss)
    trace, got = _captured_grads(copy.deepcopy(model), x, addresses, _loss)
    for address in addresses:
        assert got[address] is not None, f"no gradient captured for {address}"
        torch.testing.assert_close(got[address], expected[address], rtol=1e-5, atol=1e-7)
    assert all(g.requires_grad is False for gs in trace.grads.values() for g in gs if g is not None)


def test_grad_of_op_overwritten_in_place():
    # z = bn2(...) + y, then z.relu_(): add_1's gradient is w.r.t. the sum *before* relu_ overwrote it,
    # i.e. d loss / d relu_out * (sum > 0); relu__1's gradient is w.r.t. the relu output.
    model = ConvNet().train()
    x = torch.randn(2, 3, 6, 6)
    with tl.Capture(save_grads=tl.func("add", "relu_"), save=tl.func("add")) as cap:
        _loss(model(x)).backward()
    trace = cap.trace
    add, relu_ = trace["add_1"], trace["relu__1"]
    assert set(trace.grads) == {add.index, relu_.index}
    torch.testing.assert_close(add.grad, relu_.grad * (add.out > 0))
    assert not torch.equal(add.grad, relu_.grad)  # some of the sum is negative, so the masks differ


def test_training_window_phases_params_and_backward_flops():
    model = ConvNet().train()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 6, 6)

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with tl.Capture() as cap:
        _loss(model(x)).backward()
        opt.step()
    trace = cap.trace

    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    loss = _loss(ref(x))
    with FlopCounterMode(display=False) as counter:  # torch's registry covers every op of ConvNet
        loss.backward()
    ref_opt.step()

    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"capture changed the numerics of {name}"
    for b, c in zip(model.buffers(), ref.buffers()):
        assert torch.equal(b, c)

    phases = trace.columns["phase"]
    funcs = trace.columns["func"]
    first_bwd, last_bwd = phases.index("backward"), len(phases) - 1 - phases[::-1].index("backward")
    first_opt = phases.index("optimizer")
    # forward ops, then one block of backward ops, then the step's ops.
    assert set(phases[:first_bwd]) == {"forward"}
    assert set(phases[first_bwd : last_bwd + 1]) == {"backward"}
    assert first_opt > last_bwd
    assert "convolution" in funcs[:first_bwd] and "convolution_backward" in funcs[first_bwd:last_bwd]
    assert "native_batch_norm_backward" in funcs[first_bwd:last_bwd]
    opt_funcs = [f for f, p in zip(funcs, phases) if p == "optimizer"]
    # SGD's first momentum step on CPU: clone each grad into a buffer, then p.add_(buf, alpha=-lr) per param.
    n_params = len(list(model.parameters()))
    assert opt_funcs.count("add_") == n_params and opt_funcs.count("clone") == n_params, opt_funcs

    bwd_flops = sum(f for f, p in zip(trace.columns["flops"], phases) if p == "backward")
    assert bwd_flops == counter.get_total_flops() > 0

    # Backward ops point at the forward op they differentiate: convolution_backward -> a convolution.
    for i, f in enumerate(funcs):
        if f == "convolution_backward":
            fwd = trace.columns["fwd_op"][i]
            assert fwd >= 0 and funcs[fwd] == "convolution" and phases[fwd] == "forward"
    assert all(trace.columns["fwd_op"][i] == -1 for i in range(first_bwd))
    # Unlinked: the loss seed (ones_like, made before the engine runs) and AccumulateGrad (parameters are
    # leaves, produced by no op): its detach of the grad.
    assert funcs[first_bwd] == "ones_like"
    unlinked = {funcs[i] for i in range(first_bwd + 1, last_bwd + 1) if trace.columns["fwd_op"][i] < 0}
    assert unlinked == {"detach"}


class _Ops(TorchDispatchMode):
    """The ATen ops a plain run dispatches: the reference for what a window records."""

    def __init__(self) -> None:
        super().__init__()
        self.funcs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.funcs.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "python"])
def test_a_window_dispatches_the_plain_runs_ops(monkeypatch: pytest.MonkeyPatch, pure: bool) -> None:
    # A reference the window holds to an op's outputs (it once kept the last op's until the next op) changes
    # what autograd does: it copies a gradient it would otherwise reuse (the loss seed got a detach).
    monkeypatch.setenv(_fastpath.PURE_PYTHON_ENV, "1" if pure else "0")
    torch.manual_seed(0)
    model, x = ConvNet().train(), torch.randn(2, 3, 6, 6)
    plain, captured = copy.deepcopy(model), copy.deepcopy(model)
    ops = _Ops()
    with ops:
        _loss(plain(x)).backward()
    with tl.Capture() as cap:
        _loss(captured(x)).backward()
    assert cap.trace.columns["func"] == ops.funcs


def test_keep_graph_loss_trains_like_forward_hook_loss():
    model = ConvNet().train()
    ref = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    x = torch.randn(2, 3, 6, 6)

    trace = tl.trace(model, x, save=tl.func("relu"), keep_graph=True)
    act = trace["relu_1"].out  # the output of `act` (nn.ReLU)
    assert act.requires_grad
    loss = _loss(trace.output) + 1e-1 * act.abs().mean()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss.backward()
    opt.step()

    seen = {}
    handle = ref.act.register_forward_hook(lambda m, a, out: seen.setdefault("act", out))
    ref_loss = _loss(ref(x)) + 1e-1 * seen["act"].abs().mean()
    handle.remove()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_loss.backward()
    ref_opt.step()

    assert torch.equal(loss.detach(), ref_loss.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    # The activation term did change the update: the task loss alone trains conv1 differently.
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    _loss(plain(x)).backward()
    plain_opt.step()
    assert not torch.allclose(plain.conv1.weight, model.conv1.weight)


def test_log_backward_appends_backward_ops_and_grads():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    trace = tl.trace(model, x, save_grads=tl.func("relu"))
    n_forward = len(trace)
    with pytest.warns(UserWarning, match="recorded no backward"):
        assert trace["relu_1"].grad is None  # no backward yet
    assert set(trace.columns["phase"]) == {"forward"}

    trace.log_backward(_loss(trace.output))
    assert len(trace) > n_forward
    assert set(trace.columns["phase"][n_forward:]) == {"backward"}
    assert trace.columns["index"] == list(range(len(trace)))
    # Labels keep counting: the forward had t_1, t_2 (two Linear layers); backward ts start at t_3.
    assert "t_3" in trace.labels and trace["t_3"].phase == "backward"
    assert trace["threshold_backward_1"].fwd_op == trace["relu_1"].index

    ref = copy.deepcopy(model)
    h = ref[1](ref[0](x))
    (expected,) = torch.autograd.grad(_loss(ref[2](h)), h)
    torch.testing.assert_close(trace["relu_1"].grad, expected)
    assert trace["addmm_1"].grad is None  # not selected


def test_log_backward_rejects_bad_loss():
    model = nn.Linear(4, 2)
    trace = tl.trace(model, torch.randn(2, 4))
    with pytest.raises(ValueError, match="loss must require grad"):
        trace.log_backward(trace.output.detach().sum())
    with pytest.raises(ValueError, match="loss must be a torch.Tensor"):
        trace.log_backward(1.0)


@pytest.mark.parametrize("option", ["save_grads", "stats"])
def test_options_are_validated(option):
    with pytest.raises(ValueError, match=option):
        tl.Capture(**{option: "relu"})
    with pytest.raises(ValueError, match=option):
        tl.trace(nn.Linear(2, 2), torch.randn(1, 2), **{option: 1})


def test_nothing_left_installed_after_window_even_on_error():
    model = ConvNet().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n_pre, n_post = len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)
    x = torch.randn(2, 3, 6, 6)
    with pytest.raises(RuntimeError, match="boom"):
        with tl.Capture(save_grads=True, stats=True):
            out = model(x)
            assert len(_global_optimizer_pre_hooks) == n_pre + 1
            raise RuntimeError("boom")
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == (n_pre, n_post)

    # The gradient hooks were removed with the window: a backward afterwards stores nothing.
    with tl.Capture(save_grads=True) as cap:
        out = model(x)
    assert cap.trace.grads == {}
    _loss(out).backward()
    opt.step()
    assert cap.trace.grads == {}


def test_ops_without_gradient_have_none():
    # argmax (integer output), a detached branch and a no_grad block produce nothing autograd differentiates.
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    with tl.Capture(save_grads=True) as cap:
        y = lin(x)
        idx = y.argmax(1)
        with torch.no_grad():
            z = y * 2
        w = y.detach().exp()
        (y.relu().sum() + z.sum() + w.sum() + idx.sum()).backward()
    trace = cap.trace
    assert trace["argmax_1"].grad is None
    assert trace["exp_1"].grad is None and trace["mul_1"].grad is None
    assert torch.equal(trace["relu_1"].grad, torch.ones(3, 4))
    torch.testing.assert_close(trace["addmm_1"].grad, (y > 0).float())


def test_save_grads_by_module_output():
    # tl.module matches the op that produced the module's output, known only once the module returns.
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    trace = tl.trace(model, x, save_grads=tl.module("1"))
    trace.log_backward(trace.output.sum())
    (index,) = trace.grads
    assert trace[index].func == "tanh" and trace[index].output_of == ("1",)
    h = torch.tanh(model[0](x)).detach().requires_grad_()
    (expected,) = torch.autograd.grad(model[2](h).sum(), h)
    torch.testing.assert_close(trace[index].grad, expected)


def test_stored_grads_survive_gradient_accumulation():
    # Two micro-batches in one window: the second backward accumulates into .grad in place (AccumulateGrad's
    # add_), which may share memory with a gradient stored during the first backward (a Linear's t op output
    # gradient is what becomes weight.grad). Stored gradients must keep their first-backward values.
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    x1, x2 = torch.randn(3, 4), torch.randn(3, 4)
    alone = copy.deepcopy(model)
    with tl.Capture(save_grads=True) as cap:
        _loss(alone(x1)).backward()
    expected = {i: [g.clone() if g is not None else None for g in gs] for i, gs in cap.trace.grads.items()}

    with tl.Capture(save_grads=True) as cap:
        _loss(model(x1)).backward()
        _loss(model(x2)).backward()
    trace = cap.trace
    assert "add_" in trace.columns["func"]  # the in-place accumulation did run inside the window
    for index, grads in expected.items():
        for got, want in zip(trace.grads[index], grads):
            if want is not None:
                assert torch.equal(got, want), trace[index].label
