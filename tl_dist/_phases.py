"""Which phase of a training step an op belongs to: ``forward``, ``backward``, ``optimizer`` or ``recompute``.

The recorder asks one C call per op (``torch._C._current_graph_task_id()``: not -1 while the autograd engine
runs a graph task); this module handles what that call cannot tell:

- ``optimizer``: global optimizer step pre/post hooks set ``recorder.phase`` for the ops of ``step()``. The
  profiler markers ``_record_function_enter_new``/``_exit`` that ``Optimizer.step`` and ``zero_grad`` put around
  their hooks run outside them; their names (``Optimizer.step#SGD.step``) say where they belong.
- A closure passed to ``optimizer.step(closure)`` (what Lightning's automatic optimization does: forward and
  backward run *inside* ``step``, after the pre-hooks) is wrapped for that one call so its ops keep
  ``forward``/``backward``.
- The seed gradient ``loss.backward()`` creates (``ones_like`` in ``torch.autograd._make_grads``, and the
  ``detach`` that follows it) runs before the engine starts: it is ``backward``.
- ``torch.utils.checkpoint`` recomputation runs forward code inside the engine with grad enabled: ``recompute``
  (told apart from a ``create_graph=True`` backward, and given its module, by ``ModuleTracker.recomputed``).
- The hooks are global; calls from other threads (an EMA model, an evaluator) are ignored.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .schema import PHASES  # noqa: F401 (old path)

if TYPE_CHECKING:
    from ._recorder_state import RecorderState

# Ops whose phase needs a second look (the recorder checks `func in SPECIAL` before calling `special`).
SPECIAL = frozenset(
    {
        "ones_like",
        "ones",
        "detach",
        "_record_function_enter_new",
        "_record_function_enter",
        "_record_function_exit",
    }
)
_SEED_MAKER = torch.autograd._make_grads.__code__
_current_node = torch._C._current_autograd_node
_get_ident = threading.get_ident


class PhaseTracker:
    """Phase bookkeeping of one capture (owned by its Recorder): optimizer hooks and the special cases above."""

    def __init__(self, recorder: RecorderState) -> None:
        self.rec = weakref.proxy(recorder)  # the recorder owns this tracker: no reference cycle
        self.thread = _get_ident()
        # One entry per open profiler region: the phase to restore at its exit, or None (not an optimizer's).
        self._regions: list[str | None] = []
        self._seed = -2  # index of the last seed gradient (its detach follows it at once)
        # Stepped in the window (their state persists); a WeakSet from the first step on (one costs ~20 us to
        # make with cold caches, and most windows step none).
        self.optimizers: weakref.WeakSet | tuple = ()
        self._handles: list[Any] = []

    # -- window -------------------------------------------------------------------------------------------
    def install(self) -> None:
        """Global optimizer step hooks, for the capturing thread only."""
        rec, thread, tracker = self.rec, _get_ident(), self  # the hooks go at uninstall: no cycle stays
        self.thread = thread

        def pre(optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if _get_ident() != thread:
                return None
            rec.phase = "optimizer"
            if not tracker.optimizers:
                tracker.optimizers = weakref.WeakSet()
            tracker.optimizers.add(optimizer)
            if rec.locate is not None:  # where step() was called: the source of every op of the step
                rec.step_source = rec.locate.caller(2)
            return _wrap_closure(rec, args, kwargs)

        def post(optimizer: Any, args: Any, kwargs: Any) -> None:
            if _get_ident() == thread:
                rec.phase = "forward"
                rec.step_source = None

        self._handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.rec.phase = "forward"

    # -- per op -------------------------------------------------------------------------------------------
    def special(self, func: str, args: tuple, phase: str) -> str:
        """The phase of a ``SPECIAL`` op run outside the engine, whose default would be ``phase``."""
        rec = self.rec
        if func == "detach":  # the seed's own detach, dispatched right after it
            return "backward" if rec.n_ops == self._seed + 1 else phase
        if func in ("ones_like", "ones"):
            if not _called_from(_SEED_MAKER, depth=8):
                return phase
            self._seed = rec.n_ops
            return "backward"
        if func == "_record_function_exit":
            restore = self._regions.pop() if self._regions else None
            if restore is None:
                return phase
            rec.phase = restore
            return "optimizer"
        name = args[0] if args and isinstance(args[0], str) else ""
        if name.startswith("Optimizer."):  # Optimizer.step#SGD.step, Optimizer.zero_grad#SGD.zero_grad
            self._regions.append(phase)
            rec.phase = "optimizer"
            return "optimizer"
        self._regions.append(None)
        return phase


def accumulating_param() -> torch.Tensor | None:
    """The parameter whose gradient the running autograd node accumulates (``AccumulateGrad``), if any."""
    node = _current_node()
    if node is None or type(node).__name__ != "AccumulateGrad":
        return None
    return node.variable


def _called_from(code: Any, *, depth: int) -> bool:
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _wrap_closure(rec: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """``optimizer.step(closure)``: run the closure's ops as forward/backward, then return to ``optimizer``."""
    if "closure" in kwargs:
        closure = kwargs["closure"]
    elif len(args) > 1:  # args[0] is the optimizer
        closure = args[1]
    else:
        return None
    if not callable(closure):
        return None

    def closure_outside_the_step() -> Any:
        rec.phase, source = "forward", rec.step_source
        rec.step_source = None
        try:
            return closure()
        finally:
            rec.phase, rec.step_source = "optimizer", source

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_outside_the_step}
    return (args[0], closure_outside_the_step, *args[2:]), kwargs
