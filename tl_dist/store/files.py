"""What the rest of tl_dist asks of an HDF5 file without knowing the layout: what a file is, a shard's metadata,
and the merged-trace file (``MergedTrace.save`` / ``tl.load_merged``) written and read as attributes and tables.

The merge and the command line call these instead of h5py (this package is the only h5py user); a table node
they are handed (``open_group``) is only passed back to the readers here and in :mod:`.codecs`.

Example:
    >>> file_kind("runs/job42/rank00000/step00000100.h5")
    'shard'
    >>> read_metadata("runs/job42/rank00000/step00000100.h5")["world_size"]
    8
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import h5py
import numpy as np

from .._files import replacing
from ..errors import ShardFormatError
from ..schema import SCHEMA_VERSION, Field
from .codecs import _read_dataset, write_table
from .options import ShardOptions
from .writer import ROOT_ENCODING

MERGED_ENCODING = "tl_dist.merged"
MERGED_ENCODING_VERSION = "1"
# One table of a merged file's group: (name, fields, columns).
Table = tuple[str, tuple[Field, ...], dict[str, list]]


def file_kind(path: str | os.PathLike) -> str:
    """``"shard"`` (a rank's window, ``tl.load``), ``"merged"`` (``tl.load_merged``) or ``"other"`` (HDF5 of
    another layout), from the file's root ``encoding-type``.

    Raises:
        ShardFormatError: ``path`` is not a readable HDF5 file.
    """
    try:
        with h5py.File(path, "r") as f:
            encoding = f.attrs.get("encoding-type")
    except OSError as exc:
        raise ShardFormatError(f"{os.fspath(path)}: not a readable HDF5 file: {exc}") from exc
    return {ROOT_ENCODING: "shard", MERGED_ENCODING: "merged"}.get(encoding, "other")


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """A shard's run metadata (rank, world_size, step, host ...) from one attribute read, tables untouched.

    Raises:
        ShardFormatError: the file cannot be read or has no metadata.
    """
    try:
        with h5py.File(path, "r") as f:
            return json.loads(f.attrs["metadata"])
    except Exception as exc:  # noqa: BLE001 - any failure is a format problem of this file
        raise ShardFormatError(f"{os.fspath(path)}: no readable shard metadata: {exc}") from exc


def ragged_lengths(group: Any, name: str) -> np.ndarray | None:
    """Row lengths of ragged column ``name`` of a table node, from its offsets alone (values not read); None
    when the column is absent or not ragged."""
    node = group.get(name)
    offsets = _read_dataset(node, "offsets") if isinstance(node, h5py.Group) else None
    return None if offsets is None else np.diff(offsets)


def write_merged(
    path: str | os.PathLike, attrs: dict[str, Any], groups: Iterable[tuple[str, dict[str, Any], list[Table]]]
) -> str:
    """Write a merged-trace file (temporary name, then renamed): root ``attrs``, and per item of ``groups`` (one
    rank's step: its name, attributes and tables) a group under ``/shards``. Returns the path."""
    path = os.fspath(path)
    options = ShardOptions()
    with replacing(path) as tmp, h5py.File(tmp, "w") as root:
        root.attrs["encoding-type"] = MERGED_ENCODING
        root.attrs["encoding-version"] = MERGED_ENCODING_VERSION
        root.attrs["schema_version"] = SCHEMA_VERSION
        for key, value in attrs.items():
            root.attrs[key] = value
        shards = root.create_group("shards")
        for name, group_attrs, tables in groups:
            grp = shards.create_group(name)
            for key, value in group_attrs.items():
                grp.attrs[key] = value
            for table, fields, columns in tables:
                write_table(grp, table, fields, columns, options)
    return path


def _open_merged_file(path: str) -> Any:
    """``path`` open read-only with h5py, or the ShardFormatError naming it (missing, or not HDF5)."""
    if not os.path.isfile(path):
        raise ShardFormatError(f"{path}: no such merged-trace file")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise ShardFormatError(f"{path}: not a readable HDF5 file: {exc}") from exc


def read_merged(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The root attributes of a merged-trace file and each ``/shards`` group's attributes, by group name.

    Raises:
        ShardFormatError: the file is missing, not HDF5, not a merged trace, or from a newer schema.
    """
    path = os.fspath(path)
    root = _open_merged_file(path)
    try:
        with root:
            if root.attrs.get("encoding-type") != MERGED_ENCODING:
                raise ShardFormatError(
                    f"{path}: not a merged trace (encoding-type {root.attrs.get('encoding-type')!r}, "
                    f"expected {MERGED_ENCODING!r}); open shards with tl.load or merge them with tl.merge_ranks"
                )
            version = int(root.attrs.get("schema_version", -1))
            if version > SCHEMA_VERSION:
                raise ShardFormatError(f"{path}: schema version {version} is newer than {SCHEMA_VERSION}")
            return dict(root.attrs), {name: dict(g.attrs) for name, g in root["shards"].items()}
    except ShardFormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a format problem of this file
        raise ShardFormatError(f"{path}: corrupt merged-trace file: {type(exc).__name__}: {exc}") from exc


@contextmanager
def open_group(path: str | os.PathLike, name: str) -> Iterator[Any]:
    """One ``/shards`` group of a merged-trace file, open for the table readers (``read_table``,
    ``read_arrays``) while the ``with`` block runs; its ``.attrs`` hold the group's attributes.

    Raises:
        ShardFormatError: the file is missing or not readable HDF5, or has no such group (names the file).
    """
    path = os.fspath(path)
    f = _open_merged_file(path)
    with f:
        try:
            group = f["shards"][name]
        except Exception as exc:  # noqa: BLE001 - a missing or corrupt group: a format problem of this file
            raise ShardFormatError(f"{path}: no readable group /shards/{name}: {exc}") from exc
        yield group
