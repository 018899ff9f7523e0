"""Sinks: the consumers of finished capture windows (the HDF5 shard writer, OpenTelemetry, Lightning, yours).

``tl.arm(out_dir, sinks=[...])`` registers sinks for the process. When an armed window closes, the training
thread builds the trace and hands it to one background worker thread (a bounded queue); the worker computes
the window's :class:`tl_dist.telemetry.StepTelemetry` once and calls every sink with both. So a slow or failing
sink never slows or breaks the training loop:

- a full queue (:data:`MAX_QUEUED_WINDOWS` windows or :data:`MAX_QUEUED_BYTES` of saved tensors) drops the
  *oldest* window and counts it (:func:`tl_dist.sink_stats`);
- a sink that needs only the window's :class:`~tl_dist.telemetry.StepTelemetry` and tables says so with
  ``needs_tensors = False``: it gets the trace without saved tensors, and when every sink says so the queue
  holds none;
- a sink that raises is logged once (logger ``tl_dist``) with its name, counted, and called again for the next
  window;
- ``tl.disarm()`` and interpreter exit flush the queue (bounded time), then call each sink's ``close()``.

Example:
    >>> class PrintSink:
    ...     def on_window(self, trace, telemetry):
    ...         print(telemetry.step, telemetry.wall_ns, telemetry.flops_per_second)
    ...     def close(self):
    ...         pass
    >>> tl.arm(sinks=[PrintSink()])
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .telemetry import StepTelemetry, summarize

if TYPE_CHECKING:
    from .trace import Trace

log = logging.getLogger("tl_dist")

MAX_QUEUED_WINDOWS = 8
"""Windows waiting for the worker at most; one more drops the oldest (a window can hold saved tensors)."""

MAX_QUEUED_BYTES = 2 << 30
"""Bytes of saved tensors (outputs, gradients, parameter gradients) the queued windows hold at most: a window
that would go over drops the oldest queued ones until it fits (each counted in ``dropped``). The newest window
is always queued, however big: its tensors exist already, and dropping it would free nothing sooner. Read when
``tl.arm`` starts the worker. A window's bytes are its saved ops' ``out_bytes`` (a view counts in full), so the
bound errs on the safe side."""


@runtime_checkable
class Sink(Protocol):
    """A consumer of finished windows. Both methods run on tl_dist's sink worker thread, never on the training
    thread; exceptions are logged and counted, never raised into training.

    ``on_window(trace, telemetry)`` gets the window's :class:`tl_dist.Trace` (with ``trace.metadata``: rank,
    step, run id, host, ...) and its :class:`tl_dist.telemetry.StepTelemetry` (None only if summarising failed,
    which is logged). ``close()`` is called once at ``tl.disarm()`` or exit, after the last window.

    A sink may set ``needs_tensors = False`` (a class attribute): its trace then has every table and the
    metadata but no saved tensors (``saved``, ``grads``, ``param_grads`` empty, ``output`` None), and a window
    whose sinks all say so is queued without them (see :func:`needs_tensors`).
    """

    def on_window(self, trace: Trace, telemetry: StepTelemetry | None) -> None: ...

    def close(self) -> None: ...


def sink_name(sink: Any) -> str:
    """How logs and :func:`sink_stats` name a sink: its ``name`` attribute, else its class name."""
    name = getattr(sink, "name", None)
    return name if isinstance(name, str) and name else type(sink).__name__


def needs_tensors(sink: Any) -> bool:
    """Whether ``sink`` is given the window's saved tensors: unless it sets ``needs_tensors = False``.

    Example:
        >>> class StepTimes:
        ...     needs_tensors = False  # reads only the telemetry: windows reach it without tensors
        ...     def on_window(self, trace, telemetry):
        ...         print(telemetry.wall_ns)
        ...     def close(self):
        ...         pass
        >>> needs_tensors(StepTimes())
        False
    """
    return getattr(sink, "needs_tensors", True) is not False


def window_bytes(trace: Trace) -> int:
    """Bytes of the tensors ``trace`` holds for the queue's bound: saved outputs and gradients counted by their
    ops' ``out_bytes``, plus parameter gradients (see :data:`MAX_QUEUED_BYTES`)."""
    if not trace.saved and not trace.grads and not trace.param_grads:
        return 0  # the telemetry default: a metadata-only window
    out_bytes = trace.columns["out_bytes"]
    total = sum(out_bytes[i] for i in trace.saved) + sum(out_bytes[i] for i in trace.grads)
    return total + sum(g.nelement() * g.element_size() for g in trace.param_grads.values())


def check_sinks(sinks: Any) -> tuple[Sink, ...]:
    """``sinks`` as a tuple, each checked to have ``on_window`` and ``close`` (ValueError naming the bad one)."""
    if isinstance(sinks, (str, bytes)) or not hasattr(sinks, "__iter__"):
        raise ValueError(f"sinks must be a list of sinks (objects with on_window and close), got {sinks!r}")
    out = tuple(sinks)
    for k, s in enumerate(out):
        if not isinstance(s, Sink):
            raise ValueError(
                f"sinks[{k}] ({type(s).__name__}) is not a sink: it needs on_window(trace, telemetry) and close() "
                "methods (see tl_dist.Sink)"
            )
    return out


