"""Cache misses per op of a captured training step between large kernels, simulated by valgrind: where the
window's time goes when instruction counts say it should not.

``bench_instructions.py`` counts instructions on a small model, where everything stays in the caches. On a
full-size step each kernel streams megabytes through the caches and evicts what the recorder touched for the
previous op: its code, the CPython and torch functions it calls, the recorder's dicts. On the transformer step
of ``bench_telemetry.py`` the window costs ~10 us per op more than the floor, where its ~12k instructions per
op would take ~3 us. This script runs a step whose activations (2 MB) do not fit a core's L2, under callgrind
with its cache simulation (32 KB L1 instruction and data caches, a 1 MB last level standing for L2), once in the
pass-through floor and once in ``tl.capture()``, and prints per op (window minus floor) the instructions, the
L1 and L2 misses, and a cost estimate: instructions + 5 cycles per L1 miss + 40 per L2 miss (a hit in L3 on
this machine kind: the latencies are assumptions, the miss counts are not). Functions of torch's kernel
library (``libtorch_cpu``) are left out: the kernels do the same work in both modes, but their vectorised
loops take other paths with other buffer alignments, which moves their counts by more than the whole
recorder costs. The top functions follow.

Not noise-free: memory layout moves with every build and run, and two runs of nearly the same code have
differed by 4% in the total (18,619 and 19,361 estimated cycles per op). Read changes function by function,
and totals only beyond ~5%. Each run takes ~10 minutes (the two modes run at once).

Run: ``.venv/bin/python benchmarks/bench_cache.py [--steps 2] [--top 15]`` (needs ``valgrind``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

EVENTS = ("Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")
L1_MISS_CYCLES, L2_MISS_CYCLES = 5, 40
CACHES = ["--I1=32768,8,64", "--D1=32768,8,64", "--LL=1048576,16,64"]
KERNEL_LIBRARY = "libtorch_cpu"


def simulate(mode: str, steps: int, out_dir: str) -> tuple[dict[str, list[int]], int]:
    """(events per function outside the kernel library, ops per step) of one callgrind run."""
    out = os.path.join(out_dir, f"callgrind.{mode}")
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--cache-sim=yes",
        *CACHES,
        "--collect-atstart=no",
        "--toggle-collect=starmap_next",
        f"--callgrind-out-file={out}",
        sys.executable,
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_instructions.py"),
        "--worker",
        mode,
        "--model",
        "wide",
        "--steps",
        str(steps),
    ]
    one = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **one}, check=False)
    ops = re.search(r"^ops (\d+)$", done.stderr, re.MULTILINE)
    if done.returncode != 0 or ops is None:
        raise RuntimeError(f"callgrind run of {mode} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    listing = subprocess.run(
        ["callgrind_annotate", "--threshold=100", out], capture_output=True, text=True, check=True
    ).stdout
    functions: dict[str, list[int]] = defaultdict(lambda: [0] * len(EVENTS))
    line_re = re.compile(r"^\s*((?:[\d,]+ \([ \d.]+%\)\s+){" + str(len(EVENTS)) + r"})(.*)$")
    for line in listing.splitlines():
        match = line_re.match(line)
        name = match.group(2) if match else ""
        if not match or "PROGRAM TOTALS" in name or "=>" in name or "events annotated" in name:
            continue
        if KERNEL_LIBRARY in name:
            continue
        counts = [int(v.replace(",", "")) for v in re.findall(r"([\d,]+) \(", match.group(1))]
        function = re.sub(r"'\d+", "", re.sub(r" \[.*\]\s*$", "", name)).split(":")[-1]
        for i, v in enumerate(counts):
            functions[function][i] += v
    return functions, int(ops.group(1))


def cycles(c: list[float]) -> float:
    """The cost estimate of one function's (or the total's) events."""
    ev = dict(zip(EVENTS, c))
    l1 = ev["I1mr"] + ev["D1mr"] + ev["D1mw"]
    l2 = ev["ILmr"] + ev["DLmr"] + ev["DLmw"]
    return ev["Ir"] + L1_MISS_CYCLES * l1 + L2_MISS_CYCLES * l2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="steps simulated in each mode")
    parser.add_argument("--top", type=int, default=15, help="functions listed")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        sys.exit("bench_cache needs valgrind and callgrind_annotate (apt-get install valgrind)")
    with tempfile.TemporaryDirectory(prefix="tl_bench_cache_") as out_dir, ThreadPoolExecutor(2) as pool:
        (floor, ops), (window, _) = pool.map(lambda m: simulate(m, args.steps, out_dir), ("floor", "window"))
    n = ops * args.steps
    per_op = {
        f: [(w - b) / n for w, b in zip(window.get(f, [0] * len(EVENTS)), floor.get(f, [0] * len(EVENTS)))]
        for f in set(window) | set(floor)
    }
    total = [sum(c[i] for c in per_op.values()) for i in range(len(EVENTS))]
    ev = dict(zip(EVENTS, total))
    print(f"window - floor per op, a 2-layer d=32 transformer step on 1024x16 tokens ({ops} ops), callgrind")
    print(
        f"  instructions {ev['Ir']:.0f}; L1 misses {ev['I1mr']:.0f} code + {ev['D1mr'] + ev['D1mw']:.0f} data; "
        f"L2 misses {ev['ILmr']:.1f} code + {ev['DLmr'] + ev['DLmw']:.1f} data"
    )
    print(
        f"  estimate {cycles(total):.0f} cycles per op (instructions + {L1_MISS_CYCLES} per L1 miss + "
        f"{L2_MISS_CYCLES} per L2 miss), of which misses {cycles(total) - ev['Ir']:.0f}"
    )
    print("  top functions (self cost):")
    for name, c in sorted(per_op.items(), key=lambda kv: -cycles(kv[1]))[: args.top]:
        e = dict(zip(EVENTS, c))
        misses = f"L1 {e['I1mr'] + e['D1mr'] + e['D1mw']:5.1f}  L2 {e['ILmr'] + e['DLmr'] + e['DLmw']:5.1f}"
        print(f"    {cycles(c):7.0f}  Ir {e['Ir']:6.0f}  {misses}  {name[:80]}")


if __name__ == "__main__":
    main()
