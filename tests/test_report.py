"""The HTML run report: its numbers against the traces' columns, the file a user gets (self-contained, within
its size), and the page opened in headless Chromium (no errors, no requests, plots drawn, pixels not blank)."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from report_synth import synthetic_run
from test_views import Net

import tl_dist as tl
from tl_dist.cli import main
from tl_dist.report.data import Run
from tl_dist.report.headline import headline
from tl_dist.schema import OUTSIDE
from tl_dist.telemetry import summarize

pytest.importorskip("plotly", reason="the report needs the tl_dist[report] extra (plotly)")


@pytest.fixture(scope="module")
def small_run():
    # 2 ranks x 2 steps, 4 layers (one all_reduce bucket), rank 1 three times slower, a NaN at step 1 rank 0.
    return synthetic_run(world_size=2, steps=2, layers=4, straggler=1, nan_at=(1, 0))


def _independent_module_ns(trace, address):
    """ns per phase of ``address``'s ops, from the columns alone: forward ops by their module column, backward
    ops by their forward op's, optimizer ops by the parameter they update."""
    cols = trace.columns
    out = {"forward": 0, "backward": 0, "optimizer": 0}
    for i in range(len(trace)):
        phase = cols["phase"][i]
        if phase == "forward":
            mine = cols["module"][i] == address
        elif phase == "backward":
            f = cols["fwd_op"][i]
            mine = f >= 0 and cols["module"][f] == address
        else:
            mine = any(p.rsplit(".", 1)[0] == address for p in cols["params"][i])
        if mine:
            out[phase] += cols["duration_ns"][i]
    return out


def test_numbers(small_run):
    g, traces = small_run
    run = Run.of(g)
    rows = {r["name"]: r for r in run.modules()}
    for k in range(4):
        expected = {"forward": 0, "backward": 0, "optimizer": 0}
        for t in traces.values():
            for phase, ns in _independent_module_ns(t, f"layers.{k}").items():
                expected[phase] += ns
        assert {p: rows[f"layers.{k}"][p] for p in expected} == expected
        # each window: forward t (view), addmm, relu; backward threshold_backward, mm, mm, sum; 2 add_
        assert rows[f"layers.{k}"]["ops"] == 9 * len(traces)
    # The root holds every layer; mse_loss and the all_reduce ran outside every module.
    assert rows["<root>"]["ops"] == 36 * len(traces)
    assert rows[OUTSIDE]["ops"] == 2 * len(traces)
    # The straggler: rank 1 arrives last at the one all_reduce of each step; rank 0 waits for it.
    strag = run.stragglers()
    assert [(s["step"], s["rank"]) for s in strag if s["caused_wait_ns"] > 0] == [(0, 1), (1, 1)]
    # The headline: step 0 holds the longest window (rank 0's, waiting); its straggler, rank 1, held rank 0 up
    # by its caused wait, at the all_reduce (outside every module); its largest phase is its slow backward.
    h = headline(run)
    assert (h["step"], h["rank"], h["straggler"], h["wait_ns"]) == (0, 1, True, strag[0]["caused_wait_ns"])
    assert (h["collective"], h["module"], h["phase"]) == ("all_reduce", OUTSIDE, "backward")
    (c0, c1) = run.collectives()
    # bytes 4 x 262144; duration from rank 0's arrival to completion; 2 ranks: bus factor 2 (n - 1) / n = 1.
    t0 = traces[(0, 0)]
    op = t0.collective_table["op"][0]
    duration = t0.collective_table["complete_ns"][0] - min(
        traces[(0, r)].collective_table["issue_ns"][0] for r in (0, 1)
    )
    assert c0["bytes"] == 1048576 and c0["ns"] == duration
    # busbw: one definition, per (step, rank, kind, group), the numbers StepTelemetry (so OTel) reports; the
    # joined rows carry none (their duration includes the wait for the straggler).
    assert "busbw" not in c0
    assert [(b["step"], b["rank"], b["kind"], b["busbw"]) for b in run.bandwidth()] == [
        (s, r, row.kind, row.busbw)
        for (s, r), t in sorted(traces.items())
        for row in summarize(t).collectives
    ]
    ct = t0.collective_table  # 1 MB in (complete - issue) on rank 0, 2 ranks: bus factor 2 (2 - 1) / 2 = 1
    assert run.bandwidth()[0]["busbw"] == pytest.approx(
        1048576 / ((ct["complete_ns"][0] - ct["issue_ns"][0]) / 1e9)
    )
    assert c0["module"] == OUTSIDE and t0.columns["label"][op] == "all_reduce_1"
    first = run.statistics()["first_nonfinite"]
    assert (first["step"], first["rank"], first["label"], first["of"], first["module"]) == (
        1,
        0,
        "relu_1",
        "grad",
        "layers.0",
    )
    lines = run.statistics()["lines"]
    # The last ReLU of each layer has output norm 10 + k + 0.01 step (same on both ranks).
    assert lines["layers.2 out"] == {0: pytest.approx(12.0), 1: pytest.approx(12.01)}


