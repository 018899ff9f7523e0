"""Post-mortem shards: an exception, SIGTERM, SIGUSR1 or SIGKILL during armed windows leaves loadable evidence."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import pytest
import torch
from torch import nn

import tl_dist as tl


@pytest.fixture(autouse=True)
def _disarm_after():
    yield
    tl.disarm()


class Bad(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.proj = torch.randn(5, 5)

    def forward(self, x):
        return torch.mm(torch.relu(self.fc(x)), self.proj)  # 3x4 @ 5x5: mm raises


def test_exception_in_window_leaves_incomplete_shard_naming_the_op(tmp_path):
    rank_dir = tl.arm(tmp_path, options=tl.CaptureOptions(save=True))
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        with tl.capture(step=12):
            Bad()(torch.randn(3, 4))
    trace = tl.load(rank_dir / "step00000012.h5")
    assert trace.metadata["complete"] is False and trace.metadata["end_reason"] == "exception"
    assert trace.metadata["error"].startswith("RuntimeError: ")
    assert trace.failed_op["func"] == "mm" and trace.failed_op["aten"] == "aten.mm.default"
    assert trace.failed_op["index"] == len(trace)  # the op that raised has no row: it never finished
    mm_line = _line("3x4 @ 5x5: mm raises")
    assert trace.failed_op["source"] == f"{__file__}:{mm_line}"
    # Where the window's thread was: the raise point, in the user's code, named by the call it was making.
    assert trace.metadata["stack_at"] == f"{__file__}:{mm_line} in torch.mm"
    stack = trace.metadata["stack"]
    assert f"{__file__}:{mm_line} in Bad.forward -> torch.mm" in stack
    assert stack.index(f"{__file__}:{mm_line} in Bad.forward -> torch.mm") > stack.index(
        f"{__file__}:{_line('Bad()(torch.randn(3, 4))')} in "
        "test_exception_in_window_leaves_incomplete_shard_naming_the_op -> Bad()"
    )
    with h5py.File(rank_dir / "step00000012.h5", "r") as f:  # plain variable-length strings, no pickle
        assert h5py.check_string_dtype(f["stack"].dtype).encoding == "utf-8"
        assert f["stack"].asstr()[()].tolist() == stack
        assert f.attrs["stack_at"] == trace.metadata["stack_at"]
    # The ops before the failure are there, with their saved outputs.
    assert "relu" in [op.func for op in trace] and trace["relu_1"].out.shape == (3, 4)


def _spawn(tmp_path, body, *args):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, proc, timeout=90.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {path}")
        time.sleep(0.05)


BUSY_WINDOW = """
    import sys, signal, torch, tl_dist as tl
    from pathlib import Path
    out = Path(sys.argv[1])
    if sys.argv[2] == "own-handler":
        def mine(signum, frame):
            (out / "own-handler-ran").write_text(str(signum))
            sys.exit(3)
        signal.signal(signal.SIGTERM, mine)
    tl.arm(out / "run")
    with tl.capture(step=3):
        x = torch.ones(16)
        (out / "ready").touch()
        while not (out / "finish").exists():
            for _ in range(50):
                x = x.add(1).mul(0.5)
"""


# 20 add/mul pairs, then an op that never returns: its kernel (Python, so the signal handler runs inside it)
# says when it started and waits. The SIGTERM then always lands inside that op, never between two ops.
BLOCKED_IN_OP = """
    import sys, time, torch, tl_dist as tl
    from pathlib import Path
    out = Path(sys.argv[1])

    @torch.library.custom_op("tltest::block", mutates_args=())
    def block(x: torch.Tensor) -> torch.Tensor:
        (out / "ready").touch()
        while True:
            time.sleep(0.01)

    tl.arm(out / "run")
    with tl.capture(step=3):
        x = torch.ones(16)
        for _ in range(20):
            x = x.add(1).mul(0.5)
        block(x)
