"""The HDF5 shard writer as a sink: ``tl.arm(out_dir)`` registers it; it writes each window's shard on the sink
worker thread, as ``out_dir/rank{RRRRR}/step{SSSSSSSS}.h5``. An ``out_dir`` that is a URL (``s3://...``) gets
each shard written to a local spool first, then uploaded (:mod:`.location`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import location
from .hdf5 import write_shard
from .options import ShardOptions

_DEFAULT_SHARD = ShardOptions()


def shard_path(out_dir: str | os.PathLike, rank: int, step: int) -> Path | str:
    """Where the shard of ``rank``'s window ``step`` lives under a run's ``out_dir`` (a URL stays a URL)."""
    return location.join(out_dir, f"rank{rank:05d}", f"step{step:08d}.h5")


class ShardSink:
    """Writes every window it is given as a shard (atomically: a temporary name, then ``os.replace``; for a URL,
    a local spool file, then an upload that publishes the object only once complete).

    Example:
        >>> tl.arm("runs/job42")   # registers ShardSink("runs/job42") itself
    """

    name = "shards"

    def __init__(self, out_dir: str | os.PathLike, *, shard: ShardOptions = _DEFAULT_SHARD) -> None:
        if not isinstance(shard, ShardOptions):
            raise ValueError(f"shard must be a tl_dist.store.ShardOptions, got {type(shard).__name__}")
        self.url = str(out_dir).rstrip("/") if location.is_url(out_dir) else None
        self.out_dir = Path(out_dir) if self.url is None else None
        self.spool = location.spool_dir(self.url) if self.url is not None else None
        self.shard = shard

    def path_for(self, metadata: dict[str, Any]) -> Path | str:
        return shard_path(self.url or self.out_dir, metadata.get("rank", 0), metadata.get("step", 0))

    def write(self, trace: Any, *, complete: bool, timeout: float | None = None) -> Path | str:
        """Write ``trace``'s shard; returns its path or URL. ``timeout``: seconds an upload may take.

        Raises:
            StorageError: (URL) the upload failed or timed out; the message names the spooled shard, kept.
        """
        final = self.path_for(trace.metadata)
        if self.url is None:
            final.parent.mkdir(parents=True, exist_ok=True)
            return write_shard(trace, final, complete=complete, options=self.shard)
        local = self.spool / final[len(self.url) + 1 :]
        local.parent.mkdir(parents=True, exist_ok=True)
        write_shard(trace, local, complete=complete, options=self.shard)
        return location.upload(local, final, timeout=timeout)

    def on_window(self, trace: Any, telemetry: Any) -> None:
        self.write(trace, complete=bool(trace.metadata.get("complete", True)))

    def close(self) -> None:
        pass
