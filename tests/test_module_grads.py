"""Gradients per module call (trace.module(...).grad) and per parameter (trace.param_grads), against plain
PyTorch: a tensor hook on the module's output in a plain run, and the parameters' .grad after a plain backward."""

from __future__ import annotations

import copy

import pytest
import torch
from zoo import MHA, ResCNN

import tl_dist as tl


def _plain_output_grad(
    model: torch.nn.Module, address: str, x: torch.Tensor, leaf: int | None = None
) -> list:
    """The gradient of (model(x) ** 2).sum() w.r.t. the output of module ``address``, caught by a tensor hook."""
    grads: list = []

    def hook(mod: torch.nn.Module, args: tuple, out: object) -> None:
        t = out if leaf is None else out[leaf]
        t.register_hook(grads.append)

    handle = model.get_submodule(address).register_forward_hook(hook)
    try:
        out = model(x)
        (_first(out) ** 2).sum().backward()
    finally:
        handle.remove()
    return grads


def _first(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def test_module_grad_equals_a_hook_on_its_output() -> None:
    torch.manual_seed(0)
    model, x = ResCNN().eval(), torch.randn(2, 3, 8, 8)
    (want,) = _plain_output_grad(copy.deepcopy(model), "blocks.0", x)
    with tl.capture(save_grads=tl.module("blocks.0")) as cap:
        (model(x) ** 2).sum().backward()
    got = cap.trace.module("blocks.0").grad
    assert torch.equal(got, want)
    assert cap.trace.module("blocks.1").grad is None  # not selected


def test_module_grad_keeps_the_output_structure() -> None:
    torch.manual_seed(0)
    model, x = MHA().eval(), torch.randn(2, 5, 8)
    (want,) = _plain_output_grad(copy.deepcopy(model), "attn", x, leaf=0)
    trace = tl.trace(model, x, save_grads=True)
    trace.log_backward((trace.output[0] ** 2).sum())
    out_grad, weights_grad = trace.module("attn").grad
    assert torch.equal(out_grad, want)
    assert weights_grad is None  # the loss does not use the attention weights


class Halves(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.chunk(2, dim=1)  # one op (split), two outputs: the module's leaves are its outputs 0 and 1


def test_module_grad_of_a_multi_output_op() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), Halves())
    trace = tl.trace(model, torch.randn(2, 3), save_grads=tl.module("1"))
    a, b = trace.output
    trace.log_backward((a * 1.0 + b * 3.0).sum())
    grad_a, grad_b = trace.module("1").grad
    # d/da of sum(a + 3 b) = 1, d/db = 3, each of shape 2x2
    assert torch.equal(grad_a, torch.ones(2, 2)) and torch.equal(grad_b, torch.full((2, 2), 3.0))


