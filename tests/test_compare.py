"""tl.compare (per-op divergence of two traces) and the causal selectors tl.upstream / tl.downstream."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from zoo import DataBranch, ResCNN

import tl_dist as tl


@pytest.fixture(scope="module")
def cnn() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return ResCNN().eval(), torch.randn(2, 3, 8, 8)


def test_identical_traces_do_not_diverge(cnn: tuple) -> None:
    model, x = cnn
    with torch.no_grad():
        a, b = tl.trace(model, x), tl.trace(model, x)
    frame = tl.compare(a, b)
    assert len(frame) == len(a) and not frame.differs.any()
    assert (frame.max_abs_diff == 0).all() and (frame.rel_l2 == 0).all()
    assert tl.compare(a, b, first=True) is None


@pytest.mark.parametrize(
    "site, edit",
    [
        ("relu_1", tl.scale(0.5)),
        ("convolution_3", tl.zero_ablate()),
        ("relu__4", tl.add(1.0)),  # the last block's output: only later ops differ
    ],
)
def test_compare_finds_the_edited_op_first(cnn: tuple, site: str, edit: tl.Edit) -> None:
    model, x = cnn
    with torch.no_grad():
        clean = tl.trace(model, x)
        edited = tl.trace(model, x, intervene=tl.when(tl.label(site), edit))
    first = tl.compare(clean, edited, first=True)
    assert first.label == site and first._trace is clean
    frame = tl.compare(clean, edited)
    before = frame[frame.index_a < clean[site].index]
    assert len(before) == clean[site].index and not before.differs.any()
    # Sorted by relative L2 distance, largest first.
    rel = list(frame.rel_l2)
    assert rel == sorted(rel, key=lambda v: -v if not math.isnan(v) else math.inf)


def test_compare_measures_by_hand(cnn: tuple) -> None:
    model, x = cnn
    with torch.no_grad():
        clean = tl.trace(model, x)
        half = tl.trace(model, x, intervene=tl.when(tl.label("relu_1"), tl.scale(0.5)))
        zero = tl.trace(model, x, intervene=tl.when(tl.label("relu_1"), tl.zero_ablate()))
        a = torch.relu(model.stem(x)).double()  # relu_1 by hand
    row = tl.compare(clean, half).set_index("label").loc["relu_1"]
    # |a - a/2| = a/2: max abs = max(a)/2; ||a/2|| / ||a|| = 0.5 exactly (scaling by powers of 2 is exact);
    # a . a/2 / (||a|| ||a/2||) = 1.
    assert row.max_abs_diff == float(a.max()) / 2
    assert row.rel_l2 == 0.5
    assert row.cosine == pytest.approx(1.0, abs=1e-12)
    zrow = tl.compare(clean, zero).set_index("label").loc["relu_1"]
    assert zrow.max_abs_diff == float(a.max()) and zrow.rel_l2 == 1.0 and math.isnan(zrow.cosine)
    # Reversed: b's values are zero, a's are not -> relative to zero is infinite.
    assert tl.compare(zero, clean).set_index("label").loc["relu_1"].rel_l2 == math.inf


def test_compare_traces_that_took_different_paths() -> None:
    model = DataBranch()
    with torch.no_grad():
        pos, neg = tl.trace(model, torch.ones(2, 4)), tl.trace(model, -torch.ones(2, 4))
    frame = tl.compare(pos, neg).set_index("label")
    # pos: sum, gt, item, t, addmm, relu; neg: sum, gt, item, t, addmm, sigmoid.
    assert frame.loc["relu_1"].note == "only in a" and frame.loc["sigmoid_1"].note == "only in b"
    assert frame.loc["addmm_1"].note == "module differs: 'neg.0' in b"
    assert tl.compare(pos, neg, first=True).label == "sum_1"  # the inputs differ from the first op on


def test_compare_needs_saved_outputs(cnn: tuple) -> None:
    model, x = cnn
    with torch.no_grad():
        light, full = tl.trace(model, x, save=None), tl.trace(model, x)
    with pytest.raises(tl.TlDistError, match="trace a has none: trace it with save=True"):
        tl.compare(light, full)
    with pytest.raises(ValueError, match="atol must be a non-negative number"):
        tl.compare(full, full, atol=-1)


# ---------------------------------------------------------------------------------------------- causal


class Small(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * 2  # mul_1
        b = a + 1  # add_1   <- mul_1
        c = a.relu()  # relu_1  <- mul_1
        d = b * c  # mul_2   <- add_1, relu_1
        e = x - 1  # sub_1   (input only)
        return d + e  # add_2 <- mul_2, sub_1


@pytest.fixture(scope="module")
def small() -> tl.Trace:
    trace = tl.trace(Small(), torch.randn(3))
    assert [op.label for op in trace] == ["mul_1", "add_1", "relu_1", "mul_2", "sub_1", "add_2"]
    return trace


def _labels(trace: tl.Trace, selector: tl.Selector) -> set[str]:
    return {op.label for op in trace.select(selector)}


@pytest.mark.parametrize(
    "selector, expected",
    [
        (tl.upstream(tl.label("mul_2")), {"mul_1", "add_1", "relu_1"}),
        (tl.upstream(tl.label("add_2")), {"mul_1", "add_1", "relu_1", "mul_2", "sub_1"}),
        (tl.upstream(tl.label("mul_1")), set()),
        (tl.downstream(tl.label("mul_1")), {"add_1", "relu_1", "mul_2", "add_2"}),
        (tl.downstream(tl.label("add_1")), {"mul_2", "add_2"}),
        (tl.downstream(tl.label("sub_1")), {"add_2"}),
        # A match feeding another match is in the set; one that feeds none is not.
        (tl.upstream(tl.label("mul_1") | tl.label("mul_2")), {"mul_1", "add_1", "relu_1"}),
        (tl.upstream(tl.label("mul_2")) & tl.func("mul"), {"mul_1"}),
        (~tl.downstream(tl.label("mul_1")), {"mul_1", "sub_1"}),
        (tl.upstream(tl.label("add_2")) & tl.downstream(tl.label("mul_1")), {"add_1", "relu_1", "mul_2"}),
        (tl.downstream(tl.label("relu_1")) | tl.upstream(tl.label("add_1")), {"mul_2", "add_2", "mul_1"}),
    ],
)
def test_causal_selectors_equal_hand_computed_sets(
    small: tl.Trace, selector: tl.Selector, expected: set
) -> None:
    assert _labels(small, selector) == expected


def test_causal_selector_follows_the_trace_it_is_used_on(small: tl.Trace) -> None:
    selector = tl.downstream(tl.func("sub"))
    assert _labels(small, selector) == {"add_2"}
    with torch.no_grad():  # (with grad, autograd's detach of relu's result would be downstream too)
        other = tl.trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), torch.randn(1, 2))
    assert _labels(other, tl.downstream(tl.func("addmm"))) == {"relu_1"}
    assert _labels(small, selector) == {"add_2"}  # not the other trace's cached answer


@pytest.mark.parametrize("option", ["save", "save_grads", "stats"])
def test_causal_selectors_are_refused_while_capturing(option: str) -> None:
    with pytest.raises(ValueError, match=f"{option}: tl.upstream.*needs the finished trace"):
        tl.capture(**{option: tl.upstream(tl.func("relu"))})
