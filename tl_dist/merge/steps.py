"""One captured step of a merge: join its collectives, judge them, align its clocks, time it.

The merge runs this once per step over that step's :class:`~.sources.RankData` and keeps only the small results
(:class:`StepResult` rows); the per-member records can be rebuilt from the shards (:func:`join_step`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .clocks import ClockSolution, clock_key, estimate_clocks
from .match import Finding, Joined, ending, match_step
from .members import Members
from .sources import GivenPaths, RankData
from .timing import StepTiming, breakdown_row, step_timing, straggler_rows

# What an incomplete shard says about how its window ended, copied into findings' ``where``.
ENDED_KEYS = ("end_reason", "error", "stack_at", "stack")


def ended_info(data: RankData) -> dict[str, Any]:
    """How an incomplete shard's window ended and where its thread was; {} for a complete shard."""
    if data.complete:
        return {}
    meta = data.metadata
    return {k: meta[k] for k in ENDED_KEYS if meta.get(k)} or {"end_reason": "unknown"}


def join_step(step: int, data: dict[int, RankData], absent: set[int]) -> tuple[list[Joined], list[Finding]]:
    """Join and judge one step's collectives (``data``: per rank with a readable shard)."""
    return match_step(
        step,
        {r: d.entries or [] for r, d in data.items()},
        incomplete={r for r, d in data.items() if not d.complete},
        absent=absent,
        last_op={r: d.last_op for r, d in data.items()},
        ended={r: info for r, d in data.items() if (info := ended_info(d))},
    )


@dataclass
class RunFacts:
    """What a step's analysis needs to know about the run beyond the step's shards."""

    world_size: int
    errors: dict[tuple[int, int], str]  # (step, rank) -> why that shard could not be read
    written: dict[int, list[int]]  # per rank, every step it has a shard for
    given: GivenPaths | None = None  # None: a run directory was merged, not a list of shard paths


def beside_note(step: int, ranks: list[int], given: GivenPaths | None) -> str:
    """Where the shards of ``ranks`` for ``step`` are when the merge was given a list of shard paths that left
    them out ('' when not: they are really absent)."""
    if given is None:
        return ""
    paths = [given.beside[(step, r)] for r in ranks if (step, r) in given.beside]
    if not paths:
        return ""
    return (
        f"not among the {given.count} shard path(s) given, but beside them: {', '.join(paths)} (merge the run "
        f"directory {' / '.join(given.roots)} to include them)"
    )


def explain_missing_ranks(findings: list[Finding]) -> None:
    """A rank without a shard at a step whose last shard ended early (an exception, a signal) did not die
    without a post-mortem: it left that one and never came back. Its ``missing_rank`` says so and is that
    ending's consequence (``primary=False``), as are hangs of its groups at that step."""
    ended = {(f.step, f.ranks[0]): f for f in findings if f.kind == "incomplete_shard" and f.ranks}
    gone: set[tuple[int, int]] = set()  # (step, rank) without a shard, its process having failed before
    for f in findings:
        if f.kind != "missing_rank" or not f.ranks:
            continue
        r = f.ranks[0]
        last = f.where.get(r, {}).get("last_step")
        cause = ended.get((last, r))
        if cause is None or "shard" in f.where.get(r, {}):
            continue
        f.message = (
            f"no shard for rank {r}: its last shard, step {last}, is a post-mortem ({cause.message}); it did not "
            "capture this step"
        )
        f.primary = False
        gone.add((f.step, r))
    for f in findings:  # the others then hang waiting for it: that failure's consequence too
        if f.kind == "not_completed" and any((f.step, r) in gone for r in f.group):
            f.primary = False


def shard_findings(step: int, data: dict[int, RankData], absent: set[int], run: RunFacts) -> list[Finding]:
    """Findings about the shards themselves: ``unreadable_shard``, ``missing_rank`` (with the last step that
    rank wrote a shard for), ``foreign_shard`` (written by another job) and ``incomplete_shard`` (how its window
    ended, where its thread was)."""
    out = []
    for r in sorted(absent):
        err = run.errors.get((step, r))
        if err is not None:
            out.append(Finding("unreadable_shard", step, (), -1, (r,), f"rank {r}: {err}"))
            continue
        earlier = [s for s in run.written.get(r, ()) if s < step]
        last = max(earlier) if earlier else None
        where: dict[str, Any] = {"absent": True, "last_step": last}
        beside = beside_note(step, [r], run.given)
        if beside and run.given is not None:  # the merge was given a subset: the rank is left out, not dead
            where["shard"] = run.given.beside[(step, r)]
            message = f"no shard for rank {r} of {run.world_size}: {beside}"
        else:
            tail = (
                f"its last shard is step {last}" if last is not None else "no earlier shard of it was found"
            )
            among = ""
            if run.given is not None:
                among = (
                    f" among the {run.given.count} shard path(s) given, nor in their run directory "
                    f"{' / '.join(run.given.roots)}"
                )
            message = (
                f"no shard for rank {r} of {run.world_size}{among} ({tail}): it died or hung before its window "
                "ended, without a post-mortem (SIGKILL, a C++ abort)"
                + (", or its shards are elsewhere" if among else "")
            )
        out.append(Finding("missing_rank", step, (), -1, (r,), message, {r: where}))
    out += foreign_shards(step, data)
    for r, d in sorted(data.items()):
        info = ended_info(d)
        if not info:
            continue
        message = f"rank {r}'s window ended early: {ending(info)}"
        if info.get("stack_at"):
            message += f"; it was at {info['stack_at']}"
        failed = d.failed_op or {}
        if failed.get("func"):
            message += f"; op in flight: {failed['func']}"
        last = {f"last_{k}": v for k, v in d.last_op.items()}
        out.append(Finding("incomplete_shard", step, (), -1, (r,), message, {r: {**last, **info}}))
    return out


