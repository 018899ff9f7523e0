"""Post-mortem writing: the open armed window's partial trace, written now as an incomplete shard.

The signal handlers, the signal watcher and the exit hook call :func:`write_postmortem`; a watchdog may too. The
window found open is asked for its snapshot (``Capture.snapshot``) and written by its own session's shard
writer, whichever session (``tl.arm``'s or a callback's own) opened it.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import _disable_current_modes

from ._recorder import ACTIVE
from ._stacks import frame_stack

SIGNAL_FLUSH_S = 10.0
"""How long a terminating signal (SIGTERM) waits for the sinks (and a post-mortem upload) before the process ends."""

writing = threading.Lock()
"""Held while a post-mortem shard is written; a window closing with an error takes it too, so the shard that
ends up under the window's name is the final one."""


def write_postmortem(reason: str, frame: Any = None) -> Path | None:
    """Write the open armed window's partial trace as an incomplete shard; None when no window is open.

    Called from the signal handlers and at exit; usable directly (e.g. from a watchdog) to leave evidence of
    a hang. The window's shard name is used, so a window that later closes normally overwrites it.

    Example:
        >>> from tl_dist.arm import write_postmortem
        >>> tl.arm("runs/x")
        >>> with tl.capture(step=7):
        ...     write_postmortem("watchdog")  # runs/x/rank00000/step00000007.h5, marked incomplete
    """
    if not ACTIVE:
        return None
    cap = ACTIVE[-1]
    window = cap.window
    if window is None or window.armed.shard_sink is None:
        return None
    if frame is None or threading.get_ident() != window.thread:
        # From the watcher thread (or a handler on another thread): the window's thread's stack tells which
        # op it is stuck in.
        frame = sys._current_frames().get(window.thread)
    if not writing.acquire(blocking=False):
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
            return window.armed.shard_sink.write(trace, complete=False, timeout=SIGNAL_FLUSH_S)
    except Exception as exc:  # noqa: BLE001 - never raise out of a signal handler or atexit
        print(f"tl_dist: could not write post-mortem shard {window.path}: {exc}", file=sys.stderr)
        return None
    finally:
        writing.release()
