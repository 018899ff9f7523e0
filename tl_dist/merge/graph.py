"""``tl.merge_ranks``: the per-rank shards of a job joined into one global trace (:class:`MergedTrace`).

The merge streams: it reads one step's shards at a time, keeps of each only its collectives and a few numbers
(:mod:`.sources`), joins, judges, aligns and times that step (:mod:`.steps`), keeps the step's small result tables
and drops its per-member records. Views that need more (``g.joined``, ``g.rank(r)``, ``to_pandas``, Perfetto)
read the shards again, one at a time where they can.

Example:
    >>> g = tl.merge_ranks("runs/job42")
    >>> g.findings, g.clocks, g.stragglers(), g.collectives, g.to_perfetto("job42.json")
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import MergeError, TlDistError
from .clocks import ClockSolution
from .dask_engine import DaskEngine, DaskSource, connected, resolve_engine
from .match import Finding, Joined
from .sources import Interner, RankData, ShardSource, check_subset, find_shards
from .steps import RunFacts, analyse_step, join_step
from .timing import step_timing

if TYPE_CHECKING:
    from ..trace import Trace


class MergedTrace:
    """The traces of all ranks (and steps) of a job, with collectives joined across ranks.

    Built by :func:`merge_ranks` or :func:`load_merged`. Times in every view are aligned per step to each rank's
    reference clock (``clocks``).

    Attributes:
        world_size: ranks in the job.
        steps: captured steps merged, ascending.
        findings: problems found (:class:`~tl_dist.merge.match.Finding`): per step, the shard-level ones
            (``missing_rank``, ``unreadable_shard``, ``incomplete_shard``) first, then per group in issue order.
        incomplete: (step, rank) pairs whose shard was written at a crash, hang or signal.
        shard_errors: (step, rank) -> why that shard could not be read (``strict=False``).

    Example:
        >>> g = tl.merge_ranks("runs/job42")
        >>> print(g.summary()); g.stragglers().head()
    """

    def __init__(
        self,
        source: Any,
        *,
        world_size: int,
        data: dict[tuple[int, int], RankData],
        results: list[Any],
        shard_errors: dict[tuple[int, int], str],
        absent: dict[int, set[int]],
        expected: list[int],
        written: dict[int, list[int]],
    ) -> None:
        self._source = source
        self.expected_ranks = expected  # the ranks merged (the world, or ranks=)
        self.written = written  # per rank, every step it has a shard for
        self._data = data  # per (step, rank): RankData without its entries
        self._absent = absent
        self.world_size = world_size
        self.steps = [r.step for r in results]
        self.findings: list[Finding] = [f for r in results for f in r.findings]
        self.clock_solutions: dict[int, ClockSolution] = {r.step: r.clocks for r in results}
        self._collective_rows = [row for r in results for row in r.collective_rows]
        self._straggler_rows = [row for r in results for row in r.straggler_rows]
        self._breakdown_rows = [row for r in results for row in r.breakdown_rows]
        self.incomplete = {key for key, d in data.items() if not d.complete}
        self.shard_errors = shard_errors
        self._full: dict[tuple[int, int], Trace] = {}
        self._joined: list[Joined] | None = None

    # -- access --------------------------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        """Ranks with at least one readable shard, ascending."""
        return sorted({r for _, r in self._data})

    def keys(self) -> list[tuple[int, int]]:
        """The (step, rank) pairs with a readable shard, sorted."""
        return sorted(self._data)

    def metadata(self, step: int, rank: int) -> dict[str, Any]:
        """The run metadata of that rank's shard for ``step`` (host, boot_id, end_reason, stack, ...)."""
        return self._data[(step, rank)].metadata

    def rank(self, rank: int, *, step: int | None = None) -> Trace:
        """That rank's :class:`~tl_dist.trace.Trace` (for ``step``; may be omitted when one step was merged).

        Example:
            >>> g.rank(1)["all_reduce_1"].duration_ns
        """
        if step is None:
            steps = sorted(s for s, r in self._data if r == rank)
            if len(steps) > 1:
                raise ValueError(f"step: rank {rank} has shards for steps {steps}; pass step=")
            step = steps[0] if steps else None
        key = (step, rank)
        if key not in self._data:
            raise KeyError(f"no readable shard for rank {rank} at step {step}; ranks: {self.ranks}")
        if key not in self._full:
            self._full[key] = self._source.trace(key)
        return self._full[key]

    def traces(self) -> dict[tuple[int, int], Trace]:
        """Every rank's full trace keyed by (step, rank); shards are read on first use (saved tensors lazily).

        Example:
            >>> g.traces()[(100, 3)]["relu_1"].out
        """
        return {(s, r): self.rank(r, step=s) for s, r in self.keys()}

    def iter_traces(
        self, *, step: int | None = None, fields: Iterable[str] | None = None
    ) -> Iterable[tuple[tuple[int, int], Trace]]:
        """((step, rank), full trace) one at a time (of ``step`` only, when given), none kept: for passes over
        big runs. ``fields``: a shard on disk is read for these op columns only (the others hold their kind's
        empty value) besides its module, collective and statistics tables.

        Example:
            >>> for (step, rank), t in g.iter_traces(step=100, fields=["func", "duration_ns"]): ...
        """
        for key in self.keys():
            if step is None or key[0] == step:
                full = self._full.get(key)
                yield key, full if full is not None else self._source.trace(key, fields)

    def aligned_origin_ns(self) -> int:
        """The earliest op start of any rank and step on aligned clocks (the zero of Perfetto's time axis)."""
        offsets = self.offsets
        starts = [d.first_ns - offsets.get(k, 0) for k, d in self._data.items() if d.n_ops]
        return min(starts) if starts else 0

    def __repr__(self) -> str:
        ops = sum(d.n_ops for d in self._data.values())
        return (
            f"<MergedTrace {len(self.ranks)}/{self.world_size} ranks, {len(self.steps)} step(s), {ops} ops, "
            f"{len(self._collective_rows)} collectives, {len(self.findings)} findings>"
        )

    # -- joined collectives ---------------------------------------------------------------------------------
    def joined_step(self, step: int) -> list[Joined]:
        """The joined collectives of one step (each member's record), rebuilt from its shards.

        Example:
            >>> [j.verdict for j in g.joined_step(100)]
        """
        if self._joined is not None:
            return [j for j in self._joined if j.step == step]
        names = Interner()
        data = {r: self._source.read((s, r), names) for s, r in self.keys() if s == step}
        return join_step(step, data, self._absent.get(step, set()))[0]

    @property
    def joined(self) -> list[Joined]:
        """Every collective joined across ranks (:class:`~tl_dist.merge.match.Joined`), in the order of
        ``collectives``. Rebuilt from the shards on first use and kept: it holds every member's record."""
        if self._joined is None:
            self._joined = [j for step in self.steps for j in self.joined_step(step)]
        return self._joined

    @property
    def timings(self) -> list[dict[str, Any]]:
        """Aligned timing of each joined collective (same order as ``joined``), as dicts: start_ns, skew_ns,
        duration_ns, last_rank, uncertainty_ns, waits and uncertain (per rank); see ``timing.StepTiming``."""
        out = []
        for step in self.steps:
            joined = [j for j in self.joined if j.step == step]
            timing = step_timing(joined, self.clock_solutions[step])
            out.extend(timing.collective(k) for k in range(len(joined)))
        return out

    # -- time ----------------------------------------------------------------------------------------------
    @property
    def offsets(self) -> dict[tuple[int, int], int]:
        """Per (step, rank), its clock minus its reference's, in ns (see ``clocks``)."""
        return {(s, r): o for s, sol in self.clock_solutions.items() for r, o in sol.offsets.items()}

    @property
    def clocks(self) -> Any:
        """Per (step, rank): host, offset_ns (its clock minus its reference rank's), uncertainty_ns (the true
        offset lies within offset_ns +- uncertainty_ns; NA when not estimated), method (``same-host``: one clock,
        offset 0 by construction; ``estimated``: from the causality bounds of matched collectives; ``none``:
        not bounded both ways), collectives (used as evidence), reference.

        Example:
            >>> g.clocks.query("method == 'estimated'").uncertainty_ns.max()
        """
        from .views import clocks_frame

        return clocks_frame(self)

    def stragglers(self) -> Any:
        """Ranks ordered, per step, by how long the others waited for them (most first).

        Columns: step, rank, caused_wait_ns (others' wait over the collectives this rank arrived at last),
        last_count (collectives it arrived at last), wait_ns (its own wait for others), uncertain_wait_ns (its
        waits no longer than the clock uncertainty: blamed on nobody). Only a lead larger than the clock
        uncertainty between two ranks counts as a wait. Waits are unions of intervals, so async collectives in
        flight together count their common wait once.

        Example:
            >>> g.stragglers().groupby("step").head(1)   # the worst straggler of each step
        """
        import pandas as pd

        columns = ["step", "rank", "caused_wait_ns", "last_count", "wait_ns", "uncertain_wait_ns"]
        frame = pd.DataFrame(self._straggler_rows, columns=columns)
        return frame.sort_values(
            ["step", "caused_wait_ns", "rank"], ascending=[True, False, True]
        ).reset_index(drop=True)

    def time_breakdown(self) -> Any:
        """Per (step, rank): ops, compute_ns, comm_ns, wait_ns, window_ns (see ``timing.local_breakdown``)."""
        import pandas as pd

        columns = ["step", "rank", "ops", "compute_ns", "comm_ns", "wait_ns", "window_ns"]
        return pd.DataFrame(self._breakdown_rows, columns=columns)

    # -- views ---------------------------------------------------------------------------------------------
    @property
    def collectives(self) -> Any:
        """One row per joined collective: step, group, seq, func, verdict, ranks, bytes, skew, duration, ...

        Example:
            >>> g.collectives.query("verdict != 'matched'")
        """
        from .views import collectives_frame

        return collectives_frame(self._collective_rows)

    def to_pandas(self) -> Any:
        """All ops of all ranks: the schema's columns plus ``step``, ``rank`` and ``aligned_start_ns``.

        Example:
            >>> g.to_pandas().groupby(["rank", "func"]).duration_ns.sum()
        """
        from .views import ops_frame

        return ops_frame(self)

    def summary(self) -> str:
        """A readable report: ranks, collectives by verdict, clocks, findings, stragglers, time per rank."""
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
    source: Any,
    keys: list[tuple[int, int]],
    *,
    world_size: int,
    strict: bool,
    expected: Iterable[int] | None = None,
    shard_errors: dict[tuple[int, int], str] | None = None,
    written: dict[int, list[int]] | None = None,
    progress: bool = False,
) -> MergedTrace:
    """The streaming merge over ``source`` (``sources.ShardSource`` / ``MergedFileSource``): reads the shards
    ``keys`` step by step and keeps each step's results (no I/O besides ``source.read``).

    ``expected``: the ranks each step should have (default: the world); ``shard_errors``: shards already known
    to be unreadable; ``written``: per rank, every step it has a shard for (for ``missing_rank``'s last step).

    Raises:
        MergeError: a shard of another world size, or (``strict``) one that cannot be read.
    """
    errors = dict(shard_errors or {})
    expected = sorted(range(world_size) if expected is None else expected)
    by_step: dict[int, list[int]] = {s: [] for s, _ in errors}
    for s, r in sorted(keys):
        by_step.setdefault(s, []).append(r)
    names = Interner()
    facts = RunFacts(world_size, errors, written or {})
    bar = _progress(len(keys)) if progress else None
    results, data, absent = [], {}, {}
    try:
        for step in sorted(by_step):
            step_data: dict[int, RankData] = {}
            for rank in by_step[step]:
                try:
                    d = source.read((step, rank), names)
                except TlDistError as exc:
                    if strict:
                        raise MergeError(
                            f"cannot merge: {exc} (pass strict=False to merge the other shards)"
                        ) from exc
                    errors[(step, rank)] = str(exc)
                    continue
                finally:
                    if bar is not None:
                        bar.update()
                world = d.metadata.get("world_size")
                if world is not None and int(world) != world_size:
                    raise MergeError(
                        f"{source.name((step, rank))} says world size {world}, the run {world_size} (shards "
                        "disagree on the world size: are they from one run?)"
                    )
                step_data[rank] = d
            missing = {r for r in expected if r not in step_data}
            if missing:
                absent[step] = missing
            result, _, _ = analyse_step(step, step_data, missing, facts)
            results.append(result)
            for rank, d in step_data.items():
                d.entries = None  # rebuilt from the shard when a view needs them
                data[(step, rank)] = d
    finally:
        if bar is not None:
            bar.close()
    return MergedTrace(
        source,
        world_size=world_size,
        data=data,
        results=results,
        shard_errors=errors,
        absent=absent,
        expected=expected,
        written=written or {},
    )


