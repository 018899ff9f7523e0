"""Capture entry points: ``tl.trace(model, x)`` and the ``with tl.capture():`` window.

Ops are intercepted at the dispatcher by a private TorchDispatchMode; module boundaries come from global
forward hooks. Both are installed on entry and removed on exit -- also when the user's code raises -- so
nothing stays behind and a plain forward afterwards costs what it did before.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._recorder import Recorder
from .arm import open_window as _open_window
from .errors import TlDistError
from .selectors import check_selection
from .trace import Trace

_active: list[Capture] = []


class _CaptureMode(TorchDispatchMode):
    """Forwards every dispatched op to the capture's recorder."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self._on_op = recorder.on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        return self._on_op(func, args, kwargs or {})


class Capture:
    """A capture window: records every op run inside ``with``; the result is ``.trace``.

    Example:
        >>> with tl.capture(save=tl.func("relu")) as cap:
        ...     loss = model(x).sum()
        >>> cap.trace["relu_1"].out
    """

    def __init__(
        self,
        *,
        save: Any = None,
        keep_graph: bool = False,
        source: bool = True,
        roots: list[tuple[str, torch.nn.Module]] | None = None,
        save_grads: Any = None,
        stats: Any = None,
    ) -> None:
        self.save = check_selection(save, "save")
        self.save_grads = check_selection(save_grads, "save_grads")
        self.stats = check_selection(stats, "stats")
        if not isinstance(keep_graph, bool):
            raise ValueError(f"keep_graph must be a bool, got {keep_graph!r}")
        if not isinstance(source, bool):
            raise ValueError(f"source must be a bool, got {source!r}")
        self.keep_graph = keep_graph
        self.source = source
        self._roots = roots or []
        self.trace: Trace | None = None
        self._window: Any = None  # arm.Window when tl.arm() is active: writes the shard on exit
        self._recorder: Recorder | None = None
        self._mode: _CaptureMode | None = None

    def __enter__(self) -> Capture:
        if _active:
            raise TlDistError("a tl_dist capture is already active in this process; captures do not nest")
        recorder = self._recorder = Recorder(
            save=self.save,
            keep_graph=self.keep_graph,
            source=self.source,
            roots=self._roots,
            save_grads=self.save_grads,
            stats=self.stats,
        )
        recorder.modules.install()
        recorder.training.install()
        self._mode = _CaptureMode(recorder)
        try:
            self._mode.__enter__()
        except BaseException:
            recorder.modules.uninstall()
            recorder.training.uninstall()
            raise
        _active.append(self)
        # Saved outputs add many small containers; letting the cyclic GC walk them mid-forward costs more
        # than the whole capture. It is switched back on (if it was on) when the window closes.
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        recorder = self._recorder
        try:
            self._mode.__exit__(exc_type, exc, tb)
        finally:
            _active.remove(self)
            recorder.modules.uninstall()
            recorder.modules.close()
            # tl.trace (roots given) keeps inert gradient hooks on the graph for trace.log_backward.
            recorder.training.uninstall(keep_node_hooks=bool(self._roots))
            if self._gc_was_enabled:
                gc.enable()
        try:
            self.trace = self._build_trace(output=None)
        except Exception as build_error:
            if exc is None:
                raise
            # Never mask the user's own error with one of ours: it propagates, with a note.
            if hasattr(exc, "add_note"):
                exc.add_note(f"tl_dist: no partial trace ({type(build_error).__name__}: {build_error})")
            return
        if exc is not None:
            # The partial trace travels with the error: `except E as e: e.tl_trace`.
            exc.tl_trace = self.trace
            if hasattr(exc, "add_note"):
                where = recorder.failed_op
                at = (
                    f" at {where['func']} in {where['module'] or '<top>'} ({where['source']})"
                    if where
                    else ""
                )
                exc.add_note(
                    f"tl_dist: {len(self.trace)} ops captured before the error{at}; see exc.tl_trace"
                )
        if self._window is not None:
            self._window.close(self, exc)

    def _build_trace(self, output: Any) -> Trace:
        rec = self._recorder
        modules = rec.modules
        columns = rec.columns()
        return Trace(
            columns,
            {name: list(col) for name, col in modules.calls.items()},
            collective_table=rec.comm.columns(columns),
            saved=rec.saved,
            replay=rec.replay,
            output_of={i: tuple(a) for i, a in rec.output_of.items()},
            out_trees=modules.out_trees,
            output=output,
            metadata={"clock_offset_ns": rec.clock_offset_ns},
            failed_op=rec.failed_op,
            grads=rec.training.grads,
            stats_table=rec.training.finish(),
            recorder=rec,
        )


