"""``tl.arm()``: per-rank capture windows written to rank-local HDF5 shards, with post-mortem shards.

Arming installs nothing on the op path: it fixes where shards go (``out_dir/rank{RRRRR}/``), what a window
records, the run metadata, and installs SIGTERM/SIGUSR1 handlers plus an atexit hook that write whatever an
open window has captured as a shard marked incomplete. ``with tl.capture(step=k):`` then writes
``step{k:08d}.h5`` when the window closes (the window counter names it when no step is given).

Example:
    >>> torch.distributed.init_process_group("gloo")
    >>> tl.arm("runs/job42", every=100)
    >>> for step in range(1000):
    ...     if tl.should_capture(step):
    ...         with tl.capture(step=step):
    ...             train_step()
    ...     else:
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

from ._stacks import frame_stack, traceback_stack
from .selectors import check_selection
from .store.options import ShardOptions

_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s)
_DEFAULT_SHARD = ShardOptions()


def _run_metadata() -> dict[str, Any]:
    """Rank, world size and backend from the default process group; rank 0 of world 1 without one."""
    rank, world, backend = 0, 1, ""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        rank, world, backend = dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    return {
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
        "world_size": world,
        "backend": backend,
        "host": socket.gethostname(),
        # Same host and boot: one clock. The merge then takes offset 0 instead of estimating one.
        "boot_id": _boot_id(),
        "pid": os.getpid(),
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
    """The armed state of this process (``tl.arm``): output folder, capture defaults, run metadata."""

    def __init__(
        self,
        out_dir: Path,
        *,
        save: Any,
        save_grads: Any,
        stats: Any,
        every: int | None,
        shard: ShardOptions,
    ) -> None:
        self.out_dir = out_dir
        self.save = save
        self.save_grads = save_grads
        self.stats = stats
        self.every = every
        self.shard = shard
        self.metadata = _run_metadata()
        self.rank_dir = out_dir / f"rank{self.metadata['rank']:05d}"
        self.windows = 0
        self.previous_handlers: dict[int, Any] = {}
        self.watcher: _SignalWatcher | None = None

    def shard_path(self, number: int) -> Path:
        return self.rank_dir / f"step{number:08d}.h5"


class Window:
    """One armed capture window: knows its shard name and writes the shard when the capture closes."""

    def __init__(self, armed: Armed, step: int | None) -> None:
        self.armed = armed
        self.number = armed.windows
        armed.windows += 1
        self.step = step if step is not None else self.number
        self.path = armed.shard_path(self.step)
        self.thread = threading.get_ident()  # the thread that runs the window: its stack goes in post-mortems

    def metadata(self, *, complete: bool, reason: str) -> dict[str, Any]:
        meta = dict(self.armed.metadata)
        meta.update(step=self.step, window=self.number, complete=complete, end_reason=reason)
        return meta

    def close(self, capture: Any, exc: BaseException | None) -> None:
        """Called by ``Capture.__exit__``: an exception makes the shard incomplete (post-mortem)."""
        from .store.hdf5 import write_shard

        complete = exc is None
        reason = "closed" if complete else "exception"
        meta = self.metadata(complete=complete, reason=reason)
        if exc is not None:
            meta["error"] = f"{type(exc).__name__}: {exc}"
            meta.update(traceback_stack(exc.__traceback__, until=_on_signal.__code__))
            signum = _raised_in_signal_handler(exc)
            if signum is not None:  # the user's handler, chained after ours, raised: the signal ended it
                meta["end_reason"] = signal.Signals(signum).name
        trace = capture.trace
        trace.metadata.update(meta)
        try:
            # Serialised with post-mortem writes (the signal watcher may be writing this window's snapshot):
            # the shard that ends up under the name is this final one.
            with _writing:
                write_shard(trace, self.path, complete=complete, options=self.armed.shard)
        except Exception as write_exc:
            if exc is None:
                raise
            # The user's exception is the one to see; a failed post-mortem write must not replace it.
            warnings.warn(
                f"tl_dist: could not write post-mortem shard {self.path}: {write_exc}", stacklevel=2
            )
        else:
            trace.metadata["shard"] = str(self.path)


_state: Armed | None = None
_writing = threading.Lock()


def arm(
    out_dir: str | os.PathLike,
    *,
    save: Any = None,
    save_grads: Any = None,
    stats: Any = None,
    every: int | None = None,
    shard: ShardOptions = _DEFAULT_SHARD,
) -> Path:
    """Arm this process: ``tl.capture`` windows write rank-local shards under ``out_dir``.

    Call once per process, after ``init_process_group`` (without a process group the process is rank 0 of a
    world of 1). Arming again replaces the previous arming. Nothing is installed on the op path, so steps
    outside a window run at plain speed. SIGTERM and SIGUSR1 handlers (chained to the previous ones; SIGTERM
    still terminates) and an atexit hook write an open window's partial trace as an incomplete shard.

    Args:
        out_dir: root folder of the run; this rank writes ``out_dir/rank{RRRRR}/step{SSSSSSSS}.h5``.
        save: default op outputs to keep in armed windows: True, None (metadata only) or a selector.
        save_grads: default per-op gradients to keep (True, None or a selector), forwarded to the capture.
        stats: default per-op statistics (True, None or a selector), forwarded to the capture.
        every: capture policy for integrations: ``tl.should_capture(step)`` is True when
            ``step % every == 0``; None captures every step.
        shard: chunking/compression of shards, see :class:`tl_dist.store.ShardOptions`.

    Returns:
        This rank's shard folder.

    Example:
        >>> tl.arm("runs/job42", save=tl.func("relu"), every=10)
        >>> with tl.capture(step=10):
        ...     model(x).sum().backward()
        >>> tl.load("runs/job42/rank00000/step00000010.h5").step
        10
    """
    global _state
    if not isinstance(out_dir, (str, os.PathLike)):
        raise ValueError(f"out_dir must be a str or os.PathLike folder, got {type(out_dir).__name__}")
    save = check_selection(save, "save")
    save_grads = check_selection(save_grads, "save_grads")
    stats = check_selection(stats, "stats")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"every must be a positive int (capture every N-th step) or None, got {every!r}")
    if not isinstance(shard, ShardOptions):
        raise ValueError(f"shard must be a tl_dist.store.ShardOptions, got {type(shard).__name__}")
    root = Path(out_dir)
    if root.exists() and not root.is_dir():
        raise ValueError(f"out_dir {str(root)!r} exists and is not a folder")
    if _state is not None:
        disarm()
    state = Armed(root, save=save, save_grads=save_grads, stats=stats, every=every, shard=shard)
    state.rank_dir.mkdir(parents=True, exist_ok=True)
    _install_handlers(state)
    atexit.register(_at_exit)
    _state = state
    return state.rank_dir


def disarm() -> None:
    """Undo :func:`arm`: restore the previous signal handlers and drop the atexit hook. A no-op when not armed.

    Example:
        >>> tl.arm("runs/x"); tl.disarm()
    """
    global _state
    state = _state
    if state is None:
        return
    _state = None
    atexit.unregister(_at_exit)
    for signum, previous in state.previous_handlers.items():
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        # else: someone installed a handler after us; leave theirs in place (it may chain to ours, a no-op
        # once disarmed).
    if state.watcher is not None:
        state.watcher.close()


def armed() -> Armed | None:
    """The current armed state, or None."""
    return _state


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


def open_window(step: int | None) -> Window | None:
    """For ``tl.capture(step=...)``: a window writing a shard when armed, else None."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be a non-negative int or None, got {step!r}")
    state = _state
    return None if state is None else Window(state, step)


