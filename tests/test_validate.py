"""trace.validate(): replaying saved ops from their parents' saved outputs; skips, mismatches, side effects."""

import math
import re

import pytest
import torch
from torch import nn

import tl_dist as tl
from tl_dist.validate import ValidationReport, validate


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class WriteThroughView(nn.Module):
    def forward(self, x):
        y = x.clone()
        y[:, 0] = 0.0  # fill_ on a select view of y
        return y * 2  # reads y: must depend on the fill_, not on clone's (pre-write) value


class CountingBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        self.calls.add_(1)
        y = self.fc(x)
        y.relu_()  # an in-place write into an op's saved output
        return y + self.calls


@pytest.fixture
def net():
    return Net(), torch.randn(5, 4)


def _trace(model, x, **kwargs):
    # no_grad: with grad enabled autograd adds detach ops (relu saves its output), changing the op lists below
    with torch.no_grad():
        return tl.trace(model, x, **kwargs)


def test_clean_trace_passes_and_counts(net):
    model, x = net
    trace = _trace(model, x)
    report = trace.validate()
    assert isinstance(report, ValidationReport)
    assert report and report.passed
    # t, addmm (fc1), relu, t, addmm (fc2): every op saved, none skipped
    assert [op.func for op in trace] == ["t", "addmm", "relu", "t", "addmm"]
    assert (report.checked, report.n_skipped, report.n_mismatched) == (5, 0, 0)
    assert str(report).startswith("validation passed: 5 ops replayed, 0 mismatched, 0 skipped")


def test_tampered_saved_output_is_reported_with_label_and_difference(net):
    model, x = net
    trace = _trace(model, x)
    relu = trace["relu_1"]
    trace.saved[relu.index][0] = relu.out + 0.25  # relu_1 no longer matches its replay from addmm_1
    report = trace.validate()
    assert not report
    # relu_1 itself differs by 0.25; addmm_2 replayed from the tampered relu_1 differs from its saved output
    assert [m.label for m in report.mismatches] == ["relu_1", "addmm_2"]
    assert report.mismatches[0].max_abs_diff == pytest.approx(0.25)
    assert report.mismatches[1].max_abs_diff > 0
    text = str(report)
    assert "FAILED" in text and "mismatch relu_1: max abs diff 0.25" in text
    with pytest.raises(
        tl.ValidationError, match=r"output: relu_1 \(max abs diff 0.25\), addmm_2 \(max abs diff"
    ):
        trace.validate(raise_on_mismatch=True)


def test_tolerances_decide_what_counts_as_a_mismatch(net):
    model, x = net
    trace = _trace(model, x)
    relu = trace["relu_1"]
    trace.saved[relu.index][0] = relu.out * (1 + 1e-7)  # a relative error far inside rtol=1e-5
    assert trace.validate()  # defaults atol=1e-6, rtol=1e-5
    strict = trace.validate(atol=0.0, rtol=0.0)
    assert not strict and strict.mismatches[0].label == "relu_1"
    assert 0 < strict.mismatches[0].max_abs_diff < 1e-6


def test_shape_change_is_a_mismatch(net):
    model, x = net
    trace = _trace(model, x)
    trace.saved[trace["relu_1"].index][0] = torch.zeros(2, 2)
    report = trace.validate()
    first = report.mismatches[0]
    assert first.label == "relu_1" and math.isinf(first.max_abs_diff) and "shape" in first.detail


def test_skips_name_their_reason():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.ReLU()).train()
    x = torch.randn(3, 4)
    with torch.no_grad():
        trace = _trace(model, x)
    # CPU dropout: mask = empty_like(x).bernoulli_(1 - p).div_(1 - p); x * mask
    assert [op.label for op in trace] == [
        *("t_1", "addmm_1", "empty_like_1", "bernoulli__1", "div__1", "mul_1", "relu_1")
    ]
    report = trace.validate()
    assert report.skipped == {
        "empty_like_1": "returns uninitialised memory",
        "bernoulli__1": "nondeterministic op (random numbers)",
    }
    # div_ replays from bernoulli_'s saved mask, so everything downstream of the random draw is still checked
    assert report.checked == 5 and report

    with torch.no_grad():
        partial = tl.trace(model.eval(), x, save=tl.func("relu"))
    report = partial.validate()
    # in eval mode dropout runs no op: relu reads addmm_1, whose output was not saved
    assert report.skipped == {"relu_1": "input from addmm_1 (output 0) was not saved"}
    # nothing was replayed: the report does not pass, and says so
    assert report.checked == 0 and not report
    assert str(report).startswith("validation checked nothing (every op skipped): 0 ops replayed")


