"""Sinks: armed windows reach every sink on a background thread; slow, failing or overflowing sinks never reach
the training loop; disarm flushes; post-mortem shards stay synchronous."""

import logging
import threading
import time

import pytest
import torch
from torch import nn

import tl_dist as tl


@pytest.fixture(autouse=True)
def _disarm_after():
    yield
    tl.disarm()


class ListSink:
    def __init__(self):
        self.windows = []
        self.closed = 0

    def on_window(self, trace, telemetry):
        self.windows.append((trace, telemetry))

    def close(self):
        self.closed += 1


class SleepySink(ListSink):
    name = "sleepy"

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_window(self, trace, telemetry):
        time.sleep(self.seconds)
        super().on_window(trace, telemetry)


class FailingSink:
    name = "broken"

    def __init__(self):
        self.calls = 0

    def on_window(self, trace, telemetry):
        self.calls += 1
        raise RuntimeError(f"exporter down ({self.calls})")

    def close(self):
        raise OSError("close failed too")


class GateSink(ListSink):
    """Blocks in on_window until released: makes the worker's progress deterministic."""

    def __init__(self):
        super().__init__()
        self.started = threading.Event()
        self.release = threading.Event()

    def on_window(self, trace, telemetry):
        self.started.set()
        assert self.release.wait(30)
        super().on_window(trace, telemetry)


@pytest.fixture
def model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def step(model, opt):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_every_sink_gets_each_window_with_its_telemetry(tmp_path, model):
    a, b = ListSink(), ListSink()
    tl.arm(tmp_path, sinks=[a, b])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    traces = []
    for s in range(3):
        with tl.capture(step=s) as cap:
            step(model, opt)
        traces.append(cap.trace)
    assert tl.flush()
    for sink in (a, b):
        assert [t.step for t, _ in sink.windows] == [0, 1, 2]
        assert [t is c for (t, _), c in zip(sink.windows, traces)] == [True] * 3
        for trace, telemetry in sink.windows:
            assert telemetry.step == trace.step and telemetry.total_flops == sum(trace.columns["flops"])
            assert telemetry == tl.telemetry.summarize(trace)
    assert a.windows[0][1] is b.windows[0][1]  # summarised once per window, shared by the sinks
    stats = tl.sink_stats()
    assert (stats.submitted, stats.delivered, stats.dropped, stats.pending) == (3, 3, 0, 0)
    assert sorted(p.name for p in (tmp_path / "rank00000").iterdir()) == [
        f"step0000000{s}.h5" for s in range(3)
    ]
    assert tl.disarm() is True
    assert a.closed == b.closed == 1


def test_sinks_without_out_dir(model):
    sink = ListSink()
    assert tl.arm(sinks=[sink]) is None  # no shard folder
    with tl.capture(step=4):
        model(torch.randn(2, 4))
    tl.disarm()
    assert [t.step for t, _ in sink.windows] == [4]
    assert "shard" not in sink.windows[0][0].metadata


def test_a_sleeping_sink_does_not_slow_the_loop(tmp_path, model):
    sink = SleepySink(1.0)
    tl.arm(sinks=[sink])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    started = time.perf_counter()
    for s in range(6):
        with tl.capture(step=s):
            step(model, opt)
    loop_s = time.perf_counter() - started
    # Six windows at 1 s each would take 6 s if the training thread waited for the sink.
    assert loop_s < 3.0, loop_s
    assert tl.sink_stats().pending >= 4 and len(sink.windows) <= 2
    started = time.perf_counter()
    assert tl.disarm() is True  # flushes: every window delivered before it returns
    assert time.perf_counter() - started >= 3.0
    assert [t.step for t, _ in sink.windows] == list(range(6)) and sink.closed == 1


def test_a_failing_sink_is_logged_once_and_never_reaches_training(tmp_path, model, caplog):
    broken, good = FailingSink(), ListSink()
    tl.arm(tmp_path, sinks=[broken, good])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="tl_dist"):
        for s in range(4):
            with tl.capture(step=s):
                step(model, opt)
        tl.flush()
        tl.disarm()
    # The shard writer and the other sink got every window despite the failing one.
    assert sorted(p.name for p in (tmp_path / "rank00000").iterdir()) == [
        f"step0000000{s}.h5" for s in range(4)
    ]
    assert [t.step for t, _ in good.windows] == [0, 1, 2, 3]
    stats = tl.sink_stats()
    assert broken.calls == 4 and stats.errors == {"broken": 5}  # four windows and close()
    assert stats.last_error["broken"] == "OSError: close failed too"
    warned = [r for r in caplog.records if "broken" in r.getMessage()]
    assert len(warned) == 1 and "on_window" in warned[0].getMessage()
    assert "exporter down (1)" in caplog.text


