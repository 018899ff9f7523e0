"""Interventions (tl.when + the edits of tl_dist.edits) on the test zoo, against plain PyTorch.

Ground truth: for a module site, the same edit applied by a forward hook on a plain forward; for an op site,
a hand-written forward applying the edit at that op (or, for an op inside library code -- MHA's softmax --
a ten-line TorchDispatchMode written here). Same kernels in the same order, so the outputs are compared bit
for bit (torch.equal). Sites run in the grad mode that exercises each path: under no_grad the edit is applied
at the dispatcher; with autograd recording, just above it (tl_dist._intervene).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import torch
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from zoo import MHA, InPlace, LoopRNN, ResCNN, TorchEncoder

import tl_dist as tl

# ------------------------------------------------------------------------------------------ reference forwards


def rescnn_op(m: ResCNN, x: torch.Tensor, edit: Callable) -> torch.Tensor:
    """ResCNN.forward with ``edit`` applied to torch.relu after the stem (relu_1)."""
    h = edit(torch.relu(m.stem(x)))
    return m.fc(m.pool(m.blocks(h)).flatten(1))


def encoder_op(m: TorchEncoder, x: torch.Tensor, edit: Callable) -> torch.Tensor:
    """TorchEncoder.forward (the layer's non-fast path, as torch writes it) with ``edit`` on the feed-forward
    activation (relu_1)."""
    layer = m.layer
    h = layer.norm1(x + layer._sa_block(x, None, None))
    ff = layer.dropout2(layer.linear2(layer.dropout(edit(layer.activation(layer.linear1(h))))))
    return m.head(layer.norm2(h + ff))


def loop_rnn_op(m: LoopRNN, x: torch.Tensor, edit: Callable) -> torch.Tensor:
    """LoopRNN.forward with ``edit`` applied to the second step's tanh (tanh_2)."""
    h = torch.zeros(x.shape[0], 7)
    for t in range(m.steps):
        h = torch.tanh(m.inp(x[:, t]) + m.rec(h))
        if t == 1:
            h = edit(h)
    return h


class EditNth(TorchDispatchMode):
    """Plain-PyTorch reference for an op inside library code: replaces the output of the ``n``-th call of
    ``op`` by ``edit(output)``."""

    def __init__(self, op: Any, n: int, edit: Callable) -> None:
        super().__init__()
        self.op, self.n, self.edit, self.seen = op, n, edit, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func is self.op:
            self.seen += 1
            if self.seen == self.n:
                out = self.edit(out)
        return out


def mha_op(m: MHA, x: torch.Tensor, edit: Callable) -> Any:
    """MHA in train mode (dropout 0, so the slow path runs) with ``edit`` on its softmax (_softmax_1)."""
    with EditNth(torch.ops.aten._softmax.default, 1, edit):
        return m(x)


# ------------------------------------------------------------------------------------------------------ sites


@dataclass(frozen=True)
class SiteCase:
    name: str
    build: Callable[[], tuple[torch.nn.Module, Callable[[], torch.Tensor]]]
    grad: bool
    labels: tuple[str, ...]  # the ops whose outputs the edit replaces, in order (hand-read from the model)
    module: str | None = None  # module site: its address (a forward hook is the reference)
    op: str | None = None  # op site: the label, with `forward` the reference
    forward: Callable | None = None
    hook_out: Callable[[Any, Callable], Any] = lambda out, edit: edit(out)  # the hook's edit of the output


def _inputs(*shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.randn(*shape)


def _mha_train() -> tuple[torch.nn.Module, Callable]:
    return MHA().train(), _inputs(2, 5, 8)


_CNN = lambda: (ResCNN().eval(), _inputs(2, 3, 8, 8))  # noqa: E731
_ENCODER = lambda: (TorchEncoder().eval(), _inputs(2, 5, 16))  # noqa: E731
_RNN = lambda: (LoopRNN(), _inputs(3, 4, 5))  # noqa: E731
SITES = [
    # blocks.0 ends in its ReLU(inplace=True), called twice: the second call's relu_ is the block's output.
    SiteCase("rescnn-module", _CNN, False, ("relu__2",), module="blocks.0"),
    SiteCase("rescnn-op", _CNN, False, ("relu_1",), op="relu_1", forward=rescnn_op),
    # linear1 on a 3-D input: view, t, addmm, view; the last view (view_11, after the attention block's ten views) is its output.
    SiteCase("encoder-module", _ENCODER, True, ("view_11",), module="layer.linear1"),
    SiteCase("encoder-op", _ENCODER, True, ("relu_1",), op="relu_1", forward=encoder_op),
    # rec (a bias-free Linear) is called once per step: four calls, four edits.
    SiteCase("loop_rnn-module", _RNN, False, ("mm_1", "mm_2", "mm_3", "mm_4"), module="rec"),
    SiteCase("loop_rnn-op", _RNN, True, ("tanh_2",), op="tanh_2", forward=loop_rnn_op),
    SiteCase(
        "mha-module",
        lambda: (MHA().eval(), _inputs(2, 5, 8)),
        True,
        ("transpose_8",),  # tests/zoo.py: attn's output leaves are transpose_8 (output) and mean_1 (weights)
        module="attn",
        hook_out=lambda out, edit: (edit(out[0]), out[1]),  # output=0: the attention output, not the weights
    ),
    SiteCase("mha-op", _mha_train, False, ("_softmax_1",), op="_softmax_1", forward=mha_op),
]


class Run:
    """One site's model and inputs, plain runs of the reference recording the site's values."""

    def __init__(self, case: SiteCase) -> None:
        torch.manual_seed(0)
        self.case = case
        self.model, make = case.build()
        self.x, self.x2, self.x3 = make(), make(), make()
        self.labels = list(case.labels)
        shapes: list[tuple[int, ...]] = []
        self.reference(self.x, lambda v, lab: shapes.append(tuple(v.shape)) or v)
        self.shape = shapes[0]
        # Values at the site in plain runs on the other inputs (for patch and resample), by label.
        self.clean = {"x2": self.recorded(self.x2), "x3": self.recorded(self.x3)}

    def reference(self, x: torch.Tensor, edit: Callable[[torch.Tensor, str], torch.Tensor]) -> Any:
        """A plain forward on ``x`` with ``edit(value, label)`` applied at the site."""
        case, labels = self.case, iter(self.labels)

        def at_site(value: torch.Tensor) -> torch.Tensor:
            return edit(value, next(labels))

        with torch.set_grad_enabled(case.grad):
            if case.module is None:
                return case.forward(self.model, x, at_site)
            target = self.model.get_submodule(case.module)
            handle = target.register_forward_hook(lambda mod, args, out: case.hook_out(out, at_site))
            try:
                return self.model(x)
            finally:
                handle.remove()

    def recorded(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        values: dict[str, torch.Tensor] = {}

        def record(value: torch.Tensor, label: str) -> torch.Tensor:
            values[label] = value.detach().clone()
            return value

        self.reference(x, record)
        return values

    def traced(self, edit: Any, **options: Any) -> tl.Trace:
        selector = tl.module(self.case.module) if self.case.module else tl.label(self.case.op)
        with torch.set_grad_enabled(self.case.grad):
            return tl.trace(self.model, self.x, intervene=tl.when(selector, edit), **options)

    def other(self, name: str) -> tl.Trace:
        with torch.set_grad_enabled(self.case.grad):
            return tl.trace(self.model, {"x2": self.x2, "x3": self.x3}[name])


@cache
def run_of(name: str) -> Run:
    return Run(next(c for c in SITES if c.name == name))


def _vector(shape: tuple[int, ...], lo: float, hi: float) -> torch.Tensor:
    """A vector broadcasting along the channel (4-D) or feature (last) dimension."""
    if len(shape) == 4:
        return torch.linspace(lo, hi, shape[1]).reshape(-1, 1, 1)
    return torch.linspace(lo, hi, shape[-1])


def _seeded(seed: int, label: str) -> torch.Generator:
    # The documented recipe of add_noise / resample: a CPU generator seeded with seed + crc32(label).
    return torch.Generator().manual_seed((seed + zlib.crc32(label.encode())) % (1 << 63))


def _masked(v: torch.Tensor) -> torch.Tensor:
    w = v.clone()
    w[..., [0, 2]] = 0
    return w


def _resampled(run: Run, v: torch.Tensor, label: str) -> torch.Tensor:
    pick = int(torch.randint(2, (), generator=_seeded(1, label)))
    return run.clean[("x2", "x3")[pick]][label]


# name -> (the edit, given the run; the same edit by hand: (run, value, label) -> value)
EDITS: dict[str, tuple[Callable[[Run], Any], Callable[[Run, torch.Tensor, str], torch.Tensor]]] = {
    "zero_ablate": (lambda r: tl.zero_ablate(), lambda r, v, lab: torch.zeros_like(v)),
    "mean_ablate": (
        lambda r: tl.mean_ablate(dims=0),
        lambda r, v, lab: v.mean(dim=(0,), keepdim=True).expand_as(v),
    ),
    "scale": (lambda r: tl.scale(0.5), lambda r, v, lab: v * 0.5),
    "add": (lambda r: tl.add(_vector(r.shape, -1, 1)), lambda r, v, lab: v + _vector(r.shape, -1, 1)),
    "add_noise": (
        lambda r: tl.add_noise(0.3, seed=5),
        lambda r, v, lab: v + 0.3 * torch.randn(v.shape, generator=_seeded(5, lab), dtype=v.dtype),
    ),
    "clamp": (lambda r: tl.clamp(-0.1, 0.2), lambda r, v, lab: v.clamp(-0.1, 0.2)),
    "replace": (
        lambda r: tl.replace(torch.linspace(2, 3, r.shape[-1])),
        lambda r, v, lab: torch.linspace(2, 3, r.shape[-1]).expand_as(v),
    ),
    "mask": (lambda r: tl.mask([0, 2]), lambda r, v, lab: _masked(v)),
    "patch": (lambda r: tl.patch(r.other("x2")), lambda r, v, lab: r.clean["x2"][lab]),
    "resample": (lambda r: tl.resample([r.other("x2"), r.other("x3")], seed=1), _resampled),
    "function": (lambda r: lambda value, op: value * 2 - 1, lambda r, v, lab: v * 2 - 1),
}


def _leaves(value: Any) -> list[torch.Tensor]:
    return list(value) if isinstance(value, tuple) else [value]


@pytest.mark.parametrize("edit_name", list(EDITS))
@pytest.mark.parametrize("site", [c.name for c in SITES])
def test_edit_equals_plain_pytorch(site: str, edit_name: str) -> None:
    run = run_of(site)
    make, by_hand = EDITS[edit_name]
    trace = run.traced(make(run))
    expected = run.reference(run.x, lambda v, lab: by_hand(run, v, lab))
    for got, want in zip(_leaves(trace.output), _leaves(expected), strict=True):
        assert torch.equal(got.detach(), want.detach()), f"{site} {edit_name}: traced output differs"
    assert sorted(trace.edited) == sorted(run.labels)
    # The edited value is what the trace recorded for the op (and what validate() leaves out).
    recording = _Recorder(run, by_hand)
    run.reference(run.x, recording)
    for label in run.labels:
        assert torch.equal(_leaves(trace[label].out)[0].detach(), recording.values[label])
    report = trace.validate()
    assert report, str(report)
    assert set(run.labels) <= set(report.skipped)


class _Recorder:
    """An edit by hand that remembers the edited value per label."""

    def __init__(self, run: Run, by_hand: Callable) -> None:
        self.run, self.by_hand, self.values = run, by_hand, {}

    def __call__(self, v: torch.Tensor, label: str) -> torch.Tensor:
        new = self.by_hand(self.run, v, label)
        self.values[label] = new.detach().clone()
        return new


def test_edit_changes_the_output() -> None:
    # Guards the equality test above against a no-op: the edited output really differs from the plain one.
    run = run_of("rescnn-op")
    with torch.no_grad():
        plain = run.model(run.x)
    assert not torch.equal(run.traced(tl.scale(0.5)).output, plain)


def test_patch_every_op_restores_the_clean_output() -> None:
    torch.manual_seed(0)
    model = ResCNN().eval()
    clean_x, corrupt_x = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        clean = tl.trace(model, clean_x)
        patched = tl.trace(model, corrupt_x, intervene=tl.when(True, tl.patch(clean)))
        corrupt = model(corrupt_x)
    assert not torch.equal(corrupt, clean.output)
    assert torch.equal(patched.output, clean.output)
    assert len(patched.edited) == len(clean.saved)  # every op with an output


def test_list_applies_in_order_and_rshift_composes() -> None:
    run = run_of("rescnn-op")
    sel = tl.label("relu_1")
    first_scale = [tl.when(sel, tl.scale(2.0)), tl.when(sel, tl.add(1.0))]
    with torch.no_grad():
        listed = tl.trace(run.model, run.x, intervene=first_scale)
        chained = tl.trace(run.model, run.x, intervene=tl.when(sel, tl.add(1.0) >> tl.scale(2.0)))
    assert torch.equal(listed.output, run.reference(run.x, lambda v, lab: v * 2.0 + 1.0))
    assert torch.equal(chained.output, run.reference(run.x, lambda v, lab: (v + 1.0) * 2.0))
    assert listed.edited == {"relu_1": "tl.scale(2.0); tl.add(1.0)"}


def test_add_noise_is_reproducible_and_seeded() -> None:
    run = run_of("rescnn-op")
    a, b = run.traced(tl.add_noise(0.5, seed=7)), run.traced(tl.add_noise(0.5, seed=7))
    c = run.traced(tl.add_noise(0.5, seed=8))
    assert torch.equal(a.output, b.output)
    assert not torch.equal(a.output, c.output)


# --------------------------------------------------------------------------------------------------- autograd


def test_steering_vector_gradient_equals_forward_hook() -> None:
    torch.manual_seed(0)
    model, x = ResCNN().eval(), torch.randn(2, 3, 8, 8)
    v = torch.zeros(8, 1, 1, requires_grad=True)
    trace = tl.trace(model, x, intervene=tl.when(tl.module("blocks.0"), tl.add(v)), keep_graph=True)
    (trace.output**2).sum().backward()
    w = torch.zeros(8, 1, 1, requires_grad=True)
    handle = model.blocks[0].register_forward_hook(lambda mod, args, out: out + w)
    (model(x) ** 2).sum().backward()
    handle.remove()
    assert w.grad.abs().sum() > 0
    assert torch.equal(v.grad, w.grad)


@pytest.mark.parametrize("site", ["rescnn-op", "loop_rnn-op", "encoder-op"])
def test_op_site_edit_backpropagates_through_the_edit(site: str) -> None:
    # Steering at an op (applied above autograd): the vector's gradient and the parameters' are those of
    # the hand-written forward with the same edit.
    run = run_of(site)
    model = run.model
    v = (_vector(run.shape, -0.5, 0.5) * 0).requires_grad_()
    with torch.enable_grad():
        trace = tl.trace(model, run.x, intervene=tl.when(tl.label(run.labels[0]), tl.scale(3.0) >> tl.add(v)))
        loss = (trace.output**2).sum()
        got = torch.autograd.grad(loss, [v, *model.parameters()], allow_unused=True)
        w = (_vector(run.shape, -0.5, 0.5) * 0).requires_grad_()
        ref = (run.case.forward(model, run.x, lambda value: value * 3.0 + w) ** 2).sum()
        want = torch.autograd.grad(ref, [w, *model.parameters()], allow_unused=True)
    assert torch.equal(loss.detach(), ref.detach())
    assert got[0].abs().sum() > 0
    for g, e in zip(got, want, strict=True):
        assert (g is None and e is None) or torch.equal(g, e)


def test_zero_ablation_cuts_the_gradient_upstream() -> None:
    torch.manual_seed(0)
    model, x = ResCNN().eval(), torch.randn(2, 3, 8, 8)
    trace = tl.trace(model, x, intervene=tl.when(tl.label("relu_1"), tl.zero_ablate()))
    trace.output.sum().backward()
    # relu_1 reads only the stem: zeroing it leaves the stem no path to the loss; the blocks keep theirs.
    assert model.stem.weight.grad is None
    assert torch.count_nonzero(model.blocks[0].conv1.weight.grad) == 0  # it saw only zeros
    # Zeros through the blocks (eval BatchNorm with fresh statistics maps 0 to 0) reach fc as zeros: only its
    # bias gets a gradient, d(sum of 2x5 outputs)/d(bias) = 2 per unit.
    assert torch.count_nonzero(model.fc.weight.grad) == 0
    assert torch.equal(model.fc.bias.grad, torch.full((5,), 2.0))


# -------------------------------------------------------------------------------------------- errors, limits


def _clean_process() -> tuple:
    return (
        len(_get_current_dispatch_mode_stack()),
        torch._C._len_torch_function_stack(),
        len(nn_module._global_forward_hooks),
        len(nn_module._global_forward_pre_hooks),
    )


@pytest.mark.parametrize(
    "edit, what",
    [
        (lambda value, op: value.double(), "dtype: torch.float64 instead of torch.float32"),
        (lambda value, op: value[:1], "shape: (1, 8, 8, 8) instead of (2, 8, 8, 8)"),
        (lambda value, op: 3.0, "returned float, not a tensor"),
    ],
)
def test_an_edit_that_changes_dtype_or_shape_names_the_op(edit: Callable, what: str) -> None:
    run = run_of("rescnn-op")
    before = _clean_process()
    with pytest.raises(tl.InterventionError, match=r"on relu_1") as err, torch.no_grad():
        tl.trace(run.model, run.x, intervene=tl.when(tl.label("relu_1"), edit))
    assert what in str(err.value)
    assert _clean_process() == before
    assert len(err.value.tl_trace) > 0  # the ops captured before the error travel with it


def test_module_site_shape_error_names_the_module_op() -> None:
    run = run_of("rescnn-module")
    with pytest.raises(
        tl.InterventionError, match=r"tl.replace\(tensor\[3\]\) on relu__2 \(in blocks.0.relu\)"
    ):
        with torch.no_grad():
            tl.trace(run.model, run.x, intervene=tl.when(tl.module("blocks.0"), tl.replace(torch.ones(3))))


def test_internal_op_under_autograd_raises_naming_the_returned_op() -> None:
    # MHA's softmax runs inside F.multi_head_attention_forward, which uses it before returning: with autograd
    # recording, an edit there could not be differentiated. tl_dist says so, and where it could edit.
    torch.manual_seed(0)
    model, x = MHA().eval(), torch.randn(2, 5, 8)
    before = _clean_process()
    with pytest.raises(tl.InterventionError, match=r"cannot edit _softmax_1 .*multi_head_attention_forward"):
        tl.trace(model, x, intervene=tl.when(tl.func("_softmax"), tl.scale(0.5)))
    assert _clean_process() == before


def test_inplace_op_edit_reaches_aliases_without_grad_and_refuses_stale_reads_with_grad() -> None:
    torch.manual_seed(0)
    model, x = InPlace(), torch.randn(3, 6)

    def by_hand(m: InPlace, x: torch.Tensor) -> torch.Tensor:  # InPlace.forward with relu_ scaled by 0.5
        y = m.fc(x)
        y.add_(1.0)
        y.relu_()
        y.mul_(0.5)  # the edit, written into y as the in-place op wrote
        z = y * 2
        z[:, 0] = -1.0
        z[1] = y[0]
        z.mul_(0.5)
        return z + y

    with torch.no_grad():
        trace = tl.trace(model, x, intervene=tl.when(tl.label("relu__1"), tl.scale(0.5)))
        assert torch.equal(trace.output, by_hand(model, x))
    # With autograd the edit is a new tensor; InPlace keeps using `y` (the unedited tensor relu_ wrote).
    with pytest.raises(tl.InterventionError, match=r"reads the tensor the in-place op relu__1 wrote"):
        tl.trace(model, x, intervene=tl.when(tl.label("relu__1"), tl.scale(0.5)))


def test_output_position_and_all() -> None:
    torch.manual_seed(0)
    model, x = MHA().eval(), torch.randn(2, 5, 8)
    with torch.no_grad():
        plain = model(x)
        weights = tl.trace(model, x, intervene=tl.when(tl.module("attn"), tl.zero_ablate(), output=1))
        both = tl.trace(model, x, intervene=tl.when(tl.module("attn"), tl.scale(2.0), output="all"))
    assert torch.equal(weights.output[0], plain[0]) and torch.equal(
        weights.output[1], torch.zeros_like(plain[1])
    )
    assert torch.equal(both.output[0], plain[0] * 2.0) and torch.equal(both.output[1], plain[1] * 2.0)
    with pytest.raises(tl.InterventionError, match=r"output has 2 tensor\(s\); output=5"), torch.no_grad():
        tl.trace(model, x, intervene=tl.when(tl.module("attn"), tl.zero_ablate(), output=5))


def test_capture_window_and_save_none() -> None:
    run = run_of("rescnn-module")
    with torch.no_grad():
        expected = run.reference(run.x, lambda v, lab: v * 0.0)
        with tl.capture(intervene=[tl.when(tl.module("blocks.0"), tl.scale(0.0))]) as cap:
            out = run.model(run.x)
        light = tl.trace(run.model, run.x, save=None, intervene=tl.when(tl.module("blocks.0"), tl.scale(0.0)))
    assert torch.equal(out, expected) and torch.equal(light.output, expected)
    assert cap.trace.edited == {"relu__2": "tl.scale(0.0)"} and not light.saved


@pytest.mark.parametrize(
    "value, message",
    [
        (tl.zero_ablate(), "intervene must be tl.when(selector, edit)"),
        ([tl.when(tl.func("relu"), tl.zero_ablate()), "relu"], "intervene must be tl.when"),
        (tl.when(tl.upstream(tl.func("relu")), tl.zero_ablate()), "needs the finished trace"),
    ],
)
def test_bad_intervene_option(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tl.CaptureOptions(intervene=value)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: tl.when("relu_1", tl.zero_ablate()), "selector must be a selector"),
        (lambda: tl.when(tl.func("relu"), "zero"), "edit must be an edit"),
        (lambda: tl.when(tl.func("relu"), tl.zero_ablate(), output=-1), "output must be"),
        (lambda: tl.mean_ablate(dims="batch"), "dims must be"),
        (lambda: tl.add_noise(-1.0), "std must be"),
        (lambda: tl.clamp(), "needs min or max"),
        (lambda: tl.mask(1.5), "index must be"),
        (lambda: tl.scale("2"), "factor must be"),
        (lambda: tl.patch(object()), "other must be a tl_dist Trace"),
        (lambda: tl.resample([]), "others must be a non-empty list"),
    ],
)
def test_bad_edit_arguments_name_the_argument(make: Callable, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_mean_ablate_over_a_dimension_the_value_lacks_names_it() -> None:
    model, x = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()), torch.randn(2, 4)
    hooks = dict(torch.nn.modules.module._global_forward_hooks)
    with pytest.raises(
        tl.InterventionError, match=r"tl.mean_ablate\(dims=\(7,\)\) on relu_1: its output has 2 "
    ):
        tl.trace(model, x, intervene=tl.when(tl.func("relu"), tl.mean_ablate(dims=7)))
    assert dict(torch.nn.modules.module._global_forward_hooks) == hooks  # nothing left behind
    got = tl.trace(model, x, intervene=tl.when(tl.func("relu"), tl.mean_ablate(dims=-2))).output
    assert torch.equal(got, model(x).mean(dim=0, keepdim=True).expand(2, 3))


def test_an_intervention_that_edits_nothing_warns() -> None:
    run = run_of("rescnn-module")
    typo = r"intervene=tl.when\(tl.module\('blocks.5'\), tl.zero_ablate\(\)\) edited nothing"
    with pytest.warns(UserWarning, match=typo), torch.no_grad():
        trace = tl.trace(run.model, run.x, intervene=tl.when(tl.module("blocks.5"), tl.zero_ablate()))
    assert trace.edited == {}


def test_edited_trace_saves_and_loads(tmp_path) -> None:  # noqa: ANN001 - pytest fixture
    run = run_of("rescnn-op")
    trace = run.traced(tl.scale(0.5))
    loaded = tl.load(trace.save(tmp_path / "edited.h5"))
    assert loaded.edited == {"relu_1": "tl.scale(0.5)"}
    assert torch.equal(loaded["relu_1"].out, trace["relu_1"].out)


def test_patch_from_a_trace_without_the_op_saved() -> None:
    run = run_of("rescnn-op")
    with torch.no_grad():
        other = tl.trace(run.model, run.x2, save=tl.func("addmm"))
        with pytest.raises(tl.InterventionError, match="did not save relu_1"):
            tl.trace(run.model, run.x, intervene=tl.when(tl.label("relu_1"), tl.patch(other)))