def test_uninitialised_memory_is_skipped():
    class Empty(nn.Module):
        def forward(self, x):
            buf = torch.empty(3, 3)
            buf.copy_(x)
            return buf + 1

    with torch.no_grad():
        trace = tl.trace(Empty(), torch.randn(3, 3))
    assert [op.label for op in trace] == ["empty_1", "copy__1", "add_1"]
    report = trace.validate()
    assert report.skipped == {"empty_1": "returns uninitialised memory"}
    # copy_ reads empty_1's saved (uninitialised) value but overwrites all of it, so it still replays exactly
    assert report.checked == 2 and report


def test_write_through_view_is_a_dependency():
    x = torch.randn(3, 4)
    trace = tl.trace(WriteThroughView(), x)
    fill, mul = trace["fill__1"], trace["mul_1"]
    # fill_ returns the view and lists y (its base) as a second output: mul reads that one
    assert fill.out_shapes == (torch.Size([3]), torch.Size([3, 4]))
    assert mul.parents == (fill.index,)
    expected = x.clone()
    expected[:, 0] = 0
    assert torch.equal(trace.saved[fill.index][1], expected)
    assert torch.equal(trace["clone_1"].out, x)  # the pre-write value stays what clone produced
    report = trace.validate()
    assert report and report.checked == 5, str(report)


def test_replay_changes_neither_model_nor_saved_tensors():
    model = CountingBuffer()
    x = torch.randn(2, 3)
    trace = _trace(model, x)
    assert model.calls.item() == 1
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_saved = {i: [t.clone() for t in outs] for i, outs in trace.saved.items()}
    report = trace.validate()
    # add__1 wrote into the buffer: its replay must start from the value before the write (0 -> 1)
    assert report and report.checked == len(trace), str(report)
    assert trace["add__1"].params == ("calls",)
    assert model.calls.item() == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_state[k]), k
    for i, outs in trace.saved.items():
        for a, b in zip(outs, before_saved[i]):
            assert torch.equal(a, b), trace[i].label
    assert not hasattr(model.calls, "_tl_src")
    # the replays wrote into copies: replaying again starts from the same values and passes again
    again = trace.validate()
    assert again and again.checked == len(trace), str(again)


def test_lstm_workspace_left_undefined_by_the_replay_is_not_compared():
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4)
    trace = tl.trace(lstm, torch.randn(5, 2, 3))  # grad enabled: the kernel also fills its workspace
    rnn = trace["mkldnn_rnn_layer_1"]
    assert len(rnn.out_shapes) == len(trace.saved[rnn.index]) == 4
    report = trace.validate()  # the no_grad replay returns the workspace undefined (None)
    assert report and report.checked == len(trace), str(report)
    # the three defined outputs are still compared
    trace.saved[rnn.index][1] = trace.saved[rnn.index][1] + 1.0
    assert [m.label for m in trace.validate().mismatches][:1] == ["mkldnn_rnn_layer_1"]


def test_replay_runs_without_grad(net):
    model, x = net
    trace = _trace(model, x)
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(torch.is_grad_enabled())
            return func(*args, **(kwargs or {}))

    with Spy():
        assert trace.validate()
    assert seen and not any(seen)


def test_bad_tolerances_name_the_argument(net):
    model, x = net
    trace = _trace(model, x)
    for bad in (-1.0, "0.1", True, None):
        with pytest.raises(
            ValueError, match=rf"^atol must be a non-negative number, got {re.escape(repr(bad))}$"
        ):
            trace.validate(atol=bad)
        with pytest.raises(
            ValueError, match=rf"^rtol must be a non-negative number, got {re.escape(repr(bad))}$"
        ):
            trace.validate(rtol=bad)
    assert trace.validate(atol=0, rtol=0)  # zero is allowed, ints too


