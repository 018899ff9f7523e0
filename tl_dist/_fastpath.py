"""When a window's ops take the compiled per-op path (``tl_dist/_fastop.c``) instead of ``Recorder.on_op``.

The extension is built at install time when a C compiler is there (``pip install`` builds it; it is optional,
so an install without a compiler still works and every op takes the Python path). It does the work of
``Recorder.on_op`` for the ops of a window that saves no outputs (the telemetry default, with or without
``stats``; the statistics themselves are taken by the same Python code), and per op no tensor subclass, collective, tensor list, intervention or CUDA kernel. Every
other op, and every op of other windows, runs ``Recorder.on_op``, which
stays the reference: ``tests/test_fastop.py`` checks both give the same rows.

Set ``TL_DIST_PURE_PYTHON=1`` to run every op in Python (read when a window opens).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ._common import DEVICE_NAMES, DTYPE_NAMES, TAG, device_name, dtype_name, flat_outputs, shape_of
from ._opinfo import flop_count, op_info
from ._phases import SPECIAL, accumulating_param
from .schema import OP_FIELDS, field_names
from .training import _KEY

try:
    from . import _fastop
except ImportError:  # built without a C compiler: every op takes the Python path
    _fastop = None

PURE_PYTHON_ENV = "TL_DIST_PURE_PYTHON"
# The row _fastop.c builds, field by field; a schema change must change both.
_ROW_LAYOUT = (
    "index",
    "label",
    "func",
    "aten",
    "kind",
    "phase",
    "fwd_op",
    "module",
    "module_stack",
    "module_call",
    "out_shapes",
    "dtype",
    "device",
    "out_bytes",
    "in_shapes",
    "parents",
    "inplace",
    "flops",
    "start_ns",
    "duration_ns",
    "source",
    "params",
)


def _entry(func: Any) -> tuple | None:
    """What the compiled path needs of an op overload, or None when its ops always need Recorder.on_op."""
    info = op_info(func)
    if info.comm is not None or info.tensor_lists or info.kind == "collective":
        return None
    special = info.func in SPECIAL
    return (func, info, info.call, info.func, info.aten, info.kind, info.flop_fn, special, info.mutated)


def available() -> bool:
    """Whether the compiled per-op path is built and not switched off by ``TL_DIST_PURE_PYTHON=1``."""
    return _fastop is not None and os.environ.get(PURE_PYTHON_ENV, "") != "1"


def compiled_dispatch(recorder: Any, mode: Any) -> Any:
    """A ``__torch_dispatch__`` for ``mode`` that records into ``recorder`` in C, or None if this window needs
    Python. It holds the recorder and only a weak reference to the mode, so the window's objects stay free of
    reference cycles."""
    if not available() or recorder.saving:
        return None
    return _fastop.FastOp(recorder, mode)


if _fastop is not None:
    if field_names(OP_FIELDS) != _ROW_LAYOUT:
        raise ImportError("tl_dist._fastop builds rows out of step with schema.OP_FIELDS: update _fastop.c")
    assert _KEY == TAG, "_fastop.c uses one name for the tensor tag and the autograd-node key"
    _fastop.configure(
        tensor_type=torch.Tensor,
        parameter_type=torch.nn.Parameter,
        entries={},
        make_entry=_entry,
        dtype_names=DTYPE_NAMES,
        device_names=DEVICE_NAMES,
        dtype_name=dtype_name,
        device_name=device_name,
        flat_outputs=flat_outputs,
        shape_of=shape_of,
        flop_count=flop_count,
        graph_task_id=torch._C._current_graph_task_id,
        grad_enabled=torch.is_grad_enabled,
        current_node=torch._C._current_autograd_node,
        accumulating_param=accumulating_param,
        perf_counter_ns=time.perf_counter_ns,
        tag=TAG,
    )
