"""``tl.armed_session``: an armed session of its own beside the process's ``tl.arm`` (a framework callback's).

Its windows go to its own folder and sinks, a user's ``tl.arm`` keeps its own, one set of signal handlers serves
both, post-mortems go to the open window's session, and a window's summary is computed once.
"""

import signal

import pytest
import torch
from sink_helpers import StepSink
from torch import nn

import tl_dist as tl
from tl_dist.arm import _on_signal, armed, write_postmortem


@pytest.fixture(autouse=True)
def _disarm_after():
    yield
    tl.disarm()


def _step(model):
    model(torch.randn(3, 4)).sum().backward()


def _shards(folder):
    return sorted(p.name for p in (folder / "rank00000").glob("*.h5"))


def test_a_session_beside_tl_arm_keeps_each_window_with_its_own_session(tmp_path):
    model = nn.Linear(4, 2)
    mine, theirs = StepSink(), StepSink()
    tl.arm(tmp_path / "user", sinks=[mine], options=tl.CaptureOptions(save=None))
    user_state = armed()
    session = tl.armed_session(tmp_path / "own", sinks=[theirs], options=tl.CaptureOptions(save=True))
    with tl.capture(step=1) as plain:
        _step(model)
    with session.capture(step=2, root=model) as own:
        _step(model)
    assert session.close() and armed() is user_state
    assert plain.trace.metadata["shard"].startswith(str(tmp_path / "user"))
    # each window recorded its own session's options: the session saves outputs, the user's arm does not
    saved = [sum(op.out is not None for op in cap.trace) for cap in (own, plain)]
    assert saved[0] == len(own.trace) and saved[1] == 0
    with tl.capture(step=3):
        _step(model)
    assert tl.flush()
    assert _shards(tmp_path / "user") == ["step00000001.h5", "step00000003.h5"]
    assert _shards(tmp_path / "own") == ["step00000002.h5"]
    assert [s for s, _ in mine.windows] == [1, 3] and [s for s, _ in theirs.windows] == [2]
    assert tl.sink_stats().delivered == 2
    with pytest.raises(ValueError, match="this armed session is closed"):
        session.capture(step=4)


def test_signal_handlers_are_held_by_one_session_and_handed_on(tmp_path):
    def previous(signum, frame):
        pass

    before = signal.signal(signal.SIGUSR1, previous)
    try:
        session = tl.armed_session(tmp_path / "own")
        assert signal.getsignal(signal.SIGUSR1) is _on_signal
        assert session.previous_handlers[signal.SIGUSR1] is previous
        tl.arm(tmp_path / "user")  # armed while the session lives: the handlers are not installed twice
        assert armed().previous_handlers == {}
        session.close()  # the user's arm takes the handlers over, with what they replaced
        assert signal.getsignal(signal.SIGUSR1) is _on_signal
        assert armed().previous_handlers[signal.SIGUSR1] is previous
        tl.disarm()
        assert signal.getsignal(signal.SIGUSR1) is previous
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_post_mortem_goes_to_the_open_windows_session(tmp_path):
    tl.arm(tmp_path / "user")
    session = tl.armed_session(tmp_path / "own")
    with session.capture(step=4):
        torch.ones(3).add(1)
        path = write_postmortem("watchdog")
        shard = tl.load(path)
    session.close()
    assert path == tmp_path / "own" / "rank00000" / "step00000004.h5"
    assert shard.metadata["complete"] is False and shard.metadata["end_reason"] == "watchdog"
    assert [op.func for op in shard if op.func in ("ones", "add")] == ["ones", "add"]
    assert _shards(tmp_path / "user") == []


def test_a_windows_summary_is_computed_once_and_the_sinks_get_that_one(tmp_path, summarize_calls):
    model = nn.Linear(4, 2)
    sink = StepSink()
    session = tl.armed_session(tmp_path / "own", sinks=[sink], summarize_on_close=True, peak_flops=1e12)
    caps = []
    for step in (0, 1):
        with session.capture(step=step) as cap:
            _step(model)
        caps.append(cap)
    assert session.flush()
    assert summarize_calls == [caps[0].trace, caps[1].trace]  # once per window, on the closing thread
    assert [t for _, t in sink.windows] == [c.window.telemetry for c in caps]
    assert all(s is c.window.telemetry for (_, s), c in zip(sink.windows, caps))
    # peak_flops reached the one summary: MFU = achieved FLOP/s over the peak, from its own numbers
    t = caps[0].window.telemetry
    assert t.total_flops > 0 and t.mfu == pytest.approx(t.total_flops / (t.wall_ns * 1e-9) / 1e12)
    session.close()
    # tl.arm leaves the summary to the sink worker: once per window there too
    tl.arm(sinks=[StepSink()])
    with tl.capture(step=5) as cap:
        _step(model)
    assert tl.flush() and summarize_calls[2:] == [cap.trace]
    assert cap.window.telemetry is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"peak_flops": 0}, "peak_flops must be a positive number"),
        ({"peak_flops": float("nan")}, "peak_flops must be a positive number"),
        ({"summarize_on_close": 1}, "summarize_on_close must be a bool"),
        ({"sinks": [object()]}, r"sinks\[0\] \(object\) is not a sink"),
    ],
)
def test_bad_arguments_name_the_argument(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tl.armed_session(tmp_path, **kwargs)
