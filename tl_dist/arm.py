"""``tl.arm()``: per-rank capture windows handed to sinks (the HDF5 shard writer and others), with post-mortems.

Arming installs nothing on the op path: it fixes what a window records (``tl.CaptureOptions``), the run
metadata, and the sinks that receive finished windows on a background worker thread (``tl_dist.sinks``); with
``out_dir`` the shard writer is one of them (``out_dir/rank{RRRRR}/step{SSSSSSSS}.h5``). It installs
SIGTERM/SIGUSR1 handlers plus an atexit hook that write whatever an open window has captured as a shard marked
incomplete -- synchronously, so it lands before the process dies -- and flush the sinks' queue.

Example:
    >>> torch.distributed.init_process_group("gloo")
    >>> tl.arm("runs/job42", every=100)
    >>> for step in range(1000):
    ...     with tl.capture(step=step) if tl.should_capture(step) else contextlib.nullcontext():
    ...         train_step()
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

from . import _session, _signals
from ._common import user_stacklevel
from ._postmortem import SIGNAL_FLUSH_S, write_postmortem
from ._postmortem import writing as _writing
from ._signals import on_signal as _on_signal
from ._stacks import traceback_stack
from .capture import Capture, open_capture
from .compiled import watch_compiles
from .options import DEFAULT_OPTIONS, CaptureOptions, check_options
from .sinks import SinkStats, SinkWorker, check_sinks
from .store import ShardOptions, ShardSink, location
from .telemetry import StepTelemetry, summarize

__all__ = [
    "FLUSH_TIMEOUT_S",
    "SIGNAL_FLUSH_S",
    "Armed",
    "arm",
    "armed",
    "armed_session",
    "disarm",
    "flush",
    "should_capture",
    "sink_stats",
    "write_postmortem",
]

_DEFAULT_SHARD = ShardOptions()
FLUSH_TIMEOUT_S = 30.0
"""How long ``disarm()`` and interpreter exit wait for the sinks to take the queued windows."""


def _run_id(out_dir: Path | str | None, host: str) -> str:
    """One id for every rank of the run without talking to the others: torchelastic's run id, else the shard
    folder's name, else the rendezvous address, else this process."""
    folder = location.name(out_dir) if out_dir is not None else None
    for value in (os.environ.get("TORCHELASTIC_RUN_ID"), folder):
        if value:
            return value
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return f"{host}-{os.getpid()}"


def _job_nonce() -> str:
    """An id every rank of this job agrees on and no other job has ('' without a process group). ``run_id`` is
    the same for two jobs that reuse a run folder; this tells their shards apart. The first rank to arm puts a
    random id in the process group's rendezvous store and the others read it back: no collective, and no rank
    waits for another to arm."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    try:
        store = dist.distributed_c10d._get_default_store()
        return store.compare_set("tl_dist/job_nonce", "", uuid.uuid4().hex).decode()
    except Exception:  # noqa: BLE001 - a store without compare_set: shards then carry no nonce
        return ""


def _run_metadata(out_dir: Path | str | None) -> dict[str, Any]:
    """Rank, world size and backend from the default process group; rank 0 of world 1 without one."""
    rank, world, backend = 0, 1, ""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        rank, world, backend = dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    host = socket.gethostname()
    return {
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
        "world_size": world,
        "backend": backend,
        "host": host,
        # Same host and boot: one clock. The merge then takes offset 0 instead of estimating one.
        "boot_id": _boot_id(),
        "pid": os.getpid(),
        "run_id": _run_id(out_dir, host),
        "job_nonce": _job_nonce(),
        "torch_version": str(torch.__version__),
        "start_time_ns": time.time_ns(),
    }


def _boot_id() -> str:
    """This kernel boot's id (Linux); '' where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class Armed:
    """An armed session: the options, run metadata and sinks its capture windows use.

    ``tl.arm`` makes one the process's (plain ``tl.capture`` windows open in it); :func:`armed_session` makes
    one that only its own :meth:`capture` windows use, e.g. a framework callback's, beside a user's ``tl.arm``.
    """

    def __init__(
        self,
        out_dir: Path | str | None,
        *,
        options: CaptureOptions,
        every: int | None,
        sinks: tuple[Any, ...],
        shard: ShardOptions,
        peak_flops: float | None = None,
        summarize_on_close: bool = False,
    ) -> None:
        self.out_dir = out_dir
        self.options = options
        self.every = every
        self.shard = shard
        self.peak_flops = peak_flops
        self.summarize_on_close = summarize_on_close
        self.metadata = _run_metadata(out_dir)
        self.shard_sink = ShardSink(out_dir, shard=shard) if out_dir is not None else None
        all_sinks = ((self.shard_sink,) if self.shard_sink is not None else ()) + sinks
        self.worker = SinkWorker(all_sinks)
        rank_dir = f"rank{self.metadata['rank']:05d}"
        self.rank_dir = location.join(out_dir, rank_dir) if out_dir is not None else None
        self.windows = 0
        self.steps: dict[int, int] = {}  # step -> the number of the window that last captured it
        self.previous_handlers: dict[int, Any] = {}  # filled when this session installs the signal handlers
        self.watcher: Any = None  # the signal watcher thread of those handlers
        self.closed = False

    def open_window(self, step: int | None) -> Window:
        return Window(self, step)

    def capture(self, *, step: int | None = None, root: torch.nn.Module | None = None) -> Capture:
        """A ``tl.capture`` window of this session (whatever the process's ``tl.arm`` is), with its options.

        Example:
            >>> session = tl.armed_session("runs/fit")
            >>> with session.capture(step=3):
            ...     model(x).sum().backward()
            >>> session.close()  # runs/fit/rank00000/step00000003.h5
        """
        if self.closed:
            raise ValueError("this armed session is closed; open a new one with tl.armed_session(...)")
        return open_capture(self, step=step, root=root)

    def flush(self, timeout: float | None = FLUSH_TIMEOUT_S) -> bool:
        """Wait until this session's sinks took every closed window; False if ``timeout`` seconds passed first."""
        return self.worker.flush(timeout)

    def close(self, timeout: float | None = FLUSH_TIMEOUT_S) -> bool:
        """Flush (up to ``timeout``) and close the sinks; give back the signal handlers if this session held
        them. True when every window reached the sinks. Closing twice is a no-op (True)."""
        if self.closed:
            return True
        self.closed = True
        _signals.unregister(self)
        if not _signals.live:
            atexit.unregister(_at_exit)
        return self.worker.close(timeout)


