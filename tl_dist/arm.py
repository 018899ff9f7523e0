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
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from . import _session
from ._recorder import ACTIVE
from ._stacks import frame_stack, traceback_stack
from .compiled import watch_compiles
from .options import CaptureOptions, check_options
from .sinks import SinkStats, SinkWorker, check_sinks
from .store import ShardOptions, ShardSink, location

_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s)
_DEFAULT_SHARD = ShardOptions()
_DEFAULT_OPTIONS = CaptureOptions()
FLUSH_TIMEOUT_S = 30.0
"""How long ``disarm()`` and interpreter exit wait for the sinks to take the queued windows."""
SIGNAL_FLUSH_S = 10.0
"""How long a terminating signal (SIGTERM) waits for them before the process ends."""


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
    """The armed state of this process (``tl.arm``), the capture core's session: options, metadata, sinks."""

    def __init__(
        self,
        out_dir: Path | str | None,
        *,
        options: CaptureOptions,
        every: int | None,
        sinks: tuple[Any, ...],
        shard: ShardOptions,
    ) -> None:
        self.out_dir = out_dir
        self.options = options
        self.every = every
        self.shard = shard
        self.metadata = _run_metadata(out_dir)
        self.shard_sink = ShardSink(out_dir, shard=shard) if out_dir is not None else None
        all_sinks = ((self.shard_sink,) if self.shard_sink is not None else ()) + sinks
        self.worker = SinkWorker(all_sinks)
        rank_dir = f"rank{self.metadata['rank']:05d}"
        self.rank_dir = location.join(out_dir, rank_dir) if out_dir is not None else None
        self.windows = 0
        self.previous_handlers: dict[int, Any] = {}
        self.watcher: _SignalWatcher | None = None

    def open_window(self, step: int | None) -> Window:
        return Window(self, step)


class Window:
    """One armed capture window: on close, hands its trace to the sinks (post-mortems: the shard first)."""

    def __init__(self, armed: Armed, step: int | None) -> None:
        self.armed = armed
        self.number = armed.windows
        armed.windows += 1
        self.step = step if step is not None else self.number
        sink = armed.shard_sink
        self.path = sink.path_for({"rank": armed.metadata["rank"], "step": self.step}) if sink else None
        self.thread = threading.get_ident()  # the thread that runs the window: its stack goes in post-mortems

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
            signum = _raised_in_signal_handler(exc)
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
        armed.worker.submit(trace, skip=skip)


_state: Armed | None = None
_last_stats: SinkStats | None = None
_writing = threading.Lock()


def arm(
    out_dir: str | os.PathLike | None = None,
    *,
    every: int | None = None,
    sinks: Any = (),
    options: CaptureOptions = _DEFAULT_OPTIONS,
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
    if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
        raise ValueError(
            f"out_dir must be a str or os.PathLike folder (or None), got {type(out_dir).__name__}"
        )
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"every must be a positive int (capture every N-th step) or None, got {every!r}")
    check_options(options)
    if not isinstance(shard, ShardOptions):
        raise ValueError(f"shard must be a tl_dist.store.ShardOptions, got {type(shard).__name__}")
    sinks = check_sinks(sinks)
    root = (out_dir if location.is_url(out_dir) else Path(out_dir)) if out_dir is not None else None
    if isinstance(root, Path) and root.exists() and not root.is_dir():
        raise ValueError(f"out_dir {str(root)!r} exists and is not a folder")
    if isinstance(root, str):
        location.check_writable(root)
    if root is None and not sinks:
        raise ValueError("arm needs out_dir (write shards) or sinks (consumers of windows), got neither")
    if _state is not None:
        if (
            _state.out_dir is not None
            and root is not None
            and location.key(_state.out_dir) != location.key(root)
        ):
            warnings.warn(
                f"tl.arm({str(root)!r}): re-arming; windows now go to {str(root)!r} instead of "
                f"{str(_state.out_dir)!r}",
                UserWarning,
                stacklevel=2,
            )
        disarm()
    state = Armed(root, options=options, every=every, sinks=sinks, shard=shard)
    if isinstance(state.rank_dir, Path):
        state.rank_dir.mkdir(parents=True, exist_ok=True)
    _install_handlers(state)
    watch_compiles()  # before the job compiles: its compiled regions then carry FLOPs and their ATen ops
    atexit.register(_at_exit)
    _state = state
    _session.install(state)
    return state.rank_dir


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
    atexit.unregister(_at_exit)
    for signum, previous in state.previous_handlers.items():
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        # else: someone installed a handler after us; leave theirs in place (it may chain to ours, a no-op
        # once disarmed).
    if state.watcher is not None:
        state.watcher.close()
    delivered = state.worker.close(timeout)
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
    return True if state is None else state.worker.flush(timeout)


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


# -- post-mortem --------------------------------------------------------------------------------------------
def write_postmortem(reason: str, frame: Any = None) -> Path | None:
    """Write the open armed window's partial trace as an incomplete shard; None when no window is open.

    Called from the signal handlers and at exit; usable directly (e.g. from a watchdog) to leave evidence of
    a hang. The window's shard name is used, so a window that later closes normally overwrites it.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    state = _state
    if state is None or not ACTIVE or state.shard_sink is None:
        return None
    cap = ACTIVE[-1]
    window = cap.window
    if window is None:
        return None
    if frame is None or threading.get_ident() != window.thread:
        # From the watcher thread (or a handler on another thread): the window's thread's stack tells which
        # op it is stuck in.
        frame = sys._current_frames().get(window.thread)
    if not _writing.acquire(blocking=False):
        return None  # a second signal while writing: the first write wins
    try:
        # The dispatch mode may still be active (we interrupted the window): the writer's own tensor ops
        # must not be recorded into the trace being written.
        with _disable_current_modes():
            trace = cap.snapshot(frame)
            if trace is None:
                return None
            meta = window.metadata(complete=False, reason=reason)
            meta.update(frame_stack(frame))
            trace.metadata.update(meta)
            return state.shard_sink.write(trace, complete=False, timeout=SIGNAL_FLUSH_S)
    except Exception as exc:  # noqa: BLE001 - never raise out of a signal handler or atexit
        print(f"tl_dist: could not write post-mortem shard {window.path}: {exc}", file=sys.stderr)
        return None
    finally:
        _writing.release()


def _raised_in_signal_handler(exc: BaseException) -> int | None:
    """The signal whose handler chain (ours, then the one we chained to) raised ``exc``, if it did."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _on_signal.__code__:
            return tb.tb_frame.f_locals.get("signum")
        tb = tb.tb_next
    return None


