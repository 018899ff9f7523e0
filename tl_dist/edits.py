"""Edits: what an intervention does to an op's (or a module's) output, and ``tl.when`` to say where.

An edit is called as ``edit(value, op)`` with the tensor the op produced and a view of the op (its fields:
``op.label``, ``op.func``, ``op.module``, ...; ``op.pos``: which output of the op this is), and returns the
tensor the model sees instead. The built-ins below are small objects; a plain function ``(value, op) -> value``
is an edit too, and ``a >> b`` applies ``a`` then ``b``. Edits run with autograd on when the model's forward
does, so a loss through an edited value backpropagates through the edit (``tl.add(v)`` with ``v`` requiring
grad trains a steering vector). An edit must keep the value's dtype, shape and device: anything else raises
:class:`InterventionError` naming the op.

Example:
    >>> trace = tl.trace(model, x, intervene=tl.when(tl.func("relu"), tl.zero_ablate()))
    >>> steer = tl.when(tl.module("layer2"), tl.add(v) >> tl.clamp(-3.0, 3.0))
    >>> tl.trace(model, x, intervene=[steer, tl.when(tl.label("relu_1"), lambda value, op: value * 0.5)])
"""

from __future__ import annotations

import numbers
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .causal import check_capture_selector, selector_parts
from .errors import InterventionError
from .selectors import Selector, module

if TYPE_CHECKING:
    from .trace import Trace

Tensor = torch.Tensor


class Site:
    """The op an edit is applied to: the op's fields as attributes, plus ``pos`` (which output of the op)."""

    __slots__ = ("_op", "pos")

    def __init__(self, op: Any, pos: int) -> None:
        self._op = op
        self.pos = pos

    def __getattr__(self, name: str) -> Any:
        return getattr(self._op, name)

    def __repr__(self) -> str:
        return f"<Site {self._op.label} output {self.pos}>"


class Edit:
    """Base class of edits: ``edit(value, op) -> value``; ``a >> b`` applies ``a`` then ``b``."""

    def __call__(self, value: Tensor, op: Site) -> Tensor:
        raise NotImplementedError

    def needs_graph(self) -> bool:
        """Whether the edit holds tensors that require grad (its result must then be built under autograd)."""
        return False

    def __rshift__(self, other: Any) -> Edit:
        return _Chain(self, as_edit(other, ">>"))

    def __rrshift__(self, other: Any) -> Edit:
        return _Chain(as_edit(other, ">>"), self)


def as_edit(value: Any, name: str = "edit") -> Edit:
    """``value`` as an :class:`Edit`: an edit, or a function ``(value, op) -> value``."""
    if isinstance(value, Edit):
        return value
    if callable(value):
        return _Function(value)
    raise ValueError(
        f"{name} must be an edit such as tl.zero_ablate() or a function (value, op) -> value; got {value!r}"
    )


class _Function(Edit):
    def __init__(self, fn: Callable[[Tensor, Site], Tensor]) -> None:
        self.fn = fn

    def __call__(self, value: Tensor, op: Site) -> Tensor:
        return self.fn(value, op)

    def needs_graph(self) -> bool:
        return True  # a user function may close over tensors that require grad: build it under autograd

    def __repr__(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))


class _Chain(Edit):
    def __init__(self, first: Edit, then: Edit) -> None:
        self.first, self.then = first, then

    def __call__(self, value: Tensor, op: Site) -> Tensor:
        return self.then(check_result(self.first(value, op), value, op, self.first), op)

    def needs_graph(self) -> bool:
        return self.first.needs_graph() or self.then.needs_graph()

    def __repr__(self) -> str:
        return f"{self.first!r} >> {self.then!r}"


def _requires_grad(*values: Any) -> bool:
    return any(isinstance(v, Tensor) and v.requires_grad for v in values)


def _number_or_tensor(value: Any, name: str) -> Any:
    if isinstance(value, Tensor) or (isinstance(value, numbers.Real) and not isinstance(value, bool)):
        return value
    raise ValueError(f"{name} must be a number or a tensor, got {value!r}")