def test_a_full_queue_drops_the_oldest_and_counts(model):
    gate = GateSink()
    tl.arm(sinks=[gate])
    with tl.capture(step=0):
        model(torch.randn(2, 4))
    assert gate.started.wait(30)  # the worker holds window 0; the queue is empty
    for s in range(1, 20):
        with tl.capture(step=s):
            model(torch.randn(2, 4))
    stats = tl.sink_stats()
    # 19 more windows into a queue of 8: the 11 oldest of them are dropped.
    assert tl.sinks.MAX_QUEUED_WINDOWS == 8
    assert (stats.submitted, stats.dropped, stats.pending) == (20, 11, 9)
    gate.release.set()
    assert tl.flush()
    assert [t.step for t, _ in gate.windows] == [0, *range(12, 20)]
    assert tl.sink_stats().delivered == 9


def test_flush_times_out_and_disarm_bounds_its_wait(model):
    gate = GateSink()
    tl.arm(sinks=[gate])
    for s in range(3):
        with tl.capture(step=s):
            model(torch.randn(2, 4))
    assert gate.started.wait(30)
    assert tl.flush(timeout=0.2) is False
    started = time.perf_counter()
    assert tl.disarm(timeout=0.3) is False  # gave up: two windows never reached the sink
    assert time.perf_counter() - started < 3
    assert tl.sink_stats().dropped == 2
    gate.release.set()


def test_exception_window_writes_its_shard_now_and_still_reaches_the_sinks(tmp_path, model):
    sink = ListSink()
    rank_dir = tl.arm(tmp_path, sinks=[FailingSink(), sink])
    with pytest.raises(ZeroDivisionError):
        with tl.capture(step=3):
            model(torch.randn(2, 4))
            raise ZeroDivisionError("division by zero")
    # Synchronous: the post-mortem shard is on disk before the with-block is left, no flush needed.
    shard = tl.load(rank_dir / "step00000003.h5")
    assert shard.metadata["complete"] is False and shard.metadata["error"].startswith("ZeroDivisionError")
    tl.flush()
    [(trace, telemetry)] = sink.windows
    assert trace.metadata["complete"] is False and telemetry.step == 3


def test_saved_tensors_keep_the_window_values_after_later_steps(tmp_path):
    """The shard is written after the window, while training goes on: what the next steps overwrite in place
    (parameters, their gradients, optimizer state) must be copied at hand-off."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    gate = GateSink()
    rank_dir = tl.arm(tmp_path, sinks=[gate], options=tl.CaptureOptions(save=True, save_grads=True))
    with tl.capture(step=0):
        model(torch.randn(3, 4))
    assert gate.started.wait(30)  # the worker is held: the next window's shard is written only later
    with tl.capture(step=1) as cap:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    trace = cap.trace
    t_op = next(op for op in trace if op.func == "t")  # a view of the weight
    momentum = next(op for op in trace if op.phase == "optimizer" and op.func == "clone")  # SGD's buffer
    relu = trace["relu_1"]
    then = {"t": t_op.out.clone(), "momentum": momentum.out.clone(), "grad": relu.grad.clone()}
    weight_grad = next(op for op in trace if op.phase == "backward" and op.fwd_op == t_op.index)
    for _ in range(3):  # later steps update weights, grads and momentum buffers in place
        opt.zero_grad(set_to_none=False)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    assert not torch.equal(model[0].weight.t(), then["t"])
    assert not torch.equal(opt.state[model[0].weight]["momentum_buffer"], then["momentum"])
    assert torch.equal(t_op.out, then["t"]) and torch.equal(momentum.out, then["momentum"])
    assert torch.equal(relu.grad, then["grad"]) and weight_grad.out is not None
    gate.release.set()
    assert tl.flush()
    disk = tl.load(rank_dir / "step00000001.h5")
    assert torch.equal(disk[t_op.index].out, then["t"]) and torch.equal(
        disk[momentum.index].out, then["momentum"]
    )
    assert torch.equal(disk[relu.index].grad, then["grad"])


SIGTERM_SCRIPT = """
import sys, time, torch, tl_dist as tl
from pathlib import Path
out = Path(sys.argv[1])

class SlowMarker:
    def on_window(self, trace, telemetry):
        time.sleep(0.5)
        (out / f"sink-{trace.step}").write_text(str(telemetry.total_flops))
    def close(self):
        (out / "closed").touch()

tl.arm(out / "run", sinks=[SlowMarker()])
for step in range(3):
    with tl.capture(step=step):
        torch.ones(4).add(1)
with tl.capture(step=3):
    x = torch.ones(16)
    (out / "ready").touch()
    while True:
        x = x.add(1).mul(0.5)
