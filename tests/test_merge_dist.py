"""The merge on real multi-process gloo runs: a clean run over every collective kind, DDP and FSDP2, and a fault
matrix where each run gets exactly the right finding at the right op. Each case is its own 2-rank run.

Faulty collectives go through a second group with a short timeout, so a rank stuck waiting for its peer
raises within seconds (an exception inside an armed window writes an incomplete shard naming the in-flight
op), while the default group keeps the launcher's long timeout for setup and teardown.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks

import tl_dist as tl

pytestmark = pytest.mark.slow
FAULT_TIMEOUT = timedelta(seconds=3)


class _Killed(Exception):
    pass


def _raise_killed(signum, frame):
    raise _Killed()


def _fault_body(rank, world_size, out_dir, case):
    """One rank of a faulty run. Returns what the test checks besides the shards."""
    signal.signal(signal.SIGTERM, _raise_killed)  # arm chains to it: the post-mortem shard, then _Killed
    tl.arm(out_dir / "run")
    group = dist.new_group([0, 1], timeout=FAULT_TIMEOUT)
    a, b = torch.ones(4), torch.ones(4) * 2
    error = ""
    try:
        with tl.capture(step=1):
            dist.all_reduce(a, group=group)  # seq 1: fine on every case
            if case == "size":
                # gloo aborts the process when it receives more bytes than it expects, so the receiver's
                # buffer is the larger one: it gets 16 of 24 bytes and carries on.
                dist.broadcast(torch.ones(4 if rank == 0 else 6), src=0, group=group)
            elif case == "dtype":
                # Same byte count (4 x float32 vs 2 x float64): gloo completes it, silently mixing the bytes.
                x = torch.ones(4) if rank == 0 else torch.ones(2, dtype=torch.float64)
                dist.broadcast(x, src=0, group=group)
            elif case == "type":
                if rank == 0:
                    dist.all_reduce(b, group=group)
                else:
                    dist.broadcast(b, src=1, group=group)
            elif case == "skip":
                if rank == 0:
                    dist.all_reduce(b, group=group)  # rank 1 skips this one
                dist.all_reduce(a * 3, group=group)
            elif case == "order":
                # The same two code paths, run in a different order (as when ranks iterate a set differently).
                def reduce_a():
                    dist.all_reduce(a, group=group)

                def reduce_b():
                    dist.all_reduce(b, group=group)

                for fn in (reduce_a, reduce_b) if rank == 0 else (reduce_b, reduce_a):
                    fn()
            elif case == "hang":
                if rank == 0:
                    dist.all_reduce(b, group=group)  # rank 1 never joins: times out, incomplete shard
                else:
                    (out_dir / "rank1.pid").write_text(str(os.getpid()))
                    time.sleep(60)  # hangs until rank 0 gives up and kills it
            dist.all_reduce(a, group=group)
    except _Killed:
        error = "killed"
    except RuntimeError as exc:  # gloo's timeout / size check
        error = type(exc).__name__
    if case == "hang" and rank == 0:
        pid_file = out_dir / "rank1.pid"
        for _ in range(100):
            if pid_file.exists():
                break
            time.sleep(0.05)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
    tl.disarm()
    return {"error": error}


def _merge_case(tmp_path, case):
    results = run_ranks(_fault_body, world_size=2, tmp_path=tmp_path, args=(case,), timeout=60)
    g = tl.merge_ranks(tmp_path / "run")
    primary = [f for f in g.findings if f.primary and f.group == (0, 1)]
    return g, primary, results


def test_size_mismatch_run(tmp_path):
    g, primary, _ = _merge_case(tmp_path, "size")
    assert [(f.kind, f.seq) for f in primary] == [("size_mismatch", 2)], g.summary()
    assert {r: w["label"] for r, w in primary[0].where.items()} == {0: "broadcast_1", 1: "broadcast_1"}
    assert primary[0].where[1]["source"].endswith(f"test_merge_dist.py:{_line('4 if rank == 0 else 6')}")


def test_dtype_mismatch_run(tmp_path):
    g, primary, _ = _merge_case(tmp_path, "dtype")
    assert [(f.kind, f.seq) for f in primary] == [("dtype_mismatch", 2)], g.summary()


def test_different_collective_run(tmp_path):
    g, primary, _ = _merge_case(tmp_path, "type")
    assert [(f.kind, f.seq) for f in primary] == [("type_mismatch", 2)], g.summary()
    assert primary[0].where[0]["func"] == "all_reduce" and primary[0].where[1]["func"] == "broadcast"


def test_skipped_collective_run(tmp_path):
    g, primary, _ = _merge_case(tmp_path, "skip")
    assert [(f.kind, f.seq, f.ranks) for f in primary] == [("missing", 2, (1,))], g.summary()
    assert primary[0].where[0]["source"].endswith(f":{_line('rank 1 skips this one')}")
    assert primary[0].where[1]["absent"]


def test_swapped_order_run(tmp_path):
    g, primary, _ = _merge_case(tmp_path, "order")
    assert [f.kind for f in primary] == ["order"], g.summary()
    assert {w["seq"] for w in primary[0].where.values()} == {2, 3}


def test_hang_run_not_completed_from_incomplete_shards(tmp_path):
    g, primary, results = _merge_case(tmp_path, "hang")
    assert results[1]["error"] == "killed" and results[0]["error"]
    assert g.incomplete == {(1, 0), (1, 1)}
    assert [(f.kind, f.seq, f.ranks) for f in primary] == [("not_completed", 2, (1,))], g.summary()
    where = primary[0].where
    assert where[0]["label"] == "all_reduce_2" and where[0]["source"].endswith(
        f":{_line('rank 1 never joins')}"
    )
    assert where[1]["absent"] and where[1]["last_label"] == "all_reduce_1"


def test_deleted_and_corrupt_shards(tmp_path):
    run_ranks(_fault_body, world_size=2, tmp_path=tmp_path, args=("none",), timeout=60)
    shard = tmp_path / "run" / "rank00001" / "step00000001.h5"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 3])  # truncated
    with pytest.raises(tl.MergeError, match="rank00001"):
        tl.merge_ranks(tmp_path / "run")
    g = tl.merge_ranks(tmp_path / "run", strict=False)
    assert [(f.kind, f.ranks) for f in g.findings] == [("unreadable_shard", (1,))]
    shard.unlink()
    with pytest.raises(tl.MergeError, match=r"no shard for rank\(s\) \[1\]"):
        tl.merge_ranks(tmp_path / "run")
    g = tl.merge_ranks(tmp_path / "run", strict=False)
    assert [(f.kind, f.ranks) for f in g.findings] == [("missing_rank", (1,))]
    assert g.ranks == [0] and len(g.rank(0).collective_table["op"]) == 2


def _line(text: str) -> int:
    with open(__file__) as fh:
        for n, line in enumerate(fh, 1):
            if text in line and "_line(" not in line:
                return n
    raise AssertionError(text)
