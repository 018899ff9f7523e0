"""Finding and reading shards for a merge, one at a time.

The merge keeps of each shard only what it needs after reading it (:class:`RankData`): its collectives as
:class:`~.match.Entry` records, the compute/communication breakdown of its window, where its last op was and the
shard's metadata. Op tables are read as numpy arrays and dropped at once, so a merge's memory is bounded by one
step's collectives, not by the run's ops. Strings (op labels, funcs, module addresses, source lines) are interned
once across all shards (:class:`Interner`): the same label on 1,024 ranks is one string, and the join compares
integer ids.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import MergeError, ShardFormatError
from ..schema import COLLECTIVE_FIELDS, OP_FIELDS
from ..telemetry import module_name
from .match import Entry
from .timing import local_breakdown

if TYPE_CHECKING:
    import h5py

    from ..trace import Trace

_SHARD_RE = re.compile(r"rank(\d+)[/\\]step(\d+)\.h5$")


@dataclass
class ShardRef:
    """One shard file and the rank and step its path names."""

    path: Path
    rank: int
    step: int


def find_shards(path_or_paths: Any) -> list[ShardRef]:
    """The shards of a run directory (``DIR/rank{R}/step{S}.h5``) or an explicit list of shard paths.

    Raises:
        MergeError: the directory holds no shards, a path does not exist, or a path is not named
            ``rank{R}/step{S}.h5`` (the rank and step are read from it when the shard cannot be).
    """
    if isinstance(path_or_paths, (str, os.PathLike)):
        root = Path(path_or_paths)
        if root.is_dir():
            found = sorted(root.glob("rank*/step*.h5"))
            refs = [_ref(p) for p in found if _SHARD_RE.search(p.as_posix())]
            if not refs:
                raise MergeError(
                    f"path_or_paths: {root} holds no shards (expected {root}/rank00000/step00000000.h5, as "
                    "written by tl.arm + tl.capture)"
                )
            return refs
        paths = [root]
    elif isinstance(path_or_paths, (list, tuple)) and path_or_paths:
        paths = [Path(p) for p in path_or_paths]
    else:
        raise MergeError(
            f"path_or_paths must be a run directory or a non-empty list of shard paths, got {path_or_paths!r}"
        )
    refs = []
    for p in paths:
        if not p.exists():
            raise MergeError(f"path_or_paths: {p} does not exist")
        if not _SHARD_RE.search(p.as_posix()):
            raise MergeError(
                f"path_or_paths: {p} is not named rank{{R}}/step{{S}}.h5 as tl.arm writes shards"
            )
        refs.append(_ref(p))
    return refs


def _ref(p: Path) -> ShardRef:
    m = _SHARD_RE.search(p.as_posix())
    return ShardRef(p, int(m.group(1)), int(m.group(2)))


def check_subset(value: Any, name: str) -> frozenset[int] | None:
    """``steps=`` / ``ranks=`` of a merge: None (all) or a non-empty collection of non-negative ints."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, bool, int)) or not isinstance(value, Iterable):
        raise ValueError(
            f"{name} must be None or a collection of non-negative ints (e.g. [0, 3]), got {value!r}"
        )
    items = list(value)
    bad = [v for v in items if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0]
    if bad or not items:
        raise ValueError(f"{name} must hold non-negative ints, got {value!r}")
    return frozenset(int(v) for v in items)