"""


@pytest.mark.slow
def test_sigterm_in_window_writes_incomplete_shard_and_terminates(tmp_path):
    proc = _spawn(tmp_path, BLOCKED_IN_OP)
    _wait_for(tmp_path / "ready", proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM  # the default action still ran after the post-mortem
    trace = tl.load(tmp_path / "run" / "rank00000" / "step00000003.h5")
    assert trace.metadata["complete"] is False and trace.metadata["end_reason"] == "SIGTERM"
    assert [op.func for op in trace] == ["ones"] + ["add", "mul"] * 20
    # the op the signal interrupted is named as in flight: the next op, which has no row
    failed = trace.failed_op
    assert (failed["func"], failed["aten"], failed["index"]) == ("block", "tltest.block.default", 41)
    assert failed["error"] == "in flight when the post-mortem was written"
    # The handler ran inside the op's kernel: the stack goes from the script's call of the op, through torch's
    # and tl_dist's dispatch, to the kernel's loop, the innermost frame of user code.
    script = tmp_path / "child.py"
    assert trace.metadata["stack"][0] == f"{script}:{_line('    block(x)', script)} in <module> -> block"
    kernel = (_line("while True", script), _line("time.sleep(0.01)", script))
    assert trace.metadata["stack_at"] in (
        f"{script}:{kernel[0]} in block",
        f"{script}:{kernel[1]} in time.sleep",
    )


@pytest.mark.slow
def test_sigterm_chains_to_previous_python_handler(tmp_path):
    proc = _spawn(tmp_path, BUSY_WINDOW, "own-handler")
    _wait_for(tmp_path / "ready", proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 3
    assert (tmp_path / "own-handler-ran").read_text() == str(int(signal.SIGTERM))
    trace = tl.load(tmp_path / "run" / "rank00000" / "step00000003.h5")
    # tl_dist's handler wrote the SIGTERM post-mortem, then ran the user's, whose sys.exit unwound the window:
    # that window's own close wrote the shard last, with the exception as its error and the signal (what ended
    # the process) as its end reason.
    assert trace.metadata["complete"] is False
    assert trace.metadata["end_reason"] == "SIGTERM" and trace.metadata["error"] == "SystemExit: 3"


@pytest.mark.slow
def test_sigusr1_snapshots_and_the_window_still_completes(tmp_path):
    proc = _spawn(tmp_path, BUSY_WINDOW, "default")
    _wait_for(tmp_path / "ready", proc)
    shard = tmp_path / "run" / "rank00000" / "step00000003.h5"
    proc.send_signal(signal.SIGUSR1)
    _wait_for(shard, proc)
    snapshot = tl.load(shard)
    assert snapshot.metadata["complete"] is False and snapshot.metadata["end_reason"] == "SIGUSR1"
    assert proc.poll() is None  # SIGUSR1 asks for a dump; the process keeps running
    (tmp_path / "finish").touch()
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    final = tl.load(shard)
    assert final.metadata["complete"] is True and len(final) > len(snapshot)


WRITER_LOOP = """
    import sys, torch, tl_dist as tl
    from pathlib import Path
    from torch import nn
    out = Path(sys.argv[1])
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    tl.arm(out / "run", options=tl.CaptureOptions(save=True))
    x = torch.randn(256, 512)
    step = 0
    while True:
        with torch.no_grad(), tl.capture(step=step):
            model(x)
        step += 1
        (out / "progress").write_text(str(step))
"""


@pytest.mark.slow
def test_sigkill_leaves_only_complete_shards(tmp_path):
    proc = _spawn(tmp_path, WRITER_LOOP)
    rank_dir = tmp_path / "run" / "rank00000"
    deadline = time.monotonic() + 120
    while len(list(rank_dir.glob("step*.h5"))) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    # Writing dominates the loop (8 x 512 KiB saved per step), so the kill most likely lands mid-write.
    time.sleep(0.05)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    shards = sorted(rank_dir.glob("step*.h5"))
    assert len(shards) >= 3
    for shard in shards:
        trace = tl.load(shard)
        assert trace.metadata["complete"] is True and len(trace) == 16  # 8 x (t, addmm)
        assert len(trace.saved.load_all()) == len(trace.saved) > 0
    others = [p.name for p in rank_dir.iterdir() if not p.name.startswith("step")]
    # Anything else is a hidden temporary of the interrupted write, never a file under a shard's name.
    assert all(name.startswith(".step") and ".tmp-" in name for name in others), others


HUNG_RANK = """
    import os, sys, time, torch, torch.distributed as dist, tl_dist as tl
    from pathlib import Path
    out, rank, port = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 1:
        (out / "ready1").touch()
        time.sleep(600)  # never joins the all-reduce: rank 0 hangs in it
    tl.arm(out / "run")
    with tl.capture(step=9):
        x = torch.ones(8).mul(3)
        (out / "ready0").touch()
        dist.all_reduce(x)  # blocks in C++: Python handlers cannot run until it returns
        x.add(1)
