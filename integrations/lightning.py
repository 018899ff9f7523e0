"""Lightning: ``TelemetryCallback`` records the real training step on every rank, logs telemetry, merges at the end.

Example:
    >>> from tl_dist.integrations.lightning import TelemetryCallback
    >>> trainer = L.Trainer(strategy="ddp", devices=2, callbacks=[TelemetryCallback(every_n_steps=50)])
    >>> trainer.fit(model)
    # shards: <trainer.log_dir>/tl_dist/rank00001/step00000050.h5; merged.h5, timeline.json, graph.svg beside them

A window is one optimizer step (all its accumulated micro-batches) of the training itself -- not a re-run of a
batch -- captured on every rank at the same ``trainer.global_step``. Everything the callback logs is defined in
``docs/lightning.md``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

import torch

from tl_dist.errors import TlDistError, missing_extra

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.throughput import get_available_flops
    from lightning.pytorch.utilities import rank_zero_warn
    from typing_extensions import override
except ImportError as exc:  # the tl_dist[lightning] extra is not installed
    raise missing_extra("tl_dist.integrations.lightning", "lightning", exc) from exc

import tl_dist as tl
from tl_dist.options import check_options
from tl_dist.pipeline import finish_run
from tl_dist.sinks import check_sinks
from tl_dist.step_facts import nonfinite_origin
from tl_dist.store import shard_path

from ._step_metrics import (
    SCALARS,
    failed_scalars,
    module_addresses,
    modules_key,
    nonfinite_message,
    rank_arrivals,
    rank_module_values,
    rank_scalars,
    step_metrics,
    step_straggler,
)

__all__ = ["NonFiniteError", "TelemetryCallback"]

ON_NONFINITE = ("warn", "raise", "stop")
SUPERSEDED = "superseded"
"""Folder (under the shard folder) where shards of steps a fit runs again are moved, never overwritten."""
log = logging.getLogger("lightning.pytorch.callbacks.tl_dist")
"""Where the end-of-fit merge reports (its line, the findings table, the files written): under Lightning's own
logger, so it shows where Lightning's messages show (rank 0)."""
_PRECISION_DTYPES = {"64": torch.float64, "32": torch.float32, "16": torch.float16, "bf16": torch.bfloat16}


class NonFiniteError(TlDistError, ArithmeticError):
    """A captured step recorded a NaN (or an infinite gradient) and ``on_nonfinite="raise"``."""


