"""Interventions and replay on models from outside the zoo (issue 20, section 2), against plain PyTorch.

Each test pins a defect found running tl_dist over a peer's model suite: fused fast paths an edited run left,
replays that were not bit for bit, compare/validate rules that disagreed with replay, and the edit API's
spelling. References are the model run again by hand (plain PyTorch), or values computed in the comments.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import tl_dist as tl


class AttnBlock(nn.Module):
    """Self-attention then a layout change: eval + no_grad takes MHA's fused fast path (one op)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, _ = self.attn(x, x, x)
        return a.permute(0, 2, 1).reshape(2, -1)


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.relu(x)
        raise RuntimeError("boom")


# ------------------------------------------------------------------- an edited run takes the clean run's path


def test_op_site_edit_keeps_mha_on_its_fast_path_so_the_label_edits_the_same_op() -> None:
    torch.manual_seed(0)
    model, x = AttnBlock().eval(), torch.randn(2, 5, 16)
    with torch.no_grad():
        clean = tl.trace(model, x)
        edited = tl.trace(model, x, intervene=tl.when(tl.label("clone_1"), tl.zero_ablate()))
    funcs = ["_native_multi_head_attention", "permute", "clone", "_unsafe_view"]
    assert [op.func for op in clean] == funcs
    # Before the fix the edited run had 38 ops (MHA's slow path) and zeroed a copy inside attention.
    assert [op.func for op in edited] == funcs
    assert edited.metadata["edited"] == {"clone_1": "tl.zero_ablate()"}
    # clone_1 is the permuted attention output, the reshape only views it: all zeros
    assert torch.equal(edited.output, torch.zeros(2, 80))


def test_op_site_edit_keeps_the_fused_encoder_layer_and_matches_plain_pytorch() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        clean = tl.trace(layer, x)
        fused = clean[0].label
        edited = tl.trace(layer, x, intervene=tl.when(tl.label(fused), tl.scale(2.0)))
        want = layer(x) * 2.0  # plain PyTorch: the fused layer's output, doubled
    assert [op.func for op in clean] == ["_transformer_encoder_layer_fwd"]
    assert [op.label for op in edited] == [fused]
    assert torch.equal(edited.output, want)


def test_the_fast_path_patch_is_gone_after_the_window_even_when_the_model_raises() -> None:
    original = torch._C._has_torch_function
    with pytest.raises(RuntimeError, match="boom"):
        tl.trace(Boom(), torch.randn(3), intervene=tl.when(tl.func("relu"), tl.zero_ablate()))
    assert torch.overrides.has_torch_function is original


class Passthrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        return func(*args, **(kwargs or {}))


def test_a_users_own_mode_still_sends_mha_off_its_fast_path() -> None:
    torch.manual_seed(0)
    model, x = AttnBlock().eval(), torch.randn(2, 5, 16)
    with torch.no_grad(), Passthrough():
        clean = tl.trace(model, x)
        edited = tl.trace(model, x, intervene=tl.when(tl.func("_softmax"), tl.scale(1.0)))
    # as in plain PyTorch under that mode: the slow path, with its softmax; the edit only hides tl_dist's mode
    assert "_native_multi_head_attention" not in [op.func for op in clean]
    assert [op.label for op in edited] == [op.label for op in clean] and "_softmax_1" in edited.edited
    assert torch.overrides.has_torch_function is torch._C._has_torch_function


# ------------------------------------------------------------------------------------- replay, bit for bit


def test_lstm_cell_replays_bit_for_bit() -> None:
    torch.manual_seed(0)
    cell, x = nn.LSTMCell(8, 16), torch.randn(4, 8)
    trace = tl.trace(cell, x)
    h, c = cell(x)  # plain PyTorch
    replayed = trace.replay()
    # Before the fix h differed by ~1e-8: the in-place sigmoid_ of a gate chunk (stride (64, 1)) replayed on a
    # contiguous copy, which the kernel vectorises differently.
    assert torch.equal(replayed.output[0], h) and torch.equal(replayed.output[1], c)
    assert tl.compare(trace, replayed, first=True, atol=0.0, rtol=0.0) is None