def load_merged(
    path: str | os.PathLike, *, steps: Iterable[int] | None = None, ranks: Iterable[int] | None = None
) -> MergedTrace:
    """Reopen a merged trace written by ``MergedTrace.save`` (optionally only some steps / ranks of it); the
    merge is re-run over its stored tables, one step at a time.

    Raises:
        ShardFormatError: the file is missing, not HDF5, not a merged trace, or from a newer schema.
        MergeError: ``steps`` / ``ranks`` select nothing in it.

    Example:
        >>> g = tl.load_merged("job42-merged.h5"); g.findings
    """
    from ..store.location import is_url, reading
    from .persist import open_merged

    if is_url(path):  # a local copy, kept while the process runs: views read its tables again
        with reading(path, keep=True) as local:
            return load_merged(local, steps=steps, ranks=ranks)
    stored = open_merged(path, steps=steps, ranks=ranks)
    return build(stored.pop("source"), stored.pop("keys"), strict=False, **stored)


def _progress(total: int) -> Any:
    try:
        from tqdm.auto import tqdm  # installed with lightning; optional here
    except ImportError:
        return None
    return tqdm(total=total, desc="reading shards", unit="shard", leave=False)


def merge_ranks(
    path_or_paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    strict: bool = True,
    world_size: int | None = None,
    steps: Iterable[int] | None = None,
    ranks: Iterable[int] | None = None,
    progress: bool = False,
    engine: Any = "local",
) -> MergedTrace:
    """Join the rank-local shards of a job into one :class:`MergedTrace`.

    Collectives are matched across ranks on (group ranks, sequence number) and judged (matched, type / size /
    dtype mismatch, missing, order, not completed); shards written at a crash, hang or signal are findings of
    their own; clocks are aligned per step (same host and boot: offset 0; else causality bounds from matched
    collectives). Shards are read one step at a time. Full reference: ``docs/merge.md``.

    Args:
        path_or_paths: a run directory (``DIR/rank{R}/step{S}.h5``, all steps) or a list of shard paths;
            either may be an fsspec URL (``s3://bucket/run42``; needs ``tl_dist[scale]``).
        strict: raise :class:`~tl_dist.errors.MergeError` when a shard is missing or unreadable; False merges
            the rest and reports ``missing_rank`` / ``unreadable_shard`` findings.
        world_size: ranks the job had; default: what the shards' metadata say.
        steps: merge only these captured steps (e.g. ``[100, 200]``); None: all.
        ranks: merge only these ranks (their collectives are judged on the ranks chosen); None: all.
        progress: show a progress bar while reading shards.
        engine: where shards are read: ``"local"`` (this process), or on Dask workers (``tl_dist[scale]``):
            ``"dask"`` (a LocalCluster started for the merge), a scheduler address (``"tcp://HOST:8786"``), a
            ``distributed.Client``, or a :class:`~tl_dist.merge.dask_engine.DaskEngine`. The result is the
            same; see ``docs/merge.md`` ("On Dask").

    Returns:
        The merged trace; ``.findings`` is empty for a healthy run.

    Raises:
        MergeError: no shards (or none of the chosen steps/ranks), shards of different world sizes, or
            (``strict``) a missing/unreadable shard.

    Example:
        >>> g = tl.merge_ranks("runs/job42", steps=[100], ranks=range(8))
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
    want_steps, want_ranks = check_subset(steps, "steps"), check_subset(ranks, "ranks")
    dask = resolve_engine(engine)
    # Reading and joining allocate many small objects (one record per collective per rank); the cyclic GC
    # walking them again and again made the merge superlinear in ranks. Nothing here makes cycles, so it is
    # paused for the merge (and restored if it was on).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _merge(path_or_paths, strict, world_size, want_steps, want_ranks, progress, dask)
    finally:
        if gc_was_enabled:
            gc.enable()


def _merge(
    path_or_paths: Any,
    strict: bool,
    world_size: int | None,
    steps: frozenset[int] | None,
    ranks: frozenset[int] | None,
    progress: bool,
    dask: DaskEngine | None = None,
) -> MergedTrace:
    refs = find_shards(path_or_paths)
    written: dict[int, list[int]] = {}
    for ref in refs:
        written.setdefault(ref.rank, []).append(ref.step)
    chosen = [r for r in refs if (steps is None or r.step in steps) and (ranks is None or r.rank in ranks)]
    if not chosen:
        have_steps = sorted({r.step for r in refs})
        have_ranks = sorted({r.rank for r in refs})
        raise MergeError(
            f"no shards for steps={sorted(steps) if steps else 'all'}, ranks={sorted(ranks) if ranks else 'all'}:"
            f" the shards have steps {_span(have_steps)} and ranks {_span(have_ranks)}"
        )
    hint = _world_hint(refs)
    if world_size is not None and hint is not None and hint != world_size:
        raise MergeError(f"world_size={world_size} but the shards say [{hint}]")
    world = world_size or hint or max(r.rank for r in refs) + 1
    out_of_range = sorted({r.rank for r in refs if r.rank >= world})
    if out_of_range:
        raise MergeError(f"shards for rank(s) {out_of_range} but world_size is {world}")
    if ranks is not None and max(ranks) >= world:
        raise ValueError(
            f"ranks: {sorted(r for r in ranks if r >= world)} outside the world of {world} ranks"
        )
    expected = sorted(ranks) if ranks is not None else list(range(world))
    if strict:
        have = {(r.step, r.rank) for r in chosen}
        for step in sorted({r.step for r in chosen}):
            missing = [r for r in expected if (step, r) not in have]
            if missing:
                raise MergeError(
                    f"no shard for rank(s) {missing} at step {step} (world size {world}); pass "
                    "strict=False to merge the other ranks and report it as a finding"
                )
    source = ShardSource(chosen)
    keys = sorted(source.refs)
    run = {
        "world_size": world,
        "strict": strict,
        "expected": expected,
        "written": written,
        "progress": progress,
    }
    if dask is None:
        return build(source, keys, **run)
    with connected(dask) as client:
        remote = DaskSource(source, client, keys)
        try:
            return build(remote, keys, **run)
        finally:
            remote.close()


def _world_hint(refs: list[Any]) -> int | None:
    """The world size the first readable shard's metadata names (a cheap attribute read), or None."""
    import h5py

    from ..store.location import reading

    for ref in refs:
        try:
            with reading(ref.path) as path, h5py.File(path, "r") as f:
                value = json.loads(f.attrs["metadata"]).get("world_size")
        except Exception:  # noqa: BLE001 - unreadable shards are reported when the merge reads them
            continue
        if value is not None:
            return int(value)
    return None


def _span(values: list[int]) -> str:
    if len(values) > 6:
        return f"{values[0]}..{values[-1]} ({len(values)})"
    return str(values)