# -- the built-in edits (alphabetical after the two ablations) --------------------------------------------
class zero_ablate(Edit):  # noqa: N801 - the public spelling is tl.zero_ablate()
    """Replace the value by zeros.

    Example:
        >>> tl.trace(model, x, intervene=tl.when(tl.module("layer3"), tl.zero_ablate()))
    """

    def __call__(self, value: Tensor, op: Site) -> Tensor:
        return torch.zeros_like(value)

    def __repr__(self) -> str:
        return "tl.zero_ablate()"


class mean_ablate(Edit):  # noqa: N801
    """Replace the value by its mean over ``dims`` (default: the batch dimension), broadcast back.

    Example:
        >>> tl.when(tl.module("encoder.layers.3"), tl.mean_ablate(dims=(0, 1)))  # mean over batch and position
    """

    def __init__(self, dims: int | Sequence[int] = 0) -> None:
        dims_tuple = (dims,) if isinstance(dims, int) and not isinstance(dims, bool) else dims
        if (
            not isinstance(dims_tuple, (tuple, list))
            or not dims_tuple
            or any(isinstance(d, bool) or not isinstance(d, int) for d in dims_tuple)
        ):
            raise ValueError(f"dims must be an int or a non-empty sequence of ints, got {dims!r}")
        self.dims = tuple(dims_tuple)

    def __call__(self, value: Tensor, op: Site) -> Tensor:
        if not value.is_floating_point():
            raise InterventionError(
                f"tl.mean_ablate on {op.label}: its output is {value.dtype}, not floating point"
            )
        if any(not -value.dim() <= d < value.dim() for d in self.dims):
            raise InterventionError(
                f"tl.mean_ablate(dims={self.dims}) on {op.label}: its output has {value.dim()} dimension(s) "
                f"(shape {tuple(value.shape)}); dims must be in [{-value.dim()}, {value.dim() - 1}]"
            )
        return value.mean(dim=self.dims, keepdim=True).expand_as(value).clone()

    def __repr__(self) -> str:
        return f"tl.mean_ablate(dims={self.dims})"


class add(Edit):  # noqa: N801
    """Add ``vector`` (a number or a tensor broadcasting to the value): steering. A ``vector`` that requires
    grad gets the gradient of a loss through the edited value.

    Example:
        >>> v = torch.zeros(64, 1, 1, requires_grad=True)
        >>> trace = tl.trace(model, x, intervene=tl.when(tl.module("layer1"), tl.add(v)), keep_graph=True)
        >>> trace.output.sum().backward(); v.grad
    """

    def __init__(self, vector: Tensor | float) -> None:
        self.vector = _number_or_tensor(vector, "vector")

    def __call__(self, value: Tensor, op: Site) -> Tensor:
        return value + self.vector

    def needs_graph(self) -> bool:
        return _requires_grad(self.vector)

    def __repr__(self) -> str:
        v = self.vector
        return f"tl.add({'tensor' + str(list(v.shape)) if isinstance(v, Tensor) else v})"


