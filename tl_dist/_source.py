"""Where in the user's code an op or module call comes from: the file:line ``source`` field.

A leaf below the recorder (it imports only ``_common``), so the hot path and the module tracker share it. With the
extension built, the same walk runs in C (``_csrc/source.c``, sharing this module's caches); this one is the
reference, and the path with ``TL_DIST_PURE_PYTHON=1``.
"""

from __future__ import annotations

import sys
import sysconfig
import weakref
from typing import Any

import torch

from ._common import OWN_DIR as _OWN_DIR
from ._common import TORCH_DIR as _TORCH_DIR

_MODULE_MACHINERY = torch.nn.modules.module.__file__
# Frames that are never "the user's code": torch and tl_dist themselves, the standard library (contextlib and
# functools wrappers around torch calls), and typing_extensions' @deprecated wrapper torch puts on some APIs.
_INTERNAL_DIRS = (_TORCH_DIR, _OWN_DIR, "<frozen")
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + "/"
_TYPING_EXTENSIONS = getattr(sys.modules.get("typing_extensions"), "__file__", None)


_USER, _INTERNAL, _MODULE_CALL = 0, 1, 2  # the kinds of code (the compiled walk, _csrc/source.c, reads them)
# Shared by all captures and by the compiled walk (code objects outlive them): code object -> its kind, and
# (code, bytecode offset) -> "file:line".
CODE_KINDS: dict[Any, int] = {}
SOURCE_NAMES: dict[tuple[Any, int], str] = {}


def code_kind(code: Any) -> int:
    """The kind of a code object: the user's (0), torch's, tl_dist's or the standard library's (1), or
    ``nn.Module``'s call machinery (2); cached in ``CODE_KINDS`` for every later frame of that code.

    Example:
        >>> code_kind(code_kind.__code__)
        1
    """
    filename = code.co_filename
    if filename == _MODULE_MACHINERY:
        kind = _MODULE_CALL
    elif (
        filename.startswith(_INTERNAL_DIRS)
        or filename == _TYPING_EXTENSIONS
        or (filename.startswith(_STDLIB_DIR) and "-packages/" not in filename)
    ):
        kind = _INTERNAL
    else:
        kind = _USER
    CODE_KINDS[code] = kind
    return kind


class SourceLocator:
    """Finds file:line of the user code behind the current op or module call.

    Walks outward from the caller, skipping torch's and tl_dist's own frames. It stops at the first frame of
    ``nn.Module``'s call machinery: everything outside that frame is the enclosing module call, whose call site
    was located once when the call started. So the walk per op is only as deep as the code between the op and
    its innermost module (a few frames), however deeply modules nest.
    """

    def __init__(self, modules: Any) -> None:  # the capture's _modules.ModuleTracker (its current_source)
        self._modules = weakref.proxy(modules)  # the recorder owns both: no reference cycle
        self._kinds = CODE_KINDS
        self._names = SOURCE_NAMES

    def _walk(self, frame: Any, enclosing: str) -> str:
        kinds = self._kinds
        while frame is not None:
            code = frame.f_code
            kind = kinds.get(code)
            if kind is None:
                kind = code_kind(code)
            if kind == _USER:
                key = (code, frame.f_lasti)
                name = self._names.get(key)
                if name is None:
                    name = self._names[key] = f"{code.co_filename}:{frame.f_lineno}"
                return name
            if kind == _MODULE_CALL:
                return enclosing
            frame = frame.f_back
        return ""

    def __call__(self) -> str:
        """Source of the op being dispatched (called from Recorder.on_op, or from the compiled per-op path,
        which has no Python frame of its own: the walk starts at the caller and skips tl_dist's frames)."""
        try:
            frame = sys._getframe(1)
        except ValueError:  # no Python frame under the op at all (an autograd engine thread)
            return ""
        return self._walk(frame, self._modules.current_source)

    def caller(self, depth: int) -> str:
        """Source of the user code ``depth`` frames above the caller (an optimizer step hook: its step call)."""
        return self._walk(sys._getframe(depth + 1), self._modules.current_source)

    def call_site(self) -> str:
        """Source of the module call starting now (called from the module pre-hook, before it is pushed)."""
        frame = sys._getframe(2)
        kinds = self._kinds
        while frame is not None:  # step out of this call's own machinery frames
            kind = kinds.get(frame.f_code)
            if (code_kind(frame.f_code) if kind is None else kind) != _MODULE_CALL:
                break
            frame = frame.f_back
        return self._walk(frame, self._modules.current_source)
