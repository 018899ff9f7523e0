"""Shard writing options: kept apart from the h5py code so that ``tl.arm`` can take them without importing
h5py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ShardOptions:
    """Rarely changed settings of shard writing.

    Args:
        rows_per_chunk: chunk length of column datasets.
        compression: HDF5 filter for columns: ``"gzip"`` (readable by every HDF5 tool, h5dump included) or
            None.
        compression_level: gzip level 1-9.
        tensor_compression: filter for saved activations/gradients. None by default: float activations
            barely compress with gzip and compressing them costs most of the write time.

    Example:
        >>> tl.arm("runs/job42", shard=ShardOptions(tensor_compression="gzip"))
    """

    rows_per_chunk: int = 65_536
    compression: str | None = "gzip"
    compression_level: int = 4
    tensor_compression: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rows_per_chunk, int) or self.rows_per_chunk < 1:
            raise ValueError(f"rows_per_chunk must be a positive int, got {self.rows_per_chunk!r}")
        for name in ("compression", "tensor_compression"):
            value = getattr(self, name)
            if value not in (None, "gzip"):
                raise ValueError(f"{name} must be 'gzip' or None, got {value!r}")
        if not isinstance(self.compression_level, int) or not 1 <= self.compression_level <= 9:
            raise ValueError(f"compression_level must be an int in 1..9, got {self.compression_level!r}")

    def column_kwargs(self, n: int) -> dict[str, Any]:
        """Dataset keywords for a 1-D column of ``n`` values; scalars and empty datasets get none."""
        if n == 0 or self.compression is None:
            return {}
        return {
            "chunks": (min(n, self.rows_per_chunk),),
            "compression": self.compression,
            "compression_opts": self.compression_level,
        }

    def tensor_kwargs(self, array: np.ndarray) -> dict[str, Any]:
        """Dataset keywords for a saved tensor; scalars and empty arrays are never chunked or compressed."""
        if self.tensor_compression is None or array.ndim == 0 or array.size == 0:
            return {}
        return {"compression": self.tensor_compression, "compression_opts": self.compression_level}