class Interner:
    """One integer id per distinct string across the shards of a merge (id 0 is ``""``).

    Example:
        >>> names = Interner(); names.id("all_reduce_1"), names.strings[1]
        (1, 'all_reduce_1')
    """

    __slots__ = ("strings", "_ids")

    def __init__(self) -> None:
        self.strings: list[str] = [""]
        self._ids: dict[str, int] = {"": 0}

    def id(self, value: str) -> int:
        got = self._ids.get(value)
        if got is None:
            got = self._ids[value] = len(self.strings)
            self.strings.append(value)
        return got

    def ids(self, codes: np.ndarray, table: Any) -> np.ndarray:
        """Global ids of ``codes`` into a shard's ``table`` (of str or bytes); only the codes used are interned."""
        if not len(codes):
            return np.zeros(0, dtype=np.int64)
        used = np.unique(codes)
        if used[0] < 0 or used[-1] >= len(table):
            raise ValueError(f"string codes {used[0]}..{used[-1]} outside a table of {len(table)}")
        lookup = np.zeros(int(used[-1]) + 1, dtype=np.int64)
        for c in used.tolist():
            s = table[c]
            lookup[c] = self.id(s.decode() if isinstance(s, bytes) else s)
        return lookup[codes]

    def text(self, ids: np.ndarray) -> list[str]:
        return list(map(self.strings.__getitem__, ids.tolist()))


class RankData:
    """What the merge keeps of one (step, rank) shard (see the module docstring)."""

    __slots__ = ("rank", "step", "metadata", "failed_op", "n_ops", "entries", "last_op", "local", "first_ns")

    def __init__(self, rank: int, step: int, metadata: dict, failed_op: Any) -> None:
        self.rank = rank
        self.step = step
        self.metadata = metadata
        self.failed_op = failed_op
        self.n_ops = 0
        self.entries: list[Entry] | None = []
        self.last_op: dict[str, Any] = {}
        self.local = (0, 0, 0)  # compute_ns, comm_ns, window_ns (timing.local_breakdown)
        self.first_ns = -1  # first op's start, epoch ns on the rank's clock

    @property
    def complete(self) -> bool:
        return bool(self.metadata.get("complete", True))


_OP_FIELDS = tuple(
    f for f in OP_FIELDS if f.name in ("kind", "start_ns", "duration_ns", "label", "module", "source")
)
_COLL_FIELDS = tuple(  # what an Entry holds
    f
    for f in COLLECTIVE_FIELDS
    if f.name
    in ("op", "func", "group_name", "seq", "root", "peer", "in_numel", "out_numel", "dtype", "bytes")
    or f.name in ("is_async", "issue_ns", "complete_ns", "state")
)
_GROUP_FIELD = next(f for f in COLLECTIVE_FIELDS if f.name == "group_ranks")
_STR_COLL = tuple(f.name for f in _COLL_FIELDS if f.kind == "str")


def read_rank(
    root: h5py.Group, metadata: dict, failed_op: Any, strings: list[str] | None, names: Interner, key: tuple
) -> RankData:
    """Read one shard's (or merged-file group's) tables into a :class:`RankData`. ``key``: (step, rank)."""
    from ..store.codecs import read_arrays

    step, rank = key
    data = RankData(rank, step, metadata, failed_op)
    n, ops, op_tables = read_arrays(root, "ops", _OP_FIELDS)
    m, ct, ct_tables = read_arrays(root, "collectives", _COLL_FIELDS)
    groups = _groups(root["collectives"], ct["group_name"]) if m else []

    def ids(arrays: dict, tables: dict, name: str, rows: np.ndarray | None = None) -> np.ndarray:
        codes = arrays[name] if rows is None else arrays[name][rows]
        return names.ids(codes, strings if tables[name] is None else tables[name])

    data.n_ops = n
    in_module = _in_module(root["ops"], n, ops, op_tables, ids) if n else np.zeros(0, dtype=bool)
    if n:
        starts, durations = ops["start_ns"], ops["duration_ns"]
        is_coll = ids(ops, op_tables, "kind") == names.id("collective")
        spans = ct["is_async"] & (ct["complete_ns"] >= 0)
        async_spans = (ct["op"][spans], ct["issue_ns"][spans], ct["complete_ns"][spans])
        data.local = local_breakdown(is_coll, starts, durations, async_spans)
        data.first_ns = int(starts.min())
        last = np.array([n - 1])
        module = names.strings[int(ids(ops, op_tables, "module", last)[0])]
        data.last_op = {
            "op": n - 1,
            "label": names.strings[int(ids(ops, op_tables, "label", last)[0])],
            "module": module_name({"module": module, "module_stack": bool(in_module[-1])}),
            "source": names.strings[int(ids(ops, op_tables, "source", last)[0])],
        }
    if failed_op:
        data.last_op.update(failed_func=failed_op.get("func"), error=failed_op.get("error"))
    if not m:
        return data
    op = ct["op"]
    valid = (op >= 0) & (op < n)
    at = np.where(valid, op, 0)
    where = {}
    for name in ("label", "module", "source"):
        got = ids(ops, op_tables, name, at) if n else np.zeros(m, dtype=np.int64)
        where[name] = np.where(valid, got, 0)
    coded = {name: ids(ct, ct_tables, name) for name in _STR_COLL}
    text = {name: names.text(coded[name]) for name in ("func", "group_name", "dtype", "state")}
    keys = list(zip(coded["func"].tolist(), where["module"].tolist(), where["source"].tolist()))
    data.entries = list(
        map(
            Entry._make,
            zip(
                [rank] * m,
                range(m),
                op.tolist(),
                text["func"],
                groups,
                text["group_name"],
                ct["seq"].tolist(),
                ct["peer"].tolist(),
                ct["root"].tolist(),
                ct["in_numel"].tolist(),
                ct["out_numel"].tolist(),
                text["dtype"],
                ct["bytes"].tolist(),
                ct["is_async"].tolist(),
                ct["issue_ns"].tolist(),
                ct["complete_ns"].tolist(),
                text["state"],
                names.text(where["label"]),
                names.text(where["module"]),
                names.text(where["source"]),
                (in_module[at] & valid).tolist() if n else [False] * m,
                keys,
            ),
        )
    )
    return data


