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
    # per rank: a process name, and the two ops (mm, then the all_reduce) as slices; one flow joins the
    # two all_reduce_1 slices, from rank 0 to rank 1
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    slices = [(e["pid"], e["name"]) for e in events if e["ph"] == "X"]
    assert slices == [(0, "mm_1"), (0, "all_reduce_1"), (1, "mm_1"), (1, "all_reduce_1")]
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


def test_summary_of_one_shard_reports_the_other_ranks_missing(tmp_path, capsys):
    run = _run(tmp_path)
    assert main(["summary", str(run / "rank00000" / "step00000000.h5"), "--no-fail"]) == 0
    out = capsys.readouterr().out
    assert "1/2 ranks" in out and "missing_rank: no shard for rank 1 of 2" in out
