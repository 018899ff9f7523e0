"""The report's HTML: one file with its CSS, its data and plotly.js inline, so it opens offline and no request
leaves the page. Tables are plain HTML; plots are plotly figures built in the page from inline JSON."""

from __future__ import annotations

import html
import importlib.util
import json
from pathlib import Path
from typing import Any

from ..errors import MissingToolError
from ..schema import PHASES
from ..views.summary import format_bytes, format_count, format_ns
from .data import Run, short_source
from .headline import headline

MAX_BANDWIDTH_ROWS = 200  # per (step, rank, kind, group) busbw rows shown
_COLOURS = {"compute": "#4e79a7", "comm": "#f28e2b", "wait": "#e15759"}
_PHASE_COLOURS = {"forward": "#4e79a7", "backward": "#f28e2b", "optimizer": "#76b7b2", "recompute": "#59a14f"}
_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 0; color: #222; }
header { background: #1f4e79; color: #fff; padding: 14px 24px; }
header h1 { margin: 0; font-size: 20px; }
nav { background: #eef3f8; padding: 6px 24px; position: sticky; top: 0; z-index: 5; border-bottom: 1px solid #cdd; }
nav a { margin-right: 16px; color: #1f4e79; text-decoration: none; }
main { padding: 0 24px 40px; max-width: 1500px; }
section { margin-top: 28px; }
h2 { border-bottom: 2px solid #1f4e79; padding-bottom: 4px; font-size: 18px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
table { border-collapse: collapse; margin: 6px 0 12px; font-size: 13px; }
th, td { border: 1px solid #d5dbe1; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f6f9; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.facts td:first-child { font-weight: 600; background: #f8fafc; }
.plot { width: 100%; min-height: 260px; }
.note { color: #555; font-size: 13px; }
.headline { font-size: 17px; background: #fff6e0; border-left: 4px solid #e15759; padding: 8px 12px; }
.bad { color: #b00020; font-weight: 600; }
.consequence { color: #777; }
"""
_SCRIPT = """
(function () {
  var figures = JSON.parse(document.getElementById("tl-figures").textContent);
  var config = {responsive: true, displaylogo: false};
  Object.keys(figures.static).forEach(function (id) {
    var f = figures.static[id];
    Plotly.newPlot(id, f.data, f.layout, config);
  });
  var select = document.getElementById("tl-step");
  function showStep() {
    ["timeline", "totals"].forEach(function (name) {
      var f = figures[name][select.value];
      Plotly.react("tl-" + name, f.data, f.layout, config);
    });
  }
  if (select) { select.addEventListener("change", showStep); showStep(); }
})();
"""


def plotly_js() -> str:
    """plotly.js as shipped in the ``plotly`` package (the ``tl_dist[report]`` extra)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise MissingToolError(
            "the HTML report needs plotly (its plotly.js is inlined): pip install 'tl_dist[report]' or pip "
            "install plotly"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise MissingToolError(f"plotly is installed but {path} is missing; reinstall plotly")
    return path.read_text(encoding="utf-8")


def _ms(ns: float) -> float:
    return round(ns / 1e6, 4)


def _rate(flops: float, ns: float) -> str:
    return format_count(flops / (ns / 1e9), "FLOP/s") if ns > 0 and flops else ""


def _table(
    header: list[str], rows: list[list[Any]], *, numeric: set[int] = frozenset(), cls: str = ""
) -> str:
    out = [
        f'<table class="{cls}">' if cls else "<table>",
        "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>",
    ]
    for row in rows:
        cells = []
        for k, cell in enumerate(row):
            text = cell if isinstance(cell, _Raw) else html.escape(str(cell))
            cells.append(f'<td class="n">{text}</td>' if k in numeric else f"<td>{text}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


class _Raw(str):
    """Cell text that is already HTML."""


def _group(ranks: tuple[int, ...]) -> str:
    ranks = tuple(ranks)
    if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _axis(title: str, **extra: Any) -> dict[str, Any]:
    return {"title": {"text": title}, "automargin": True, **extra}


def _layout(title: str, height: int, **extra: Any) -> dict[str, Any]:
    return {
        "title": {"text": title},
        "height": height,
        "margin": {"t": 40, "b": 40, "l": 60, "r": 20},
        **extra,
    }


class Page:
    """Builds the sections of one report from a :class:`~.data.Run`."""

    def __init__(self, run: Run, title: str) -> None:
        self.run = run
        self.title = title
        self.static: dict[str, Any] = {}
        self.timeline: dict[str, Any] = {}
        self.totals: dict[str, Any] = {}

    def _plot(self, name: str, figure: dict[str, Any]) -> str:
        div = f"tl-plot-{name}"
        self.static[div] = figure
        return f'<div class="plot" id="{div}"></div>'

    # -- sections --------------------------------------------------------------------------------------------
    def overview(self, breakdown: list[dict[str, Any]]) -> str:
        o = self.run.overview()
        facts = [
            ["world size", o["world_size"]],
            ["ranks with a shard", f"{len(o['ranks'])} ({_group(tuple(o['ranks']))})"],
            ["steps", ", ".join(map(str, o["steps"]))],
            ["hosts", ", ".join(o["hosts"]) or "not recorded"],
            ["torch", ", ".join(o["torch"]) or "not recorded"],
            ["ops", f"{o['ops']:,}"],
            ["collectives", f"{o['collectives']:,}" + (" (joined across ranks)" if o["merged"] else "")],
            [
                "findings",
                _Raw(f'<span class="bad">{o["findings"]}</span>') if o["findings"] else "0",
            ],
        ]
        if o["incomplete"]:
            facts.append(["incomplete shards (step, rank)", ", ".join(map(str, o["incomplete"]))])
        steps, ranks = self.run.steps, self.run.ranks
        window = {(b["step"], b["rank"]): b["window_ns"] for b in breakdown}
        z = [[_ms(window[(s, r)]) if (s, r) in window else None for s in steps] for r in ranks]
        figure = {
            "data": [
                {
                    "type": "heatmap",
                    "x": [str(s) for s in steps],
                    "y": [f"rank {r}" for r in ranks],
                    "z": z,
                    "colorscale": "Viridis",
                    "colorbar": {"title": {"text": "ms"}},
                    "hovertemplate": "step %{x}, %{y}: %{z} ms<extra></extra>",
                }
            ],
            "layout": _layout(
                "Step time per rank (window: capture enter to leave, ms; docs/telemetry.md, Step facts)",
                max(260, 14 * len(ranks) + 120),
                xaxis=_axis("step", type="category"),
                yaxis=_axis("", autorange="reversed"),
            ),
        }
        return self._headline() + _table(["", ""], facts, cls="facts") + self._plot("steptime", figure)

    def _headline(self) -> str:
        h = headline(self.run)
        if h is None:
            return ""
        where = f" in <b>{html.escape(h['module'])}</b>" if h["module"] else ""
        if h["straggler"]:
            what = (
                f"rank <b>{h['rank']}</b> was the straggler: the others waited <b>{_ms(h['wait_ns'])} ms</b> "
                f"for it (its {html.escape(h['collective'] or 'collective')}{where} arrived last)"
            )
        else:
            what = f"slowest on rank <b>{h['rank']}</b>{where}"
        phase = (
            f"; its largest phase: {html.escape(h['phase'])} {_ms(h['phase_ns'])} ms" if h["phase"] else ""
        )
        return (
            f'<p class="headline" id="tl-headline">Slowest step <b>{h["step"]}</b> '
            f"({_ms(h['window_ns'])} ms window): {what}{phase}.</p>"
        )

    def timelines(self, breakdown: list[dict[str, Any]]) -> str:
        segments = self.run.timeline()
        ranks = self.run.ranks
        labels = [f"rank {r}" for r in ranks]
        height = max(260, 18 * len(ranks) + 120)
        for step, segs in segments.items():
            data = []
            for kind in ("compute", "comm", "wait"):
                mine = [s for s in segs if s["kind"] == kind]
                data.append(
                    {
                        "type": "bar",
                        "orientation": "h",
                        "name": {"comm": "communication", "wait": "waiting"}.get(kind, kind),
                        "y": [f"rank {s['rank']}" for s in mine],
                        "base": [_ms(s["start"]) for s in mine],
                        "x": [max(_ms(s["ns"]), 0.0005) for s in mine],
                        "text": [s.get("label", "") for s in mine],
                        "textposition": "none",
                        "marker": {"color": _COLOURS[kind]},
                        "hovertemplate": "%{y}: %{base:.3f} + %{x:.3f} ms %{text}<extra>" + kind + "</extra>",
                    }
                )
            self.timeline[str(step)] = {
                "data": data,
                "layout": _layout(
                    f"Step {step}: each rank's window on the aligned clock",
                    height,
                    barmode="overlay",
                    xaxis=_axis("ms from the step's first op"),
                    yaxis=_axis("", categoryorder="array", categoryarray=labels, autorange="reversed"),
                ),
            }
            rows = [b for b in breakdown if b["step"] == step]
            self.totals[str(step)] = {
                "data": [
                    {
                        "type": "bar",
                        "orientation": "h",
                        "name": name,
                        "y": [f"rank {b['rank']}" for b in rows],
                        "x": [_ms(b[key]) for b in rows],
                        "marker": {"color": _COLOURS[colour]},
                    }
                    for name, key, colour in (
                        ("compute", "compute_ns", "compute"),
                        ("communication", "comm_ns", "comm"),
                        ("waiting", "wait_ns", "wait"),
                    )
                ],
                "layout": _layout(
                    f"Step {step}: compute / communication / waiting per rank (ms; step facts, docs/telemetry.md)",
                    height,
                    barmode="group",
                    xaxis=_axis("ms"),
                    yaxis=_axis("", categoryorder="array", categoryarray=labels, autorange="reversed"),
                ),
            }
        options = "".join(f'<option value="{s}">step {s}</option>' for s in segments)
        return (
            '<p class="note">Compute: runs of ops between collectives (host time between them included). '
            "Communication: a collective from issue to observed completion. Waiting: from this rank's arrival "
            "to the last member's (merged runs only).</p>"
            f'<label>Step: <select id="tl-step">{options}</select></label>'
            '<div class="plot" id="tl-timeline"></div><div class="plot" id="tl-totals"></div>'
        )

    def modules(self) -> str:
        run = self.run
        shards = max(len(run.full), 1)
        rows = []
        for m in run.modules():
            rows.append(
                [
                    _Raw("&nbsp;" * 4 * m["depth"] + html.escape(m["name"])),
                    f"{m['ops'] / shards:,.1f}",
                    *(format_ns(m[p] / shards) for p in PHASES),
                    format_ns(m["ns"] / shards),
                    format_count(m["flops"] / shards, "FLOP"),
                    _rate(m["flops"], m["ns"]),
                ]
            )
        header = [
            "module (its submodules included)",
            "ops",
            *PHASES,
            "total",
            "FLOPs",
            "FLOP/s",
        ]
        own = run.own_module_time()[:20]
        figure = {
            "data": [
                {
                    "type": "bar",
                    "orientation": "h",
                    "name": phase,
                    "y": [r["name"] for r in own],
                    "x": [_ms(r[phase] / shards) for r in own],
                    "marker": {"color": _PHASE_COLOURS[phase]},
                }
                for phase in PHASES
            ],
            "layout": _layout(
                "Own time per module and phase (ms per step per rank; slowest 20)",
                max(260, 20 * len(own) + 100),
                barmode="stack",
                xaxis=_axis("ms"),
                yaxis=_axis("", autorange="reversed"),
            ),
        }
        funcs = run.funcs()[:30]
        func_rows = [
            [
                f["func"],
                f["kind"],
                f"{f['calls']:,}",
                format_ns(f["ns"]),
                format_count(f["flops"], "FLOP"),
                _rate(f["flops"], f["ns"]),
            ]
            for f in funcs
        ]
        slow = [
            [
                o["step"],
                o["rank"],
                o["label"],
                o["phase"],
                o["module"],
                short_source(o["source"]),
                format_ns(o["ns"]),
                format_count(o["flops"], "FLOP"),
            ]
            for o in run.slowest_ops()
        ]
        sample = ""
        if run.sampled:
            ranks = sorted({r for _, r in run.full})
            sample = f" (of {len(run.keys)}: every step of rank(s) {', '.join(map(str, ranks))}; the shards are read whole for this)"
        return (
            f'<p class="note">Mean over {shards} (step, rank) window(s){html.escape(sample)}. Backward ops count '
            "in their forward op's module, optimizer ops in their parameters' module. Op functions and the "
            "slowest ops: every window.</p>"
            + _table(header, rows, numeric=set(range(1, len(header))))
            + self._plot("modules", figure)
            + "<h3>Per op function (all windows)</h3>"
            + _table(["func", "kind", "calls", "time", "FLOPs", "FLOP/s"], func_rows, numeric={2, 3, 4, 5})
            + "<h3>Slowest ops</h3>"
            + _table(
                ["step", "rank", "op", "phase", "module", "source", "time", "FLOPs"],
                slow,
                numeric={0, 1, 6, 7},
            )
        )

    def collectives(self) -> str:
        run = self.run
        rows = run.collectives()
        if not rows:
            return '<p class="note">No collectives were captured.</p>'
        kinds: dict[tuple[str, str], dict[str, Any]] = {}
        for c in rows:
            k = kinds.setdefault((c["func"], _group(c["group"])), {"n": 0, "bytes": 0, "ns": []})
            k["n"] += 1
            k["bytes"] += c["bytes"]
            if c["ns"] >= 0:
                k["ns"].append(c["ns"])
        summary = [
            [
                func,
                group,
                k["n"],
                format_bytes(k["bytes"]),
                format_ns(sum(k["ns"]) / len(k["ns"])) if k["ns"] else "-",
            ]
            for (func, group), k in sorted(kinds.items())
        ]
        shown = sorted(rows, key=lambda c: -c["ns"])[:400]
        table = [
            [
                c["step"],
                c["func"],
                _group(c["group"]),
                c["seq"],
                _Raw(html.escape(c["verdict"]))
                if c["verdict"] in ("matched", "completed")
                else _Raw(f'<span class="bad">{html.escape(c["verdict"])}</span>'),
                format_bytes(c["bytes"]),
                format_ns(c["ns"]) if c["ns"] >= 0 else "-",
                format_ns(c["skew_ns"]) if c["skew_ns"] >= 0 else "-",
                c["last_rank"] if c["last_rank"] >= 0 else "-",
                c["module"],
                short_source(c["source"]),
            ]
            for c in shown
        ]
        header = [
            "step",
            "kind",
            "group",
            "seq",
            "verdict",
            "bytes",
            "duration",
            "skew",
            "last",
            "module",
            "source",
        ]
        out = (
            "<h3>By kind and group</h3>"
            + _table(
                ["kind", "group", "count", "bytes", "mean duration"],
                summary,
                numeric={2, 3, 4},
            )
            + "<h3>Bus bandwidth per rank</h3>"
            + '<p class="note">busbw as nccl-tests defines it, per (step, rank, kind, group): the summed size (the '
            "larger buffer) / the summed issue-to-completion time on that rank x the bus factor; the same numbers "
            "as StepTelemetry, the OTel gauge tl.collective.busbw and Prometheus.</p>"
            + _table(
                ["step", "rank", "kind", "group", "completed", "bytes", "time", "bus bandwidth"],
                [
                    [
                        b["step"],
                        b["rank"],
                        b["kind"],
                        b["group"],
                        b["completed"],
                        format_bytes(b["bytes"]),
                        format_ns(b["duration_ns"]),
                        format_bytes(int(b["busbw"])) + "/s" if b["busbw"] else "-",
                    ]
                    for b in run.bandwidth()[:MAX_BANDWIDTH_ROWS]
                ],
                numeric={0, 1, 4, 5, 6, 7},
            )
            + f"<h3>Collectives ({len(shown)} longest of {len(rows)})</h3>"
            + '<p class="note">Duration: first arrival to last completion (aligned clocks); skew: first to last '
            "arrival; module: the collective's own (schema.module_name).</p>"
            + _table(header, table, numeric={0, 3, 5, 6, 7, 8})
        )
        waits = run.waits()
        if waits["z"]:
            figure = {
                "data": [
                    {
                        "type": "heatmap",
                        "x": waits["columns"],
                        "y": [f"rank {r}" for r in waits["ranks"]],
                        "z": [[None if v is None else _ms(v) for v in row] for row in waits["z"]],
                        "colorscale": "Reds",
                        "colorbar": {"title": {"text": "ms"}},
                        "hovertemplate": "%{y} at %{x}: waited %{z} ms<extra></extra>",
                    }
                ],
                "layout": _layout(
                    "Wait per rank and collective (ms: from the rank's arrival to the last member's)",
                    max(260, 14 * len(waits["ranks"]) + 140),
                    xaxis=_axis("", type="category", showticklabels=len(waits["columns"]) <= 60),
                    yaxis=_axis("", autorange="reversed"),
                ),
            }
            out += self._plot("waits", figure)
        stragglers = run.stragglers()
        if stragglers:
            caused: dict[int, int] = {}
            for s in stragglers:
                caused[s["rank"]] = caused.get(s["rank"], 0) + s["caused_wait_ns"]
            figure = {
                "data": [
                    {
                        "type": "bar",
                        "x": [f"rank {r}" for r in sorted(caused)],
                        "y": [_ms(caused[r]) for r in sorted(caused)],
                        "marker": {"color": _COLOURS["wait"]},
                    }
                ],
                "layout": _layout(
                    "Others' wait each rank caused, all steps (ms; the straggler of a step has the most)",
                    300,
                    xaxis=_axis("", type="category"),
                    yaxis=_axis("ms"),
                ),
            }
            worst = [s for s in stragglers if s["caused_wait_ns"] > 0]
            top: dict[int, list[dict[str, Any]]] = {}
            for s in worst:
                top.setdefault(s["step"], []).append(s)
            srows = [
                [
                    step,
                    ", ".join(
                        f"rank {s['rank']} ({format_ns(s['caused_wait_ns'])}, last {s['last_count']}x)"
                        for s in rs[:3]
                    ),
                ]
                for step, rs in sorted(top.items())
            ]
            out += "<h3>Stragglers</h3>" + self._plot("stragglers", figure)
            out += _table(["step", "slowest ranks (others' wait caused, times last)"], srows) if srows else ""
        return out

    def findings(self) -> str:
        found = self.run.findings()
        if not found:
            return '<p class="note">No findings: every collective matched on every rank, no op failed.</p>'
        rows = []
        for f in found:
            where = "<br>".join(
                html.escape(
                    f"rank {w['rank']}: {w['what']} in {w['module']} ({short_source(w['source']) or 'no source'})"
                )
                for w in f["where"]
            )
            kind = html.escape(f["kind"]) + (
                "" if f["primary"] else ' <span class="consequence">(consequence)</span>'
            )
            rows.append([f["step"], _Raw(kind), ", ".join(map(str, f["ranks"])), f["message"], _Raw(where)])
        return _table(["step", "finding", "ranks", "what", "where each rank was"], rows, numeric={0})

    def statistics(self) -> str:
        stats = self.run.statistics()
        if not stats["recorded"]:
            return '<p class="note">No statistics recorded (capture with <code>stats=True</code> to see norms here).</p>'
        out = ""
        first = stats["first_nonfinite"]
        if first:
            out += (
                f'<p class="bad">First non-finite value: step {first["step"]}, rank {first["rank"]}, '
                f"{html.escape(first['label'])} ({first['of']}: {first['nan']} NaN, {first['inf']} Inf) in "
                f"{html.escape(first['module'])} ({html.escape(short_source(first['source']) or 'no source')})</p>"
            )
        else:
            out += '<p class="note">No NaN or Inf in any recorded value.</p>'
        for of, title in (
            ("out", "Output norm per module"),
            ("grad", "Gradient norm per module (w.r.t. its output)"),
        ):
            lines = {k[: -len(of) - 1]: v for k, v in stats["lines"].items() if k.endswith(" " + of)}
            if not lines:
                continue
            data = [
                {
                    "type": "scatter",
                    "mode": "lines+markers",
                    "name": name,
                    "x": [str(s) for s in v],
                    "y": list(v.values()),
                }
                for name, v in sorted(lines.items())[:20]
            ]
            out += self._plot(
                f"norm-{of}",
                {
                    "data": data,
                    "layout": _layout(
                        title + " (L2, mean over ranks)",
                        340,
                        xaxis=_axis("step", type="category"),
                        yaxis=_axis("norm"),
                    ),
                },
            )
        return out

    # -- the document ----------------------------------------------------------------------------------------
    def render(self) -> str:
        breakdown = self.run.breakdown()
        sections = [
            ("overview", "Overview", self.overview(breakdown)),
            ("timeline", "Timeline per rank", self.timelines(breakdown)),
            ("modules", "Time per module and op", self.modules()),
            ("collectives", "Collectives", self.collectives()),
            ("findings", "Findings", self.findings()),
            ("statistics", "Statistics", self.statistics()),
        ]
        nav = "".join(f'<a href="#{sid}">{html.escape(title)}</a>' for sid, title, _ in sections)
        body = "".join(
            f'<section id="{sid}"><h2>{html.escape(title)}</h2>{content}</section>'
            for sid, title, content in sections
        )
        figures = json.dumps(
            {"static": self.static, "timeline": self.timeline, "totals": self.totals}, separators=(",", ":")
        )
        figures = figures.replace("</", "<\\/")  # no "</script>" inside the JSON
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(self.title)}</title><style>{_CSS}</style>"
            f"<script>{plotly_js()}</script></head><body>"
            f"<header><h1>{html.escape(self.title)}</h1></header><nav>{nav}</nav><main>{body}</main>"
            f'<script type="application/json" id="tl-figures">{figures}</script>'
            f"<script>{_SCRIPT}</script></body></html>\n"
        )