def _in_module(
    ops: h5py.Group, n: int, arrays: dict, tables: dict, ids: Callable[[dict, dict, str], np.ndarray]
) -> np.ndarray:
    """Per op whether it ran inside a module call (a non-empty ``module_stack``), from that column's offsets
    alone; a shard without the column: whether it names a module."""
    import h5py

    from ..store.codecs import _read_dataset

    node = ops.get("module_stack")
    offsets = _read_dataset(node, "offsets") if isinstance(node, h5py.Group) else None
    if offsets is None or len(offsets) != n + 1:
        return ids(arrays, tables, "module") != 0  # id 0 is ""
    return np.diff(offsets) > 0


def _groups(collectives: h5py.Group, group_names: np.ndarray) -> list[tuple[int, ...]]:
    """The group_ranks column as tuples, one object per process group. Within a process a group's name names
    its members, so only the first row of each (name, size) is read: a world group of 1,024 ranks on 500 rows
    would otherwise be half a million values to decompress per shard, and O(ranks^2) for the merge."""
    import h5py

    from ..store.codecs import _read_dataset, read_ragged_rows

    node = collectives[_GROUP_FIELD.name]
    offsets = _read_dataset(node, "offsets") if isinstance(node, h5py.Group) else None
    if offsets is None or len(offsets) != len(group_names) + 1:
        raise ValueError("collectives/group_ranks: offsets missing or of the wrong length")
    sizes = np.diff(offsets)
    key = group_names.astype(np.int64) * (int(sizes.max(initial=0)) + 1) + sizes
    distinct, first, which = np.unique(key, return_index=True, return_inverse=True)
    _, groups = read_ragged_rows(collectives, _GROUP_FIELD, first.tolist())
    return [groups[k] for k in which.reshape(-1).tolist()]


