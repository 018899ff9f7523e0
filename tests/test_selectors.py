"""Selectors on real traces: prefix-sibling module addresses, each selector's rule, the algebra (&, |, ~) as set
operations, and errors. The Hypothesis tests build random module trees whose sibling names are prefixes of
each other (layer1 / layer10 / layer1x) and check every selector against a reference computed from torch's own
module tree (named_modules), not from address strings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tl_dist as tl
from tl_dist.selectors import check_selection


def _trace(model: nn.Module, x: torch.Tensor) -> tl.Trace:
    with torch.no_grad():
        return tl.trace(model, x)


@pytest.fixture(scope="module")
def siblings() -> tl.Trace:
    model = nn.Sequential()
    model.add_module("layer1", nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    model.add_module("layer10", nn.Linear(2, 2))
    model.add_module("layer1x", nn.ReLU(inplace=True))
    trace = _trace(model, torch.randn(1, 2))
    assert [(op.label, op.module) for op in trace] == [
        ("t_1", "layer1.0"),
        ("addmm_1", "layer1.0"),
        ("relu_1", "layer1.1"),
        ("t_2", "layer10"),
        ("addmm_2", "layer10"),
        ("relu__1", "layer1x"),
    ]
    return trace


def _labels(trace: tl.Trace, selector: tl.Selector) -> list[str]:
    return [op.label for op in trace.select(selector)]


def test_in_module_stops_at_the_address_boundary(siblings):
    # "layer1" is a prefix of "layer10" and "layer1x" as strings, not as module addresses
    assert _labels(siblings, tl.in_module("layer1")) == ["t_1", "addmm_1", "relu_1"]
    assert _labels(siblings, tl.in_module("layer10")) == ["t_2", "addmm_2"]
    assert _labels(siblings, tl.in_module("layer1.1")) == ["relu_1"]
    assert _labels(siblings, tl.in_module("layer")) == []  # no module of that name
    assert _labels(siblings, tl.in_module("layer1.")) == []
    assert len(_labels(siblings, tl.in_module(""))) == 6  # the root module holds every op


def test_in_module_covers_a_submodule_called_without_its_parent():
    class Direct(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1 = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            self.layer10 = nn.Sequential(nn.Linear(2, 2))

        def forward(self, x):
            # layer1.0 and layer10.0 run straight from the top: layer1's own forward never runs
            return self.layer10[0](self.layer1[0](x))

    trace = _trace(Direct(), torch.randn(1, 2))
    assert [(op.label, op.module_stack) for op in trace][1] == ("addmm_1", ("", "layer1.0"))
    assert _labels(trace, tl.in_module("layer1")) == ["t_1", "addmm_1"]  # inside a submodule of layer1
    assert _labels(trace, tl.in_module("layer10")) == ["t_2", "addmm_2"]
    assert _labels(trace, tl.in_module("layer1.0")) == ["t_1", "addmm_1"]


def test_module_func_and_label_rules(siblings):
    # module(): the op whose output is the module's output (layer1's is its ReLU's)
    assert _labels(siblings, tl.module("layer1")) == ["relu_1"]
    assert _labels(siblings, tl.module("layer1.0")) == ["addmm_1"]
    assert _labels(siblings, tl.module("")) == ["relu__1"]
    assert _labels(siblings, tl.module("layer")) == []
    # func("relu") also matches the in-place relu_; func("relu_") only that one
    assert _labels(siblings, tl.func("relu")) == ["relu_1", "relu__1"]
    assert _labels(siblings, tl.func("relu_")) == ["relu__1"]
    assert _labels(siblings, tl.func("rel")) == []
    assert _labels(siblings, tl.func("addmm", "t")) == ["t_1", "addmm_1", "t_2", "addmm_2"]
    assert _labels(siblings, tl.label("addmm_2", "t_1")) == ["t_1", "addmm_2"]
    assert _labels(siblings, tl.where(lambda op: op.index % 2)) == ["addmm_1", "t_2", "relu__1"]


def test_combinations(siblings):
    relu = tl.func("relu")
    assert _labels(siblings, relu & tl.in_module("layer1")) == ["relu_1"]
    assert _labels(siblings, relu | tl.in_module("layer10")) == ["relu_1", "t_2", "addmm_2", "relu__1"]
    assert _labels(siblings, ~relu) == ["t_1", "addmm_1", "t_2", "addmm_2"]
    assert _labels(siblings, ~~relu) == ["relu_1", "relu__1"]


def test_reprs_name_the_selection():
    sel = tl.func("relu", "addmm") & ~tl.in_module("layer1") | tl.label("t_1")
    assert repr(sel) == "((tl.func('addmm', 'relu') & ~tl.in_module('layer1')) | tl.label('t_1'))"
    assert repr(tl.module("fc")) == "tl.module('fc')"

    def big(op):
        return op.flops > 0

    assert repr(tl.where(big)) == "tl.where('big')"
    assert repr(tl.label("relu_2", "add_1")) == "tl.label('add_1', 'relu_2')"

    class Threshold:  # a callable without __name__: its own repr names it
        def __call__(self, op):
            return op.flops > 10

        def __repr__(self):
            return "Threshold(10)"

    assert repr(tl.where(Threshold())) == "tl.where(Threshold(10))"


def test_bad_selectors_name_what_was_expected():
    with pytest.raises(ValueError, match=r"tl\.func\(\) needs at least one name"):
        tl.func()
    with pytest.raises(ValueError, match=r"tl\.label\(\) needs at least one name"):
        tl.label()
    with pytest.raises(TypeError, match=r"tl\.in_module\(\) expects str names, got 3 \(int\)"):
        tl.in_module(3)
    with pytest.raises(TypeError, match=r"tl\.module\(\) expects str names, got None \(NoneType\)"):
        tl.module(None)
    with pytest.raises(TypeError, match=r"tl\.func\(\) expects str names"):
        tl.func("relu", 1)
    with pytest.raises(ValueError, match=r"tl\.func\(\) names must be op names such as 'relu', got ''"):
        tl.func("relu", "")
    with pytest.raises(TypeError, match=r"selector & expects another selector .* got 'relu'"):
        tl.func("relu") & "relu"
    with pytest.raises(TypeError, match=r"selector \| expects another selector"):
        tl.func("relu") | None
    with pytest.raises(TypeError, match=r"tl\.where\(\) expects a callable taking an op, got 'x'"):
        tl.where("x")
    with pytest.raises(NotImplementedError):
        tl.Selector().match(None)


def test_check_selection_accepts_true_none_or_a_selector():
    relu = tl.func("relu")
    assert check_selection(True, "save") is True
    assert check_selection(None, "save") is None
    assert check_selection(relu, "save") is relu
    for bad in (False, 1, "relu", [relu]):
        with pytest.raises(
            ValueError, match=r"^save_grads must be True \(all ops\), None \(none\) or a selector"
        ):
            check_selection(bad, "save_grads")


# -- properties over random module trees ----------------------------------------------------------------------
# Sibling names chosen so that many are string prefixes of others.
NAMES = ("a", "a1", "a10", "a1x", "b", "b0")
LEAVES = (lambda: nn.Linear(2, 2), nn.ReLU, nn.Tanh, nn.Sigmoid)


def _tree(depth: int):
    leaf = st.sampled_from(range(len(LEAVES))).map(lambda i: LEAVES[i]())
    if depth == 0:
        return leaf

    def container(children: list[tuple[str, nn.Module]]) -> nn.Module:
        seq = nn.Sequential()
        for name, child in children:
            seq.add_module(name, child)
        return seq

    named = st.lists(
        st.tuples(st.sampled_from(NAMES), _tree(depth - 1)), min_size=1, max_size=3, unique_by=lambda c: c[0]
    )
    return st.one_of(leaf, named.map(container))


@st.composite
def traced_trees(draw):
    children = draw(
        st.lists(
            st.tuples(st.sampled_from(NAMES), _tree(2)), min_size=2, max_size=4, unique_by=lambda c: c[0]
        )
    )
    model = nn.Sequential()
    for name, child in children:
        model.add_module(name, child)
    return model, _trace(model, torch.randn(1, 2))


def _addresses(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules()]


def _inside(model: nn.Module, address: str) -> set[str]:
    """Addresses of the module at ``address`` and all its submodules, from torch's module tree."""
    sub = model.get_submodule(address)
    return {
        address if not name else (f"{address}.{name}" if address else name) for name, _ in sub.named_modules()
    }


