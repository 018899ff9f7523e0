"""tl_dist: record every op of a PyTorch job -- ATen ops, collectives, module boundaries -- as one graph.

Example:
    >>> import tl_dist as tl
    >>> trace = tl.trace(model, x, save=tl.func("relu") | tl.in_module("classifier"))
    >>> trace["relu_2"].out, trace.to_pandas(), trace.draw("graph.svg")
"""

from . import telemetry
from .arm import arm, disarm, flush, should_capture, sink_stats
from .capture import Capture, capture, trace
from .errors import MergeError, MissingToolError, SchemaError, ShardFormatError, TlDistError, ValidationError
from .merge import MergedTrace, load_merged, merge_ranks
from .options import CaptureOptions
from .schema import MODULE_CALL_FIELDS, OP_FIELDS, SCHEMA_VERSION, Field
from .selectors import Selector, func, in_module, label, module, where
from .sinks import Sink, SinkStats
from .store import ShardOptions, load
from .trace import Collective, ModuleCall, Op, Trace

__all__ = [
    "Capture",
    "CaptureOptions",
    "Collective",
    "Field",
    "MODULE_CALL_FIELDS",
    "MergeError",
    "MergedTrace",
    "MissingToolError",
    "ModuleCall",
    "OP_FIELDS",
    "Op",
    "SCHEMA_VERSION",
    "SchemaError",
    "Selector",
    "ShardFormatError",
    "ShardOptions",
    "Sink",
    "SinkStats",
    "TlDistError",
    "Trace",
    "ValidationError",
    "arm",
    "capture",
    "disarm",
    "flush",
    "func",
    "in_module",
    "label",
    "load",
    "load_merged",
    "merge_ranks",
    "module",
    "should_capture",
    "sink_stats",
    "telemetry",
    "trace",
    "where",
]

__version__ = "0.1.0"
