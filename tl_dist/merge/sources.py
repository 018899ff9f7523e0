"""Finding and reading shards for a merge. Shards are read only through the store's API (``tl.load``)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import MergeError, TlDistError

if TYPE_CHECKING:
    from ..trace import Trace

_SHARD_RE = re.compile(r"rank(\d+)[/\\]step(\d+)\.h5$")


@dataclass
class ShardRef:
    """One shard file and the rank and step its path names."""

    path: Path
    rank: int
    step: int


def find_shards(path_or_paths: Any) -> list[ShardRef]:
    """The shards of a run directory (``DIR/rank{R}/step{S}.h5``) or an explicit list of shard paths.

    Raises:
        MergeError: the directory holds no shards, a path does not exist, or a path is not named
            ``rank{R}/step{S}.h5`` (the rank and step are read from it when the shard cannot be).
    """
    if isinstance(path_or_paths, (str, os.PathLike)):
        root = Path(path_or_paths)
        if root.is_dir():
            found = sorted(root.glob("rank*/step*.h5"))
            refs = [_ref(p) for p in found if _SHARD_RE.search(p.as_posix())]
            if not refs:
                raise MergeError(
                    f"path_or_paths: {root} holds no shards (expected {root}/rank00000/step00000000.h5, as "
                    "written by tl.arm + tl.capture)"
                )
            return refs
        paths = [root]
    elif isinstance(path_or_paths, (list, tuple)) and path_or_paths:
        paths = [Path(p) for p in path_or_paths]
    else:
        raise MergeError(
            f"path_or_paths must be a run directory or a non-empty list of shard paths, got {path_or_paths!r}"
        )
    refs = []
    for p in paths:
        if not p.exists():
            raise MergeError(f"path_or_paths: {p} does not exist")
        if not _SHARD_RE.search(p.as_posix()):
            raise MergeError(
                f"path_or_paths: {p} is not named rank{{R}}/step{{S}}.h5 as tl.arm writes shards"
            )
        refs.append(_ref(p))
    return refs


def _ref(p: Path) -> ShardRef:
    m = _SHARD_RE.search(p.as_posix())
    return ShardRef(p, int(m.group(1)), int(m.group(2)))


# The op columns the merge itself reads; the rest (parents, shapes, module stacks: the costly ragged ones) are
# read only when a view needs a rank's full trace (``MergedTrace.rank``).
MERGE_FIELDS = (
    "index",
    "label",
    "func",
    "kind",
    "phase",
    "module",
    "source",
    "start_ns",
    "duration_ns",
    "flops",
)


class ShardTables:
    """What the merge reads of one shard: some op columns, the collective table, metadata, failed_op.

    Duck-types the parts of :class:`~tl_dist.trace.Trace` the merge's analyzers use (``columns``,
    ``collective_table``, ``metadata``, ``failed_op``, ``len``).
    """

    __slots__ = ("path", "columns", "collective_table", "metadata", "failed_op", "_n")

    def __init__(
        self, path: Path, columns: dict, collective_table: dict, metadata: dict, failed_op: Any
    ) -> None:
        self.path = path
        self.columns = columns
        self.collective_table = collective_table
        self.metadata = metadata
        self.failed_op = failed_op
        self._n = len(columns["index"])

    def __len__(self) -> int:
        return self._n

    @property
    def rank(self) -> Any:
        return self.metadata.get("rank")

    @property
    def step(self) -> Any:
        return self.metadata.get("step")

    @property
    def world_size(self) -> Any:
        return self.metadata.get("world_size")


def load_tables(ref: ShardRef) -> ShardTables:
    """Read the tables the merge needs from one shard (no saved tensors, no ragged op columns).

    Uses the store's column codecs and its layout checks; a full trace comes from ``tl.load``.

    Raises:
        ShardFormatError: the file is missing, not HDF5, corrupt, or of a newer schema (names the file).
    """
    from ..schema import COLLECTIVE_FIELDS, OP_FIELDS
    from ..store.codecs import read_table
    from ..store.hdf5 import open_shard

    path = ref.path
    with open_shard(path) as (root, metadata, failed_op, strings):
        fields = tuple(f for f in OP_FIELDS if f.name in MERGE_FIELDS)
        columns = read_table(root, "ops", fields, strings=strings)
        collective_table = read_table(root, "collectives", COLLECTIVE_FIELDS, strings=strings)
    return ShardTables(path, columns, collective_table, metadata, failed_op)


def load_shard(path: Path) -> Trace:
    """The full trace of one shard (saved tensors read lazily, on first access)."""
    from ..store import load

    return load(path)


def shard_facts(trace: Trace, ref: ShardRef) -> tuple[int, int, int | None, bool]:
    """(rank, step, world_size or None, complete) of a loaded shard; its metadata wins over its file name."""
    meta = trace.metadata
    rank = _attr(trace, "rank", ref.rank)
    step = _attr(trace, "step", ref.step)
    world = _attr(trace, "world_size", None)
    if rank != ref.rank:
        raise MergeError(f"{ref.path}: shard says rank {rank} but sits in the folder of rank {ref.rank}")
    complete = bool(meta.get("complete", True))
    return int(rank), int(step if step is not None else ref.step), world, complete


def _attr(trace: Trace, name: str, default: Any) -> Any:
    value = trace.metadata.get(name)  # what Trace.rank / .step / .world_size read
    return default if value is None else int(value)


def read_all(refs: list[ShardRef], *, strict: bool, progress: bool) -> tuple[dict, dict, dict]:
    """Read every shard's tables. Returns ``({(step, rank): ShardTables}, {(step, rank): error message},
    {(step, rank): (world_size or None, complete)})``.

    With ``strict`` a shard that cannot be read raises :class:`MergeError` naming it.
    """
    traces: dict[tuple[int, int], Trace] = {}
    errors: dict[tuple[int, int], str] = {}
    facts: dict[tuple[int, int], tuple[int | None, bool]] = {}
    iterator: Any = refs
    if progress:
        try:
            from tqdm.auto import tqdm  # installed with lightning; optional here
        except ImportError:
            tqdm = None
        if tqdm is not None:
            iterator = tqdm(refs, desc="reading shards", unit="shard", leave=False)
    for ref in iterator:
        try:
            trace = load_tables(ref)
            _, step, world, complete = shard_facts(trace, ref)
        except TlDistError as exc:
            if strict:
                raise MergeError(
                    f"cannot merge: {exc} (pass strict=False to merge the other shards)"
                ) from exc
            errors[(ref.step, ref.rank)] = str(exc)
            continue
        traces[(step, ref.rank)] = trace
        facts[(step, ref.rank)] = (world, complete)
    return traces, errors, facts
