"""SIGTERM/SIGUSR1 handlers and the signal watcher: a signal during an armed window leaves its post-mortem.

One set of handlers serves every live session (``tl.arm``'s and a callback's own ``tl.armed_session``): the
first session installs them (and holds the handlers they replaced, ``previous_handlers``), and the post-mortem
goes to whichever session's window is open (:func:`tl_dist._postmortem.write_postmortem`). When the holder
closes while other sessions live, the next one takes the handlers over.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import warnings
from typing import Any

from ._postmortem import SIGNAL_FLUSH_S, write_postmortem

SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s)

live: list[Any] = []
"""The sessions alive in this process (arming order): a terminating signal flushes each one's sinks."""
_holder: Any = None
"""The session whose ``previous_handlers`` our handlers replaced (None: ours are not installed)."""


def register(state: Any) -> None:
    """``state`` is live: its sinks are flushed on a terminating signal; the first live session installs the
    handlers (from the main thread only, else a warning says there are no post-mortem handlers)."""
    live.append(state)
    if _holder is None:
        _install(state)


def unregister(state: Any) -> None:
    """``state`` closed: restore the previous handlers if it held them, or hand them to the next live session."""
    global _holder
    if any(s is state for s in live):
        live.remove(state)
    if _holder is not state:
        return
    _holder = None
    for signum, previous in state.previous_handlers.items():
        if signal.getsignal(signum) is on_signal:
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        # else: someone installed a handler after us; leave theirs in place (it may chain to ours, a no-op
        # once disarmed).
    if state.watcher is not None:
        state.watcher.close()
        state.watcher = None
    if live and threading.current_thread() is threading.main_thread():
        _install(live[0])


def _install(state: Any) -> None:
    global _holder
    if threading.current_thread() is not threading.main_thread():
        warnings.warn(
            "tl.arm() called outside the main thread: no SIGTERM/SIGUSR1 post-mortem handlers installed",
            stacklevel=4,
        )
        return
    for signum in SIGNALS:
        state.previous_handlers[signum] = signal.getsignal(signum)
        signal.signal(signum, on_signal)
    state.watcher = _SignalWatcher.start(state)
    _holder = state


def flush_live(timeout: float) -> None:
    """Give every live session's sinks up to ``timeout`` seconds to take the windows already closed."""
    for state in list(live):
        state.worker.flush(timeout)


def raised_in_signal_handler(exc: BaseException) -> int | None:
    """The signal whose handler chain (ours, then the one we chained to) raised ``exc``, if it did."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is on_signal.__code__:
            return tb.tb_frame.f_locals.get("signum")
        tb = tb.tb_next
    return None


def on_signal(signum: int, frame: Any) -> None:
    """Our handler of SIGTERM and SIGUSR1: write the post-mortem, then chain to the handler we replaced."""
    state = _holder
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
        flush_live(SIGNAL_FLUSH_S)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


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

    def __init__(self, state: Any, read_fd: int, write_fd: int) -> None:
        self._state = state
        self._read_fd = read_fd
        self._write_fd = write_fd
        self._cond = threading.Condition()
        self._handled = dict.fromkeys(SIGNALS, 0)
        self._thread = threading.Thread(target=self._run, name="tl_dist-signal-watcher", daemon=True)

    @classmethod
    def start(cls, state: Any) -> _SignalWatcher | None:
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
        received = dict.fromkeys(SIGNALS, 0)
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
                if done or _holder is not self._state:
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
                    flush_live(SIGNAL_FLUSH_S)
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
    state = _holder
    if state is not None and state.watcher is not None:
        state.watcher.forget_in_child()
        state.watcher = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _die_by_default(signum: int) -> None:
    """From a non-main thread: reset ``signum`` to its default action in C (Python's ``signal.signal`` works in
    the main thread only) and re-raise it, so the process ends as the signal would have ended it."""
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal(signum, None)  # SIG_DFL is 0
    os.kill(os.getpid(), signum)