"""


@pytest.mark.slow
def test_sigterm_flushes_closed_windows_and_writes_the_open_one(tmp_path):
    import signal
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(SIGTERM_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # the slow sink still holds windows 1 and 2
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    # The windows closed before the signal reached the sink (flushed before the process ended) ...
    assert sorted(p.name for p in tmp_path.glob("sink-*")) == ["sink-0", "sink-1", "sink-2"]
    shards = tmp_path / "run" / "rank00000"
    assert sorted(p.name for p in shards.iterdir()) == [f"step0000000{s}.h5" for s in range(4)]
    # ... and the open window's post-mortem was written synchronously.
    open_window = tl.load(shards / "step00000003.h5")
    assert open_window.metadata["complete"] is False and open_window.metadata["end_reason"] == "SIGTERM"
    assert tl.load(shards / "step00000002.h5").metadata["complete"] is True


class TelemetryOnlySink(ListSink):
    name = "telemetry-only"
    needs_tensors = False


def _tensors_of(trace):
    return [t for kept in (trace.saved, trace.grads) for v in kept.values() for t in v if t is not None]


def test_a_sink_that_needs_no_tensors_gets_none_and_the_queue_holds_none_for_it(model):
    import gc
    import weakref

    bare, full = TelemetryOnlySink(), ListSink()
    tl.arm(sinks=[bare, full], options=tl.CaptureOptions(save=True))
    x = torch.randn(2, 4)
    with tl.capture(step=0) as cap:
        model(x)
    n_saved = len(_tensors_of(cap.trace))
    assert tl.flush()
    (got_bare, tel_bare), (got_full, tel_full) = bare.windows[0], full.windows[0]
    assert n_saved == 6 and len(_tensors_of(got_full)) == 6  # t, addmm, relu, detach, t, addmm
    assert _tensors_of(got_bare) == [] and got_bare.output is None and got_bare.param_grads == {}
    assert got_bare.columns is got_full.columns and got_bare.metadata["step"] == 0  # same tables, same facts
    assert tel_bare is tel_full
    tl.disarm()

    # Every sink needs no tensors: the queued window holds none (only the user's own trace keeps them).
    gate = GateSink()
    gate.needs_tensors = False
    tl.arm(sinks=[gate], options=tl.CaptureOptions(save=True))
    gc.disable()
    try:
        with tl.capture(step=0):
            model(x)
        assert gate.started.wait(30)
        with tl.capture(step=1) as cap:  # queued while the worker is held by window 0
            model(x)
        refs = [weakref.ref(t) for t in _tensors_of(cap.trace)]
        del cap
        assert len(refs) == 6 and [r for r in refs if r() is not None] == []
    finally:
        gc.enable()
        gate.release.set()
    assert tl.flush()
    assert [t.step for t, _ in gate.windows] == [0, 1] and all(t.saved == {} for t, _ in gate.windows)


def test_the_queue_is_bounded_in_bytes_and_drops_the_oldest(model, monkeypatch):
    x = torch.randn(2, 4)
    one = tl.trace(model, x)
    # Saved outputs of one window, float32: t (4x8, the weight's view counts in full), addmm, relu, detach
    # (2x8 each), t (8x2), addmm (2x2) = (32 + 3 * 16 + 16 + 4) * 4 bytes.
    size = sum(t.nelement() * t.element_size() for t in _tensors_of(one))
    assert size == 400
    monkeypatch.setattr(tl.sinks, "MAX_QUEUED_BYTES", 2 * size + size // 2)  # room for two windows
    gate = GateSink()
    tl.arm(sinks=[gate], options=tl.CaptureOptions(save=True))
    with tl.capture(step=0):
        model(x)
    assert gate.started.wait(30)  # the worker holds window 0; the queue is empty
    for s in range(1, 6):
        with tl.capture(step=s):
            model(x)
    stats = tl.sink_stats()
    assert (stats.submitted, stats.dropped, stats.pending, stats.queued_bytes) == (6, 3, 3, 2 * size)
    gate.release.set()
    assert tl.flush()
    assert [t.step for t, _ in gate.windows] == [0, 4, 5]
    assert tl.sink_stats().queued_bytes == 0


def test_the_newest_window_is_queued_even_over_the_byte_bound(model, monkeypatch):
    monkeypatch.setattr(tl.sinks, "MAX_QUEUED_BYTES", 10)
    sink = ListSink()
    tl.arm(sinks=[sink], options=tl.CaptureOptions(save=True))
    x = torch.randn(2, 4)
    with tl.capture(step=0):
        model(x)
    assert tl.flush()
    assert [t.step for t, _ in sink.windows] == [0] and tl.sink_stats().dropped == 0
    with pytest.raises(ValueError, match="max_bytes"):
        tl.sinks.SinkWorker((sink,), max_bytes=-1)
