"""Rank-local HDF5 shards and merged-trace files: the only part of tl_dist that imports h5py.

The rest of tl_dist (the merge, the command line) uses this package's public names below, never a module's
private ones or h5py itself. Layout: docs/shard-format.md.

- Shards: :func:`write_shard`, :func:`load` (``tl.load``), :func:`load_columns` (some op columns only),
  :func:`open_shard` (the checked root, for readers of many shards), :func:`shard_path` (where ``tl.arm``
  writes a window), :class:`ShardSink` (the sink ``tl.arm`` registers).
- What a file is: :func:`file_kind`, :func:`read_metadata`.
- Tables: :func:`read_table` (columns as lists), :func:`read_arrays` (scalar columns as numpy arrays),
  :func:`read_ragged_rows`, :func:`ragged_lengths`, :func:`write_table`; :data:`ARRAY_DTYPES`.
- Merged-trace files: :func:`write_merged`, :func:`read_merged`, :func:`open_group`.

Example:
    >>> tl.store.file_kind("job42-merged.h5")
    'merged'
"""

from . import location
from .codecs import ARRAY_DTYPES, read_arrays, read_ragged_rows, read_table, write_table
from .files import file_kind, open_group, ragged_lengths, read_merged, read_metadata, write_merged
from .hdf5 import LazyTensors, load, load_columns, open_shard, write_shard
from .options import ShardOptions
from .sink import ShardSink, shard_path

__all__ = [
    "ARRAY_DTYPES",
    "LazyTensors",
    "ShardOptions",
    "ShardSink",
    "file_kind",
    "load",
    "load_columns",
    "location",
    "open_group",
    "open_shard",
    "ragged_lengths",
    "read_arrays",
    "read_merged",
    "read_metadata",
    "read_ragged_rows",
    "read_table",
    "shard_path",
    "write_merged",
    "write_shard",
    "write_table",
]