def capture(
    *,
    save: Any = None,
    keep_graph: bool = False,
    source: bool = True,
    step: int | None = None,
    save_grads: Any = None,
    stats: Any = None,
) -> Capture:
    """A window recording every op of arbitrary code: ``with tl.capture() as cap: ...``; then ``cap.trace``.

    Args:
        save: which op outputs to keep: ``True`` all, ``None`` none (metadata only), or a selector. When
            ``tl.arm`` is active, None takes the armed default.
        keep_graph: keep saved outputs attached to autograd so a loss can be built from them.
        source: record file:line of the user code issuing each op.
        save_grads: forward ops whose output gradient (of the loss backward runs on in the window) is kept:
            ``True``, ``None`` or a selector; ``trace["relu_2"].grad``.
        stats: ops whose output statistics (mean, std, min, max, L2 norm, zero fraction, NaN and Inf counts)
            are recorded, and their gradient's when backward runs: ``True`` (every forward op but views),
            ``None`` or a selector (any op, backward and optimizer ops included). See ``trace.stats_table``.
        step: training step of the window. When armed (``tl.arm``) the window writes
            ``rank{RRRRR}/step{step:08d}.h5`` on exit (numbered by a window counter when None).

    Example:
        >>> with tl.capture(save=tl.func("relu")) as cap:
        ...     model(x).sum().backward()
        >>> cap.trace.to_pandas()
    """
    window = _open_window(step)
    if window is not None:
        armed = window.armed
        save = armed.save if save is None else save
        save_grads = armed.save_grads if save_grads is None else save_grads
        stats = armed.stats if stats is None else stats
    cap = Capture(save=save, keep_graph=keep_graph, source=source, save_grads=save_grads, stats=stats)
    cap._window = window
    return cap


def trace(
    model: torch.nn.Module,
    inputs: Any,
    *,
    kwargs: dict[str, Any] | None = None,
    save: Any = True,
    keep_graph: bool = False,
    source: bool = True,
    save_grads: Any = None,
    stats: Any = None,
) -> Trace:
    """Run ``model`` once on ``inputs`` and record every ATen op it executes.

    Args:
        model: any ``torch.nn.Module``; it is not modified (no hooks, modes or patches remain).
        inputs: a tensor, or a tuple of positional arguments.
        kwargs: keyword arguments for the model.
        save: which op outputs to keep: ``True`` all (default), ``None`` none, or a selector
            (``tl.func("relu") | tl.in_module("classifier")``).
        keep_graph: keep saved outputs attached to autograd (build a loss from activations).
        source: record file:line of the user code issuing each op.
        save_grads: forward ops whose output gradient ``trace.log_backward(loss)`` keeps (``True``/selector).
        stats: ops whose output (and, after ``log_backward``, gradient) statistics are recorded.

    Returns:
        The :class:`Trace`. If the forward raises, the error propagates with the partial trace as
        ``err.tl_trace``.

    Example:
        >>> trace = tl.trace(model, torch.randn(1, 3, 32, 32))
        >>> trace["relu_2"].out.shape
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(inputs, tuple):
        args = inputs
    elif isinstance(inputs, list):
        raise ValueError("inputs must be a tensor or a tuple of positional arguments; wrap a list in a tuple")
    else:
        args = (inputs,)
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"kwargs must be a dict of keyword arguments, got {type(kwargs).__name__}")
    cap = Capture(
        save=save,
        keep_graph=keep_graph,
        source=source,
        roots=[("", model)],
        save_grads=save_grads,
        stats=stats,
    )
    with cap:
        output = model(*args, **(kwargs or {}))
    cap.trace.output = output
    return cap.trace
