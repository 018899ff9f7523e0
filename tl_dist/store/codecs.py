"""Per-kind encodings of schema columns as HDF5 datasets (see ``docs/shard-format.md``).

Every encoder writes one node (a dataset, or a group of datasets with ``encoding-type`` /
``encoding-version`` attributes) under a table group; every decoder returns the plain Python list the in-memory
trace holds for that kind (ints, floats, bools, strs, tuples of ints, tuples of strs, tuples of torch.Size).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

import h5py
import numpy as np
import torch

from ..schema import Field
from .options import ShardOptions

ENCODING_VERSION = "1"
STR_DTYPE = h5py.string_dtype()  # variable-length UTF-8


def _tag(node: h5py.Group | h5py.Dataset, encoding: str, *, version: bool = True) -> None:
    node.attrs["encoding-type"] = encoding
    if version:
        node.attrs["encoding-version"] = ENCODING_VERSION


def _column(group: h5py.Group, name: str, data: np.ndarray, options: ShardOptions) -> h5py.Dataset:
    return group.create_dataset(name, data=data, **options.column_kwargs(len(data)))


def _categorical(group: h5py.Group, values: Sequence[str] | Any, options: ShardOptions) -> None:
    values = values if isinstance(values, (list, tuple)) else list(values)
    # Three C-level passes (unique in first-seen order, index, codes) instead of a Python loop per value.
    categories = list(dict.fromkeys(values))
    code_of = {v: i for i, v in enumerate(categories)}
    codes = np.fromiter(map(code_of.__getitem__, values), dtype=np.int32, count=len(values))
    _column(group, "codes", codes, options)
    group.create_dataset("categories", data=np.array(categories, dtype=object), dtype=STR_DTYPE)


class StringTable:
    """One shard-wide list of distinct strings: str columns of every table store int32 codes into it.

    One dataset per str column instead of a group of two (creating HDF5 objects dominates writing small
    tables), and one id per distinct op name or module path across the whole shard.
    """

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def codes(self, values: Sequence[str]) -> np.ndarray:
        index = self.index
        for v in dict.fromkeys(values):
            if v not in index:
                index[v] = len(index)
        return np.fromiter(map(index.__getitem__, values), dtype=np.int32, count=len(values))

    def write(self, parent: h5py.Group, name: str, options: ShardOptions) -> None:
        data = np.array(list(self.index), dtype=object)
        parent.create_dataset(name, data=data, dtype=STR_DTYPE, **options.column_kwargs(len(data)))


def _offsets(lengths: Any, n: int) -> np.ndarray:
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.fromiter(lengths, dtype=np.int64, count=n), out=offsets[1:])
    return offsets


def write_column(
    group: h5py.Group, field: Field, values: list, options: ShardOptions, strings: StringTable | None = None
) -> None:
    """Write ``values`` (one schema column) as node ``field.name`` of ``group``; str values as codes into
    ``strings`` when given, else as a categorical group of their own."""
    kind, name, n = field.kind, field.name, len(values)
    if kind == "str" and strings is not None:
        _column(group, name, strings.codes(values), options)
    elif kind == "strs" and strings is not None:
        node = group.create_group(name)
        _tag(node, "ragged-codes", version=False)
        flat = list(chain.from_iterable(values))
        _column(node, "codes", strings.codes(flat), options)
        _column(node, "offsets", _offsets(map(len, values), n), options)
    elif kind == "int":
        _column(group, name, np.asarray(values, dtype=np.int64).reshape(n), options)
    elif kind == "float":
        _column(group, name, np.asarray(values, dtype=np.float64).reshape(n), options)
    elif kind == "bool":
        _column(group, name, np.asarray(values, dtype=np.bool_).reshape(n), options)
    elif kind == "str":
        node = group.create_group(name)
        _tag(node, "categorical", version=False)
        _categorical(node, values, options)
    elif kind == "ints":
        node = group.create_group(name)
        _tag(node, "ragged", version=False)
        offsets = _offsets(map(len, values), n)
        flat = np.fromiter(chain.from_iterable(values), dtype=np.int64, count=int(offsets[-1]))
        _column(node, "values", flat, options)
        _column(node, "offsets", offsets, options)
    elif kind == "strs":
        node = group.create_group(name)
        _tag(node, "ragged-categorical", version=False)
        offsets = _offsets(map(len, values), n)
        _categorical(node, chain.from_iterable(values), options)
        _column(node, "offsets", offsets, options)
    elif kind == "shapes":
        node = group.create_group(name)
        _tag(node, "ragged-shapes", version=False)
        offsets = _offsets(map(len, values), n)
        shapes = list(chain.from_iterable(values))
        shape_offsets = _offsets(map(len, shapes), len(shapes))
        flat = np.fromiter(chain.from_iterable(shapes), dtype=np.int64, count=int(shape_offsets[-1]))
        _column(node, "values", flat, options)
        _column(node, "shape_offsets", shape_offsets, options)
        _column(node, "offsets", offsets, options)
    else:  # schema.Field validates kinds; a new kind must get an encoding here
        raise NotImplementedError(f"no shard encoding for kind {kind!r} of field {name!r}")


def _read_categorical(node: h5py.Group) -> list[str]:
    categories = node["categories"].asstr()[()].tolist()
    return list(map(categories.__getitem__, node["codes"][()].tolist()))


def _split(flat: list, offsets: list[int]) -> list[tuple]:
    n = len(offsets) - 1
    if n > 0 and offsets[-1] == n * (offsets[1] - offsets[0]):
        width = offsets[1] - offsets[0]
        if all(b - a == width for a, b in zip(offsets, offsets[1:])):
            # Rows of equal length (no parents, one output shape, ...): split in C.
            return [()] * n if width == 0 else list(zip(*[iter(flat)] * width))
    return [tuple(flat[a:b]) for a, b in zip(offsets, offsets[1:])]


def _check_encoding(node: Any, expected: str, field: Field) -> None:
    encoding = node.attrs.get("encoding-type") if isinstance(node, h5py.Group) else "dataset"
    if encoding != expected:
        raise ValueError(
            f"column {field.name!r} (kind {field.kind}) should be encoded as {expected!r}, found {encoding!r}"
        )


def read_column(group: h5py.Group, field: Field, n: int, strings: list[str] | None = None) -> list:
    """Read column ``field`` of ``group`` back into the in-memory representation; checks its length is ``n``.
    ``strings``: the shard's string table, for str columns stored as codes."""
    if field.name not in group:
        raise ValueError(f"column {field.name!r} is missing from {group.name}")
    node = group[field.name]
    kind = field.kind
    coded = kind in ("str", "strs") and (
        isinstance(node, h5py.Dataset) or node.attrs.get("encoding-type") == "ragged-codes"
    )
    if coded and strings is None:
        # Called for single columns (merge reads a few): fetch the string table the group names.
        path = group.attrs.get("strings")
        if path is None:
            raise ValueError(
                f"{group.name}/{field.name} holds string codes but {group.name} names no string table"
            )
        strings = group.file[path].asstr()[()].tolist()
    if kind == "str" and coded:
        values = list(map(strings.__getitem__, node[()].tolist()))
    elif kind == "strs" and coded:
        flat = list(map(strings.__getitem__, node["codes"][()].tolist()))
        values = _split(flat, node["offsets"][()].tolist())
    elif kind in ("int", "float", "bool"):
        _check_encoding(node, "dataset", field)
        values = node[()].tolist()
    elif kind == "str":
        _check_encoding(node, "categorical", field)
        values = _read_categorical(node)
    elif kind == "ints":
        flat, offsets = read_ragged(group, field)
        values = _split(flat.tolist(), offsets.tolist())
    elif kind == "strs":
        _check_encoding(node, "ragged-categorical", field)
        values = _split(_read_categorical(node), node["offsets"][()].tolist())
    elif kind == "shapes":
        _check_encoding(node, "ragged-shapes", field)
        flat = node["values"][()].tolist()
        size = torch.Size
        shapes = [size(flat[a:b]) for a, b in _pairs(node["shape_offsets"][()].tolist())]
        values = _split(shapes, node["offsets"][()].tolist())
    else:
        raise NotImplementedError(f"no shard encoding for kind {kind!r} of field {field.name!r}")
    if len(values) != n:
        raise ValueError(f"column {field.name!r} of {group.name} has {len(values)} rows, expected {n}")
    return values


