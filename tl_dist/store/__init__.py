"""Rank-local HDF5 shards: :func:`write_shard` and :func:`load` (``tl.load``). Layout: docs/shard-format.md.

The only part of tl_dist that imports h5py.
"""

from .hdf5 import LazyTensors, load, write_shard
from .options import ShardOptions

__all__ = ["LazyTensors", "ShardOptions", "load", "write_shard"]