def test_file_is_self_contained(small_run, tmp_path):
    g, _ = small_run
    path = g.report(tmp_path / "run.html")
    text = Path(path).read_text()
    assert text.startswith("<!DOCTYPE html>") and text.count("<script") == 3  # plotly.js, data, the page's
    # Nothing to fetch: outside the scripts' code, no src= or href= to another document, no stylesheet link.
    markup = re.sub(r"<script([^>]*)>.*?</script>", r"<script\1></script>", text, flags=re.S)
    assert re.search(r"<(script|img|iframe)[^>]* src=", markup) is None and "<link" not in markup
    assert all(h.startswith("#") for h in re.findall(r'<a href="([^"]*)"', markup))
    for section in ("overview", "timeline", "modules", "collectives", "findings", "statistics"):
        assert f'<section id="{section}">' in text
    assert "First non-finite value: step 1, rank 0, relu_1 (grad: 1 NaN, 0 Inf) in layers.0" in text
    # The headline opens the page, above the overview's facts.
    assert text.index('id="tl-headline">Slowest step <b>0</b>') < text.index('class="facts"')


def test_one_trace_one_step(tmp_path):
    with torch.no_grad():
        t = tl.trace(Net().eval(), torch.randn(2, 3, 4, 4))
    text = Path(t.report(tmp_path / "one.html", title="one trace")).read_text()
    assert "<title>one trace</title>" in text
    assert "No collectives were captured." in text and "No statistics recorded" in text
    assert "block.conv1" in text and "No findings" in text
    with pytest.raises(ValueError, match="path: folder .*nowhere does not exist"):
        t.report(tmp_path / "nowhere" / "r.html")
    with pytest.raises(ValueError, match="a report is of a tl.merge_ranks result or a Trace, got list"):
        tl.report.write_report([], tmp_path / "r.html")


