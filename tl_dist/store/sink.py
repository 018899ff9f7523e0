"""The HDF5 shard writer as a sink: ``tl.arm(out_dir)`` registers it; it writes each window's shard on the sink
worker thread, as ``out_dir/rank{RRRRR}/step{SSSSSSSS}.h5``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .hdf5 import write_shard
from .options import ShardOptions

_DEFAULT_SHARD = ShardOptions()


def shard_path(out_dir: str | os.PathLike, rank: int, step: int) -> Path:
    """Where the shard of ``rank``'s window ``step`` lives under a run's ``out_dir``."""
    return Path(out_dir) / f"rank{rank:05d}" / f"step{step:08d}.h5"


class ShardSink:
    """Writes every window it is given as a shard (atomically: a temporary name, then ``os.replace``).

    Example:
        >>> tl.arm("runs/job42")   # registers ShardSink("runs/job42") itself
    """

    name = "shards"

    def __init__(self, out_dir: str | os.PathLike, *, shard: ShardOptions = _DEFAULT_SHARD) -> None:
        if not isinstance(shard, ShardOptions):
            raise ValueError(f"shard must be a tl_dist.store.ShardOptions, got {type(shard).__name__}")
        self.out_dir = Path(out_dir)
        self.shard = shard

    def path_for(self, metadata: dict[str, Any]) -> Path:
        return shard_path(self.out_dir, metadata.get("rank", 0), metadata.get("step", 0))

    def write(self, trace: Any, *, complete: bool) -> Path:
        path = self.path_for(trace.metadata)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_shard(trace, path, complete=complete, options=self.shard)

    def on_window(self, trace: Any, telemetry: Any) -> None:
        self.write(trace, complete=bool(trace.metadata.get("complete", True)))

    def close(self) -> None:
        pass