class add_noise(Edit):  # noqa: N801
    """Add Gaussian noise of standard deviation ``std``, reproducibly: the noise for an op is drawn from a CPU
    ``torch.Generator`` seeded with ``seed + crc32(op label)`` (so each op gets its own noise, the same in every
    run, replay and rerun).

    Example:
        >>> tl.when(tl.func("gelu"), tl.add_noise(0.1, seed=3))
    """

    def __init__(self, std: float, *, seed: int = 0) -> None:
        if isinstance(std, bool) or not isinstance(std, numbers.Real) or std < 0:
            raise ValueError(f"std must be a non-negative number, got {std!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.std, self.seed = float(std), seed

    def __call__(self, value: Tensor, op: Site) -> Tensor:
        if not value.is_floating_point():
            raise InterventionError(
                f"tl.add_noise on {op.label}: its output is {value.dtype}, not floating point"
            )
        generator = torch.Generator().manual_seed(op_seed(self.seed, op.label))
        noise = torch.randn(value.shape, generator=generator, dtype=value.dtype)
        return value + self.std * noise.to(value.device)

    def __repr__(self) -> str:
        return f"tl.add_noise({self.std}, seed={self.seed})"


def op_seed(seed: int, label: str) -> int:
    """The seed an edit with ``seed`` uses for the op labelled ``label`` (stable across processes)."""
    return (seed + zlib.crc32(label.encode())) % (1 << 63)


class clamp(Edit):  # noqa: N801
    """Clamp the value to ``[min, max]`` (either may be None), as ``torch.clamp(value, min, max)``.

    Example:
        >>> tl.when(tl.module("encoder"), tl.clamp(-5.0, 5.0))
        >>> tl.when(tl.func("relu"), tl.clamp(max=6.0))

    The bounds were called ``lo``/``hi`` before: those names still work, with a warning (once), and will be
    removed.
    """

    def __init__(
        self,
        min: float | Tensor | None = None,  # noqa: A002 - torch.clamp's names
        max: float | Tensor | None = None,  # noqa: A002
        **renamed: float | Tensor | None,
    ) -> None:
        unknown = sorted(set(renamed) - set(_CLAMP_RENAMED))
        if unknown:
            raise TypeError(
                f"tl.clamp() got unexpected keyword arguments {unknown}; its bounds are min and max"
            )
        if renamed:
            if not _warned_clamp:
                _warned_clamp.append(True)
                warnings.warn(
                    "tl.clamp(lo=, hi=) is now tl.clamp(min=, max=), as torch.clamp; lo and hi will be removed",
                    FutureWarning,
                    stacklevel=2,
                )
            old = {_CLAMP_RENAMED[k]: v for k, v in renamed.items()}
            for name, given in (("min", min), ("max", max)):
                if name in old and given is not None:
                    raise TypeError(f"tl.clamp() got both {name} and its old name; give {name} only")
            min, max = old.get("min", min), old.get("max", max)  # noqa: A001
        if min is None and max is None:
            raise ValueError("tl.clamp needs min or max (or both)")
        for name, v in (("min", min), ("max", max)):
            if v is not None:
                _number_or_tensor(v, name)
        self.min, self.max = min, max

    def __call__(self, value: Tensor, op: Site) -> Tensor:
        return torch.clamp(value, self.min, self.max)

    def __repr__(self) -> str:
        return f"tl.clamp({self.min}, {self.max})"


_CLAMP_RENAMED = {"lo": "min", "hi": "max"}
_warned_clamp: list[bool] = []  # the rename warning is given once per process


class mask(Edit):  # noqa: N801
    """Zero the entries at ``index`` along ``dim`` (units with the default ``dim=-1``; positions with ``dim=1``
    for (batch, position, feature) values). ``index``: an int, a list of ints, or a bool/long tensor.

    Example:
        >>> tl.when(tl.module("mlp.act"), tl.mask([3, 17]))          # units 3 and 17
        >>> tl.when(tl.module("encoder.layers.0"), tl.mask(0, dim=1))  # the first position
    """

    def __init__(self, index: int | Sequence[int] | Tensor, *, dim: int = -1) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ValueError(f"dim must be an int, got {dim!r}")
        if isinstance(index, Tensor):
            if index.dtype == torch.bool:
                index = index.nonzero().flatten()
            if index.dtype not in (torch.int64, torch.int32) or index.dim() > 1:
                raise ValueError(
                    f"index must be a 1-D long or bool tensor, got {index.dtype} of {index.dim()} dims"
                )
            index = index.detach().to(torch.int64).flatten()
        elif isinstance(index, int) and not isinstance(index, bool):
            index = torch.tensor([index])
        elif isinstance(index, (list, tuple)) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in index
        ):
            index = torch.tensor(list(index), dtype=torch.int64)
        else:
            raise ValueError(f"index must be an int, a list of ints or a long/bool tensor, got {index!r}")
        self.index, self.dim = index, dim

    def __call__(self, value: Tensor, op: Site) -> Tensor:
        size = value.shape[self.dim] if value.dim() else 0
        index = self.index
        if index.numel() and not (-size <= int(index.min()) and int(index.max()) < size):
            raise InterventionError(
                f"tl.mask on {op.label}: index {index.tolist()} out of range for dim {self.dim} of size {size}"
            )
        return value.index_fill(self.dim, (index % max(size, 1)).to(value.device), 0)

    def __repr__(self) -> str:
        return f"tl.mask({self.index.tolist()}, dim={self.dim})"


