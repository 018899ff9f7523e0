"""Interventions and replay benchmark (issue 14, Performance), on the ResNet-18-like model, in one process.

Workload: ``benchmarks/models.py``'s ResNet-18 layout on 2x3x224x224 (CPU, 2 threads, eval, no_grad).

Modes, each measured between two runs of the mode it is compared with (within a round; the pairs' order
rotates from round to round), its ratio taken to the faster of the two: ``plain`` forward; ``metadata`` -- ``tl.trace(save=None)``; ``module edit`` -- the same with a
steering vector added to ``layer3``'s output (``intervene=tl.when(tl.module("layer3"), tl.add(v))``);
``op edit`` -- the same vector added to one op's output (an op-site edit: every op is matched against it);
``replay`` -- ``trace.replay()`` of a ``save=True`` trace taken once. Each measurement is the fastest of 3
blocks of calibrated repetitions (``bench_trace.best_of``); median and min of the per-round ratios printed:

- module edit / metadata: target <= 1.0 (an intervention on one module costs no more than the metadata-only
  trace; the noise of this machine is a few percent either way);
- replay / plain: target <= 1.5.

``metadata (again) / metadata`` divides the metadata-only trace by itself: how far from 1.0 noise alone moves
a ratio here. The Python/C function calls of one run of each (``sys.setprofile``) say, without noise, how much
work an edit adds.

Run: ``.venv/bin/python benchmarks/bench_edits.py [--rounds 9]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_trace import best_of, calibrate, plain_fn  # noqa: E402
from models import ResNet18  # noqa: E402

import tl_dist as tl  # noqa: E402

TARGETS = {"module edit / metadata": 1.0, "replay / plain": 1.5}
# (mode, the mode it is divided by), each measured between two runs of its base; the order rotates per round.
PAIRS = [
    ("module edit", "metadata"),
    ("op edit", "metadata"),
    ("metadata (again)", "metadata"),  # the same call: the noise floor of these ratios on this machine
    ("metadata", "plain"),
    ("replay", "plain"),
]


def modes(model: torch.nn.Module, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    steer = torch.full((256, 1, 1), 0.01)
    module_edit = tl.when(tl.module("layer3"), tl.add(steer))
    op_edit = tl.when(tl.label("relu__13"), tl.add(steer))  # layer3.1's last in-place ReLU: the same value
    with torch.no_grad():
        saved = tl.trace(model, x)
        check = tl.trace(model, x, save=None, intervene=module_edit)
        by_op = tl.trace(model, x, save=None, intervene=op_edit)
    assert check.edited and by_op.edited == {"relu__13": repr(op_edit.edit)}, (check.edited, by_op.edited)
    replayed = saved.replay()
    assert torch.equal(replayed.output, saved.output) and not replayed.metadata["not_replayed"]

    def traced(**options: object) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return tl.trace(model, x, save=None, **options)

        return run

    return {
        "plain": plain_fn(model, x),
        "metadata": traced(),
        "metadata (again)": traced(),
        "module edit": traced(intervene=module_edit),
        "op edit": traced(intervene=op_edit),
        "replay": saved.replay,
    }


def calls(fn: Callable[[], object]) -> int:
    """Python and C function calls one run of ``fn`` makes: a deterministic measure of the work it adds."""
    count = 0

    def profiler(frame: object, event: str, arg: object) -> None:
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(profiler)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model, x = ResNet18().eval(), torch.randn(2, 3, 224, 224)
    fns = modes(model, x)
    reps = {name: calibrate(fn) for name, fn in fns.items()}  # also the warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    ratios: dict[str, list[float]] = {f"{mode} / {base}": [] for mode, base in PAIRS}
    for r in range(args.rounds):
        pairs = PAIRS[r % len(PAIRS) :] + PAIRS[: r % len(PAIRS)]
        for mode, base in pairs:
            # The base right before and right after: the faster of the two is the least disturbed.
            before = best_of(fns[base], reps[base])
            t = best_of(fns[mode], reps[mode])
            after = best_of(fns[base], reps[base])
            times[mode].append(t)
            times[base] += [before, after]
            ratios[f"{mode} / {base}"].append(t / min(before, after))
    plain_ms = 1e3 * statistics.median(times["plain"])
    print(f"ResNet-18 2x3x224x224, {args.rounds} rounds; plain forward {plain_ms:.1f} ms")
    print(f"{'ratio':<30}{'median':>8}{'min':>8}{'target':>8}")
    for name, values in ratios.items():
        target = f"{TARGETS[name]:.2f}" if name in TARGETS else "-"
        print(f"{name:<30}{statistics.median(values):>8.3f}{min(values):>8.3f}{target:>8}")
    counts = {name: calls(fns[name]) for name in ("metadata", "module edit", "op edit")}
    print("function calls of one run (deterministic): " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
