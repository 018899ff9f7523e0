"""Instructions per op of a captured training step, counted by valgrind: the window's cost without the noise.

On a shared machine two runs of the same step differ by more than a per-op change of a few hundred ns, so
wall-clock A/Bs cannot tell whether a change to the recorder's hot path helps. Instruction counts can. This
script runs the step of ``bench_telemetry.py`` (forward, backward, SGD with momentum) on a small model, where
Python per op dominates, under valgrind's cachegrind for each mode, twice (``--steps`` apart), and prints the
difference per step and per op, so start-up (importing torch) cancels. With every thread pool at one thread
and a fixed hash seed, two runs of the same code agree to ~0.01% (47,828 and 47,827 instructions per op).
A change elsewhere in the package moves objects in memory and can shift the count by ~0.4% (moving one
function to another module read 353 fewer per op), so differences under ~0.5% say nothing:

- ``plain``: the step alone; ``floor``: in a pass-through TorchDispatchMode (the least any dispatcher-level
  tracer costs); ``window``: in ``tl.capture()`` (the telemetry default).
- instructions per op of each, window / floor and floor / plain as ratios, and (window - floor) per op: what
  tl_dist's own code costs for each op, the number a hot-path change should lower.

``--model mlp`` counts ``tl.trace(save=True)`` of a small MLP's forward instead (``window``), against the floor
that keeps every output and copies a kept one before an in-place write (``floor``): the half of issue 23's
target 2 where the window's fixed cost weighs most.

Instructions are not time (cache misses and branch mispredictions are not counted), but on the same model and
machine fewer instructions for the same work has meant less time. Each valgrind run takes 1-3 minutes (torch's
import dominates); two run at once.

Run: ``.venv/bin/python benchmarks/bench_instructions.py [--model transformer|resnet|wide|mlp] [--steps 10]
[--modes floor window]``
(needs ``valgrind``: ``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

MODES = ("plain", "floor", "window")


def worker(mode: str, model_name: str, steps: int) -> None:
    """Runs ``steps`` steps of ``mode`` after three of warm-up (one torch thread: no pool threads counted).
    The measured steps run inside ``itertools.starmap``: ``bench_cache.py`` has callgrind collect only them.
    ``wide`` is the transformer on 1024x16 tokens, whose 2 MB activations do not fit a core's L2."""
    import torch
    from torch import nn

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_telemetry import _run, _step
    from models import ResNet18

    import tl_dist as tl

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if model_name == "mlp":
        _trace_worker(mode, steps)
        return
    if model_name in ("transformer", "wide"):
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
        model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).train()
        x = torch.randn(2, 8, 32) if model_name == "transformer" else torch.randn(1024, 16, 32)
    else:
        # A batch of 2: BatchNorm refuses one value per channel in training.
        model, x = ResNet18(num_classes=10).train(), torch.randn(2, 3, 32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for _ in range(3):
        _run(mode, model, opt, x)
    with tl.capture() as cap:
        _step(model, opt, x)
    print(f"ops {len(cap.trace)}", file=sys.stderr)
    del cap
    list(itertools.starmap(_run, [(mode, model, opt, x)] * steps))


def _trace_worker(mode: str, calls: int) -> None:
    """``--model mlp``: ``calls`` forwards of a small MLP (bench_trace.py's, 64 wide: the kernels' share is
    small) in eval and no_grad: plain; in the floor that keeps every output and copies a kept one before an
    in-place write (``bench_trace.py``'s last floor); in ``tl.trace(save=True)`` ("window"). A window's fixed
    cost (opening, closing, the Trace) weighs most here: 11 ops, 8 module calls."""
    import torch
    from bench_trace import passthrough_fn, plain_fn, trace_fn
    from torch import nn

    dims = (64, 64, 64, 64)
    layers: list[nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model, x = nn.Sequential(*layers, nn.Linear(dims[-1], 10)).eval(), torch.randn(4, dims[0])
    run = {
        "plain": plain_fn(model, x),
        "floor": passthrough_fn(model, x, keep=True, copy=True),
        "window": trace_fn(model, x, True),
    }[mode]
    for _ in range(3):
        run()
    print(f"ops {len(trace_fn(model, x, True)())}", file=sys.stderr)
    list(itertools.starmap(run, [()] * calls))


def instructions(mode: str, model_name: str, steps: int) -> tuple[int, int]:
    """(instructions of the whole run, ops per step) of one valgrind run."""
    cmd = [
        "valgrind",
        "--tool=cachegrind",
        "--cache-sim=no",
        "--cachegrind-out-file=/dev/null",
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        mode,
        "--model",
        model_name,
        "--steps",
        str(steps),
    ]
    # One thread everywhere: numpy's OpenBLAS and OpenMP pools spin while idle, and valgrind would count the
    # spinning (it made runs differ by several %); a fixed hash seed for the same dict layouts in every run.
    one = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **one}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    refs = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    ops = re.search(r"^ops (\d+)$", done.stderr, re.MULTILINE)
    if done.returncode != 0 or refs is None or ops is None:
        raise RuntimeError(f"valgrind run of {mode} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return int(refs.group(1).replace(",", "")), int(ops.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("transformer", "resnet", "wide", "mlp"), default="transformer")
    parser.add_argument("--steps", type=int, default=10, help="steps between the two runs of each mode")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to count")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.worker:
        worker(args.worker, args.model, args.steps)
        return
    if shutil.which("valgrind") is None:
        sys.exit("bench_instructions needs valgrind (apt-get install valgrind)")
    modes = [m for m in MODES if m in args.modes]
    runs = [(mode, n) for mode in modes for n in (2, 2 + args.steps)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        counts = dict(zip(runs, pool.map(lambda run: instructions(run[0], args.model, run[1]), runs)))
    ops = counts[runs[0]][1]
    per_step = {
        mode: (counts[(mode, 2 + args.steps)][0] - counts[(mode, 2)][0]) / args.steps for mode in modes
    }
    what = "tl.trace(save=True) forward" if args.model == "mlp" else "training step"
    print(f"{args.model} {what}, {ops} ops; instructions per step (per op), valgrind, {args.steps} steps")
    for mode in modes:
        print(f"  {mode:7s} {per_step[mode] / 1e6:9.2f} M  ({per_step[mode] / ops:8.0f} per op)")
    ratios = [("window", "floor"), ("floor", "plain"), ("window", "plain")]
    print(
        "  "
        + "; ".join(f"{a} / {b} {per_step[a] / per_step[b]:.3f}x" for a, b in ratios if {a, b} <= set(modes))
    )
    if {"window", "floor"} <= set(modes):
        own = (per_step["window"] - per_step["floor"]) / ops
        print(f"  tl_dist's own per op (window - floor): {own:.0f} instructions")


if __name__ == "__main__":
    main()
