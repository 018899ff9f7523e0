"""The merged result as a folder, one file per step: ``g.save(FOLDER, split="step")``, ``tl.merge_ranks(...,
out=FOLDER)`` (on Dask: each step's file written on a worker) and ``tl.load_merged(FOLDER)`` (lazy).

Layout (FOLDER may be an fsspec URL)::

    index.json          encoding-type "tl_dist.merged-steps", encoding-version, schema_version, world_size,
                        expected, written, given, shard_errors, and per step: its file, the merge's results
                        (findings, clocks, collectives, stragglers, time breakdown, absent ranks) and what the
                        merge kept of each rank (metadata, op count, last op, window facts)
    step{S:08d}.h5      that step's ranks' tables: a merged file of one step (``tl.load_merged`` opens it alone)

Unlike ``merged.h5``, whose analysis is re-run on load, the folder stores the merge's results: loading reads the
index only, and a step's file is read when a view needs that step's tables (``g.rank(r, step=s)``,
``g.to_pandas(step=s)``, ``g.joined_step(s)``, ``g.iter_traces(step=s)``); whole-run views (``to_pandas()``,
Perfetto, the report) read the step files one at a time. So no process holds more than one step's tables.

Example:
    >>> tl.merge_ranks("s3://bucket/job42", engine="dask", out="s3://bucket/job42-merged")
    >>> g = tl.load_merged("s3://bucket/job42-merged")   # the index only
    >>> g.findings, g.to_pandas(step=100)                  # step 100's file only
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._files import replacing
from ..errors import SelectionError, ShardFormatError
from ..schema import SCHEMA_VERSION
from ..store import load, write_merged
from ..store.location import exists, is_url, join, name, reading, upload
from .clocks import ClockSolution
from .match import Finding
from .persist import merged_attrs, trace_groups
from .sources import GivenPaths, MergedFileSource, RankData, ShardRef, ShardSource, check_subset
from .steps import StepResult

if TYPE_CHECKING:
    from ..trace import Trace
    from .graph import MergedTrace

INDEX = "index.json"
ENCODING = "tl_dist.merged-steps"
ENCODING_VERSION = "1"
SPLITS = ("step",)


def step_file(step: int) -> str:
    """The name of a step's file in a per-step folder (``step00000100.h5``)."""
    return f"step{step:08d}.h5"


# -- a lossless JSON encoding of the results (tuples, int keys and sets survive the round trip) ---------------
_MARKERS = ("__tuple__", "__range__", "__items__", "__set__")