def _pairs(offsets: list[int]) -> Any:
    return zip(offsets, offsets[1:])


def write_table(
    parent: h5py.Group,
    name: str,
    fields: tuple[Field, ...],
    columns: dict[str, list],
    options: ShardOptions,
    *,
    strings: tuple[StringTable, str] | None = None,
) -> h5py.Group:
    """Write a dict of columns as group ``name``: one node per field, column order and row count as attrs.

    ``strings``: (table, its dataset's path): str columns become codes into that shared string table, and the
    group's ``strings`` attribute names it. Without it each str column is a categorical group.
    """
    group = parent.create_group(name)
    _tag(group, "table")
    table = None
    if strings is not None:
        table, path = strings
        group.attrs["strings"] = path
    n = len(columns[fields[0].name]) if fields else 0
    group.attrs["column-order"] = np.array([f.name for f in fields], dtype=object)
    group.attrs["n-rows"] = n
    if n == 0:
        # An empty table is its group alone (no collectives, no stats: the common case); the reader
        # rebuilds empty columns from the schema. Saves ~30 objects per shard.
        return group
    for f in fields:
        values = columns.get(f.name)
        if values is None:
            raise ValueError(f"table {name!r} lacks column {f.name!r} of its schema")
        if len(values) != n:
            raise ValueError(f"table {name!r}: column {f.name!r} has {len(values)} rows, expected {n}")
        write_column(group, f, values, options, table)
    return group


