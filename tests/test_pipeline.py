"""tl_dist.pipeline.finish_run: the end-of-run pipeline the Lightning callback and ``tl-dist merge`` share."""

import json
import logging
import shutil
import time

import pytest
from merge_synth import coll, make_trace, write_run

import tl_dist as tl
from tl_dist.pipeline import finish_run

A = "train.py:10"


def _run(tmp_path, *, bad):
    traces = [make_trace(0, [coll(source=A)]), make_trace(1, [coll(source=A, numel=8 if bad else 4)])]
    write_run(tmp_path / "run", traces)
    return tmp_path / "run"


def test_finish_run_writes_merged_timeline_and_logs_the_findings(tmp_path, caplog):
    run = _run(tmp_path, bad=True)
    with caplog.at_level(logging.INFO, logger="tl_dist"):
        out = finish_run(run, merged=run / "merged.h5", timeline=run / "timeline.json")
    g = out.merged
    assert [f.kind for f in g.findings] == ["size_mismatch"]
    assert out.written == [str(run / "merged.h5"), str(run / "timeline.json")]
    reopened = tl.load_merged(run / "merged.h5")
    assert (reopened.steps, reopened.ranks, len(reopened.findings)) == ([0], [0, 1], 1)
    events = json.loads((run / "timeline.json").read_text())
    assert events  # a Perfetto trace, parsed
    records = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert records[0] == ("tl_dist", "INFO", "tl_dist: merged steps [0] of 2 rank(s): 1 finding(s)")
    name, level, table = records[1]
    assert (name, level) == ("tl_dist", "WARNING")
    header, row = table.splitlines()[1:3]
    assert header.split() == ["step", "kind", "ranks", "message"]
    assert row.split()[:3] == ["0", "size_mismatch", "1"]  # the rank whose size differs (numel 8 on rank 1)
    assert row.endswith("sizes differ across ranks: {0: 4, 1: 8}")
    assert records[2] == ("tl_dist", "INFO", f"tl_dist: wrote {run / 'merged.h5'}, {run / 'timeline.json'}")


def test_finish_run_without_a_logger_reports_nothing_and_a_clean_run_logs_no_table(tmp_path, caplog):
    run = _run(tmp_path, bad=False)
    with caplog.at_level(logging.DEBUG):
        out = finish_run(run, logger=None)
    assert out.written == [] and out.merged.findings == [] and caplog.records == []
    with caplog.at_level(logging.DEBUG, logger="tl_dist"):
        finish_run(out.merged)
    assert [r.levelname for r in caplog.records] == ["INFO"]


@pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz's dot")
def test_finish_run_draws_the_last_step_in_the_background(tmp_path):
    run = _run(tmp_path, bad=False)
    out = finish_run(run, graph=True, logger=None)
    assert out.written == [f"{run / 'graph.svg'} (laid out in the background)"]
    assert "digraph" in (run / "graph.dot").read_text()
    deadline = time.monotonic() + 60
    while not (run / "graph.svg").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (run / "graph.svg").read_text().lstrip().startswith("<?xml")


def test_bad_arguments_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="run must be a run folder"):
        finish_run(3)
    g = finish_run(_run(tmp_path, bad=False), logger=None).merged
    with pytest.raises(ValueError, match="graph=True draws the last step from the run's shards"):
        finish_run(g, graph=True)
