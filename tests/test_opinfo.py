"""Static facts tl_dist keeps per operator (tl_dist._opinfo) and the FLOPs it records, against hand-computed
numbers (each formula written out in a comment) -- never against FlopCounterMode fed tl_dist's own formulas."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tl_dist as tl
from tl_dist._opinfo import flop_count, mutated_tensors, op_info

aten = torch.ops.aten


def _flops(fn, *args, grad: bool = False) -> dict[str, int]:
    """label -> FLOPs of every op ``fn(*args)`` runs (and its backward when ``grad``), traced with tl.Capture."""
    with torch.set_grad_enabled(grad), tl.Capture() as cap:
        out = fn(*args)
        if grad:
            out.sum().backward()
    return {op.label: op.flops for op in cap.trace}


def test_matmul_flops_by_hand():
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    c, d = torch.randn(2, 5), torch.randn(5, 4)
    # mm (m, k) @ (k, n): 2 * m * k * n; the second shape must not reuse the first one's memoised count
    assert _flops(lambda: (a @ b, c @ d, a @ b)) == {"mm_1": 2 * 2 * 3 * 4, "mm_2": 2 * 2 * 5 * 4, "mm_3": 48}
    bias = torch.randn(4)
    # addmm counts its matmul only: 2 * 2 * 3 * 4
    assert _flops(torch.addmm, bias, a, b) == {"addmm_1": 48}
    # bmm (batch, m, k) @ (batch, k, n): 2 * batch * m * k * n
    assert _flops(torch.bmm, torch.randn(3, 2, 5), torch.randn(3, 5, 7)) == {"bmm_1": 2 * 3 * 2 * 5 * 7}


def test_convolution_flops_depend_on_stride():
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    # 2 * N * out_h * out_w * C_out * C_in * kh * kw: stride 1 -> 3x3 output, stride 2 -> 2x2 (same shapes in,
    # so the memo key must include the stride)
    flops = _flops(lambda: (F.conv2d(x, w, stride=1), F.conv2d(x, w, stride=2)))
    assert flops == {"convolution_1": 2 * 1 * 9 * 3 * 2 * 9, "convolution_2": 2 * 1 * 4 * 3 * 2 * 9}


def test_convolution_flops_tell_a_transposed_convolution_by_its_flag():
    # aten.convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups): the same
    # shapes in, only the `transposed` flag differs, so the memo key must include the non-tensor arguments.
    # 2 * N * C_out * C_in/groups * kh * kw * (outputs of a convolution, inputs of a transposed one):
    # conv2d 5x5 -> 3x3, 9 positions; conv_transpose2d spreads each of the 25 inputs.
    x, w = torch.randn(1, 2, 5, 5), torch.randn(2, 2, 3, 3)
    flops = _flops(lambda: (F.conv2d(x, w), F.conv_transpose2d(x, w)))
    assert flops == {"convolution_1": 2 * 1 * 2 * 2 * 9 * 9, "convolution_2": 2 * 1 * 2 * 2 * 9 * 25}


def test_ops_without_a_formula_count_zero():
    x = torch.randn(4, 4)
    assert _flops(lambda: (x.relu(), x + 1, x.t())) == {"relu_1": 0, "add_1": 0, "t_1": 0}


def test_cpu_sdpa_forward_and_backward_flops_by_hand():
    # torch's registry has formulas only for the GPU attention kernels; tl_dist adds the CPU flash kernels.
    b, h, lq, s, e = 2, 3, 4, 6, 8
    q = torch.randn(b, h, lq, e, requires_grad=True)
    k = torch.randn(b, h, s, e, requires_grad=True)
    v = torch.randn(b, h, s, e, requires_grad=True)
    flops = _flops(F.scaled_dot_product_attention, q, k, v, grad=True)
    fwd = "_scaled_dot_product_flash_attention_for_cpu_1"
    bwd = "_scaled_dot_product_flash_attention_for_cpu_backward_1"
    # forward: scores Q K^T (2*b*h*lq*s*e) and scores @ V (2*b*h*lq*s*e): 4 * b*h*lq*s*e = 4608
    assert flops[fwd] == 4 * b * h * lq * s * e == 4608
    # backward: recompute Q K^T, dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q: 5 x 2*b*h*lq*s*e = 11520
    assert flops[bwd] == 10 * b * h * lq * s * e == 11520
    assert sum(flops.values()) == flops[fwd] + flops[bwd]  # nothing else in the graph multiplies


def test_flop_count_memo_is_per_signature():
    info = op_info(aten.mm.default)
    a, b, c = torch.randn(2, 3), torch.randn(3, 4), torch.randn(3, 6)
    assert flop_count(info, (a, b), {}, a @ b) == 48
    assert flop_count(info, (a, c), {}, a @ c) == 2 * 2 * 3 * 6
    conv = op_info(aten.convolution.default)
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    args = (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    assert flop_count(conv, args, {}, F.conv2d(x, w)) == 972
    strided = (x, w, None, [2, 2], [0, 0], [1, 1], False, [0, 0], 1)
    assert flop_count(conv, strided, {}, F.conv2d(x, w, stride=2)) == 432


def test_formula_reading_tensor_values_is_not_memoised_on_shapes():
    # Varlen flash attention (GPU kernels; the formula runs anywhere): 10 tokens of 2 heads x 8 dims in two
    # sequences. The cumulative lengths have the same shape every batch, their values decide the count.
    info = op_info(aten._flash_attention_forward.default)
    q = k = v = torch.randn(10, 2, 8)

    def count(offsets: list[int]) -> int:
        cum = torch.tensor(offsets)
        return flop_count(info, (q, k, v, cum, cum, 8, 8, 0.0, False, False), {}, None)

    # per sequence of length n: 4 * heads * n * n * dims; lengths 5 + 5, then 2 + 8
    assert count([0, 5, 10]) == 2 * (4 * 2 * 5 * 5 * 8) == 3200
    assert count([0, 2, 10]) == 4 * 2 * 8 * (2 * 2 + 8 * 8) == 4352


def test_unhashable_argument_is_counted_without_the_memo():
    info = op_info(aten.mm.default)
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    # a keyword holding a list of lists cannot be part of the memo key; the formula ignores it
    assert flop_count(info, (a, b), {"unused": [[1, 2]]}, a @ b) == 48
    assert flop_count(info, (a, b), {"unused": {"x": 1}}, a @ b) == 48
    # The convolution formula reads the output's shape: handed on without the memo too. 3x3 output positions:
    # 2 * N * C_out * C_in * kh * kw * 9.
    conv = op_info(aten.convolution.default)
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    args = (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    assert flop_count(conv, args, {"unused": [[1]]}, F.conv2d(x, w)) == 2 * 1 * 3 * 2 * 9 * 9


@pytest.mark.parametrize(
    "op, func, kind",
    [
        (aten.relu.default, "relu", "compute"),
        (aten.relu_.default, "relu_", "compute"),
        (aten.view.default, "view", "view"),
        (aten.t.default, "t", "view"),
        (torch.ops.c10d.allreduce_.default, "all_reduce", "collective"),
        (torch.ops._c10d_functional.all_reduce.default, "all_reduce", "collective"),
        (torch.ops._c10d_functional.wait_tensor.default, "wait_tensor", "compute"),
    ],
)
def test_op_names_and_kinds(op, func, kind):
    info = op_info(op)
    assert (info.func, info.kind, info.counter_key, info.aten) == (func, kind, func, str(op))
    assert op_info(op) is info  # cached: one OpInfo per overload


def test_operators_that_are_not_overloads():
    # A higher-order operator (torch.cond) has no overload packet, schema or tags: named by its __name__, in its
    # own namespace, writing nothing, seeded by nothing.
    cond = op_info(torch.ops.higher_order.cond)
    assert (cond.func, cond.namespace, cond.kind, cond.mutated, cond.nondeterministic) == (
        "cond",
        "higher_order",
        "compute",
        (),
        False,
    )
    assert cond.flop_fn is None

    # A plain Python callable: its __name__, not the repr of the function object (what str() gives).
    def scale_rows(x):
        return x

    info = op_info(scale_rows)
    assert (info.func, info.namespace, info.kind, info.mutated) == ("scale_rows", "", "compute", ())
    assert info.aten == str(scale_rows) != info.func
    # A callable without a __name__ (a functools.partial) is named by what str() says of it.
    unnamed = functools.partial(scale_rows)
    assert op_info(unnamed).func == str(unnamed)


def test_written_arguments_come_from_the_schema():
    # (position, name) of each argument the schema marks as written (Tensor(a!))
    assert op_info(aten.relu.default).mutated == ()
    assert op_info(aten.relu_.default).mutated == ((0, "self"),)
    assert op_info(aten.add.out).mutated == ((3, "out"),)  # add.out(self, other, *, alpha, out)
    assert op_info(aten._foreach_add_.Scalar).mutated == ((0, "self"),)
    assert op_info(torch.ops.c10d.allreduce_.default).mutated == ((0, "tensors"),)
    assert op_info(aten.bernoulli_.float).nondeterministic and not op_info(aten.relu.default).nondeterministic


def test_mutated_tensors_finds_positional_keyword_and_listed_tensors():
    x, y, out = torch.ones(2), torch.ones(2), torch.empty(2)
    assert mutated_tensors(op_info(aten.relu_.default), (x,), {}) == [x]
    assert mutated_tensors(op_info(aten.relu.default), (x,), {}) == []
    # add.out's out is keyword-only: found by name
    (found,) = mutated_tensors(op_info(aten.add.out), (x, y), {"alpha": 1, "out": out})
    assert found is out
    # _foreach_add_ writes into every tensor of its list argument
    got = mutated_tensors(op_info(aten._foreach_add_.Scalar), ([x, y], 1.0), {})
    assert len(got) == 2 and got[0] is x and got[1] is y
    assert mutated_tensors(op_info(aten.add.out), (x, y), {}) == []  # no out given


def test_traced_flops_of_a_small_model_by_hand():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        trace = tl.trace(model, torch.randn(5, 4))
    # addmm (5x4 @ 4x8): 2*5*4*8 = 320; addmm (5x8 @ 8x3): 2*5*8*3 = 240; t and relu count nothing
    assert {op.label: op.flops for op in trace} == {
        "t_1": 0,
        "addmm_1": 320,
        "relu_1": 0,
        "t_2": 0,
        "addmm_2": 240,
    }