def read_ragged(group: h5py.Group, field: Field) -> tuple[np.ndarray, np.ndarray]:
    """An ``ints`` column as numpy arrays ``(values, offsets)``: row i is ``values[offsets[i]:offsets[i+1]]``."""
    node = group[field.name]
    _check_encoding(node, "ragged", field)
    flat, offsets = _read_dataset(node, "values"), _read_dataset(node, "offsets")
    if flat is None or offsets is None:
        raise ValueError(f"column {field.name!r}: ragged values or offsets missing")
    return flat, offsets


def read_ragged_rows(group: h5py.Group, field: Field, rows: list[int]) -> tuple[np.ndarray, list[tuple]]:
    """Some rows of an ``ints`` column: ``(offsets, [row values as a tuple, ...])``, reading (and
    decompressing) only the parts of ``values`` those rows lie in."""
    node = group[field.name]
    _check_encoding(node, "ragged", field)
    offsets = _read_dataset(node, "offsets")
    if offsets is None or "values" not in node:
        raise ValueError(f"column {field.name!r}: ragged values or offsets missing")
    values = node["values"]
    return offsets, [tuple(values[offsets[r] : offsets[r + 1]].tolist()) for r in rows]


def _table(parent: h5py.Group, name: str) -> tuple[h5py.Group, int]:
    """Table group ``name`` of ``parent`` (checked to be one) and its row count."""
    if name not in parent:
        raise ValueError(f"group {name!r} is missing")
    group = parent[name]
    if not isinstance(group, h5py.Group) or group.attrs.get("encoding-type") != "table":
        raise ValueError(f"{group.name} is not a table (encoding-type attribute 'table' missing)")
    return group, int(group.attrs["n-rows"])


# What a column written before its field existed reads as: the schema's "none / unknown" spellings.
_MISSING = {"int": -1, "float": float("nan"), "bool": False, "str": "", "ints": (), "strs": (), "shapes": ()}


