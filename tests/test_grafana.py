"""The Grafana dashboard (exporters/grafana/tl_dist.json) against the exporter it reads.

Every panel's and variable's PromQL is parsed (promql-parser, Prometheus' grammar) and each metric and label it
names must be in a real scrape of ``start_prometheus()`` after a captured training step, so the dashboard
cannot drift from the exporter. The JSON's layout and variables are checked as Grafana reads them. With a
Prometheus server on PATH, it scrapes the endpoint and evaluates every query: each returns series, and some
return the exact numbers the captured windows hold.
"""

import collections
import itertools
import json
import math
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from datetime import timedelta
from pathlib import Path

import promql_parser
import pytest
import torch
import torch.distributed as dist
import yaml
from otel_helpers import C10D_NO_AUTOGRAD, AllReduce, Block, Log
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import tl_dist as tl
from tl_dist.exporters.otel import OtelSink, start_prometheus
from tl_dist.telemetry import OUTSIDE

pytestmark = pytest.mark.filterwarnings(C10D_NO_AUTOGRAD)

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "exporters" / "grafana"
DASHBOARD = GRAFANA / "tl_dist.json"
# Labels Prometheus itself puts on every scraped series (the scrape job and target), not the exporter.
TARGET_LABELS = {"job", "instance"}
# Exported only on a GPU whose peak tl_dist knows: absent from a CPU scrape. Name -> labels, as
# docs/telemetry.md's metric table gives them (checked below; test_otel_wire checks that table).
GPU_ONLY = {"tl_step_mfu": {"tl_rank"}}
GRAFANA_BUILTINS = {"__rate_interval", "__range", "__interval", "__all"}
JOB = "tl_dist_test"


def load_dashboard(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Top-level panels and those inside collapsed rows."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(where, expr, legendFormat) of every panel target and every query variable (label_values' selector)."""
    out = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            out.append(
                (f"panel {panel['title']!r} {target['refId']}", target["expr"], target["legendFormat"])
            )
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']!r}", label_values_selector(var["definition"]), ""))
    return out


def label_values_selector(definition: str) -> str:
    match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition.strip(), re.S)
    assert match, f"variable query {definition!r} is not label_values(selector, label)"
    return match[1]


def interpolate(expr: str, *, job: str = JOB, window: str = "5m") -> str:
    """What Grafana sends for this expr: the dashboard's variables at their defaults (rank, module, func: All,
    i.e. their allValue ``.*``), the job given and Grafana's range variables."""
    values = {"job": job, "rank": ".*", "module": ".*", "func": ".*", "window": window}
    values |= {"__rate_interval": window, "__range": window, "__interval": "15s"}

    def one(match: re.Match) -> str:
        name = match[1] or match[2]
        assert name in values, f"{name!r} used in {expr!r} has no value"
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    """Every metric selector of a PromQL expression (range selectors' too), from the parsed tree."""
    found = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def grouping_labels(expr: str) -> set[str]:
    """Labels named by by(...), without(...), on(...), ignoring(...) and group_left/right(...)."""
    found = set()

    def visit(node):
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            found.update(node.modifier.labels)
        if isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                found.update(node.modifier.matching.labels)
            found.update(node.modifier.group_labels or ())

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def parse_exposition(text: str) -> dict[str, list[dict[str, str]]]:
    """sample name -> label sets of a Prometheus text exposition (prometheus_client's own parser)."""
    samples = collections.defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append(dict(sample.labels))
    return samples


# -- a real exporter after captured steps ------------------------------------------------------------------
class Job:
    """A world of one rank (gloo) armed with OtelSink on a start_prometheus() endpoint, and its model."""

    def __init__(self):
        # Block (Linear+ReLU), a Linear, an all_reduce and a log that turns the negative half of its input NaN.
        self.model = nn.Sequential(Block(), nn.Linear(4, 2), AllReduce(), Log())
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.traces = []
        self.prom = start_prometheus(port=0)
        # Shards in a run folder, for the straggler gauges: this rank merges each step (a world of one: nobody
        # waits for anyone, the merge's verdict is "none").
        self.sink = OtelSink(meter_provider=self.prom, spans=None, stragglers=True)
        tl.arm(tempfile.mkdtemp(prefix="tl_grafana_"), sinks=[self.sink])

    def step(self):
        # Gradients set to None: every window runs the same ops (accumulating into .grad would add backward
        # ops from the second window on, whose first window a Prometheus rate cannot see).
        self.opt.zero_grad()
        with tl.capture(step=len(self.traces), stats=True) as cap:
            self.model(torch.randn(3, 4)).sum().backward()
            self.opt.step()
        assert tl.flush()
        assert self.sink.wait_stragglers(timeout=60)
        self.traces.append(cap.trace)

    def scrape(self) -> dict[str, list[dict[str, str]]]:
        return parse_exposition(urllib.request.urlopen(self.prom.url, timeout=10).read().decode())


