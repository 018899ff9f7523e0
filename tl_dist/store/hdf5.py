"""Loading a shard back as a trace (``tl.load``); writing is :mod:`.writer`. Layout: ``docs/shard-format.md``.

Nothing here pickles: every value is a number, a string, JSON text or a numeric array, so loading a shard runs
no code.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils._pytree import tree_flatten, treespec_loads

from ..errors import ShardFormatError
from ..schema import (
    COLLECTIVE_FIELDS,
    COMPILED_OP_FIELDS,
    EMPTY_VALUE,
    MODULE_CALL_FIELDS,
    OP_FIELDS,
    SCHEMA_VERSION,
    STAT_FIELDS,
)
from ..trace import Trace
from . import location
from .codecs import ENCODING_VERSION, read_table
from .writer import _OUTPUT_OF_FIELDS, _TREE_FIELDS, ROOT_ENCODING, ShardOptions, write_shard


def _array_tensor(ds: h5py.Dataset) -> torch.Tensor:
    arr = ds[()]
    dtype_name = ds.attrs.get("torch-dtype", "")
    tensor = torch.from_numpy(np.ascontiguousarray(arr)) if isinstance(arr, np.ndarray) else torch.tensor(arr)
    want = getattr(torch, dtype_name, None) if dtype_name else None
    if isinstance(want, torch.dtype) and want != tensor.dtype:
        tensor = tensor.view(want)
    return tensor


# -- reading ---------------------------------------------------------------------------------------------------
def _read_tensors(node: h5py.Group | h5py.Dataset, n_outputs: int) -> list[torch.Tensor | None]:
    if isinstance(node, h5py.Dataset):
        return [_array_tensor(node)]
    outs: list[torch.Tensor | None] = [None] * n_outputs
    for name, ds in node.items():
        outs[int(name)] = _array_tensor(ds)
    return outs


class LazyTensors(Mapping):
    """Saved tensors of a loaded shard: op index -> list of outputs, read from the file on first access.

    Loading many shards (merge) therefore reads only their tables. The file is opened per first access of an
    op; the value is cached. Use :meth:`load_all` before moving or deleting the file.
    """

    def __init__(self, path: Path, group: str, index: dict[int, tuple[str, int]]) -> None:
        self._path = path
        self._group = group
        self._index = index
        self._cache: dict[int, list] = {}

    def __getitem__(self, op: int) -> list:
        cached = self._cache.get(op)
        if cached is not None:
            return cached
        name, n_outputs = self._index[op]
        try:
            with h5py.File(self._path, "r") as f:
                value = _read_tensors(f[self._group][name], n_outputs)
        except (OSError, KeyError, ValueError) as exc:
            raise ShardFormatError(f"{self._path}: cannot read {self._group}/{name}: {exc}") from exc
        self._cache[op] = value
        return value

    def __iter__(self) -> Iterator[int]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, op: object) -> bool:
        return op in self._index

    def load_all(self) -> dict[int, list]:
        """Read every tensor now (one file open) and return them as a plain dict."""
        missing = [op for op in self._index if op not in self._cache]
        if missing:
            try:
                with h5py.File(self._path, "r") as f:
                    group = f[self._group]
                    for op in missing:
                        self._cache[op] = _read_tensors(group[self._index[op][0]], self._index[op][1])
            except (OSError, KeyError, ValueError) as exc:
                raise ShardFormatError(f"{self._path}: cannot read {self._group}: {exc}") from exc
        return {op: self._cache[op] for op in self._index}


def _tensor_index(root: h5py.File, name: str, columns: dict[str, list]) -> dict[int, tuple[str, int]]:
    """op index -> (node name, number of outputs) for the tensors under ``/name``."""
    if name not in root:
        return {}
    index = {label: i for i, label in enumerate(columns["label"])}
    keys = list(root[name])
    unknown = [k for k in keys if k not in index]
    if unknown:
        raise ValueError(f"/{name} holds tensors of ops not in the op table: {unknown[:3]}")
    out_shapes = columns["out_shapes"]
    return {index[k]: (k, len(out_shapes[index[k]])) for k in keys}


def _read_trees(root: h5py.File, strings: list[str] | None) -> tuple[dict[int, Any], Any]:
    table = read_table(root, "trees", _TREE_FIELDS, strings=strings)
    extra = root.get("tree_tensors")
    trees: dict[int, Any] = {}
    output = None
    unregistered: set[str] = set()
    for row, spec_json, leaves_json in zip(table["row"], table["spec"], table["leaves"]):
        leaves = [
            _array_tensor(extra[v["tensor"]]) if isinstance(v, dict) and "tensor" in v else v
            for v in json.loads(leaves_json)
        ]
        try:
            spec = treespec_loads(spec_json)
        except NotImplementedError as exc:
            # A pytree node type the writing process registered and this one has not (its module is not
            # imported here: transformers' ModelOutput in a merge process). The structure is unknown here; the
            # values are not: they read as a tuple of the leaves.
            named = re.search(r"Deserializing (\S+) in pytree", str(exc))
            unregistered.add(named.group(1) if named else str(exc))
            spec = tree_flatten(tuple(range(len(leaves))))[1]
        if row < 0:
            output = (spec, leaves)  # unflattened by load(): a leaf may refer to an op's saved output
        else:
            trees[row] = (spec, leaves)
    if unregistered:
        warnings.warn(
            # No file name: Python shows one warning per distinct message, and a merge reads every rank's shard.
            f"module outputs of type {', '.join(sorted(unregistered))} (registered with torch's "
            "pytree where the shard was written, not in this process) read as tuples of their values; import "
            "the module that registers them before loading to get them back as they were returned",
            RuntimeWarning,
            stacklevel=3,
        )
    return trees, output


@contextmanager
def open_shard(
    path: Path, *, raw_strings: bool = False
) -> Iterator[tuple[h5py.File, dict[str, Any], Any, Any]]:
    """Open a shard for reading once its layout and version check out; yields ``(root, metadata, failed_op,
    strings)`` (``strings``: the shard-wide string table, None in a shard without strings). Any failure to
    decode inside the ``with`` block is a :class:`ShardFormatError` naming the file.

    Example:
        >>> with open_shard(path) as (root, metadata, failed_op, strings):
        ...     ops = read_table(root, "ops", OP_FIELDS, strings=strings)
    """
    if not path.is_file():
        raise ShardFormatError(f"{path}: no such shard file")
    try:
        root = h5py.File(path, "r")
    except OSError as exc:
        raise ShardFormatError(
            f"{path}: not a readable HDF5 file (truncated, corrupt or not HDF5): {exc}"
        ) from exc
    try:
        with root:
            encoding = root.attrs.get("encoding-type")
            if encoding != ROOT_ENCODING:
                raise ShardFormatError(
                    f"{path}: HDF5 file of another layout (root encoding-type {encoding!r}, expected "
                    f"{ROOT_ENCODING!r}); not a tl_dist shard"
                )
            version = int(root.attrs.get("schema_version", -1))
            if version > SCHEMA_VERSION:
                raise ShardFormatError(
                    f"{path}: written with shard schema version {version}, this tl_dist reads up to "
                    f"{SCHEMA_VERSION}; upgrade tl_dist to read it"
                )
            if version < 1 or root.attrs.get("encoding-version") != ENCODING_VERSION:
                raise ShardFormatError(f"{path}: unknown schema/encoding version {version}")
            metadata = json.loads(root.attrs["metadata"])
            failed_op = json.loads(root.attrs["failed_op"])
            strings = None
            if "strings" in root:
                # raw: the UTF-8 bytes, for readers that decode only the strings they use (the merge)
                strings = root["strings"][()] if raw_strings else root["strings"].asstr()[()].tolist()
            if "stack" in root:
                metadata["stack"] = root["stack"].asstr()[()].tolist()
            yield root, metadata, failed_op, strings
    except ShardFormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to decode is a format problem of this file
        raise ShardFormatError(f"{path}: corrupt or incomplete shard: {type(exc).__name__}: {exc}") from exc


def load(path: str | os.PathLike, *, tensors: bool = True) -> Trace:
    """Load a shard written by an armed capture (or :func:`write_shard`) as a :class:`Trace`.

    Args:
        path: the ``.h5`` shard: a path, or a URL (``s3://...``, needs ``tl_dist[scale]``; downloaded once).
        tensors: keep saved activations/gradients reachable (read lazily, on first access of each op's
            ``.out``); False leaves them out entirely (merging many shards).

    Returns:
        A Trace with the op table, module calls (and their ``.out``), collectives, saved tensors, run metadata
        (``.rank``, ``.world_size``, ``.step``, ``.metadata["complete"]``) and ``failed_op``. Replay
        (``validate``) needs the live ops and is not available.

    Raises:
        ShardFormatError: the file is missing, not HDF5, truncated, corrupt, of another layout, or written by
            a newer schema; the message names the file and the problem.

    Example:
        >>> trace = tl.load("runs/job42/rank00000/step00000100.h5")
        >>> trace.rank, trace.world_size, trace.step, trace["relu_1"].out.shape
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a str or os.PathLike naming a shard file, got {type(path).__name__}")
    if not isinstance(tensors, bool):
        raise ValueError(f"tensors must be a bool, got {tensors!r}")
    if location.is_url(path):  # a local copy, kept while the process runs: saved tensors are read from it
        with location.reading(path, keep=True) as local:
            return load(local, tensors=tensors)
    path = Path(path)
    if path.is_dir():
        example = next(iter(sorted(path.glob("rank*/step*.h5"))), None)
        raise ShardFormatError(
            f"{path} is a directory, not a shard: merge a run's shards with tl.merge_ranks({str(path)!r})"
            + (f", or load one shard such as {str(example)!r}" if example else "")
        )
    with open_shard(path) as (root, metadata, failed_op, strings):
        filled: list[str] = []  # columns of fields newer than the shard's writer
        columns = read_table(root, "ops", OP_FIELDS, strings=strings, filled=filled)
        module_table = read_table(root, "modules", MODULE_CALL_FIELDS, strings=strings, filled=filled)
        collective_table = read_table(root, "collectives", COLLECTIVE_FIELDS, strings=strings, filled=filled)
        out_of = read_table(root, "output_of", _OUTPUT_OF_FIELDS, strings=strings)
        out_trees, output = _read_trees(root, strings)
        stats_table = (
            read_table(root, "stats", STAT_FIELDS, strings=strings, filled=filled)
            if "stats" in root
            else None
        )
        compiled = (
            read_table(root, "compiled", COMPILED_OP_FIELDS, strings=strings) if "compiled" in root else None
        )
        saved: Mapping[int, list] = {}
        grads: Mapping[int, list] = {}
        if tensors:
            saved = LazyTensors(path, "saved", _tensor_index(root, "saved", columns))
            grads = LazyTensors(path, "grads", _tensor_index(root, "grads", columns))
    if filled:
        metadata["filled_columns"] = filled
    trace = Trace(
        columns,
        module_table,
        collective_table=collective_table,
        saved=saved,
        output_of=dict(zip(out_of["op"], out_of["modules"])),
        out_trees=out_trees,
        metadata=metadata,
        failed_op=failed_op,
    )
    # Set after construction: Trace(saved=...) replaces an empty mapping by a dict, and the lazy mapping keeps
    # `len()` / `in` cheap without reading tensors.
    if tensors:
        trace.saved = saved
        trace.grads = grads
    trace._output_leaves = output  # Trace.output resolves it on first use (op outputs are read lazily)
    if stats_table is not None:
        trace.stats_table = stats_table
    if compiled is not None:
        trace.compiled_table = compiled
    return trace


def load_columns(path: str | os.PathLike, fields: Iterable[str]) -> Trace:
    """A shard's trace with only the op columns named in ``fields`` read (the others hold their kind's empty
    value), its module, collective and statistics tables, and which ops were saved (tensors read only on access,
    as one output each): for views that read many shards and
    need a few columns (the report's module time, a merged Perfetto export's module slices).

    Raises:
        ShardFormatError: as :func:`load`.
    """
    if location.is_url(path):
        with location.reading(path, keep=True) as local:
            return load_columns(local, fields)
    wanted = frozenset(fields) | {"index", "label"}
    with open_shard(Path(path)) as (root, metadata, failed_op, strings):
        columns = read_table(root, "ops", tuple(f for f in OP_FIELDS if f.name in wanted), strings=strings)
        n = len(columns["index"])
        for f in OP_FIELDS:
            columns.setdefault(f.name, [EMPTY_VALUE[f.kind]] * n)
        modules = read_table(root, "modules", MODULE_CALL_FIELDS, strings=strings)
        collectives = read_table(root, "collectives", COLLECTIVE_FIELDS, strings=strings)
        stats = read_table(root, "stats", STAT_FIELDS, strings=strings) if "stats" in root else None
        compiled = (
            read_table(root, "compiled", COMPILED_OP_FIELDS, strings=strings) if "compiled" in root else None
        )
        # Which ops were saved (not their tensors): what a live-bytes count needs.
        by_label = {label: i for i, label in enumerate(columns["label"])} if "saved" in root else {}
        index = {by_label[k]: (k, 1) for k in (root["saved"] if by_label else ()) if k in by_label}
    trace = Trace(
        columns,
        modules,
        collective_table=collectives,
        metadata=metadata,
        failed_op=failed_op,
        stats_table=stats,
    )
    trace.saved = LazyTensors(Path(path), "saved", index)
    if compiled is not None:
        trace.compiled_table = compiled
    return trace


__all__ = ["LazyTensors", "ShardOptions", "load", "load_columns", "write_shard"]