def read_table(
    parent: h5py.Group,
    name: str,
    fields: tuple[Field, ...],
    *,
    strings: list[str] | None = None,
    filled: list[str] | None = None,
) -> dict[str, list]:
    """Read group ``name`` written by :func:`write_table` back into a dict of columns in schema order.

    A field the writer's schema did not have yet (absent from the group's ``column-order``) reads as its
    kind's "unknown" value (-1, NaN, False, '', ()) and its ``table/field`` name is appended to ``filled``; a
    field the writer listed but whose node is gone is corruption and raises.

    ``strings``: the already read string table the group's ``strings`` attribute names (read here if None).
    """
    group, n = _table(parent, name)
    written = set(np.asarray(group.attrs.get("column-order", ()), dtype=object).tolist())
    path = group.attrs.get("strings")
    if n and path is not None and strings is None:
        strings = group.file[path].asstr()[()].tolist()
    columns: dict[str, list] = {}
    for f in fields:
        if f.name not in written and f.name not in group:
            columns[f.name] = [_MISSING[f.kind]] * n
            if filled is not None:
                filled.append(f"{name}/{f.name}")
        elif n == 0:
            columns[f.name] = []
        else:
            columns[f.name] = read_column(group, f, n, strings if path is not None else None)
    return columns


ARRAY_DTYPES = {"int": np.int64, "float": np.float64, "bool": np.bool_}
_ARRAY_DTYPES = ARRAY_DTYPES  # the old private name


def _read_dataset(group: h5py.Group, name: str) -> np.ndarray | None:
    """Dataset ``name`` of ``group`` read whole through h5py's low-level API (a third faster than ``ds[()]``);
    None when it is not a dataset."""
    try:
        dataset = h5py.h5d.open(group.id, name.encode())
    except KeyError:  # absent, or a group (an encoded column)
        return None
    values = np.empty(dataset.shape, dtype=dataset.dtype)
    if values.size:
        dataset.read(h5py.h5s.ALL, h5py.h5s.ALL, values)
    return values


def read_arrays(
    parent: h5py.Group, name: str, fields: tuple[Field, ...]
) -> tuple[int, dict[str, np.ndarray], dict[str, list[str] | None]]:
    """Scalar columns (kinds int, float, bool, str) of table ``name`` as numpy arrays: no Python object per row,
    for readers of many shards (the merge).

    Returns ``(n_rows, arrays, categories)``. A str column reads as int32 codes: ``categories[field]`` is None
    when they index the string table the group's ``strings`` attribute names (``/strings`` of a shard), else
    the column's own categories. A field the writer's schema lacked reads as its kind's unknown value (str:
    code 0 of the categories ``[""]``).

    Example:
        >>> n, arrays, categories = read_arrays(root, "ops", fields)
        >>> strings[arrays["label"]]
    """
    group, n = _table(parent, name)
    written: set[str] | None = None  # read when a column is absent (attribute reads cost as much as columns)
    has_table: bool | None = None
    arrays: dict[str, np.ndarray] = {}
    categories: dict[str, list[str] | None] = {}
    for f in fields:
        if f.kind not in _ARRAY_DTYPES and f.kind != "str":
            raise ValueError(f"read_arrays reads scalar columns; {f.name!r} is of kind {f.kind}")
        values = _read_dataset(group, f.name) if n else None  # the common case: one dataset per column
        if n == 0 or (values is None and f.name not in group):
            if n and written is None:
                written = set(np.asarray(group.attrs.get("column-order", ()), dtype=object).tolist())
            if n and f.name in written:
                raise ValueError(f"column {f.name!r} is missing from {group.name}")
            if f.kind == "str":
                arrays[f.name] = np.zeros(n, dtype=np.int32)
                categories[f.name] = [""]
            else:
                arrays[f.name] = np.full(n, _MISSING[f.kind], dtype=_ARRAY_DTYPES[f.kind])
            continue
        if values is None:
            node = group[f.name]
            _check_encoding(node, "categorical" if f.kind == "str" else "dataset", f)
            values = node["codes"][()]
            categories[f.name] = node["categories"].asstr()[()].tolist()
        elif f.kind == "str":
            if has_table is None:
                has_table = group.attrs.get("strings") is not None
            if not has_table:
                raise ValueError(f"{group.name}/{f.name} holds string codes but names no string table")
            categories[f.name] = None
        else:
            values = values.astype(_ARRAY_DTYPES[f.kind], copy=False)
        if values.shape != (n,):
            raise ValueError(f"column {f.name!r} of {group.name} has shape {values.shape}, expected ({n},)")
        arrays[f.name] = values
    return n, arrays, categories
