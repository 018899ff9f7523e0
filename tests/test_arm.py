"""tl.arm / tl.disarm: armed capture windows write rank-local shards; run metadata; step policy; handlers."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

import tl_dist as tl
from tl_dist.arm import _on_signal, armed


@pytest.fixture(autouse=True)
def _disarm_after():
    yield
    tl.disarm()


class ListSink:
    def __init__(self):
        self.windows = []

    def on_window(self, trace, telemetry):
        self.windows.append((trace, telemetry))

    def close(self):
        pass


def small_step(model, x):
    model(x).sum().backward()


@pytest.fixture
def model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_window_writes_shard_with_run_metadata(tmp_path, model):
    rank_dir = tl.arm(tmp_path / "run")
    assert rank_dir == tmp_path / "run" / "rank00000" and rank_dir.is_dir()
    with tl.capture(step=7) as cap:
        small_step(model, torch.randn(3, 4))
    path = rank_dir / "step00000007.h5"
    assert cap.trace.metadata["shard"] == str(path)
    assert tl.flush()  # the shard writer is a sink: it writes on the sink worker thread
    assert sorted(p.name for p in rank_dir.iterdir()) == ["step00000007.h5"]
    disk = tl.load(path)
    # rank 0 of a world of 1 without a process group
    assert (disk.rank, disk.world_size, disk.step) == (0, 1, 7)
    assert (cap.trace.rank, cap.trace.world_size, cap.trace.step) == (0, 1, 7)
    meta = disk.metadata
    assert meta["complete"] is True and meta["end_reason"] == "closed"
    assert meta["pid"] == os.getpid() and meta["host"] == socket.gethostname()
    assert meta["torch_version"] == torch.__version__ and meta["backend"] == ""
    assert 0 < meta["start_time_ns"] <= time.time_ns()
    assert disk.columns == cap.trace.columns
    assert "backward" in disk.columns["phase"]


def test_window_counter_names_shards_without_step(tmp_path, model):
    rank_dir = tl.arm(tmp_path)
    for _ in range(3):
        with tl.capture():
            small_step(model, torch.randn(2, 4))
    tl.flush()
    names = sorted(p.name for p in rank_dir.iterdir())
    assert names == ["step00000000.h5", "step00000001.h5", "step00000002.h5"]
    assert [tl.load(rank_dir / n).metadata["window"] for n in names] == [0, 1, 2]


def test_a_step_captured_twice_says_its_shard_is_replaced(tmp_path, model):
    rank_dir = tl.arm(tmp_path)
    with tl.capture(step=1):  # window 0
        small_step(model, torch.randn(2, 4))
    with pytest.warns(RuntimeWarning, match=r"step 1 was already captured by window 0 of this process") as w:
        with tl.capture(step=1):  # a second micro-batch given the same step
            model(torch.randn(2, 4))
    assert w[0].filename == __file__  # the user's line, not tl_dist's
    with tl.capture():  # window 2, numbered 2: no collision
        model(torch.randn(2, 4))
    with pytest.warns(RuntimeWarning, match=r"step 2 was already captured by window 2"):
        with tl.capture(step=2):
            model(torch.randn(2, 4))
    tl.flush()
    assert sorted(p.name for p in rank_dir.iterdir()) == ["step00000001.h5", "step00000002.h5"]
    assert tl.load(rank_dir / "step00000001.h5").metadata["window"] == 1  # the later window's


def test_armed_defaults_apply_and_explicit_arguments_win(tmp_path, model):
    rank_dir = tl.arm(tmp_path, options=tl.CaptureOptions(save=tl.func("relu")))
    with tl.capture(step=1):
        small_step(model, torch.randn(2, 4))
    with tl.capture(step=2, save=tl.func("addmm")):
        small_step(model, torch.randn(2, 4))
    with tl.capture(step=3, options=tl.CaptureOptions(stats=True)):  # options replace the armed ones
        small_step(model, torch.randn(2, 4))
    with pytest.raises(ValueError, match="either options="):
        tl.capture(options=tl.CaptureOptions(), save=True)
    tl.disarm()
    three = tl.load(rank_dir / "step00000003.h5")
    assert not three.saved and len(three.stats_table["op"]) > 0
    one, two = tl.load(rank_dir / "step00000001.h5"), tl.load(rank_dir / "step00000002.h5")
    assert {one[i].func for i in one.saved} == {"relu"}
    assert {two[i].func for i in two.saved} == {"addmm"}
    assert one["relu_1"].out.shape == (2, 8)


def test_unarmed_capture_and_trace_write_nothing(tmp_path, model):
    with pytest.warns(UserWarning, match=r"tl.capture\(step=3\): the process is not armed"):
        with tl.capture(step=3) as cap:
            small_step(model, torch.randn(2, 4))
    assert cap.trace.rank is None and list(tmp_path.iterdir()) == []
    rank_dir = tl.arm(tmp_path)
    tl.trace(model, torch.randn(2, 4))  # tl.trace is not an armed window
    assert list(rank_dir.iterdir()) == []
    tl.disarm()
    with pytest.warns(UserWarning, match="not armed"):
        with tl.capture(step=4):
            small_step(model, torch.randn(2, 4))
    assert list(rank_dir.iterdir()) == []


def test_should_capture_every(tmp_path):
    assert tl.should_capture(0) is False  # not armed
    tl.arm(tmp_path, every=50)
    assert [s for s in range(160) if tl.should_capture(s)] == [0, 50, 100, 150]
    tl.arm(tmp_path)  # re-arming replaces; every=None captures every step
    assert all(tl.should_capture(s) for s in range(5))
    with pytest.raises(ValueError, match="step"):
        tl.should_capture("3")


def test_bad_arguments_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="every"):
        tl.arm(tmp_path, every=0)
    with pytest.raises(ValueError, match="every"):
        tl.arm(tmp_path, every=True)
    with pytest.raises(ValueError, match="save must be True"):
        tl.CaptureOptions(save="relu")
    with pytest.raises(ValueError, match="save_grads"):
        tl.CaptureOptions(save_grads=1)
    with pytest.raises(ValueError, match="stats"):
        tl.CaptureOptions(stats="all")
    with pytest.raises(ValueError, match="source must be a bool"):
        tl.CaptureOptions(source=1)
    with pytest.raises(ValueError, match="options must be a tl.CaptureOptions"):
        tl.arm(tmp_path, options={"save": True})
    with pytest.raises(TypeError, match="save"):
        tl.arm(tmp_path, save=True)  # one way to say it: options=
    with pytest.raises(ValueError, match="sinks\\[1\\]"):
        tl.arm(tmp_path, sinks=[ListSink(), object()])
    with pytest.raises(ValueError, match="sinks must be a list"):
        tl.arm(tmp_path, sinks=ListSink())
    with pytest.raises(ValueError, match="neither"):
        tl.arm()
    with pytest.raises(ValueError, match="out_dir"):
        tl.arm(42)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="out_dir"):
        tl.arm(tmp_path / "file")
    with pytest.raises(ValueError, match="shard"):
        tl.arm(tmp_path, shard={"compression": None})
    assert armed() is None
    tl.arm(tmp_path)
    with pytest.raises(ValueError, match="step"):
        tl.capture(step=-1)


def test_arm_and_disarm_restore_signal_handlers(tmp_path):
    def mine(signum, frame):
        pass

    before_usr1 = signal.signal(signal.SIGUSR1, mine)
    before_term = signal.getsignal(signal.SIGTERM)
    try:
        tl.arm(tmp_path)
        assert signal.getsignal(signal.SIGTERM) is _on_signal
        assert signal.getsignal(signal.SIGUSR1) is _on_signal
        assert armed().previous_handlers[signal.SIGUSR1] is mine
        tl.arm(tmp_path)  # re-arming does not chain to itself
        assert armed().previous_handlers[signal.SIGUSR1] is mine
        tl.disarm()
        assert signal.getsignal(signal.SIGUSR1) is mine
        assert signal.getsignal(signal.SIGTERM) is before_term
        tl.disarm()  # a no-op when not armed
    finally:
        signal.signal(signal.SIGUSR1, before_usr1)


def test_disarm_neutralises_atexit_hook(tmp_path):
    # A window left open at exit is written by the atexit hook -- unless the process disarmed first.
    script = textwrap.dedent(
        """
        import sys, torch, tl_dist as tl
        tl.arm(sys.argv[1])
        cap = tl.capture(step=5)
        cap.__enter__()
        torch.ones(3).add(1).relu()
        if sys.argv[2] == "disarm":
            tl.disarm()
        """
    )
    for mode in ("keep", "disarm"):
        out = tmp_path / mode
        proc = subprocess.run(
            [sys.executable, "-c", script, str(out), mode], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        shards = list((out / "rank00000").iterdir())
        if mode == "disarm":
            assert shards == []
        else:
            trace = tl.load(shards[0])
            assert trace.metadata["complete"] is False and trace.metadata["end_reason"] == "atexit"
            funcs = [op.func for op in trace]
            assert [f for f in funcs if f in ("ones", "add", "relu")] == ["ones", "add", "relu"]


TWO_RANKS = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
    import tl_dist as tl
    from torch import nn

    def worker(rank, out, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        torch.manual_seed(rank)
        model = nn.Linear(4, 2)
        tl.arm(out, options=tl.CaptureOptions(save=True))
        for step in (10, 20):
            with tl.capture(step=step):
                loss = model(torch.randn(3, 4)).sum()
                loss.backward()
                for p in model.parameters():
                    dist.all_reduce(p.grad)
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(sys.argv[1], int(sys.argv[2])), nprocs=2, join=True)
    """
)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_rank_gloo_run_writes_rank_shards(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    out = tmp_path / "run"
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(script), str(out), str(_free_port())],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["rank00000", "rank00001"]
    for rank in (0, 1):
        names = sorted(p.name for p in (out / f"rank{rank:05d}").iterdir())
        assert names == ["step00000010.h5", "step00000020.h5"]
        for name, step in zip(names, (10, 20)):
            trace = tl.load(out / f"rank{rank:05d}" / name)
            assert (trace.rank, trace.world_size, trace.step) == (rank, 2, step)
            meta = trace.metadata
            assert meta["backend"] == "gloo" and meta["local_rank"] == rank and meta["complete"] is True
            # two all-reduces (weight and bias grads) recorded as collective ops
            assert sum(k == "collective" for k in trace.columns["kind"]) == 2


def test_armed_save_grads_and_stats_reach_the_shard(tmp_path, model):
    rank_dir = tl.arm(tmp_path, options=tl.CaptureOptions(save_grads=tl.func("relu"), stats=True))
    with tl.capture(step=1) as cap:
        small_step(model, torch.randn(2, 4))
    tl.flush()
    disk = tl.load(rank_dir / "step00000001.h5")
    relu = cap.trace["relu_1"].index
    assert list(cap.trace.grads) == [relu] and list(disk.grads) == [relu]
    assert torch.equal(disk["relu_1"].grad, cap.trace["relu_1"].grad)
    assert disk["relu_1"].grad.shape == (2, 8)
    assert len(disk.stats_table["op"]) > 0 and disk.stats_table == cap.trace.stats_table
