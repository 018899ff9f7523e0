"""``MergedTrace.save`` / ``tl.load_merged``: one HDF5 file holding every rank's tables and the merge's inputs.

Layout (all tables written with the store's codecs, so ``h5dump`` reads them like shards)::

    /                       attrs: encoding-type "tl_dist.merged", encoding-version, schema_version,
                                   world_size, shard_errors (JSON), absent (JSON)
    /shards/s{S}_r{R}/      attrs: step, rank, metadata (JSON), failed_op (JSON)
        ops/ modules/ collectives/      tables as in a shard

Verdicts, offsets and timings are not stored: loading re-runs the (deterministic, I/O-free) join over the stored
tables, so a file written by an older tl_dist gets today's analysis. Saved tensors stay in the shards.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import h5py

from ..errors import ShardFormatError
from ..schema import COLLECTIVE_FIELDS, MODULE_CALL_FIELDS, OP_FIELDS, SCHEMA_VERSION
from ..store.codecs import ShardOptions, read_table, write_table
from ..trace import Trace

if TYPE_CHECKING:
    from .graph import MergedTrace

ENCODING = "tl_dist.merged"
ENCODING_VERSION = "1"


def save_merged(g: MergedTrace, path: str | os.PathLike) -> str:
    """Write ``g`` to ``path`` (temporary name, then renamed). Returns the path."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path, got {type(path).__name__}")
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    options = ShardOptions()
    absent: dict[str, list[int]] = {}
    for f in g.findings:
        if f.kind in ("missing_rank", "unreadable_shard"):
            absent.setdefault(str(f.step), []).extend(f.ranks)
    try:
        with h5py.File(tmp, "w") as root:
            root.attrs["encoding-type"] = ENCODING
            root.attrs["encoding-version"] = ENCODING_VERSION
            root.attrs["schema_version"] = SCHEMA_VERSION
            root.attrs["world_size"] = g.world_size
            root.attrs["shard_errors"] = json.dumps({f"{s}:{r}": e for (s, r), e in g.shard_errors.items()})
            root.attrs["absent"] = json.dumps(absent)
            shards = root.create_group("shards")
            for (step, rank), trace in sorted(g.traces().items()):
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
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_merged(path: str | os.PathLike) -> MergedTrace:
    """Reopen a merged trace written by ``MergedTrace.save``.

    Raises:
        ShardFormatError: the file is missing, not HDF5, not a merged trace, or from a newer schema.

    Example:
        >>> g = tl.load_merged("job42-merged.h5"); g.findings
    """
    from .graph import build

    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path, got {type(path).__name__}")
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
            absent = {int(s): set(rs) for s, rs in json.loads(root.attrs["absent"]).items()}
            traces: dict[tuple[int, int], Trace] = {}
            incomplete: set[tuple[int, int]] = set()
            for grp in root["shards"].values():
                key = (int(grp.attrs["step"]), int(grp.attrs["rank"]))
                meta = json.loads(grp.attrs["metadata"])
                traces[key] = Trace(
                    read_table(grp, "ops", OP_FIELDS),
                    read_table(grp, "modules", MODULE_CALL_FIELDS),
                    collective_table=read_table(grp, "collectives", COLLECTIVE_FIELDS),
                    metadata=meta,
                    failed_op=json.loads(grp.attrs["failed_op"]),
                )
                if not meta.get("complete", True):
                    incomplete.add(key)
    except ShardFormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a format problem of this file
        raise ShardFormatError(f"{path}: corrupt merged-trace file: {type(exc).__name__}: {exc}") from exc
    return build(traces, world_size=world_size, incomplete=incomplete, shard_errors=errors, absent=absent)