def _enc(v: Any) -> Any:
    if isinstance(v, np.generic):
        v = v.item()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tuple):
        # A collective's ranks are often a run of consecutive ranks: two numbers instead of 100k.
        if len(v) > 2 and all(type(x) is int for x in v) and v == tuple(range(v[0], v[0] + len(v))):
            return {"__range__": [v[0], len(v)]}
        return {"__tuple__": [_enc(x) for x in v]}
    if isinstance(v, list):
        return [_enc(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return {"__set__": [_enc(x) for x in sorted(v)]}
    if isinstance(v, dict):
        if all(type(k) is str and k not in _MARKERS for k in v):
            return {k: _enc(x) for k, x in v.items()}
        return {"__items__": [[_enc(k), _enc(x)] for k, x in v.items()]}
    return str(v)  # as merged.h5 stores metadata (json default=str)


def _dec(v: Any) -> Any:
    if isinstance(v, list):
        return [_dec(x) for x in v]
    if not isinstance(v, dict):
        return v
    if len(v) == 1:
        ((marker, body),) = v.items()
        if marker == "__tuple__":
            return tuple(_dec(x) for x in body)
        if marker == "__range__":
            return tuple(range(body[0], body[0] + body[1]))
        if marker == "__set__":
            return {_dec(x) for x in body}
        if marker == "__items__":
            return {_dec(k): _dec(x) for k, x in body}
    return {k: _dec(x) for k, x in v.items()}


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


_RANK_SLOTS = tuple(s for s in RankData.__slots__ if s != "entries")  # entries are rebuilt from the step file


def _rank_data(fields: dict[str, Any]) -> RankData:
    data = RankData.__new__(RankData)
    for slot in _RANK_SLOTS:
        setattr(data, slot, fields[slot])
    data.entries = None
    return data


def _step_index(g: MergedTrace, step: int) -> dict[str, Any]:
    """What the index keeps of one step (see the module docstring)."""
    return {
        "step": step,
        "file": step_file(step),
        "absent": g._absent.get(step, set()),
        "findings": [_fields(f) for f in g.findings if f.step == step],
        "clocks": _fields(g.clock_solutions[step]),
        "collectives": [row for row in g._collective_rows if row[0] == step],
        "stragglers": [row for row in g._straggler_rows if row["step"] == step],
        "breakdown": [row for row in g._breakdown_rows if row["step"] == step],
        "ranks": {
            r: {slot: getattr(d, slot) for slot in _RANK_SLOTS}
            for (s, r), d in sorted(g._data.items())
            if s == step
        },
    }


# -- writing --------------------------------------------------------------------------------------------------
def write_step_file(
    dest: str | Path,
    attrs: dict[str, Any],
    traces: Iterable[tuple[tuple[int, int], Trace]],
    incomplete: Iterable[tuple[int, int]],
) -> str:
    """Write one step's merged file at ``dest`` (a path, or a URL: written to a local spool, then uploaded so that
    no reader sees part of it), one trace at a time. Returns ``dest``."""
    incomplete = set(incomplete)
    if not is_url(dest):
        return write_merged(dest, attrs, trace_groups(traces, incomplete))
    spool = Path(tempfile.mkdtemp(prefix="tl_dist-steps-"))
    local = spool / name(dest)
    write_merged(local, attrs, trace_groups(traces, incomplete))
    upload(local, str(dest))  # removes the local copy once stored; an error names it
    shutil.rmtree(spool, ignore_errors=True)
    return str(dest)


def write_step_from_shards(
    dest: str | Path, attrs: dict[str, Any], refs: list[ShardRef], incomplete: list[tuple[int, int]]
) -> str:
    """On a Dask worker: one step's merged file written from its shards, read one at a time (a shard at a URL is
    downloaded, read and removed), so the client never holds the step's op tables."""

    def traces() -> Iterator[tuple[tuple[int, int], Trace]]:
        for ref in refs:
            with reading(ref.path) as local:
                yield (ref.step, ref.rank), load(local, tensors=False)

    return write_step_file(dest, attrs, traces(), incomplete)


def save_steps(g: MergedTrace, folder: str | os.PathLike, *, client: Any = None) -> str:
    """Write ``g`` as a per-step folder (see the module docstring): the step files first, the index last, so a
    reader that finds the index finds every file it names. ``client``: a ``distributed.Client`` that writes each
    step's file on a worker from the shards (a merge of a run's shards); None: this process writes them.
    Returns ``folder``."""
    if not isinstance(folder, (str, os.PathLike)):
        raise ValueError(f"path must be a folder path or URL, got {type(folder).__name__}")
    folder = str(folder).rstrip("/") if is_url(folder) else Path(folder)
    if isinstance(folder, Path):
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"path: {folder} is a file; split='step' writes a folder")
        folder.mkdir(parents=True, exist_ok=True)
    base = getattr(g._source, "base", g._source)  # a Dask merge's source reads the shards through its base
    on_workers = client is not None and isinstance(base, ShardSource)
    futures = []
    for step in g.steps:
        dest = join(folder, step_file(step))
        keys = [k for k in g.keys() if k[0] == step]
        incomplete = sorted(k for k in keys if k in g.incomplete)
        attrs = merged_attrs(g, step)
        if on_workers:
            refs = [base.refs[k] for k in keys]
            key = f"tl_dist-write-step-{step}-{uuid.uuid4().hex[:8]}"
            futures.append(client.submit(write_step_from_shards, dest, attrs, refs, incomplete, key=key))
        else:
            write_step_file(dest, attrs, g.iter_traces(step=step), incomplete)
    if futures:
        client.gather(futures)  # raises what a worker raised
    index = {
        "encoding-type": ENCODING,
        "encoding-version": ENCODING_VERSION,
        "schema_version": SCHEMA_VERSION,
        "world_size": g.world_size,
        "expected": g.expected_ranks,
        "written": g.written,
        "given": g.given.to_json() if g.given is not None else None,
        "shard_errors": g.shard_errors,
        "steps": [_step_index(g, step) for step in g.steps],
    }
    text = json.dumps(_enc(index), separators=(",", ":"))
    if isinstance(folder, Path):
        with replacing(folder / INDEX) as tmp, open(tmp, "w") as f:
            f.write(text)
    else:
        spool = Path(tempfile.mkdtemp(prefix="tl_dist-steps-"))
        (spool / INDEX).write_text(text)
        upload(spool / INDEX, join(folder, INDEX))
        shutil.rmtree(spool, ignore_errors=True)
    return str(folder)


# -- reading --------------------------------------------------------------------------------------------------
def is_split(path: str | os.PathLike) -> bool:
    """Whether ``path`` (a folder or URL) holds a per-step merged result (its ``index.json``)."""
    return exists(join(path, INDEX))


class StepFilesSource:
    """The per-rank tables of a per-step folder, read on demand from the step's file (a step file at a URL is
    downloaded on first need and kept while the process runs)."""

    def __init__(self, folder: str | Path, files: dict[int, str], groups: dict[tuple[int, int], str]) -> None:
        self.folder = folder
        self.files = files  # step -> file name
        self.groups = groups  # (step, rank) -> group name
        self._local: dict[int, str] = {}

    def _source(self, step: int) -> MergedFileSource:
        where = str(join(self.folder, self.files[step]))
        if step not in self._local:
            if is_url(where):
                with reading(where, keep=True) as local:
                    self._local[step] = str(local)
            else:
                self._local[step] = where
        groups = {k: v for k, v in self.groups.items() if k[0] == step}
        return MergedFileSource(self._local[step], groups)

    def _named(self, step: int, exc: ShardFormatError) -> ShardFormatError:
        local, where = self._local.get(step), str(join(self.folder, self.files[step]))
        message = str(exc) if local is None or local == where else str(exc).replace(local, where)
        return ShardFormatError(message)

    def name(self, key: tuple[int, int]) -> str:
        return f"{join(self.folder, self.files[key[0]])}:/shards/{self.groups[key]}"

    def read(self, key: tuple[int, int], names: Any) -> RankData:
        try:
            return self._source(key[0]).read(key, names)
        except ShardFormatError as exc:
            raise self._named(key[0], exc) from exc

    def trace(self, key: tuple[int, int], fields: Iterable[str] | None = None) -> Trace:
        try:
            return self._source(key[0]).trace(key, fields)
        except ShardFormatError as exc:
            raise self._named(key[0], exc) from exc


def open_steps(
    folder: str | os.PathLike, *, steps: Iterable[int] | None = None, ranks: Iterable[int] | None = None
) -> dict[str, Any]:
    """A per-step folder's index: ``{"stored": MergedTrace arguments}`` to rebuild the merge's results without
    reading a step file, or (``ranks`` given: the ranks' collectives are judged anew) ``{"rebuild": build
    arguments}`` over the chosen steps' files.

    Raises:
        ShardFormatError: no readable index, or one of another encoding or a newer schema.
        SelectionError: ``steps`` / ``ranks`` select nothing in it.
    """
    want_steps, want_ranks = check_subset(steps, "steps"), check_subset(ranks, "ranks")
    folder = str(folder).rstrip("/") if is_url(folder) else Path(folder)
    where = join(folder, INDEX)
    if not exists(where):
        raise ShardFormatError(
            f"{folder}: no {INDEX}: not a merged folder (g.save(path, split='step')); a run directory is merged "
            "with tl.merge_ranks"
        )
    try:
        with reading(where) as local:
            index = _dec(json.loads(Path(local).read_text()))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ShardFormatError(f"{where}: corrupt index: {exc}") from exc
    if not isinstance(index, dict) or index.get("encoding-type") != ENCODING:
        raise ShardFormatError(
            f"{where}: not the index of a per-step merged folder (encoding-type {ENCODING!r})"
        )
    if int(index.get("schema_version", -1)) > SCHEMA_VERSION:
        raise ShardFormatError(
            f"{where}: schema version {index['schema_version']} is newer than {SCHEMA_VERSION}"
        )
    try:
        chosen = [s for s in index["steps"] if want_steps is None or s["step"] in want_steps]
        expected = list(index["expected"])
        errors = {k: e for k, e in index["shard_errors"].items() if want_steps is None or k[0] in want_steps}
        groups = {(s["step"], r): f"s{s['step']}_r{r}" for s in chosen for r in s["ranks"]}
        run = {
            "world_size": int(index["world_size"]),
            "expected": expected,
            "written": index["written"],
            "given": GivenPaths.from_json(index["given"]) if index["given"] else None,
        }
        source = StepFilesSource(folder, {s["step"]: s["file"] for s in chosen}, groups)
        if not chosen:
            raise SelectionError(
                f"{folder}: no step {sorted(want_steps or ())} in it; it has steps {[s['step'] for s in index['steps']]}"
            )
        if want_ranks is not None:
            groups = {k: v for k, v in groups.items() if k[1] in want_ranks}
            errors = {k: e for k, e in errors.items() if k[1] in want_ranks}
            if not groups and not errors:
                raise SelectionError(f"{folder}: no ranks' tables for steps={steps!r}, ranks={ranks!r}")
            source.groups = groups
            run["expected"] = sorted(want_ranks & set(expected))
            return {"rebuild": {"source": source, "keys": sorted(groups), "shard_errors": errors, **run}}
        results = [
            StepResult(
                s["step"],
                [Finding(**f) for f in s["findings"]],
                ClockSolution(**s["clocks"]),
                s["collectives"],
                s["stragglers"],
                s["breakdown"],
            )
            for s in chosen
        ]
        data = {(s["step"], r): _rank_data(d) for s in chosen for r, d in s["ranks"].items()}
        absent = {s["step"]: set(s["absent"]) for s in chosen if s["absent"]}
    except (SelectionError, ShardFormatError):
        raise
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a format problem of this index
        raise ShardFormatError(f"{where}: corrupt index: {type(exc).__name__}: {exc}") from exc
    return {
        "stored": {
            "source": source,
            "data": data,
            "results": results,
            "shard_errors": errors,
            "absent": absent,
            **run,
        }
    }
