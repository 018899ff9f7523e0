"""Capture of a torch.compile'd training step: captured-compiled vs uncaptured-compiled vs eager, side by side.

One process, one model per workload (the compiled one wraps it, so all modes run the same parameters). Modes
are interleaved within each round (compiled, window, compiled, eager, compiled) so that load from other
processes hits every mode alike; each captured step and each eager step is divided by the faster of the two
uncaptured compiled steps bracketing it. The script prints the median (and min) of those ratios over rounds:

- ``window / compiled``: ``tl.capture()`` around the compiled step (regions as ops). Target <= 1.10x.
- ``eager / compiled``: the same step run eagerly (what a window used to make of a compiled model).

Each ratio is printed on two clocks: wall time, and the process's CPU time (all threads), which load from other
processes on a shared machine disturbs far less (it still counts the same work).

It also checks, once, that the window compiled nothing (Dynamo's counters) and recorded compiled regions.

Run: ``OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_compile.py [--rounds 7] [--only mlp]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import mlp, transformer  # noqa: E402

import tl_dist as tl  # noqa: E402

TARGET = 1.10


def _workloads() -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    return {
        "mlp": (mlp().train(), torch.randn(64, 784)),
        "transformer": (transformer().train(), torch.randn(4, 128, 256)),
    }


def _step(fn, model: torch.nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    fn(x).float().pow(2).mean().backward()


def _timed(mode: str, compiled, model: torch.nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one step in ``mode``."""
    t0, c0 = time.perf_counter(), time.process_time()
    if mode == "window":
        with tl.capture():
            _step(compiled, model, x)
    else:
        _step(compiled if mode == "compiled" else model, model, x)
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=["mlp", "transformer"])
    args = parser.parse_args()
    tl.watch_compiles()
    for name, (model, x) in _workloads().items():
        if args.only and name != args.only:
            continue
        compiled = torch.compile(model)
        t0 = time.perf_counter()
        for _ in range(2):  # compiles forward and backward, then a warm run
            _step(compiled, model, x)
        compile_s = time.perf_counter() - t0
        for mode in ("window", "eager"):  # warm up the other modes too
            _timed(mode, compiled, model, x)
        frames = dict(counters["frames"])
        with tl.capture() as cap:
            _step(compiled, model, x)
        assert dict(counters["frames"]) == frames, "the window compiled something"
        kinds = cap.trace.columns["kind"]
        regions = kinds.count("compiled")
        ratios: dict[tuple[str, int], list[float]] = {(m, c): [] for m in ("window", "eager") for c in (0, 1)}
        plain: list[float] = []
        for _ in range(args.rounds):
            before = _timed("compiled", compiled, model, x)
            window = _timed("window", compiled, model, x)
            middle = _timed("compiled", compiled, model, x)
            eager = _timed("eager", compiled, model, x)
            after = _timed("compiled", compiled, model, x)
            plain.append(min(before[0], middle[0], after[0]))
            for c in (0, 1):
                ratios["window", c].append(window[c] / min(before[c], middle[c]))
                ratios["eager", c].append(eager[c] / min(middle[c], after[c]))
        window_med = statistics.median(ratios["window", 1])
        line = (
            f"{name:12s} compile {compile_s:5.1f}s  compiled step {statistics.median(plain) * 1e3:.2f} ms  "
            f"{len(kinds)} ops, {regions} compiled regions"
        )
        for mode in ("window", "eager"):
            line += f"\n  {mode}/compiled median: CPU {statistics.median(ratios[mode, 1]):.3f}x"
            line += f" wall {statistics.median(ratios[mode, 0]):.3f}x (min CPU {min(ratios[mode, 1]):.3f}x)"
        print(
            line
            + f"\n  target: window within {TARGET:.2f}x (CPU) {'ok' if window_med <= TARGET else 'MISSED'}"
        )


if __name__ == "__main__":
    main()
