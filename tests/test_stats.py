"""Activation/gradient statistics (stats=) and first_nonfinite."""

import math

import pytest
import torch
from torch import nn

import tl_dist as tl
from tl_dist.training import _device_stats, finish_stats, tensor_stats


def _direct(t):
    """The eight statistics computed straight from the tensor, in float64."""
    x = t.detach().double()
    return {
        "mean": x.mean().item(),
        "std": x.std(correction=0).item(),
        "min": x.min().item(),
        "max": x.max().item(),
        "norm": x.norm().item(),
        "zero_frac": (x == 0).double().mean().item(),
        "nan": int(x.isnan().sum()),
        "inf": int(x.isinf().sum()),
    }


def _assert_stats_equal(got, expected, what):
    for name, value in expected.items():
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(got[name]), (what, name)
        else:
            assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), (what, name, got[name], value)


def _stats(t, device_path=False):
    raw = _device_stats(t.reshape(-1), t.numel()).tolist() if device_path else tensor_stats(t)
    return finish_stats(raw)


@pytest.mark.parametrize("device_path", [False, True], ids=["cpu-path", "gpu-path"])
def test_tensor_stats_known_values(device_path):
    # [0, 2, -2, 4]: mean 1, population var ((1+1+9+9)/4) = 5, norm sqrt(0+4+4+16) = sqrt(24), one zero in four.
    values = _stats(torch.tensor([0.0, 2.0, -2.0, 4.0]), device_path)
    assert values == pytest.approx([1.0, math.sqrt(5), -2.0, 4.0, math.sqrt(24), 0.25, 0, 0])
    special = _stats(torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0]), device_path)
    assert special[6:] == [1, 2] and special[5] == pytest.approx(0.2)
    assert math.isnan(special[2]) and math.isnan(special[3])  # min/max propagate NaN, as torch.min does
    infs = _stats(torch.tensor([1.0, float("inf"), -float("inf")]), device_path)
    assert infs[2:4] == [-float("inf"), float("inf")] and infs[6:] == [0, 2]
    strided = torch.arange(12.0).reshape(3, 4).t()  # not contiguous: 0..11, mean 5.5, var (144-1)/12
    assert finish_stats(tensor_stats(strided))[:4] == pytest.approx([5.5, math.sqrt(143 / 12), 0, 11])


def test_tensor_stats_dtypes_and_precision():
    half = finish_stats(tensor_stats(torch.tensor([1.0, 3.0], dtype=torch.bfloat16)))
    assert half[:2] == [2.0, 1.0]
    assert tensor_stats(torch.tensor([1, 2])) is None  # integers: no statistics
    assert tensor_stats(torch.empty(0)) is None
    assert finish_stats(tensor_stats(torch.tensor([3.0])))[:2] == [3.0, 0.0]  # one element: std 0, not NaN
    # |mean| >> std: the shifted path keeps the std accurate where E[x^2] - E[x]^2 in float32 would not.
    x = 1000.0 + 1e-2 * torch.randn(10_000)
    got = finish_stats(tensor_stats(x))
    expected = x.double().std(correction=0).item()
    assert got[1] == pytest.approx(expected, rel=1e-3)
    assert finish_stats(_device_stats(x, x.numel()).tolist())[1] == pytest.approx(expected, rel=1e-3)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_window_stats_equal_direct_computation():
    model = Net()
    x = torch.randn(5, 6)
    with tl.Capture(save=True, save_grads=True, stats=True) as cap:
        model(x).pow(2).mean().backward()
    trace = cap.trace
    table = trace.stats_table
    assert set(table["of"]) == {"out", "grad"}
    n_checked = {"out": 0, "grad": 0}
    for k, index in enumerate(table["op"]):
        of = table["of"][k]
        values = trace[index].out if of == "out" else trace[index].grad
        tensor = values[0] if isinstance(values, tuple) else values
        got = {
            name: table[name][k] for name in ("mean", "std", "min", "max", "norm", "zero_frac", "nan", "inf")
        }
        _assert_stats_equal(got, _direct(tensor), (trace[index].label, of))
        n_checked[of] += 1
    # Every forward op with a float output has output stats except views; relu has zeros, so zero_frac > 0.
    # Forward ops with float outputs (t, addmm, relu, ...) and their gradients; views have none.
    assert n_checked["out"] >= 5 and n_checked["grad"] >= 5
    relu = trace["relu_1"]
    assert 0 < relu.stats["out"]["zero_frac"] < 1 and relu.stats["out"]["min"] == 0.0
    assert set(relu.stats) == {"out", "grad"}
    # stats=True covers forward ops; backward ops' outputs appear as the `grad` rows of forward ops.
    assert all(trace[i].phase == "forward" for i in table["op"])


