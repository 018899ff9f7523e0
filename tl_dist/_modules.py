"""Module-call tracking for a capture: global forward pre/post hooks, installed only while a capture is active.

Each call of a module becomes a row of the module-call table (schema.MODULE_CALL_FIELDS); the recorder reads
``current_call``, ``current_address`` and ``address_stack`` for every op.

- The hooks are global: calls from other threads (an EMA model, an async evaluator) are ignored, except inside
  the autograd engine, whose device threads run checkpoint recomputation on GPUs.
- A module called while the autograd engine runs is checkpoint recomputation: its ops take the address stack
  of the module's forward call, and no module-call row is added (the forward call already has one).
- With the extension built, a call's common case is done in C (``_csrc/modules.c``, ``_fastpath.module_hooks``):
  a named module on the window's thread, outside the autograd engine, with no compiled wrapper in the tree;
  and at its end, when it is the innermost call open and returns plain tensors (one, or a tuple of them and
  Nones). Every other call, and every call with ``TL_DIST_PURE_PYTHON=1``, runs the Python below, which
  ``tests/test_fastop.py`` compares it to.
- ``torch.compile``'d modules (``OptimizedModule``) are transparent: addresses lose the ``_orig_mod`` segment,
  and the wrapper's call is the call of the module it wraps (whose own hooks do not fire when it runs compiled;
  when they do -- eagerly, or resuming after a graph break -- that inner call is not counted twice).
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
import weakref
from types import CodeType
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules import module as nn_module
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_unflatten

from ._common import TAG, TORCH_DIR
from .schema import MODULE_CALL_FIELDS, empty_columns

LEAF_SPEC = tree_flatten(torch.empty(0))[1]
_CHECKPOINT_FILE = TORCH_DIR + "utils/checkpoint.py"  # torch.utils.checkpoint, found on the Python stack
# torch warns at a compiled module's call while global module hooks exist that they fire for its wrapper too;
# the tracker's own hooks count the wrapper and the module it wraps as one call, so the warning (about hooks
# the user never registered) is silenced while they are installed.
_WRAPPER_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"
# Module._call_impl and the closure it runs forward and forward hooks in (their frames hold the module as self).
_CALL_CODES = frozenset(
    {
        nn_module.Module._call_impl.__code__,
        *(c for c in nn_module.Module._call_impl.__code__.co_consts if isinstance(c, CodeType)),
    }
)
_get_ident = threading.get_ident
_graph_task_id = torch._C._current_graph_task_id
# Constant True while Dynamo traces (it inlines the global module hooks into the frame it compiles: a call
# into torch._C there would break the graph, and a frame that breaks before its first op is never compiled).
_compiling = torch.compiler.is_compiling


FLAT_TUPLE_SPECS: dict[int, Any] = {}  # n -> the spec of a plain tuple of n leaves


def _flatten(output: Any) -> tuple[list, Any]:
    """``tree_flatten(output)``, without the pytree walk for what modules mostly return: a tensor, or a plain
    tuple of tensors and Nones (``nn.MultiheadAttention``'s ``(out, None)``), whose spec depends only on its
    length."""
    if isinstance(output, torch.Tensor) and type(output) not in SUPPORTED_NODES:
        return [output], LEAF_SPEC
    if type(output) is tuple and all(
        v is None or (isinstance(v, torch.Tensor) and type(v) not in SUPPORTED_NODES) for v in output
    ):
        spec = FLAT_TUPLE_SPECS.get(len(output))
        if spec is None:
            spec = FLAT_TUPLE_SPECS[len(output)] = tree_flatten(output)[1]
        return list(output), spec
    return tree_flatten(output)


def _strip_compiled(name: str) -> str:
    """``encoder._orig_mod.layer`` -> ``encoder.layer``: torch.compile's wrapper is not part of the address."""
    if "_orig_mod" not in name:
        return name
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


# type -> (whether it is torch.compile's wrapper class, whether its forward is torch's own code): one lookup
# per module call in the pre-hook.
CLASS_FACTS: dict[type, tuple[bool, bool]] = {}


def _class_facts(cls: type) -> tuple[bool, bool]:
    """(wrapper class, builtin) of a module class: whether it is ``OptimizedModule`` (torch.compile's wrapper),
    and whether its forward is torch's own code (nn.Linear, nn.MultiheadAttention, DDP), so no user frame can
    sit between its call and its ops: their source is the call site, found without walking the stack.
    NB: ops of a user hook registered on such a module are located at the module's call site too."""
    facts = CLASS_FACTS.get(cls)
    if facts is None:
        code = getattr(getattr(cls, "forward", None), "__code__", None)
        builtin = code is not None and code.co_filename.startswith(TORCH_DIR)
        facts = CLASS_FACTS[cls] = (cls.__name__ == "OptimizedModule", builtin)
    return facts


if TYPE_CHECKING:
    from ._recorder_state import RecorderState


def hidden_from_dynamo(*functions: Any) -> None:
    """Dynamo runs these functions, and everything they call, as plain Python.

    A compiled module's inner call runs the global module hooks with Dynamo's frame callback on: without this,
    Dynamo would compile the hooks themselves (new frames, graph breaks) on a window's first step. Marked on
    the code objects, so it costs nothing per call (``torch._dynamo.disable`` wrappers cost ~25 us a call),
    and needs no import of Dynamo (``torch._C._dynamo`` is part of torch's extension module). Nothing is
    marked while Dynamo is not loaded: nothing can be compiled before it is, and marking costs ~2 us a function
    with the caches a model's forward left cold (a window marks ~25).
    """
    if "torch._dynamo" not in sys.modules:
        return
    mark, skip = _skip_marker()
    for fn in functions:
        mark(fn.__code__, skip)


@functools.cache
def _skip_marker() -> tuple[Any, Any]:
    """(set_code_exec_strategy, the SKIP strategy): looked up once, where a window marks ~25 functions."""
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    return set_code_exec_strategy, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)


