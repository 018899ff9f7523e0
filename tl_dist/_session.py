"""The process's armed session, as the capture core sees it: where ``tl.capture`` windows get their defaults and
hand their trace when they close. ``tl.arm`` installs one; the core never imports ``arm`` (arrows point one way:
arm -> capture -> this module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .options import CaptureOptions


class Window(Protocol):
    """One armed capture window; ``Capture.__exit__`` calls ``close`` with the capture and the user's error."""

    def close(self, capture: Any, exc: BaseException | None) -> None: ...


class Session(Protocol):
    """What ``tl.arm`` installs: the default options of its windows and how to open one."""

    options: CaptureOptions

    def open_window(self, step: int | None) -> Window: ...


_current: Session | None = None


def current() -> Session | None:
    """The armed session, or None when the process is not armed."""
    return _current


def install(session: Session | None) -> None:
    """Make ``session`` the armed session (None: not armed)."""
    global _current
    _current = session
