"""Which dispatcher ops communicate, and how to read them: each known ``c10d`` / functional collective
overload's spec (where its data, group, root, peer and reduce op are among its arguments) resolved against its
schema (:class:`CommOp`). ``tl_dist._opinfo`` asks :func:`comm_op` once per overload; the recorder's
:class:`~tl_dist.collectives.CollectiveLog` reads a call's arguments through it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ._common import OWN_DIR, TORCH_DIR

# Frames between the dispatcher and the recorder: ours, and torch's wrappers around __torch_dispatch__.
DISPATCH_PLUMBING = (OWN_DIR, TORCH_DIR + "_dynamo" + os.sep, TORCH_DIR + "_compile.py")


@dataclass(frozen=True)
class _Spec:
    """Where one communication op keeps its data and parameters, by schema argument name."""

    func: str
    inputs: str | None = None  # argument holding the tensors this rank contributes
    outputs: str | None = None  # argument receiving the result; "return" when the op returns it
    reduce_op: str | None = None
    root: str | None = None  # group rank of the root
    peer: str | None = None  # group rank of the p2p peer


_C10D = "process_group"
_SPECS: dict[tuple[str, str], _Spec] = {
    ("c10d", "allreduce_"): _Spec("all_reduce", "tensors", "tensors", "reduce_op"),
    ("c10d", "allreduce_coalesced_"): _Spec("all_reduce", "tensors", "tensors", "reduce_op"),
    ("c10d", "allgather_"): _Spec("all_gather", "input_tensors", "output_tensors"),
    ("c10d", "_allgather_base_"): _Spec("all_gather", "input_tensor", "output_tensor"),
    ("c10d", "allgather_coalesced_"): _Spec("all_gather", "input_list", "output_lists"),
    ("c10d", "allgather_into_tensor_coalesced_"): _Spec("all_gather", "inputs", "outputs"),
    ("c10d", "reduce_scatter_"): _Spec("reduce_scatter", "input_tensors", "output_tensors", "reduce_op"),
    ("c10d", "_reduce_scatter_base_"): _Spec("reduce_scatter", "input_tensor", "output_tensor", "reduce_op"),
    ("c10d", "reduce_scatter_tensor_coalesced_"): _Spec("reduce_scatter", "inputs", "outputs", "reduce_op"),
    ("c10d", "broadcast_"): _Spec("broadcast", "tensors", "tensors", root="root_rank"),
    ("c10d", "reduce_"): _Spec("reduce", "tensors", "tensors", "reduce_op", root="root_rank"),
    ("c10d", "gather_"): _Spec("gather", "input_tensors", "output_tensors", root="root_rank"),
    ("c10d", "scatter_"): _Spec("scatter", "input_tensors", "output_tensors", root="root_rank"),
    ("c10d", "alltoall_"): _Spec("all_to_all", "input_tensors", "output_tensors"),
    ("c10d", "alltoall_base_"): _Spec("all_to_all", "input", "output"),
    ("c10d", "barrier"): _Spec("barrier"),
    ("c10d", "monitored_barrier_"): _Spec("barrier"),
    ("c10d", "send"): _Spec("send", "tensors", peer="dst"),
    ("c10d", "recv_"): _Spec("recv", None, "tensors", peer="src"),
    ("c10d", "recv_any_source_"): _Spec("recv", None, "tensors"),
    ("_c10d_functional", "all_reduce"): _Spec("all_reduce", "input", "return", "reduce_op"),
    ("_c10d_functional", "all_reduce_"): _Spec("all_reduce", "input", "input", "reduce_op"),
    ("_c10d_functional", "all_reduce_coalesced"): _Spec("all_reduce", "inputs", "return", "reduce_op"),
    ("_c10d_functional", "all_reduce_coalesced_"): _Spec("all_reduce", "inputs", "inputs", "reduce_op"),
    ("_c10d_functional", "all_gather_into_tensor"): _Spec("all_gather", "input", "return"),
    ("_c10d_functional", "all_gather_into_tensor_out"): _Spec("all_gather", "input", "out"),
    ("_c10d_functional", "all_gather_into_tensor_coalesced"): _Spec("all_gather", "inputs", "return"),
    ("_c10d_functional", "reduce_scatter_tensor"): _Spec("reduce_scatter", "input", "return", "reduce_op"),
    ("_c10d_functional", "reduce_scatter_tensor_out"): _Spec("reduce_scatter", "input", "out", "reduce_op"),
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"): _Spec(
        "reduce_scatter", "inputs", "return", "reduce_op"
    ),
    ("_c10d_functional", "all_to_all_single"): _Spec("all_to_all", "input", "return"),
    ("_c10d_functional", "broadcast"): _Spec("broadcast", "input", "return", root="src"),
    ("_c10d_functional", "broadcast_"): _Spec("broadcast", "input", "input", root="src"),
    ("_c10d_functional", "isend"): _Spec("send", "tensor", peer="dst"),
    ("_c10d_functional", "irecv"): _Spec("recv", None, "return", peer="src"),
    ("_c10d_functional_autograd", "all_to_all_single"): _Spec("all_to_all", "input", "return"),
    ("_c10d_functional_autograd", "reduce_scatter_tensor"): _Spec(
        "reduce_scatter", "input", "return", "reduce_op"
    ),
    ("_c10d_functional_autograd", "all_gather_into_tensor"): _Spec("all_gather", "input", "return"),
}
# Communication helpers that are not collectives themselves: wait_tensor completes a functional collective.
_WAIT = ("_c10d_functional", "wait_tensor")
_HELPERS = frozenset({_WAIT, ("_c10d_functional", "_wrap_tensor_autograd"), ("c10d", "check_for_nan")})

REDUCE_NAMES = {int(v): k.lower() for k, v in torch.distributed.ReduceOp.RedOpType.__members__.items()}


class CommOp:
    """A communication overload's spec resolved against its schema: argument positions, defaults, mutations."""

    __slots__ = ("spec", "func", "ns", "is_wait", "_pos", "_default_async", "mutated", "has_async_arg")

    def __init__(self, op: Any, spec: _Spec | None, *, ns: str, is_wait: bool = False) -> None:
        self.spec = spec
        self.ns = ns
        self.func = spec.func if spec is not None else op.overloadpacket.__name__
        self.is_wait = is_wait
        args = op._schema.arguments
        self._pos = {a.name: i for i, a in enumerate(args)}
        async_arg = next((a for a in args if a.name == "async_op"), None)
        self.has_async_arg = async_arg is not None
        self._default_async = bool(async_arg.default_value) if async_arg is not None else False
        # c10d's schemas do not mark their written arguments (a!), so the recorder would not know that
        # allreduce_ overwrites its input; declaring it lets copy-on-write protect saved tensors.
        self.mutated: tuple[tuple[int, str], ...] = ()
        if spec is not None and spec.outputs not in (None, "return"):
            self.mutated = ((self._pos[spec.outputs], spec.outputs),)

    def arg(self, name: str | None, args: tuple, kwargs: dict, default: Any = None) -> Any:
        if name is None:
            return default
        pos = self._pos[name]
        if pos < len(args):
            return args[pos]
        return kwargs.get(name, default)

    def is_async(self, args: tuple, kwargs: dict) -> bool:
        if not self.has_async_arg:
            # Functional collectives always return before completion. c10d send/recv have no async_op: the
            # blocking dist.send/recv are isend/irecv plus wait(), told apart by their Python caller.
            return self.ns != "c10d" or not _blocking_p2p()
        return bool(self.arg("async_op", args, kwargs, self._default_async))


def comm_op(op: Any) -> CommOp | None:
    """The :class:`CommOp` of ``op`` if it is a communication op tl_dist knows, else None (called once per
    overload by ``_opinfo``)."""
    key = (getattr(op, "namespace", ""), op.overloadpacket.__name__ if hasattr(op, "overloadpacket") else "")
    spec = _SPECS.get(key)
    if spec is None and key not in _HELPERS:
        return None
    return CommOp(op, spec, ns=key[0], is_wait=key == _WAIT)


_C10D_PY = TORCH_DIR + "distributed" + os.sep
_BLOCKING_P2P = frozenset({"send", "recv"})


def _blocking_p2p() -> bool:
    """Is the send/recv being recorded the blocking ``dist.send``/``dist.recv`` (which call isend/irecv, then
    wait), rather than ``isend``/``irecv``/``batch_isend_irecv`` whose caller waits later, if ever?"""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(DISPATCH_PLUMBING):
        frame = frame.f_back
    while frame is not None and frame.f_code.co_filename.startswith(_C10D_PY):
        if frame.f_code.co_name in _BLOCKING_P2P and frame.f_code.co_filename.endswith("distributed_c10d.py"):
            return True
        frame = frame.f_back
    return False
