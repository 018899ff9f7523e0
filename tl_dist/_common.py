"""Names and row helpers shared by the capture's parts (recorder, training state, collectives, module tracker).

A leaf module below all of them (it imports only the schema), so any part can use it without an import cycle.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .schema import OP_FIELDS, STAT_FIELDS, field_names

# Attribute set on every op output during a capture: (capture token, op index, output position).
TAG = "_tl_src"
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
OWN_DIR = os.path.dirname(__file__) + os.sep
# Position of each schema field in a recorder row (rows are tuples in ``schema.OP_FIELDS`` order).
FIELD_INDEX = {name: i for i, name in enumerate(field_names(OP_FIELDS))}

# Dtypes whose values statistics and non-finite checks look at; the stats table's value columns after op, of, at.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
STAT_NAMES = field_names(STAT_FIELDS)[3:]

# On POSIX, os.environ keeps its values in this bytes dict (os.environ._data is posix.environ) and writes
# through it (os.environ[k] = v, monkeypatch.setenv): one probe of it reads what os.environ.get would, without
# os.environ's three Python calls (~20 us with the cold caches a forward leaves, and a window reads two names).
_ENVIRON_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
if not isinstance(_ENVIRON_BYTES, dict):
    _ENVIRON_BYTES = None


def environ_get(name: str, default: str = "") -> str:
    """``os.environ.get(name, default)`` for an ASCII ``name``, read with one dict probe where the platform allows.

    Example:
        >>> environ_get("TL_DIST_PURE_PYTHON")
        ''
    """
    if _ENVIRON_BYTES is None:
        return os.environ.get(name, default)
    value = _ENVIRON_BYTES.get(name.encode())
    return default if value is None else os.fsdecode(value)


DTYPE_NAMES: dict[torch.dtype, str] = {}
DEVICE_NAMES: dict[torch.device, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (memoised: called for every op)."""
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        name = DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def device_name(device: torch.device) -> str:
    """``device(type='cuda', index=0)`` -> ``"cuda:0"`` (memoised)."""
    name = DEVICE_NAMES.get(device)
    if name is None:
        name = DEVICE_NAMES[device] = str(device)
    return name


class RowView:
    """Attribute access to a row under construction, for selectors evaluated while capturing."""

    __slots__ = ("_row", "output_of")

    def __init__(self, row: tuple, output_of: tuple[str, ...] = ()) -> None:
        self._row = row
        self.output_of = output_of

    def __getattr__(self, name: str) -> Any:
        try:
            return self._row[FIELD_INDEX[name]]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def shape(self) -> tuple[int, ...] | None:
        shapes = self.out_shapes
        return tuple(shapes[0]) if shapes else None


def arg_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an op's arguments in slot order, those in list arguments (``cat``'s, ``_foreach_*``'s)
    included: the order the recorder numbers an op's inputs in, and replay refills them in."""
    tensors: list[torch.Tensor] = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            tensors.append(a)
        elif type(a) is list or type(a) is tuple:
            tensors += [b for b in a if isinstance(b, torch.Tensor)]
    return tensors


