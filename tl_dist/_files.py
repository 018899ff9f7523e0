"""Writing a file so that a reader never sees it half-written."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def replacing(path: str | os.PathLike, *, tmp: str | os.PathLike | None = None) -> Iterator[str]:
    """Yield a temporary name to write instead of ``path`` (``tmp``, else ``<path>.tmp-<pid>``); when the block
    ends normally it is renamed over ``path``, when it raises it is removed and the error goes on.

    Example:
        >>> with replacing("report.html") as tmp:
        ...     open(tmp, "w").write(text)
    """
    tmp = os.fspath(tmp) if tmp is not None else f"{os.fspath(path)}.tmp-{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
