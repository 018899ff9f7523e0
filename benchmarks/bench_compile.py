"""Capture of a torch.compile'd training step: captured-compiled vs uncaptured-compiled vs eager, side by side.

One process, one model per workload (the compiled one wraps it, so all modes run the same parameters). Modes
are interleaved within each round (compiled, window, compiled, eager, compiled) so that load from other
processes hits every mode alike; each captured step and each eager step is divided by the faster of the two
uncaptured compiled steps bracketing it. The script prints the median (and min) of those ratios over rounds:

- ``window / compiled``: ``tl.capture()`` around the compiled step (regions as ops). Target <= 1.10x.
- ``eager / compiled``: the same step run eagerly (what a window used to make of a compiled model).

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


def _timed(mode: str, compiled, model: torch.nn.Module, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    if mode == "window":
        with tl.capture():
            _step(compiled, model, x)
    else:
        _step(compiled if mode == "compiled" else model, model, x)
    return time.perf_counter() - t0


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
        ratios: dict[str, list[float]] = {"window": [], "eager": []}
        plain: list[float] = []
        for _ in range(args.rounds):
            before = _timed("compiled", compiled, model, x)
            window = _timed("window", compiled, model, x)
            middle = _timed("compiled", compiled, model, x)
            eager = _timed("eager", compiled, model, x)
            after = _timed("compiled", compiled, model, x)
            plain.append(min(before, middle, after))
            ratios["window"].append(window / min(before, middle))
            ratios["eager"].append(eager / min(middle, after))
        window_med = statistics.median(ratios["window"])
        print(
            f"{name:12s} compile {compile_s:5.1f}s  compiled step {statistics.median(plain) * 1e3:.2f} ms  "
            f"{len(kinds)} ops, {regions} compiled regions  "
            f"window/compiled median {window_med:.3f}x (min {min(ratios['window']):.3f}x; target "
            f"<= {TARGET:.2f}x {'ok' if window_med <= TARGET else 'MISSED'})  eager/compiled median "
            f"{statistics.median(ratios['eager']):.3f}x (min {min(ratios['eager']):.3f}x)"
        )


if __name__ == "__main__":
    main()