def _atoms(model: nn.Module, trace: tl.Trace) -> st.SearchStrategy:
    real = _addresses(model)
    # addresses that do not exist but are string prefixes or extensions of ones that do
    fake = sorted({a[:-1] for a in real if len(a) > 1} | {a + "0" for a in real if a} - set(real))
    labels = [op.label for op in trace]
    return st.one_of(
        st.sampled_from(real + fake).map(tl.in_module),
        st.sampled_from(real + fake).map(tl.module),
        st.sampled_from(("addmm", "t", "relu", "tanh", "sigmoid")).map(tl.func),
        st.sampled_from(labels).map(tl.label),
    )


def _selectors(atoms: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(
        atoms,
        lambda inner: st.one_of(
            st.tuples(inner, inner).map(lambda ab: ab[0] & ab[1]),
            st.tuples(inner, inner).map(lambda ab: ab[0] | ab[1]),
            inner.map(lambda a: ~a),
        ),
        max_leaves=4,
    )


def _picked(trace: tl.Trace, selector: tl.Selector) -> set[int]:
    return {op.index for op in trace.select(selector)}


@settings(max_examples=40, deadline=None)
@given(traced_trees(), st.data())
def test_in_module_matches_the_module_subtree(tree, data):
    model, trace = tree
    address = data.draw(st.sampled_from(_addresses(model)), label="address")
    inside = _inside(model, address)
    assert _picked(trace, tl.in_module(address)) == {op.index for op in trace if op.module in inside}
    # a name that is only a string prefix of a real sibling selects nothing of that sibling
    for missing in (address + "0", address + "x"):
        if missing not in _addresses(model):
            assert _picked(trace, tl.in_module(missing)) == set()


@settings(max_examples=40, deadline=None)
@given(traced_trees(), st.data())
def test_selector_algebra_is_set_algebra(tree, data):
    model, trace = tree
    everything = set(range(len(trace)))
    selectors = _selectors(_atoms(model, trace))
    a = data.draw(selectors, label="a")
    b = data.draw(selectors, label="b")
    pa, pb = _picked(trace, a), _picked(trace, b)
    assert _picked(trace, a & ~a) == set()
    assert _picked(trace, a | ~a) == everything
    assert _picked(trace, ~a) == everything - pa
    assert _picked(trace, a & b) == pa & pb
    assert _picked(trace, a | b) == pa | pb
    # De Morgan
    assert _picked(trace, ~(a | b)) == _picked(trace, ~a & ~b)
    assert _picked(trace, ~(a & b)) == _picked(trace, ~a | ~b)


def test_func_names_the_public_op_and_matches_atens_underscored_implementation():
    # torch.softmax / log_softmax reach the dispatcher as _softmax / _log_softmax: a user names the public op
    model = nn.Sequential(nn.Linear(3, 4), nn.Softmax(dim=-1), nn.LogSoftmax(dim=-1))
    trace = _trace(model, torch.randn(2, 3))
    assert [op.func for op in trace][-2:] == ["_softmax", "_log_softmax"]
    assert _labels(trace, tl.func("softmax")) == ["_softmax_1"]
    assert _labels(trace, tl.func("_softmax")) == ["_softmax_1"]
    assert _labels(trace, tl.func("log_softmax")) == ["_log_softmax_1"]
    assert _labels(trace, tl.func("oftmax")) == []
    saved = tl.trace(model, torch.randn(2, 3), save=tl.func("softmax") & tl.in_module("1"))
    assert [op.label for op in saved if op.out is not None] == ["_softmax_1"]
