"""``tl.merge_ranks``: the per-rank shards of a job joined into one global trace (:class:`MergedTrace`).

Example:
    >>> g = tl.merge_ranks("runs/job42")
    >>> g.findings, g.stragglers(), g.collectives, g.to_perfetto("job42.json")
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import MergeError
from .clocks import estimate_offsets
from .match import Finding, Joined, entries_of, match_step
from .sources import ShardRef, find_shards, read_all
from .timing import collective_timing, straggler_rows, time_breakdown

if TYPE_CHECKING:
    from ..trace import Trace


class MergedTrace:
    """The traces of all ranks (and steps) of a job, with collectives joined across ranks.

    Built by :func:`merge_ranks` or :func:`load_merged`; the constructor does no I/O. Times in every view are
    aligned to the lowest rank's clock (``offsets``).

    Attributes:
        world_size: ranks in the job.
        steps: captured steps, ascending.
        findings: problems found (:class:`~tl_dist.merge.match.Finding`), in step, group and issue order.
        joined: every collective joined across ranks (:class:`~tl_dist.merge.match.Joined`).
        offsets: per rank, its clock minus the reference clock, in ns.
        incomplete: (step, rank) pairs whose shard was written at a crash, hang or signal.

    Example:
        >>> g = tl.merge_ranks("runs/job42")
        >>> print(g.summary()); g.stragglers().head()
    """

    def __init__(
        self,
        traces: dict[tuple[int, int], Trace],
        *,
        world_size: int,
        joined: list[Joined],
        findings: list[Finding],
        offsets: dict[int, int],
        incomplete: set[tuple[int, int]],
        shard_errors: dict[tuple[int, int], str],
    ) -> None:
        self._traces = traces  # full Traces, or the merge's ShardTables (full trace loaded on demand)
        self._full: dict[tuple[int, int], Trace] = {}
        self.world_size = world_size
        self.steps = sorted({s for s, _ in traces} | {s for s, _ in shard_errors})
        self.joined = joined
        self.findings = findings
        self.offsets = offsets
        self.incomplete = incomplete
        self.shard_errors = shard_errors
        self._timings: list[dict[str, Any]] | None = None

    # -- access --------------------------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        """Ranks with at least one readable shard, ascending."""
        return sorted({r for _, r in self._traces})

    def rank(self, rank: int, *, step: int | None = None) -> Trace:
        """That rank's :class:`~tl_dist.trace.Trace` (for ``step``; may be omitted when one step was captured).

        Example:
            >>> g.rank(1)["all_reduce_1"].duration_ns
        """
        if step is None:
            steps = sorted(s for s, r in self._traces if r == rank)
            if len(steps) > 1:
                raise ValueError(f"step: rank {rank} has shards for steps {steps}; pass step=")
            step = steps[0] if steps else None
        key = (step, rank)
        if key not in self._traces:
            raise KeyError(f"no readable shard for rank {rank} at step {step}; ranks: {self.ranks}")
        return self._full_trace(key)

    def _full_trace(self, key: tuple[int, int]) -> Trace:
        from ..trace import Trace
        from .sources import load_shard

        tables = self._traces[key]
        if isinstance(tables, Trace):
            return tables
        if key not in self._full:
            self._full[key] = load_shard(tables.path)
        return self._full[key]

    def traces(self) -> dict[tuple[int, int], Trace]:
        """Every rank's full trace keyed by (step, rank); shards are read on first use (saved tensors lazily).

        Example:
            >>> g.traces()[(100, 3)]["relu_1"].out
        """
        return {key: self._full_trace(key) for key in sorted(self._traces)}

    def tables(self) -> dict[tuple[int, int], Any]:
        """Per (step, rank) what the merge read: op columns ``sources.MERGE_FIELDS`` (all columns when built
        from full traces), the collective table, metadata and failed_op."""
        return dict(self._traces)

    def __repr__(self) -> str:
        ops = sum(len(t) for t in self._traces.values())
        return (
            f"<MergedTrace {len(self.ranks)}/{self.world_size} ranks, {len(self.steps)} step(s), {ops} ops, "
            f"{len(self.joined)} collectives, {len(self.findings)} findings>"
        )

    # -- time ----------------------------------------------------------------------------------------------
    @property
    def timings(self) -> list[dict[str, Any]]:
        """Aligned timing of each joined collective (same order as ``joined``): see ``timing.collective_timing``."""
        if self._timings is None:
            self._timings = [collective_timing(j, self.offsets) for j in self.joined]
        return self._timings

    def stragglers(self) -> Any:
        """Ranks ordered, per step, by how long the others waited for them (most first).

        Columns: step, rank, caused_wait_ns (others' wait over the collectives this rank arrived at last),
        last_count (collectives it arrived at last), wait_ns (its own wait for others). Waits are unions of
        intervals, so async collectives in flight together count their common wait once.

        Example:
            >>> g.stragglers().groupby("step").head(1)   # the worst straggler of each step
        """
        import pandas as pd

        rows = straggler_rows(self.joined, self.timings)
        frame = pd.DataFrame(rows, columns=["step", "rank", "caused_wait_ns", "last_count", "wait_ns"])
        return frame.sort_values(
            ["step", "caused_wait_ns", "rank"], ascending=[True, False, True]
        ).reset_index(drop=True)

    def time_breakdown(self) -> Any:
        """Per (step, rank): ops, compute_ns, comm_ns, wait_ns, window_ns (see ``timing.time_breakdown``)."""
        import pandas as pd

        waits = {
            (row["step"], row["rank"]): row["wait_ns"] for row in straggler_rows(self.joined, self.timings)
        }
        rows = [
            time_breakdown(s, r, trace, waits.get((s, r), 0))
            for (s, r), trace in sorted(self._traces.items())
        ]
        return pd.DataFrame(
            rows, columns=["step", "rank", "ops", "compute_ns", "comm_ns", "wait_ns", "window_ns"]
        )

    # -- views ---------------------------------------------------------------------------------------------
    @property
    def collectives(self) -> Any:
        """One row per joined collective: step, group, seq, func, verdict, ranks, bytes, skew, duration, ...

        Example:
            >>> g.collectives.query("verdict != 'matched'")
        """
        from .views import collectives_frame

        return collectives_frame(self)

    def to_pandas(self) -> Any:
        """All ops of all ranks: the schema's columns plus ``step``, ``rank`` and ``aligned_start_ns``.

        Example:
            >>> g.to_pandas().groupby(["rank", "func"]).duration_ns.sum()
        """
        from .views import ops_frame

        return ops_frame(self)

    def summary(self) -> str:
        """A readable report: ranks, collectives by verdict, findings, stragglers, compute vs communication."""
        from .views import summary

        return summary(self)

    def draw(
        self,
        path: str,
        *,
        format: str = "svg",
        depth: int | str | None = "auto",
        rank: int | Sequence[int] | None = None,
        step: int | Sequence[int] | None = None,
        phase: str | Sequence[str] | None = None,
        show_all: bool = False,
    ) -> str:
        """Render one cluster per (step, rank), each drawn as ``trace.draw`` draws one trace, with collectives
        joined across clusters. ``rank`` and ``step`` pick the shards drawn (an int or a list); ``depth``,
        ``phase`` and ``show_all`` as in :func:`tl_dist.views.draw.draw` (``"auto"`` counts the nodes of all
        drawn shards together). Returns the written file's path.

        Example:
            >>> g.draw("job42.svg", step=100, phase="backward")
        """
        from .draw import draw

        return draw(
            self, path, format=format, depth=depth, rank=rank, step=step, phase=phase, show_all=show_all
        )

    def to_perfetto(self, path: str) -> str:
        """Write a Chrome/Perfetto trace JSON: one process per rank, ops as slices on aligned time, joined
        collectives linked by flow events. Returns ``path``.

        Example:
            >>> g.to_perfetto("job42.json")   # open in https://ui.perfetto.dev
        """
        from .perfetto import write_perfetto

        return write_perfetto(self, path)

    def report(self, path: str | os.PathLike, *, title: str | None = None) -> str:
        """Write a self-contained HTML report of the run (overview, timeline per rank, time per module and op,
        collectives, findings, statistics; needs the ``tl_dist[report]`` extra). Returns ``path``.

        Example:
            >>> g.report("job42.html")   # opens offline in any browser
        """
        from ..report import write_report

        return write_report(self, path, title=title)

    def save(self, path: str | os.PathLike) -> str:
        """Write the merged trace as one HDF5 file (every rank's tables and the merge facts); reopen it with
        :func:`load_merged`.

        Example:
            >>> g.save("job42-merged.h5"); tl.load_merged("job42-merged.h5").findings
        """
        from .persist import save_merged

        return save_merged(self, path)


def build(
    traces: dict[tuple[int, int], Trace],
    *,
    world_size: int,
    incomplete: set[tuple[int, int]],
    shard_errors: dict[tuple[int, int], str],
    absent: dict[int, set[int]],
) -> MergedTrace:
    """Join and judge loaded traces (no I/O): the part of :func:`merge_ranks` after reading."""
    steps = sorted({s for s, _ in traces} | set(absent))
    joined: list[Joined] = []
    findings: list[Finding] = []
    for step in steps:
        step_absent = absent.get(step, set())
        for r in sorted(step_absent):
            err = shard_errors.get((step, r))
            if err is not None:
                findings.append(Finding("unreadable_shard", step, (), -1, (r,), f"rank {r}: {err}"))
            else:
                findings.append(
                    Finding("missing_rank", step, (), -1, (r,), f"no shard for rank {r} of {world_size}")
                )
        ranks = sorted(r for s, r in traces if s == step)
        entries = {r: entries_of(r, traces[(step, r)]) for r in ranks}
        last_op = {r: _last_op(traces[(step, r)]) for r in ranks}
        step_incomplete = {r for s, r in incomplete if s == step}
        j, f = match_step(step, entries, incomplete=step_incomplete, absent=step_absent, last_op=last_op)
        joined.extend(j)
        findings.extend(f)
    offsets = estimate_offsets(joined, sorted({r for _, r in traces}))
    return MergedTrace(
        traces,
        world_size=world_size,
        joined=joined,
        findings=findings,
        offsets=offsets,
        incomplete=incomplete,
        shard_errors=shard_errors,
    )


def _last_op(trace: Trace) -> dict[str, Any]:
    if not len(trace):
        return {}
    cols = trace.columns
    i = len(trace) - 1
    failed = trace.failed_op or {}
    return {
        "op": i,
        "label": cols["label"][i],
        "module": cols["module"][i],
        "source": cols["source"][i],
        **({"failed_func": failed.get("func"), "error": failed.get("error")} if failed else {}),
    }


def merge_ranks(
    path_or_paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    strict: bool = True,
    world_size: int | None = None,
    progress: bool = False,
) -> MergedTrace:
    """Join the rank-local shards of a job into one :class:`MergedTrace`.

    Collectives are matched across ranks on (group ranks, sequence number) and judged (matched, type / size /
    dtype mismatch, missing, order, not completed); clocks are aligned from matched collectives' completion
    times. Full reference: ``docs/merge.md``.

    Args:
        path_or_paths: a run directory (``DIR/rank{R}/step{S}.h5``, all steps) or a list of shard paths.
        strict: raise :class:`~tl_dist.errors.MergeError` when a shard is missing or unreadable; False merges
            the rest and reports ``missing_rank`` / ``unreadable_shard`` findings.
        world_size: ranks the job had; default: what the shards' metadata say.
        progress: show a progress bar while reading shards.

    Returns:
        The merged trace; ``.findings`` is empty for a healthy run.

    Raises:
        MergeError: no shards, shards of different world sizes, or (``strict``) a missing/unreadable shard.

    Example:
        >>> g = tl.merge_ranks("runs/job42")
        >>> [str(f) for f in g.findings], g.stragglers().head(3)
    """
    if not isinstance(strict, bool):
        raise ValueError(f"strict must be a bool, got {strict!r}")
    if world_size is not None and (
        isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1
    ):
        raise ValueError(f"world_size must be a positive int or None, got {world_size!r}")
    if not isinstance(progress, bool):
        raise ValueError(f"progress must be a bool, got {progress!r}")
    # Reading and joining allocate millions of small objects (columns, one record per collective per rank);
    # the cyclic GC walking them again and again made the merge superlinear in ranks. Nothing here makes
    # cycles, so it is paused for the merge (and restored if it was on).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _merge(path_or_paths, strict=strict, world_size=world_size, progress=progress)
    finally:
        if gc_was_enabled:
            gc.enable()


def _merge(path_or_paths: Any, *, strict: bool, world_size: int | None, progress: bool) -> MergedTrace:
    refs: list[ShardRef] = find_shards(path_or_paths)
    traces, errors, facts = read_all(refs, strict=strict, progress=progress)
    worlds = {w for w, _ in facts.values() if w is not None}
    if len(worlds) > 1:
        raise MergeError(f"shards disagree on the world size ({sorted(worlds)}): are they from one run?")
    if world_size is None:
        world_size = worlds.pop() if worlds else max(r for _, r in list(traces) + list(errors)) + 1
    elif worlds and worlds != {world_size}:
        raise MergeError(f"world_size={world_size} but the shards say {sorted(worlds)}")
    out_of_range = sorted({r for _, r in list(traces) + list(errors) if r >= world_size})
    if out_of_range:
        raise MergeError(f"shards for rank(s) {out_of_range} but world_size is {world_size}")
    steps = sorted({s for s, _ in traces} | {s for s, _ in errors})
    absent: dict[int, set[int]] = {}
    for step in steps:
        missing = {r for r in range(world_size) if (step, r) not in traces}
        if missing:
            absent[step] = missing
            if strict:
                raise MergeError(
                    f"no shard for rank(s) {sorted(missing)} at step {step} (world size {world_size}); pass "
                    "strict=False to merge the other ranks and report it as a finding"
                )
    incomplete = {key for key, (_, complete) in facts.items() if not complete}
    return build(traces, world_size=world_size, incomplete=incomplete, shard_errors=errors, absent=absent)