class ShardSource:
    """The shards of a run, read on demand: ``read`` for the merge, ``trace`` for a rank's full trace."""

    def __init__(self, refs: list[ShardRef]) -> None:
        self.refs = {(r.step, r.rank): r for r in refs}

    def name(self, key: tuple[int, int]) -> str:
        return str(self.refs[key].path)

    def read(self, key: tuple[int, int], names: Interner) -> RankData:
        """Raises ShardFormatError (unreadable, names the file) or MergeError (rank/step disagree with its path)."""
        from ..store.hdf5 import open_shard

        ref = self.refs[key]
        with open_shard(ref.path, raw_strings=True) as (root, metadata, failed_op, strings):
            for field, named in (("rank", ref.rank), ("step", ref.step)):
                value = metadata.get(field)
                if value is not None and int(value) != named:
                    raise MergeError(
                        f"{ref.path}: shard says {field} {value} but its path names {field} {named}"
                    )
            return read_rank(root, metadata, failed_op, strings, names, key)

    def trace(self, key: tuple[int, int], fields: Iterable[str] | None = None) -> Trace:
        """The full trace of one shard (saved tensors read lazily, on first access); with ``fields``, only those
        op columns (``store.hdf5.load_columns``)."""
        from ..store.hdf5 import load, load_columns

        path = self.refs[key].path
        return load(path) if fields is None else load_columns(path, fields)


class MergedFileSource:
    """The per-rank tables stored in a merged file (``MergedTrace.save``), read on demand."""

    def __init__(self, path: str, groups: dict[tuple[int, int], str]) -> None:
        self.path = path
        self.groups = groups

    def name(self, key: tuple[int, int]) -> str:
        return f"{self.path}:/shards/{self.groups[key]}"

    def _open(self, key: tuple[int, int]) -> Any:
        import h5py

        f = h5py.File(self.path, "r")
        return f, f["shards"][self.groups[key]]

    def read(self, key: tuple[int, int], names: Interner) -> RankData:
        f, grp = self._open(key)
        try:
            with f:
                meta = json.loads(grp.attrs["metadata"])
                return read_rank(grp, meta, json.loads(grp.attrs["failed_op"]), None, names, key)
        except (MergeError, ShardFormatError):
            raise
        except Exception as exc:  # noqa: BLE001 - any decoding failure is a format problem of this file
            raise ShardFormatError(f"{self.name(key)}: corrupt merged-trace group: {exc}") from exc

    def trace(self, key: tuple[int, int], fields: Iterable[str] | None = None) -> Trace:
        """The stored tables of one (step, rank) as a trace (all its op columns: ``fields`` is not needed)."""
        from ..schema import MODULE_CALL_FIELDS
        from ..store.codecs import read_table
        from ..trace import Trace

        f, grp = self._open(key)
        with f:
            return Trace(
                read_table(grp, "ops", OP_FIELDS),
                read_table(grp, "modules", MODULE_CALL_FIELDS),
                collective_table=read_table(grp, "collectives", COLLECTIVE_FIELDS),
                metadata=json.loads(grp.attrs["metadata"]),
                failed_op=json.loads(grp.attrs["failed_op"]),
            )


class TraceSource:
    """Traces already in memory, keyed by (step, rank), merged as shards are: each is written once to an
    in-memory HDF5 file with the store's codecs and read back by the merge's own reader, so both take one path.

    Example:
        >>> g = build(TraceSource(traces), sorted(traces), world_size=2, strict=True)
    """

    def __init__(self, traces: dict[tuple[int, int], Trace]) -> None:
        import h5py

        from ..schema import MODULE_CALL_FIELDS
        from ..store.codecs import ShardOptions, write_table

        self.traces = dict(traces)
        self._file = h5py.File(io.BytesIO(), "w")
        options = ShardOptions()
        for (step, rank), trace in sorted(self.traces.items()):
            grp = self._file.create_group(f"s{step}_r{rank}")
            write_table(grp, "ops", OP_FIELDS, trace.columns, options)
            write_table(grp, "modules", MODULE_CALL_FIELDS, trace.module_table, options)
            write_table(grp, "collectives", COLLECTIVE_FIELDS, trace.collective_table, options)

    def name(self, key: tuple[int, int]) -> str:
        return f"trace of rank {key[1]} step {key[0]} (in memory)"

    def read(self, key: tuple[int, int], names: Interner) -> RankData:
        trace = self.traces[key]
        grp = self._file[f"s{key[0]}_r{key[1]}"]
        return read_rank(grp, dict(trace.metadata), trace.failed_op, None, names, key)

    def trace(self, key: tuple[int, int], fields: Iterable[str] | None = None) -> Trace:
        return self.traces[key]
