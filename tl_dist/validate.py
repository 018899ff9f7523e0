"""Replay check of a trace: re-execute every saved op from its parents' saved outputs and compare.

This is TorchLens's validation idea applied to the columnar trace: if every saved op, fed the saved outputs of
the ops it read (and the parameters/inputs it read, kept by the recorder), reproduces its own saved output,
then the recorded graph (parents, argument order, saved values) really describes the computation.

Example:
    >>> trace = tl.trace(model, x)
    >>> report = trace.validate()
    >>> bool(report), report.checked, report.skipped
    (True, 57, 2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ._common import VALIDATE_ATOL, VALIDATE_RTOL, clone_strided, flat_outputs, local_tensor
from ._opinfo import UNINITIALISED, draws_random, mutated_tensors, op_info, unreproducible_outputs
from ._reexec import fill_args
from .errors import TlDistError, ValidationError

if TYPE_CHECKING:
    from .trace import Trace


@dataclass(frozen=True)
class Mismatch:
    """One op whose replay differs from its saved output."""

    label: str
    max_abs_diff: float
    detail: str = ""


@dataclass
class ValidationReport:
    """Result of :func:`validate`; true when no op mismatched.

    Example:
        >>> report = trace.validate()
        >>> if not report:
        ...     print(report)   # lists each mismatching op with its largest absolute difference
    """

    checked: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # label -> why it was not replayed
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """No replayed op differed from its saved output, and some op was replayed: a validation that skipped
        every op checked nothing, and does not pass (an empty trace, with nothing to skip, does)."""
        return not self.mismatches and (self.checked > 0 or not self.skipped)

    @property
    def n_skipped(self) -> int:
        return len(self.skipped)

    @property
    def n_mismatched(self) -> int:
        return len(self.mismatches)

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        if self.mismatches:
            verdict = "FAILED"
        else:
            verdict = "passed" if self.passed else "checked nothing (every op skipped)"
        lines = [
            f"validation {verdict}: {self.checked} ops replayed, {self.n_mismatched} mismatched, "
            f"{self.n_skipped} skipped"
        ]
        for m in self.mismatches:
            extra = f" ({m.detail})" if m.detail else ""
            lines.append(f"  mismatch {m.label}: max abs diff {m.max_abs_diff:.3g}{extra}")
        for label, why in self.skipped.items():
            lines.append(f"  skipped {label}: {why}")
        return "\n".join(lines)


def _compare(expected: torch.Tensor, got: torch.Tensor, atol: float, rtol: float) -> tuple[float, str] | None:
    """None when ``got`` reproduces ``expected``; else (max abs difference, what differs)."""
    if expected.shape != got.shape:
        return math.inf, f"shape {tuple(got.shape)} != saved {tuple(expected.shape)}"
    if expected.dtype != got.dtype:
        return math.inf, f"dtype {got.dtype} != saved {expected.dtype}"
    if expected.numel() == 0:
        return None
    # A DTensor's values on this rank are its local shard (comparing DTensors would need collectives).
    exp, res = local_tensor(expected).detach(), local_tensor(got).detach().to(expected.device)
    if exp.is_floating_point() or exp.is_complex():
        if torch.allclose(res, exp, atol=atol, rtol=rtol, equal_nan=True):
            return None
        # Only the elements that differ: equal infinities would give inf - inf = NaN. A NaN on one side only
        # is infinitely far from the number on the other (max() of a NaN would report NaN).
        differs = (res != exp) & ~(torch.isnan(res) & torch.isnan(exp))
        diff = (res.to(torch.complex128 if exp.is_complex() else torch.float64) - exp).abs()[differs]
        return float(diff.nan_to_num(nan=math.inf, posinf=math.inf).max()), ""
    if torch.equal(res, exp):
        return None
    return float((res.to(torch.float64) - exp.to(torch.float64)).abs().max()), ""


def _skip_reason(info: Any, expected: list | None, func: Any, args: tuple, kwargs: dict) -> str | None:
    if info.kind == "collective":
        return "collective: replaying it would need every member rank"
    if getattr(func, "communicates", False):
        return "compiled region issuing collectives: replaying it would need every member rank"
    if draws_random(info, func, args, kwargs):
        return "nondeterministic op (random numbers)"
    # An empty *size-0* tensor (BatchNorm's reserve placeholder) holds no bytes: its shape is still checked.
    if info.func in UNINITIALISED and unreproducible_outputs(info.func, expected or []):
        return "returns uninitialised memory"
    if expected is None or all(e is None for e in expected):
        return "own output not saved"
    return None


def validate(
    trace: Trace,
    *,
    raise_on_mismatch: bool = False,
    atol: float = VALIDATE_ATOL,
    rtol: float = VALIDATE_RTOL,
) -> ValidationReport:
    """Re-execute every saved op of ``trace`` from its parents' saved outputs and compare with its own.

    Replays run under ``torch.no_grad()``; tensors an op writes into are cloned first, so neither the model's
    parameters nor the trace's saved tensors change. Ops whose result is not reproducible (drawing random numbers
    for the arguments they got: dropout with ``p=0`` does not, the rule replay uses too; returning uninitialised
    memory; collectives) or whose parents' outputs were not saved are skipped, with the reason.

    Args:
        trace: a trace recorded with saved outputs (``tl.trace(model, x)`` saves all by default).
        raise_on_mismatch: raise :class:`~tl_dist.errors.ValidationError` naming the mismatching ops instead
            of only reporting them.
        atol: absolute tolerance for floating-point outputs (integer/bool outputs must match exactly).
        rtol: relative tolerance for floating-point outputs.

    Returns:
        A :class:`ValidationReport`; ``bool(report)`` is true when nothing mismatched and at least one op was
        replayed (a report that skipped every op checked nothing: false, and its text says so).

    Example:
        >>> report = tl.trace(model, x).validate()
        >>> assert report, str(report)
    """
    if not isinstance(atol, (int, float)) or isinstance(atol, bool) or atol < 0:
        raise ValueError(f"atol must be a non-negative number, got {atol!r}")
    if not isinstance(rtol, (int, float)) or isinstance(rtol, bool) or rtol < 0:
        raise ValueError(f"rtol must be a non-negative number, got {rtol!r}")
    if len(trace) and not trace._replay:
        raise TlDistError(
            "validate() has nothing to replay: the trace holds no replay information (it was captured with "
            "save=None, or loaded from a shard). Trace again in this process with save=True or a selector."
        )
    report = ValidationReport()
    labels = trace.columns["label"]
    saved = trace.saved
    edited = trace.edited
    labels_index = trace.labels
    # An op that ran after an edited op but before its edit took effect read the unedited value.
    edit_at = {labels_index[lab]: at for lab, at in trace.metadata.get("edits_applied_at", {}).items()}
    with torch.no_grad():
        for index in sorted(trace._replay):
            label = labels[index]
            func, skeleton_args, skeleton_kwargs, srcs, consts = trace._replay[index]
            info = op_info(func)
            expected = saved.get(index)
            reason = _skip_reason(info, expected, func, skeleton_args, skeleton_kwargs)
            if label in edited:
                reason = f"output replaced by an edit ({edited[label]})"
            elif edit_at and (
                early := [p for p in trace.columns["parents"][index] if edit_at.get(p, 0) > index]
            ):
                reason = f"read {labels[early[0]]} before its edit took effect"
            tensors: list[torch.Tensor] = []
            for src, const in zip(srcs, consts):
                if reason is not None:
                    break
                if src is None:
                    tensors.append(const)
                    continue
                parent = saved.get(src[0])
                value = parent[src[1]] if parent is not None and src[1] < len(parent) else None
                if value is None:
                    reason = f"input from {labels[src[0]]} (output {src[1]}) was not saved"
                else:
                    tensors.append(value)
            if reason is not None:
                report.skipped[label] = reason
                continue
            args, kwargs = fill_args(skeleton_args, skeleton_kwargs, tensors)
            written = mutated_tensors(info, args, kwargs)
            if written:
                # Write into copies: the originals are saved outputs or the model's own parameters. One copy
                # per distinct tensor, so an op reading and writing the same tensor still sees one tensor.
                copies = {id(t): clone_strided(t) for t in written}
                tensors = [copies.get(id(t), t) for t in tensors]
                args, kwargs = fill_args(skeleton_args, skeleton_kwargs, tensors)
            try:
                raw = func(*args, **kwargs)
            except Exception as exc:  # a replay that cannot run is a finding, not a crash of validate()
                report.checked += 1
                report.mismatches.append(
                    Mismatch(label, math.inf, f"replay raised {type(exc).__name__}: {exc}")
                )
                continue
            report.checked += 1
            result = flat_outputs(raw)
            # Outputs a kernel fills only for autograd (mkldnn_rnn_layer's workspace) come back undefined
            # (None) from a no_grad replay; they are the op's last outputs and are not compared.
            undefined = sum(o is None for o in raw) if type(raw) is tuple or type(raw) is list else 0
            if undefined and len(result) + undefined == len(expected):
                expected = expected[: len(result)]
            # An in-place write through a view also lists the view's base as an extra saved output (see
            # Recorder._with_written_bases); the op itself does not return it. Those values are checked by
            # the replays of the ops that read them.
            if info.mutated and len(result) < len(expected):
                expected = expected[: len(result)]
            if len(result) != len(expected):
                detail = f"{len(result)} outputs != saved {len(expected)}"
                report.mismatches.append(Mismatch(label, math.inf, detail))
                continue
            worst: tuple[float, str] | None = None
            for exp, got in zip(expected, result):
                if exp is None:
                    continue
                diff = _compare(exp, got, atol, rtol)
                if diff is not None and (worst is None or diff[0] > worst[0]):
                    worst = diff
            if worst is not None:
                report.mismatches.append(Mismatch(label, worst[0], worst[1]))
    if raise_on_mismatch and report.mismatches:
        names = ", ".join(f"{m.label} (max abs diff {m.max_abs_diff:.3g})" for m in report.mismatches)
        raise ValidationError(
            f"{len(report.mismatches)} of {report.checked} replayed ops did not reproduce their saved "
            f"output: {names}. Check in-place writes through views and custom ops in those ops' modules."
        )
    return report
