"""Writing a trace as one HDF5 shard, and loading it back (``tl.load``). Layout: ``docs/shard-format.md``.

Nothing here pickles: every value is a number, a string, JSON text or a numeric array, so loading a shard runs
no code.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils._pytree import tree_flatten, treespec_dumps, treespec_loads

from ..errors import ShardFormatError
from ..schema import COLLECTIVE_FIELDS, MODULE_CALL_FIELDS, OP_FIELDS, SCHEMA_VERSION, STAT_FIELDS, Field
from ..trace import Trace
from .codecs import ENCODING_VERSION, ShardOptions, StringTable, _tag, read_table, write_table

ROOT_ENCODING = "tl_dist.shard"
_DEFAULT_OPTIONS = ShardOptions()

# Which module/output-of rows have an entry: an internal side table, not a schema of its own.
_OUTPUT_OF_FIELDS = (
    Field("op", "int", "Op whose output is a module call's output."),
    Field("modules", "strs", "Addresses of the module calls returning that output."),
)
_TREE_FIELDS = (
    Field("row", "int", "Module-call row (-1: the trace's output)."),
    Field("spec", "str", "torch.utils._pytree treespec as JSON."),
    Field("leaves", "str", "JSON list: null for op outputs, a value, or {'tensor': name} in /tree_tensors."),
)

# torch dtypes numpy cannot hold (bfloat16, float8) are stored bit for bit as ints of the same width.
_NUMPY_NATIVE = frozenset(
    {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"}
    | {"complex64", "complex128", "uint16", "uint32", "uint64"}
)
_RAW_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _tensor_array(t: torch.Tensor) -> tuple[np.ndarray, str]:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    dtype = str(t.dtype).replace("torch.", "")
    try:
        return t.numpy(), dtype
    except TypeError:
        return t.view(_RAW_VIEW[t.element_size()]).numpy(), dtype


def _array_tensor(ds: h5py.Dataset) -> torch.Tensor:
    arr = ds[()]
    dtype_name = ds.attrs.get("torch-dtype", "")
    tensor = torch.from_numpy(np.ascontiguousarray(arr)) if isinstance(arr, np.ndarray) else torch.tensor(arr)
    want = getattr(torch, dtype_name, None) if dtype_name else None
    if isinstance(want, torch.dtype) and want != tensor.dtype:
        tensor = tensor.view(want)
    return tensor


def _write_tensor(group: h5py.Group, name: str, t: torch.Tensor, options: ShardOptions) -> None:
    arr, dtype = _tensor_array(t)
    ds = group.create_dataset(name, data=arr, **options.tensor_kwargs(arr))
    # Attribute writes cost about as much as a small dataset: only where the numpy dtype does not say it.
    if dtype not in _NUMPY_NATIVE:
        ds.attrs["torch-dtype"] = dtype


def _write_tensors(
    root: h5py.File, name: str, tensors: Mapping[int, list], labels: list[str], options: ShardOptions
) -> None:
    """``tensors`` maps op index -> list of outputs (None where not kept). A one-output op is one dataset named
    by the op's label; a multi-output op a group of datasets named by output position."""
    group = root.create_group(name)
    _tag(group, "tensors")
    for index, outs in tensors.items():
        label = labels[index]
        if len(outs) == 1 and outs[0] is not None:
            _write_tensor(group, label, outs[0], options)  # the op is found by its (unique) label
            continue
        # No attributes: the op is found by its label and its output count is len(out_shapes[op]).
        sub = group.create_group(label)
        for pos, t in enumerate(outs):
            if t is not None:
                _write_tensor(sub, str(pos), t, options)


_LEAF_SPEC = treespec_dumps(tree_flatten(0)[1])


def _tree_rows(trace: Trace, root: h5py.File, options: ShardOptions) -> dict[str, list]:
    """Module-call output structures (and the trace's output) as JSON rows; non-op tensor leaves as datasets."""
    rows: dict[str, list] = {"row": [], "spec": [], "leaves": []}
    extra: h5py.Group | None = None
    trees = list(trace.out_trees.items())
    if trace.output is not None:
        leaves, spec = tree_flatten(trace.output)
        trees.append((-1, (spec, leaves)))
    for row, (spec, leaves) in trees:
        if spec.is_leaf() and len(leaves) == 1 and leaves[0] is None:
            # Most module calls return one op's tensor: skip the JSON encoders for them.
            rows["row"].append(row)
            rows["spec"].append(_LEAF_SPEC)
            rows["leaves"].append("[null]")
            continue
        try:
            spec_json = treespec_dumps(spec)
        except Exception:  # noqa: BLE001 - custom pytree nodes without a serialized name: structure not stored
            continue
        encoded = []
        for i, leaf in enumerate(leaves):
            if leaf is None or isinstance(leaf, (bool, int, float, str)):
                encoded.append(leaf)
            elif isinstance(leaf, torch.Tensor):
                if extra is None:
                    extra = root.create_group("tree_tensors")
                    _tag(extra, "tensors")
                name = f"{row}_{i}"
                _write_tensor(extra, name, leaf, options)
                encoded.append({"tensor": name})
            else:
                encoded.append(None)  # NB: other leaf types (custom objects) are not stored
        rows["row"].append(row)
        rows["spec"].append(spec_json)
        rows["leaves"].append(json.dumps(encoded))
    return rows


def _json_attr(value: Any) -> str:
    return json.dumps(value, default=str, sort_keys=True)


