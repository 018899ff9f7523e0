"""The numbers of a run report, gathered from a merged run or one trace into plain lists and dicts (no HTML).

Every time is in nanoseconds here; :mod:`.page` turns them into tables and plots. Ops are counted in the
module they are drawn in (:func:`tl_dist.views.graph.home_calls`): backward ops in their forward op's module,
optimizer ops in their parameters' module.

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

from ..merge.timing import straggler_rows, time_breakdown
from ..views.graph import PHASES, home_calls
from ..views.summary import NO_MODULE

if TYPE_CHECKING:
    from ..merge.graph import MergedTrace
    from ..trace import Trace

# nccl-tests' bus bandwidth: the algorithm bandwidth times what each kind moves over the slowest link.
_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
TOP_OPS = 25
MAX_COLLECTIVE_ROWS = 400
MAX_HEATMAP_COLUMNS = 1500


def bus_bandwidth(func: str, nbytes: int, duration_ns: int, group_size: int) -> float:
    """Bytes per second on the bus (nccl-tests' busbw): size / time x the kind's factor; 0 when unknown.
    ``nbytes`` is one rank's input; all_gather moves its output (input x group size)."""
    if duration_ns <= 0 or nbytes <= 0 or group_size < 1:
        return 0.0
    size = nbytes * group_size if func == "all_gather" else nbytes
    factor = _BUS_FACTOR.get(func, lambda n: 1.0)(group_size) if group_size > 1 else 1.0
    return size / (duration_ns / 1e9) * factor


def module_name(address: str | None) -> str:
    """The report's name of a module address: ``<root>`` for the root, ``NO_MODULE`` outside every module."""
    if address is None:
        return NO_MODULE
    return address or "<root>"


def short_source(source: str) -> str:
    """``file.py:12`` from a full ``/path/to/file.py:12``."""
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else source


# Windows read whole for the module and statistics sections when a merged run's shards are on disk.
MAX_FULL_WINDOWS = 32


@dataclass
class Run:
    """What a report shows, from a :class:`~tl_dist.merge.graph.MergedTrace` (:meth:`of`) or one trace.

    ``traces`` holds every (step, rank) window with at least the merge's columns (times, kinds, labels);
    ``full`` the windows whose backward and optimizer links were read, for the per-module time and the
    statistics: all of them in memory, a sample of whole steps' ranks when a large run's shards are on disk.
    """

    traces: dict[tuple[int, int], Trace]
    world_size: int
    merged: MergedTrace | None = None
    offsets: dict[int, int] = field(default_factory=dict)
    full: dict[tuple[int, int], Trace] = field(default_factory=dict)
    _rows: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    _homes: dict[tuple[int, int], list[str | None]] = field(default_factory=dict)

    @classmethod
    def of(cls, source: MergedTrace | Trace) -> Run:
        # Told apart by what they hold (importing their classes here would close an import cycle: trace.report).
        if hasattr(source, "joined") and hasattr(source, "tables"):
            tables = source.tables()
            run = cls(tables, source.world_size, merged=source, offsets=dict(source.offsets))
            full = {k: t for k, t in tables.items() if hasattr(t, "module_table")}
            if len(full) < len(tables):  # shards on disk: read a sample whole
                full = {(s, r): source.rank(r, step=s) for s, r in run.sample()}
            run.full = full
            return run
        if hasattr(source, "columns") and hasattr(source, "module_table"):
            key = (
                source.step if source.step is not None else 0,
                source.rank if source.rank is not None else 0,
            )
            return cls({key: source}, source.world_size or 1, full={key: source})
        raise ValueError(f"a report is of a tl.merge_ranks result or a Trace, got {type(source).__name__}")

    def sample(self) -> list[tuple[int, int]]:
        """Every window when there are at most ``MAX_FULL_WINDOWS``; else every step of a few ranks: the lowest,
        the one that made the others wait longest, the highest (as many as fit)."""
        keys = sorted(self.traces)
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
        return len(self.full) < len(self.traces)

    # -- helpers ---------------------------------------------------------------------------------------------
    @property
    def steps(self) -> list[int]:
        return sorted({s for s, _ in self.traces})

    @property
    def ranks(self) -> list[int]:
        return sorted({r for _, r in self.traces})

    def items(self) -> Iterator[tuple[tuple[int, int], Trace]]:
        return iter(sorted(self.traces.items()))

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

    # -- sections --------------------------------------------------------------------------------------------
    def overview(self) -> dict[str, Any]:
        metas = [t.metadata for _, t in self.items()]
        findings = self.merged.findings if self.merged is not None else []
        incomplete = sorted(self.merged.incomplete) if self.merged is not None else []
        if self.merged is None:
            incomplete = [k for k, t in self.items() if t.metadata.get("complete") is False]
        return {
            "world_size": self.world_size,
            "ranks": self.ranks,
            "steps": self.steps,
            "hosts": sorted({str(m["host"]) for m in metas if m.get("host")}),
            "torch": sorted({str(m["torch_version"]) for m in metas if m.get("torch_version")}),
            "ops": sum(len(t) for t in self.traces.values()),
            "collectives": len(self.merged.joined)
            if self.merged is not None
            else sum(len(t.collective_table["op"]) for t in self.traces.values()),
            "findings": len(findings),
            "incomplete": incomplete,
            "merged": self.merged is not None,
        }

    def breakdown(self) -> list[dict[str, Any]]:
        """Per (step, rank): ops, compute_ns, comm_ns, wait_ns, window_ns (``merge.timing.time_breakdown``)."""
        waits = {}
        if self.merged is not None:
            waits = {
                (r["step"], r["rank"]): r["wait_ns"]
                for r in straggler_rows(self.merged.joined, self.merged.timings)
            }
        return [time_breakdown(s, r, t, waits.get((s, r), 0)) for (s, r), t in self.items()]

    def timeline(self) -> dict[int, list[dict[str, Any]]]:
        """Per step, the segments of each rank's window on the aligned clock, ns from the step's first op:
        ``compute`` (runs of non-collective ops, host time between them included), ``comm`` (a collective from
        issue to observed completion) and ``wait`` (waiting for the last member to arrive)."""
        out: dict[int, list[dict[str, Any]]] = {}
        starts: dict[int, int] = {}
        for (s, r), t in self.items():
            if len(t):
                first = min(t.columns["start_ns"]) - self.offsets.get(r, 0)
                starts[s] = min(starts.get(s, first), first)
        for (s, r), t in self.items():
            segs = out.setdefault(s, [])
            base = starts.get(s, 0) + self.offsets.get(r, 0)
            cols = t.columns
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
                        {"rank": r, "kind": "compute", "start": run_start - base, "ns": run_end - run_start}
                    )
                    run_start = None
                issue, complete = inflight.get(i, (start, start + dur))
                end = complete if complete >= issue else start + dur
                segs.append(
                    {
                        "rank": r,
                        "kind": "comm",
                        "start": issue - base,
                        "ns": max(end - issue, 0),
                        "label": cols["label"][i],
                    }
                )
            if run_start is not None:
                segs.append(
                    {"rank": r, "kind": "compute", "start": run_start - base, "ns": run_end - run_start}
                )
        if self.merged is not None:
            for j, timing in zip(self.merged.joined, self.merged.timings):
                for r, w in timing["waits"].items():
                    e = j.entries[r]
                    if w > 0 and j.step in starts:
                        arrival = e.issue_ns - self.offsets.get(r, 0) - starts[j.step]
                        label = f"{j.func} seq {j.seq}: waits for rank {timing['last_rank']}"
                        out[j.step].append(
                            {"rank": r, "kind": "wait", "start": arrival, "ns": w, "label": label}
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
            for chain, phase, dur, flops in zip(
                self._ancestors(key), cols["phase"], cols["duration_ns"], cols["flops"]
            ):
                for address in chain or (None,):
                    row = rows.get(address)
                    if row is None:
                        row = rows[address] = {
                            "module": address,
                            "ops": 0,
                            "flops": 0,
                            **{p: 0 for p in PHASES},
                        }
                    row["ops"] += 1
                    row["flops"] += flops
                    row[phase if phase in PHASES else "forward"] += dur
        ordered = [r for a, r in rows.items() if a is not None] + ([rows[None]] if None in rows else [])
        for row in ordered:
            row["depth"] = depth.get(row["module"], 0) if row["module"] is not None else 0
            row["name"] = module_name(row["module"])
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
                    row = rows[address] = {"name": module_name(address), **{p: 0 for p in PHASES}}
                row[phase if phase in PHASES else "forward"] += dur
        return sorted(rows.values(), key=lambda r: -sum(r[p] for p in PHASES))

    def funcs(self) -> list[dict[str, Any]]:
        """Per op func: calls, ns and FLOPs over every (step, rank), most time first."""
        rows: dict[str, dict[str, Any]] = {}
        for _, t in self.items():
            cols = t.columns
            for func, kind, dur, flops in zip(cols["func"], cols["kind"], cols["duration_ns"], cols["flops"]):
                row = rows.get(func)
                if row is None:
                    row = rows[func] = {"func": func, "kind": kind, "calls": 0, "ns": 0, "flops": 0}
                row["calls"] += 1
                row["ns"] += dur
                row["flops"] += flops
        return sorted(rows.values(), key=lambda r: -r["ns"])

    def slowest_ops(self, n: int = TOP_OPS) -> list[dict[str, Any]]:
        candidates = []
        for key, t in self.items():
            durations = t.columns["duration_ns"]
            for i in heapq.nlargest(n, range(len(t)), key=durations.__getitem__):
                candidates.append((durations[i], key, i))
        out = []
        for dur, (s, r), i in heapq.nlargest(n, candidates):
            cols = self.traces[(s, r)].columns
            out.append(
                {
                    "step": s,
                    "rank": r,
                    "label": cols["label"][i],
                    "phase": cols["phase"][i],
                    "module": module_name(
                        self.homes((s, r))[i] if (s, r) in self.full else cols["module"][i] or None
                    ),
                    "source": cols["source"][i],
                    "ns": dur,
                    "flops": cols["flops"][i],
                }
            )
        return out

    def collectives(self) -> list[dict[str, Any]]:
        """One row per collective (joined across ranks when merged): timing on the aligned clock, bandwidth."""
        rows = []
        if self.merged is not None:
            frame = self.merged.collectives
            for k, c in enumerate(frame.itertuples(index=False)):
                n = len(c.group)
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
                        "busbw": bus_bandwidth(str(c.func), int(c.bytes), int(c.duration_ns), n),
                        "module": module_name(c.module if c.module else None),
                        "source": str(c.source),
                    }
                )
            return rows
        for (s, r), t in self.items():
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
                        "busbw": bus_bandwidth(ct["func"][k], ct["bytes"][k], ns, len(group)),
                        "module": module_name(self.homes((s, r))[op] if 0 <= op < len(t) else None),
                        "source": t.columns["source"][op] if 0 <= op < len(t) else "",
                    }
                )
        return rows

    def waits(self) -> dict[str, Any]:
        """Rank x joined collective wait (ns): ``ranks``, ``columns`` (labels), ``z`` (rows per rank; None where a
        rank has no part in it). At most ``MAX_HEATMAP_COLUMNS`` collectives, the longest-skewed ones."""
        if self.merged is None or not self.merged.joined:
            return {"ranks": [], "columns": [], "z": []}
        pairs = list(zip(self.merged.joined, self.merged.timings))
        if len(pairs) > MAX_HEATMAP_COLUMNS:
            keep = set(
                heapq.nlargest(MAX_HEATMAP_COLUMNS, range(len(pairs)), key=lambda k: pairs[k][1]["skew_ns"])
            )
            pairs = [p for k, p in enumerate(pairs) if k in keep]
        ranks = self.ranks
        z = [[t["waits"].get(r) for _, t in pairs] for r in ranks]
        columns = [f"s{j.step} {j.func} #{j.seq}" for j, _ in pairs]
        return {"ranks": ranks, "columns": columns, "z": z}

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
                where = []
                for r, w in sorted(f.where.items()):
                    if w.get("absent"):
                        where.append(
                            {
                                "rank": r,
                                "what": "did not issue it; last op " + str(w.get("last_label") or "-"),
                                "module": module_name(w.get("last_module") or None),
                                "source": w.get("last_source") or "",
                            }
                        )
                    else:
                        where.append(
                            {
                                "rank": r,
                                "what": f"{w.get('label')} seq {w.get('seq')} {w.get('state')}",
                                "module": module_name(w.get("module") or None),
                                "source": w.get("source") or "",
                            }
                        )
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
        for (s, r), t in self.items():
            failed = t.failed_op
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
                                "module": module_name(failed.get("module") or None),
                                "source": failed.get("source") or "",
                            }
                        ],
                    }
                )
        return out

    def statistics(self) -> dict[str, Any]:
        """Norms of each module's output and of the gradient w.r.t. it, per step (mean over ranks), from the
        ``stats=`` tables; and the first non-finite value (by step, then rank, then time in the window)."""
        series: dict[tuple[str, str], dict[int, list[float]]] = {}
        first = None
        recorded = False
        for key, t in sorted(self.full.items()):
            st = t.stats_table
            if not st["op"]:
                continue
            recorded = True
            homes = self.homes(key)
            last_out: dict[str | None, int] = {}  # module -> its last op with recorded output statistics
            for op, of in zip(st["op"], st["of"]):
                if of == "out" and 0 <= op < len(homes):
                    last_out[homes[op]] = max(last_out.get(homes[op], -1), op)
            wanted = {op: module for module, op in last_out.items()}
            for op, of, norm in zip(st["op"], st["of"], st["norm"]):
                module = wanted.get(op, ...)
                if module is not ...:
                    series.setdefault((module_name(module), of), {}).setdefault(key[0], []).append(norm)
            if first is None:
                bad = [k for k in range(len(st["op"])) if st["nan"][k] or st["inf"][k]]
                if bad:
                    k = min(bad, key=lambda k: st["at"][k])
                    op = st["op"][k]
                    cols = t.columns
                    first = {
                        "step": key[0],
                        "rank": key[1],
                        "label": cols["label"][op],
                        "of": st["of"][k],
                        "nan": st["nan"][k],
                        "inf": st["inf"][k],
                        "module": module_name(homes[op]),
                        "source": cols["source"][op],
                    }
        lines = {
            f"{name} {of}": {s: sum(v) / len(v) for s, v in sorted(by_step.items())}
            for (name, of), by_step in series.items()
        }
        return {"recorded": recorded, "lines": lines, "first_nonfinite": first}
