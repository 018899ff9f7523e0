"""Where a thread was: its Python stack as plain strings, for post-mortem shards.

A post-mortem shard (signal, exception, exit, hang watcher) records the stack of the thread that ran the window,
so the merge can say where a rank was when it never reached a collective ("it was at train.py:42 in
time.sleep"). Only strings are kept -- no frames, no pickles -- so a shard stays plain data.

Example:
    >>> info = thread_stack(threading.main_thread().ident)
    >>> info["stack_at"], info["stack"][-1]
    ('/job/train.py:42 in time.sleep', '/job/train.py:42 in main -> time.sleep')
"""

from __future__ import annotations

import dis
import itertools
import linecache
import sys
import sysconfig
from types import CodeType, FrameType, TracebackType
from typing import Any

from ._common import OWN_DIR, TORCH_DIR

MAX_FRAMES = 64  # innermost frames kept; deeper (outer) ones are summarised in one line
MAX_CALL_CHARS = 80
_STDLIB = sysconfig.get_paths()["stdlib"] + "/"
_CALL_OPS = frozenset(i for i, name in enumerate(dis.opname) if name.startswith(("CALL", "PRECALL")))
_CACHE = dis.opmap.get("CACHE", -1)


def is_library(filename: str) -> bool:
    """Whether a frame's file is tl_dist's, torch's or the standard library's (not the user's code)."""
    return filename.startswith((OWN_DIR, TORCH_DIR, "<frozen")) or (
        filename.startswith(_STDLIB) and "-packages/" not in filename
    )


def _call_text(code: CodeType, lasti: int) -> str:
    """What the frame is calling at bytecode offset ``lasti`` (``time.sleep``), or '' when not at a call.

    The call's source span comes from the code object's positions table (PEP 657), as tracebacks' carets do.
    """
    raw = code.co_code
    if lasti < 0 or lasti >= len(raw):
        return ""
    op_at = lasti
    while op_at > 0 and raw[op_at] == _CACHE:  # a Python caller's f_lasti sits on its CALL's inline caches
        op_at -= 2
    if raw[op_at] not in _CALL_OPS:
        return ""
    try:
        position = next(itertools.islice(code.co_positions(), lasti // 2, None))
    except (StopIteration, AttributeError):  # AttributeError: Python < 3.11
        return ""
    line, end_line, col, end_col = position
    if line is None or end_line is None or col is None or end_col is None or end_line - line > 20:
        return ""
    lines = [linecache.getline(code.co_filename, n).encode() for n in range(line, end_line + 1)]
    if not lines or not lines[0]:
        return ""
    # Columns are UTF-8 byte offsets.
    lines[-1] = lines[-1][:end_col]
    lines[0] = lines[0][col:]
    text = " ".join(b.decode(errors="replace").strip() for b in lines)
    return _callee(text)


def _callee(text: str) -> str:
    """``dist.all_reduce(x, group=g)`` -> ``dist.all_reduce``: the call expression minus its argument list."""
    if not text.endswith(")"):
        return ""
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        ch = text[i]
        if ch == ")":
            depth += 1
        elif ch == "(":
            depth -= 1
            if depth == 0:
                callee = " ".join(text[:i].split())
                if len(callee) > MAX_CALL_CHARS:
                    callee = "..." + callee[-MAX_CALL_CHARS:]
                return callee
    return ""


def _describe(entries: list[tuple[CodeType, int, int]]) -> dict[str, Any]:
    """``{"stack": [...], "stack_at": str}`` from (code, lasti, lineno) entries, outermost first."""
    lines = []
    at = ""
    dropped = max(0, len(entries) - MAX_FRAMES)
    if dropped:
        lines.append(f"... {dropped} outer frames not kept")
    for n, (code, lasti, lineno) in enumerate(entries):
        call = _call_text(code, lasti)
        name = getattr(code, "co_qualname", code.co_name)
        if n >= dropped:
            lines.append(f"{code.co_filename}:{lineno} in {name}" + (f" -> {call}" if call else ""))
        if not is_library(code.co_filename):
            at = f"{code.co_filename}:{lineno} in {call or name}"
    return {"stack": lines, "stack_at": at}


def frame_stack(frame: FrameType | None) -> dict[str, Any]:
    """The stack ending at ``frame`` (innermost): ``{"stack": ["file:line in func -> call", ...] (outermost
    first), "stack_at": the innermost frame of user code (not tl_dist, torch or the standard library), named
    by the call it is making}``. Empty values when ``frame`` is None."""
    entries = []
    while frame is not None:
        entries.append((frame.f_code, frame.f_lasti, frame.f_lineno or 0))
        frame = frame.f_back
    return _describe(entries[::-1])


def traceback_stack(tb: TracebackType | None, *, until: CodeType | None = None) -> dict[str, Any]:
    """Like :func:`frame_stack`, for where an exception was raised: the frames outside the traceback's first
    one (its callers, still running), then the traceback's entries down to the raise -- or down to the frame
    before the first one running ``until`` (a signal handler: where the thread was when the signal came)."""
    if tb is None:
        return {"stack": [], "stack_at": ""}
    outer = []
    frame = tb.tb_frame.f_back
    while frame is not None:
        outer.append((frame.f_code, frame.f_lasti, frame.f_lineno or 0))
        frame = frame.f_back
    entries = outer[::-1]
    while tb is not None and tb.tb_frame.f_code is not until:
        entries.append((tb.tb_frame.f_code, tb.tb_lasti, tb.tb_lineno or 0))
        tb = tb.tb_next
    return _describe(entries)


def thread_stack(ident: int | None) -> dict[str, Any]:
    """The current stack of the thread ``ident`` (``threading.get_ident()`` of it), read with
    ``sys._current_frames()``; empty values when that thread is gone."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    return frame_stack(frame)