def test_cli_report(tmp_path, capsys):
    from merge_synth import coll, make_trace, write_run

    write_run(tmp_path / "run", [make_trace(0, [coll()]), make_trace(1, [coll()])])
    assert main(["report", str(tmp_path / "run"), "-o", str(tmp_path / "r.html")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'r.html'}"
    assert (tmp_path / "r.html").stat().st_size > 1_000_000  # plotly.js inlined


def _check_in_browser(path, plots):
    from browser import open_page, png_pixels

    page = open_page(Path(path))
    probe = page["probe"]
    assert probe["errors"] == [] and not any("Uncaught" in line for line in page["console"])
    assert probe["blocked"] == [] and probe["resources"] == [] and page["requests"] == []
    drawn = {p["id"]: p for p in probe["plots"]}
    assert set(drawn) == plots
    assert all(p["svgs"] >= 1 for p in drawn.values()), drawn
    pixels = png_pixels(page["png"])
    inked = (pixels[..., :3].astype(int).sum(axis=2) < 700).mean()  # not white-ish
    assert inked > 0.02 and len(np.unique(pixels.reshape(-1, pixels.shape[2]), axis=0)) > 50


@pytest.mark.needs("chromium")
def test_browser_check_sees_what_a_page_fetches(tmp_path):
    """The check above is only worth something if it fails on a page that fetches: a script and an image from
    URLs are the page's requests, and those and a fetch() made by the page's own code are each blocked and
    reported (the probe's policy stops fetch() before it is a request)."""
    from browser import open_page

    page = tmp_path / "fetches.html"
    page.write_text(
        '<html><head><title>t</title></head><body><script src="http://example.invalid/a.js"></script>'
        '<img src="https://example.invalid/b.png"><script>fetch("http://example.invalid/c.json")'
        ".catch(function () {});</script></body></html>"
    )
    seen = open_page(page)
    urls = ["http://example.invalid/a.js", "https://example.invalid/b.png", "http://example.invalid/c.json"]
    assert sorted(seen["requests"]) == urls[:2]
    assert sorted(seen["probe"]["blocked"]) == sorted(urls)


@pytest.mark.slow
@pytest.mark.needs("chromium")
def test_run_report_in_chromium(tmp_path):
    g, _ = synthetic_run(world_size=8, steps=3, layers=6, straggler=5, nan_at=(2, 3))
    path = g.report(tmp_path / "run.html")
    plots = {"tl-plot-steptime", "tl-timeline", "tl-totals", "tl-plot-modules", "tl-plot-waits"}
    _check_in_browser(path, plots | {"tl-plot-stragglers", "tl-plot-norm-out", "tl-plot-norm-grad"})


@pytest.mark.slow
@pytest.mark.needs("chromium")
def test_one_trace_report_in_chromium(tmp_path):
    with torch.no_grad():
        t = tl.trace(Net().eval(), torch.randn(2, 3, 4, 4))
    _check_in_browser(
        t.report(tmp_path / "one.html"), {"tl-plot-steptime", "tl-timeline", "tl-totals", "tl-plot-modules"}
    )


@pytest.mark.slow
def test_64_ranks_20_steps_within_20_mb(tmp_path):
    g, _ = synthetic_run(world_size=64, steps=20)
    path = g.report(tmp_path / "big.html")
    assert Path(path).stat().st_size <= 20 * 2**20


def test_large_run_on_disk_reads_a_sample_whole(tmp_path):
    from tl_dist.store import write_shard

    _, traces = synthetic_run(world_size=12, steps=3, layers=4, straggler=5)
    for (step, rank), trace in traces.items():
        folder = tmp_path / "run" / f"rank{rank:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        write_shard(trace, folder / f"step{step:08d}.h5")
    run = Run.of(tl.merge_ranks(tmp_path / "run"))
    # 36 windows > 32: every step of the lowest rank, the straggler and the highest rank.
    assert run.sampled and sorted(run.full) == [(s, r) for s in range(3) for r in (0, 5, 11)]
    rows = {r["name"]: r for r in run.modules()}
    expected = sum(_independent_module_ns(traces[k], "layers.1")["backward"] for k in run.full)
    assert rows["layers.1"]["backward"] == expected
    # Op functions count every window: 4 addmm per window.
    assert {f["func"]: f["calls"] for f in run.funcs()}["addmm"] == 4 * 36
    text = Path(tl.report.write_report(tl.merge_ranks(tmp_path / "run"), tmp_path / "r.html")).read_text()
    assert "Mean over 9 (step, rank) window(s) (of 36: every step of rank(s) 0, 5, 11;" in text


def test_first_nonfinite_is_where_it_arose_not_where_a_collective_brought_it():
    g, traces = synthetic_run(world_size=2, steps=2, layers=4, straggler=1, nan_at=(1, 1))
    t0 = traces[(1, 0)]
    reduce_op = t0.collective_table["op"][0]
    # Rank 0's all-reduce received rank 1's NaN gradient (stats record a collective's result): a NaN on the
    # lower rank, but one another rank made.
    for name, value in zip(t0.stats_table, (reduce_op, "out", reduce_op, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4, 0)):
        t0.stats_table[name].append(value)
    first = Run.of(g).statistics()["first_nonfinite"]
    assert (first["step"], first["rank"], first["label"], first["of"]) == (1, 1, "relu_1", "grad")


def test_the_reports_norms_are_the_module_norms_of_plain_torch():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    model, x = nn.Sequential(Block(), nn.Linear(4, 1)), torch.randn(5, 4)
    want = {}

    def keep(name):
        return lambda mod, args, out: want.__setitem__(name, float(out.detach().double().norm()))

    for name in ("0", "0.fc2", "1"):
        model.get_submodule(name).register_forward_hook(keep(name))
    with tl.capture(stats=True) as cap:
        model(x).sum().backward()
    for name in ("0", "0.fc2", "1"):
        model.get_submodule(name)._forward_hooks.clear()
    lines = Run.of(cap.trace).statistics()["lines"]
    # The block returns fc2's output: its norm, not that of the block's last own op.
    for name in ("0", "0.fc2", "1"):
        assert lines[f"{name} out"][0] == pytest.approx(want[name], rel=1e-6)
    assert {(r.module, r.of): r.norm for r in summarize(cap.trace).norms}[("0", "out")] == lines["0 out"][0]