@pytest.mark.parametrize("grad", [False, True])
def test_compare_treats_the_lstm_kernel_the_same_in_a_trace_and_its_replay(grad: bool) -> None:
    torch.manual_seed(0)
    lstm, x = nn.LSTM(8, 16, batch_first=True), torch.randn(2, 5, 8)
    with torch.set_grad_enabled(grad):
        trace, again = tl.trace(lstm, x), tl.trace(lstm, x)
    replayed = trace.replay()
    rnn = trace["mkldnn_rnn_layer_1"]
    # no_grad: 3 outputs (output, h, c) in both, no trailing None; grad: a 4th, the workspace for backward
    assert len(trace.saved[rnn.index]) == len(replayed.saved[rnn.index]) == (4 if grad else 3)
    assert tl.compare(trace, replayed, first=True) is None
    # two runs of the model itself: the workspace bytes differ (partly unwritten scratch), nothing else
    assert tl.compare(trace, again, first=True) is None
    # a real difference in the kernel's outputs is still found
    doubled = trace.fork().do("mkldnn_rnn_layer_1", tl.scale(2.0)).replay()
    assert tl.compare(trace, doubled, first=True).label == "mkldnn_rnn_layer_1"


# --------------------------------------------------------------------- one rule for "this op draws numbers"