@dataclass
class SinkStats:
    """Counters of the sink worker (``tl.sink_stats()``).

    Attributes:
        submitted: windows handed to the worker.
        delivered: windows every sink was called with (successfully or not).
        dropped: windows dropped because the queue was full, in windows or bytes (the oldest goes first).
        pending: windows waiting or being delivered now.
        queued_bytes: bytes of saved tensors the waiting windows hold now (see :data:`MAX_QUEUED_BYTES`).
        errors: sink name -> how many windows it raised on.
        last_error: sink name -> its last error, as ``"Type: message"``.
        busy_s: seconds the worker spent delivering (telemetry + sinks).
    """

    submitted: int = 0
    delivered: int = 0
    dropped: int = 0
    pending: int = 0
    queued_bytes: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    last_error: dict[str, str] = field(default_factory=dict)
    busy_s: float = 0.0


class SinkWorker:
    """One background thread delivering windows to ``sinks`` in order, from a bounded queue.

    The thread starts with the first window and is a daemon: a process that exits without ``close`` (killed)
    does not wait for it; ``atexit`` flushing is the caller's (``tl.arm`` registers it).
    """

    def __init__(
        self, sinks: tuple[Sink, ...], *, max_queued: int = MAX_QUEUED_WINDOWS, max_bytes: int | None = None
    ) -> None:
        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1:
            raise ValueError(f"max_queued must be a positive int, got {max_queued!r}")
        max_bytes = MAX_QUEUED_BYTES if max_bytes is None else max_bytes
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be a non-negative int, got {max_bytes!r}")
        self.sinks = sinks
        self.max_queued = max_queued
        self.max_bytes = max_bytes
        self._tensor_free = tuple(s for s in sinks if not needs_tensors(s))
        self.stats = SinkStats()
        self._queue: collections.deque = collections.deque()
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def submit(
        self, trace: Trace, *, skip: tuple[Sink, ...] = (), telemetry: StepTelemetry | None = None
    ) -> None:
        """Queue ``trace`` for every sink but those in ``skip``; never blocks (a full queue drops the oldest).
        ``telemetry``: the window's summary when the caller computed it already (else the worker does, once)."""
        if not self.sinks:
            return
        getting = [s for s in self.sinks if not any(s is k for k in skip)]
        if getting and all(any(s is f for f in self._tensor_free) for s in getting):
            trace = trace.without_tensors()  # no sink wants them: the queue does not keep them alive
        size = window_bytes(trace)
        with self._cond:
            if self._closed:
                return
            if os.getpid() != self._pid:  # a forked child: the parent's thread and queue are not ours
                return
            queue, stats = self._queue, self.stats
            while queue and (len(queue) >= self.max_queued or stats.queued_bytes + size > self.max_bytes):
                stats.queued_bytes -= queue.popleft()[2]
                stats.dropped += 1
            queue.append((trace, skip, size, telemetry))
            stats.queued_bytes += size
            stats.submitted += 1
            stats.pending = len(queue) + self._busy
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tl_dist-sinks", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every queued window was delivered; False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                if self._thread is None or not self._thread.is_alive():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = 30.0) -> bool:
        """Flush (up to ``timeout``), stop the thread and call each sink's ``close()``; True if all was delivered."""
        flushed = self.flush(timeout)
        with self._cond:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            self.stats.dropped += len(left)
            self.stats.queued_bytes = 0
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=1.0 if flushed else 0.1)
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - a sink's failure must not reach the caller
                self._failed(sink, exc, "close")
        if left:
            log.warning(
                "tl_dist: %d window(s) were not delivered to the sinks before the deadline", len(left)
            )
        return flushed and not left

    # -- worker thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queue:
                    return
                trace, skip, size, telemetry = self._queue.popleft()
                self.stats.queued_bytes -= size
                self._busy = True
            started = time.perf_counter()
            try:
                if telemetry is None:
                    try:
                        telemetry = summarize(trace)
                    except Exception as exc:  # noqa: BLE001
                        self._failed(None, exc, "summarize")
                bare = trace.without_tensors() if self._tensor_free else trace
                for sink in self.sinks:
                    if any(sink is s for s in skip):
                        continue
                    try:
                        tensor_free = any(sink is s for s in self._tensor_free)
                        sink.on_window(bare if tensor_free else trace, telemetry)
                    except Exception as exc:  # noqa: BLE001 - never into the training loop
                        self._failed(sink, exc, "on_window")
            finally:
                trace = bare = None  # the worker keeps no window alive while it waits
                with self._cond:
                    self._busy = False
                    self.stats.delivered += 1
                    self.stats.busy_s += time.perf_counter() - started
                    self.stats.pending = len(self._queue)
                    self._cond.notify_all()

    def _failed(self, sink: Any, exc: BaseException, what: str) -> None:
        name = "telemetry" if sink is None else sink_name(sink)
        with self._cond:
            count = self.stats.errors.get(name, 0) + 1
            self.stats.errors[name] = count
            self.stats.last_error[name] = f"{type(exc).__name__}: {exc}"
        if count == 1:
            log.warning(
                "tl_dist: sink %s raised in %s (logged once; counted in tl.sink_stats())",
                name,
                what,
                exc_info=exc,
            )