class Window:
    """One armed capture window: on close, hands its trace to the sinks (post-mortems: the shard first)."""

    def __init__(self, armed: Armed, step: int | None) -> None:
        self.armed = armed
        self.number = armed.windows
        armed.windows += 1
        self.step = step if step is not None else self.number
        earlier = armed.steps.get(self.step)
        if earlier is not None and armed.shard_sink is not None:
            warnings.warn(
                f"tl_dist: step {self.step} was already captured by window {earlier} of this process: this window's "
                f"shard (step{self.step:08d}.h5) replaces that one. Give each window its own step= (with "
                "gradient accumulation, capture one micro-batch per step; windows without step= are numbered "
                "by their count, which explicit steps can collide with)",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        armed.steps[self.step] = self.number
        sink = armed.shard_sink
        self.path = sink.path_for({"rank": armed.metadata["rank"], "step": self.step}) if sink else None
        self.thread = threading.get_ident()  # the thread that runs the window: its stack goes in post-mortems
        self.telemetry: StepTelemetry | None = None
        """The window's summary, computed once on close when the session asks for it (``summarize_on_close``)
        and handed to every sink; None otherwise (the sink worker computes it)."""
        self.telemetry_error: Exception | None = None

    def metadata(self, *, complete: bool, reason: str) -> dict[str, Any]:
        meta = dict(self.armed.metadata)
        meta.update(step=self.step, window=self.number, complete=complete, end_reason=reason)
        return meta

    def close(self, capture: Any, exc: BaseException | None) -> None:
        """Called by ``Capture.__exit__``. A window the user's error ended is a post-mortem: its shard is written
        now, on this thread; then (or for a normal window, only) the worker delivers it to the sinks."""
        armed = self.armed
        complete = exc is None
        meta = self.metadata(complete=complete, reason="closed" if complete else "exception")
        if exc is not None:
            meta["error"] = f"{type(exc).__name__}: {exc}"
            meta.update(traceback_stack(exc.__traceback__, until=_on_signal.__code__))
            signum = _signals.raised_in_signal_handler(exc)
            if signum is not None:  # the user's handler, chained after ours, raised: the signal ended it
                meta["end_reason"] = signal.Signals(signum).name
        trace = capture.trace
        trace.metadata.update(meta)
        skip: tuple[Any, ...] = ()
        if not complete and armed.shard_sink is not None:
            skip = (armed.shard_sink,)
            try:
                # Serialised with post-mortem writes (the signal watcher may be writing this window's
                # snapshot): the shard that ends up under the name is this final one.
                with _writing:
                    armed.shard_sink.write(trace, complete=False, timeout=SIGNAL_FLUSH_S)
            except Exception as write_exc:  # noqa: BLE001 - the user's exception is the one to see
                warnings.warn(
                    f"tl_dist: could not write post-mortem shard {self.path}: {write_exc}", stacklevel=3
                )
        if self.path is not None:
            trace.metadata["shard"] = str(self.path)
        capture.detach_from_training()
        if complete and armed.summarize_on_close:
            try:
                self.telemetry = summarize(trace, peak_flops=armed.peak_flops)
            except Exception as summary_exc:  # noqa: BLE001 - the worker counts it when it tries again
                self.telemetry_error = summary_exc
        if self.telemetry is not None:
            armed.worker.submit(trace, skip=skip, telemetry=self.telemetry)
        else:
            armed.worker.submit(trace, skip=skip)


_state: Armed | None = None
_last_stats: SinkStats | None = None


def _start(
    out_dir: str | os.PathLike | None,
    *,
    every: int | None,
    sinks: Any,
    options: CaptureOptions,
    shard: ShardOptions,
    peak_flops: float | None = None,
    summarize_on_close: bool = False,
) -> Armed:
    """Check the arguments, build the session, make its shard folder; not yet live (no handlers)."""
    if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
        raise ValueError(
            f"out_dir must be a str or os.PathLike folder (or None), got {type(out_dir).__name__}"
        )
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"every must be a positive int (capture every N-th step) or None, got {every!r}")
    check_options(options)
    if not isinstance(shard, ShardOptions):
        raise ValueError(f"shard must be a tl_dist.store.ShardOptions, got {type(shard).__name__}")
    if peak_flops is not None and (
        isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float)) or not peak_flops > 0
    ):
        raise ValueError(
            f"peak_flops must be a positive number (FLOP/s of one device) or None, got {peak_flops!r}"
        )
    if not isinstance(summarize_on_close, bool):
        raise ValueError(f"summarize_on_close must be a bool, got {summarize_on_close!r}")
    sinks = check_sinks(sinks)
    root = (out_dir if location.is_url(out_dir) else Path(out_dir)) if out_dir is not None else None
    if isinstance(root, Path) and root.exists() and not root.is_dir():
        raise ValueError(f"out_dir {str(root)!r} exists and is not a folder")
    if isinstance(root, str):
        location.check_writable(root)
    if root is None and not sinks:
        raise ValueError("arm needs out_dir (write shards) or sinks (consumers of windows), got neither")
    state = Armed(
        root,
        options=options,
        every=every,
        sinks=sinks,
        shard=shard,
        peak_flops=peak_flops,
        summarize_on_close=summarize_on_close,
    )
    if isinstance(state.rank_dir, Path):
        state.rank_dir.mkdir(parents=True, exist_ok=True)
    return state