@pytest.fixture(scope="module")
def job():
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("OTEL_")}
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    j = Job()
    try:
        j.step()
        j.first_scrape = j.scrape()
        yield j
    finally:
        tl.disarm()
        j.prom.shutdown()
        dist.destroy_process_group()
        os.environ.update(saved)


def test_every_query_names_metrics_and_labels_the_exporter_serves(job):
    scraped = job.first_scrape
    # What the step put there: one all_reduce, norms, a NaN (docs/telemetry.md's metric table).
    assert {lb["tl_collective_kind"] for lb in scraped["tl_collective_bytes_total"]} == {"all_reduce"}
    assert {lb["tl_of"] for lb in scraped["tl_tensor_norm"]} == {"out", "grad"}
    nonfinite = {(lb["tl_module"], lb["tl_of"]) for lb in scraped["tl_nonfinite_total"]}
    assert {("3", "out"), (OUTSIDE, "out")} <= nonfinite  # log of a negative; the loss, sum() of it
    # Modules with statistics have their series from the first window, at 0 (so a first NaN alerts).
    assert {(lb["tl_module"], lb["tl_of"]) for lb in scraped["tl_tensor_norm"]} <= nonfinite
    assert job.traces[0].metadata.get("device_name", "") == ""  # on CPU: no peak, so no tl_step_mfu
    assert not GPU_ONLY.keys() & set(scraped)
    docs = (ROOT / "docs" / "telemetry.md").read_text().splitlines()
    for name, labels in GPU_ONLY.items():
        (row,) = [line for line in docs if f"| `{name}` |" in line]
        assert all(f"`{label.replace('_', '.')}`" in row for label in labels), row

    dashboard = load_dashboard()
    named = set()
    for where, expr, legend in queries(dashboard):
        query_labels = set(TARGET_LABELS)
        for sel in selectors(interpolate(expr)):
            assert sel.name, f"{where}: a selector without a metric name: {sel}"
            named.add(sel.name)
            if sel.name in GPU_ONLY:
                query_labels |= GPU_ONLY[sel.name]
                continue
            assert sel.name in scraped, f"{where}: {sel.name} is not in a scrape of the exporter"
            series = scraped[sel.name]
            labels = set().union(*series) | TARGET_LABELS
            query_labels |= labels
            for m in sel.matchers.matchers:
                assert m.name in labels, (
                    f"{where}: {sel.name} has no label {m.name!r} (it has {sorted(labels)})"
                )
                if m.op == promql_parser.MatchOp.Equal and m.name not in TARGET_LABELS:
                    values = {lb.get(m.name) for lb in series}
                    assert m.value in values, f"{where}: {sel.name}{{{m.name}={m.value!r}}} never exported"
        for label in grouping_labels(interpolate(expr)) | set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend)):
            assert label in query_labels, f"{where}: label {label!r} is on none of the query's metrics"
    # The panels: step time, FLOP/s, MFU, phases, modules, op time and calls, collectives, norms, non-finite.
    assert named == {
        "tl_step_duration_seconds_count", "tl_step_duration_seconds_sum", "tl_step_flops_per_second",
        "tl_step_mfu", "tl_op_time_seconds_total", "tl_op_calls_total",
        "tl_module_duration_seconds_sum", "tl_module_duration_seconds_count",
        "tl_collective_duration_seconds_sum", "tl_collective_duration_seconds_count",
        "tl_collective_duration_seconds_bucket", "tl_collective_busbw_bytes_per_second",
        "tl_collective_bytes_total", "tl_tensor_norm", "tl_nonfinite_total", "target_info",
        "tl_step_straggler_rank", "tl_step_straggler_wait_seconds",
    }  # fmt: skip


