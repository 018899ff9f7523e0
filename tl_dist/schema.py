"""The one list of per-op fields, and the vocabulary every layer shares. The field lists drive the in-memory trace
table, ``to_pandas``, the HDF5 shard layout and the field reference in ``docs/``; nothing else spells the field
list out again. The vocabulary (bottom of this module) is defined here once: :data:`PHASES`, :data:`OUTSIDE`
and :data:`ROOT`, :func:`module_name` (how every view names an op's module), :func:`bus_factor` (nccl-tests'
bus-bandwidth factors) and :data:`DEVICE_PEAK_FLOPS`.

Kinds (how a value is held in memory -> how the store encodes it):

- ``int``    Python int                      -> int64 dataset
- ``float``  Python float                    -> float64 dataset
- ``bool``   Python bool                     -> bool dataset
- ``str``    Python str                      -> categorical (codes + categories)
- ``ints``   tuple of int (a shape, parents) -> ragged (values + offsets)
- ``strs``   tuple of str                    -> ragged strings
- ``shapes`` tuple of tuple of int           -> ragged of ragged
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Adding a field needs no new version: readers fill columns a file predates with the kind's "unknown" value
# (see store.codecs.read_table). The version changes only when an existing field changes meaning or encoding.
SCHEMA_VERSION = 1

KINDS = ("int", "float", "bool", "str", "ints", "strs", "shapes")
# Each kind's empty value: what a column holds for a row that recorded nothing there (not the "unknown" fill).
EMPTY_VALUE = {"int": 0, "float": 0.0, "bool": False, "str": "", "ints": (), "strs": (), "shapes": ()}


@dataclass(frozen=True)
class Field:
    """One column of a table: its name, its kind (see module doc) and what it means."""

    name: str
    kind: str
    doc: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Field {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")


OP_FIELDS: tuple[Field, ...] = (
    Field("index", "int", "Position of the op in execution order, from 0."),
    Field("label", "str", "Unique name `{func}_{n}`; n counts calls of that func from 1 (`relu_2`)."),
    Field("func", "str", "Short op name: `relu`, `relu_`, `convolution`; normalised names for collectives."),
    Field(
        "aten", "str", "Full operator overload name, e.g. `aten.relu_.default`, `c10d.allreduce_.default`."
    ),
    Field(
        "kind",
        "str",
        "`compute`, `view`, `factory` (no tensor inputs), `collective`, `other` (no tensor out) or `compiled` "
        "(one run of a torch.compile'd region: its ATen ops are rows of `compiled_table`).",
    ),
    Field(
        "phase",
        "str",
        "`forward`, `backward` (run by the autograd engine, and the loss seed), `optimizer` (inside step() or "
        "zero_grad()) or `recompute` (torch.utils.checkpoint recomputing forward ops inside backward).",
    ),
    Field(
        "fwd_op",
        "int",
        "For a backward op: index of the forward op whose autograd node it runs (its grad_fn); -1 otherwise.",
    ),
    Field(
        "module",
        "str",
        "Address of the innermost module whose forward issued the op; for a backward op, that of the forward op "
        "it differentiates (an AccumulateGrad op: the module owning the parameter); '' outside any module.",
    ),
    Field(
        "module_stack",
        "strs",
        "Addresses of the enclosing module calls, outermost first (a backward op: its forward op's); empty "
        "outside every module.",
    ),
    Field(
        "module_call",
        "int",
        "Row in the trace's module-call table of the innermost call; -1 outside modules and for backward and "
        "recompute ops (they run outside the call; `module` says whose they are).",
    ),
    Field(
        "out_shapes",
        "shapes",
        "Shape of each tensor the op returned; an in-place write into a view (`y[:, 0] = 0`) also lists the "
        "view's base, whose value it changed, after the returned tensors.",
    ),
    Field("dtype", "str", "dtype of the first tensor output ('' when none)."),
    Field("device", "str", "Device of the first tensor output ('' when none)."),
    Field("out_bytes", "int", "Bytes of all tensor outputs together."),
    Field("in_shapes", "shapes", "Shape of each tensor argument, in argument order."),
    Field("parents", "ints", "Indices of the ops whose outputs this op read (data dependencies)."),
    Field("inplace", "bool", "The op writes into one of its arguments (`relu_`, `add_`, `copy_`, out=)."),
    Field(
        "flops",
        "int",
        "Floating-point operations from torch.utils.flop_counter's formulas (plus CPU attention); 0 where none.",
    ),
    Field("start_ns", "int", "Start time, nanoseconds since the Unix epoch (host clock)."),
    Field(
        "duration_ns",
        "int",
        "Duration in ns: host clock on CPU, CUDA events when the op ran on a GPU (host clock for views, which "
        "launch no kernel).",
    ),
    Field("source", "str", "file:line of the user code that issued the op ('' when not recorded)."),
    Field("params", "strs", "Names of the parameters and buffers the op read."),
)

MODULE_CALL_FIELDS: tuple[Field, ...] = (
    Field("address", "str", "Module address as in named_modules() ('' for the root)."),
    Field("type", "str", "Class name of the module."),
    Field(
        "call", "int", "Which call of this module this is, from 0 (a module called twice has calls 0 and 1)."
    ),
    Field("parent", "int", "Row of the enclosing module call; -1 at top level."),
    Field("depth", "int", "Nesting depth; the outermost call has depth 0."),
    Field("first_op", "int", "Index of the first op inside the call (== end_op when it ran no op)."),
    Field("end_op", "int", "One past the index of the last op inside the call."),
    Field(
        "out_ops", "ints", "For each leaf of the call's output: the op that produced it (-1: not an op's)."
    ),
    Field("out_pos", "ints", "For each leaf of the call's output: which of that op's outputs it is."),
    Field("source", "str", "file:line of the user code that called the module ('' when not recorded)."),
)

# One row per collective op (the op itself is also a row of the op table, at `op`). Filled by
# tl_dist.collectives; stored in shards beside the op table; merge matches rows across ranks on
# (group_ranks, seq).
COLLECTIVE_FIELDS: tuple[Field, ...] = (
    Field("op", "int", "Index of the collective's row in the op table."),
    Field(
        "func", "str", "Normalised collective: all_reduce, all_gather, reduce_scatter, broadcast, send, ..."
    ),
    Field("group_ranks", "ints", "Global ranks of the process group's members, in group-rank order."),
    Field("group_name", "str", "The process group's name (c10d group name)."),
    Field("group_desc", "str", "The process group's description ('default_pg', user-given desc, ...)."),
    Field(
        "seq",
        "int",
        "The group's c10d sequence number for this collective (same on every member); -1 if unknown.",
    ),
    Field("reduce_op", "str", "Reduce operation (sum, avg, max, ...) or '' where none applies."),
    Field("root", "int", "Global rank of the root (broadcast, reduce, gather, scatter); -1 where none."),
    Field("peer", "int", "Global rank of the peer of a send/recv; -1 otherwise."),
    Field("in_numel", "int", "Elements in the input tensors together."),
    Field("out_numel", "int", "Elements in the output tensors together."),
    Field("dtype", "str", "dtype of the data tensors."),
    Field("bytes", "int", "Bytes this rank contributes (input tensors)."),
    Field("is_async", "bool", "Issued with async_op=True (or a functional collective awaited later)."),
    Field("issue_ns", "int", "When the collective was issued, ns since the Unix epoch."),
    Field("complete_ns", "int", "When it was observed complete, ns since the Unix epoch; -1 if never."),
    Field("state", "str", "`issued` (never seen complete: in flight at a crash or hang) or `completed`."),
    Field("bucket", "int", "DDP gradient bucket index for DDP's bucket all-reduce; -1 otherwise."),
    Field("backend", "str", "The group's backend: `gloo`, `nccl`, ... ('' if unknown)."),
)

# One row per ATen op inside each compiled region a window ran (the region itself is one op-table row of kind
# `compiled`, at `region`). Filled by tl_dist.compiled from the graph Inductor compiled.
COMPILED_OP_FIELDS: tuple[Field, ...] = (
    Field("region", "int", "Index of the region's row in the op table."),
    Field("pos", "int", "Position of the op in the region's ATen graph (after Inductor's post-grad passes)."),
    Field("func", "str", "Short op name, as in the op table (`addmm`, `relu`)."),
    Field("aten", "str", "Full operator overload name."),
    Field(
        "module",
        "str",
        "Address of the innermost module the op came from (the graph's `nn_module_stack`; a backward op: its "
        "forward op's), below the compiled module's own address.",
    ),
    Field("module_stack", "strs", "Addresses of the enclosing modules, outermost first."),
    Field(
        "flops", "int", "FLOPs from the same formulas as eager ops, on the shapes the graph was compiled for."
    ),
    Field("out_shapes", "shapes", "Shape of each tensor the op returns, as compiled."),
)

# One row per (op, value) whose statistics a capture with ``stats=`` recorded: the op's first floating-point
# output (`of` == "out") or the gradient of the loss w.r.t. it (`of` == "grad"). Filled by tl_dist.training.
STAT_FIELDS: tuple[Field, ...] = (
    Field("op", "int", "Index of the op in the op table."),
    Field("of", "str", "`out` (the op's output) or `grad` (gradient of the loss w.r.t. that output)."),
    Field("at", "int", "Ops recorded before the value existed: orders values by when they were computed."),
    Field("mean", "float", "Mean of the elements."),
    Field("std", "float", "Population standard deviation (correction 0)."),
    Field("min", "float", "Smallest element (NaN if any element is NaN)."),
    Field("max", "float", "Largest element (NaN if any element is NaN)."),
    Field("norm", "float", "L2 norm of the flattened tensor."),
    Field("zero_frac", "float", "Fraction of elements equal to zero."),
    Field("nan", "int", "Number of NaN elements."),
    Field("inf", "int", "Number of +-Inf elements."),
)


_NAMES: dict[int, tuple[tuple[Field, ...], tuple[str, ...]]] = {}  # id(fields) -> (fields, their names)


def field_names(fields: tuple[Field, ...]) -> tuple[str, ...]:
    """Names of ``fields`` in order (worked out once per field tuple: every window asks for its tables')."""
    entry = _NAMES.get(id(fields))
    if entry is None or entry[0] is not fields:  # the tuple is kept in the entry: its id is not reused
        entry = _NAMES[id(fields)] = (fields, tuple(f.name for f in fields))
    return entry[1]


def empty_columns(fields: tuple[Field, ...]) -> dict[str, list]:
    """A fresh dict of empty lists, one per field, in schema order."""
    return {f.name: [] for f in fields}


class EmptyUntilSet:
    """A table attribute (of ``tl_dist.Trace``) that reads as an empty table of ``fields`` until one is set (None
    also leaves it empty): most windows have no collectives, statistics or compiled regions, and making their
    three empty tables at every window's close costs ~30 us with the cold caches a forward leaves.

    Example:
        >>> class Holder:
        ...     stats_table = EmptyUntilSet(STAT_FIELDS)
        >>> Holder().stats_table["op"]
        []
    """

    def __init__(self, fields: tuple) -> None:
        self.fields = fields

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, trace: Any, owner: type | None = None) -> Any:
        if trace is None:
            return self
        table = trace.__dict__.get(self.slot)
        if table is None:
            table = trace.__dict__[self.slot] = empty_columns(self.fields)
        return table

    def __set__(self, trace: Any, table: dict[str, list] | None) -> None:
        trace.__dict__[self.slot] = table


