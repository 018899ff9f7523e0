"""The merged trace's data and queries: :class:`MergedTrace`, the per-rank shards of a job joined into one global
trace.

Built by :mod:`.build` (``tl.merge_ranks``, ``tl.load_merged``); its methods that reach the views, the report
and the merged file (``collectives``, ``clocks``, ``to_pandas``, ``summary``, ``draw``, ``to_perfetto``,
``report``, ``save``) are defined in :mod:`.api` and attached to the class there. Views that need more than
the kept step tables (``g.joined``, ``g.rank(r)``) read the shards again, one at a time where they can.

Example:
    >>> g = tl.merge_ranks("runs/job42")
    >>> g.findings, g.clocks, g.stragglers(), g.collectives, g.to_perfetto("job42.json")
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..errors import SelectionError
from .clocks import ClockSolution
from .match import Finding, Joined, mark_consequences
from .sources import GivenPaths, Interner, RankData
from .steps import explain_missing_ranks, join_step
from .timing import BREAKDOWN_COLUMNS, step_timing

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
            (``missing_rank``, ``unreadable_shard``, ``foreign_shard``, ``incomplete_shard``) first, then per group in issue order.
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
        given: GivenPaths | None = None,
    ) -> None:
        self._source = source
        self.expected_ranks = expected  # the ranks merged (the world, or ranks=)
        self.written = written  # per rank, every step it has a shard for
        self.given = given  # a merge of a list of shard paths: what it left out (None: a run directory)
        self._data = data  # per (step, rank): RankData without its entries
        self._absent = absent
        self.world_size = world_size
        self.steps = [r.step for r in results]
        self.findings: list[Finding] = [f for r in results for f in r.findings]
        mark_consequences(self.findings)
        explain_missing_ranks(self.findings)
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
        Raises :class:`~tl_dist.errors.SelectionError` when no readable shard is there.

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
            raise SelectionError(f"no readable shard for rank {rank} at step {step}; ranks: {self.ranks}")
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
        """Per (step, rank): ops, the window's step facts (window_ns: enter -> leave, idle_before_ns,
        idle_after_ns, compute_ns, comm_ns; :mod:`tl_dist.step_facts`) and wait_ns (its wait for others on the
        aligned clock). Definitions: docs/telemetry.md, "Step facts".

        Example:
            >>> g.time_breakdown().query("step == 0")[["rank", "window_ns", "idle_before_ns", "wait_ns"]]
        """
        import pandas as pd

        return pd.DataFrame(self._breakdown_rows, columns=list(BREAKDOWN_COLUMNS))