# -- post-mortem --------------------------------------------------------------------------------------------
def _in_flight(frame: Any) -> dict[str, Any] | None:
    """The op a signal interrupted: the Recorder.on_op frame on the interrupted stack, if any."""
    from ._recorder import Recorder

    code = Recorder.on_op.__code__
    while frame is not None:
        if frame.f_code is code:
            local = frame.f_locals
            info = local.get("info")
            recorder = local.get("self")
            if info is None or recorder is None:
                return None
            return {
                "index": recorder.n_ops,
                "func": info.func,
                "aten": info.aten,
                "module": recorder.modules.current_address,
                "source": "",
                "error": "in flight when the post-mortem was written",
            }
        frame = frame.f_back
    return None


def write_postmortem(reason: str, frame: Any = None) -> Path | None:
    """Write the open armed window's partial trace as an incomplete shard; None when no window is open.

    Called from the signal handlers and at exit; usable directly (e.g. from a watchdog) to leave evidence of
    a hang. The window's shard name is used, so a window that later closes normally overwrites it.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    from .capture import _active
    from .store.hdf5 import write_shard

    state = _state
    if state is None or not _active:
        return None
    cap = _active[-1]
    window = getattr(cap, "_window", None)
    recorder = getattr(cap, "_recorder", None)
    if window is None or recorder is None:
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
            trace = cap._build_trace(output=None)
            for _, row in getattr(recorder.modules, "_stack", ()):
                trace.module_table["end_op"][row] = recorder.n_ops
            if trace.failed_op is None:
                trace.failed_op = _in_flight(frame)
            meta = window.metadata(complete=False, reason=reason)
            meta.update(frame_stack(frame))
            trace.metadata.update(meta)
            return write_shard(trace, window.path, complete=False, options=state.shard)
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
        # Default disposition (or one installed outside Python): re-deliver with it, so SIGTERM terminates.
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
