"""The model zoo (tests/zoo.py) through tl.trace, with grad enabled and under no_grad.

For every model: the traced output equals a plain forward's; every call of every leaf module has the output a
forward hook sees in a plain run; the summed op FLOPs equal FlopCounterMode's total; validate() passes; the
model (parameters, buffers, hooks, global hooks, dispatch-mode stack) is left as a plain forward leaves it;
selectors pick the hand-computed ops; and in grad mode, backward through the traced output gives the plain
run's gradients.
"""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode
from zoo import ZOO, Entry

import tl_dist as tl
from tl_dist._opinfo import EXTRA_FLOP_FORMULAS

_OWN_FORMULAS = {packet.__name__ for packet in EXTRA_FLOP_FORMULAS}

MODES = ("grad", "no_grad")
CASES = [pytest.param(entry, mode, id=f"{entry.name}-{mode}") for entry in ZOO for mode in MODES]

_MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_GLOBAL_HOOK_DICTS = tuple(
    name
    for name in (
        "_global_forward_hooks",
        "_global_forward_hooks_always_called",
        "_global_forward_hooks_with_kwargs",
        "_global_forward_pre_hooks",
        "_global_backward_hooks",
        "_global_backward_pre_hooks",
        "_global_module_registration_hooks",
        "_global_parameter_registration_hooks",
        "_global_buffer_registration_hooks",
    )
    if hasattr(nn_module, name)
)


def _hook_state(model: nn.Module) -> tuple:
    per_module = {
        name: tuple(tuple(getattr(m, d, {}).keys()) for d in _MODULE_HOOK_DICTS)
        for name, m in model.named_modules()
    }
    global_hooks = tuple(tuple(getattr(nn_module, d).keys()) for d in _GLOBAL_HOOK_DICTS)
    return per_module, global_hooks, len(_get_current_dispatch_mode_stack()), tuple(warnings.filters)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def _leaves(value: Any) -> list:
    return tree_flatten(value)[0]


def _assert_same(actual: Any, expected: Any, what: str) -> None:
    a, spec_a = tree_flatten(actual)
    e, spec_e = tree_flatten(expected)
    assert spec_a == spec_e, f"{what}: structure {spec_a} != {spec_e}"
    for i, (x, y) in enumerate(zip(a, e)):
        if isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor), f"{what}[{i}]: {x!r} is not a tensor"
            assert torch.equal(x.detach(), y.detach()), f"{what}[{i}] differs by {(x - y).abs().max()}"
        else:
            assert x == y, f"{what}[{i}]: {x!r} != {y!r}"


@dataclass
class Run:
    entry: Entry
    grad: bool
    model: nn.Module  # the traced copy
    plain_model: nn.Module
    args: tuple
    kwargs: dict
    trace: tl.Trace
    plain_out: Any
    leaf_outs: dict[str, list]
    leaf_calls: dict[str, int]
    plain_flops: int
    state_before: dict[str, torch.Tensor]
    hooks_before: tuple


