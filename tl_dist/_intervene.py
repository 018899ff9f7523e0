"""Applying ``intervene=`` edits while a capture runs (the edits themselves are :mod:`tl_dist.edits`).

Two places, picked by the selector (:attr:`tl_dist.edits.When.module_site`):

- **Op sites** -- :meth:`Interventions.on_op`, called by ``Recorder.on_op`` once an op's outputs are known
  (only when a window has op-site edits: other windows pay one attribute check per op). Where autograd does
  not record the op (grad off, or no input requires grad, and the edit holds no tensor requiring grad) the
  edit replaces the output right there, at the dispatcher, so it reaches any op, inside fused or library code
  too. Where autograd records it, an edit made below autograd would be invisible to backward (and the op's
  backward would read the edited value as its own result); so the op is only marked, and the edit is applied
  just above autograd, when the torch function that ran the op returns its output to Python (a
  ``TorchFunctionMode`` installed for the window). An op whose output is consumed inside that call before it
  returns (``addmm`` inside ``F.linear`` on a 3-D input) cannot be edited differentiably: that raises,
  naming the op and the one the call returned. An in-place op is edited in place at the dispatcher (every
  alias sees it); above autograd its edit is a new tensor (writing it back would break the op's backward),
  and a later read of the tensor it wrote raises (:meth:`Interventions.check_stale`).
- **Module sites** -- :meth:`Interventions.module_output`, called from the module tracker's forward post-hook:
  the edited tensors replace the module's output, as a forward hook returning a new output would.

In both places an edited tensor carries the producing op's tag, so later ops list that op as their parent, and
it replaces the op's saved output. Edits run with tl_dist's dispatch mode off: they add no rows.
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from ._common import FIELD_INDEX, TAG, RowView, flat_outputs
from .edits import Site, When, check_result
from .errors import InterventionError
from .selectors import module

if TYPE_CHECKING:
    from ._recorder import Recorder

Tensor = torch.Tensor
_PHASE = FIELD_INDEX["phase"]
_LABEL = FIELD_INDEX["label"]
_MODULE = FIELD_INDEX["module"]
_INPLACE = FIELD_INDEX["inplace"]
_grad_enabled = torch.is_grad_enabled
# Edits run without the capture's dispatch mode (their ops are not the model's), autograd still on.
_NoRecording = torch._C._DisableTorchDispatch


class _EditFunctionMode(TorchFunctionMode):
    """Applies the edits marked on ops that autograd records, when the torch call that ran them returns."""

    # NB: any TorchFunctionMode makes ``torch.overrides.has_torch_function`` true, and torch's fused fast paths
    # (MultiheadAttention, TransformerEncoder(Layer)) read that as "a subclass wants every op" and take their
    # slow path: an edited run would run other ops than the clean one, and labels would no longer line up.
    # While a window has op-site edits, :func:`_has_torch_function` answers as if this mode were absent.

    def __init__(self, owner: Interventions) -> None:
        super().__init__()
        self._owner = weakref.proxy(owner)  # the owner holds this mode: no reference cycle

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        owner = self._owner
        if owner.stale:
            owner.check_stale(func, args, kwargs)
        start = owner.rec.n_ops
        outer, owner.call_grad = owner.call_grad, _grad_enabled()
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            owner.call_grad = outer
        if owner.deferred:
            out = owner.apply_deferred(out, func, start)
        return out


class Interventions:
    """The edits of one capture window (owned by its Capture; the recorder and module tracker call in)."""

    def __init__(self, recorder: Recorder, rules: tuple[When, ...]) -> None:
        self.rec = weakref.proxy(recorder)
        self.op_rules = [w for w in rules if not w.module_site]
        self.module_rules = [w for w in rules if w.module_site]
        # The common case, tl.when(tl.module(address), ...) only: other modules' calls return at once.
        plain = all(type(w.selector) is module for w in self.module_rules)
        self._addresses = {w.selector.address for w in self.module_rules} if plain else None
        self.applied: dict[int, list[str]] = {}  # op index -> the edits applied to its outputs
        self.applied_at: dict[int, int] = {}  # op index -> ops recorded when its edit took effect
        self._used: set[int] = set()  # id() of the rules that edited something
        self._rules = rules
        self.deferred: dict[tuple[int, int], list[When]] = {}  # (op, output) -> edits awaiting autograd
        # id -> tensor an in-place op wrote whose edit (under autograd) is a new tensor: it holds the unedited
        # value, so reading it later would silently skip the edit (kept alive, so the id stays its own).
        self.stale: dict[int, tuple[Tensor, str]] = {}
        self._mode: _EditFunctionMode | None = None
        # Grad mode where the model called the torch function now running (None outside one). Autocast turns
        # grad on inside a call for its cached weight casts; under the caller's no_grad nothing the caller gets
        # back carries autograd's graph of such an op, so its edit is applied at the dispatcher.
        self.call_grad: bool | None = None

    # -- window -------------------------------------------------------------------------------------------
    def install(self) -> None:
        rec = self.rec
        rec.edits = self if self.op_rules else None
        rec.modules.edits = self if self.module_rules else None
        # Autocast caches its weight casts until the outermost autocast exits: a window after another forward in
        # the same autocast block would reuse them (no cast ops: labels would shift against a clean trace), and
        # an edited cast would stay in the cache after the window. Edited windows start and end with it empty.
        torch.clear_autocast_cache()
        if self.op_rules:
            _hide_edit_modes(True)
            self._mode = _EditFunctionMode(self)
            self._mode.__enter__()

    def uninstall(self) -> None:
        rec = self.rec
        torch.clear_autocast_cache()
        rec.edits = None
        rec.modules.edits = None
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
            _hide_edit_modes(False)
        if self.deferred:
            labels = sorted({rec.rows[i][_LABEL] for i, _ in self.deferred})
            self.deferred.clear()
            warnings.warn(
                f"tl_dist: the edits on {', '.join(labels)} were not applied: those ops ran outside any torch call "
                "whose result tl_dist could replace",
                RuntimeWarning,
                stacklevel=3,
            )

    def unapplied(self) -> list[When]:
        """The rules that edited nothing (most likely a misspelt name)."""
        return [rule for rule in self._rules if id(rule) not in self._used]

    def metadata(self) -> dict[str, dict[str, Any]]:
        """For the trace's metadata: ``edited`` (label -> the edits applied to that op) and ``edits_applied_at``
        (label -> how many ops had run when the edit took effect: ops before that read the unedited value, as
        autograd's own ``detach`` of a result, or ops inside a module before the module's output is edited)."""
        rows = self.rec.rows
        return {
            "edited": {rows[i][_LABEL]: "; ".join(edits) for i, edits in sorted(self.applied.items())},
            "edits_applied_at": {rows[i][_LABEL]: at for i, at in sorted(self.applied_at.items())},
        }

    # -- op sites -------------------------------------------------------------------------------------------
    def on_op(
        self, index: int, row: tuple, info: Any, out: Any, outs: list[Tensor], tensors: list[Tensor]
    ) -> tuple[Any, list[Tensor]]:
        """Edits for op ``index`` (just run): the op's possibly replaced return value and output list."""
        if not outs or row[_PHASE] != "forward":
            return out, outs
        view = RowView(row)
        matches: list[tuple[When, int]] = []
        n_returned = 1 if isinstance(out, Tensor) else len(flat_outputs(out))
        for rule in self.op_rules:
            if rule.selector is True or rule.selector.match(view):
                matches += [(rule, pos) for pos in rule.positions(n_returned, row[_LABEL])]
        if not matches:
            return out, outs
        if (
            _grad_enabled()
            and self.call_grad is not False
            and (any(t.requires_grad for t in tensors) or any(rule.edit.needs_graph() for rule, _ in matches))
        ):
            for rule, pos in matches:
                self.deferred.setdefault((index, pos), []).append(rule)
            return out, outs
        outs = list(outs)
        with _NoRecording(), torch.no_grad():
            for rule, pos in matches:
                value = outs[pos]
                new = self._run(rule, value, Site(view, pos), index)
                if info.mutated:  # an in-place op: every alias of the written tensor sees the edit
                    value.copy_(new)
                    continue
                setattr(new, TAG, (self.rec.token, index, pos))
                outs[pos] = new
                out = _replace_output(out, pos, new)
        return out, outs

    def apply_deferred(self, out: Any, func: Any, start: int) -> Any:
        """Called when a torch call returns: applies the marked edits to the outputs it returns (under autograd),
        and raises for marks made during the call whose op's output it does not return."""
        rec, token = self.rec, self.rec.token
        tensors = _returned_tensors(out)
        replaced: dict[int, Tensor] = {}
        for k, t in enumerate(tensors):
            tag = getattr(t, TAG, None)
            if tag is None or tag[0] != token:
                continue
            rules = self.deferred.pop((tag[1], tag[2]), None)
            if rules is None:
                continue
            index, pos = tag[1], tag[2]
            row = rec.rows[index]
            site = Site(RowView(row), pos)
            new = t
            with _NoRecording():
                for rule in rules:
                    new = self._run(rule, new, site, index)
            if row[_INPLACE]:
                # Writing the edit back into t would break the op's backward (relu_ saves its result): the edit
                # is a new tensor, and t must not be read again.
                self.stale[id(t)] = (t, row[_LABEL])
            setattr(new, TAG, (token, index, pos))
            self._note_saved(index, pos, new)
            if rec.stats_on:
                rec.training.forget_out_stats(index)
                rec.training.out_stats(index, [new], row)
            replaced[k] = new
        stuck = [key for key in self.deferred if key[0] >= start]
        if stuck:
            index, pos = stuck[0]
            row = rec.rows[index]
            returned = [rec.rows[tag[1]][_LABEL] for tag in (getattr(t, TAG, None) for t in tensors) if tag]
            self.deferred.clear()
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            raise InterventionError(
                f"cannot edit {row[_LABEL]} (output {pos}) differentiably: it ran inside {name}, which used it "
                f"before returning {', '.join(returned) or 'no tensor of this capture'}; autograd only sees an "
                "edit of a value a torch call returns to Python. Edit "
                + (f"{returned[0]} or " if returned else "")
                + "the enclosing module's output (tl.module(...)), or run under torch.no_grad()"
            )
        return _rebuild(out, replaced) if replaced else out

    def check_stale(self, func: Any, args: tuple, kwargs: dict | None) -> None:
        """Raises when a torch call reads a tensor whose in-place op's edit was applied out of place."""
        stale = self.stale
        for a in (*args, *(kwargs or {}).values()):
            for t in a if type(a) is list or type(a) is tuple else (a,):
                hit = stale.get(id(t)) if isinstance(t, Tensor) else None
                if hit is not None and hit[0] is t:
                    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
                    raise InterventionError(
                        f"{name} reads the tensor the in-place op {hit[1]} wrote, after {hit[1]} was edited: with "
                        "autograd recording, the edited value is a new tensor (the value the in-place call "
                        f"returned), not the one it wrote. Use the returned value (y = y.relu_()), edit under "
                        "torch.no_grad(), or edit the enclosing module's output"
                    )

    # -- module sites ---------------------------------------------------------------------------------------
    def module_output(self, address: str, leaves: list[Any]) -> bool:
        """Edits the output leaves of a module call returning now (``leaves`` is changed in place); whether any
        leaf was replaced."""
        if self._addresses is not None and address not in self._addresses:
            return False
        rec, token = self.rec, self.rec.token
        changed = False
        tensor_k = -1
        matched: dict[int, bool] = {}  # rule -> applied (for the output= check)
        for k, leaf in enumerate(leaves):
            if not isinstance(leaf, Tensor):
                continue
            tensor_k += 1
            tag = getattr(leaf, TAG, None)
            if tag is None or tag[0] != token:
                continue
            index, pos = tag[1], tag[2]
            view = RowView(rec.rows[index], (address,))
            new = leaf
            for r, rule in enumerate(self.module_rules):
                if not rule.selector.match(view):
                    continue
                hit = rule.output == "all" or rule.output == tensor_k
                matched[r] = matched.get(r, False) or hit
                if hit:
                    with _NoRecording():
                        new = self._run(rule, new, Site(view, pos), index)
            if new is not leaf:
                setattr(new, TAG, (token, index, pos))
                self._note_saved(index, pos, new)
                leaves[k] = new
                changed = True
        for r, applied in matched.items():
            if not applied:
                rule = self.module_rules[r]
                raise InterventionError(
                    f"{rule!r} on module {address or '<root>'}: its output has {tensor_k + 1} tensor(s); "
                    f"output={rule.output} is none of them"
                )
        return changed

    # -- shared ---------------------------------------------------------------------------------------------
    def _run(self, rule: When, value: Tensor, site: Site, index: int) -> Tensor:
        new = check_result(rule.edit(value, site), value, site, rule.edit)
        self._used.add(id(rule))
        self.applied.setdefault(index, []).append(repr(rule.edit))
        self.applied_at[index] = max(self.rec.n_ops, index + 1)
        return new

    def _note_saved(self, index: int, pos: int, new: Tensor) -> None:
        """The edited value becomes the op's saved output (when the op's output is saved)."""
        rec = self.rec
        saved = rec.saved.get(index)
        if saved is not None and pos < len(saved) and saved[pos] is not None:
            with _NoRecording():  # not an op of the model (a detach would shift every later label)
                saved[pos] = new if rec.keep_graph else new.detach()
            rec.watch(new, (index, 0, pos))