def test_panel_promql_checker_catches_a_misspelt_metric_and_label(job):
    scraped = job.first_scrape
    (sel,) = selectors(
        interpolate('sum by (tl_rank) (rate(tl_step_duration_second_sum{job="$job"}[$window]))')
    )
    assert sel.name == "tl_step_duration_second_sum" and sel.name not in scraped
    (sel,) = selectors('tl_tensor_norm{tl_of="grads"}')
    assert {m.value for m in sel.matchers.matchers} == {"grads"}
    assert "grads" not in {lb["tl_of"] for lb in scraped["tl_tensor_norm"]}
    assert grouping_labels("sum by (tl_kind) (x) / on (a) group_left (b) y") == {"tl_kind", "a", "b"}
    with pytest.raises(ValueError):
        promql_parser.parse(interpolate("sum(rate(tl_step_flops_total[$window])"))  # unbalanced parenthesis


# -- the JSON as Grafana reads it -------------------------------------------------------------------------
def overlaps(panels: list[dict]) -> list[tuple[str, str]]:
    def cells(p):
        g = p["gridPos"]
        return {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}

    return [(a["title"], b["title"]) for a, b in itertools.combinations(panels, 2) if cells(a) & cells(b)]


def layout_problems(dashboard: dict) -> list[str]:
    panels = all_panels(dashboard)
    problems = []
    ids = collections.Counter(p["id"] for p in panels)
    problems += [f"panel id {i} used {n} times" for i, n in ids.items() if n > 1]
    for p in panels:
        g = p["gridPos"]
        if not (g["x"] >= 0 and g["y"] >= 0 and g["w"] >= 1 and g["h"] >= 1 and g["x"] + g["w"] <= 24):
            problems.append(f"{p['title']!r} at {g} is outside the 24 columns")
    problems += [f"{a!r} overlaps {b!r}" for a, b in overlaps(dashboard["panels"])]
    return problems


def variables_used(dashboard: dict) -> set[str]:
    text = json.dumps({k: v for k, v in dashboard.items() if k != "templating"})
    text += json.dumps(
        [{k: v for k, v in var.items() if k != "name"} for var in dashboard["templating"]["list"]]
    )
    return {a or b or c for a, b, c in re.findall(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", text)}


def test_layout_ids_and_variables():
    dashboard = load_dashboard()
    assert layout_problems(dashboard) == []
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert {"job", "rank"} <= set(variables)
    used = variables_used(dashboard)
    assert used - GRAFANA_BUILTINS <= set(variables), used - GRAFANA_BUILTINS - set(variables)
    assert set(variables) <= used, f"variables nobody uses: {set(variables) - used}"
    ds = {"type": "prometheus", "uid": "${datasource}"}
    for panel in all_panels(dashboard):
        if panel["type"] != "row":  # every query goes to the chosen Prometheus, none to a fixed uid
            assert panel["datasource"] == ds, panel["title"]
            assert all(t["datasource"] == ds for t in panel["targets"]), panel["title"]
            assert panel["description"] and panel["targets"], panel["title"]
    # Counters and bucket counts count captured windows only: the panels showing them say so.
    for panel in all_panels(dashboard):
        if any("_total" in t["expr"] or t.get("format") == "heatmap" for t in panel.get("targets", [])):
            assert "captured windows only" in panel["description"], panel["title"]
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36


def test_layout_check_catches_overlaps_duplicate_ids_and_overflow(tmp_path):
    dashboard = load_dashboard()
    first, second = [p for p in dashboard["panels"] if p["type"] != "row"][:2]
    second["gridPos"] = dict(first["gridPos"], x=first["gridPos"]["x"] + 1)  # one column to the right
    second["id"] = first["id"]
    dashboard["panels"][-1]["gridPos"]["w"] = 25
    assert layout_problems(dashboard) == [
        f"panel id {first['id']} used 2 times",
        f"{dashboard['panels'][-1]['title']!r} at {dashboard['panels'][-1]['gridPos']} is outside the 24 columns",
        f"{first['title']!r} overlaps {second['title']!r}",
    ]
    dashboard = load_dashboard()
    dashboard["panels"][1]["targets"][0]["expr"] += " * $scale"
    assert "scale" in variables_used(dashboard)


def test_provisioning_files_point_at_the_dashboard():
    docs = (ROOT / "docs" / "grafana.md").read_text()
    (provider,) = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "tl_dist.yaml").read_text())[
        "providers"
    ]
    assert provider["type"] == "file"
    assert provider["options"]["path"] in docs  # where the docs say to put tl_dist.json
    (source,) = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "tl_dist.yaml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["url"].startswith("http")
    assert "exporters/grafana/tl_dist.json" in (ROOT / "README.md").read_text()


