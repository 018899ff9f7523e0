"""The merge algorithm: ``tl.merge_ranks`` and ``tl.load_merged`` build a :class:`~.graph.MergedTrace`.

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
import os
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import MergeError, SelectionError, ShardFormatError, TlDistError
from ..store import read_metadata
from ..store.location import is_dir as location_is_dir
from ..store.location import is_url, reading
from .dask_engine import DaskEngine, DaskSource, connected, resolve_engine
from .graph import MergedTrace
from .persist import open_merged
from .sources import GivenPaths, Interner, RankData, ShardSource, check_subset, find_shards
from .split import open_steps, save_steps
from .steps import RunFacts, analyse_step, beside_note


def build(
    source: Any,
    keys: list[tuple[int, int]],
    *,
    world_size: int,
    strict: bool,
    expected: Iterable[int] | None = None,
    shard_errors: dict[tuple[int, int], str] | None = None,
    written: dict[int, list[int]] | None = None,
    given: GivenPaths | None = None,
    progress: bool = False,
) -> MergedTrace:
    """The streaming merge over ``source`` (``sources.ShardSource`` / ``MergedFileSource``): reads the shards
    ``keys`` step by step and keeps each step's results (no I/O besides ``source.read``).

    ``expected``: the ranks each step should have (default: the world); ``shard_errors``: shards already known
    to be unreadable; ``written``: per rank, every step it has a shard for (for ``missing_rank``'s last step);
    ``given``: the merge was of a list of shard paths (``missing_rank`` says where the left-out ones are).

    Raises:
        MergeError: a shard of another world size, or (``strict``) one that cannot be read.
    """
    errors = dict(shard_errors or {})
    expected = sorted(range(world_size) if expected is None else expected)
    by_step: dict[int, list[int]] = {s: [] for s, _ in errors}
    for s, r in sorted(keys):
        by_step.setdefault(s, []).append(r)
    names = Interner()
    facts = RunFacts(world_size, errors, written or {}, given)
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
        given=given,
    )


def load_merged(
    path: str | os.PathLike, *, steps: Iterable[int] | None = None, ranks: Iterable[int] | None = None
) -> MergedTrace:
    """Reopen a merged trace written by ``MergedTrace.save`` (optionally only some steps / ranks of it).

    A merged file (``g.save("x.h5")``): the merge is re-run over its stored tables, one step at a time. A
    per-step folder (``g.save(FOLDER, split="step")``, ``merge_ranks(..., out=FOLDER)``): only its index is
    read (findings, clocks, stragglers, collectives as the merge computed them); a step's file is read when a
    view needs that step's tables (``g.rank(r, step=s)``, ``g.to_pandas(step=s)``), whole-run views read them
    one at a time. ``ranks=`` on a folder re-merges those ranks from the chosen steps' files (their
    collectives are judged on them alone).

    Raises:
        ShardFormatError: the file (or a folder's index) is missing, not a merged trace, corrupt, or from a
            newer schema; the message names the file.
        SelectionError: ``steps`` / ``ranks`` select nothing in it (a ``MergeError`` and a ``ValueError``).

    Example:
        >>> g = tl.load_merged("job42-merged.h5"); g.findings
        >>> g = tl.load_merged("s3://bucket/job42-merged"); g.to_pandas(step=100)   # step 100's file only
    """
    if isinstance(path, (str, os.PathLike)) and location_is_dir(path):  # a per-step folder: its index only
        opened = open_steps(path, steps=steps, ranks=ranks)
        if "stored" in opened:
            return MergedTrace(**opened["stored"])
        rebuild = opened["rebuild"]  # ranks= judges their collectives anew: re-merge from the step files
        return build(rebuild.pop("source"), rebuild.pop("keys"), strict=False, **rebuild)
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
    out: str | os.PathLike | None = None,
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
        out: also write the merged result as a per-step folder here (a path or URL; what
            ``g.save(out, split="step")`` writes, reopened lazily by :func:`load_merged`); with a Dask engine each
            step's file is written on a worker from the shards, so this process never holds a step's op tables.

    Returns:
        The merged trace; ``.findings`` is empty for a healthy run.

    Raises:
        MergeError: no shards, shards of different world sizes, or (``strict``) a missing/unreadable shard.
        SelectionError: ``steps`` / ``ranks`` choose no shard, or ranks outside the world.

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
    if out is not None and not isinstance(out, (str, os.PathLike)):
        raise ValueError(f"out must be a folder path or URL, got {type(out).__name__}")
    want_steps, want_ranks = check_subset(steps, "steps"), check_subset(ranks, "ranks")
    dask = resolve_engine(engine)
    # Reading and joining allocate many small objects (one record per collective per rank); the cyclic GC
    # walking them again and again made the merge superlinear in ranks. Nothing here makes cycles, so it is
    # paused for the merge (and restored if it was on).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _merge(path_or_paths, strict, world_size, want_steps, want_ranks, progress, dask, out)
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
    out: str | os.PathLike | None = None,
) -> MergedTrace:
    refs = find_shards(path_or_paths)
    is_dir = isinstance(path_or_paths, (str, os.PathLike)) and location_is_dir(path_or_paths)
    given = None if is_dir else GivenPaths.of(refs)
    written: dict[int, list[int]] = {}
    for step, rank in sorted({(r.step, r.rank) for r in refs} | set(given.beside if given else ())):
        written.setdefault(rank, []).append(step)
    chosen = [r for r in refs if (steps is None or r.step in steps) and (ranks is None or r.rank in ranks)]
    if not chosen:
        have_steps = sorted({r.step for r in refs})
        have_ranks = sorted({r.rank for r in refs})
        raise SelectionError(
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
        raise SelectionError(
            f"ranks: {sorted(r for r in ranks if r >= world)} outside the world of {world} ranks"
        )
    expected = sorted(ranks) if ranks is not None else list(range(world))
    if strict:
        have = {(r.step, r.rank) for r in chosen}
        for step in sorted({r.step for r in chosen}):
            missing = [r for r in expected if (step, r) not in have]
            if missing:
                beside = beside_note(step, missing, given)
                raise MergeError(
                    f"no shard for rank(s) {missing} at step {step} (world size {world})"
                    + (f": {beside}" if beside else "")
                    + "; pass strict=False to merge the other ranks and report it as a finding"
                )
    source = ShardSource(chosen)
    keys = sorted(source.refs)
    run = {
        "world_size": world,
        "strict": strict,
        "expected": expected,
        "written": written,
        "given": given,
        "progress": progress,
    }
    if dask is None:
        g = build(source, keys, **run)
        if out is not None:
            save_steps(g, out)
        return g
    with connected(dask) as client:
        remote = DaskSource(source, client, keys)
        try:
            g = build(remote, keys, **run)
        finally:
            remote.close()
        if out is not None:
            save_steps(g, out, client=client)
        return g


def _world_hint(refs: list[Any]) -> int | None:
    """The world size the first readable shard's metadata names (a cheap attribute read), or None."""
    for ref in refs:
        try:
            with reading(ref.path) as path:
                value = read_metadata(path).get("world_size")
        except ShardFormatError:  # unreadable shards are reported when the merge reads them
            continue
        if value is not None:
            return int(value)
    return None


def _span(values: list[int]) -> str:
    if len(values) > 6:
        return f"{values[0]}..{values[-1]} ({len(values)})"
    return str(values)