# -- vocabulary: the words every layer uses, defined once --------------------------------------------------
PHASES = ("forward", "backward", "optimizer", "recompute")
"""The phases of a training step an op can belong to (the ``phase`` field), in step order."""

P2P_ROLES = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv", "recv_any_source": "recv"}
"""Point-to-point collective funcs (the ``func`` field) and their side of a transfer."""

ROOT = "<root>"
"""The module name of the root module (address ``""``)."""

OUTSIDE = "(outside modules)"
"""The module name of ops that ran outside every module call (a loss computed at top level, the optimizer)."""


def module_address(op: Any) -> str | None:
    """The owner module of an op, a failed-op record or a row with ``module``/``module_stack`` -- the one rule
    every view uses (:func:`module_name` names it, the drawings place a collective in its call): its address,
    ``""`` for the root module, None outside every module.

    Example:
        >>> module_address({"module": "module.2", "module_stack": ("", "module", "module.2")})
        'module.2'
    """
    get = op.get if isinstance(op, dict) else lambda k, d=None: getattr(op, k, d)
    if not get("module_stack", None):
        return get("module", "") or None
    return get("module", "") or ""


def is_profiler_marker(aten: str) -> bool:
    """Whether an op (by its ``aten`` overload name) only marks a ``torch.profiler.record_function`` range:
    ``profiler._record_function_enter_new`` and ``_exit``, which DDP's forward, ``Optimizer.step`` and user
    code put around real work. They compute nothing, so views neither draw them nor name one as where a rank
    last was.

    Example:
        >>> is_profiler_marker("profiler._record_function_exit._RecordFunction"), is_profiler_marker("aten.mm.default")
        (True, False)
    """
    return aten.startswith("profiler.")


