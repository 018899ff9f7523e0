"""Static facts about an operator overload, computed once per overload and cached (the hot path does one dict
lookup per op)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import flop_registry, shape_wrapper

from .comm_ops import comm_op

_aten = torch.ops.aten
# Formulas torch's registry lacks for ops that run on CPU, reusing torch's own shape formulas: CPU
# scaled-dot-product attention has the same (query, key, value, ...) / (grad_out, query, key, value, ...)
# layout as the GPU kernels torch counts. Pass this to FlopCounterMode(custom_mapping=...) to compare.
EXTRA_FLOP_FORMULAS: dict[Any, Any] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: flop_counter.sdpa_flop.__wrapped__,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_counter.sdpa_backward_flop.__wrapped__,
}
_EXTRA_WRAPPED = {packet: shape_wrapper(f) for packet, f in EXTRA_FLOP_FORMULAS.items()}
# Registry formulas go through shape_wrapper (they see argument shapes only) unless registered get_raw=True:
# those read tensor values (varlen attention's cumulative sequence lengths), so their count cannot be
# memoised on shapes.
_SHAPE_WRAPPER_CODE = shape_wrapper(lambda: 0).__code__

# Namespaces whose ops are communication, not compute. Collective recognition proper (normalised names,
# group, sequence number) lives in tl_dist.collectives; this only tags the kind.
COLLECTIVE_NAMESPACES = frozenset(
    {"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"}
)


# Ops that return uninitialised memory: their output is whatever bytes the allocator handed out, so no other
# run reproduces it (OpInfo has no tag for this; torch does not tag these ops).
UNINITIALISED = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted", "resize_"}
)
# func -> positions of outputs that are scratch memory the kernel only partly writes (oneDNN's LSTM workspace,
# kept for backward): its bytes differ from run to run of the same model on the same input.
SCRATCH_OUTPUTS = {"mkldnn_rnn_layer": frozenset({3})}


def unreproducible_outputs(func: str, outs: list) -> frozenset[int]:
    """Positions of the outputs ``outs`` of a call of ``func`` (by name, as the trace's ``func`` column) whose
    bytes no run reproduces: an :data:`UNINITIALISED` op's, the scratch ones of :data:`SCRATCH_OUTPUTS`. An
    empty tensor (BatchNorm's size-0 reserve placeholder) holds no bytes: it is reproducible.

    Example:
        >>> unreproducible_outputs("empty_like", [torch.empty(3), torch.empty(0)])
        frozenset({0})
    """
    scratch = range(len(outs)) if func in UNINITIALISED else SCRATCH_OUTPUTS.get(func, ())
    return frozenset(k for k in scratch if k < len(outs) and outs[k] is not None and outs[k].numel())


class OpInfo:
    """What tl_dist needs to know about one operator overload, independent of its arguments."""

    __slots__ = (
        "func",
        "aten",
        "namespace",
        "kind",
        "flop_fn",
        "flops_from_shapes",
        "mutated",
        "nondeterministic",
        "counter_key",
        "comm",
        "call",
        "tensor_lists",
    )

    def __init__(self, op: Any) -> None:
        packet = getattr(op, "overloadpacket", None)
        self.aten = str(op)
        self.namespace = getattr(op, "namespace", "")
        self.func = packet.__name__ if packet is not None else getattr(op, "__name__", self.aten)
        self.flop_fn = flop_registry.get(packet) or _EXTRA_WRAPPED.get(packet)
        self.flops_from_shapes = getattr(self.flop_fn, "__code__", None) is _SHAPE_WRAPPER_CODE
        schema = getattr(op, "_schema", None)
        # (position, name) of every argument the op writes into: relu_(self), add_(self), copy_(self), out=.
        self.mutated: tuple[tuple[int, str], ...] = ()
        # Whether an argument may hold a list of tensors (cat, _foreach_*, index): the hot path walks the
        # lists of only such ops; an op without a schema is walked in full.
        self.tensor_lists = schema is None or any(
            isinstance(a.type, torch.ListType) and "Tensor" in str(a.type) for a in schema.arguments
        )
        if schema is not None:
            self.mutated = tuple(
                (i, a.name)
                for i, a in enumerate(schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write
            )
        tags = getattr(op, "tags", ())
        self.nondeterministic = torch.Tag.nondeterministic_seeded in tags
        # Communication ops (tl_dist.collectives): normalised func (all_reduce), declared mutations.
        self.comm = comm_op(op) if self.namespace in COLLECTIVE_NAMESPACES else None
        if self.comm is not None:
            self.func = self.comm.func
            self.mutated = self.comm.mutated or self.mutated
        if self.comm is not None and self.comm.spec is None:  # wait_tensor, _wrap_tensor_autograd
            self.kind = "compute"
        elif self.namespace in COLLECTIVE_NAMESPACES:
            self.kind = "collective"
        elif getattr(op, "is_view", False):
            self.kind = "view"
        else:
            self.kind = "compute"
        self.counter_key = self.func
        # What runs the op: an OpOverload's C++ callable itself, skipping OpOverload.__call__ (a Python frame
        # that only forwards to it: ~0.3 us per op); anything else (TorchBindOpOverload, ...) as it is.
        self.call = op._op if type(op) is torch._ops.OpOverload else op


# id(op) -> (op, its OpInfo): looked up by id because OpOverload.__hash__ is Python code (a second per-op
# Python call); the op is kept, so the id cannot be reused while the entry exists.
OPINFO_CACHE: dict[int, tuple[Any, OpInfo]] = {}


def op_info(op: Any) -> OpInfo:
    """The cached :class:`OpInfo` of ``op``."""
    entry = OPINFO_CACHE.get(id(op))
    if entry is None or entry[0] is not op:
        entry = OPINFO_CACHE[id(op)] = (op, OpInfo(op))
    return entry[1]


def mutated_tensors(info: OpInfo, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``args``/``kwargs`` hand to ``info``'s op in argument slots it writes into."""
    found: list[torch.Tensor] = []
    for pos, name in info.mutated:
        value = args[pos] if pos < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def draws_random(info: OpInfo, func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call of ``func`` draws random numbers: a random op (tagged ``nondeterministic_seeded``) not
    called with a probability of 0 (``dropout_p=0.0``, as attention kernels are in eval) or ``train=False``.
    The one rule replay (reuses the recorded output) and validate (skips the op) both follow."""
    if not info.nondeterministic:
        return False
    for k, arg in enumerate(getattr(func, "_schema", None).arguments if hasattr(func, "_schema") else ()):
        if arg.name in ("dropout_p", "p", "train"):
            value = args[k] if k < len(args) else kwargs.get(arg.name, getattr(arg, "default_value", None))
            # A tensor probability (bernoulli_.Tensor) may hold anything: it draws.
            if value is False or (arg.name != "train" and type(value) in (int, float) and value == 0):
                return False
    return True


_FLOP_CACHE: dict[tuple, int] = {}


def flop_count(info: OpInfo, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one call from torch's formula, memoised on (op, argument shapes and values).

    torch's shape-based formulas run a pytree map over every argument (and some call other wrapped formulas,
    mapping again): ~20-40 us per matmul. The count depends only on shapes and non-tensor arguments, and models
    repeat them (every layer of a stack), so one evaluation per distinct call signature suffices. Formulas
    that read tensor values (varlen attention) are evaluated on every call.
    """
    if not info.flops_from_shapes:
        return int(info.flop_fn(*args, **kwargs, out_val=out))
    key: list[Any] = [info.aten]
    try:
        for a in args:
            if isinstance(a, torch.Tensor):
                key.append(a.shape)
            elif type(a) is list or type(a) is tuple:
                key.append(tuple([v.shape if isinstance(v, torch.Tensor) else v for v in a]))
            else:
                key.append(a)
        if kwargs:
            for name, a in kwargs.items():
                key.append(name)
                key.append(a.shape if isinstance(a, torch.Tensor) else a)
    except RuntimeError:  # a nested tensor's ragged sizes: torch's formulas cannot count it (0: not counted)
        return 0
    try:
        signature = tuple(key)
        flops = _FLOP_CACHE.get(signature)
    except TypeError:  # an unhashable argument: compute without memoising
        return int(info.flop_fn(*args, **kwargs, out_val=out))
    if flops is None:
        if len(_FLOP_CACHE) >= 65_536:  # varying shapes (dynamic sequence lengths): keep memory bounded
            _FLOP_CACHE.clear()
        flops = _FLOP_CACHE[signature] = int(info.flop_fn(*args, **kwargs, out_val=out))
    return flops