class patch(Edit):  # noqa: N801
    """Replace the value by the same op's output in ``other`` (a trace of the same model on another input, with
    that op saved): activation patching. Ops are matched by label.

    Example:
        >>> clean = tl.trace(model, x_clean)
        >>> tl.trace(model, x_corrupt, intervene=tl.when(tl.module("layer2"), tl.patch(clean)))
    """

    def __init__(self, other: Trace) -> None:
        if not hasattr(other, "saved") or not hasattr(other, "labels"):
            raise ValueError(f"other must be a tl_dist Trace, got {type(other).__name__}")
        self.other = other

    def __call__(self, value: Tensor, op: Site) -> Tensor:
        return saved_value(self.other, op, "tl.patch").clone()

    def __repr__(self) -> str:
        return f"tl.patch(<trace of {len(self.other)} ops>)"


class resample(Edit):  # noqa: N801
    """Replace the value by the same op's output in one of ``others`` (traces of the model on other inputs),
    chosen per op from a generator seeded like :class:`add_noise`: resample ablation.

    Example:
        >>> pool = [tl.trace(model, xi) for xi in other_inputs]
        >>> tl.when(tl.module("layer4"), tl.resample(pool, seed=1))
    """

    def __init__(self, others: Sequence[Trace], *, seed: int = 0) -> None:
        if not isinstance(others, (list, tuple)) or not others:
            raise ValueError("others must be a non-empty list of traces")
        for t in others:
            if not hasattr(t, "saved") or not hasattr(t, "labels"):
                raise ValueError(f"others must hold tl_dist Traces, got {type(t).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.others, self.seed = list(others), seed

    def __call__(self, value: Tensor, op: Site) -> Tensor:
        generator = torch.Generator().manual_seed(op_seed(self.seed, op.label))
        pick = int(torch.randint(len(self.others), (), generator=generator))
        return saved_value(self.others[pick], op, "tl.resample").clone()

    def __repr__(self) -> str:
        return f"tl.resample(<{len(self.others)} traces>, seed={self.seed})"


class replace(Edit):  # noqa: N801
    """Replace the value by ``tensor`` (broadcast to the value's shape), or by ``fn(op)`` for a function.

    Example:
        >>> tl.when(tl.label("relu_3"), tl.replace(torch.ones(8, 1, 1)))
    """

    def __init__(self, tensor_or_fn: Tensor | Callable[[Site], Tensor]) -> None:
        if not isinstance(tensor_or_fn, Tensor) and not callable(tensor_or_fn):
            raise ValueError(
                f"tensor_or_fn must be a tensor or a function op -> tensor, got {tensor_or_fn!r}"
            )
        self.source = tensor_or_fn

    def __call__(self, value: Tensor, op: Site) -> Tensor:
        given = isinstance(self.source, Tensor)
        new = self.source if given else self.source(op)
        if isinstance(new, Tensor) and new.shape != value.shape:
            try:
                new = torch.broadcast_to(new, value.shape)
            except RuntimeError:
                pass  # check_result names the shapes
        # Its own memory: a later in-place op of the model must not write into the user's tensor.
        return new.clone() if given and isinstance(new, Tensor) else new

    def needs_graph(self) -> bool:
        return not isinstance(self.source, Tensor) or self.source.requires_grad

    def __repr__(self) -> str:
        src = self.source
        return f"tl.replace({'tensor' + str(list(src.shape)) if isinstance(src, Tensor) else repr(src)})"


class scale(Edit):  # noqa: N801
    """Multiply the value by ``factor`` (a number or a tensor broadcasting to it).

    Example:
        >>> tl.when(tl.func("_softmax"), tl.scale(0.5))
    """

    def __init__(self, factor: float | Tensor) -> None:
        self.factor = _number_or_tensor(factor, "factor")

    def __call__(self, value: Tensor, op: Site) -> Tensor:
        return value * self.factor

    def needs_graph(self) -> bool:
        return _requires_grad(self.factor)

    def __repr__(self) -> str:
        f = self.factor
        return f"tl.scale({'tensor' + str(list(f.shape)) if isinstance(f, Tensor) else f})"


def saved_value(other: Trace, op: Site, what: str) -> Tensor:
    """Output ``op.pos`` of the op labelled ``op.label`` in trace ``other``, or an error saying what is missing."""
    index = other.labels.get(op.label)
    if index is None:
        raise InterventionError(
            f"{what}: the other trace has no op {op.label!r} (a different model, or a different path through it)"
        )
    outs = other.saved.get(index)
    value = outs[op.pos] if outs is not None and op.pos < len(outs) else None
    if value is None:
        raise InterventionError(
            f"{what}: the other trace did not save {op.label} (output {op.pos}); trace it with save=True or a "
            "selector covering the patched ops"
        )
    return value.detach()


# -- where edits apply ---------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)  # edits hold tensors: compared by identity
class When:
    """One intervention: ``edit`` replaces output ``output`` of each op ``selector`` matches (see :func:`when`)."""

    selector: Any
    edit: Edit
    output: int | str = 0

    @property
    def module_site(self) -> bool:
        """Applied when a module returns (the selector names a ``tl.module``), not when an op runs."""
        return self.selector is not True and any(isinstance(s, module) for s in selector_parts(self.selector))

    def positions(self, n: int, label: str) -> range | tuple[int, ...]:
        """Output positions (of ``n``) this intervention edits on op ``label``."""
        if self.output == "all":
            return range(n)
        if self.output >= n:
            raise InterventionError(
                f"tl.when(..., output={self.output}) on {label}: it has {n} tensor output(s) (0..{n - 1})"
            )
        return (self.output,)

    def __repr__(self) -> str:
        where = "True" if self.selector is True else repr(self.selector)
        out = f", output={self.output!r}" if self.output != 0 else ""
        return f"tl.when({where}, {self.edit!r}{out})"


def when(
    selector: Selector | bool, edit: Edit | Callable[[Tensor, Site], Tensor], *, output: int | str = 0
) -> When:
    """Apply ``edit`` to the output of every op ``selector`` matches, as the model runs.

    Args:
        selector: which ops: a selector (``tl.func("relu")``, ``tl.label("addmm_2")``), or ``True`` for every op.
            A selector naming ``tl.module(address)`` edits that module's output when the module returns, as a
            forward hook would; otherwise the op's output is edited when the op runs, so every later op (inside
            fused or library code too) sees the edited value.
        edit: an edit (``tl.zero_ablate()``, ``tl.add(v)``, ...) or a function ``(value, op) -> value``.
        output: which tensor: for an op, the position among its outputs; for a module, the index among the tensor
            leaves of its output (pytree order); ``"all"`` for every one. Default 0: the op's (module's) output.

    Example:
        >>> trace = tl.trace(model, x, intervene=tl.when(tl.func("relu") & tl.in_module("layer1"), tl.scale(0.0)))
    """
    if not (selector is True or isinstance(selector, Selector)):
        raise ValueError(
            f"selector must be a selector such as tl.func('relu'), or True (every op); got {selector!r}"
        )
    if output != "all" and (isinstance(output, bool) or not isinstance(output, int) or output < 0):
        raise ValueError(f"output must be a non-negative int or 'all', got {output!r}")
    return When(selector, as_edit(edit), output)


def check_interventions(value: Any, name: str = "intervene") -> tuple[When, ...] | None:
    """``value`` (None, one ``tl.when(...)`` or a list of them) as a tuple, or a ValueError naming ``name``."""
    if value is None:
        return None
    items = value if isinstance(value, (list, tuple)) else (value,)
    for item in items:
        if not isinstance(item, When):
            raise ValueError(
                f"{name} must be tl.when(selector, edit) or a list of them (applied in order); got {item!r}"
            )
        check_capture_selector(item.selector, name)
    return tuple(items) or None


def check_result(result: Any, value: Tensor, op: Site, edit: Any) -> Tensor:
    """``result`` if it can stand for ``value`` (a tensor of the same dtype, shape and device); else an error
    naming the op and the edit."""
    where = f"{edit!r} on {op.label}" + (f" (in {op.module})" if op.module else "")
    if not isinstance(result, Tensor):
        raise InterventionError(f"{where} returned {type(result).__name__}, not a tensor")
    for what, got, want in (
        ("dtype", result.dtype, value.dtype),
        ("shape", tuple(result.shape), tuple(value.shape)),
        ("device", result.device, value.device),
    ):
        if got != want:
            raise InterventionError(
                f"{where} changed the {what}: {got} instead of {want}; edits must keep it"
            )
    return result