def write_shard(
    trace: Trace,
    path: str | os.PathLike,
    *,
    complete: bool = True,
    metadata: Mapping[str, Any] | None = None,
    options: ShardOptions = _DEFAULT_OPTIONS,
) -> Path:
    """Write ``trace`` as one HDF5 shard at ``path``, atomically (temporary name in the same folder, then
    ``os.replace``), so a killed process never leaves a half-written file under ``path``.

    Args:
        trace: the trace to store (columns, module and collective tables, saved tensors, gradients).
        path: the shard's file name; its folder must exist.
        complete: False for a post-mortem shard (the window did not finish).
        metadata: run metadata stored as root attributes (rank, world size, host, ...), beside
            ``trace.metadata``.
        options: chunking and compression, see :class:`ShardOptions`.

    Returns:
        The shard's path.

    Example:
        >>> write_shard(cap.trace, "step00000001.h5")
        >>> tl.load("step00000001.h5").to_pandas()
    """
    if not isinstance(options, ShardOptions):
        raise ValueError(f"options must be a ShardOptions, got {type(options).__name__}")
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"path: folder {path.parent} does not exist (writing shard {path.name})")
    meta = dict(trace.metadata)
    meta.update(metadata or {})
    meta["complete"] = bool(complete)
    # pid and thread: a post-mortem written from tl_dist's signal watcher never shares a temporary name.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        # v110 object headers: a third cheaper to create than the default's, and HDF5 >= 1.10 tools
        # (h5dump included) read them.
        with h5py.File(tmp, "w", libver=("v110", "v110")) as root:
            _tag(root, ROOT_ENCODING)
            root.attrs["schema_version"] = SCHEMA_VERSION
            root.attrs["complete"] = bool(complete)
            root.attrs["metadata"] = _json_attr(meta)
            # Run facts also as plain attributes so `h5dump -A` shows them without JSON.
            for key, value in meta.items():
                if key in root.attrs:
                    continue
                # Exact base types: h5py has no conversion for subclasses such as torch's TorchVersion.
                for base in (bool, int, float, str):
                    if isinstance(value, base):
                        root.attrs[key] = base(value)
                        break
            root.attrs["failed_op"] = _json_attr(trace.failed_op)
            shared = (StringTable(), "/strings")
            write_table(root, "ops", OP_FIELDS, trace.columns, options, strings=shared)
            write_table(root, "modules", MODULE_CALL_FIELDS, trace.module_table, options, strings=shared)
            write_table(
                root, "collectives", COLLECTIVE_FIELDS, trace.collective_table, options, strings=shared
            )
            output_of = {
                "op": list(trace.output_of),
                "modules": [tuple(v) for v in trace.output_of.values()],
            }
            write_table(root, "output_of", _OUTPUT_OF_FIELDS, output_of, options, strings=shared)
            write_table(
                root, "trees", _TREE_FIELDS, _tree_rows(trace, root, options), options, strings=shared
            )
            labels = trace.columns["label"]
            _write_tensors(root, "saved", trace.saved, labels, options)
            if trace.grads:
                _write_tensors(root, "grads", trace.grads, labels, options)
            write_table(root, "stats", STAT_FIELDS, trace.stats_table, options, strings=shared)
            shared[0].write(root, "strings", options)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


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
    for row, spec_json, leaves_json in zip(table["row"], table["spec"], table["leaves"]):
        spec = treespec_loads(spec_json)
        leaves = [
            _array_tensor(extra[v["tensor"]]) if isinstance(v, dict) else v for v in json.loads(leaves_json)
        ]
        if row < 0:
            output = spec.unflatten(leaves)
        else:
            trees[row] = (spec, leaves)
    return trees, output


@contextmanager
def open_shard(path: Path) -> Iterator[tuple[h5py.File, dict[str, Any], Any, list[str] | None]]:
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
            strings = root["strings"].asstr()[()].tolist() if "strings" in root else None
            yield root, metadata, failed_op, strings
    except ShardFormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to decode is a format problem of this file
        raise ShardFormatError(f"{path}: corrupt or incomplete shard: {type(exc).__name__}: {exc}") from exc


def load(path: str | os.PathLike, *, tensors: bool = True) -> Trace:
    """Load a shard written by an armed capture (or :func:`write_shard`) as a :class:`Trace`.

    Args:
        path: the ``.h5`` shard.
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
        output=output,
        metadata=metadata,
        failed_op=failed_op,
    )
    # Set after construction: Trace(saved=...) replaces an empty mapping by a dict, and the lazy mapping keeps
    # `len()` / `in` cheap without reading tensors.
    if tensors:
        trace.saved = saved
        trace.grads = grads
    if stats_table is not None:
        trace.stats_table = stats_table
    return trace


def load_columns(path: str | os.PathLike, fields: Iterable[str]) -> Trace:
    """A shard's trace with only the op columns named in ``fields`` read (the others hold their kind's empty
    value), its module, collective and statistics tables, and which ops were saved (tensors read only on access,
    as one output each): for views that read many shards and
    need a few columns (the report's module time, a merged Perfetto export's module slices).

    Raises:
        ShardFormatError: as :func:`load`.
    """
    wanted = frozenset(fields) | {"index", "label"}
    empty = {"int": 0, "float": 0.0, "bool": False, "str": "", "ints": (), "strs": (), "shapes": ()}
    with open_shard(Path(path)) as (root, metadata, failed_op, strings):
        columns = read_table(root, "ops", tuple(f for f in OP_FIELDS if f.name in wanted), strings=strings)
        n = len(columns["index"])
        for f in OP_FIELDS:
            columns.setdefault(f.name, [empty[f.kind]] * n)
        modules = read_table(root, "modules", MODULE_CALL_FIELDS, strings=strings)
        collectives = read_table(root, "collectives", COLLECTIVE_FIELDS, strings=strings)
        stats = read_table(root, "stats", STAT_FIELDS, strings=strings) if "stats" in root else None
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
    return trace


__all__ = ["LazyTensors", "ShardOptions", "load", "load_columns", "write_shard"]