def _on_signal(signum: int, frame: Any) -> None:
    state = _state
    name = signal.Signals(signum).name
    write_postmortem(name, frame)
    if state is not None and state.watcher is not None:
        state.watcher.handled(signum)
    previous = state.previous_handlers.get(signum) if state is not None else signal.SIG_DFL
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    elif signum == getattr(signal, "SIGUSR1", None):
        # SIGUSR1 is the "dump now" request: its default action (terminate) is not taken.
        return
    else:
        # Default disposition (or one installed outside Python): re-deliver with it, so SIGTERM terminates --
        # after the sinks took the windows already closed (bounded: the scheduler's kill grace is short).
        if state is not None:
            state.worker.flush(SIGNAL_FLUSH_S)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_handlers(state: Armed) -> None:
    if threading.current_thread() is not threading.main_thread():
        warnings.warn(
            "tl.arm() called outside the main thread: no SIGTERM/SIGUSR1 post-mortem handlers installed",
            stacklevel=3,
        )
        return
    for signum in _SIGNALS:
        state.previous_handlers[signum] = signal.getsignal(signum)
        signal.signal(signum, _on_signal)
    state.watcher = _SignalWatcher.start(state)


class _SignalWatcher:
    """Writes the post-mortem from a helper thread when the main thread cannot run Python handlers.

    Python runs signal handlers in the main thread between bytecodes; a rank blocked in a C++ call (a
    collective whose peer hung or died) would run ours only when that call returns -- possibly never. The C
    signal trampoline also writes the signal number to ``signal.set_wakeup_fd``'s pipe at once; this thread
    reads it and, if the main thread's handler has not run within ``GRACE_S``, writes the post-mortem itself,
    then gives SIGTERM its default action (terminate) when that was the previous disposition.
    """

    GRACE_S = 2.0
    WRITE_TIMEOUT_S = 60.0

    def __init__(self, state: Armed, read_fd: int, write_fd: int) -> None:
        self._state = state
        self._read_fd = read_fd
        self._write_fd = write_fd
        self._cond = threading.Condition()
        self._handled = dict.fromkeys(_SIGNALS, 0)
        self._thread = threading.Thread(target=self._run, name="tl_dist-signal-watcher", daemon=True)

    @classmethod
    def start(cls, state: Armed) -> _SignalWatcher | None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous != -1:
            # Someone (an asyncio loop) owns the wakeup fd: leave it to them, main-thread handlers only.
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return None
        watcher = cls(state, read_fd, write_fd)
        watcher._thread.start()
        return watcher

    def handled(self, signum: int) -> None:
        with self._cond:
            self._handled[signum] = self._handled.get(signum, 0) + 1
            self._cond.notify_all()

    def _run(self) -> None:
        received = dict.fromkeys(_SIGNALS, 0)
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            if not data:
                return  # closed by disarm
            for signum in data:
                if signum not in received:
                    continue
                received[signum] += 1
                with self._cond:
                    done = self._cond.wait_for(
                        lambda s=signum: self._handled[s] >= received[s], timeout=self.GRACE_S
                    )
                if done or _state is not self._state:
                    continue
                # In a helper thread with a deadline: on CUDA the snapshot synchronises the device, which a hung
                # NCCL kernel can block forever; SIGTERM must end the process all the same.
                writer = threading.Thread(
                    target=write_postmortem, args=(signal.Signals(signum).name,), daemon=True
                )
                writer.start()
                writer.join(timeout=self.WRITE_TIMEOUT_S)
                previous = self._state.previous_handlers.get(signum)
                if signum == signal.SIGTERM and previous in (signal.SIG_DFL, None):
                    self._state.worker.flush(SIGNAL_FLUSH_S)
                    _die_by_default(signum)

    def close(self) -> None:
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:
            pass  # not the main thread
        os.close(self._write_fd)  # the thread reads EOF and ends
        self._thread.join(timeout=5)
        os.close(self._read_fd)

    def forget_in_child(self) -> None:
        """After fork: the child has no watcher thread, and its signals must not wake the parent's."""
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:
            pass
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def _after_fork_in_child() -> None:
    # A forked worker (DataLoader) inherits the wakeup pipe: a SIGTERM sent to the worker at shutdown would
    # otherwise reach the parent's watcher and be taken for the parent's own.
    state = _state
    if state is not None and state.watcher is not None:
        state.watcher.forget_in_child()
        state.watcher = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _die_by_default(signum: int) -> None:
    """From a non-main thread: reset ``signum`` to its default action in C (Python's ``signal.signal`` works in
    the main thread only) and re-raise it, so the process ends as the signal would have ended it."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal(signum, None)  # SIG_DFL is 0
    os.kill(os.getpid(), signum)


def _at_exit() -> None:
    write_postmortem("atexit")
    state = _state
    if state is not None:  # the windows already closed reach the sinks; then the sinks close
        state.worker.close(FLUSH_TIMEOUT_S)