def flat_outputs(out: Any) -> list[torch.Tensor]:
    """The tensors an op returned, in the order their positions are numbered (``saved[op][pos]``, tags):
    a tuple/list is walked one level deep (``split`` returns a list; ``_foreach`` ops lists in tuples)."""
    if isinstance(out, torch.Tensor):
        return [out]
    flat: list[torch.Tensor] = []
    if type(out) is tuple or type(out) is list:
        for o in out:
            if isinstance(o, torch.Tensor):
                flat.append(o)
            elif type(o) is list or type(o) is tuple:
                flat += [p for p in o if isinstance(p, torch.Tensor)]
    return flat


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of the memory ``t`` views (its storage's address); None when it has none to write: an empty
    storage, or a wrapper subclass without storage (FSDP2's DTensor parameters, AsyncCollectiveTensor), whose
    data lives in inner tensors that its own dispatch handles below the mode; or a layout without one storage
    (sparse: values and indices are tensors of their own)."""
    try:
        storage = t.untyped_storage()
    except NotImplementedError:  # "Cannot access storage of SparseTensorImpl"
        return None
    return storage_address(storage)


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    """``tuple(t.shape)`` as plain ints, -1 for a ragged dimension of a nested tensor (which has no size: a
    strided nested tensor raises for it, a jagged one's is a symbolic "nested int").

    Example:
        >>> shape_of(torch.nested.nested_tensor([torch.ones(3, 4), torch.ones(5, 4)], layout=torch.jagged))
        (2, -1, 4)
    """
    try:
        sizes = tuple(t.shape)
    except RuntimeError:  # "NestedTensorImpl doesn't support sizes"
        sizes = []
        for dim in range(t.dim()):
            try:
                sizes.append(t.size(dim))
            except RuntimeError:  # "Given dimension 1 is irregular and does not have a size"
                sizes.append(-1)
        return tuple(sizes)
    if all(type(s) is int for s in sizes):
        return sizes
    return tuple([s if type(s) is int else _size_int(s) for s in sizes])


def _size_int(size: Any) -> int:
    try:
        return int(size)
    except (AttributeError, RuntimeError, TypeError):  # a nested int (the ragged dimension): no one value
        return -1


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s values are one strided block (what a dataset holds and a flat reduction reads); sparse
    and nested tensors are not.

    Example:
        >>> is_dense(torch.ones(2, 3)), is_dense(torch.ones(2, 3).to_sparse())
        (True, False)
    """
    return t.layout is torch.strided and not t.is_nested


def storage_address(storage: torch.UntypedStorage) -> int | None:
    """:func:`storage_key` of a tensor whose storage is at hand."""
    try:
        return storage.data_ptr() if storage.nbytes() else None
    except RuntimeError:
        return None


def byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, end) bytes of its storage that ``t`` can touch (a superset for strided views)."""
    lo = t.storage_offset()
    itemsize = t.element_size()
    if t.is_contiguous():
        n = t.numel()
        return (lo * itemsize, (lo + n) * itemsize) if n else (0, 0)
    hi = lo + 1
    try:
        strides = t.stride()
    except RuntimeError:  # a nested tensor: no strides; any byte of its storage
        return 0, t.untyped_storage().nbytes()
    for size, stride in zip(t.shape, strides):
        if size == 0:
            return 0, 0
        hi += (size - 1) * abs(stride)
    return lo * itemsize, hi * itemsize


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the calling function that names the first line outside
    tl_dist (the user's ``with tl.capture(...)``, however many of tl_dist's frames lie between)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(OWN_DIR):
        level += 1
        frame = frame.f_back
    return level


def has_its_bytes(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage (a wrapper subclass's: its :func:`local_tensor`'s) still holds the bytes ``t``
    reads. FSDP frees an unsharded parameter after use by resizing its storage to 0 bytes, which leaves every
    view of it saved earlier pointing at no memory (reading one crashes the process). True for tensors without
    one storage (sparse, nested)."""
    t = local_tensor(t)
    try:
        nbytes = t.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):
        return True
    return nbytes >= byte_extent(t)[1]


_Parameter = torch.nn.Parameter


def _is_wrapper(t: torch.Tensor) -> bool:
    # The type checks first: plain tensors and parameters, nearly every tensor, skip torch's protocol test.
    return type(t) is not torch.Tensor and type(t) is not _Parameter and is_traceable_wrapper_subclass(t)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds a wrapper subclass's values in this process: a DTensor's local shard, an
    AsyncCollectiveTensor's buffer (the first inner tensor of ``__tensor_flatten__``, recursively); ``t`` itself
    for a plain tensor. tl_dist's own reductions and copies run with Python dispatch off, where a wrapper (no
    storage of its own) cannot be read, and must not run the subclass's dispatch (a DTensor reduction would
    issue collectives).

    Example:
        >>> local_tensor(dtensor).shape  # this rank's shard
    """
    while _is_wrapper(t):
        attrs, _ = t.__tensor_flatten__()
        t = getattr(t, attrs[0])
    return t


def map_local(t: torch.Tensor, fn: Any) -> torch.Tensor:
    """``fn`` (a copy, a detach) applied to the plain tensor(s) inside ``t``, rebuilt as ``t``'s subclass
    without running its dispatch (``__tensor_unflatten__``); ``fn(t)`` for a plain tensor. Runs with Python
    dispatch off, as :func:`local_tensor`.

    Example:
        >>> map_local(dtensor, torch.Tensor.clone)  # a DTensor over a copy of the local shard
    """
    if not _is_wrapper(t):
        return fn(t)
    attrs, ctx = t.__tensor_flatten__()
    inner = {a: map_local(v, fn) if isinstance(v := getattr(t, a), torch.Tensor) else v for a in attrs}
    return type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())


def clone_strided(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with ``t``'s strides. ``clone()`` keeps the strides only of a dense tensor: a chunk of a
    wider tensor (stride (64, 1) for shape (4, 16)) comes back contiguous, and a kernel run on it takes another
    vectorisation path than on the original (LSTMCell's in-place ``sigmoid_`` of a gate chunk differs in the
    last bit). Tensors whose elements overlap (an ``expand``) cannot be copied into such a layout: clone()."""
    if t.is_contiguous() or any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape)):
        return t.clone()
    copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    try:
        return copy.copy_(t)
    except RuntimeError:  # other overlapping layouts (as_strided): a dense copy
        return t.clone()


# Default tolerances of validate() for floating-point outputs (integer and bool outputs must match exactly).
VALIDATE_ATOL = 1e-6
VALIDATE_RTOL = 1e-5


def attach(cls: type, methods: type) -> None:
    """Set every attribute ``methods`` defines (functions, properties; not dunders) on ``cls``.

    Example:
        >>> attach(Trace, _TraceMethods)   # tl_dist.api: trace.to_pandas() runs _TraceMethods.to_pandas
    """
    for name, value in vars(methods).items():
        if not (name.startswith("__") and name.endswith("__")):
            setattr(cls, name, value)
