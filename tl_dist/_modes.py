"""The dispatch modes of a capture: the only code on the dispatcher's path while a window is open.

``CaptureMode`` hands every op to its recorder (``Recorder.on_op``, or the compiled per-op path of
``_fastpath``); ``SubclassMode`` is on the stack while a recorded op runs a tensor subclass's own dispatch.
Both see the recorder through ``_recorder_state``'s protocol: the recorder owns them and imports this module.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ._fastpath import compiled_dispatch
from ._modules import hidden_from_dynamo
from ._opinfo import OPINFO_CACHE, op_info
from ._recorder_state import RecorderState

Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_perf_ns = time.perf_counter_ns


class CaptureMode(TorchDispatchMode):
    """Forwards every dispatched op to a recorder (the only code on the dispatcher's path)."""

    def __init__(self, recorder: RecorderState) -> None:
        super().__init__()
        self._on_op = recorder.on_op
        dispatch = self._compiled = compiled_dispatch(recorder, self)
        if dispatch is not None:  # torch calls an instance's own __torch_dispatch__ before the class's
            self.__torch_dispatch__ = dispatch
        # Marked again at every window: torch._dynamo.reset() may drop what was set on the code objects.
        hidden_from_dynamo(CaptureMode.__torch_dispatch__, SubclassMode.__torch_dispatch__)

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        try:
            super().__exit__(exc_type, exc_val, exc_tb)
        finally:
            if self._compiled is not None:
                self._compiled.close()  # the autograd node it kept between two backward ops goes now

    @contextlib.contextmanager
    def redirected(self, on_op: Any) -> Iterator[None]:
        """Sends every op to ``on_op`` (``Recorder.on_op``'s signature) instead of the recorder while the block
        runs, the compiled per-op path included (a compiled region's own ops, ``tl_dist.compiled``)."""
        recorded, compiled = self._on_op, self.__dict__.pop("__torch_dispatch__", None)
        self._on_op = on_op
        try:
            yield
        finally:
            self._on_op = recorded
            if compiled is not None:
                self.__torch_dispatch__ = compiled

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo unless this says False: the wrapper
        # imports Dynamo at the first op (~1-2 s) and costs ~1 us per op. The code objects are marked for
        # Dynamo to skip instead (hidden_from_dynamo: this frame and everything it calls, at no cost per call).
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile'd code keeps running compiled while the mode is on (Dynamo would fall back to eager
        # otherwise); the mode is off while Dynamo/Inductor compile. Regions are recorded by tl_dist.compiled.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        # types is empty for plain tensors; a tensor subclass (DTensor, AsyncCollectiveTensor) runs its own
        # dispatch inside this op, which may communicate (see SubclassMode). Some ops name plain torch.Tensor
        # there (the detach inside relu_ in training): those have no dispatch of their own, nor nn.Parameter.
        subclass = bool(types) and any(t is not Tensor and t is not _Parameter for t in types)
        return self._on_op(func, args, kwargs or {}, subclass)


class SubclassMode(TorchDispatchMode):
    """On the mode stack while a recorded op runs a tensor subclass's own dispatch.

    CaptureMode is off the stack inside its handler, so what DTensor issues there (the all-reduce of a
    ``Partial`` gradient in ``opt.step()``) and the ``wait_tensor`` an AsyncCollectiveTensor runs before its
    first use would reach no one. This mode records those collectives as ops of their own, reports waits as
    completions, and runs every other op unrecorded: it is the subclass's implementation of the op already
    recorded. A nested subclass op returns NotImplemented so that its own dispatch runs with this mode on.
    """

    def __init__(self, recorder: RecorderState) -> None:
        super().__init__()
        self._recorder = weakref.proxy(recorder)  # the recorder owns this mode: no reference cycle

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as CaptureMode: its code object is marked for Dynamo to skip

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        if types:
            if any(issubclass(t, _FakeTensor) for t in types):
                return func(*args, **kwargs)  # DTensor's sharding propagation: FakeTensorMode runs it
            return NotImplemented
        cached = OPINFO_CACHE.get(id(func))
        info = cached[1] if cached is not None and cached[0] is func else op_info(func)
        if info.comm is None:
            return func(*args, **kwargs)
        if info.comm.is_wait:
            out = func(*args, **kwargs)
            self._recorder.comm.waited(args, _perf_ns())
            return out
        return self._recorder.on_op(func, args, kwargs)