def test_the_wheel_carries_the_grafana_files_and_builds_without_warnings(tmp_path):
    # A real wheel build of a copy of the package (pip, no network: no deps, no build isolation). setuptools
    # used to print its BuildBackendWarning ~50 lines each for the three data folders missing from `packages`.
    import shutil
    import sys
    import zipfile

    src = tmp_path / "src"
    for folder in ("tl_dist", "exporters", "integrations"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    cmd += ["--disable-pip-version-check"]
    proc = subprocess.run(
        cmd + ["-w", str(tmp_path / "wheel"), str(src)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "BuildBackendWarning" not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[:3000]
    (wheel,) = (tmp_path / "wheel").glob("tl_dist-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    grafana = {str(p.relative_to(ROOT / "exporters")) for p in GRAFANA.rglob("*") if p.is_file()}
    assert len(grafana) == 3  # the dashboard and its two provisioning files
    assert {f"tl_dist/exporters/{p}" for p in grafana} <= names
    # The compiled per-op path is built into the wheel when a C compiler is there (it is here).
    assert any(n.startswith("tl_dist/_fastop.") and n.endswith((".so", ".pyd")) for n in names), sorted(names)


# -- a real Prometheus evaluates every query --------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus server on 127.0.0.1 scraping one endpoint every 300 ms, with its TSDB in ``folder``."""

    def __init__(self, folder: Path, target_url: str):
        target = urllib.parse.urlsplit(target_url)
        config = {
            "global": {"scrape_interval": "300ms", "scrape_timeout": "300ms"},
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [target.netloc]}]}],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'tsdb'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=open(folder / "prometheus.log", "w"),
        )  # fmt: skip
        self.log = folder / "prometheus.log"

    def get(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, **params) -> list[dict]:
        return self.get("/api/v1/query", query=expr, **params)["result"]

    def wait(self, what, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if what():
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.1)
        raise AssertionError(f"Prometheus: timed out; log: {self.log.read_text()}")

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def value(result: list[dict], **labels) -> float:
    found = [float(r["value"][1]) for r in result if all(r["metric"].get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (labels, result)
    return found[0]


@pytest.mark.needs("prometheus")
def test_prometheus_evaluates_every_query_to_the_windows_numbers(job, tmp_path):
    prom = Prometheus(tmp_path, job.prom.url)
    try:

        def seen_all_windows() -> bool:  # (none: not scraped yet, or the last scrape failed)
            found = prom.query(f'tl_step_duration_seconds_count{{job="{JOB}"}}')
            return bool(found) and float(found[0]["value"][1]) == len(job.traces)

        prom.wait(seen_all_windows)
        for _ in range(3):  # each window lands in its own scrape: rates over them see all three
            job.step()
            prom.wait(seen_all_windows)
        # Every query at the last scrape, over a range from 1 ms before the first scrape (which saw window 0
        # only): rate() then extrapolates every series by the same 1 ms, and means and ratios are exact.
        (scrapes,) = prom.query(f'tl_step_duration_seconds_count{{job="{JOB}"}}[5m]')
        (first, _), (last, _) = scrapes["values"][0], scrapes["values"][-1]
        assert [v for _, v in scrapes["values"]][:: len(scrapes["values"]) - 1] == ["1", "4"]
        window = f"{round((last - first) * 1000) + 1}ms"
        dashboard = load_dashboard()
        results = {}
        for where, expr, _ in queries(dashboard):
            sent = interpolate(expr, window=window)
            if where.startswith("variable"):
                name = re.search(r"'(\w+)'", where)[1]
                var = next(v for v in dashboard["templating"]["list"] if v["name"] == name)
                label = re.fullmatch(r"label_values\(.+,\s*(\w+)\)", var["definition"], re.S)[1]
                results[where] = prom.get(f"/api/v1/label/{label}/values", **{"match[]": sent})
            else:
                results[where] = prom.query(sent, time=last)
    finally:
        prom.close()
    gpu_only = {
        w for w, e, _ in queries(dashboard) if any(s.name in GPU_ONLY for s in selectors(interpolate(e)))
    }
    assert gpu_only == {"panel 'MFU (mean of ranks)' A", "panel 'MFU per rank' A"}
    for where, result in results.items():
        if where in gpu_only:
            assert result == [], where  # CPU windows: no MFU (the panels say so)
        else:
            assert result, f"{where}: Prometheus returned no series"
            assert all(not math.isnan(float(r["value"][1])) for r in result if "value" in r), (where, result)
    assert results["variable 'job'"] == [JOB]
    assert results["variable 'rank'"] == ["0"]

    # The numbers, from the three windows Prometheus saw change (the first one was there before it started).
    seen = job.traces[1:]
    wall = [t.metadata["window_end_ns"] - t.metadata["window_start_ns"] for t in seen]
    assert value(results["panel 'Step time per rank' A"], tl_rank="0") == pytest.approx(
        sum(wall) / 3e9, rel=1e-6
    )
    assert value(results["panel 'Step time' A"]) == pytest.approx(sum(wall) / 3e9, rel=1e-6)

    def op_ns(trace, **match):
        cols = trace.columns
        return sum(
            d for i, d in enumerate(cols["duration_ns"]) if all(cols[k][i] == v for k, v in match.items())
        )

    phases = results["panel 'Op time per step by phase' A"]
    for phase in ("forward", "backward", "optimizer"):
        expected = sum(op_ns(t, phase=phase) for t in seen) / 3e9
        assert value(phases, tl_phase=phase) == pytest.approx(expected, rel=1e-6), phase
    ops = results["panel 'Slowest op funcs' B"]
    # Two addmm a window: Block's Linear and the Linear.
    assert value(ops, tl_op_func="addmm", tl_phase="forward") == pytest.approx(2)
    seconds = results["panel 'Slowest op funcs' A"]
    expected = sum(op_ns(t, func="addmm", phase="forward") for t in seen) / 3e9
    assert value(seconds, tl_op_func="addmm", tl_phase="forward") == pytest.approx(expected, rel=1e-6)
    assert value(results["panel 'Captured windows' A"]) == 4
    # The straggler panels read the merge's verdict: in a world of one nobody waits (rank -1, shown "none").
    verdicts = [job.sink.step_stragglers[s].late for s in range(len(job.traces))]
    assert verdicts == [None] * len(job.traces)
    assert value(results["panel 'Straggler of the last captured step' A"]) == -1
    assert value(results["panel 'Straggler wait' A"]) == 0
    assert value(results["panel 'Ranks reporting' A"]) == 1
    # Two NaN outputs per window (the log, the loss summing it), four windows.
    assert value(results["panel 'Non-finite values' A"]) == 8
    nonfinite = results["panel 'Non-finite values per module' A"]
    assert {(r["metric"]["tl_module"], r["metric"]["tl_of"]) for r in nonfinite} == {
        ("3", "out"),
        (OUTSIDE, "out"),
    }
    # FLOP/s: the last window's FLOPs (per op, from its trace) over its wall time.
    last = job.traces[-1]
    flops = sum(last.columns["flops"])
    fps = flops / ((last.metadata["window_end_ns"] - last.metadata["window_start_ns"]) / 1e9)
    assert value(results["panel 'FLOP/s per rank' A"], tl_rank="0") == pytest.approx(fps, rel=1e-6)
    # The outermost module's forward: every forward op inside a module (all but the loss's sum).
    rows = results["panel 'Slowest modules' A"]
    assert {r["metric"]["tl_module"] for r in rows} >= {"<root>", "0", "0.lin", "1", OUTSIDE}
    inside = sum(
        d
        for t in seen
        for d, phase, stack in zip(t.columns["duration_ns"], t.columns["phase"], t.columns["module_stack"])
        if phase == "forward" and stack
    )
    assert value(rows, tl_module="<root>", tl_phase="forward") == pytest.approx(inside / 3e9, rel=1e-6)
    # One all_reduce a window: its mean issue -> completion time.
    waits = [
        c - i for t in seen for i, c in zip(t.collective_table["issue_ns"], t.collective_table["complete_ns"])
    ]
    assert len(waits) == 3
    durations = results["panel 'Collective duration by kind' A"]
    assert value(durations, tl_collective_kind="all_reduce") == pytest.approx(sum(waits) / 3e9, rel=1e-6)
