"""Where shards live: a local path or any fsspec URL (``s3://bucket/run42``, ``gs://...``, ``file://...``).

A URL is never taken for a path: ``"s3://bucket/run"`` names an object store, not a folder ``s3:``. The rest of
tl_dist calls this module at a few narrow points: :func:`is_url`, :func:`find` (shard names under a run),
:func:`exists` / :func:`is_dir`, :func:`reading` (a local file to read, downloaded when remote) and :func:`upload` (a spooled
shard put under its final name atomically). Remote access needs the ``tl_dist[scale]`` extra (fsspec, and
s3fs for ``s3://``).

Example:
    >>> from tl_dist.store import location
    >>> location.is_url("s3://bucket/run42"), location.is_url("runs/job42")
    (True, False)
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ShardFormatError, TlDistError

_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
# Object stores publish an object only once its upload is complete (S3 multipart uploads too), so a put under the
# final name is already atomic; anything else is put under a hidden temporary name and renamed.
_ATOMIC_PUT = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})
INSTALL_HINT = "pip install 'tl_dist[scale]'"
SPOOL_ENV = "TL_DIST_SPOOL"
"""Environment variable: the local folder where shards bound for a URL are written before upload (default:
``<tempdir>/tl_dist-spool``)."""


class StorageError(TlDistError):
    """A shard could not be put in, or read from, its store; the message says where a local copy is kept."""


def is_url(target: Any) -> bool:
    """Whether ``target`` is an fsspec URL (``scheme://...``) rather than a local path.

    Example:
        >>> is_url("gs://b/run"), is_url(Path("runs/x"))
        (True, False)
    """
    return isinstance(target, str) and bool(_URL_RE.match(target))


def _filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path inside it."""
    try:
        import fsspec
    except ImportError:
        raise TlDistError(
            f"{url}: reading and writing URLs needs fsspec (and s3fs for s3://): {INSTALL_HINT}"
        ) from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as exc:  # the scheme's implementation (s3fs, gcsfs, ...) is not installed
        raise TlDistError(f"{url}: {exc} ({INSTALL_HINT} brings s3fs for s3://)") from None
    except ValueError as exc:
        raise ValueError(f"{url}: not a URL fsspec knows: {exc}") from None


def join(root: str | os.PathLike, *parts: str) -> str | Path:
    """``root/part/...``: a URL stays a string, a path a :class:`Path`."""
    if is_url(root):
        return "/".join([str(root).rstrip("/"), *parts])
    return Path(root).joinpath(*parts)


def name(target: str | os.PathLike) -> str:
    """The last component of a path or URL (``s3://b/run42`` -> ``run42``)."""
    return str(target).rstrip("/").rsplit("/", 1)[-1] if is_url(target) else Path(target).name


def key(target: str | os.PathLike) -> str:
    """One spelling per place, to compare two run folders."""
    return str(target).rstrip("/") if is_url(target) else str(Path(target).resolve())


def exists(target: str | os.PathLike) -> bool:
    """Whether the file or folder (path or URL) exists now: a URL is looked up afresh, not in the listings
    fsspec cached (s3fs answers from a cached listing of the folder, taken before another process wrote the
    object, that it is missing: a poller waiting for another rank's shard would wait forever)."""
    if not is_url(target):
        return Path(target).exists()
    fs, path = _filesystem(str(target))
    fs.invalidate_cache(path)
    return bool(fs.exists(path))


def is_dir(target: str | os.PathLike) -> bool:
    """Whether ``target`` is a folder (a URL: a prefix with objects under it)."""
    if not is_url(target):
        return Path(target).is_dir()
    fs, path = _filesystem(str(target))
    return bool(fs.isdir(path))


def find(root: str, pattern: str) -> list[str]:
    """URLs of the objects under the URL ``root`` matching the glob ``pattern`` (e.g. ``rank*/step*.h5``)."""
    fs, path = _filesystem(root)
    protocol = root.split("://", 1)[0]
    found = fs.glob(f"{path.rstrip('/')}/{pattern}")
    return sorted(f"{protocol}://{p.lstrip('/')}" if protocol != "file" else f"file://{p}" for p in found)


# -- reading ---------------------------------------------------------------------------------------------------
_fetched: Path | None = None
_fetch_lock = threading.Lock()


def _fetch_dir() -> Path:
    """This process's folder of downloaded shards, removed at exit."""
    global _fetched
    with _fetch_lock:
        if _fetched is None:
            _fetched = Path(tempfile.mkdtemp(prefix="tl_dist-fetch-"))
            atexit.register(shutil.rmtree, _fetched, True)
        return _fetched


def _download(url: str, into: Path) -> Path:
    fs, path = _filesystem(url)
    local = into / hashlib.sha1(url.encode()).hexdigest()[:16] / name(url)
    local.parent.mkdir(parents=True, exist_ok=True)
    try:
        fs.get_file(path, str(local))
    except FileNotFoundError:
        raise ShardFormatError(f"{url}: no such shard file") from None
    except Exception as exc:  # noqa: BLE001 - any transport failure: name the URL
        raise StorageError(f"{url}: cannot download: {type(exc).__name__}: {exc}") from exc
    return local


@contextlib.contextmanager
def reading(target: str | os.PathLike, *, keep: bool = False) -> Iterator[Path]:
    """A local file holding ``target`` for the ``with`` block: the path itself, or a download of the URL (removed
    afterwards; with ``keep``, left until the process exits, for a trace whose saved tensors are read from it on
    first access). A :class:`ShardFormatError` raised inside that names the downloaded copy names the URL.

    Example:
        >>> with reading("s3://b/run/rank00000/step00000001.h5") as path:
        ...     h5py.File(path)
    """
    if not is_url(target):
        yield Path(target)
        return
    url = str(target)
    local = _download(url, _fetch_dir() if keep else Path(tempfile.mkdtemp(prefix="tl_dist-read-")))
    try:
        yield local
    except ShardFormatError as exc:
        raise ShardFormatError(str(exc).replace(str(local), url)) from exc
    finally:
        if not keep:
            shutil.rmtree(local.parent.parent, ignore_errors=True)


# -- writing ---------------------------------------------------------------------------------------------------
def spool_dir(url: str) -> Path:
    """The local folder where shards bound for the run URL ``url`` are written before upload (``$TL_DIST_SPOOL``
    or ``<tempdir>/tl_dist-spool``, then one folder per URL)."""
    base = Path(os.environ.get(SPOOL_ENV) or Path(tempfile.gettempdir()) / "tl_dist-spool")
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", url.rstrip("/"))[-80:]
    return base / f"{readable}-{hashlib.sha1(url.encode()).hexdigest()[:8]}"


def check_writable(url: str) -> None:
    """Fail at ``tl.arm`` time, not at the first shard, when URLs cannot be written at all (no fsspec, no
    implementation for the scheme)."""
    _filesystem(url)


def upload(local: Path, url: str, *, timeout: float | None = None) -> str:
    """Put the spooled shard ``local`` at ``url`` so that no reader ever sees part of it under that name, then
    remove ``local``. Within ``timeout`` seconds (None: as long as the store takes).

    Raises:
        StorageError: the store is unreachable, refused the object, or took longer than ``timeout``; the
            message names the local copy, which is kept.
    """
    fs, path = _filesystem(url)
    outcome: dict[str, BaseException | None] = {}

    def put() -> None:
        try:
            protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
            parent = path.rsplit("/", 1)[0]
            if protocol in _ATOMIC_PUT:  # no folders to make (and no bucket created by mistake)
                fs.put_file(str(local), path)
            else:
                fs.makedirs(parent, exist_ok=True)
                hidden = f"{parent}/.{path.rsplit('/', 1)[-1]}.tmp-{os.getpid()}-{threading.get_ident()}"
                fs.put_file(str(local), hidden)
                fs.mv(hidden, path)
            local.unlink()
            outcome["error"] = None
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            outcome["error"] = exc

    if timeout is None:
        put()
    else:
        worker = threading.Thread(target=put, name="tl_dist-upload", daemon=True)
        worker.start()
        worker.join(timeout)
    if "error" not in outcome:
        raise StorageError(
            f"could not upload shard to {url} within {timeout:g} s; it is kept at {local} (the upload goes on "
            "in the background and removes it if it succeeds)"
        )
    exc = outcome["error"]
    if exc is not None:
        raise StorageError(
            f"could not upload shard to {url}: {type(exc).__name__}: {exc}; it is kept at {local}"
        ) from exc
    return url
