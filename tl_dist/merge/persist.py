"""``MergedTrace.save`` / ``tl.load_merged``: one HDF5 file holding every rank's tables and the merge's inputs.

Layout (all tables written with the store's codecs, so ``h5dump`` reads them like shards)::

    /                       attrs: encoding-type "tl_dist.merged", encoding-version, schema_version,
                                   world_size, shard_errors (JSON), expected (JSON: the ranks merged),
                                   written (JSON: per rank, the steps it has shards for),
                                   given (JSON, when a list of shard paths was merged: how many, their run
                                   directories, the shards there left out)
    /shards/s{S}_r{R}/      attrs: step, rank, metadata (JSON), failed_op (JSON)
        ops/ modules/ collectives/      tables as in a shard

Verdicts, offsets and timings are not stored: loading re-runs the (deterministic) merge over the stored tables, one
step at a time, so a file written by an older tl_dist gets today's analysis. Saved tensors stay in the shards.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ..errors import SelectionError, ShardFormatError
from ..schema import COLLECTIVE_FIELDS, MODULE_CALL_FIELDS, OP_FIELDS
from ..store import read_merged, write_merged
from .sources import GivenPaths, MergedFileSource, check_subset

if TYPE_CHECKING:
    from ..trace import Trace
    from .graph import MergedTrace


def merged_attrs(g: MergedTrace, step: int | None = None) -> dict[str, Any]:
    """The root attributes of a merged file of ``g`` (of one ``step`` only: its shard errors)."""
    errors = {k: e for k, e in g.shard_errors.items() if step is None or k[0] == step}
    attrs = {
        "world_size": g.world_size,
        "shard_errors": json.dumps({f"{s}:{r}": e for (s, r), e in errors.items()}),
        "expected": json.dumps(g.expected_ranks),
        "written": json.dumps({str(r): s for r, s in g.written.items()}),
    }
    if g.given is not None:
        attrs["given"] = g.given.to_json()
    return attrs


def trace_groups(
    traces: Iterable[tuple[tuple[int, int], Trace]], incomplete: Collection[tuple[int, int]]
) -> Iterator[tuple[str, dict[str, Any], list]]:
    """The ``/shards`` groups of a merged file (``store.write_merged``'s ``groups``), one (step, rank) trace at a
    time; ``incomplete``: the keys whose window ended early."""
    for (step, rank), trace in traces:
        meta = dict(trace.metadata)
        meta["complete"] = (step, rank) not in incomplete
        group_attrs = {
            "step": step,
            "rank": rank,
            "metadata": json.dumps(meta, default=str),
            "failed_op": json.dumps(trace.failed_op, default=str),
        }
        tables = [
            ("ops", OP_FIELDS, trace.columns),
            ("modules", MODULE_CALL_FIELDS, trace.module_table),
            ("collectives", COLLECTIVE_FIELDS, trace.collective_table),
        ]
        yield f"s{step}_r{rank}", group_attrs, tables


def save_merged(g: MergedTrace, path: str | os.PathLike) -> str:
    """Write ``g`` to ``path`` (temporary name, then renamed), reading one rank's trace at a time. Returns the
    path."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path, got {type(path).__name__}")
    return write_merged(path, merged_attrs(g), trace_groups(g.iter_traces(), g.incomplete))


def open_merged(
    path: str | os.PathLike, *, steps: Iterable[int] | None = None, ranks: Iterable[int] | None = None
) -> dict[str, Any]:
    """What ``tl.load_merged`` needs to re-run the merge over a merged file: ``build``'s arguments (the source of
    the chosen (step, rank) tables, their keys, world size, expected ranks, shard errors, steps written).

    Raises:
        ShardFormatError: the file is missing, not HDF5, not a merged trace, or from a newer schema.
        SelectionError: ``steps`` / ``ranks`` select nothing in it.
    """

    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path, got {type(path).__name__}")
    want_steps, want_ranks = check_subset(steps, "steps"), check_subset(ranks, "ranks")
    path = os.fspath(path)
    attrs, group_attrs = read_merged(path)
    try:
        world_size = int(attrs["world_size"])
        errors = {
            (int(k.split(":")[0]), int(k.split(":")[1])): v
            for k, v in json.loads(attrs["shard_errors"]).items()
        }
        expected = json.loads(attrs["expected"]) if "expected" in attrs else list(range(world_size))
        written = {int(r): s for r, s in json.loads(attrs.get("written", "{}")).items()}
        given = GivenPaths.from_json(attrs["given"]) if "given" in attrs else None
        groups = {(int(a["step"]), int(a["rank"])): name for name, a in group_attrs.items()}
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a format problem of this file
        raise ShardFormatError(f"{path}: corrupt merged-trace file: {type(exc).__name__}: {exc}") from exc

    def chosen(key: tuple[int, int]) -> bool:
        return (want_steps is None or key[0] in want_steps) and (want_ranks is None or key[1] in want_ranks)

    groups = {k: v for k, v in groups.items() if chosen(k)}
    errors = {k: v for k, v in errors.items() if chosen(k)}
    if not groups and not errors:
        raise SelectionError(f"{path}: no ranks' tables for steps={steps!r}, ranks={ranks!r}")
    if want_ranks is not None:
        expected = sorted(want_ranks & set(expected))
    return {
        "source": MergedFileSource(path, groups),
        "keys": sorted(groups),
        "world_size": world_size,
        "expected": expected,
        "shard_errors": errors,
        "written": written,
        "given": given,
    }
