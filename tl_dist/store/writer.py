"""Writing a trace as one HDF5 shard (``write_shard``). Layout: ``docs/shard-format.md``; reading: :mod:`.hdf5`.

Nothing here pickles: every value is a number, a string, JSON text or a numeric array, so loading a shard runs
no code.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np
import torch
from torch.utils._pytree import tree_flatten, treespec_dumps

from .._common import is_dense, local_tensor, user_stacklevel
from .._files import replacing
from ..schema import (
    COLLECTIVE_FIELDS,
    COMPILED_OP_FIELDS,
    MODULE_CALL_FIELDS,
    OP_FIELDS,
    SCHEMA_VERSION,
    STAT_FIELDS,
    Field,
)
from .codecs import STR_DTYPE, ShardOptions, StringTable, _tag, write_table

if TYPE_CHECKING:
    from ..trace import Trace

ROOT_ENCODING = "tl_dist.shard"
_DEFAULT_OPTIONS = ShardOptions()

# Which module/output-of rows have an entry: an internal side table, not a schema of its own.
_OUTPUT_OF_FIELDS = (
    Field("op", "int", "Op whose output is a module call's output."),
    Field("modules", "strs", "Addresses of the module calls returning that output."),
)
_TREE_FIELDS = (
    Field("row", "int", "Module-call row (-1: the trace's output)."),
    Field("spec", "str", "torch.utils._pytree treespec as JSON."),
    Field("leaves", "str", "JSON list: null for op outputs, a value, or {'tensor': name} in /tree_tensors."),
)

# torch dtypes numpy cannot hold (bfloat16, float8) are stored bit for bit as ints of the same width.
_NUMPY_NATIVE = frozenset(
    {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"}
    | {"complex64", "complex128", "uint16", "uint32", "uint64"}
)
_RAW_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def writable(t: torch.Tensor) -> bool:
    """Whether a shard can hold ``t``'s values: one dense block of them (not sparse or nested), not on the meta
    device (no values)."""
    return is_dense(t) and not t.is_meta


def _tensor_array(t: torch.Tensor) -> tuple[np.ndarray, str]:
    t = local_tensor(t).detach()  # a rank's shard holds a DTensor's local part
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    dtype = str(t.dtype).replace("torch.", "")
    try:
        return t.numpy(), dtype
    except TypeError:
        return t.view(_RAW_VIEW[t.element_size()]).numpy(), dtype


def _write_tensor(group: h5py.Group, name: str, t: torch.Tensor, options: ShardOptions) -> None:
    arr, dtype = _tensor_array(t)
    ds = group.create_dataset(name, data=arr, **options.tensor_kwargs(arr))
    # Attribute writes cost about as much as a small dataset: only where the numpy dtype does not say it.
    if dtype not in _NUMPY_NATIVE:
        ds.attrs["torch-dtype"] = dtype


def _write_tensors(
    root: h5py.File, name: str, tensors: Mapping[int, list], labels: list[str], options: ShardOptions
) -> list[str]:
    """``tensors`` maps op index -> list of outputs (None where not kept). A one-output op is one dataset named
    by the op's label; a multi-output op a group of datasets named by output position. Returns the tensors
    left out (not :func:`writable`: they load as None), which the caller names in one warning."""
    group = root.create_group(name)
    _tag(group, "tensors")
    left_out: list[str] = []
    for index, outs in tensors.items():
        label = labels[index]
        if len(outs) == 1 and outs[0] is not None:
            if writable(outs[0]):
                _write_tensor(group, label, outs[0], options)  # the op is found by its (unique) label
            else:
                left_out.append(label)
            continue
        # No attributes: the op is found by its label and its output count is len(out_shapes[op]).
        sub = group.create_group(label)
        for pos, t in enumerate(outs):
            if t is None:
                continue
            if writable(t):
                _write_tensor(sub, str(pos), t, options)
            else:
                left_out.append(f"{label}[{pos}]")
    return left_out


def _warn_left_out(path: Path, name: str, left_out: list[str]) -> None:
    if left_out:
        warnings.warn(
            f"{path}: {len(left_out)} {name} tensor(s) not written, sparse, nested or meta (a shard holds dense "
            f"values only): {', '.join(left_out[:5])}{' ...' if len(left_out) > 5 else ''}; they load as None",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )


_LEAF_SPEC = treespec_dumps(tree_flatten(0)[1])


def _tree_rows(trace: Trace, root: h5py.File, options: ShardOptions) -> dict[str, list]:
    """Module-call output structures (and the trace's output) as JSON rows; non-op tensor leaves as datasets."""
    rows: dict[str, list] = {"row": [], "spec": [], "leaves": []}
    extra: h5py.Group | None = None
    trees = list(trace.out_trees.items())
    if trace.output is not None:
        leaves, spec = tree_flatten(trace.output)
        for i, (op, pos) in trace.output_refs.items():  # an op's output: found through /saved, not copied
            leaves[i] = {"op": op, "pos": pos}
        trees.append((-1, (spec, leaves)))
    for row, (spec, leaves) in trees:
        if spec.is_leaf() and len(leaves) == 1 and leaves[0] is None:
            # Most module calls return one op's tensor: skip the JSON encoders for them.
            rows["row"].append(row)
            rows["spec"].append(_LEAF_SPEC)
            rows["leaves"].append("[null]")
            continue
        try:
            spec_json = treespec_dumps(spec)
        except Exception:  # noqa: BLE001 - custom pytree nodes without a serialized name: structure not stored
            continue
        encoded = []
        for i, leaf in enumerate(leaves):
            if leaf is None or isinstance(leaf, (bool, int, float, str, dict)):
                encoded.append(leaf)
            elif isinstance(leaf, torch.Tensor) and writable(leaf):
                if extra is None:
                    extra = root.create_group("tree_tensors")
                    _tag(extra, "tensors")
                name = f"{row}_{i}"
                _write_tensor(extra, name, leaf, options)
                encoded.append({"tensor": name})
            else:
                encoded.append(None)  # NB: other leaf types (custom objects) are not stored
        rows["row"].append(row)
        rows["spec"].append(spec_json)
        rows["leaves"].append(json.dumps(encoded))
    return rows


def _json_attr(value: Any) -> str:
    return json.dumps(value, default=str, sort_keys=True)


def write_shard(
    trace: Trace,
    path: str | os.PathLike,
    *,
    complete: bool = True,
    metadata: Mapping[str, Any] | None = None,
    options: ShardOptions = _DEFAULT_OPTIONS,
) -> Path:
    """Write ``trace`` as one HDF5 shard at ``path``, atomically (temporary name in the same folder, then
    ``os.replace``), so a killed process never leaves a half-written file under ``path``.

    Args:
        trace: the trace to store (columns, module and collective tables, saved tensors, gradients).
        path: the shard's file name; its folder must exist.
        complete: False for a post-mortem shard (the window did not finish).
        metadata: run metadata stored as root attributes (rank, world size, host, ...), beside
            ``trace.metadata``.
        options: chunking and compression, see :class:`ShardOptions`.

    Returns:
        The shard's path.

    Example:
        >>> write_shard(cap.trace, "step00000001.h5")
        >>> tl.load("step00000001.h5").to_pandas()
    """
    if not isinstance(options, ShardOptions):
        raise ValueError(f"options must be a ShardOptions, got {type(options).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a str or os.PathLike file name, got {path!r} ({type(path).__name__})")
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"path: folder {path.parent} does not exist (writing shard {path.name})")
    meta = dict(trace.metadata)
    meta.update(metadata or {})
    meta["complete"] = bool(complete)
    # A post-mortem's stack (tl_dist._stacks) is a dataset of strings, one frame a line, not JSON in an attribute.
    stack = meta.pop("stack", None)
    # pid and thread: a post-mortem written from tl_dist's signal watcher never shares a temporary name.
    hidden = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with replacing(path, tmp=hidden) as tmp:
        # v110 object headers: a third cheaper to create than the default's, and HDF5 >= 1.10 tools
        # (h5dump included) read them.
        with h5py.File(tmp, "w", libver=("v110", "v110")) as root:
            _tag(root, ROOT_ENCODING)
            root.attrs["schema_version"] = SCHEMA_VERSION
            root.attrs["complete"] = bool(complete)
            root.attrs["metadata"] = _json_attr(meta)
            # Run facts also as plain attributes so `h5dump -A` shows them without JSON.
            for key, value in meta.items():
                if key in root.attrs:
                    continue
                # Exact base types: h5py has no conversion for subclasses such as torch's TorchVersion.
                for base in (bool, int, float, str):
                    if isinstance(value, base):
                        root.attrs[key] = base(value)
                        break
            root.attrs["failed_op"] = _json_attr(trace.failed_op)
            shared = (StringTable(), "/strings")
            write_table(root, "ops", OP_FIELDS, trace.columns, options, strings=shared)
            write_table(root, "modules", MODULE_CALL_FIELDS, trace.module_table, options, strings=shared)
            write_table(
                root, "collectives", COLLECTIVE_FIELDS, trace.collective_table, options, strings=shared
            )
            output_of = {
                "op": list(trace.output_of),
                "modules": [tuple(v) for v in trace.output_of.values()],
            }
            write_table(root, "output_of", _OUTPUT_OF_FIELDS, output_of, options, strings=shared)
            write_table(
                root, "trees", _TREE_FIELDS, _tree_rows(trace, root, options), options, strings=shared
            )
            labels = trace.columns["label"]
            left_out = {"saved": _write_tensors(root, "saved", trace.saved, labels, options)}
            if trace.grads:
                left_out["grads"] = _write_tensors(root, "grads", trace.grads, labels, options)
            write_table(root, "stats", STAT_FIELDS, trace.stats_table, options, strings=shared)
            if trace.compiled_table["region"]:
                write_table(
                    root, "compiled", COMPILED_OP_FIELDS, trace.compiled_table, options, strings=shared
                )
            shared[0].write(root, "strings", options)
            if stack:
                root.create_dataset(
                    "stack", data=np.array([str(s) for s in stack], dtype=object), dtype=STR_DTYPE
                )
    for name, labels_out in left_out.items():
        _warn_left_out(path, name, labels_out)
    return path