def test_stats_selector_limits_rows_and_needs_no_saved_tensors():
    model = Net()
    with tl.Capture(stats=tl.func("relu")) as cap:
        model(torch.randn(5, 6)).sum().backward()
    trace = cap.trace
    assert {trace[i].func for i in trace.stats_table["op"]} == {"relu"}
    assert sorted(trace.stats_table["of"]) == ["grad", "out"]
    assert trace.saved == {} and trace.grads == {}


def test_log_backward_adds_gradient_stats():
    model = Net()
    trace = tl.trace(model, torch.randn(4, 6), save=None, stats=tl.func("relu"))
    assert trace.stats_table["of"] == ["out"]
    trace.log_backward(trace.output.sum())
    assert trace.stats_table["of"] == ["out", "grad"]
    grad = trace["relu_1"].stats["grad"]
    # d sum(fc2(h)) / dh = column sums of fc2.weight, the same for every row of the batch.
    expected = model.fc2.weight.detach().sum(0).expand(4, 10)
    _assert_stats_equal(grad, _direct(expected), "relu grad")


class NaNHead(nn.Module):
    def forward(self, x):
        return torch.log(x - 1.5)  # NaN wherever x < 1.5


class NaNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = NaNHead()

    def forward(self, x):
        return self.head(torch.sigmoid(self.fc(x)) * 2).sum()


def test_first_nonfinite_names_op_module_and_source():
    model = NaNNet()
    with tl.Capture(stats=True) as cap:
        model(torch.randn(3, 4)).backward()
    op = cap.trace.first_nonfinite()
    assert op.label == "log_1" and op.module == "head"
    assert op.source.endswith(f"test_stats.py:{NaNHead.forward.__code__.co_firstlineno + 1}")
    assert op.stats["out"]["nan"] > 0
    # Everything before it is finite.
    assert all(cap.trace[i].stats.get("out", {}).get("nan", 0) == 0 for i in range(op.index))


def test_first_nonfinite_in_backward_only():
    # sqrt is finite at 0 but its gradient 1 / (2 sqrt(0)) is inf: every forward output is finite, and the
    # first non-finite value is the gradient w.r.t. sqrt's input, the output of mul_1 (x * 1.0).
    x = torch.tensor([0.0, 1.0, 4.0], requires_grad=True)
    with tl.Capture(stats=True) as cap:
        torch.sqrt(x * 1.0).sum().backward()
    trace = cap.trace
    op = trace.first_nonfinite()
    assert op.label == "mul_1"
    assert op.stats["out"]["inf"] == 0 and op.stats["grad"]["inf"] == 1
    assert trace["sqrt_1"].stats["grad"]["inf"] == 0  # d sum / d sqrt = 1 everywhere
    # Selecting backward ops explicitly records their outputs too: the sqrt backward op made the inf.
    with tl.Capture(stats=tl.where(lambda o: o.phase == "backward")) as cap:
        torch.sqrt(x * 1.0).sum().backward()
    op = cap.trace.first_nonfinite()
    assert op.phase == "backward" and cap.trace[op.fwd_op].func == "sqrt"


def test_first_nonfinite_without_stats():
    model = NaNNet()
    with tl.Capture() as cap:
        model(torch.randn(3, 4))
    with pytest.raises(tl.TlDistError, match="stats=True"):
        cap.trace.first_nonfinite()
    with tl.Capture(save=True) as cap:
        model(torch.randn(3, 4))
    assert cap.trace.first_nonfinite().label == "log_1"
    with tl.Capture(stats=True) as cap:
        Net()(torch.randn(2, 6)).sum().backward()
    assert cap.trace.first_nonfinite() is None


