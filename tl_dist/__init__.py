"""tl_dist: record every op of a PyTorch job -- ATen ops, collectives, module boundaries -- as one graph.

Example:
    >>> import tl_dist as tl
    >>> trace = tl.trace(model, x, save=tl.func("relu") | tl.in_module("classifier"))
    >>> trace["relu_2"].out, trace.to_pandas(), trace.draw("graph.svg")
"""

from . import (
    api,  # noqa: F401 (attaches the Trace and MergedTrace methods that reach views, store, report)
    telemetry,
)
from .arm import Armed, arm, armed_session, disarm, flush, should_capture, sink_stats
from .capture import Capture, capture, trace
from .causal import downstream, upstream
from .compare import compare
from .compiled import watch_compiles
from .edits import (
    Edit,
    add,
    add_noise,
    clamp,
    mask,
    mean_ablate,
    patch,
    replace,
    resample,
    scale,
    when,
    zero_ablate,
)
from .errors import (
    InterventionError,
    MergeError,
    MissingToolError,
    SchemaError,
    SelectionError,
    ShardFormatError,
    TlDistError,
    ValidationError,
)
from .merge import MergedTrace, load_merged, merge_ranks
from .options import CaptureOptions
from .replay import Fork
from .schema import MODULE_CALL_FIELDS, OP_FIELDS, SCHEMA_VERSION, Field
from .selectors import Selector, func, in_module, label, module, where
from .sinks import Sink, SinkStats
from .store import ShardOptions, load, shard_path
from .trace import Collective, ModuleCall, Op, Trace

__all__ = [
    "Armed",
    "Capture",
    "CaptureOptions",
    "Collective",
    "Edit",
    "Field",
    "Fork",
    "InterventionError",
    "MODULE_CALL_FIELDS",
    "MergeError",
    "MergedTrace",
    "MissingToolError",
    "ModuleCall",
    "OP_FIELDS",
    "Op",
    "SCHEMA_VERSION",
    "SchemaError",
    "SelectionError",
    "Selector",
    "ShardFormatError",
    "ShardOptions",
    "Sink",
    "SinkStats",
    "TlDistError",
    "Trace",
    "ValidationError",
    "add",
    "add_noise",
    "arm",
    "armed_session",
    "capture",
    "clamp",
    "compare",
    "disarm",
    "downstream",
    "flush",
    "func",
    "in_module",
    "label",
    "load",
    "load_merged",
    "mask",
    "mean_ablate",
    "merge_ranks",
    "module",
    "patch",
    "replace",
    "resample",
    "scale",
    "should_capture",
    "shard_path",
    "sink_stats",
    "telemetry",
    "trace",
    "upstream",
    "watch_compiles",
    "when",
    "where",
    "zero_ablate",
]

__version__ = "0.1.0"