def _go_live(state: Armed) -> None:
    """Signal handlers (first live session), compile watching, the exit hook."""
    _signals.register(state)
    watch_compiles()  # before the job compiles: its compiled regions then carry FLOPs and their ATen ops
    atexit.unregister(_at_exit)  # once, and after the exit hooks registered before this session (LIFO)
    atexit.register(_at_exit)


def arm(
    out_dir: str | os.PathLike | None = None,
    *,
    every: int | None = None,
    sinks: Any = (),
    options: CaptureOptions = DEFAULT_OPTIONS,
    shard: ShardOptions = _DEFAULT_SHARD,
) -> Path | str | None:
    """Arm this process: ``tl.capture`` windows go to sinks -- the shard writer under ``out_dir``, and ``sinks``.

    Call once per process, after ``init_process_group`` (without a process group the process is rank 0 of a
    world of 1). Arming again replaces the previous arming (its queue is flushed first). Nothing is installed
    on the op path, so steps outside a window run at plain speed. SIGTERM and SIGUSR1 handlers (chained to the
    previous ones; SIGTERM still terminates) and an atexit hook write an open window's partial trace as an
    incomplete shard (with ``out_dir``) and flush the sinks.

    Args:
        out_dir: root folder of the run; this rank writes ``out_dir/rank{RRRRR}/step{SSSSSSSS}.h5``. A URL
            (``s3://bucket/run42``, any fsspec URL; needs ``tl_dist[scale]``): each shard is written to a
            local spool (``$TL_DIST_SPOOL``), then uploaded so that no reader sees a partial object; a failed
            upload keeps the spooled shard and the warning names it (docs/merge.md, "Object storage"). None:
            no shards (and no post-mortem shards), only ``sinks``.
        every: capture policy for integrations: ``tl.should_capture(step)`` is True when
            ``step % every == 0``; None captures every step.
        sinks: more consumers of finished windows (:class:`tl_dist.Sink`: ``on_window(trace, telemetry)`` and
            ``close()``), e.g. ``tl_dist.exporters.otel.OtelSink()``; they run on a background thread.
        options: what windows record by default (:class:`tl_dist.CaptureOptions`); ``tl.capture`` keywords
            override them per window.
        shard: chunking/compression of shards, see :class:`tl_dist.store.ShardOptions`.

    Returns:
        This rank's shard folder (a URL for a URL ``out_dir``; None without ``out_dir``).

    Example:
        >>> tl.arm("runs/job42", options=tl.CaptureOptions(save=tl.func("relu")), every=10)
        >>> with tl.capture(step=10):
        ...     model(x).sum().backward()
        >>> tl.flush()  # shards are written in the background; disarm() and exit flush too
        >>> tl.load("runs/job42/rank00000/step00000010.h5").step
        10
    """
    global _state
    state = _start(out_dir, every=every, sinks=sinks, options=options, shard=shard)
    if _state is not None:
        if (
            _state.out_dir is not None
            and state.out_dir is not None
            and location.key(_state.out_dir) != location.key(state.out_dir)
        ):
            warnings.warn(
                f"tl.arm({str(state.out_dir)!r}): re-arming; windows now go to {str(state.out_dir)!r} instead "
                f"of {str(_state.out_dir)!r}",
                UserWarning,
                stacklevel=2,
            )
        disarm()
    _go_live(state)
    _state = state
    _session.install(state)
    return state.rank_dir


