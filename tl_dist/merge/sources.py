"""Finding and reading shards for a merge, one at a time.

The merge keeps of each shard only what it needs after reading it (:class:`RankData`): its collectives as
:class:`~.match.Entry` records, the compute/communication breakdown of its window, where its last op was and the
shard's metadata. Op tables are read as numpy arrays and dropped at once, so a merge's memory is bounded by one
step's collectives, not by the run's ops. Strings (op labels, funcs, module addresses, source lines) are interned
once across all shards (:class:`Interner`): the same label on 1,024 ranks is one string, and the join compares
integer ids.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MergeError, ShardFormatError
from ..schema import COLLECTIVE_FIELDS, MODULE_CALL_FIELDS, OP_FIELDS, is_profiler_marker, module_name
from ..step_facts import local_facts, window_span
from ..store import (
    ARRAY_DTYPES,
    load,
    load_columns,
    open_group,
    open_shard,
    ragged_lengths,
    read_arrays,
    read_ragged_rows,
    read_table,
)
from ..store.location import exists, find, is_dir, is_url, join, reading
from ..trace import Trace
from .match import Entry

_SHARD_RE = re.compile(r"rank(\d+)[/\\]step(\d+)\.h5$")


@dataclass
class ShardRef:
    """One shard file and the rank and step its path names."""

    path: Path | str  # a str is a URL
    rank: int
    step: int


def find_shards(path_or_paths: Any) -> list[ShardRef]:
    """The shards of a run directory (``DIR/rank{R}/step{S}.h5``) or an explicit list of shard paths; a
    directory or shard given as a URL (``s3://bucket/run42``) is listed and read through fsspec
    (``tl_dist.store.location``).

    Raises:
        MergeError: the directory holds no shards, a path does not exist, or a path is not named
            ``rank{R}/step{S}.h5`` (the rank and step are read from it when the shard cannot be).
    """
    # Messages lead with the path, not the Python argument's name: `tl-dist` users see them too.
    if isinstance(path_or_paths, (str, os.PathLike)):
        root = _place(path_or_paths)
        if is_dir(root):
            refs = _shards_in(root)
            if not refs:
                raise MergeError(
                    f"{root} holds no shards (expected {join(root, 'rank00000')}/step00000000.h5, as written "
                    "by tl.arm + tl.capture)"
                )
            return refs
        paths = [root]
    elif isinstance(path_or_paths, (list, tuple)) and path_or_paths:
        paths = [_place(p) for p in path_or_paths]
    else:
        raise MergeError(
            f"merge_ranks takes a run directory or a non-empty list of shard paths, got {path_or_paths!r}"
        )
    refs = []
    for p in paths:
        if not exists(p):
            raise MergeError(f"{p} does not exist (expected a run directory or a shard)")
        if not _SHARD_RE.search(_posix(p)):
            raise MergeError(
                f"{p} is not named rank{{R}}/step{{S}}.h5 as tl.arm writes shards (a saved trace: open it with "
                "tl.load)"
            )
        refs.append(_ref(p))
    return refs


def _shards_in(root: Path | str) -> list[ShardRef]:
    found: list[Any] = (
        find(root, "rank*/step*.h5") if isinstance(root, str) else sorted(root.glob("rank*/step*.h5"))
    )
    return [_ref(p) for p in found if _SHARD_RE.search(_posix(p))]


def _run_dir(p: Path | str) -> Path | str:
    """The run directory of a shard path ``RUN/rank{R}/step{S}.h5`` (a URL stays a string)."""
    return p.rsplit("/", 2)[0] if isinstance(p, str) else p.parent.parent


@dataclass(frozen=True)
class GivenPaths:
    """A merge of an explicit list of shard paths, not of a run directory: how many were given, the run
    directories holding them, and the shards of those directories that were not given (by (step, rank)), so a
    rank missing from the merge is not reported as dead while its shard sits in the sibling folder.

    Example:
        >>> GivenPaths.of([ShardRef(Path("run/rank00001/step00000000.h5"), 1, 0)]).beside
        {(0, 0): 'run/rank00000/step00000000.h5'}
    """

    count: int
    roots: tuple[str, ...]
    beside: dict[tuple[int, int], str]

    @classmethod
    def of(cls, refs: list[ShardRef]) -> GivenPaths:
        given = {(r.step, r.rank) for r in refs}
        roots = sorted({_run_dir(r.path) for r in refs}, key=str)
        beside = {
            (r.step, r.rank): str(r.path)
            for root in roots
            for r in _shards_in(root)
            if (r.step, r.rank) not in given
        }
        return cls(len(refs), tuple(map(str, roots)), beside)

    def to_json(self) -> str:
        beside = {f"{s}:{r}": p for (s, r), p in self.beside.items()}
        return json.dumps({"count": self.count, "roots": list(self.roots), "beside": beside})

    @classmethod
    def from_json(cls, text: str) -> GivenPaths:
        d = json.loads(text)
        beside = {(int(k.split(":")[0]), int(k.split(":")[1])): p for k, p in d["beside"].items()}
        return cls(int(d["count"]), tuple(d["roots"]), beside)


def _place(p: str | os.PathLike) -> Path | str:
    """A URL stays a string (never a folder named ``s3:``); anything else is a path."""
    return str(p).rstrip("/") if is_url(p) else Path(p)


def _posix(p: Path | str) -> str:
    return p if isinstance(p, str) else p.as_posix()


def _ref(p: Path | str) -> ShardRef:
    m = _SHARD_RE.search(_posix(p))
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
    """One integer id per distinct string across the shards of a merge (id 0 is ``""``), and one tuple object
    per distinct process group (:meth:`group`).

    Example:
        >>> names = Interner(); names.id("all_reduce_1"), names.strings[1]
        (1, 'all_reduce_1')
    """

    __slots__ = ("strings", "_ids", "_groups")

    def __init__(self) -> None:
        self.strings: list[str] = [""]
        self._ids: dict[str, int] = {"": 0}
        self._groups: dict[tuple[int, ...], tuple[int, ...]] = {}

    def groups(self, groups: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """``groups`` (one per collective of a shard) with each distinct group one tuple across all shards: the
        world group of N ranks is then one N-tuple, not one per shard (N^2 ints for the merge)."""
        seen: dict[int, tuple[int, ...]] = {}  # a shard's rows share a few tuple objects: hash each once
        out = []
        for g in groups:
            got = seen.get(id(g))
            if got is None:
                got = seen[id(g)] = self._groups.setdefault(g, g)
            out.append(got)
        return out

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


_EMPTY = np.zeros(0, dtype=np.int64)
_NO_OPS = (np.zeros(0, dtype=bool), _EMPTY, _EMPTY, (_EMPTY, _EMPTY, _EMPTY))


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
        self.local = local_facts(*_NO_OPS, window_span(metadata))  # step_facts.FACTS of the window
        self.first_ns = -1  # first op's start, epoch ns on the rank's clock

    @property
    def complete(self) -> bool:
        return bool(self.metadata.get("complete", True))


_OP_FIELDS = tuple(
    f for f in OP_FIELDS if f.name in ("kind", "aten", "start_ns", "duration_ns", "label", "module", "source")
)
_COLL_FIELDS = tuple(  # what an Entry holds
    f
    for f in COLLECTIVE_FIELDS
    if f.name
    in ("op", "func", "group_name", "seq", "root", "peer", "in_numel", "out_numel", "dtype", "bytes")
    or f.name in ("is_async", "issue_ns", "complete_ns", "state")
)
_GROUP_FIELD = next(f for f in COLLECTIVE_FIELDS if f.name == "group_ranks")
_STACK_FIELD = next(f for f in OP_FIELDS if f.name == "module_stack")  # its offsets: inside a module call
_STR_COLL = tuple(f.name for f in _COLL_FIELDS if f.kind == "str")


@dataclass
class _Tables:
    """A shard's op and collective columns as :func:`~tl_dist.store.codecs.read_arrays` returns them (str columns
    as codes into ``categories`` or, where None, into ``strings``), its collectives' groups, and per op whether it
    ran inside a module call (None: not recorded)."""

    n: int
    ops: dict[str, np.ndarray]
    op_categories: dict[str, Any]
    m: int
    ct: dict[str, np.ndarray]
    ct_categories: dict[str, Any]
    groups: list[tuple[int, ...]]
    in_module: np.ndarray | None
    strings: Any = None


def read_rank(
    root: Any, metadata: dict, failed_op: Any, strings: list[str] | None, names: Interner, key: tuple
) -> RankData:
    """Read one shard's (or merged-file group's) tables into a :class:`RankData`. ``key``: (step, rank)."""
    n, ops, op_categories = read_arrays(root, "ops", _OP_FIELDS)
    m, ct, ct_categories = read_arrays(root, "collectives", _COLL_FIELDS)
    groups = _groups(root["collectives"], ct["group_name"]) if m else []
    tables = _Tables(n, ops, op_categories, m, ct, ct_categories, groups, _in_module(root["ops"], n), strings)
    return rank_data(tables, metadata, failed_op, names, key)


def trace_rank(trace: Trace, names: Interner, key: tuple) -> RankData:
    """:func:`read_rank` of a trace in memory: its columns turned into the arrays a shard reads as."""

    def arrays(columns: dict[str, list], fields: tuple) -> tuple[int, dict, dict]:
        n = len(columns[fields[0].name])
        out: dict[str, np.ndarray] = {}
        categories: dict[str, Any] = {}
        for f in fields:
            values = columns[f.name]
            if f.kind == "str":
                categories[f.name], codes = np.unique(np.array(values, dtype=object), return_inverse=True)
                out[f.name] = codes.reshape(-1).astype(np.int32)
            else:
                out[f.name] = np.array(values, dtype=ARRAY_DTYPES[f.kind]).reshape(n)
        return n, out, categories

    n, ops, op_categories = arrays(trace.columns, _OP_FIELDS)
    ct = trace.collective_table
    m, cts, ct_categories = arrays(ct, _COLL_FIELDS)
    groups = [tuple(g) for g in ct[_GROUP_FIELD.name]]
    in_module = np.fromiter(map(bool, trace.columns[_STACK_FIELD.name]), dtype=bool, count=n)
    tables = _Tables(n, ops, op_categories, m, cts, ct_categories, groups, in_module)
    return rank_data(tables, dict(trace.metadata), trace.failed_op, names, key)


def _last_real_op(aten_ids: np.ndarray, names: Interner) -> int:
    """Index of the last op that is not a profiler marker (the last op when every one is)."""
    kinds = np.unique(aten_ids)
    markers = kinds[[is_profiler_marker(names.strings[int(k)]) for k in kinds]]
    real = np.flatnonzero(~np.isin(aten_ids, markers))
    return int(real[-1]) if real.size else len(aten_ids) - 1


def rank_data(tables: _Tables, metadata: dict, failed_op: Any, names: Interner, key: tuple) -> RankData:
    """The :class:`RankData` of one shard's tables (see the module docstring)."""
    step, rank = key
    data = RankData(rank, step, metadata, failed_op)
    n, ops, m, ct = tables.n, tables.ops, tables.m, tables.ct
    groups = names.groups(tables.groups)

    def ids(arrays: dict, categories: dict, name: str, rows: np.ndarray | None = None) -> np.ndarray:
        codes = arrays[name] if rows is None else arrays[name][rows]
        return names.ids(codes, tables.strings if categories[name] is None else categories[name])

    op_cat, ct_cat = tables.op_categories, tables.ct_categories
    data.n_ops = n
    in_module = tables.in_module
    if in_module is None:  # a shard without module stacks: inside a module call when it names one
        in_module = ids(ops, op_cat, "module") != 0 if n else np.zeros(0, dtype=bool)  # id 0 is ""
    if n:
        starts, durations = ops["start_ns"], ops["duration_ns"]
        is_coll = ids(ops, op_cat, "kind") == names.id("collective")
        done = ct["complete_ns"] >= 0
        spans = (ct["op"][done], ct["issue_ns"][done], ct["complete_ns"][done])
        # An incomplete shard was blocked in what never completed until the window ended.
        hung = None if data.complete else ct["issue_ns"][ct["complete_ns"] < 0]
        data.local = local_facts(is_coll, starts, durations, spans, window_span(metadata), hung)
        data.first_ns = int(starts.min())
        last_i = _last_real_op(ids(ops, op_cat, "aten"), names)
        last = np.array([last_i])
        module = names.strings[int(ids(ops, op_cat, "module", last)[0])]
        data.last_op = {
            "op": last_i,
            "label": names.strings[int(ids(ops, op_cat, "label", last)[0])],
            "module": module_name({"module": module, "module_stack": bool(in_module[last_i])}),
            "source": names.strings[int(ids(ops, op_cat, "source", last)[0])],
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
        got = ids(ops, op_cat, name, at) if n else np.zeros(m, dtype=np.int64)
        where[name] = np.where(valid, got, 0)
    coded = {name: ids(ct, ct_cat, name) for name in _STR_COLL}
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


def _in_module(ops: Any, n: int) -> np.ndarray | None:
    """Per op whether it ran inside a module call (a non-empty ``module_stack``), from that column's offsets
    alone; None when the shard has no such column."""
    if not n:
        return np.zeros(0, dtype=bool)
    lengths = ragged_lengths(ops, _STACK_FIELD.name)
    if lengths is None or len(lengths) != n:
        return None
    return lengths > 0


def _groups(collectives: Any, group_names: np.ndarray) -> list[tuple[int, ...]]:
    """The group_ranks column as tuples, one object per process group. Within a process a group's name names
    its members, so only the first row of each (name, size) is read: a world group of 1,024 ranks on 500 rows
    would otherwise be half a million values to decompress per shard, and O(ranks^2) for the merge."""
    sizes = ragged_lengths(collectives, _GROUP_FIELD.name)
    if sizes is None or len(sizes) != len(group_names):
        raise ValueError("collectives/group_ranks: offsets missing or of the wrong length")
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
        ref = self.refs[key]
        with (
            reading(ref.path) as path,
            open_shard(path, raw_strings=True) as (root, metadata, failed_op, strings),
        ):
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
        path = self.refs[key].path
        return load(path) if fields is None else load_columns(path, fields)


class MergedFileSource:
    """The per-rank tables stored in a merged file (``MergedTrace.save``), read on demand."""

    def __init__(self, path: str, groups: dict[tuple[int, int], str]) -> None:
        self.path = path
        self.groups = groups

    def name(self, key: tuple[int, int]) -> str:
        return f"{self.path}:/shards/{self.groups[key]}"

    def read(self, key: tuple[int, int], names: Interner) -> RankData:
        try:
            with open_group(self.path, self.groups[key]) as grp:
                meta = json.loads(grp.attrs["metadata"])
                return read_rank(grp, meta, json.loads(grp.attrs["failed_op"]), None, names, key)
        except (MergeError, ShardFormatError):
            raise
        except Exception as exc:  # noqa: BLE001 - any decoding failure is a format problem of this file
            raise ShardFormatError(f"{self.name(key)}: corrupt merged-trace group: {exc}") from exc

    def trace(self, key: tuple[int, int], fields: Iterable[str] | None = None) -> Trace:
        """The stored tables of one (step, rank) as a trace (all its op columns: ``fields`` is not needed)."""
        with open_group(self.path, self.groups[key]) as grp:
            return Trace(
                read_table(grp, "ops", OP_FIELDS),
                read_table(grp, "modules", MODULE_CALL_FIELDS),
                collective_table=read_table(grp, "collectives", COLLECTIVE_FIELDS),
                metadata=json.loads(grp.attrs["metadata"]),
                failed_op=json.loads(grp.attrs["failed_op"]),
            )


class TraceSource:
    """Traces already in memory, keyed by (step, rank), merged as shards are (their columns turned into the
    arrays :func:`read_rank` reads from a shard, :func:`trace_rank`).

    Example:
        >>> g = build(TraceSource(traces), sorted(traces), world_size=2, strict=True)
    """

    def __init__(self, traces: dict[tuple[int, int], Trace]) -> None:
        self.traces = dict(traces)

    def name(self, key: tuple[int, int]) -> str:
        return f"trace of rank {key[1]} step {key[0]} (in memory)"

    def read(self, key: tuple[int, int], names: Interner) -> RankData:
        return trace_rank(self.traces[key], names, key)

    def trace(self, key: tuple[int, int], fields: Iterable[str] | None = None) -> Trace:
        return self.traces[key]
