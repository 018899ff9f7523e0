"""trace.draw(..., rolled=True): a loop over the same modules and ops drawn once, with iteration counts."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from zoo import LoopRNN, ResCNN

import tl_dist as tl
from tl_dist.views.draw import graph_source
from tl_dist.views.rolled import find_loops


@pytest.mark.parametrize(
    "sequence, loops",
    [
        ("zabcabcabcq", [(1, 3, 3)]),
        ("aaaa", [(0, 1, 4)]),
        ("abab" + "xyz" + "xyzxyz", [(0, 2, 2), (4, 3, 3)]),
        ("abcab", []),  # an incomplete second iteration is no loop
        ("abcdbcd", [(1, 3, 2)]),
        # The longest run from the earliest start wins: "abab" then "ab" again is period 2 x 3, not 4 x 1.
        ("ababab", [(0, 2, 3)]),
    ],
)
def test_find_loops(sequence: str, loops: list) -> None:
    assert find_loops(list(sequence)) == loops


def _ops(source: str) -> list[str]:
    """First label lines of the op nodes of a DOT source."""
    return [
        m
        for line in source.splitlines()
        if "->" not in line
        for m in re.findall(r'op\d+ \[label="([^"\\]+)', line)
    ]


def _edges(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if "->" in line]


def test_rolled_rnn_draws_one_step_with_counts() -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        trace = tl.trace(LoopRNN(), torch.randn(3, 4, 5))
    unrolled, rolled = graph_source(trace), graph_source(trace, rolled=True)
    assert graph_source(trace, rolled=False) == unrolled
    # Four steps of addmm (inp), mm (rec), add, tanh unrolled; one of each rolled.
    assert sorted(_ops(unrolled)) == sorted(
        ["zeros_1"] + [f"{f}_{k}" for f in ("addmm", "mm", "add", "tanh") for k in range(1, 5)]
    )
    assert sorted(_ops(rolled)) == sorted(
        ["zeros_1", "addmm_1 … addmm_4 ×4", "mm_1 … mm_4 ×4", "add_1 … add_4 ×4", "tanh_1 … tanh_4 ×4"]
    )
    assert 'label="inp (Linear) ×4"' in rolled and 'label="rec (Linear) ×4"' in rolled
    assert "call 1" in unrolled and "call 1" not in rolled
    names = dict(re.findall(r'(op\d+) \[label="([^_"]+)_1', rolled))
    name = {func: node for node, func in names.items()}
    edges = _edges(rolled)
    # h_t = tanh(inp(x_t) + rec(h_{t-1})): each step's tanh feeds the next step's rec (3 of 4 steps), dashed;
    # the first step's rec reads the zeros.
    assert f'{name["tanh"]} -> {name["mm"]} [label="×3" fontsize=9 style=dashed constraint=false]' in edges
    assert f"{name['zeros']} -> {name['mm']}" in edges
    assert f'{name["addmm"]} -> {name["add"]} [label="×4" fontsize=9]' in edges
    assert len(edges) < len(_edges(unrolled))


def test_rolled_backward_of_the_loop() -> None:
    torch.manual_seed(0)
    model = LoopRNN()
    with tl.capture() as cap:
        model(torch.randn(3, 4, 5)).sum().backward()
    rolled = graph_source(cap.trace, phase="backward", rolled=True)
    unrolled = graph_source(cap.trace, phase="backward")
    assert len(_ops(rolled)) < len(_ops(unrolled))
    # The middle steps' backward repeats (the first and last differ: no gradient to accumulate into yet).
    assert any(re.search(r" ×\d$", label) for label in _ops(rolled))


def test_models_without_loops_draw_the_same() -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        trace = tl.trace(ResCNN().eval(), torch.randn(2, 3, 8, 8))
    assert graph_source(trace, rolled=True) == graph_source(trace)


def test_a_python_loop_over_one_block_rolls() -> None:
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    class Repeat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = block

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(5):
                x = self.block(x)
            return x

    with torch.no_grad():
        trace = tl.trace(Repeat(), torch.randn(2, 4))
    rolled = graph_source(trace, rolled=True)
    assert sorted(_ops(rolled)) == ["addmm_1 … addmm_5 ×5", "tanh_1 … tanh_5 ×5"]
    assert 'label="block (Sequential) ×5"' in rolled and 'label="block.0 (Linear) ×5"' in rolled
    assert '<root> (Repeat)"' in rolled  # called once
    edges = _edges(rolled)
    assert 'op2 -> op1 [label="×4" fontsize=9 style=dashed constraint=false]' in edges  # tanh -> next addmm
    assert 'op1 -> op2 [label="×5" fontsize=9]' in edges


@pytest.mark.needs("dot")
def test_rolled_draw_renders(tmp_path) -> None:  # noqa: ANN001 - pytest fixture
    with torch.no_grad():
        trace = tl.trace(LoopRNN(), torch.randn(3, 4, 5))
    path = trace.draw(tmp_path / "rnn.svg", rolled=True)
    svg = open(path, encoding="utf-8").read()
    assert "<svg" in svg and "×4" in svg and "tanh_1 … tanh_4" in svg


def test_rolled_must_be_a_bool() -> None:
    with torch.no_grad():
        trace = tl.trace(LoopRNN(), torch.randn(3, 4, 5))
    with pytest.raises(ValueError, match="rolled must be a bool"):
        graph_source(trace, rolled="yes")
