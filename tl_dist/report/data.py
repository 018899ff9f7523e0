"""The numbers of a run report, gathered from a merged run or one trace into plain lists and dicts (no HTML).

Every time is in nanoseconds here; :mod:`.page` turns them into tables and plots. Ops are counted in the
module they are drawn in (:func:`tl_dist.views.graph.home_calls`): backward ops in their forward op's module,
optimizer ops in their parameters' module, collectives in their owner module.

Example:
    >>> run = Run.of(tl.merge_ranks("runs/job42"))
    >>> run.overview()["world_size"], run.modules()[:3]
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..merge.timing import member_waits, step_timing, trace_breakdown
from ..schema import OUTSIDE, PHASES, module_name
from ..step_facts import nonfinite_origin
from ..telemetry import collective_rows, module_norms, region_shares, split_region
from ..views.graph import home_calls

if TYPE_CHECKING:
    from ..merge.graph import MergedTrace
    from ..trace import Trace

TOP_OPS = 25
MAX_COLLECTIVE_ROWS = 400
MAX_HEATMAP_COLUMNS = 1500


def _named(address: str | None) -> str:
    """``schema.module_name`` of a module address (None: the op ran outside every module)."""
    return module_name({"module": address or "", "module_stack": address is not None})


def _where_row(rank: int, w: dict[str, Any], in_group: bool) -> dict[str, Any] | None:
    """One rank's line of a finding: what it did at the collective (or, absent, its last op) and, when its shard
    is a post-mortem, where its thread was. None for a rank-level finding with nothing more than its message."""
    stack = f"; thread at {w['stack_at']}" if w.get("stack_at") else ""
    if in_group and not w.get("absent"):
        return {
            "rank": rank,
            "what": f"{w.get('label')} seq {w.get('seq')} {w.get('state')}{stack}",
            "module": _named(w.get("module") or None),
            "source": w.get("source") or "",
        }
    if not w.get("last_label"):
        return (
            None
            if not in_group
            else {"rank": rank, "what": "did not issue it", "module": OUTSIDE, "source": ""}
        )
    return {
        "rank": rank,
        "what": ("did not issue it; " if in_group else "") + f"last op {w['last_label']}{stack}",
        "module": _named(w.get("last_module") or None),
        "source": w.get("last_source") or "",
    }


def short_source(source: str) -> str:
    """``file.py:12`` from a full ``/path/to/file.py:12``."""
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else source


# Windows read whole for the module and statistics sections: beyond this many, a sample of whole steps' ranks.
MAX_FULL_WINDOWS = 32
# The op columns the sections over every window read (op functions, slowest ops, timeline, failed ops).
SCAN_FIELDS = (
    "label",
    "func",
    "kind",
    "phase",
    "module",
    "module_stack",
    "source",
    "start_ns",
    "duration_ns",
    "flops",
)


@dataclass
class _Scan:
    """What one pass over every window gathers (see :meth:`Run.scan`)."""

    ops: int = 0
    funcs: dict[str, dict[str, Any]] = field(default_factory=dict)
    slowest: list[tuple[int, tuple[int, int], int, dict[str, Any]]] = field(default_factory=list)
    timeline: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # aligned ns, not yet shifted
    step_start: dict[int, int] = field(default_factory=dict)  # per step, its first op on the aligned clock
    failed: list[tuple[tuple[int, int], dict[str, Any]]] = field(default_factory=list)
    # Per (step, rank): op ns per phase, and the window's telemetry.collective_rows (busbw, one definition).
    phase_ns: dict[tuple[int, int], dict[str, int]] = field(default_factory=dict)
    bandwidth: dict[tuple[int, int], tuple] = field(default_factory=dict)


@dataclass
class Run:
    """What a report shows, from a :class:`~tl_dist.merge.graph.MergedTrace` (:meth:`of`) or one trace.

    ``keys`` names every (step, rank) window. ``full`` holds the windows read whole (with their backward and
    optimizer links), for the per-module time and the statistics: every window of a small run, a sample of whole
    steps' ranks beyond ``MAX_FULL_WINDOWS`` (:meth:`sample`). The sections over every window (op functions,
    slowest ops, the timeline, failed ops) read each window once, one at a time, for a few columns
    (:meth:`scan`); the merge's own tables give the rest (time breakdown, collectives, waits, stragglers).
    """

    keys: list[tuple[int, int]]
    world_size: int
    merged: MergedTrace | None = None
    full: dict[tuple[int, int], Trace] = field(default_factory=dict)
    _scan: _Scan | None = None
    _collectives: list[dict[str, Any]] | None = None
    _rows: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    _homes: dict[tuple[int, int], list[str | None]] = field(default_factory=dict)

    @classmethod
    def of(cls, source: MergedTrace | Trace) -> Run:
        # Told apart by what they hold (importing their classes here would close an import cycle: trace.report).
        if hasattr(source, "joined_step") and hasattr(source, "iter_traces"):
            run = cls(source.keys(), source.world_size, merged=source)
            run.full = {(s, r): source.rank(r, step=s) for s, r in run.sample()}
            return run
        if hasattr(source, "columns") and hasattr(source, "module_table"):
            key = (
                source.step if source.step is not None else 0,
                source.rank if source.rank is not None else 0,
            )
            return cls([key], source.world_size or 1, full={key: source})
        raise ValueError(f"a report is of a tl.merge_ranks result or a Trace, got {type(source).__name__}")

    def sample(self) -> list[tuple[int, int]]:
        """Every window when there are at most ``MAX_FULL_WINDOWS``; else every step of a few ranks: the lowest,
        the one that made the others wait longest, the highest (as many as fit)."""
        keys = sorted(self.keys)
        if len(keys) <= MAX_FULL_WINDOWS:
            return keys
        ranks = self.ranks
        picked = [ranks[0]]
        caused: dict[int, int] = {}
        for s in self.stragglers():
            caused[s["rank"]] = caused.get(s["rank"], 0) + s["caused_wait_ns"]
        if caused:
            picked.append(max(caused, key=lambda r: (caused[r], -r)))
        picked.append(ranks[-1])
        fit = max(1, MAX_FULL_WINDOWS // max(len(self.steps), 1))
        chosen = list(dict.fromkeys(picked))[:fit]
        out = [k for k in keys if k[1] in chosen]
        return out[:MAX_FULL_WINDOWS]

    @property
    def sampled(self) -> bool:
        return len(self.full) < len(self.keys)

    # -- helpers ---------------------------------------------------------------------------------------------
    @property
    def steps(self) -> list[int]:
        return sorted({s for s, _ in self.keys})

    @property
    def ranks(self) -> list[int]:
        return sorted({r for _, r in self.keys})

    def windows(self) -> Iterator[tuple[tuple[int, int], Trace]]:
        """Every window, one at a time: of a merged run, read for ``SCAN_FIELDS`` (windows read whole are
        reused)."""
        if self.merged is None:
            return iter(sorted(self.full.items()))
        full = self.full
        return (
            (key, full.get(key, t))
            for key, t in self.merged.iter_traces(fields=None if len(full) == len(self.keys) else SCAN_FIELDS)
        )

    def _offset(self, key: tuple[int, int]) -> int:
        return self.merged.offsets.get(key, 0) if self.merged is not None else 0

    def _home_rows(self, key: tuple[int, int]) -> list[int]:
        if key not in self._rows:
            self._rows[key] = home_calls(self.full[key])
        return self._rows[key]

    def homes(self, key: tuple[int, int]) -> list[str | None]:
        """Per op of that shard, the address of the module it is counted in (None: outside every module)."""
        if key not in self._homes:
            addresses = self.full[key].module_table["address"]
            self._homes[key] = [addresses[h] if h >= 0 else None for h in self._home_rows(key)]
        return self._homes[key]

    def _ancestors(self, key: tuple[int, int]) -> list[tuple[str, ...]]:
        # Per op the addresses of its module and every enclosing one (the op's time counts in each).
        table = self.full[key].module_table
        parent, addresses = table["parent"], table["address"]
        chains: dict[int, tuple[str, ...]] = {-1: ()}
        out = []
        for h in self._home_rows(key):
            chain = chains.get(h)
            if chain is None:
                names, row = [], h
                while row >= 0:
                    names.append(addresses[row])
                    row = parent[row]
                chain = chains[h] = tuple(dict.fromkeys(reversed(names)))
            out.append(chain)
        return out

    def scan(self) -> _Scan:
        """One pass over every window (:meth:`windows`): ops, per-func totals, the slowest ops, the timeline's
        compute and communication segments (aligned ns) and the failed ops. Kept once made."""
        if self._scan is not None:
            return self._scan
        scan = _Scan()
        for key, t in self.windows():
            scan.ops += len(t)
            cols = t.columns
            for func, kind, dur, flops in zip(cols["func"], cols["kind"], cols["duration_ns"], cols["flops"]):
                row = scan.funcs.get(func)
                if row is None:
                    row = scan.funcs[func] = {"func": func, "kind": kind, "calls": 0, "ns": 0, "flops": 0}
                row["calls"] += 1
                row["ns"] += dur
                row["flops"] += flops
            durations = cols["duration_ns"]
            phase_ns = scan.phase_ns[key] = {}
            for phase, dur in zip(cols["phase"], durations):
                phase_ns[phase] = phase_ns.get(phase, 0) + dur
            scan.bandwidth[key] = collective_rows(t.collective_table)
            for i in heapq.nlargest(TOP_OPS, range(len(t)), key=durations.__getitem__):
                scan.slowest.append((durations[i], key, i, self._op_row(key, t, i)))
            scan.slowest = heapq.nlargest(TOP_OPS, scan.slowest, key=lambda c: (c[0], c[1], c[2]))
            self._segments(key, t, scan)
            if t.failed_op:
                scan.failed.append((key, t.failed_op))
        self._scan = scan
        return scan

    def _op_row(self, key: tuple[int, int], t: Trace, i: int) -> dict[str, Any]:
        cols = t.columns
        return {
            "step": key[0],
            "rank": key[1],
            "label": cols["label"][i],
            "phase": cols["phase"][i],
            "module": self._owner(key, t, i),
            "source": cols["source"][i],
            "ns": cols["duration_ns"][i],
            "flops": cols["flops"][i],
        }

    def _owner(self, key: tuple[int, int], t: Trace, i: int) -> str:
        """The module an op is listed under: a collective's is its row's (``schema.module_name``, the one rule the
        Collectives table, ``to_pandas`` and the OTel spans use); any other op's is the module it is counted in
        (its home: backward ops in their forward op's module, optimizer ops in their parameters')."""
        cols = t.columns
        if cols["kind"][i] == "collective" or key not in self.full:
            return module_name({"module": cols["module"][i], "module_stack": cols["module_stack"][i]})
        return _named(self.homes(key)[i])

    def _segments(self, key: tuple[int, int], t: Trace, scan: _Scan) -> None:
        """The window's compute runs and collectives, on the aligned clock (ns), into ``scan.timeline``."""
        s, r = key
        if not len(t):
            return
        shift = self._offset(key)
        cols = t.columns
        first = min(cols["start_ns"]) - shift
        scan.step_start[s] = min(scan.step_start.get(s, first), first)
        segs = scan.timeline.setdefault(s, [])
        ct = t.collective_table
        inflight = {op: (i, c) for op, i, c in zip(ct["op"], ct["issue_ns"], ct["complete_ns"])}
        run_start = run_end = None
        for i, (kind, start, dur) in enumerate(zip(cols["kind"], cols["start_ns"], cols["duration_ns"])):
            if kind != "collective":
                run_start = start if run_start is None else run_start
                run_end = start + dur
                continue
            if run_start is not None:
                segs.append(
                    {"rank": r, "kind": "compute", "start": run_start - shift, "ns": run_end - run_start}
                )
                run_start = None
            issue, complete = inflight.get(i, (start, start + dur))
            end = complete if complete >= issue else start + dur
            segs.append(
                {
                    "rank": r,
                    "kind": "comm",
                    "start": issue - shift,
                    "ns": max(end - issue, 0),
                    "label": cols["label"][i],
                }
            )
        if run_start is not None:
            segs.append({"rank": r, "kind": "compute", "start": run_start - shift, "ns": run_end - run_start})

    def joined_collectives(self) -> list[dict[str, Any]]:
        """Per joined collective of a merged run (step by step, as ``merged.collectives``): step, func, seq,
        skew_ns, last_rank, and per member rank its wait (``waits``) and, when it waited, its aligned arrival
        (``arrivals``). Kept once made."""
        if self._collectives is not None:
            return self._collectives
        out: list[dict[str, Any]] = []
        g = self.merged
        for step in g.steps if g is not None else ():
            joined = g.joined_step(step)
            clocks = g.clock_solutions[step]
            timing = step_timing(joined, clocks)
            skew, last = timing.skew.tolist(), timing.last_rank.tolist()
            rows = [
                {"step": step, "func": j.func, "seq": j.seq, "skew_ns": skew[k], "last_rank": last[k]}
                for k, j in enumerate(joined)
            ]
            for row in rows:
                row["waits"], row["arrivals"] = {}, {}
            for k, r, e, wait in member_waits(joined, timing):
                rows[k]["waits"][r] = wait
                if wait > 0:
                    rows[k]["arrivals"][r] = e.issue_ns - clocks.offsets.get(r, 0)
            out.extend(rows)
        self._collectives = out
        return out

    # -- sections --------------------------------------------------------------------------------------------
    def overview(self) -> dict[str, Any]:
        g = self.merged
        if g is not None:
            metas = [g.metadata(s, r) for s, r in self.keys]
            incomplete = sorted(g.incomplete)
            collectives = len(g.collectives)
        else:
            metas = [t.metadata for _, t in sorted(self.full.items())]
            incomplete = [k for k, t in sorted(self.full.items()) if t.metadata.get("complete") is False]
            collectives = sum(len(t.collective_table["op"]) for t in self.full.values())
        return {
            "world_size": self.world_size,
            "ranks": self.ranks,
            "steps": self.steps,
            "hosts": sorted({str(m["host"]) for m in metas if m.get("host")}),
            "torch": sorted({str(m["torch_version"]) for m in metas if m.get("torch_version")}),
            "ops": self.scan().ops,
            "collectives": collectives,
            "findings": len(g.findings) if g is not None else 0,
            "incomplete": incomplete,
            "merged": g is not None,
        }

    def breakdown(self) -> list[dict[str, Any]]:
        """Per (step, rank): ops, the step facts (window_ns, idle_before_ns, idle_after_ns, compute_ns, comm_ns)
        and wait_ns (``MergedTrace.time_breakdown``; :mod:`tl_dist.step_facts`)."""
        if self.merged is not None:
            return self.merged.time_breakdown().to_dict("records")
        return [trace_breakdown(s, r, t) for (s, r), t in sorted(self.full.items())]

    def timeline(self) -> dict[int, list[dict[str, Any]]]:
        """Per step, the segments of each rank's window on the aligned clock, ns from the step's first op:
        ``compute`` (runs of non-collective ops, host time between them included), ``comm`` (a collective from
        issue to observed completion) and ``wait`` (waiting for the last member to arrive)."""
        scan = self.scan()
        starts = scan.step_start
        out = {
            s: [{**seg, "start": seg["start"] - starts[s]} for seg in segs]
            for s, segs in scan.timeline.items()
        }
        for c in self.joined_collectives():
            if c["step"] not in starts:
                continue
            label = f"{c['func']} seq {c['seq']}: waits for rank {c['last_rank']}"
            for r, arrival in c["arrivals"].items():
                out[c["step"]].append(
                    {
                        "rank": r,
                        "kind": "wait",
                        "start": arrival - starts[c["step"]],
                        "ns": c["waits"][r],
                        "label": label,
                    }
                )
        return out

    def modules(self) -> list[dict[str, Any]]:
        """Per module address (in order of first use), ns per phase and FLOPs of its ops and its submodules'
        ops, summed over every (step, rank); the last row is the ops outside every module."""
        rows: dict[str, dict[str, Any]] = {}
        depth: dict[str, int] = {}
        for key, t in sorted(self.full.items()):
            table = t.module_table
            for address, d in zip(table["address"], table["depth"]):
                depth.setdefault(address, d)
            cols = t.columns
            # A compiled region counts for the modules of its ATen ops, its time split by FLOPs (as summarize).
            regions = region_shares(t) if t.compiled_table["region"] else {}
            for i, (chain, phase, dur, flops) in enumerate(
                zip(self._ancestors(key), cols["phase"], cols["duration_ns"], cols["flops"])
            ):
                parts = split_region(regions[i], dur, 0) if i in regions else ((chain, 1, dur, flops, 0),)
                for chain_k, ops_k, dur_k, flops_k, _ in parts:
                    for address in dict.fromkeys(chain_k) if chain_k else (None,):
                        row = rows.get(address)
                        if row is None:
                            row = rows[address] = {
                                "module": address,
                                "ops": 0,
                                "flops": 0,
                                **{p: 0 for p in PHASES},
                            }
                        row["ops"] += ops_k
                        row["flops"] += flops_k
                        row[phase if phase in PHASES else "forward"] += dur_k
        ordered = [r for a, r in rows.items() if a is not None] + ([rows[None]] if None in rows else [])
        for row in ordered:
            row["depth"] = depth.get(row["module"], 0) if row["module"] is not None else 0
            row["name"] = _named(row["module"])
            row["ns"] = sum(row[p] for p in PHASES)
        return ordered

    def own_module_time(self) -> list[dict[str, Any]]:
        """Per module, ns per phase of its own ops only (submodules excluded), most time first."""
        rows: dict[str | None, dict[str, Any]] = {}
        for key, t in sorted(self.full.items()):
            cols = t.columns
            for address, phase, dur in zip(self.homes(key), cols["phase"], cols["duration_ns"]):
                row = rows.get(address)
                if row is None:
                    row = rows[address] = {"name": _named(address), **{p: 0 for p in PHASES}}
                row[phase if phase in PHASES else "forward"] += dur
        return sorted(rows.values(), key=lambda r: -sum(r[p] for p in PHASES))

    def funcs(self) -> list[dict[str, Any]]:
        """Per op func: calls, ns and FLOPs over every (step, rank), most time first."""
        return sorted(self.scan().funcs.values(), key=lambda r: -r["ns"])

    def slowest_ops(self, n: int = TOP_OPS) -> list[dict[str, Any]]:
        return [row for _, _, _, row in self.scan().slowest[:n]]

    def collectives(self) -> list[dict[str, Any]]:
        """One row per collective (joined across ranks when merged): timing on the aligned clock, bandwidth."""
        rows = []
        if self.merged is not None:
            frame = self.merged.collectives
            for k, c in enumerate(frame.itertuples(index=False)):
                rows.append(
                    {
                        "index": k,
                        "step": int(c.step),
                        "func": str(c.func),
                        "group": tuple(c.group),
                        "seq": int(c.seq),
                        "verdict": str(c.verdict),
                        "bytes": int(c.bytes),
                        "ns": int(c.duration_ns),
                        "skew_ns": int(c.skew_ns),
                        "last_rank": int(c.last_rank),
                        "module": str(c.module),
                        "source": str(c.source),
                    }
                )
            return rows
        for (s, r), t in sorted(self.full.items()):
            ct = t.collective_table
            for k in range(len(ct["op"])):
                issue, complete = ct["issue_ns"][k], ct["complete_ns"][k]
                ns = complete - issue if complete >= issue else -1
                group = tuple(ct["group_ranks"][k])
                op = ct["op"][k]
                rows.append(
                    {
                        "index": len(rows),
                        "step": s,
                        "func": ct["func"][k],
                        "group": group,
                        "seq": ct["seq"][k],
                        "verdict": ct["state"][k],
                        "bytes": ct["bytes"][k],
                        "ns": ns,
                        "skew_ns": -1,
                        "last_rank": -1,
                        "module": self._owner((s, r), t, op) if 0 <= op < len(t) else OUTSIDE,
                        "source": t.columns["source"][op] if 0 <= op < len(t) else "",
                    }
                )
        return rows

    def waits(self) -> dict[str, Any]:
        """Rank x joined collective wait (ns): ``ranks``, ``columns`` (labels), ``z`` (rows per rank; None where a
        rank has no part in it). At most ``MAX_HEATMAP_COLUMNS`` collectives, the longest-skewed ones."""
        joined = self.joined_collectives()
        if not joined:
            return {"ranks": [], "columns": [], "z": []}
        if len(joined) > MAX_HEATMAP_COLUMNS:
            keep = set(
                heapq.nlargest(MAX_HEATMAP_COLUMNS, range(len(joined)), key=lambda k: joined[k]["skew_ns"])
            )
            joined = [c for k, c in enumerate(joined) if k in keep]
        ranks = self.ranks
        z = [[c["waits"].get(r) for c in joined] for r in ranks]
        columns = [f"s{c['step']} {c['func']} #{c['seq']}" for c in joined]
        return {"ranks": ranks, "columns": columns, "z": z}

    def bandwidth(self) -> list[dict[str, Any]]:
        """Per (step, rank, kind, group): the window's collective totals and busbw, as
        :func:`tl_dist.telemetry.collective_rows` (so ``StepTelemetry`` and the OTel gauge) computes them."""
        return [
            {"step": s, "rank": r, **row._asdict()}
            for (s, r), rows in sorted(self.scan().bandwidth.items())
            for row in rows
        ]

    def stragglers(self) -> list[dict[str, Any]]:
        if self.merged is None:
            return []
        frame = self.merged.stragglers()
        return [
            {k: int(getattr(r, k)) for k in ("step", "rank", "caused_wait_ns", "last_count", "wait_ns")}
            for r in frame.itertuples(index=False)
        ]

    def findings(self) -> list[dict[str, Any]]:
        out = []
        if self.merged is not None:
            for f in self.merged.findings:
                where = [_where_row(r, w, bool(f.group)) for r, w in sorted(f.where.items())]
                where = [w for w in where if w is not None]
                out.append(
                    {
                        "kind": f.kind,
                        "step": f.step,
                        "ranks": list(f.ranks),
                        "message": f.message,
                        "primary": f.primary,
                        "where": where,
                    }
                )
        for (s, r), failed in self.scan().failed:
            if failed:
                out.append(
                    {
                        "kind": "failed_op",
                        "step": s,
                        "ranks": [r],
                        "message": f"op {failed.get('index')} ({failed.get('func')}) raised {failed.get('error')}",
                        "primary": True,
                        "where": [
                            {
                                "rank": r,
                                "what": str(failed.get("func")),
                                "module": _named(failed.get("module") or None),
                                "source": failed.get("source") or "",
                            }
                        ],
                    }
                )
        return out

    def statistics(self) -> dict[str, Any]:
        """Norms of each module's output and of the gradient w.r.t. it, per step (mean over ranks), from the
        ``stats=`` tables; and the first non-finite value: its first step, the rank where it arose
        (:func:`~tl_dist.step_facts.nonfinite_origin`), the first in that rank's window."""
        series: dict[tuple[str, str], dict[int, list[float]]] = {}
        first = None
        firsts: dict[tuple[int, int], dict] = {}  # (step, rank) -> its first non-finite value, first step
        recorded = False
        for key, t in sorted(self.full.items()):
            st = t.stats_table
            if not st["op"]:
                continue
            recorded = True
            homes = self.homes(key)
            for row in module_norms(t):  # the norms fact, as StepTelemetry and the exporters read it
                series.setdefault((_named(row.module), row.of), {}).setdefault(key[0], []).append(row.norm)
            if not firsts or key[0] == next(iter(firsts))[0]:  # the first step with one: every rank's
                bad = [k for k in range(len(st["op"])) if st["nan"][k] or st["inf"][k]]
                if bad:
                    k = min(bad, key=lambda k: st["at"][k])
                    op = st["op"][k]
                    cols = t.columns
                    firsts[key] = {
                        "step": key[0],
                        "rank": key[1],
                        "label": cols["label"][op],
                        "kind": cols["kind"][op],
                        "of": st["of"][k],
                        "nan": st["nan"][k],
                        "inf": st["inf"][k],
                        "module": _named(homes[op]),
                        "source": cols["source"][op],
                    }
        if firsts:
            step = next(iter(firsts))[0]
            first = firsts[(step, nonfinite_origin({r: f["kind"] for (_, r), f in firsts.items()}))]
        lines = {
            f"{name} {of}": {s: sum(v) / len(v) for s, v in sorted(by_step.items())}
            for (name, of), by_step in series.items()
        }
        return {"recorded": recorded, "lines": lines, "first_nonfinite": first}
