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
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import h5py

from .._files import replacing
from ..errors import SelectionError, ShardFormatError
from ..schema import COLLECTIVE_FIELDS, MODULE_CALL_FIELDS, OP_FIELDS, SCHEMA_VERSION
from ..store.codecs import ShardOptions, write_table
from .sources import GivenPaths, MergedFileSource, check_subset

if TYPE_CHECKING:
    from .graph import MergedTrace

ENCODING = "tl_dist.merged"
ENCODING_VERSION = "1"


def save_merged(g: MergedTrace, path: str | os.PathLike) -> str:
    """Write ``g`` to ``path`` (temporary name, then renamed), reading one rank's trace at a time. Returns the
    path."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path, got {type(path).__name__}")
    path = os.fspath(path)
    options = ShardOptions()
    with replacing(path) as tmp, h5py.File(tmp, "w") as root:
        root.attrs["encoding-type"] = ENCODING
        root.attrs["encoding-version"] = ENCODING_VERSION
        root.attrs["schema_version"] = SCHEMA_VERSION
        root.attrs["world_size"] = g.world_size
        root.attrs["shard_errors"] = json.dumps({f"{s}:{r}": e for (s, r), e in g.shard_errors.items()})
        root.attrs["expected"] = json.dumps(g.expected_ranks)
        root.attrs["written"] = json.dumps({str(r): s for r, s in g.written.items()})
        if g.given is not None:
            root.attrs["given"] = g.given.to_json()
        shards = root.create_group("shards")
        for (step, rank), trace in g.iter_traces():
            grp = shards.create_group(f"s{step}_r{rank}")
            grp.attrs["step"] = step
            grp.attrs["rank"] = rank
            meta = dict(trace.metadata)
            meta["complete"] = (step, rank) not in g.incomplete
            grp.attrs["metadata"] = json.dumps(meta, default=str)
            grp.attrs["failed_op"] = json.dumps(trace.failed_op, default=str)
            write_table(grp, "ops", OP_FIELDS, trace.columns, options)
            write_table(grp, "modules", MODULE_CALL_FIELDS, trace.module_table, options)
            write_table(grp, "collectives", COLLECTIVE_FIELDS, trace.collective_table, options)
    return path


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
    if not os.path.isfile(path):
        raise ShardFormatError(f"{path}: no such merged-trace file")
    try:
        root = h5py.File(path, "r")
    except OSError as exc:
        raise ShardFormatError(f"{path}: not a readable HDF5 file: {exc}") from exc
    try:
        with root:
            if root.attrs.get("encoding-type") != ENCODING:
                raise ShardFormatError(
                    f"{path}: not a merged trace (encoding-type {root.attrs.get('encoding-type')!r}, "
                    f"expected {ENCODING!r}); open shards with tl.load or merge them with tl.merge_ranks"
                )
            version = int(root.attrs.get("schema_version", -1))
            if version > SCHEMA_VERSION:
                raise ShardFormatError(f"{path}: schema version {version} is newer than {SCHEMA_VERSION}")
            world_size = int(root.attrs["world_size"])
            errors = {
                (int(k.split(":")[0]), int(k.split(":")[1])): v
                for k, v in json.loads(root.attrs["shard_errors"]).items()
            }
            expected = (
                json.loads(root.attrs["expected"]) if "expected" in root.attrs else list(range(world_size))
            )
            written = {int(r): s for r, s in json.loads(root.attrs.get("written", "{}")).items()}
            given = GivenPaths.from_json(root.attrs["given"]) if "given" in root.attrs else None
            groups = {
                (int(g.attrs["step"]), int(g.attrs["rank"])): name for name, g in root["shards"].items()
            }
    except ShardFormatError:
        raise
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