"""


@pytest.mark.slow
def test_sigterm_to_rank_hung_in_collective_leaves_evidence(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ranks = [_spawn(tmp_path, HUNG_RANK, str(rank), port) for rank in (0, 1)]
    try:
        _wait_for(tmp_path / "ready0", ranks[0])
        _wait_for(tmp_path / "ready1", ranks[1])
        time.sleep(1.0)  # rank 0 is now blocked inside the all-reduce
        assert ranks[0].poll() is None
        t0 = time.monotonic()
        ranks[0].send_signal(signal.SIGTERM)
        ranks[0].communicate(timeout=60)
        # The watcher thread wrote the post-mortem and SIGTERM's default action still ended the process.
        assert ranks[0].returncode == -signal.SIGTERM
        assert time.monotonic() - t0 < 30
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    trace = tl.load(tmp_path / "run" / "rank00000" / "step00000009.h5")
    assert trace.metadata["complete"] is False and trace.metadata["end_reason"] == "SIGTERM"
    assert (trace.rank, trace.world_size) == (0, 2)
    last = trace[len(trace) - 1]
    assert last.kind == "collective"  # the all-reduce was issued; x.add(1) never ran
    assert "add" not in [op.func for op in trace]
    table = trace.collective_table
    assert table["state"] == ["issued"] and table["op"] == [last.index]
    assert table["group_ranks"] == [(0, 1)]
    # Written by the watcher thread: the stack is the main thread's, blocked in the all-reduce.
    script = tmp_path / "child.py"
    assert (
        trace.metadata["stack_at"]
        == f"{script}:{_line('dist.all_reduce(x)  # blocks', script)} in dist.all_reduce"
    )


@pytest.mark.slow
def test_sigterm_outside_a_window_terminates_without_a_shard(tmp_path):
    body = """
        import sys, time, tl_dist as tl
        from pathlib import Path
        out = Path(sys.argv[1])
        tl.arm(out / "run")
        (out / "ready").touch()
        time.sleep(120)
    """
    proc = _spawn(tmp_path, body)
    _wait_for(tmp_path / "ready", proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    assert list((tmp_path / "run" / "rank00000").iterdir()) == []


ATEXIT_WINDOW = """
    import sys, threading, time, torch, tl_dist as tl
    from pathlib import Path
    out = Path(sys.argv[1])
    tl.arm(out / "run")

    def work():
        with tl.capture(step=4):
            torch.ones(3).add(1)
            (out / "ready").touch()
            time.sleep(60)  # still inside the window when the interpreter exits

    threading.Thread(target=work, daemon=True).start()
    while not (out / "ready").exists():
        time.sleep(0.01)
    sys.exit(0)
"""


@pytest.mark.slow
def test_exit_with_a_window_open_in_another_thread_records_that_threads_stack(tmp_path):
    proc = _spawn(tmp_path, ATEXIT_WINDOW)
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    trace = tl.load(tmp_path / "run" / "rank00000" / "step00000004.h5")
    assert trace.metadata["end_reason"] == "atexit" and trace.metadata["complete"] is False
    script = tmp_path / "child.py"
    assert trace.metadata["stack_at"] == f"{script}:{_line('time.sleep(60)', script)} in time.sleep"
    assert trace.metadata["stack"][-1] == f"{script}:{_line('time.sleep(60)', script)} in work -> time.sleep"


def _line(text: str, path: Path | None = None) -> int:
    """Line number of the first line containing ``text`` in ``path`` (this file by default)."""
    with open(path or __file__) as fh:
        for n, line in enumerate(fh, 1):
            if text in line and "_line(" not in line:
                return n
    raise AssertionError(text)


def test_a_snapshot_is_the_open_windows_trace_so_far_and_the_window_goes_on():
    # What post-mortems write, asked of the capture through its public method (no Capture privates).
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
    x = torch.randn(2, 3)
    with torch.no_grad(), tl.capture() as cap:  # no autograd: no detach of relu's output
        h = model[0](x)  # t, addmm: 2 ops
        # Called inside the root module would leave it open; here the Linear call is already closed.
        part = cap.snapshot()
        model[1](h)
    assert cap.snapshot() is None  # closed
    assert [op.func for op in part] == ["t", "addmm"] and part.failed_op is None
    assert len(cap.trace) == 3 and cap.trace[2].func == "relu"
    assert [(c.type, [op.index for op in c.ops]) for c in part.module_calls()] == [("Linear", [0, 1])]
    assert cap.window is None  # not armed


def test_a_snapshot_ends_the_open_module_calls_at_the_current_op():
    seen = {}

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            y = self.lin(x)  # t, addmm
            seen["part"] = tl_cap[0].snapshot()  # inside the root call, still open
            return y.relu()

    tl_cap, model, x = [], Outer(), torch.randn(2, 3)
    with torch.no_grad(), tl.capture() as cap:  # no autograd: no detach of relu's output
        tl_cap.append(cap)
        model(x)
    part = seen["part"]
    root = part.module_calls("")[0]
    assert len(part) == 2 and [op.func for op in root.ops] == ["t", "addmm"]  # ended at op 2 in the snapshot
    assert [op.func for op in cap.trace.module_calls("")[0].ops] == ["t", "addmm", "relu"]  # the window's own
