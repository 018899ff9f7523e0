"""Error types of tl_dist. Every error the library raises on purpose derives from :class:`TlDistError`."""

from __future__ import annotations


class TlDistError(Exception):
    """Base class of tl_dist's own errors."""


class SchemaError(TlDistError, ValueError):
    """A table does not match the schema this version of tl_dist reads and writes."""


class ShardFormatError(TlDistError):
    """A shard file is corrupt, truncated, not HDF5, or written by a newer schema. The message names the file."""


class MergeError(TlDistError):
    """Shards cannot be merged (missing or unreadable shard with ``strict=True``, mixed runs, ...)."""


class SelectionError(MergeError, ValueError):
    """A step or rank asked for (``steps=`` / ``ranks=`` of a merge, ``step=`` / ``rank=`` of a merged trace's
    views) that the run has no shard for; the message lists what it has. One type wherever that mistake is made,
    caught as a :class:`MergeError` or a ``ValueError`` alike."""


class ValidationError(TlDistError):
    """``Trace.validate(raise_on_mismatch=True)`` found ops whose replay does not reproduce the saved output."""


class MissingToolError(TlDistError):
    """An external program tl_dist calls (Graphviz's ``dot``) is not installed; the message says how to get it."""


class InterventionError(TlDistError, ValueError):
    """An edit (``tl.when``) cannot be applied: it changed the dtype, shape or device of an op's output, a patch
    source lacks the op, or autograd cannot differentiate it there. The message names the op."""


def missing_extra(module: str, extra: str, exc: ImportError) -> ImportError:
    """The ImportError an adapter raises when the install extra it needs is absent: names the adapter, what
    failed to import and the ``pip install`` line that fixes it.

    Example:
        >>> try:
        ...     import lightning.pytorch as pl
        ... except ImportError as exc:
        ...     raise missing_extra("tl_dist.integrations.lightning", "lightning", exc) from exc
    """
    return ImportError(
        f"{module} needs the tl_dist[{extra}] extra ({exc}); install it: pip install 'tl_dist[{extra}]'"
    )