def module_name(op: Any) -> str:
    """How views name an op's module (:func:`module_address`): its address, ``<root>`` for the root module,
    :data:`OUTSIDE` outside every module."""
    address = module_address(op)
    return OUTSIDE if address is None else address or ROOT


# Dense peak FLOP/s by (device name fragment, dtype) from the vendors' data sheets (no sparsity). The first
# fragment contained in torch.cuda.get_device_name() wins, so more specific names come first. float32 matmuls
# use TF32 tensor cores when torch.backends.cuda.matmul.allow_tf32 is set ("tf32").
DEVICE_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989e12, "float16": 989e12, "tf32": 494e12, "float32": 67e12},
    "H100 PCIe": {"bfloat16": 756e12, "float16": 756e12, "tf32": 378e12, "float32": 51e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "tf32": 494e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12, "float32": 19.5e12},
    "L40S": {"bfloat16": 362e12, "float16": 362e12, "tf32": 183e12, "float32": 91.6e12},
    "L4": {"bfloat16": 121e12, "float16": 121e12, "tf32": 60e12, "float32": 30.3e12},
    "A10": {"bfloat16": 125e12, "float16": 125e12, "tf32": 62.5e12, "float32": 31.2e12},
    "V100": {"float16": 125e12, "float32": 15.7e12},
    "T4": {"float16": 65e12, "float32": 8.1e12},
}

_BUS_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n}
for _kind in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
    _BUS_FACTORS[_kind] = lambda n: (n - 1) / n


def bus_factor(kind: str, group_size: int) -> float:
    """nccl-tests' bus-bandwidth factor of collective ``kind`` on ``group_size`` ranks (1 for broadcast, p2p)."""
    if group_size < 1:
        return 1.0
    factor = _BUS_FACTORS.get(kind)
    return factor(group_size) if factor is not None else 1.0


def reference_markdown() -> str:
    """The field reference of ``docs/fields.md``, generated from the schema lists (``python -m tl_dist.schema``)."""
    tables = {name: value for name, value in globals().items() if name.endswith("_FIELDS")}
    lines = [
        "# Field reference",
        "",
        f"Generated from `tl_dist/schema.py` (schema version {SCHEMA_VERSION}) by `python -m tl_dist.schema`;",
        "do not edit by hand. Kinds are described in that module's docstring.",
    ]
    for name, fields in tables.items():
        lines += ["", f"## `{name}`", "", "| field | kind | meaning |", "|---|---|---|"]
        lines += [f"| `{f.name}` | {f.kind} | {f.doc.replace('|', '/')} |" for f in fields]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