class ModuleTracker:
    """Keeps the stack of module calls and their table; names modules from the roots it is given or finds."""

    __slots__ = ("current", "__dict__", "__weakref__")  # read by every op: a slot (Recorder.__slots__)

    def __init__(
        self,
        recorder: RecorderState,
        roots: list[tuple[str, torch.nn.Module]],
        compiled_hooks: tuple[Any, Any] | None = None,
    ) -> None:
        self._recorder = weakref.proxy(recorder)  # the recorder owns this tracker: no reference cycle
        self.names: dict[int, str] = {}
        self.params: dict[int, str] = {}
        self._modules: dict[int, weakref.ref] = {}
        self.calls = empty_columns(MODULE_CALL_FIELDS)
        self.out_trees: dict[int, Any] = {}  # call row -> (treespec, leaves) to rebuild the output structure
        self._call_counts: dict[str, int] = {}
        # (id(module), call row or -1 for a recomputation, address stack, call site, torch's own class)
        self._stack: list[tuple[int, int, tuple[str, ...], str, bool]] = []
        self._forward_calls: dict[int, tuple[tuple[str, ...], str]] = {}  # id(module) -> last forward call
        self._last_call: dict[int, int] = {}  # id(module) -> its last forward call's row
        self.stack_of_address: dict[str, tuple[str, ...]] = {}  # address -> stack of its last forward call
        self.recompute_calls = 0  # open module calls that started inside the autograd engine
        self.thread = _get_ident()
        self.compiled_seen = False
        self.current_call = -1
        self.current_address = ""
        self.current_source = ""
        # The innermost call is of a torch module class (nn.Linear): the source of its ops is its call site.
        self.current_builtin = False
        self.address_stack: tuple[str, ...] = ()
        # (current_address, address_stack, current_call, current_builtin, current_source) in one read, for the
        # compiled per-op path.
        self.current: tuple[str, tuple[str, ...], int, bool, str] = ("", (), -1, False, "")
        self._root_names: set[str] = set()
        self._wrapper_of: dict[int, int] = {}  # id(compiled module's _orig_mod) -> id(its OptimizedModule)
        for prefix, root in roots:
            self._add_root(root, prefix)
        self._handles: list[Any] = []
        # The warnings filter install() added, which uninstall() removes.
        self._warning_filter: tuple | None = None
        self.edits: Any = None  # tl_dist._intervene.Interventions while a window has module-site edits
        # _fastpath.module_hooks(): (module_pre, module_post), the common case of _pre and _post in C, or None.
        self._compiled_hooks = compiled_hooks

    # -- naming -------------------------------------------------------------------------------------------
    def _add_root(self, root: torch.nn.Module, prefix: str) -> None:
        self._root_names.add(prefix)
        dot = prefix + "." if prefix else ""
        # Every window names the model afresh: one walk, with a stack of its own rather than named_modules'
        # nested generators (a third of the cost), in the same order and with the same names as
        # named_modules / named_parameters / named_buffers(remove_duplicate=False): the first name of a
        # shared module or tensor is kept, parameters before buffers.
        names, modules, params = self.names, self._modules, self.params
        buffers: list[tuple[int, str]] = []
        stack: list[tuple[str, torch.nn.Module]] = [("", root)]
        while stack:
            name, mod = stack.pop()
            cls = type(mod)  # the class's facts looked up here fill the table the C pre-hook reads
            if (CLASS_FACTS.get(cls) or _class_facts(cls))[0] and hasattr(mod, "_orig_mod"):
                self._wrapper_of[id(mod._orig_mod)] = id(mod)
            children = mod._modules
            if children:
                stem = name + "." if name else ""
                stack += [
                    (stem + key, child) for key, child in reversed(children.items()) if child is not None
                ]
            if "_orig_mod" in name:
                name = _strip_compiled(name)
            names.setdefault(id(mod), dot + name if name else prefix)
            modules.setdefault(id(mod), weakref.ref(mod))
            member = dot + name + "." if name else dot
            for key, p in mod._parameters.items():
                if p is not None:
                    params.setdefault(id(p), member + key)
            if mod._buffers:
                buffers += [(id(b), member + key) for key, b in mod._buffers.items() if b is not None]
        for ident, name in buffers:
            params.setdefault(ident, name)

    def _address(self, module: torch.nn.Module) -> str:
        address = self.names.get(id(module))
        if address is not None:
            return address
        if not self._stack:
            # A new top-level module inside a capture window (the model, then a loss module, ...): the first one
            # found is the root '', later ones are named by class so addresses stay unique.
            prefix = "" if not self._root_names else type(module).__name__
            n = 1
            while prefix in self._root_names:
                n += 1
                prefix = f"{type(module).__name__}{n}"
            self._add_root(module, prefix)
            return self.names[id(module)]
        # A module outside the named tree (built on the fly in a forward, or one instance shared by every
        # caller: transformers' kernelized functions such as Llama's rotary embedding): named under its caller
        # at every call, never cached by id. One shared instance called by two layers belongs to each in turn,
        # and a dead on-the-fly module's id may come back as another module's.
        parent = self.current_address
        return f"{parent}.<{type(module).__name__}>" if parent else f"<{type(module).__name__}>"

    # -- hooks --------------------------------------------------------------------------------------------
    def install(self) -> None:
        self.thread = _get_ident()
        hidden_from_dynamo(ModuleTracker._pre, ModuleTracker._post)
        self._handles = [
            nn_module.register_module_forward_pre_hook(self._pre),
            nn_module.register_module_forward_hook(self._post, always_call=True),
        ]
        if "torch._dynamo" in sys.modules:
            self._silence_wrapper_warning()

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._warning_filter is not None:
            try:
                warnings.filters.remove(self._warning_filter)
            except ValueError:
                pass  # the filters were reset inside the window: nothing of ours is left
            self._warning_filter = None

    def _silence_wrapper_warning(self) -> None:
        before = list(warnings.filters)
        warnings.filterwarnings("ignore", message=_WRAPPER_HOOK_WARNING, category=UserWarning)
        entry = warnings.filters[0]
        if entry in before:  # the user's own filter, moved to the front: put it back and leave it theirs
            warnings.filters[:] = before
        else:
            self._warning_filter = entry

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if _compiling():
            return  # Dynamo tracing a module's call inlines the global hooks: nothing of ours in its graph
        # The common case in C (_csrc/modules.c), after the test Dynamo must see before any call into C (which
        # would break its graph); False: it changed nothing and left the call to the Python below.
        compiled = self._compiled_hooks
        if compiled is not None and compiled[0](self, module):
            return
        in_engine = _graph_task_id() != -1
        if _get_ident() != self.thread and not in_engine:
            return  # another thread's module call: not part of this window
        key = id(module)
        address = self.names.get(key)
        if address is None:
            address = self._address(module)
        if self._wrapper_of:
            wrapper = self._wrapper_of.get(key)
            if wrapper is not None and self._stack and self._stack[-1][0] == wrapper:
                return  # the compiled wrapper's call, already open under the same address
        cls = type(module)
        wrapper_class, builtin = CLASS_FACTS.get(cls) or _class_facts(cls)
        if wrapper_class and hasattr(module, "_orig_mod"):
            self.compiled_seen = True
            cls = type(module._orig_mod)  # the call's type, and whether it is torch's own class
            builtin = _class_facts(cls)[1]
        if in_engine:
            # Checkpoint recomputation: the ops belong to the module's forward call, already in the table.
            stack, source = self._forward_calls.get(key) or (self.address_stack + (address,), "")
            if self._stack and key not in self.names:
                stack = self.address_stack + (address,)  # outside the tree: its last call was maybe another's
            self._stack.append((key, -1, stack, source, builtin))
            self.recompute_calls += 1
            self._set_current()
            return
        calls = self.calls
        addresses = calls["address"]
        row = len(addresses)
        n = self._call_counts.get(address, 0)
        self._call_counts[address] = n + 1
        addresses.append(address)
        calls["type"].append(cls.__name__)
        calls["call"].append(n)
        calls["parent"].append(self.current_call)
        calls["depth"].append(len(self.address_stack))
        first = self._recorder.n_ops
        calls["first_op"].append(first)
        calls["end_op"].append(first)
        calls["out_ops"].append(())
        calls["out_pos"].append(())
        locate = self._recorder.locate
        if locate is None:
            source = ""
        elif self.current_builtin:  # called from a torch module's forward: the same site as its ops'
            source = self.current_source
        else:
            source = locate.call_site()
        calls["source"].append(source)
        stack = self.address_stack + (address,)
        self._stack.append((key, row, stack, source, builtin))
        self._forward_calls[key] = (stack, source)
        self._last_call[key] = row
        self.stack_of_address[address] = stack
        self._set_current()

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if _compiling():
            return None
        compiled = self._compiled_hooks
        if compiled is not None and compiled[1](self, module, output):
            return None
        stack = self._stack
        key = id(module)
        if not stack or (stack[-1][0] != key and all(entry[0] != key for entry in stack)):
            return
        if _get_ident() != self.thread and _graph_task_id() == -1:
            return
        calls = self.calls
        while stack:
            mid, row, _, _, _ = stack.pop()
            if row < 0:
                self.recompute_calls -= 1
            else:
                calls["end_op"][row] = self._recorder.n_ops
            if mid == key:
                break
        self._set_current()
        if row < 0:
            return
        leaves, spec = _flatten(output)
        address = calls["address"][row]
        edited = self.edits is not None and self.edits.module_output(address, leaves)
        out_ops, out_pos = self._recorder.module_output(address, leaves)
        calls["out_ops"][row] = out_ops
        calls["out_pos"][row] = out_pos
        self.out_trees[row] = (spec, [None if i >= 0 else leaf for i, leaf in zip(out_ops, leaves)])
        return tree_unflatten(leaves, spec) if edited else None

    def hook_owner(self) -> tuple[str, tuple[str, ...], int] | None:
        """(address, address stack, call row) of the module whose own forward hooks are running now, when it
        is no longer the current call; else None. Called for collectives only (it walks the Python stack).

        The global post-hook that ends a call runs before the module's own forward hooks, so what those
        issue (``RowwiseParallel``'s output redistribution: a reduce_scatter or all_reduce) would land in the
        caller; like DDP's and FSDP's collectives, it belongs to the module whose call issued it.
        NB: the call's ``end_op`` stays where the call ended (before its hooks).
        """
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code in _CALL_CODES:
                module = frame.f_locals.get("self")
                if module is None or any(entry[0] == id(module) for entry in self._stack):
                    return None  # inside its forward (or its pre-hooks): the current call is right
                forward = self._forward_calls.get(id(module))
                row = self._last_call.get(id(module), -1)
                if forward is None or not forward[0]:
                    return None
                return forward[0][-1], forward[0], row
            frame = frame.f_back
        return None

    def recomputed(self) -> tuple[str, tuple[str, ...]] | None:
        """Called for an op the engine runs with grad enabled: (address, address stack) when it is checkpoint
        recomputation, None when it is not (a ``create_graph=True`` backward).

        Recomputation runs inside a module call that started in the engine (``recompute_calls``: that call's
        stack), or with ``torch.utils.checkpoint`` on the Python stack: a checkpointed function that is not a
        module's ``__call__``. When it is a module's method (transformers checkpoints ``partial(forward, self)``;
        ``checkpoint(self._block, x)``), no module hook fired: the owner is the innermost module whose method
        runs between the op and ``torch.utils.checkpoint``, named as in its forward call; a free function's ops
        keep the stack open at the time."""
        if self.recompute_calls:
            return self.current_address, self.address_stack
        methods = []  # frames that may be a module's method, innermost first: looked into only under checkpoint
        # From the caller: Recorder.on_op (not a module's method), or the op's own caller when the compiled
        # per-op path asks, which has no Python frame.
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if code.co_filename == _CHECKPOINT_FILE:
                for method in methods:
                    module = method.f_locals.get(method.f_code.co_varnames[0])  # whatever its name
                    forward = (
                        self._forward_calls.get(id(module)) if isinstance(module, torch.nn.Module) else None
                    )
                    if forward is not None and forward[0]:
                        return forward[0][-1], forward[0]
                return self.current_address, self.address_stack
            if code.co_argcount:
                methods.append(frame)
            frame = frame.f_back
        return None

    def _set_current(self) -> None:
        if self._stack:
            _, row, stack, source, builtin = self._stack[-1]
            address = stack[-1]
        else:
            row, stack, source, builtin, address = -1, (), "", False, ""
        self.current_call = row
        self.current_address = address
        self.address_stack = stack
        self.current_source = source
        self.current_builtin = builtin
        self.current = (address, stack, row, builtin, source)

    def close(self) -> None:
        """Ends calls still open (the forward raised) at the current op count; untags the modules' tensors."""
        while self._stack:
            _, row, _, _, _ = self._stack.pop()
            if row >= 0:
                self.calls["end_op"][row] = self._recorder.n_ops
        self.recompute_calls = 0
        self._set_current()
        # An in-place op on a parameter or buffer (a step counter's add_, BatchNorm's running stats, an
        # optimizer step) tags it like any op output; the tag must not stay on the user's model.
        token = self._recorder.token
        for ref in self._modules.values():
            mod = ref()
            if mod is None:
                continue
            for t in (*mod._parameters.values(), *mod._buffers.values()):
                tag = getattr(t, TAG, None)
                if tag is not None and tag[0] == token:
                    delattr(t, TAG)

    def open_call_rows(self) -> list[int]:
        """Module-call table rows of the calls running now (a post-mortem ends them where the window stands)."""
        return [entry[1] for entry in self._stack if entry[1] >= 0]

    def live_modules(self) -> list[torch.nn.Module]:
        """The modules the capture has seen that are still alive."""
        return [m for m in (ref() for ref in self._modules.values()) if m is not None]

    def owner_of(self, param: torch.Tensor | None) -> tuple[str, tuple[str, ...]]:
        """(address, address stack) of the innermost called module owning ``param`` (for a backward op that
        accumulates its gradient); ``("", ())`` when unknown."""
        if param is None:
            return "", ()
        name = self.params.get(id(param))
        if name is None:
            return "", ()
        # The nearest enclosing module that was called: a parameter of a module that is used without being
        # called (MultiheadAttention's out_proj) belongs with the ops that read it, in its caller.
        address = name
        while address:
            address = address.rpartition(".")[0]
            stack = self.stack_of_address.get(address)
            if stack is not None:
                return address, stack
        return "", ()

    def live_module(self, address: str) -> torch.nn.Module | None:
        """The module object behind ``address`` if it is still alive."""
        for mid, name in self.names.items():
            if name == address:
                ref = self._modules.get(mid)
                return ref() if ref is not None else None
        return None
