"""Training-step capture overhead: forward + backward + SGD step, captured vs plain, in the same process.

Modes, interleaved within each round (plain, window, plain, stats, plain, grads, plain) so that load from other
processes on the machine hits every mode alike; the captured modes' order rotates from round to round, so
none always follows the same one. Each captured step is divided by the faster of the two plain steps
bracketing it (as bench_trace does), and the script prints the median (and min) of those ratios over rounds:

- ``window``: ``tl.capture()`` -- per-op timing, FLOPs, phases, backward links; nothing saved. Target <= 1.15x.
- ``stats``: ``tl.capture(stats=True)`` -- plus on-device statistics of every output and gradient. <= 1.3x.
- ``grads``: ``tl.capture(save_grads=True)`` -- plus the gradient of every forward op's output. <= 1.6x.

Run: ``OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_training.py [--rounds 7] [--only resnet18]``
(``--profile`` prints where the captured step's time goes).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import ResNet18, transformer  # noqa: E402

import tl_dist as tl  # noqa: E402

TARGETS = {"window": 1.15, "stats": 1.3, "grads": 1.6}


def _workloads() -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    return {
        "resnet18": (ResNet18().train(), torch.randn(2, 3, 224, 224)),
        "transformer": (transformer().train(), torch.randn(4, 128, 256)),
    }


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()


def _timed(
    mode: str, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor
) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one step. CPU time is what this process consumed, so it is less
    distorted than wall time when other processes compete for the machine's cores."""
    t0, c0 = time.perf_counter(), time.process_time()
    if mode == "plain":
        _step(model, opt, x)
        return time.perf_counter() - t0, time.process_time() - c0
    options = {"window": {}, "stats": {"stats": True}, "grads": {"save_grads": True}}[mode]
    with tl.capture(**options) as cap:
        _step(model, opt, x)
    elapsed = time.perf_counter() - t0, time.process_time() - c0
    assert len(cap.trace) > 0
    return elapsed


def bench(name: str, model: torch.nn.Module, x: torch.Tensor, rounds: int) -> dict[str, list[float]]:
    # A deep copy per mode so that momentum buffers and BatchNorm statistics evolve the same in each.
    runs = {m: (copy.deepcopy(model), None) for m in ("plain", *TARGETS)}
    runs = {
        m: (mod, torch.optim.SGD(mod.parameters(), lr=1e-3, momentum=0.9)) for m, (mod, _) in runs.items()
    }
    for mode, (mod, opt) in runs.items():  # warm-up: first dispatch-mode use and allocator growth are slow
        _timed(mode, mod, opt, x)
        _timed(mode, mod, opt, x)
    ratios: dict[str, list[float]] = {m: [] for m in TARGETS}
    cpu_ratios: dict[str, list[float]] = {m: [] for m in TARGETS}
    plain_times: list[float] = []
    modes = list(TARGETS)
    for r in range(rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        before = _timed("plain", *runs["plain"], x)
        for mode in order:
            captured = _timed(mode, *runs[mode], x)
            after = _timed("plain", *runs["plain"], x)
            plain_times.append(after[0])
            ratios[mode].append(captured[0] / min(before[0], after[0]))
            cpu_ratios[mode].append(captured[1] / min(before[1], after[1]))
            before = after
    print(f"{name}: plain step median {statistics.median(plain_times) * 1e3:.1f} ms ({rounds} rounds)")
    for mode, values in ratios.items():
        med = statistics.median(values)
        cpu = statistics.median(cpu_ratios[mode])
        verdict = "ok" if med <= TARGETS[mode] else "MISSED"
        print(
            f"  {mode:7s} wall median {med:.3f}x  min {min(values):.3f}x  | cpu-time median {cpu:.3f}x"
            f"  | target <= {TARGETS[mode]}x  {verdict}"
        )
    return ratios


def profile(name: str, model: torch.nn.Module, x: torch.Tensor, mode: str) -> None:
    import cProfile
    import pstats

    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    _timed(mode, model, opt, x)
    prof = cProfile.Profile()
    prof.enable()
    _timed(mode, model, opt, x)
    prof.disable()
    print(f"--- {name} {mode}: top functions by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=["resnet18", "transformer"], default=None)
    parser.add_argument("--profile", choices=list(TARGETS), default=None)
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    for name, (model, x) in _workloads().items():
        if args.only and name != args.only:
            continue
        if args.profile:
            profile(name, model, x, args.profile)
        else:
            bench(name, model, x, args.rounds)


if __name__ == "__main__":
    main()