def armed_session(
    out_dir: str | os.PathLike | None = None,
    *,
    sinks: Any = (),
    options: CaptureOptions = DEFAULT_OPTIONS,
    shard: ShardOptions = _DEFAULT_SHARD,
    peak_flops: float | None = None,
    summarize_on_close: bool = False,
) -> Armed:
    """An armed session of its own, beside the process's ``tl.arm`` (which it neither reads nor replaces).

    Only the session's own windows (:meth:`Armed.capture`) go to its sinks; plain ``tl.capture`` windows keep
    going to ``tl.arm``'s. Post-mortems cover its windows as ``tl.arm``'s (one set of signal handlers serves
    every session). Close it with :meth:`Armed.close`; interpreter exit closes it too.

    Args:
        out_dir, sinks, options, shard: as :func:`arm`.
        peak_flops: peak FLOP/s of one device, for the windows' MFU when ``summarize_on_close``.
        summarize_on_close: compute each window's :class:`tl_dist.telemetry.StepTelemetry` once, on the
            closing thread, as ``window.telemetry`` (the caller reads it) and hand that same one to the sinks.

    Example:
        >>> session = tl.armed_session("runs/fit", summarize_on_close=True)
        >>> with session.capture(step=0) as cap:
        ...     model(x).sum().backward()
        >>> cap.window.telemetry.flops
        >>> session.close()
    """
    state = _start(
        out_dir,
        every=None,
        sinks=sinks,
        options=options,
        shard=shard,
        peak_flops=peak_flops,
        summarize_on_close=summarize_on_close,
    )
    _go_live(state)
    return state


def disarm(timeout: float | None = FLUSH_TIMEOUT_S) -> bool:
    """Undo :func:`arm`: flush the sinks' queue (up to ``timeout`` seconds) and close the sinks, restore the
    previous signal handlers, drop the atexit hook. A no-op (True) when not armed.

    Returns:
        True when every window reached the sinks before the deadline.

    Example:
        >>> tl.arm("runs/x"); tl.disarm()
        True
    """
    global _state, _last_stats
    state = _state
    if state is None:
        return True
    _state = None
    _session.install(None)
    delivered = state.close(timeout)
    _last_stats = state.worker.stats
    return delivered


def armed() -> Armed | None:
    """The current armed state, or None."""
    return _state


def flush(timeout: float | None = FLUSH_TIMEOUT_S) -> bool:
    """Wait until the sinks have taken every closed window (shards written, exports handed over); False if
    ``timeout`` seconds passed first. True when not armed.

    Example:
        >>> with tl.capture(step=3): ...
        >>> tl.flush(); tl.load("runs/x/rank00000/step00000003.h5")
    """
    state = _state
    return True if state is None else state.flush(timeout)


def sink_stats() -> SinkStats:
    """Counters of the sink worker of the current arming (or of the last one after ``disarm``): windows
    submitted, delivered, dropped (queue full), pending, and errors per sink.

    Example:
        >>> tl.sink_stats().dropped
        0
    """
    state = _state
    if state is not None:
        return state.worker.stats
    return _last_stats if _last_stats is not None else SinkStats()


def should_capture(step: int) -> bool:
    """Whether an integration should open a capture window at ``step``: armed, and ``step % every == 0``
    (every step when ``every`` is None). False when not armed.

    Example:
        >>> tl.arm("runs/x", every=50)
        >>> [s for s in range(120) if tl.should_capture(s)]
        [0, 50, 100]
    """
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"step must be an int, got {step!r}")
    state = _state
    if state is None:
        return False
    return state.every is None or step % state.every == 0


def _at_exit() -> None:
    write_postmortem("atexit")
    for state in list(_signals.live):  # the windows already closed reach the sinks; then the sinks close
        state.worker.close(FLUSH_TIMEOUT_S)
