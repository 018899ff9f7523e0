"""tl_dist: record every op of a PyTorch job -- ATen ops, collectives, module boundaries -- as one graph.

Example:
    >>> import tl_dist as tl
    >>> trace = tl.trace(model, x, save=tl.func("relu") | tl.in_module("classifier"))
    >>> trace["relu_2"].out, trace.to_pandas(), trace.draw("graph.svg")
"""

from .arm import arm, disarm, should_capture
from .capture import Capture, capture, trace
from .errors import MergeError, MissingToolError, SchemaError, ShardFormatError, TlDistError, ValidationError
from .merge import MergedTrace, load_merged, merge_ranks
from .schema import MODULE_CALL_FIELDS, OP_FIELDS, SCHEMA_VERSION, Field
from .selectors import Selector, func, in_module, label, module, where
from .store import ShardOptions, load
from .trace import Collective, ModuleCall, Op, Trace

__all__ = [
    "Capture",
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
    "TlDistError",
    "Trace",
    "ValidationError",
    "arm",
    "capture",
    "disarm",
    "func",
    "in_module",
    "label",
    "load",
    "load_merged",
    "merge_ranks",
    "module",
    "should_capture",
    "trace",
    "where",
]

__version__ = "0.1.0"
