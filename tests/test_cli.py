"""The tl-dist console script on hand-written shards (run as a real subprocess where the exit code matters)."""

import json
import subprocess
import sys

import pytest
from external import have
from merge_synth import coll, make_trace, write_run

from tl_dist.cli import main

A = "train.py:10"


def _run(tmp_path, bad=False):
    s1 = [coll(source=A, numel=8 if bad else 4)]
    write_run(tmp_path / "run", [make_trace(0, [coll(source=A)]), make_trace(1, s1)])
    return tmp_path / "run"


def test_clean_merge_exits_zero_and_saves(tmp_path, capsys):
    run = _run(tmp_path)
    assert main(["merge", str(run), "-o", str(tmp_path / "m.h5"), "--quiet"]) == 0
    assert "0 findings" in capsys.readouterr().out
    assert main(["summary", str(tmp_path / "m.h5")]) == 0
    assert "no findings" in capsys.readouterr().out


def test_findings_give_exit_one_unless_no_fail(tmp_path):
    run = _run(tmp_path, bad=True)
    cmd = [sys.executable, "-m", "tl_dist.cli", "merge", str(run)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "size_mismatch" in proc.stdout and "--no-fail" in proc.stderr
    assert subprocess.run(cmd + ["--no-fail"], capture_output=True, timeout=120).returncode == 0


@pytest.mark.needs("dot", optional=True)
def test_export_draw_and_errors(tmp_path, capsys):
    run = _run(tmp_path)
    assert main(["export", str(run), "--perfetto", str(tmp_path / "t.json")]) == 0
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    # per rank: a process name, the two ops (mm, then the all_reduce) as slices on the forward track, and the
    # collective in flight on its own lane; one flow joins the two ranks' collectives, from rank 0 to rank 1
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    slices = [(e["pid"], e["name"]) for e in events if e["ph"] == "X"]
    per_rank = ["mm_1", "all_reduce_1", "all_reduce seq 1"]
    assert slices == [(r, name) for r in (0, 1) for name in per_rank]
    flows = [(e["ph"], e["pid"], e["name"]) for e in events if e["ph"] in ("s", "t", "f")]
    assert flows == [("s", 0, "all_reduce seq 1"), ("f", 1, "all_reduce seq 1")]
    if have("dot"):
        assert main(["draw", str(run), "-o", str(tmp_path / "g.svg")]) == 0
        assert (tmp_path / "g.svg").read_text().count("<svg") == 1
    else:
        assert main(["draw", str(run), "-o", str(tmp_path / "g.svg")]) == 2
        assert "Install Graphviz" in capsys.readouterr().err and not (tmp_path / "g.svg").exists()
    assert main(["summary", str(tmp_path / "nope")]) == 2
    assert "nope: no such file" in capsys.readouterr().err
    (run / "rank00001" / "step00000000.h5").unlink()
    assert main(["merge", str(run)]) == 2
    assert main(["merge", str(run), "--lenient"]) == 1
    assert main(["merge", str(run), "--lenient", "--no-fail"]) == 0


def _cli(*args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "tl_dist.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        **kwargs,
    )


@pytest.mark.needs("dot", optional=True)
def test_summary_and_draw_of_one_shard_show_that_shards_trace(tmp_path, capsys):
    run = _run(tmp_path)
    shard = run / "rank00001" / "step00000000.h5"
    assert main(["summary", str(shard)]) == 0
    out = capsys.readouterr().out
    # rank 1's own trace: its 2 ops (mm, all_reduce), no merge and no missing_rank finding.
    assert out.startswith("tl_dist trace of rank 1/2 step 0: 2 ops, 0 module calls")
    assert "missing_rank" not in out
    assert main(["export", str(shard), "--perfetto", str(tmp_path / "one.json")]) == 0
    events = json.loads((tmp_path / "one.json").read_text())["traceEvents"]
    assert [e["name"] for e in events if e["ph"] == "X" and e["cat"] != "comm"] == ["mm_1", "all_reduce_1"]
    if have("dot"):
        assert main(["draw", str(shard), "-o", str(tmp_path / "one.svg")]) == 0
        assert "all_reduce_1" in (tmp_path / "one.svg").read_text()
    # `merge` of one shard still merges it: the other rank is missing from the merge, but not dead: its shard
    # is in the sibling folder, and the finding says so.
    assert main(["merge", str(shard), "--no-fail"]) == 0
    out = capsys.readouterr().out
    assert (
        "missing_rank: no shard for rank 0 of 2: not among the 1 shard path(s) given, but beside them: "
        f"{run / 'rank00000' / 'step00000000.h5'} (merge the run directory {run} to include them)"
    ) in out
    assert "died" not in out
    # --step / --rank pick parts of a run; one shard has none to pick.
    assert main(["summary", str(shard), "--rank", "1"]) == 2
    assert "--step / --rank select part of a run directory or a merged .h5; this is one shard" in (
        capsys.readouterr().err
    )


def test_a_saved_trace_is_read_by_the_cli(tmp_path, capsys):
    import torch

    import tl_dist as tl

    path = tl.trace(torch.nn.Linear(3, 2), torch.randn(4, 3)).save(tmp_path / "model.h5")
    assert main(["summary", path]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    # t (3x2) and addmm (4x2), both saved: 6 + 8 float32 = 56 bytes; the Linear's 4x3x2 matmul: 48 FLOPs.
    assert first.startswith("tl_dist trace: 2 ops, 1 module calls, ") and first.endswith(
        "48 FLOP, 2 saved ops (56 B)"
    )
    # Merging it, or an empty folder: the message names the path and what was expected, not merge_ranks'
    # Python argument (path_or_paths).
    assert main(["merge", path]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"tl-dist: error: {path} is not named rank{{R}}/step{{S}}.h5 as tl.arm writes shards (a saved trace: open "
        "it with tl.load)\n"
    )
    (tmp_path / "empty").mkdir()
    assert main(["merge", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "path_or_paths" not in err and f"{tmp_path / 'empty'} holds no shards (expected" in err


def test_version_and_errors_name_flags(tmp_path):
    proc = _cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == "tl-dist 0.1.0"
    run = _run(tmp_path)
    (run / "rank00001" / "step00000000.h5").unlink()
    proc = _cli("merge", run)
    assert proc.returncode == 2
    assert "pass --lenient to merge the other ranks" in proc.stderr and "strict=False" not in proc.stderr
    proc = _cli("draw", run, "-o", tmp_path / "g.svg", "--depth", "-1")
    assert (
        proc.returncode == 2
        and "argument --depth: expected auto, all or a non-negative int; got '-1'" in proc.stderr
    )
    proc = _cli("draw", run, "-o", tmp_path / "g.svg", "--phase", "fwd")
    assert proc.returncode == 2 and "argument --phase: invalid choice: 'fwd'" in proc.stderr


def test_closed_pipe_exits_quietly(tmp_path):
    run = _run(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tl_dist.cli", "summary", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # as `| head` does once it has its lines: every write now fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == ""


def test_an_incomplete_shard_fails_the_merge(tmp_path, capsys):
    # Every collective matched, but rank 1's window was cut short by SIGTERM: that alone is a finding.
    ended = {"end_reason": "SIGTERM", "stack_at": "/job/train.py:42 in time.sleep"}
    traces = [
        make_trace(0, [coll(source=A)]),
        make_trace(1, [coll(source=A)], complete=False, metadata=ended),
    ]
    write_run(tmp_path / "run", traces)
    assert main(["merge", str(tmp_path / "run"), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert (
        "incomplete_shard: rank 1's window ended early: SIGTERM; it was at /job/train.py:42 in time.sleep"
        in out
    )


def test_step_and_rank_filters(tmp_path, capsys):
    traces = [
        make_trace(r, [coll(source=A, group=(0, 1, 2))], world_size=3, step=s)
        for s in (10, 20)
        for r in range(3)
    ]
    write_run(tmp_path / "run", traces)
    run = str(tmp_path / "run")
    assert main(["summary", run, "--step", "20", "--rank", "0,2"]) == 0
    assert "tl_dist merged trace: 2/3 ranks, steps [20], 4 ops, 1 collectives" in capsys.readouterr().out
    assert main(["export", run, "--perfetto", str(tmp_path / "t.json"), "--rank", "1-2", "--step", "10"]) == 0
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {1, 2}
    assert {e["args"]["step"] for e in events if e["ph"] == "X"} == {10}
    assert main(["export", run, "--perfetto", str(tmp_path / "all.json")]) == 0
    events = json.loads((tmp_path / "all.json").read_text())["traceEvents"]
    ops = [e for e in events if e["ph"] == "X" and e["cat"] not in ("module", "comm", "wait")]
    slices = sorted((e["pid"], e["args"]["step"], e["name"]) for e in ops)
    assert slices == sorted((r, s, op) for r in range(3) for s in (10, 20) for op in ("mm_1", "all_reduce_1"))
    assert main(["merge", run, "-o", str(tmp_path / "m.h5"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["summary", str(tmp_path / "m.h5"), "--rank", "1"]) == 0  # a merged file filters the same way
    assert "1/3 ranks, steps [10, 20]" in capsys.readouterr().out
    assert main(["summary", run, "--step", "30"]) == 2
    assert "no shards for steps=[30], ranks=all: the shards have steps [10, 20]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["summary", run, "--rank", "3-1"])
    assert exc.value.code == 2 and "A <= B" in capsys.readouterr().err
