"""trace.replay() / fork().do(...).replay() / .rerun(model, x): the recorded graph re-executed without the model's
code, against the model run again (plain PyTorch, or tl.trace with the same edits).

An unedited replay must reproduce every recorded value bit for bit (the same kernels on the same inputs); a
replay with edits must equal a rerun with them where the model has no data-dependent control flow; where it
has, or draws random numbers, the replay says which op instead of guessing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from zoo import UNINITIALIZED_FUNCS, ZOO, Buffers, DataBranch, InPlace, LoopRNN, ResCNN, TorchEncoder

import tl_dist as tl

# (func, output): scratch memory a kernel returns, partly unwritten (oneDNN's LSTM workspace for backward).
_SCRATCH = {("mkldnn_rnn_layer", 3)}


def _same(a: Any, b: Any) -> bool:
    la, lb = tree_flatten(a)[0], tree_flatten(b)[0]
    return len(la) == len(lb) and all(
        torch.equal(x.detach(), y.detach()) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


@pytest.mark.parametrize("mode", ["grad", "no_grad"])
@pytest.mark.parametrize("entry", ZOO, ids=[e.name for e in ZOO])
def test_unedited_replay_reproduces_every_value(entry: Any, mode: str) -> None:
    model, args, kwargs = entry.build()
    with torch.set_grad_enabled(mode == "grad"):
        trace = tl.trace(model, args, kwargs=kwargs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    replayed = trace.replay()
    assert replayed.metadata["not_replayed"] == {}
    assert _same(replayed.output, trace.output)
    cols = trace.columns
    compared = 0
    for i, outs in trace.saved.items():
        if cols["phase"][i] != "forward" or cols["func"][i] in UNINITIALIZED_FUNCS:
            continue
        for pos, (want, got) in enumerate(zip(outs, replayed.saved[i])):
            if want is not None and (cols["func"][i], pos) not in _SCRATCH:
                assert torch.equal(got, want), f"{entry.name}: {cols['label'][i]} replayed differently"
                compared += 1
    assert compared >= len(trace.saved) // 2
    # Nothing written into the model (Buffers' step counter add_, InPlace's writes replay into copies).
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _rescnn() -> tuple[nn.Module, torch.Tensor]:
    return ResCNN().eval(), torch.randn(2, 3, 8, 8)


def _encoder() -> tuple[nn.Module, torch.Tensor]:
    return TorchEncoder().eval(), torch.randn(2, 5, 16)


def _loop() -> tuple[nn.Module, torch.Tensor]:
    return LoopRNN(), torch.randn(3, 4, 5)


def _inplace() -> tuple[nn.Module, torch.Tensor]:
    return InPlace(), torch.randn(3, 6)


CASES = [
    # (model, grad mode, site, edit)
    (_rescnn, False, "relu_1", lambda: tl.scale(0.5)),
    (_rescnn, False, tl.module("blocks.0"), lambda: tl.add_noise(0.2, seed=3)),
    (_rescnn, False, tl.func("relu") & tl.in_module("blocks.1"), lambda: tl.zero_ablate()),
    (_encoder, True, "relu_1", lambda: lambda value, op: value.clamp(max=0.1)),
    (_encoder, False, tl.module("layer"), lambda: tl.mean_ablate(dims=(0, 1))),  # the fused no_grad layer
    (_loop, True, tl.module("rec"), lambda: tl.scale(-1.0)),  # four calls; the recurrence carries each edit
    (_loop, False, "tanh_2", lambda: tl.mask([1])),
    (_inplace, False, "relu__1", lambda: tl.scale(3.0)),  # written in place: the aliases see it
]


@pytest.mark.parametrize("build, grad, site, make", CASES)
def test_replay_with_an_edit_equals_rerun(build: Any, grad: bool, site: Any, make: Any) -> None:
    torch.manual_seed(0)
    model, x = build()
    with torch.set_grad_enabled(grad):
        trace = tl.trace(model, x)
        fork = trace.fork().do(site, make())
        rerun = fork.rerun(model, x)
        plain = model(x)
    replayed = fork.replay()
    assert replayed.metadata["not_replayed"] == {}
    assert not _same(rerun.output, plain)  # the edit did something
    assert _same(replayed.output, rerun.output)
    assert replayed.edited.keys() == rerun.edited.keys() != set()
    # The whole graph, not only the output: every op the rerun recorded, the replay computed alike -- except ops
    # that in the rerun ran between an op and its edit (under autograd, the edit takes effect when the torch
    # call returns; autograd's own detach of relu's result reads the unedited value), which a replay edits.
    diff = tl.compare(rerun, replayed, atol=0, rtol=0)
    assert set(diff[diff.differs].label) <= _read_before_edit(rerun)


def _read_before_edit(trace: tl.Trace) -> set[str]:
    at = {trace.labels[lab]: n for lab, n in trace.metadata["edits_applied_at"].items()}
    cols = trace.columns
    return {cols["label"][j] for j in range(len(trace)) if any(at.get(p, 0) > j for p in cols["parents"][j])}


def test_replay_keeps_a_traces_own_edits() -> None:
    torch.manual_seed(0)
    model, x = _rescnn()
    with torch.no_grad():
        edited = tl.trace(model, x, intervene=tl.when(tl.label("relu_1"), tl.scale(0.5)))
    again = edited.replay()
    assert _same(again.output, edited.output)
    assert again.edited == {"relu_1": "tl.scale(0.5)"}
    # A replayed trace can be forked and replayed again: its records are the original's.
    twice = again.fork().do("relu_1", tl.scale(2.0)).replay()
    assert _same(twice.output, tl.trace(model, x).output)  # 0.5 then 2.0: the unedited values (exact in fp)


def test_data_dependent_branch_is_reported_not_guessed() -> None:
    model = DataBranch()
    x = torch.ones(2, 4)
    with torch.no_grad():
        trace = tl.trace(model, x)
        fork = trace.fork().do("sum_1", tl.scale(-1.0))  # flips `if x.sum() > 0`
        rerun = fork.rerun(model, x)
    replayed = fork.replay()
    # bool(x.sum() > 0) is aten._local_scalar_dense on the comparison: the host read of the branch.
    assert list(replayed.metadata["not_replayed"]) == ["_local_scalar_dense_1"]
    assert "another path" in replayed.metadata["not_replayed"]["_local_scalar_dense_1"]
    assert "neg.0" in set(rerun.columns["module"]) and "neg.0" not in set(trace.columns["module"])
    # Unedited, or edited downstream of the branch only, the replay is exact and reports nothing.
    assert trace.replay().metadata["not_replayed"] == {}
    assert trace.fork().do("relu_1", tl.scale(2.0)).replay().metadata["not_replayed"] == {}


def test_random_ops_are_reported_and_their_recorded_values_reused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train()
    x = torch.ones(2, 4)
    trace = tl.trace(model, x)
    replayed = trace.replay()
    assert replayed.metadata["not_replayed"] == {"bernoulli__1": "random op: its recorded output is reused"}
    assert torch.equal(replayed.output, trace.output)
    # With the random op (eval mode) switched off by p=0-style arguments, nothing is reported.
    with torch.no_grad():
        attention = tl.trace(TorchEncoder().eval().requires_grad_(False), torch.randn(2, 5, 16))
    assert attention.replay().metadata["not_replayed"] == {}


@pytest.mark.parametrize("save", [None, tl.func("relu")])
def test_replay_needs_every_output_saved(save: Any) -> None:
    model, x = _rescnn()
    with torch.no_grad():
        trace = tl.trace(model, x, save=save)
    with pytest.raises(tl.TlDistError, match="replay needs every forward op's inputs.*save=True"):
        trace.replay()


def test_buffers_written_in_place_are_not_touched() -> None:
    model = Buffers()
    trace = tl.trace(model, torch.randn(2, 6))
    assert int(model.steps) == 1
    replayed = trace.fork().do(tl.module("fc"), tl.scale(2.0)).replay()
    assert int(model.steps) == 1
    assert torch.equal(replayed.output, trace.output * 2.0)


def test_fork_sites() -> None:
    torch.manual_seed(0)
    model, x = _rescnn()
    with torch.no_grad():
        trace = tl.trace(model, x)
    by_label = trace.fork().do("relu_1", tl.zero_ablate()).replay()
    by_index = trace.fork().do(trace["relu_1"].index, tl.zero_ablate()).replay()
    assert _same(by_label.output, by_index.output)
    # A causal selector is resolved against the trace: every relu after the blocks' first conv.
    fork = trace.fork().do(tl.downstream(tl.label("convolution_2")) & tl.func("relu"), tl.scale(0.0))
    assert [repr(w.selector) for w in fork.interventions] == [
        "tl.label('relu__1', 'relu__2', 'relu__3', 'relu__4')"
    ]
    with torch.no_grad():
        assert _same(fork.replay().output, fork.rerun(model, x).output)
    with pytest.raises(KeyError, match="did you mean relu_1"):
        trace.fork().do("relu_9", tl.zero_ablate())
    with pytest.raises(ValueError, match="site must be an op label"):
        trace.fork().do(1.5, tl.zero_ablate())
    with pytest.raises(ValueError, match="matches no op"):
        trace.fork().do(tl.upstream(tl.label("convolution_1")), tl.zero_ablate())


class AliasRead(nn.Module):
    """Reads a view taken before an in-place write into its base: the view sees the write."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        v = y.view(-1)  # taken before the write
        y.relu_()
        return v * 2 + 1


def test_replay_follows_a_view_read_after_an_in_place_write() -> None:
    torch.manual_seed(0)
    model, x = AliasRead(), torch.randn(2, 4)
    with torch.no_grad():
        trace = tl.trace(model, x)
        # The write's input changes, and so the view's value.
        fork = trace.fork().do(tl.module("fc"), tl.add(-0.5))
        rerun = fork.rerun(model, x)
    replayed = fork.replay()
    with torch.no_grad():  # by hand: relu(fc(x) - 0.5) * 2 + 1, flattened
        want = (torch.relu(model.fc(x) - 0.5) * 2 + 1).view(-1)
    assert torch.equal(rerun.output, want) and torch.equal(replayed.output, want)
    assert replayed.metadata["not_replayed"] == {}