@cache
def _run(name: str, mode: str) -> Run:
    entry = next(e for e in ZOO if e.name == name)
    torch.manual_seed(0)
    model, args, kwargs = entry.build()
    grad = mode == "grad"
    plain_model, flop_model, traced = (copy.deepcopy(model) for _ in range(3))
    state_before = _state(traced)
    hooks_before = _hook_state(traced)

    leaf_outs: dict[str, list] = defaultdict(list)
    leaves = {id(m): a for a, m in plain_model.named_modules() if next(m.children(), None) is None}

    def hook(mod: nn.Module, inp: Any, out: Any) -> None:
        addr = leaves.get(id(mod))
        if addr is not None:
            leaf_outs[addr].append(tree_map(lambda t: t.detach().clone() if torch.is_tensor(t) else t, out))

    # A global hook, as the capture uses: per-module hooks would turn off fast paths (TransformerEncoderLayer
    # skips its fused kernel when any submodule has forward hooks), so the runs would differ.
    handle = nn_module.register_module_forward_hook(hook)
    try:
        with torch.set_grad_enabled(grad):
            plain_out = plain_model(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    finally:
        handle.remove()
    with (
        torch.set_grad_enabled(grad),
        FlopCounterMode(display=False) as counter,
    ):
        flop_model(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    with torch.set_grad_enabled(grad):
        trace = tl.trace(traced, copy.deepcopy(args), kwargs=copy.deepcopy(kwargs))
    leaf_calls = {a: len(v) for a, v in leaf_outs.items()}
    return Run(
        entry,
        grad,
        traced,
        plain_model,
        args,
        kwargs,
        trace,
        plain_out,
        dict(leaf_outs),
        leaf_calls,
        counter.get_total_flops(),
        state_before,
        hooks_before,
    )


def test_zoo_is_big_enough():
    assert len(ZOO) >= 15
    assert len({e.name for e in ZOO}) == len(ZOO)


@pytest.mark.parametrize("entry, mode", CASES)
def test_output_matches_plain_forward(entry, mode):
    run = _run(entry.name, mode)
    _assert_same(run.trace.output, run.plain_out, f"{entry.name} output")
    assert len(run.trace) > 0


@pytest.mark.parametrize("entry, mode", CASES)
def test_leaf_module_outputs_match_forward_hooks(entry, mode):
    run = _run(entry.name, mode)
    traced_leaves = {a for a, m in run.model.named_modules() if next(m.children(), None) is None}
    for addr in traced_leaves:
        calls = run.trace.module_calls(addr)
        expected = run.leaf_outs.get(addr, [])
        assert len(calls) == len(expected), f"{addr}: {len(calls)} traced calls, {len(expected)} plain"
        for i, (call, out) in enumerate(zip(calls, expected)):
            assert call.call == i
            _assert_same(call.out, out, f"{entry.name} {addr!r} call {i}")


@pytest.mark.parametrize("entry, mode", CASES)
def test_flops_match_flop_counter(entry, mode):
    # FlopCounterMode with torch's own registry only: the ops tl_dist adds formulas for (CPU attention) count 0
    # there and are checked against hand-computed numbers instead (test_cpu_sdpa_flops_are_counted,
    # test_opinfo.py).
    run = _run(entry.name, mode)
    columns = run.trace.columns
    counted = sum(f for f, func in zip(columns["flops"], columns["func"]) if func not in _OWN_FORMULAS)
    assert counted == run.plain_flops


@pytest.mark.parametrize("entry, mode", CASES)
def test_validate_passes(entry, mode):
    run = _run(entry.name, mode)
    report = run.trace.validate()
    assert report, str(report)
    assert report.checked > 0
    assert report.checked + report.n_skipped == len(run.trace._replay)
    # Every op with an output was saved (save=True) and so is either replayed or skipped with a reason.
    with_outputs = sum(1 for shapes in run.trace.columns["out_shapes"] if shapes)
    assert len(run.trace._replay) == with_outputs


@pytest.mark.parametrize("entry, mode", CASES)
def test_model_left_as_a_plain_forward_leaves_it(entry, mode):
    run = _run(entry.name, mode)
    assert _hook_state(run.model) == run.hooks_before
    assert not _get_current_dispatch_mode_stack()
    traced_state = _state(run.model)
    plain_state = _state(run.plain_model)
    assert traced_state.keys() == plain_state.keys() == run.state_before.keys()
    for key, value in traced_state.items():
        # A forward may update buffers (Buffers.steps); tracing must update them exactly as a plain run does.
        assert torch.equal(value, plain_state[key]), key
    changed = {k for k, v in traced_state.items() if not torch.equal(v, run.state_before[k])}
    assert changed == ({"steps"} if entry.name == "buffers" else set())
    for name, t in run.model.state_dict(keep_vars=True).items():
        assert not hasattr(t, "_tl_src"), f"{name} still carries the capture's tag"


@pytest.mark.parametrize("entry, mode", CASES)
def test_selectors_pick_expected_ops(entry, mode):
    run = _run(entry.name, mode)
    selections = entry.selections
    if mode == "no_grad" and entry.selections_no_grad is not None:
        selections = entry.selections_no_grad
    checks = selections()
    assert checks, f"{entry.name} has no selector expectations"
    for selector, expected in checks:
        picked = [op.label for op in run.trace.select(selector)]
        if isinstance(expected, int):
            assert len(picked) == expected, f"{selector!r} picked {picked}"
        else:
            assert picked == expected, f"{selector!r} picked {picked}"


@pytest.mark.parametrize("entry", [pytest.param(e, id=e.name) for e in ZOO])
def test_backward_through_traced_output_matches_plain(entry):
    run = _run(entry.name, "grad")
    traced_loss = sum(t.sum() for t in _leaves(run.trace.output) if t.requires_grad)
    plain_loss = sum(t.sum() for t in _leaves(run.plain_out) if t.requires_grad)
    traced_loss.backward(retain_graph=True)
    plain_loss.backward(retain_graph=True)
    plain_params = dict(run.plain_model.named_parameters())
    n = 0
    for name, p in run.model.named_parameters():
        q = plain_params[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
            n += 1
    assert n > 0
    for p in (*run.model.parameters(), *run.plain_model.parameters()):
        p.grad = None


def test_cpu_sdpa_flops_are_counted():
    # torch's registry has no formula for CPU SDPA; tl_dist adds one (EXTRA_FLOP_FORMULAS). NB: the fused eval
    # fast paths (_transformer_encoder_layer_fwd, _native_multi_head_attention) and mkldnn_rnn_layer still
    # count 0, in the trace as in FlopCounterMode.
    run = _run("torch_encoder", "grad")
    op = run.trace["_scaled_dot_product_flash_attention_for_cpu_1"]
    # q, k, v: batch 2, heads 2, length 5, head dim 8 -> QK^T 2*2*2*5*5*8 = 1600, AV another 1600
    assert op.flops == 3200