_has_torch_function = torch.overrides.has_torch_function
_hidden_windows = [0]  # windows with op-site edits open now (any thread): the patch stays while one is


def _has_torch_function_without_edits(args: Any) -> bool:
    """``torch.overrides.has_torch_function`` as if no edit mode were on this thread's stack (see
    :class:`_EditFunctionMode`): true for a tensor subclass or another mode, as before."""
    if not _has_torch_function(args):
        return False
    n = torch._C._len_torch_function_stack()
    stack = [torch._C._get_function_stack_at(k) for k in range(n)]
    if not stack or not all(type(m) is _EditFunctionMode for m in stack):
        return True
    for _ in stack:  # only edit modes: ask again without them, then put them back in order
        torch._C._pop_torch_function_stack()
    try:
        return _has_torch_function(args)
    finally:
        for m in stack:
            torch._C._push_on_torch_function_stack(m)


def _hide_edit_modes(on: bool) -> None:
    """Install (``on``) or, with the last edit window closing, remove the patch of
    ``torch.overrides.has_torch_function`` (the name torch's fast-path checks look up at call time)."""
    _hidden_windows[0] += 1 if on else -1
    torch.overrides.has_torch_function = (
        _has_torch_function_without_edits if _hidden_windows[0] > 0 else _has_torch_function
    )


def _returned_tensors(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):  # plain, or torch.return_types (a tuple subclass)
        return [o for o in out if isinstance(o, Tensor)]
    return []


def _rebuild(out: Any, replaced: dict[int, Tensor]) -> Any:
    if isinstance(out, Tensor):
        return replaced[0]
    items, k = [], 0
    for o in out:
        if isinstance(o, Tensor):
            o = replaced.get(k, o)
            k += 1
        items.append(o)
    return type(out)(items)


def _replace_output(out: Any, pos: int, new: Tensor) -> Any:
    """``out`` (an op's return value) with its tensor number ``pos`` (``flat_outputs`` order) replaced."""
    if isinstance(out, Tensor):
        return new
    k = 0
    items = []
    for o in out:
        if isinstance(o, Tensor):
            items.append(new if k == pos else o)
            k += 1
        elif type(o) is list or type(o) is tuple:
            inner = []
            for p in o:
                if isinstance(p, Tensor):
                    inner.append(new if k == pos else p)
                    k += 1
                else:
                    inner.append(p)
            items.append(type(o)(inner))
        else:
            items.append(o)
    return type(out)(items)