def test_param_grads_of_a_training_step() -> None:
    torch.manual_seed(0)
    model, x = ResCNN().train(), torch.randn(2, 3, 8, 8)
    reference = copy.deepcopy(model)
    (reference(x) ** 2).sum().backward()
    (reference(x) ** 2).sum().backward()  # two micro-batches accumulate
    want = {name: p.grad for name, p in reference.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tl.capture(save_grads=True) as cap:
        (model(x) ** 2).sum().backward()
        (model(x) ** 2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # .grad is gone when the window ends; the trace kept it
    got = cap.trace.param_grads
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_param_grads_follow_the_selector() -> None:
    torch.manual_seed(0)
    model, x = ResCNN().eval(), torch.randn(2, 3, 8, 8)
    with tl.capture(save_grads=tl.in_module("fc")) as cap:
        model(x).sum().backward()
    # fc's ops read fc.weight (its transpose, t) and fc.bias (addmm): those two, nothing else.
    assert sorted(cap.trace.param_grads) == ["fc.bias", "fc.weight"]
    assert torch.equal(cap.trace.param_grads["fc.bias"], torch.full((5,), 2.0))  # d(sum of 2x5)/d(bias) = 2
    with tl.capture() as cap:
        model(x).sum().backward()
    assert cap.trace.param_grads == {}  # save_grads not asked


@pytest.mark.parametrize("save_grads", [True, tl.func("addmm")])
def test_param_grads_after_log_backward(save_grads: object) -> None:
    torch.manual_seed(0)
    model, x = ResCNN().eval(), torch.randn(2, 3, 8, 8)
    trace = tl.trace(model, x, save_grads=save_grads)
    assert trace.param_grads == {}
    trace.log_backward(trace.output.sum())
    names = set(trace.param_grads)
    assert ("fc.bias" in names) and (("stem.weight" in names) == (save_grads is True))
    assert torch.equal(trace.param_grads["fc.bias"], model.fc.bias.grad)


def _ddp_param_grads(rank: int, world_size: int, out_dir: str) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    local = copy.deepcopy(model)
    x = torch.randn(5, 4) + rank  # each rank its own batch
    ddp = DDP(model)
    with tl.capture(save_grads=True) as cap:
        (ddp(x) ** 2).sum().backward()
    # By hand: this rank's gradient without DDP, averaged over the ranks (DDP divides, then sums).
    (local(x) ** 2).sum().backward()
    want = {}
    for name, p in local.named_parameters():
        g = p.grad / world_size
        dist.all_reduce(g)
        want[name] = g
    got = {name.removeprefix("module."): g for name, g in cap.trace.param_grads.items()}
    return {"got": got, "want": want, "local": {n: p.grad for n, p in local.named_parameters()}}


@pytest.mark.slow
def test_param_grads_are_ddps_reduced_gradients(tmp_path) -> None:  # noqa: ANN001 - pytest fixture
    from dist_helpers import run_ranks

    results = run_ranks(_ddp_param_grads, world_size=2, tmp_path=tmp_path)
    for rank in (0, 1):
        got, want, local = results[rank]["got"], results[rank]["want"], results[rank]["local"]
        assert got.keys() == want.keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
        for name in want:
            assert torch.equal(got[name], want[name]), name
            assert not torch.allclose(got[name], local[name])  # the reduced gradient, not this rank's own
    assert all(torch.equal(results[0]["got"][n], results[1]["got"][n]) for n in results[0]["got"])


class _SelfCheckpointed(torch.nn.Module):
    """A layer that checkpoints its own method, not its __call__ (transformers 5's GradientCheckpointingLayer
    checkpoints ``partial(forward, self)``): no module hook fires when the engine recomputes it."""

    def __init__(me, reentrant: bool) -> None:  # noqa: N805 (any name for the module argument)
        super().__init__()
        me.fc = torch.nn.Linear(4, 4)
        me.reentrant = reentrant

    def body(me, x: torch.Tensor) -> torch.Tensor:  # noqa: N805
        return torch.sigmoid(me.fc(x)) * 2 + x

    def forward(me, x: torch.Tensor) -> torch.Tensor:  # noqa: N805
        return torch.utils.checkpoint.checkpoint(me.body, x, use_reentrant=me.reentrant)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_layer_checkpointing_its_own_method_keeps_its_ops_and_its_gradient(reentrant: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _SelfCheckpointed(reentrant), torch.nn.Linear(4, 1))
    x = torch.randn(3, 4, requires_grad=reentrant)  # reentrant checkpoint needs an input that requires grad
    (want,) = _plain_output_grad(copy.deepcopy(model), "1", x)
    with tl.capture(save_grads=True) as cap:
        (model(x) ** 2).sum().backward()
    t = cap.trace
    recomputed = [(op.func, op.module) for op in t if op.phase == "recompute" and op.kind != "view"]
    # Non-reentrant recomputation stops once it has what the backward needs (sigmoid's output); reentrant
    # reruns the whole body. Either way the ops are the layer's, not the root's.
    body = [("addmm", "1.fc"), ("sigmoid", "1"), ("mul", "1"), ("add", "1")]
    assert recomputed == (body if reentrant else body[:2])
    assert all(op.module_stack[:2] == ("", "1") for op in t if op.phase == "recompute")
    # The gradient w.r.t. the layer's output, which reentrant checkpoint's Function returns.
    assert torch.equal(t.module("1").grad, want)