def test_validate_function_reports_by_default_and_raises_on_request(net):
    model, x = net
    trace = _trace(model, x)
    relu = trace["relu_1"]
    trace.saved[relu.index][0] = relu.out + 1.0
    report = validate(trace)  # the module-level function, with its own defaults
    assert not report and [m.label for m in report.mismatches] == ["relu_1", "addmm_2"]
    with pytest.raises(
        tl.ValidationError, match=r"^2 of 5 replayed ops did not reproduce their saved output: "
    ):
        validate(trace, raise_on_mismatch=True)


def test_op_whose_output_was_dropped_is_skipped(net):
    model, x = net
    trace = _trace(model, x)
    del trace.saved[trace["relu_1"].index]  # e.g. freed by the user to save memory
    report = trace.validate()
    assert report.skipped == {
        "relu_1": "own output not saved",
        "addmm_2": "input from relu_1 (output 0) was not saved",
    }
    assert report.checked == 3 and report


class StaleAlias(nn.Module):
    def forward(self, x):
        y = x.clone()
        v = y.view(12)  # an alias taken before the write
        y.relu_()
        return v * 2  # reads the written memory through v, whose tag still points at view_1


def test_alias_taken_before_an_inplace_write_depends_on_the_write():
    with torch.no_grad():
        trace = tl.trace(StaleAlias(), torch.randn(3, 4))
    assert trace["relu__1"].index in trace["mul_1"].parents
    assert trace.validate()


def test_offset_alias_and_parameter_written_in_place_depend_on_the_write():
    class Offsets(nn.Module):
        def forward(self, x):
            y = x.clone()
            _, bottom = y.chunk(2)  # a view 6 elements into y's storage, taken before the write
            y.mul_(2)
            return bottom + 1

    with torch.no_grad():
        trace = tl.trace(Offsets(), torch.randn(4, 3))
    assert trace["mul__1"].index in trace["add_1"].parents
    assert trace.validate()

    lin = nn.Linear(3, 2)
    with torch.no_grad(), tl.capture() as cap:
        lin.weight.add_(1)  # a parameter updated in place, then read in the same window (two steps in one)
        lin(torch.randn(1, 3))
    trace = cap.trace
    assert trace["add__1"].index in trace["t_1"].parents
    assert trace["add__1"].index not in trace["addmm_1"].parents  # the bias was not written


def test_alias_of_written_memory_is_not_linked_to_unrelated_writes():
    class Chunks(nn.Module):
        def forward(self, x):
            a, b = x.clone().chunk(2)  # two views of one storage, disjoint bytes
            a.mul_(2)
            return b + 1, a + 1

    with torch.no_grad():
        trace = tl.trace(Chunks(), torch.randn(4, 3))
    # b's bytes were not written by mul_: b + 1 depends on the split only; a + 1 on the write
    assert trace["add_1"].parents == (trace["split_1"].index,)
    assert trace["mul__1"].index in trace["add_2"].parents
    assert trace.validate()


def test_size_zero_empty_is_checked_not_skipped():
    bn = nn.BatchNorm2d(3).eval()
    with torch.no_grad():
        trace = tl.trace(bn, torch.randn(2, 3, 4, 4))
    # eval BatchNorm on CPU allocates a 0-element reserve tensor with empty(): no bytes, nothing uninitialised
    assert [op.label for op in trace] == ["empty_1", "native_batch_norm_1"]
    assert trace["empty_1"].out_shapes == (torch.Size([0]),)
    report = trace.validate()
    assert report and report.skipped == {} and report.checked == 2


def test_validate_without_replay_information_says_so():
    model = nn.Sequential(nn.Linear(4, 2))
    trace = tl.trace(model, torch.randn(3, 4), save=None)
    message = (
        "validate() has nothing to replay: the trace holds no replay information (it was captured with "
        "save=None, or loaded from a shard). Trace again in this process with save=True or a selector."
    )
    with pytest.raises(tl.TlDistError, match=f"^{re.escape(message)}$"):
        trace.validate()


