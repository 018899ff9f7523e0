"""Capture entry points: ``tl.trace(model, x)`` and the ``with tl.capture():`` window.

Ops are intercepted at the dispatcher by a private TorchDispatchMode; module boundaries come from global
forward hooks, the optimizer phase from global optimizer step hooks. All are installed on entry and removed on
exit -- also when the user's code raises -- so nothing stays behind and a plain forward afterwards costs what it
did before. An armed process (``tl.arm``) hands each closed window to its session (``_session``), which
writes shards and feeds sinks; this module knows nothing of either.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from . import _session
from ._common import TAG, environ_get, map_local, storage_key, user_stacklevel
from ._fastpath import freed, untrack_rows
from ._intervene import Interventions
from ._modes import CaptureMode
from ._recorder import ACTIVE, Recorder
from .compiled import RegionHook, watch_compiles
from .errors import TlDistError
from .options import DEFAULT_OPTIONS, CaptureOptions, check_options
from .schema import OP_FIELDS, field_names, module_name
from .trace import PendingColumns, Trace

_OPTION_NAMES = ("save", "save_grads", "stats", "source", "keep_graph", "intervene")
_LABEL = field_names(OP_FIELDS).index("label")
_DEVICE = field_names(OP_FIELDS).index("device")


def resolve_options(
    options: CaptureOptions | None, keywords: dict[str, Any], base: CaptureOptions
) -> CaptureOptions:
    """The options of a window: ``options`` as given, or ``base`` with the keyword options that were given
    (not None) applied. Both at once is an error: one way to say one thing."""
    given = {k: v for k, v in keywords.items() if v is not None}
    if options is not None:
        check_options(options)
        if given:
            raise ValueError(
                f"give either options=tl.CaptureOptions(...) or the keyword options ({', '.join(sorted(given))}), "
                "not both"
            )
        return options
    return base.updated(**given) if given else base


def _cpu_setting() -> dict[str, Any]:
    """What CPU timings depend on, for ``summary()``'s caveat (``tl_dist.views.summary.timing_caveat``): torch's
    intra-op threads, the cores this process may run on, and ``OMP_WAIT_POLICY`` ('' when unset)."""
    return {
        "torch_threads": torch.get_num_threads(),
        "cpu_cores": _cores(),
        "omp_wait_policy": environ_get("OMP_WAIT_POLICY"),
    }


_CORES: list[tuple[int, int]] = []  # (pid, cores): read once per process, a fork's child reads its own


def _cores() -> int:
    """The cores this process may run on, as its affinity said at its first window (the system call and the set
    it returns cost ~15 us a window with cold caches; a job sets its affinity before it starts)."""
    pid = os.getpid()
    if _CORES and _CORES[0][0] == pid:
        return _CORES[0][1]
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        cores = os.cpu_count() or 1
    _CORES[:] = [(pid, cores)]
    return cores


class Capture:
    """A capture window: records every op run inside ``with``; the result is ``.trace``.

    Takes the options of :class:`tl_dist.CaptureOptions`, as ``options=`` or as keywords (``save=``, ...).

    Example:
        >>> with tl.capture(save=tl.func("relu")) as cap:
        ...     loss = model(x).sum()
        >>> cap.trace["relu_1"].out
    """

    def __init__(
        self,
        options: CaptureOptions | None = None,
        *,
        roots: list[tuple[str, torch.nn.Module]] | None = None,
        **keywords: Any,
    ) -> None:
        unknown = sorted(set(keywords) - set(_OPTION_NAMES))
        if unknown:
            raise TypeError(f"Capture() got unexpected options {unknown}; options: {list(_OPTION_NAMES)}")
        self.options = resolve_options(options, keywords, DEFAULT_OPTIONS)
        self._roots = roots or []
        self._keep_node_hooks = False  # tl.trace: trace.log_backward may run backward after the window
        self.trace: Trace | None = None
        self._window: Any = None  # the armed session's window, when armed: it takes the trace on exit
        self._recorder: Recorder | None = None
        self._mode: CaptureMode | None = None
        self._interventions: Interventions | None = None
        self._regions: RegionHook | None = None

    def __enter__(self) -> Capture:
        if ACTIVE:
            raise TlDistError("a tl_dist capture is already active in this process; captures do not nest")
        opts = self.options
        recorder = self._recorder = Recorder(
            save=opts.save,
            keep_graph=opts.keep_graph,
            source=opts.source,
            roots=self._roots,
            save_grads=opts.save_grads,
            stats=opts.stats,
        )
        recorder.modules.install()
        recorder.phases.install()
        recorder.training.install()
        self._mode = CaptureMode(recorder)
        if "torch._dynamo" in sys.modules:
            watch_compiles()  # graphs compiled from now on (recompilations, later steps) get their ATen facts
        self._regions = RegionHook(recorder, self._mode)
        try:
            self._regions.install()
            self._mode.__enter__()
        except BaseException:
            self._regions.uninstall()
            recorder.modules.uninstall()
            recorder.phases.uninstall()
            raise
        if opts.intervene is not None:
            self._interventions = Interventions(recorder, opts.intervene)
            self._interventions.install()
        ACTIVE.append(self)
        self._start_ns = time.time_ns()
        self._grad_enabled = torch.is_grad_enabled()
        # Saved outputs add many small containers; letting the cyclic GC walk them mid-forward costs more
        # than the whole capture. It is switched back on (if it was on) when the window closes.
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        # The GC comes back on after the trace is built and handed on: the collection its first allocation
        # starts then finds the window's objects in their final, mostly untracked, form (columns of atoms).
        try:
            self._close(exc_type, exc, tb)
        finally:
            if self._gc_was_enabled:
                gc.enable()

    def _close(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        recorder = self._recorder
        # The last look at the collectives in flight happens inside the window: a completion first seen while
        # the trace is built would be stamped after the window's end (its span would outlast the step's).
        if recorder.collective_rows:
            recorder.comm.poll()
        end_ns = time.time_ns()
        try:
            if self._interventions is not None:
                self._interventions.uninstall()
            self._mode.__exit__(exc_type, exc, tb)
        finally:
            ACTIVE.remove(self)
            self._regions.uninstall()
            recorder.modules.uninstall()
            recorder.modules.close()
            recorder.phases.uninstall()
            # tl.trace keeps inert gradient hooks on the graph for trace.log_backward.
            recorder.training.uninstall(keep_node_hooks=self._keep_node_hooks)
        try:
            self.trace = self._build_trace(output=None, end_ns=end_ns, final=True)
            untrack_rows(recorder.rows)
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
                at = f" at {where['func']} in {module_name(where)} ({where['source']})" if where else ""
                exc.add_note(
                    f"tl_dist: {len(self.trace)} ops captured before the error{at}; see exc.tl_trace"
                )
        else:
            self._warn_unmatched()
            if recorder.modules.compiled_seen and not self._regions.rows:
                warnings.warn(
                    "tl_dist: a torch.compile'd module ran inside a capture window without running an Inductor "
                    "region (another backend, or Dynamo fell back to eager): its ops are recorded one by one, "
                    "with eager times; addresses leave out the '_orig_mod' wrapper, and submodules that ran inside "
                    "a compiled graph have no calls of their own (module hooks do not run there; docs/compile.md)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if self._window is not None:
            self._window.close(self, exc)

    @property
    def window(self) -> Any:
        """The armed session's window this capture runs in (``tl.arm``'s ``Window``); None when not armed."""
        return self._window

    def snapshot(self, frame: Any = None) -> Trace | None:
        """The trace of this capture so far, while it is still open, without ending it: what a post-mortem
        writes (``tl.arm``'s signal handlers and hang watcher call it). Module calls still open end at the
        current op; the op in flight on ``frame``'s stack (the window's thread, interrupted) becomes
        ``failed_op``. None when the capture is not open.

        Example:
            >>> with tl.capture() as cap:
            ...     y = model(x)
            ...     partial = cap.snapshot()   # the window goes on
            >>> len(partial) <= len(cap.trace)
            True
        """
        rec = self._recorder
        if rec is None or self not in ACTIVE:
            return None
        # The dispatch mode may be active (the window was interrupted): building the trace runs tensor ops
        # (statistics) that must not be recorded into it.
        with _disable_current_modes():
            trace = self._build_trace(output=None)
        # A snapshot: the window may go on (SIGUSR1), so its module table is copied before the open calls are
        # ended where the window stands now.
        trace.module_table = {name: list(col) for name, col in trace.module_table.items()}
        for row in rec.modules.open_call_rows():
            trace.module_table["end_op"][row] = rec.n_ops
        if trace.failed_op is None:
            trace.failed_op = _in_flight(frame, self._mode, rec)
        return trace

    def _build_trace(self, output: Any, end_ns: int | None = None, *, final: bool = False) -> Trace:
        """The trace of the window so far; ``final`` (the window has closed: its rows are all there) leaves the
        op table to be made on first use (``PendingColumns``), where nothing at close needs it."""
        rec = self._recorder
        modules = rec.modules
        # Collectives' completion reads the op table; so does a snapshot, whose window goes on adding rows.
        lazy = final and not rec.collective_rows
        columns = PendingColumns(rec.columns, len(rec.rows)) if lazy else rec.columns()
        metadata: dict[str, Any] = {
            "grad_enabled": self._grad_enabled,  # at the window's start: replay() runs kernels in this mode
            "clock_offset_ns": rec.clock_offset_ns,
            "window_start_ns": self._start_ns,
            "window_end_ns": end_ns if end_ns is not None else time.time_ns(),
            **_cpu_setting(),
        }
        cuda = _first_cuda_device(rec) if torch.cuda.is_initialized() else None  # none without CUDA's context
        if cuda is not None:
            metadata["device_name"] = torch.cuda.get_device_name(torch.device(cuda))
        if self._interventions is not None:
            metadata.update(self._interventions.metadata())
        if self._regions is not None and self._regions.unknown:
            metadata["compiled_unknown"] = self._regions.unknown
        _drop_freed(rec.saved, rec.training.grads, rec.rows)
        trace = Trace(
            columns,
            modules.calls,  # the tracker is done with it: no copy
            collective_table=rec.comm.columns(columns) if rec.collective_rows else None,
            saved=rec.saved,
            replay_records=rec.replay_records,
            output_of={i: tuple(a) for i, a in rec.output_of.items()},
            out_trees=modules.out_trees,
            output=output,
            metadata=metadata,
            failed_op=rec.failed_op,
            grads=rec.training.grads,
            stats_table=rec.training.finish(),
            recorder=rec,
            param_grads=rec.training.param_grads,
            interventions=self.options.intervene or (),
        )
        if self._regions is not None and self._regions.rows:
            trace.compiled_table = self._regions.table()
        return trace

    def _warn_unmatched(self) -> None:
        """A selector that matched no op of a finished window is most likely misspelt (``tl.func("relux")``)."""
        trace, opts = self.trace, self.options
        if not len(trace):
            return
        found = {  # each read only for a selector that was given: the op table may not be made yet
            "save": lambda: bool(trace.saved),
            "save_grads": lambda: bool(trace.grads) or "backward" not in trace.columns["phase"],
            "stats": lambda: bool(trace.stats_table["op"]),
        }
        for name, hit in found.items():
            selector = getattr(opts, name)
            if selector is None or selector is True or hit():
                continue
            if name == "stats" and any(selector.match(op) for op in trace):
                continue  # matched ops without floating-point values: nothing to summarise, not a typo
            warnings.warn(
                f"tl_dist: {name}={selector!r} matched no op of this window ({len(trace)} ops); "
                "check the names (trace.to_pandas() lists each op's func and module)",
                UserWarning,
                stacklevel=3,
            )
        for rule in self._interventions.unapplied() if self._interventions is not None else ():
            warnings.warn(
                f"tl_dist: intervene={rule!r} edited nothing in this window ({len(trace)} ops); check the "
                "names (trace.to_pandas() lists each op's func, module and label)",
                UserWarning,
                stacklevel=3,
            )

    def detach_from_training(self) -> None:
        """Before the trace leaves the training thread (a sink writes it later): copy the saved tensors that the
        next steps may overwrite in place -- parameters, buffers and their gradients, optimizer state, DDP
        buckets, anything an in-place op, a view or a collective returned -- so the sink sees the window's
        values. Outputs of ordinary ops are fresh memory nobody writes again: they are not copied."""
        trace = self.trace
        if not trace.saved and not trace.grads:
            return
        persistent: set[int | None] = set()
        rec = self._recorder
        for mod in rec.modules.live_modules():
            for t in (*mod._parameters.values(), *mod._buffers.values()):
                if t is not None:
                    persistent.add(storage_key(t))
                    if t.grad is not None:
                        persistent.add(storage_key(t.grad))
        for optimizer in rec.phases.optimizers:
            for state in optimizer.state.values():
                persistent.update(storage_key(v) for v in state.values() if isinstance(v, torch.Tensor))
        persistent.discard(None)
        cols = trace.columns
        with torch._C._DisableTorchDispatch(), torch.no_grad():
            for index, outs in trace.saved.items():
                fresh = not cols["inplace"][index] and cols["kind"][index] in ("compute", "factory")
                for pos, t in enumerate(outs):
                    if t is not None and not (fresh and storage_key(t) not in persistent):
                        outs[pos] = map_local(t, torch.Tensor.clone)
            for outs in trace.grads.values():
                for pos, t in enumerate(outs):
                    if t is not None and storage_key(t) in persistent:
                        outs[pos] = map_local(t, torch.Tensor.clone)


def _first_cuda_device(rec: Recorder) -> str | None:
    """The first CUDA device an op of the window ran on (its rows' device field), None if none did."""
    return next((row[_DEVICE] for row in rec.rows if row[_DEVICE].startswith("cuda")), None)


def _drop_freed(saved: dict[int, list], grads: dict[int, list], rows: list[tuple]) -> None:
    """Forgets saved outputs and gradients whose memory was freed during the window (FSDP's unsharded
    parameters, :func:`tl_dist._common.has_its_bytes`): their values are gone, and reading them would crash the
    process."""
    if not saved and not grads:
        return
    lost = []
    with torch._C._DisableTorchDispatch():
        for kept in (saved, grads):
            for index, pos in freed(kept):
                kept[index][pos] = None
                lost.append(rows[index][_LABEL])
    if lost:
        warnings.warn(
            f"{len(lost)} saved tensor(s) were freed before the window ended and are not kept: "
            f"{', '.join(dict.fromkeys(lost[:5]))}{' ...' if len(lost) > 5 else ''} (FSDP frees each unsharded "
            "parameter after use; an op that only views one, such as `t`, shares its memory)",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )


def _in_flight(frame: Any, mode: CaptureMode | None, rec: Recorder) -> dict[str, Any] | None:
    """The op a signal interrupted: the Recorder.on_op frame on the interrupted stack, if any, else the op the
    mode's compiled dispatch is running (``tl_dist._fastpath``; it has no frame of its own).

    NB: it reads that frame's locals (``info``): tracking the op in flight in the recorder would cost every op
    two attribute writes on the hot path, for a post-mortem that rarely happens (the compiled path keeps a C
    pointer instead)."""
    code = Recorder.on_op.__code__
    info = None
    while frame is not None and info is None:
        if frame.f_code is code:
            info = frame.f_locals.get("info")
            if info is None:
                return None
        frame = frame.f_back
    if info is None and mode is not None:
        info = getattr(mode.__dict__.get("__torch_dispatch__"), "running", None)
    if info is None:
        return None
    return {
        "index": rec.n_ops,
        "func": info.func,
        "aten": info.aten,
        "module": rec.modules.current_address,
        "source": "",
        "error": "in flight when the post-mortem was written",
    }


def capture(
    *,
    options: CaptureOptions | None = None,
    step: int | None = None,
    root: torch.nn.Module | None = None,
    save: Any = None,
    save_grads: Any = None,
    stats: Any = None,
    source: bool | None = None,
    keep_graph: bool | None = None,
    intervene: Any = None,
) -> Capture:
    """A window recording every op of arbitrary code: ``with tl.capture() as cap: ...``; then ``cap.trace``.

    Args:
        options: what the window records, a :class:`tl_dist.CaptureOptions`; or give its fields as the keywords
            below (not both). When ``tl.arm`` is active, options not given take the armed defaults.
        step: training step of the window. When armed, the window goes to the armed sinks (the shard writer
            writes ``rank{RRRRR}/step{step:08d}.h5``; a window counter numbers it when None).
        root: name modules by their address in ``root`` (as ``root.named_modules()`` does), whatever wrapper
            calls it (DDP, FSDP, Lightning's strategies); default: the first module called in the window is
            the root.
        save: which op outputs to keep: ``True`` all, ``None`` none (metadata only), or a selector.
        save_grads: forward ops whose output gradient (of the loss backward runs on in the window) is kept:
            ``True``, ``None`` or a selector; ``trace["relu_2"].grad``.
        stats: ops whose output statistics (mean, std, min, max, L2 norm, zero fraction, NaN and Inf counts)
            are recorded, and their gradient's when backward runs: ``True`` (every forward op but views),
            ``None`` or a selector (any op, backward and optimizer ops included). See ``trace.stats_table``.
        source: record file:line of the user code issuing each op (default True).
        keep_graph: keep saved outputs attached to autograd so a loss can be built from them (default False).
        intervene: edits applied as the code runs: ``tl.when(selector, edit)`` or a list of them, in order
            (``docs/interventions.md``).

    Example:
        >>> with tl.capture(save=tl.func("relu")) as cap:
        ...     model(x).sum().backward()
        >>> cap.trace.to_pandas()
    """
    session = _session.current()
    keywords = {
        "save": save,
        "save_grads": save_grads,
        "stats": stats,
        "source": source,
        "keep_graph": keep_graph,
        "intervene": intervene,
    }
    _check_window(step, root)
    opts = resolve_options(options, keywords, session.options if session is not None else DEFAULT_OPTIONS)
    if session is None and step is not None:
        warnings.warn(
            f"tl.capture(step={step}): the process is not armed, so nothing is written and no sink sees this "
            "window (call tl.arm(out_dir) first); the trace is still cap.trace",
            UserWarning,
            stacklevel=2,
        )
    return _open(session, opts, step, root)


def open_capture(session: _session.Session, *, step: int | None, root: torch.nn.Module | None) -> Capture:
    """A capture window of ``session`` (not the process's ``tl.arm`` session), recording its options; the
    window hands its trace to that session when it closes (``tl.armed_session(...).capture``)."""
    _check_window(step, root)
    return _open(session, session.options, step, root)


def _check_window(step: Any, root: Any) -> None:
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be a non-negative int or None, got {step!r}")
    if root is not None and not isinstance(root, torch.nn.Module):
        raise ValueError(f"root must be a torch.nn.Module or None, got {type(root).__name__}")


def _open(
    session: _session.Session | None, opts: CaptureOptions, step: int | None, root: torch.nn.Module | None
) -> Capture:
    cap = Capture(opts, roots=[("", root)] if root is not None else None)
    cap._window = session.open_window(step) if session is not None else None
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
    intervene: Any = None,
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
        intervene: edits applied as the model runs: ``tl.when(selector, edit)`` or a list of them, in order;
            ``tl.when(tl.module("layer1"), tl.zero_ablate())`` (``docs/interventions.md``).

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
    opts = DEFAULT_OPTIONS.updated(
        save=save,
        save_grads=save_grads,
        stats=stats,
        source=source,
        keep_graph=keep_graph,
        intervene=intervene,
    )
    cap = Capture(opts, roots=[("", model)])
    cap._keep_node_hooks = True
    with cap:
        output = model(*args, **(kwargs or {}))
        refs = _output_refs(cap._recorder, output)  # before the window closes and the tags go
    cap.trace.output = output
    cap.trace.output_refs = refs
    return cap.trace


def _output_refs(recorder: Recorder | None, output: Any) -> dict[int, tuple[int, int]]:
    """Output leaf -> (op, output position) of the op that produced it: a shard stores those leaves as
    references to the op's saved output, not as copies of their own."""
    if recorder is None:
        return {}
    token = recorder.token
    refs = {}
    # A model's usual output, one tensor, is its own single leaf: no pytree walk (~15 us with cold caches).
    for i, leaf in enumerate((output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0]):
        tag = getattr(leaf, TAG, None) if isinstance(leaf, torch.Tensor) else None
        if tag is not None and tag[0] == token:
            refs[i] = (tag[1], tag[2])
    return refs