def test_stats_true_skips_views_copies_and_uninitialised_memory():
    # Dropout in train mode on CPU: empty_like (uninitialised) -> bernoulli_ -> div_ -> mul. The empty_like
    # buffer can hold any bits, NaN included; its "statistics" must not exist, or first_nonfinite could
    # name it. Views (the Linear's reshape, t) and clones repeat values already counted -- unless one is what a
    # module returned (the Linears on 3-D input end in _unsafe_view): every module output has its norm.
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    with tl.Capture(stats=True) as cap:
        model(torch.randn(3, 4, 6)).sum().backward()
    trace = cap.trace
    funcs = {trace[i].func for i in trace.stats_table["op"]}
    assert "empty_like" in trace.columns["func"] and "bernoulli_" in funcs
    assert "empty_like" not in funcs
    copies = {"_unsafe_view", "view", "t", "clone"}
    skipped = [i for i in trace.stats_table["op"] if trace[i].kind == "view" or trace[i].func in copies]
    # Only module outputs: the two Linears' and the Sequential's (the second Linear's), and the output only.
    assert {a for i in skipped for a in trace[i].output_of} == {"0", "2", ""}
    assert all(trace[i].output_of for i in skipped)
    assert trace["randn_1"].stats["out"]["nan"] == 0  # a factory op inside the window: the input, counted


class _Wide(nn.Module):
    def forward(self, x):
        y = torch.relu(x * 3 - 1)
        if getattr(self, "boom", False):
            raise RuntimeError("boom")
        return y.sum()


@pytest.mark.parametrize("raises", [False, True])
def test_stats_under_sleeping_omp_threads_are_exact_and_leave_the_thread_count(monkeypatch, raises):
    """With OMP_WAIT_POLICY=PASSIVE the statistics of tensors below a million elements are reduced on the
    calling thread alone (waking sleeping OpenMP threads costs more than the reduction): the values are those
    of the tensor, and the caller's torch thread count is what it was, also when the model raises."""
    import tl_dist.training as training

    monkeypatch.setattr(training, "_SLEEPING_OMP_THREADS", True)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = _Wide()
        model.boom = raises
        x = torch.randn(4, 128, 256)  # 131,072 elements: below the one-thread bound, above ATen's grain size
        seen = []
        real = training._host_stats
        monkeypatch.setattr(
            training, "_host_stats", lambda t, n: seen.append(torch.get_num_threads()) or real(t, n)
        )
        try:
            with tl.Capture(save=True, stats=True) as cap:
                model(x)
        except RuntimeError:
            assert raises
        assert torch.get_num_threads() == 2
        assert seen and set(seen) == {1}
        if not raises:
            relu = cap.trace["relu_1"]
            _assert_stats_equal(relu.stats["out"], _direct(torch.relu(x * 3 - 1)), "relu_1")
    finally:
        torch.set_num_threads(before)


def _collective_stats(rank, world_size, out_dir):
    import torch.distributed as dist

    with tl.capture(stats=True) as cap:
        a = torch.full((4,), 1.0 + rank)  # 1 and 2: the sum is 3 on both ranks
        dist.all_reduce(a)  # blocking: its buffer holds the sum once dist.all_reduce returned
        doubled = a * 2  # the reader: the statistics are taken here, of the sum
        a.zero_()  # a later write must not change them
        b = torch.full((4,), float("nan") if rank == 1 else 1.0)
        work = dist.all_reduce(b, async_op=True)  # rank 1's NaN reaches rank 0 here
        work.wait()  # nothing reads b in the window: its statistics are taken when the window closes
    t = cap.trace
    ar = [op for op in t if op.func == "all_reduce"]
    first = t.first_nonfinite()
    return {
        "a": ar[0].stats["out"],
        "b": ar[1].stats["out"],
        "first": None if first is None else first.label,
        "doubled": doubled,
    }


@pytest.mark.slow
def test_a_collectives_statistics_are_of_its_result(tmp_path):
    from dist_helpers import run_ranks

    for rank, res in enumerate(run_ranks(_collective_stats, world_size=2, tmp_path=tmp_path)):
        assert torch.equal(res["doubled"], torch.full((4,), 6.0))
        # the reduced values (3.0), not the rank's own contribution (taken at issue) nor the zeros written later
        assert (res["a"]["mean"], res["a"]["min"], res["a"]["max"], res["a"]["nan"]) == (3.0, 3.0, 3.0, 0)
        assert res["a"]["norm"] == pytest.approx(6.0)  # sqrt(4 * 9)
        assert res["b"]["nan"] == 4
        # On rank 0 the first NaN is the all-reduce that brought rank 1's; on rank 1 its own fill came first.
        assert res["first"] == ("all_reduce_2" if rank == 0 else "full_2"), rank
