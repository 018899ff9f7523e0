"""The straggler of each captured step without a caller that sees every rank: ``OtelSink(stragglers=True)``.

One rank alone cannot know whom the others waited for. So one rank (``merge_rank``, 0 by default) merges
each captured step once every rank's shard of it is in the run folder, with the merge's own code restricted
to that step (:func:`tl_dist.pipeline.step_straggler`: ``tl.merge_ranks(shards).stragglers()`` through
:func:`tl_dist.step_facts.straggler`), and the sink sets its ``tl.step.straggler_rank`` /
``tl.step.straggler_wait`` gauges from the result. Never a per-rank guess: a step whose shards do not all
arrive within ``wait_s`` is reported as such (``missing``), not computed. A shard left in a reused run folder
by another job (its ``job_nonce`` differs from this job's) has not arrived: the watch waits for this job's.

It runs on a thread of its own, so neither the training thread nor tl_dist's sink worker (which writes the
shards) ever waits for the other ranks. Shards on an fsspec URL are found and read through the store
(:mod:`tl_dist.store.location`).

Example:
    >>> watch = StragglerWatch(print, wait_s=60.0)
    >>> watch.submit("runs/job42/rank00000/step00000100.h5", step=100, world_size=8, job_nonce="3f2a...")
    >>> watch.close(5.0)   # StepStraggler(step=100, late=(3, 30000000), missing=(), error='')
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tl_dist.errors import TlDistError
from tl_dist.pipeline import step_straggler
from tl_dist.store import location, read_metadata, shard_path

KEEP = 64
"""Steps whose results :attr:`StragglerWatch.results` keeps (the latest)."""
MAX_PENDING = 16
"""Steps waiting for their shards at most; one more drops the oldest (reported as missing every rank)."""


@dataclass(frozen=True)
class StepStraggler:
    """What the merge of one captured step said: ``late`` is ``(rank, wait_ns)`` of its straggler
    (:func:`tl_dist.step_facts.straggler`) or None when nobody waited; ``missing`` the ranks whose shard did not
    arrive within the wait (then nothing was computed); ``error`` why the merge failed ('' when it did not)."""

    step: int
    late: tuple[int, int] | None
    missing: tuple[int, ...] = ()
    error: str = ""

    @property
    def known(self) -> bool:
        """Whether the step was merged (every shard arrived and the merge succeeded)."""
        return not self.missing and not self.error


def run_root(shard: str) -> str | Path:
    """The run folder of a shard ``ROOT/rank{R}/step{S}.h5`` (a URL stays a URL)."""
    if location.is_url(shard):
        return shard.rstrip("/").rsplit("/", 2)[0]
    return Path(shard).parent.parent


class StragglerWatch:
    """A thread merging each submitted step once all its shards exist (see the module doc).

    Args:
        on_result: called with each :class:`StepStraggler`, on the watch's thread.
        wait_s: how long after a step's submission its shards may take to arrive.
        poll_s: first interval between looks for the shards (it doubles up to 1 s).
    """

    def __init__(
        self, on_result: Callable[[StepStraggler], None], *, wait_s: float, poll_s: float = 0.02
    ) -> None:
        self.on_result = on_result
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.results: collections.OrderedDict[int, StepStraggler] = collections.OrderedDict()
        self._pending: collections.deque[tuple[int, str | Path, int, str, float]] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._abandoned = False
        self._busy = False
        self._thread: threading.Thread | None = None

    def submit(self, shard: str, step: int, world_size: int, job_nonce: str = "") -> None:
        """Watch for every rank's shard of ``step``, in the run folder of this rank's ``shard``, written by the
        job ``job_nonce`` names (this window's ``trace.metadata["job_nonce"]``; '' takes any shard)."""
        dropped = None
        with self._cond:
            if len(self._pending) >= MAX_PENDING:
                dropped = self._pending.popleft()
            self._pending.append(
                (step, run_root(shard), world_size, job_nonce, time.monotonic() + self.wait_s)
            )
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tl_dist-stragglers", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        if dropped is not None:
            self._done(
                StepStraggler(dropped[0], None, tuple(range(dropped[2])), "dropped: too many steps pending")
            )

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every submitted step has its result; False if ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)

    def close(self, timeout: float) -> bool:
        """Finish the steps submitted (their shards still get until their own deadline), waiting ``timeout``
        seconds at most; after that the thread stops at its next look and reports nothing more."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        done = True
        if thread is not None:
            thread.join(timeout)
            done = not thread.is_alive()
        if not done:
            with self._cond:
                self._abandoned = True
                self._cond.notify_all()
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closing)
                if not self._pending or self._abandoned:
                    self._busy = False
                    self._cond.notify_all()
                    return
                step, root, world_size, nonce, deadline = self._pending.popleft()
                self._busy = True
            result = self._merge(step, root, world_size, nonce, deadline)
            if result is not None:
                self._done(result)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _merge(
        self, step: int, root: str | Path, world_size: int, nonce: str, deadline: float
    ) -> StepStraggler | None:
        shards = [shard_path(root, r, step) for r in range(world_size)]
        missing = list(range(world_size))
        poll = self.poll_s
        while True:
            missing = [r for r in missing if not _arrived(shards[r], nonce)]
            left = deadline - time.monotonic()
            if not missing or left <= 0:
                break
            with self._cond:
                if self._cond.wait_for(lambda: self._abandoned, min(poll, left)):
                    return None
            poll = min(poll * 2, 1.0)
        if missing:
            return StepStraggler(step, None, tuple(missing))
        try:
            return StepStraggler(step, step_straggler(shards, step))
        except Exception as exc:  # noqa: BLE001 - on the watch's thread: reported, never raised into training
            return StepStraggler(step, None, (), f"{type(exc).__name__}: {exc}")

    def _done(self, result: StepStraggler) -> None:
        with self._cond:
            if self._abandoned:
                return
            self.results[result.step] = result
            self.results.move_to_end(result.step)
            while len(self.results) > KEEP:
                self.results.popitem(last=False)
        self.on_result(result)


def _arrived(shard: str | Path, nonce: str) -> bool:
    """Whether ``shard`` exists and was written by the job ``nonce`` names ('' takes any shard). One that cannot
    be read yet counts as not arrived (shards appear whole, but a store may list a name before serving it)."""
    if not location.exists(shard):
        return False
    if not nonce:
        return True
    try:
        with location.reading(shard) as local:
            return read_metadata(local).get("job_nonce", "") == nonce
    except (TlDistError, OSError):  # not readable yet, or a transport failure: look again later
        return False
