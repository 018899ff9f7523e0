"""The merge on Dask (``tl.merge_ranks(..., engine="dask")``): shards are read on the workers, matched on the client.

Each worker task reads one shard with the same reader as the local merge (:meth:`.sources.ShardSource.read`),
so the shard's op table is decoded, reduced and dropped on the worker; what travels to the client is what the
matching needs -- the shard's collective records (as columns, their strings as ids into the shard's own string
table), its metadata, last op, compute/communication breakdown and first op start. The client re-interns the
strings into the merge's one :class:`~.sources.Interner` (one string object per distinct value across ranks, as
the local merge keeps them), rebuilds the :class:`~.match.Entry` records, and runs the unchanged per-step
analysis (:func:`.graph.build`). Findings, clocks and stragglers are therefore the local merge's. A worker that
dies mid-merge loses only its tasks, which the scheduler runs again elsewhere (tasks are pure reads).

Example:
    >>> g = tl.merge_ranks("s3://bucket/run42", engine="dask")                   # a LocalCluster it starts
    >>> g = tl.merge_ranks("s3://bucket/run42", engine="tcp://10.0.0.5:8786")    # a running scheduler
    >>> g = tl.merge_ranks("runs/job42", engine=DaskEngine(workers=8))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import TlDistError
from ..store.location import INSTALL_HINT
from .match import Entry
from .sources import Interner, RankData, ShardRef, ShardSource

# Entry fields holding strings: sent as ids into the shard's string table, re-interned on the client.
_STR_FIELDS = ("func", "group_name", "dtype", "state", "label", "module", "source")
_STR_AT = tuple(Entry._fields.index(f) for f in _STR_FIELDS)
_KEY_AT = Entry._fields.index("key")
_GROUP_AT = Entry._fields.index("group")
_KEY_PARTS = tuple(_STR_FIELDS.index(f) for f in ("func", "module", "source"))  # what Entry.key interns


@dataclass(frozen=True)
class DaskEngine:
    """Where a Dask merge runs: an existing ``distributed.Client``, a scheduler address, or (neither) a
    ``LocalCluster`` of ``workers`` processes started for the merge and closed after it.

    Example:
        >>> tl.merge_ranks("s3://bucket/run42", engine=DaskEngine(scheduler="tcp://10.0.0.5:8786"))
    """

    scheduler: str | None = None
    workers: int | None = None
    client: Any = None

    def __post_init__(self) -> None:
        if self.scheduler is not None and not isinstance(self.scheduler, str):
            raise ValueError(
                f"scheduler must be an address such as 'tcp://HOST:8786', got {self.scheduler!r}"
            )
        if self.workers is not None and (
            isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1
        ):
            raise ValueError(f"workers must be a positive int or None, got {self.workers!r}")


def _distributed() -> Any:
    try:
        import distributed
    except ImportError:
        raise TlDistError(f"engine='dask' needs dask[distributed]: {INSTALL_HINT}") from None
    return distributed


def resolve_engine(engine: Any) -> DaskEngine | None:
    """``merge_ranks``' ``engine=``: None for ``"local"``, else the :class:`DaskEngine` it names (``"dask"``, a
    scheduler address ``"tcp://HOST:PORT"``, a ``distributed.Client`` or a DaskEngine).

    Raises:
        ValueError: none of those. TlDistError: a Dask engine without dask[distributed] installed.
    """
    if engine == "local":
        return None
    if engine == "dask" or isinstance(engine, DaskEngine) or (isinstance(engine, str) and "://" in engine):
        _distributed()  # before any shard is read
    if engine == "dask":
        return DaskEngine()
    if isinstance(engine, DaskEngine):
        return engine
    if isinstance(engine, str) and "://" in engine:
        return DaskEngine(scheduler=engine)
    if not isinstance(engine, str):
        try:
            from distributed import Client
        except ImportError:
            Client = None  # noqa: N806 - not installed: nothing is a Client
        if Client is not None and isinstance(engine, Client):
            return DaskEngine(client=engine)
    raise ValueError(
        "engine must be 'local', 'dask', a Dask scheduler address ('tcp://HOST:8786'), a distributed.Client "
        f"or a tl_dist.merge.dask_engine.DaskEngine, got {engine!r}"
    )


@contextlib.contextmanager
def connected(engine: DaskEngine) -> Iterator[Any]:
    """A ``distributed.Client`` for ``engine``; what is started here is closed on leaving."""
    distributed = _distributed()
    if engine.client is not None:
        yield engine.client
        return
    with contextlib.ExitStack() as stack:
        if engine.scheduler is not None:
            client = stack.enter_context(distributed.Client(engine.scheduler))
        else:
            cluster = stack.enter_context(
                distributed.LocalCluster(
                    n_workers=engine.workers or 2,
                    threads_per_worker=1,
                    processes=True,
                    dashboard_address=":0",  # a free port: never clash with a dashboard already running
                )
            )
            client = stack.enter_context(distributed.Client(cluster))
        yield client


def read_packed(ref: ShardRef) -> tuple[RankData, list | None, list[str]]:
    """On a worker: one shard read as the local merge reads it, its records packed for the trip (see the module
    docstring)."""
    names = Interner()
    data = ShardSource([ref]).read((ref.step, ref.rank), names)
    entries, data.entries = data.entries, None
    if not entries:
        return data, None, names.strings
    columns = list(zip(*entries))
    ids = names.id  # every string is interned already: a dict hit each
    for at in _STR_AT:
        columns[at] = np.fromiter(map(ids, columns[at]), dtype=np.int32, count=len(entries))
    columns[_KEY_AT] = None  # recomputed from func, module and source on the client
    return data, columns, names.strings


def unpack(packed: tuple[RankData, list | None, list[str]], names: Interner) -> RankData:
    """On the client: a worker's packed shard as the :class:`RankData` the local merge would have read."""
    data, columns, strings = packed
    if columns is None:
        data.entries = []
        return data
    lookup = np.fromiter(map(names.id, strings), dtype=np.int64, count=len(strings))
    ids = [lookup[columns[at]] for at in _STR_AT]
    for at, got in zip(_STR_AT, ids):
        columns[at] = names.text(got)
    columns[_KEY_AT] = list(zip(*(ids[k].tolist() for k in _KEY_PARTS)))
    columns[_GROUP_AT] = names.groups(columns[_GROUP_AT])
    data.entries = list(map(Entry._make, zip(*columns)))
    return data


class DaskSource:
    """A :class:`~.sources.ShardSource` whose shards are read on Dask workers, all submitted at once in merge
    order; each result is released once the client has it. Reads after the merge (views that rebuild a step's
    records) go to the shards directly.
    """

    def __init__(self, base: ShardSource, client: Any, keys: Iterable[tuple[int, int]]) -> None:
        self.base = base
        keys = list(keys)
        futures = client.map(read_packed, [base.refs[k] for k in keys], pure=False)
        self._pending = dict(zip(keys, futures))

    def name(self, key: tuple[int, int]) -> str:
        return self.base.name(key)

    def read(self, key: tuple[int, int], names: Interner) -> RankData:
        """Raises what the worker's read raised (ShardFormatError, MergeError), as the local read would."""
        future = self._pending.pop(key, None)
        if future is None:
            return self.base.read(key, names)
        try:
            return unpack(future.result(), names)
        finally:
            future.release()

    def trace(self, key: tuple[int, int], fields: Iterable[str] | None = None) -> Any:
        return self.base.trace(key, fields)

    def close(self) -> None:
        """Drop the reads not taken (a merge that stopped early)."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
