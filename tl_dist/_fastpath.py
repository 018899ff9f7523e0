"""When a window's ops take the compiled per-op path (``tl_dist/_csrc/``) instead of ``Recorder.on_op``.

The extension is built at install time when a C compiler is there (``pip install`` builds it; it is optional,
so an install without a compiler still works and every op takes the Python path). It does the work of
``Recorder.on_op`` for every window without interventions, and per op no tensor subclass, collective, tensor
list or CUDA kernel. It keeps the in-place write log as ``Recorder._note_writes`` does (``_csrc/writes.c``).
What it calls back into stays Python: output statistics (``TrainingState.out_stats``), the copies made before
a write (``Recorder._before_write``) and, in a window that saves by a selector, the selector and the saving
(``Recorder._save_op``); ``save=True`` keeps each op's outputs and replay record as ``Recorder._save`` does
(``_csrc/saved.c``), which also checks at close what was saved still has its memory (:func:`freed`). Every
other op runs ``Recorder.on_op``, which stays the reference:
``tests/test_fastop.py`` checks both give the same rows, saved tensors and replay records.

The extension also does the common case of the module tracker's two global hooks (``_csrc/modules.c``: a
named module's call on the window's thread, and a call returning tensors) and the walk over the Python
frames that finds an op's or a module call's ``source`` (``_csrc/source.c``); ``ModuleTracker._pre`` /
``_post`` and ``SourceLocator`` stay the reference, and the whole path when ``TL_DIST_PURE_PYTHON=1``.

Set ``TL_DIST_PURE_PYTHON=1`` to run every op in Python (read when a window opens).
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

import torch

from ._common import (
    DEVICE_NAMES,
    DTYPE_NAMES,
    TAG,
    device_name,
    dtype_name,
    environ_get,
    flat_outputs,
    has_its_bytes,
    shape_of,
)
from ._modules import CLASS_FACTS, FLAT_TUPLE_SPECS, LEAF_SPEC, hidden_from_dynamo
from ._opinfo import flop_count, op_info
from ._phases import SPECIAL
from ._source import CODE_KINDS, SOURCE_NAMES, code_kind
from .schema import MODULE_CALL_FIELDS, OP_FIELDS, field_names
from .training import _KEY

try:
    from . import _fastop
except ImportError:  # built without a C compiler: every op takes the Python path
    _fastop = None

PURE_PYTHON_ENV = "TL_DIST_PURE_PYTHON"


def _entry(func: Any) -> tuple | None:
    """What the compiled path needs of an op overload, or None when its ops always need Recorder.on_op."""
    info = op_info(func)
    if info.comm is not None or info.tensor_lists or info.kind == "collective":
        return None
    special = info.func in SPECIAL
    memo = info.flops_from_shapes  # FLOPs from shapes alone: memoised in C (record.c, op_flops)
    return (func, info, info.call, info.func, info.aten, info.kind, info.flop_fn, special, info.mutated, memo)


def available() -> bool:
    """Whether the compiled per-op path is built and not switched off by ``TL_DIST_PURE_PYTHON=1``."""
    return _fastop is not None and environ_get(PURE_PYTHON_ENV) != "1"


def rows_to_columns(rows: list[tuple], names: tuple[str, ...], shifted: str, shift: int) -> dict[str, list]:
    """``rows`` (tuples of one value per name in ``names``) as a list per name, ``shift`` added to each value of
    field ``shifted``: once per window, in C when the extension is built (a 1,000-op window: ~0.3 ms less).

    Example:
        >>> rows_to_columns([(0, 5), (1, 7)], ("index", "start_ns"), "start_ns", 100)
        {'index': [0, 1], 'start_ns': [105, 107]}
    """
    k = names.index(shifted)
    if _fastop is not None:
        return dict(zip(names, _fastop.columns(rows, len(names), k, shift)))
    if any(len(row) != len(names) for row in rows):
        raise ValueError(f"rows_to_columns: a row is not a tuple of {len(names)} values")
    columns = [list(col) for col in zip(*rows)] if rows else [[] for _ in names]
    columns[k] = [t + shift for t in columns[k]]
    return dict(zip(names, columns))


def untrack_rows(rows: list[tuple]) -> None:
    """Takes a closed window's ``rows`` off the cyclic GC's list (in C; nothing without the extension): rows of
    schema values never refer back to the list, so it is in no reference cycle, and the collection after the
    window then does not visit every row.

    Example:
        >>> untrack_rows(recorder.rows)
    """
    if _fastop is not None:
        _fastop.untrack_rows(rows)


def freed(kept: dict[int, list]) -> list[tuple[int, int]]:
    """``(op, position)`` of each tensor in ``kept`` (saved outputs or gradients by op) whose storage no longer
    holds the bytes it reads (:func:`has_its_bytes`: FSDP freed it), in ``kept``'s order; in C where the
    extension is built (plain tensors; a wrapper subclass asks ``has_its_bytes``).

    Example:
        >>> freed({0: [torch.ones(2), None]})
        []
    """
    if _fastop is not None:
        return _fastop.freed(kept, has_its_bytes)
    return [
        (index, pos)
        for index, outs in kept.items()
        for pos, t in enumerate(outs)
        if t is not None and not has_its_bytes(t)
    ]


def module_hooks() -> tuple[Any, Any] | None:
    """``(module_pre, module_post)``: the common case of ``ModuleTracker``'s two global hooks in C
    (``_csrc/modules.c``), or None where every module call takes the Python hooks (as every op, then, takes
    ``Recorder.on_op``).

    The caller has checked :func:`available` (a window reads it once, in ``Recorder.compiled``).

    Example:
        >>> ModuleTracker(recorder, roots, compiled_hooks=module_hooks() if available() else None)
    """
    if _fastop is None:
        return None
    return _fastop.module_pre, _fastop.module_post


def compiled_dispatch(recorder: Any, mode: Any) -> Any:
    """A ``__torch_dispatch__`` for ``mode`` that records into ``recorder`` in C, or None if this window needs
    Python. It holds the recorder and only a weak reference to the mode, so the window's objects stay free of
    reference cycles. None also where ``recorder.compiled`` (the window's reading of :func:`available`) is
    False."""
    if _fastop is None or not recorder.compiled:
        return None
    if "torch._dynamo" in sys.modules:  # nothing can be compiled before Dynamo loads (hidden_from_dynamo)
        hidden_from_dynamo(*_called_from_c(recorder))
    return _fastop.FastOp(recorder, mode)


def _called_from_c(recorder: Any) -> list[Any]:
    """The Python the compiled path calls. With no Python frame of tl_dist's below them (the mode's own
    ``__torch_dispatch__``, which is marked), Dynamo would compile each when an op runs while it traces (a
    compiled DDP's forward): new frames and graph breaks in the window. Marked again at every window, as the
    mode is: ``torch._dynamo.reset()`` may drop the marks."""
    training, modules = recorder.training, recorder.modules
    called = [_entry, flat_outputs, shape_of, flop_count, dtype_name, device_name]
    called += [recorder.on_op, recorder._record_failure]
    called += [recorder._with_written_bases, training.link_pending, training.out_stats, training.arrived]
    called += [recorder._save_op, recorder._save, recorder.watch, recorder._before_write]
    called += [recorder.phases.special, modules.recomputed]
    if recorder.locate is not None:
        called += [type(recorder.locate).__call__, code_kind]
    return called


if _fastop is not None:
    assert _KEY == TAG, "tl_dist/_csrc uses one name for the tensor tag and the autograd-node key"
    # What the extension calls and reads; configure() takes them once (tests reconfigure it from here).
    CONFIG = dict(
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
        perf_counter_ns=time.perf_counter_ns,
        tag=TAG,
        sequence_nr=torch._C._autograd._get_sequence_nr,
        row_fields=field_names(OP_FIELDS),  # the extension fills each row in this order, by name
    )
    try:
        _fastop.configure(**CONFIG)
        _fastop.configure_modules(
            leaf_spec=LEAF_SPEC,
            flat_tuple_specs=FLAT_TUPLE_SPECS,
            class_facts=CLASS_FACTS,
            call_fields=field_names(MODULE_CALL_FIELDS),
        )
        _fastop.configure_source(code_kinds=CODE_KINDS, source_names=SOURCE_NAMES, code_kind=code_kind)
    except (TypeError, ValueError) as exc:  # built from other sources than these (a stale in-place build)
        warnings.warn(
            f"tl_dist: the compiled per-op path does not match this tl_dist ({exc}); every op is recorded in "
            "Python. Reinstall tl_dist (`pip install .`, or `make install`) to rebuild it.",
            RuntimeWarning,
            stacklevel=2,
        )
        _fastop = None