class TelemetryCallback(pl.Callback):
    """Capture every ``every_n_steps``-th optimizer step on every rank; log its telemetry; merge the ranks at the end.

    Args:
        every_n_steps: capture the optimizer steps whose ``trainer.global_step`` is a multiple of this (the
            window of the batch, or batches, that run such a step; named by its first step).
        out_dir: shard folder; default ``<trainer.log_dir>/tl_dist`` (resuming from a checkpoint: the folder of
            the checkpointed run). Shards: ``rank{R:05d}/step{global_step:08d}.h5``.
        options: what a window records (:class:`tl_dist.CaptureOptions`); with ``stats`` on, module output and
            gradient norms are logged and non-finite values are caught.
        sinks: more consumers of the windows (:class:`tl_dist.Sink`), e.g. an OpenTelemetry sink.
        log: log the step telemetry to the trainer's loggers (names in ``docs/lightning.md``).
        merge_on_end: at the end of ``fit``, rank 0 merges the shards into ``merged.h5``, ``timeline.json``
            (Perfetto) and ``graph.svg`` (with Graphviz), and logs the findings (:data:`log`); the same pipeline
            as ``tl-dist merge`` (:func:`tl_dist.pipeline.finish_run`).
        on_nonfinite: with statistics on, what a NaN (or an infinite gradient) on any rank does: ``"warn"``,
            ``"raise"`` (:class:`NonFiniteError` on every rank) or ``"stop"`` (``trainer.should_stop``).
        peak_flops: peak FLOP/s of one device, for ``tl/mfu``; default from Lightning's
            ``get_available_flops`` for the device and precision (none on CPU).

    Example:
        >>> cb = TelemetryCallback(every_n_steps=100, options=tl.CaptureOptions(stats=True), on_nonfinite="stop")
        >>> L.Trainer(callbacks=[cb], logger=CSVLogger("logs")).fit(model)

    The callback arms a session of its own (``tl.armed_session``): a ``tl.arm`` the user holds keeps its folder,
    sinks and options through the fit, and plain ``tl.capture`` windows keep going to it.

    Caveats: validation that runs between the micro-batches of a captured step is recorded in its window; the
    telemetry of a window is computed once, on the training thread right after it, and the same summary goes to
    the sinks (the shard is written in the background).
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        *,
        out_dir: str | os.PathLike | None = None,
        options: tl.CaptureOptions = tl.CaptureOptions(),  # noqa: B008 - frozen, so one shared default is safe
        sinks: Any = (),
        log: bool = True,
        merge_on_end: bool = True,
        on_nonfinite: str = "warn",
        peak_flops: float | None = None,
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive int, got {every_n_steps!r}")
        if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
            raise ValueError(
                f"out_dir must be a str or os.PathLike folder (or None), got {type(out_dir).__name__}"
            )
        check_options(options)
        for name, value in (("log", log), ("merge_on_end", merge_on_end)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
        if peak_flops is not None and (
            isinstance(peak_flops, bool)
            or not isinstance(peak_flops, (int, float))
            or not 0 < peak_flops < math.inf
        ):
            raise ValueError(
                f"peak_flops must be a positive number (FLOP/s of one device) or None, got {peak_flops!r}"
            )
        self.every_n_steps = every_n_steps
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.options = options
        self.sinks = check_sinks(sinks)
        self.log = log
        self.merge_on_end = merge_on_end
        self.on_nonfinite = on_nonfinite
        self.peak_flops = float(peak_flops) if peak_flops is not None else None
        self._captured_steps: list[int] = []
        self._shard_dir: Path | None = None
        self._restored_dir: str | None = None
        # strategy="ddp_spawn" fits in spawned copies of this callback, and Lightning hands nothing of theirs
        # back: their local rank 0 writes shard_dir and captured_steps to this file at the end of the fit, and
        # the launching process reads (and removes) it when either attribute is next read there.
        self._origin_pid = os.getpid()
        self._handoff = Path(tempfile.gettempdir()) / f"tl_dist-fit-{uuid.uuid4().hex}.json"
        weakref.finalize(self, _remove, self._handoff)  # never read: removed with the callback, or at exit
        self._reset()

    @property
    def shard_dir(self) -> Path | None:
        """Where this fit's shards go (resolved at train start); after a ``ddp_spawn`` fit, in the launching
        process too."""
        self._collect()
        return self._shard_dir

    @shard_dir.setter
    def shard_dir(self, value: Path | None) -> None:
        self._shard_dir = value

    @property
    def captured_steps(self) -> list[int]:
        """The steps captured by this run (across resumes); after a ``ddp_spawn`` fit, in the launching process
        too."""
        self._collect()
        return self._captured_steps

    @captured_steps.setter
    def captured_steps(self, value: list[int]) -> None:
        self._captured_steps = value

    def _collect(self) -> None:
        """Take the state a spawned fit handed back, if one did (launching process only)."""
        if os.getpid() != self._origin_pid:
            return
        try:
            text = self._handoff.read_text()
        except FileNotFoundError:
            return
        _remove(self._handoff)
        state = json.loads(text)  # what state_dict() said in the worker (not a resume: _restored_dir stays)
        self._captured_steps = [int(s) for s in state["captured_steps"]]
        self._shard_dir = Path(state["shard_dir"]) if state["shard_dir"] else None

    def _hand_back(self, trainer: pl.Trainer) -> None:
        """In a spawned worker (local rank 0 of its node), write the state the launching process reads."""
        if os.getpid() == self._origin_pid or trainer.local_rank != 0:
            return
        tmp = self._handoff.with_name(f"{self._handoff.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.state_dict()))
        os.replace(tmp, self._handoff)  # whole or not at all

    def _reset(self) -> None:
        self._cap: Any = None  # the open tl.capture window
        self._window_step = -1
        self._session: Any = None  # this fit's own armed session (tl.armed_session), while armed
        self._at_boundary = True  # the next batch is the first micro-batch of an optimizer step
        self._batch_start_step = -1
        self._boundary_step = -1  # global_step when the running window (or optimizer step's batches) began
        # Optimizer steps one window holds, as last seen: several for manual optimization with several
        # optimizers (a GAN's two steps per batch), so a window that will contain a due step is opened.
        self._steps_per_window = 1
        self._next_due = 0
        self._peak: float | None = None
        self._timed: tuple[str, ...] = ()
        self._every: tuple[str, ...] = ()
        self._children: set[str] = set()
        self._key = 0.0

    # -- fit lifecycle ------------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After checkpoint restoration (global_step and this callback's state are back), on every rank:
        # trainer.log_dir and broadcast are collectives.
        self._reset()
        out = self._resolve_dir(trainer)
        step = trainer.global_step
        tag = trainer.strategy.broadcast(time.strftime("%Y%m%d-%H%M%S"))
        _set_aside(out, trainer.global_rank, trainer.world_size, step, tag)
        self.captured_steps = [s for s in self.captured_steps if s < step]
        self._peak = self.peak_flops or _device_peak(trainer)
        self._session = tl.armed_session(
            out,
            sinks=self.sinks,
            options=self.options,
            peak_flops=self._peak,
            # The summary is needed on the training thread: computed there once, handed on to the sinks.
            summarize_on_close=(self.log and bool(trainer.loggers)) or self.options.stats is not None,
        )
        self.shard_dir = out
        self._next_due = -(-step // self.every_n_steps) * self.every_n_steps  # first multiple >= step
        self._timed, self._every = module_addresses([name for name, _ in pl_module.named_modules()])
        self._children = {name for name, _ in pl_module.named_children()}
        self._key = modules_key(self._timed, self._every)

    def _resolve_dir(self, trainer: pl.Trainer) -> Path:
        if self.out_dir is not None:
            return self.out_dir
        log_dir = trainer.log_dir  # broadcast from rank 0: every rank must ask
        default = str(Path(log_dir if log_dir is not None else trainer.default_root_dir) / "tl_dist")
        # A resumed run goes on in the shard folder of the run it resumes, when that folder is still there
        # (rank 0 decides: on several nodes the others may not see it).
        restored = self._restored_dir
        chosen = restored if trainer.is_global_zero and restored and Path(restored).is_dir() else default
        return Path(trainer.strategy.broadcast(chosen))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        self._batch_start_step = step
        if self._at_boundary:
            self._boundary_step = step
        due = step + self._steps_per_window - 1 >= self._next_due  # the steps it will hold reach a multiple
        if self._session is not None and self._cap is None and self._at_boundary and due:
            cap = self._session.capture(step=step, root=pl_module)
            cap.__enter__()
            self._cap, self._window_step = cap, step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # An optimizer step ran in this batch exactly when global_step moved (automatic and manual optimization;
        # accumulating micro-batches leave it unchanged).
        stepped = trainer.global_step != self._batch_start_step
        self._at_boundary = stepped
        if stepped:
            self._steps_per_window = trainer.global_step - self._boundary_step
        if self._cap is not None and stepped:
            self._close_window(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._cap is not None:  # training ended inside a step (manual optimization that never stepped)
            self._close_window(trainer)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._hand_back(trainer)
        cap, self._cap = self._cap, None
        if cap is not None:
            # The error ended the window: arm's machinery writes its post-mortem shard now, synchronously,
            # and the partial trace travels with the error (exception.tl_trace).
            cap.__exit__(type(exception), exception, exception.__traceback__)
        self._disarm()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._session is None:
            return
        if self._cap is not None:
            self._close_window(trainer)
        if not self._session.flush():
            rank_zero_warn(
                f"tl_dist: rank {trainer.global_rank}: shards were still being written after the timeout"
            )
        trainer.strategy.barrier("tl_dist.merge")  # every rank's shards are on disk
        try:
            if self.merge_on_end and trainer.is_global_zero and self.captured_steps:
                self._merge(trainer)
        finally:
            self._disarm()
            self._hand_back(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._disarm()  # a fit that ended without on_fit_end

    def _disarm(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()

    # -- state --------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "captured_steps": list(self.captured_steps),
            "shard_dir": str(self.shard_dir) if self.shard_dir is not None else None,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.captured_steps = [int(s) for s in state_dict.get("captured_steps", ())]
        self._restored_dir = state_dict.get("shard_dir")

    # -- one window ---------------------------------------------------------------------------------------
    def _close_window(self, trainer: pl.Trainer) -> None:
        cap, self._cap = self._cap, None
        cap.__exit__(None, None, None)  # hands the trace to the shard writer (background)
        step = self._window_step
        self.captured_steps.append(step)
        last = max(trainer.global_step - 1, step)  # the window's last optimizer step
        self._next_due = (last // self.every_n_steps + 1) * self.every_n_steps
        statistics = self.options.stats is not None
        logging = self.log and bool(trainer.loggers)
        if not (logging or statistics):
            return
        # Outside the window: the gathers below are not part of the recorded step. The window's summary was
        # computed once as it closed (the sinks get the same one).
        telemetry = cap.window.telemetry
        error = cap.window.telemetry_error
        try:
            if error is not None:
                raise error
            scalars = rank_scalars(telemetry, self._key)
        except Exception as exc:  # noqa: BLE001 - a telemetry failure must not end the training
            rank_zero_warn(f"tl_dist: could not summarise step {step}: {type(exc).__name__}: {exc}")
            telemetry, scalars = None, failed_scalars()
        rows = _gather(trainer, scalars)
        key_at = SCALARS.index("modules_key")
        modules = None
        if all(row[key_at] == self._key for row in rows) and (self._timed or self._every):
            modules = _gather(trainer, rank_module_values(telemetry, self._timed, self._every))
        if logging:
            arrivals = _gather(trainer, rank_arrivals(telemetry, cap.trace.metadata), torch.int64)
            late = step_straggler(step, arrivals)
            for sink in self.sinks:  # e.g. OtelSink: the tl.step.straggler_* gauges (Prometheus)
                on_straggler = getattr(sink, "on_straggler", None)
                if on_straggler is not None:
                    on_straggler(late)
            metrics = step_metrics(rows, modules, self._timed, self._every, statistics=statistics, late=late)
            _log(trainer, metrics, step)
        if statistics:
            self._check_nonfinite(trainer, step, rows, telemetry)

    def _check_nonfinite(
        self, trainer: pl.Trainer, step: int, rows: list[list[float]], telemetry: Any
    ) -> None:
        flag = SCALARS.index("nonfinite")
        bad = [r for r, row in enumerate(rows) if row[flag]]
        if not bad:
            return
        mine = None
        if telemetry is not None and telemetry.first_nonfinite is not None:
            mine = dict(telemetry.first_nonfinite, rank=trainer.global_rank)
        # Every rank reports (and acts on) the same: the rank where it arose (step_facts.nonfinite_origin).
        kinds = {r: "collective" if rows[r][flag] == 1.0 else "op" for r in bad}
        first = trainer.strategy.broadcast(mine, src=nonfinite_origin(kinds))
        message = nonfinite_message(step, bad, first)
        if self.on_nonfinite == "raise":
            raise NonFiniteError(message)
        rank_zero_warn(message)
        if self.on_nonfinite == "stop":
            trainer.should_stop = True

    # -- end of fit ---------------------------------------------------------------------------------------
    def _merge(self, trainer: pl.Trainer) -> None:
        out = self.shard_dir
        try:
            g = finish_run(
                out,
                merged=out / "merged.h5",
                timeline=out / "timeline.json",
                graph=True,
                clusters=self._children,
                logger=log,
            ).merged
        except TlDistError as exc:
            rank_zero_warn(f"tl_dist: could not merge the shards in {out}: {exc}")
            return
        metrics = {"tl/findings": float(len(g.findings))}
        stragglers = g.stragglers()
        if len(stragglers):
            caused = stragglers.groupby("rank")["caused_wait_ns"].sum()
            metrics["tl/top_straggler"] = float(caused.idxmax())
        if self.log:
            _log(trainer, metrics, trainer.global_step)


# -- helpers ------------------------------------------------------------------------------------------------
def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _gather(trainer: pl.Trainer, values: list, dtype: torch.dtype = torch.float64) -> list[list]:
    """Every rank's ``values`` (rank order), gathered with the strategy."""
    tensor = torch.tensor(values, dtype=dtype, device=trainer.strategy.root_device)
    gathered = trainer.strategy.all_gather(tensor)
    if gathered.dim() == 1:  # a single-device strategy returns the tensor itself
        gathered = gathered.unsqueeze(0)
    return gathered.cpu().tolist()


def _log(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
        logger.save()  # the window's row is on disk now, also when the fit dies later


def _device_peak(trainer: pl.Trainer) -> float | None:
    dtype = _PRECISION_DTYPES.get(str(trainer.precision).split("-")[0])
    if dtype is None:
        return None
    peak = get_available_flops(trainer.strategy.root_device, dtype)
    return float(peak) if peak else None


def _set_aside(out: Path, rank: int, world_size: int, from_step: int, tag: str) -> None:
    """Move the shards of steps >= ``from_step`` (a run this fit resumes, or an earlier run in the same folder,
    went past them) to ``out/superseded/<tag>/``, so the fit never overwrites them and the merge sees one run.
    Each rank moves its own; rank 0 also the folders of ranks beyond the world size."""
    ranks = [rank]
    if rank == 0 and out.is_dir():
        ranks += [
            int(p.name[4:])
            for p in out.glob("rank*")
            if p.name[4:].isdigit() and int(p.name[4:]) >= world_size
        ]
    for r in ranks:
        folder = shard_path(out, r, 0).parent
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("step*.h5")):
            number = path.stem[4:]
            if not number.isdigit() or (int(number) < from_step and r < world_size):
                continue
            target = out / SUPERSEDED / tag / folder.name / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(path), str(target))