class Heads(nn.Module):
    """Integer, bool and multi-output ops: max.dim returns (values, int64 indices), layer_norm three tensors."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        y = self.fc(x)
        values, indices = y.max(1)
        return indices + 1, y > 0, values * 2, nn.functional.layer_norm(y, (6,))


@pytest.fixture
def heads():
    torch.manual_seed(0)
    trace = _trace(Heads(), torch.randn(5, 4))
    # t, addmm, max (values, indices), add (indices + 1), gt, mul (values * 2), native_layer_norm (3 outputs)
    assert [op.label for op in trace] == [
        *("t_1", "addmm_1", "max_1", "add_1", "gt_1", "mul_1", "native_layer_norm_1")
    ]
    assert trace.validate()
    return trace


def test_integer_output_is_compared_exactly(heads):
    add = heads["add_1"]
    tampered = add.out.clone()
    tampered[3] += 1  # one index off by one: no tolerance applies to integers
    heads.saved[add.index][0] = tampered
    report = heads.validate(atol=10.0, rtol=10.0)
    assert [(m.label, m.max_abs_diff) for m in report.mismatches] == [("add_1", 1.0)]


def test_bool_output_is_compared_exactly(heads):
    gt = heads["gt_1"]
    tampered = gt.out.clone()
    tampered[0, 0] = ~tampered[0, 0]
    heads.saved[gt.index][0] = tampered
    report = heads.validate(atol=10.0, rtol=10.0)
    assert [(m.label, m.max_abs_diff) for m in report.mismatches] == [("gt_1", 1.0)]


def test_every_output_of_a_multi_output_op_is_compared(heads):
    max_op = heads["max_1"]
    values, indices = heads.saved[max_op.index]
    heads.saved[max_op.index][1] = (
        indices.flip(0) if not torch.equal(indices.flip(0), indices) else indices + 1
    )
    diff = float((heads.saved[max_op.index][1] - indices).abs().max())
    report = heads.validate()
    # max_1's second output (the indices) differs; add_1, replayed from the tampered indices, differs too.
    assert [(m.label, m.max_abs_diff) for m in report.mismatches] == [("max_1", diff), ("add_1", diff)]

    # native_layer_norm's third output (rstd), nobody reads it: only the op itself can notice.
    heads.saved[max_op.index][1] = indices
    norm = heads["native_layer_norm_1"]
    out, mean, rstd = heads.saved[norm.index]
    heads.saved[norm.index][0] = out + 0.5
    heads.saved[norm.index][2] = rstd + 2.0
    report = heads.validate()
    # the largest difference over all outputs is reported, whichever output it is in
    assert [m.label for m in report.mismatches] == ["native_layer_norm_1"]
    assert report.mismatches[0].max_abs_diff == pytest.approx(2.0)
    heads.saved[norm.index][0] = out + 3.0
    assert heads.validate().mismatches[0].max_abs_diff == pytest.approx(3.0)
    # equally bad outputs (both infinitely far): the first one's detail is reported
    heads.saved[norm.index][0] = out[:, :3]
    heads.saved[norm.index][2] = rstd.double()
    assert heads.validate().mismatches[0].detail == "shape (5, 6) != saved (5, 3)"


def test_dtype_change_is_a_mismatch(heads):
    add, mul = heads["add_1"], heads["mul_1"]
    heads.saved[add.index][0] = add.out.to(torch.int32)  # same values, other dtype
    heads.saved[mul.index][0] = mul.out.double()
    report = heads.validate()
    assert [(m.label, m.max_abs_diff, m.detail) for m in report.mismatches] == [
        ("add_1", math.inf, "dtype torch.int64 != saved torch.int32"),
        ("mul_1", math.inf, "dtype torch.float32 != saved torch.float64"),
    ]


def test_extra_saved_output_is_a_mismatch(heads):
    mul = heads["mul_1"]
    heads.saved[mul.index].append(mul.out.clone())  # mul returns one tensor; two are saved
    report = heads.validate()
    assert [(m.label, m.max_abs_diff, m.detail) for m in report.mismatches] == [
        ("mul_1", math.inf, "1 outputs != saved 2")
    ]
    assert report.checked == 7  # the ops after it are still replayed


def test_replay_that_raises_is_reported_not_skipped(net):
    model, x = net
    trace = _trace(model, x)
    trace.saved[trace["relu_1"].index][0] = torch.zeros(5, 7)  # addmm_2 cannot multiply 5x7 by 8x3
    report = trace.validate()
    assert (report.checked, report.n_skipped) == (5, 0)
    assert [(m.label, m.max_abs_diff) for m in report.mismatches] == [
        ("relu_1", math.inf),
        ("addmm_2", math.inf),
    ]
    assert report.mismatches[0].detail == "shape (5, 8) != saved (5, 7)"
    assert report.mismatches[1].detail.startswith("replay raised RuntimeError: mat1 and mat2 shapes")
    assert "mismatch addmm_2: max abs diff inf (replay raised RuntimeError" in str(report)


def test_default_tolerances_are_atol_1e_6_and_rtol_1e_5():
    class Double(nn.Module):
        def forward(self, x):
            return x * 2

    trace = _trace(Double(), torch.tensor([0.0, 500.0]))
    mul = trace["mul_1"]
    assert mul.out.tolist() == [0.0, 1000.0]

    def passes(saved: list[float], **tolerances: float) -> bool:
        trace.saved[mul.index][0] = torch.tensor(saved)
        return bool(trace.validate(**tolerances))

    # |replay - saved| <= atol + rtol * |saved|: at a saved 0 only atol counts; at 1000, rtol * 1000 = 0.01.
    assert passes([0.9e-6, 1000.0]) and not passes([2e-6, 1000.0])
    assert passes([0.0, 1000.009]) and not passes([0.0, 1000.02])
    assert passes([0.5, 1000.0], atol=0.6) and not passes([0.5, 1000.0], atol=0.4)
    assert passes([0.0, 1100.0], rtol=0.1) and not passes([0.0, 1200.0], rtol=0.1)


def test_nan_or_infinity_in_outputs_gives_a_finite_or_infinite_difference_never_nan():
    class Log(nn.Module):
        def forward(self, x):
            return x.log()

    trace = _trace(Log(), torch.tensor([-1.0, 0.0, 4.0]))
    log = trace["log_1"]
    saved = log.out
    assert torch.isnan(saved[0]) and saved[1] == -math.inf
    assert trace.validate()  # NaN and -inf in the saved output and in the replay compare equal

    def worst(values: list[float]) -> list[tuple[str, float]]:
        trace.saved[log.index][0] = torch.tensor(values)
        return [(m.label, m.max_abs_diff) for m in trace.validate().mismatches]

    # -inf matches -inf: the difference is the 1.0 elsewhere, not inf - inf = NaN
    assert worst([math.nan, -math.inf, math.log(4.0) + 1.0]) == [("log_1", 1.0)]
    # the NaN replaced by a number: infinitely far, as is a finite value where the replay gives -inf
    assert worst([0.5, -math.inf, math.log(4.0)]) == [("log_1", math.inf)]
    assert worst([math.nan, -3.0, math.log(4.0)]) == [("log_1", math.inf)]


def test_report_text_lists_every_mismatch_and_skip():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.ReLU()).train()
    trace = _trace(model, torch.randn(3, 4))
    mul = trace["mul_1"]
    trace.saved[mul.index][0] = mul.out + 0.25
    trace.saved[trace["relu_1"].index][0] = torch.zeros(2)  # a shape change: a mismatch with a detail
    report = trace.validate()
    assert str(report) == "\n".join(
        [
            "validation FAILED: 5 ops replayed, 2 mismatched, 2 skipped",
            "  mismatch mul_1: max abs diff 0.25",
            "  mismatch relu_1: max abs diff inf (shape (3, 4) != saved (2,))",
            "  skipped empty_like_1: returns uninitialised memory",
            "  skipped bernoulli__1: nondeterministic op (random numbers)",
        ]
    )
    # a value difference has no detail text: the number says it all
    assert report.mismatches[0].detail == ""


def test_one_element_and_integer_mismatches_have_no_detail():
    class Reduce(nn.Module):
        def forward(self, x):
            return x.sum(), x.argmax()

    trace = _trace(Reduce(), torch.tensor([1.0, 5.0, 2.0]))
    total, arg = trace["sum_1"], trace["argmax_1"]
    assert total.out_shapes == ((),) and arg.out.item() == 1
    trace.saved[total.index][0] = total.out + 0.5  # one element: still compared
    trace.saved[arg.index][0] = arg.out + 2
    report = trace.validate()
    assert [(m.label, m.max_abs_diff, m.detail) for m in report.mismatches] == [
        ("sum_1", 0.5, ""),
        ("argmax_1", 2.0, ""),
    ]


def test_differences_are_computed_in_double_precision_and_complex():
    class Double(nn.Module):
        def forward(self, x):
            return x * 2

    trace = _trace(Double(), torch.tensor([5e-10]))
    mul = trace["mul_1"]
    trace.saved[mul.index][0] = torch.tensor([1.0])
    # 1.0 - 1e-9: in float32 that would round to 1.0
    replayed = float(torch.tensor([5e-10]).mul(2).double())
    assert trace.validate().mismatches[0].max_abs_diff == 1.0 - replayed != 1.0

    trace = _trace(Double(), torch.tensor([1 + 2j], dtype=torch.complex64))
    mul = trace["mul_1"]
    assert mul.out.tolist() == [2 + 4j]
    trace.saved[mul.index][0] = torch.tensor([2 + 4.5j], dtype=torch.complex64)
    assert trace.validate().mismatches[0].max_abs_diff == 0.5  # |(2+4j) - (2+4.5j)|, imaginary part included


def test_op_with_a_tensor_keyword_argument_replays_from_it():
    class Out(nn.Module):
        def forward(self, x, buf):
            return torch.add(x * 2, 1, out=buf)  # add.out: out= is a keyword-only tensor the op writes into

    x, buf = torch.randn(3), torch.zeros(3)
    trace = _trace(Out(), (x, buf))
    assert [op.func for op in trace] == ["mul", "add"]
    assert trace["add_1"].aten == "aten.add.out"
    report = trace.validate()
    assert report and report.checked == 2, str(report)
    assert torch.equal(buf, x * 2 + 1)  # the replay wrote into a copy of out=, not into the model's buffer


def test_collective_is_skipped_with_the_reason():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(3)

        class Reduce(nn.Module):
            def forward(self, x):
                y = x * 2
                dist.all_reduce(y)
                return y + 1

        trace = _trace(Reduce(), t)
    finally:
        dist.destroy_process_group()
    assert [op.func for op in trace] == ["mul", "all_reduce", "add"]
    report = trace.validate()
    assert report.skipped == {"all_reduce_1": "collective: replaying it would need every member rank"}
    assert report.checked == 2 and report


class _SideRead(nn.Module):
    def forward(self, x):
        a = x * 2
        self.side = a + 1  # reads `a` before the module returns it, so before an edit of the module's output
        return a


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _SideRead()

    def forward(self, x):
        y = x + 1  # an op no edit touches, read together with the edited one below
        return self.inner(x) * y


def test_validate_of_an_edited_trace_skips_what_the_edit_changed_and_checks_the_rest():
    model, x = _Outer(), torch.randn(3)
    trace = tl.trace(model, x, intervene=tl.when(tl.module("inner"), tl.scale(10.0)))
    # Plain PyTorch: the edit scales inner's output (x * 2) by 10 on its way out; `side` read it unedited.
    assert torch.equal(trace.output, x * 2 * 10 * (x + 1)) and torch.equal(model.inner.side, x * 2 + 1)
    report = trace.validate()
    # Ops: add_1 (x + 1), mul_1 (x * 2, edited), add_2 (side), mul_2 (the product). mul_1's saved output is the
    # edited one (no replay can give it); add_2 ran before the edit took effect (it read the unedited value,
    # which was not kept); add_1 and mul_2 (which ran after the edit) replay exactly.
    assert [op.label for op in trace] == ["add_1", "mul_1", "add_2", "mul_2"]
    assert report.skipped == {
        "mul_1": "output replaced by an edit (tl.scale(10.0))",
        "add_2": "read mul_1 before its edit took effect",
    }
    assert report and report.checked == 2


class _NetThenScale(Net):
    def forward(self, x):
        return super().forward(x) * 2


def test_ops_after_a_replay_that_raises_are_still_checked():
    torch.manual_seed(0)
    model, x = _NetThenScale(), torch.randn(5, 4)
    trace = _trace(model, x)
    trace.saved[trace["relu_1"].index][0] = torch.zeros(5, 7)  # addmm_2 cannot multiply 5x7 by 8x3
    trace.saved[trace["mul_1"].index][0] += 1.0  # and the op after it is tampered with too
    report = trace.validate()
    # t_1, addmm_1, relu_1, t_2, addmm_2 (raises), mul_1 (its saved output off by 1): all six checked.
    assert report.checked == 6
    assert [(m.label, m.max_abs_diff) for m in report.mismatches] == [
        ("relu_1", math.inf),
        ("addmm_2", math.inf),
        ("mul_1", pytest.approx(1.0)),
    ]
