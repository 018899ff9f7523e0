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
    assert len(json.loads((tmp_path / "t.json").read_text())["traceEvents"]) > 4
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


def test_summary_of_one_shard_reports_the_other_ranks_missing(tmp_path, capsys):
    run = _run(tmp_path)
    assert main(["summary", str(run / "rank00000" / "step00000000.h5"), "--no-fail"]) == 0
    out = capsys.readouterr().out
    assert "1/2 ranks" in out and "missing_rank: no shard for rank 1 of 2" in out


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
    slices = sorted((e["pid"], e["args"]["step"], e["name"]) for e in events if e["ph"] == "X")
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