def foreign_shards(step: int, data: dict[int, RankData]) -> list[Finding]:
    """``foreign_shard``: the step's shards come from more than one job (a run folder reused by a second job
    that did not overwrite every shard of the first). The job armed last is taken as the run's; the ranks whose
    shard another job wrote are at fault. Shards without a ``job_nonce`` (no process group, older shards) are
    not judged."""
    nonces = {r: str(d.metadata.get("job_nonce") or "") for r, d in data.items()}
    armed = {r: int(d.metadata.get("start_time_ns", 0)) for r, d in data.items()}
    jobs = {n for n in nonces.values() if n}
    if len(jobs) < 2:
        return []
    latest = max(jobs, key=lambda n: max(armed[r] for r in nonces if nonces[r] == n))
    foreign = tuple(sorted(r for r, n in nonces.items() if n and n != latest))
    message = (
        f"the shard(s) of rank(s) {list(foreign)} for step {step} were written by another job than the others' "
        f"(job_nonce {sorted({nonces[r] for r in foreign})} vs {latest!r}, armed earlier): the run folder was "
        "reused and these ranks did not write this step again; their collectives are not this job's"
    )
    where = {r: {"job_nonce": nonces[r], "start_time_ns": armed[r]} for r in foreign}
    return [Finding("foreign_shard", step, (), -1, foreign, message, where)]


@dataclass
class StepResult:
    """The kept results of one step."""

    step: int
    findings: list[Finding]
    clocks: ClockSolution
    collective_rows: list[tuple] = field(default_factory=list)
    straggler_rows: list[dict[str, Any]] = field(default_factory=list)
    breakdown_rows: list[dict[str, Any]] = field(default_factory=list)


COLLECTIVE_COLUMNS = (
    "step",
    "group",
    "group_name",
    "seq",
    "func",
    "verdict",
    "ranks",
    "missing",
    "absent",
    "dtype",
    "bytes",
    "start_ns",
    "skew_ns",
    "duration_ns",
    "last_rank",
    "uncertainty_ns",
    "label",
    "module",
    "source",
    "detail",
)


def collective_row(j: Joined, timing: StepTiming, k: int) -> tuple:
    """One row of ``g.collectives`` (``COLLECTIVE_COLUMNS``): joined collective ``k`` of a step and its timing."""
    entries = list(j.entries.values())
    first = entries[0]
    return (
        j.step,
        j.group,
        j.group_name,
        j.seq,
        j.func,
        j.verdict,
        tuple(sorted(j.entries)),
        j.missing,
        j.absent,
        "/".join(sorted({e.dtype for e in entries})),
        max(e.nbytes for e in entries),
        int(timing.start[k]),
        int(timing.skew[k]),
        int(timing.duration[k]),
        int(timing.last_rank[k]),
        int(timing.uncertainty[k]),
        first.label,
        first.module_name,  # the owner rule of every view (schema.module_name): <root>, (outside modules)
        first.source,
        j.detail,
    )


def analyse_step(
    step: int, data: dict[int, RankData], absent: set[int], run: RunFacts
) -> tuple[StepResult, list[Joined], StepTiming]:
    """Everything the merge computes for one step; also returns its joined collectives and their timing."""
    joined, found = join_step(step, data, absent)
    findings = shard_findings(step, data, absent, run)
    members = Members.of(joined)
    clocks = estimate_clocks(joined, {r: clock_key(r, d.metadata) for r, d in data.items()}, members)
    timing = step_timing(joined, clocks, members)
    stragglers = straggler_rows(step, joined, timing)
    waits = {row["rank"]: row["wait_ns"] for row in stragglers}
    result = StepResult(
        step,
        findings + found,
        clocks,
        [collective_row(j, timing, k) for k, j in enumerate(joined)],
        stragglers,
        [breakdown_row(step, r, d.n_ops, d.local, waits.get(r, 0)) for r, d in sorted(data.items())],
    )
    return result, joined, timing