class Attention(nn.Module):
    """SDPA with ``dropout_p``: with 0 one fused kernel (tagged random, drawing nothing); with 0.5 the CPU math
    path, whose dropout mask bernoulli_ draws."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x, x, x, dropout_p=self.p)


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_validate_and_replay_agree_on_which_ops_draw_random_numbers(p: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 2, 5, 8)
    trace = tl.trace(Attention(p), x)
    report, replayed = trace.validate(), trace.replay()
    random = {label for label, why in report.skipped.items() if why == "nondeterministic op (random numbers)"}
    reused = {
        label for label, why in replayed.metadata["not_replayed"].items() if why.startswith("random op")
    }
    assert random == reused == ({"bernoulli__1"} if p else set())
    if p == 0.0:  # deterministic: checked (before the fix: skipped as random, "passed" having checked 0 ops)
        assert [op.func for op in trace] == ["_scaled_dot_product_flash_attention_for_cpu"]
        assert report.checked == 1 and report.skipped == {} and report
        assert torch.equal(replayed.output, F.scaled_dot_product_attention(x, x, x))


def test_a_validation_that_checked_nothing_says_so() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    trace = tl.trace(model, torch.randn(2, 3), save=tl.func("relu"))
    report = trace.validate()  # relu reads addmm's output, which was not saved: nothing can be replayed
    assert report.checked == 0 and report.skipped == {"relu_1": "input from addmm_1 (output 0) was not saved"}
    assert not report and not report.passed  # before the fix: "validation passed"
    assert str(report).splitlines()[0] == (
        "validation checked nothing (every op skipped): 0 ops replayed, 0 mismatched, 1 skipped"
    )


# ------------------------------------------------------------------------------- rerun and replay conditions


def test_rerun_repeats_the_capture_grad_mode() -> None:
    torch.manual_seed(0)
    model, x = AttnBlock().eval(), torch.randn(2, 5, 16)
    with torch.no_grad():
        trace = tl.trace(model, x)
    rerun = trace.fork().rerun(
        model, x
    )  # called with grad on: before the fix MHA took its slow path (37 ops)
    assert [op.label for op in rerun] == [op.label for op in trace]
    assert tl.compare(trace, rerun, first=True) is None
    edited = trace.fork().do("clone_1", tl.zero_ablate()).rerun(model, x)
    assert [op.func for op in edited] == [op.func for op in trace]
    assert torch.equal(edited.output, torch.zeros(2, 80))
    assert torch.is_grad_enabled()  # the caller's mode is back


class InnerStep(nn.Module):
    """MAML-style: one inner gradient step inside forward, through torch.autograd.grad(create_graph=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loss = (x @ self.w).pow(2).sum()
        (g,) = torch.autograd.grad(loss, self.w, create_graph=True)
        return x @ (self.w - 0.1 * g)


def test_replay_reuses_a_gradient_computed_inside_forward() -> None:
    torch.manual_seed(0)
    model, x = InnerStep(), torch.randn(2, 3)
    trace = tl.trace(model, x)
    want = model(x)  # plain PyTorch
    # the gradient's last op, mm_2 (grad_w = x^T @ (2 x w)), runs in the backward phase: replay does not run it
    assert (trace["mm_2"].phase, trace["mul_3"].parents) == ("backward", (trace["mm_2"].index,))
    replayed = trace.replay()  # before the fix: a bare KeyError
    reused = "computed by autograd (backward phase) inside the forward (torch.autograd.grad): its recorded value is reused"
    assert replayed.metadata["not_replayed"] == {"mm_2": reused}
    assert torch.equal(replayed.output, want.detach())
    # an edit after the inner step: the reused gradient is still the right one
    doubled = trace.fork().do("mm_3", tl.scale(2.0)).replay()
    assert torch.equal(doubled.output, 2.0 * want.detach())
    # an edit before it: the gradient was computed from the unedited value, and the replay says so
    early = trace.fork().do("mm_1", tl.scale(2.0)).replay()
    assert early.metadata["not_replayed"]["mm_2"].startswith(reused + ", although the edits changed")


# ------------------------------------------------------------------------------------------------ tl.clamp


def test_clamp_takes_torch_clamps_min_and_max() -> None:
    v = torch.tensor([-2.0, -0.5, 0.5, 2.0])
    site = None  # clamp does not look at the site
    assert torch.equal(tl.clamp(min=0)(v, site), torch.tensor([0.0, 0.0, 0.5, 2.0]))  # before: TypeError
    assert torch.equal(tl.clamp(max=1.0)(v, site), torch.tensor([-2.0, -0.5, 0.5, 1.0]))
    assert torch.equal(tl.clamp(-1.0, 1.0)(v, site), torch.tensor([-1.0, -0.5, 0.5, 1.0]))
    with pytest.raises(ValueError, match="needs min or max"):
        tl.clamp()
    with pytest.raises(TypeError, match="bounds are min and max"):
        tl.clamp(low=0)


def test_clamp_old_names_warn_once_from_the_callers_line() -> None:
    from tl_dist import edits

    edits._warned_clamp.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = tl.clamp(lo=0.0)
        tl.clamp(hi=1.0)
    assert [(w.category, w.filename) for w in caught] == [(FutureWarning, __file__)]
    assert "tl.clamp(min=, max=)" in str(caught[0].message)
    assert (first.min, first.max) == (0.0, None)
    with pytest.raises(TypeError, match="both min and its old name"):
        tl.clamp(min=0.0, lo=0.0)


# ------------------------------------------------------------------------------- gradients after a plain backward


def test_module_grad_after_a_plain_backward_warns_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    trace = tl.trace(model, torch.randn(2, 3), save_grads=True)
    trace.output.sum().backward()  # outside the window: records nothing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert trace.module("0").grad is None
        assert trace["relu_1"].grad is None
    assert [(w.category, w.filename) for w in caught] == [(UserWarning, __file__)]  # once, at the caller
    assert "trace.log_backward(loss)" in str(caught[0].message)
    # through log_backward the same gradients are recorded, and nothing warns
    logged = tl.trace(model, torch.randn(2, 3), save_grads=True)
    logged.log_backward(logged.output.sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # d(sum out)/d(out of layer 0) through relu: W2^T @ 1, masked by relu's positive inputs
        relu_in = logged.module("0").out
        want = (relu_in > 0) * model[2].weight.sum(0)
        assert torch.equal(logged.module("0").grad, want.expand_as(relu_in))


# ------------------------------------------------------------------------------------ autocast's weight cast


def test_no_grad_autocast_edit_of_the_weight_cast_applies() -> None:
    torch.manual_seed(0)
    lin, x = nn.Linear(4, 3), torch.randn(2, 4)
    with torch.no_grad(), torch.amp.autocast("cpu"):
        clean = tl.trace(lin, x)
        (cast,) = [op.label for op in clean if op.func == "_to_copy" and op.out_shapes == ((3, 4),)]
        # the same autocast block: the weight casts are cached by now, yet the edited window casts again
        edited = tl.trace(lin, x, intervene=tl.when(tl.label(cast), tl.zero_ablate()))
        after = lin(x)  # the edited cast did not stay in autocast's cache
    # autocast casts the weight with grad on inside F.linear: before the fix the edit was refused
    assert [op.label for op in edited] == [op.label for op in clean]
    assert edited.metadata["edited"] == {cast: "tl.zero_ablate()"}
    # x @ 0 + bias, in bfloat16
    assert torch.equal(edited.output, lin.bias.detach().bfloat16().expand(2, 3))
    assert torch.equal(after, clean.output)
