"""HTML report benchmark: 64 ranks x 20 steps of a synthetic data-parallel run (tests/report_synth.py: 16
Linear + ReLU layers, backward linked to forward, 4 all_reduce buckets, optimizer add_ per parameter, stats).

Reports the report's build time from a merged run in memory (median of rounds), the same from shards on disk
(shards written once with the store's writer; merge_ranks + report, the `tl-dist report RUN_DIR` path), and the
file size. Goal (issue 13): under 10 s and at most 20 MB.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_report.py [--rounds 3] [--disk]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from report_synth import synthetic_run  # noqa: E402

import tl_dist as tl  # noqa: E402
from tl_dist.store import write_shard  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--disk", action="store_true", help="also time merge_ranks + report from shards on disk"
    )
    args = parser.parse_args()
    g, traces = synthetic_run(world_size=args.ranks, steps=args.steps)
    ops = sum(len(t) for t in traces.values())
    print(f"{args.ranks} ranks x {args.steps} steps: {ops:,} ops, {len(g.joined)} joined collectives")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.html"
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            g.report(out)
            times.append(time.perf_counter() - t0)
        size = out.stat().st_size
        print(
            f"report from memory: median {statistics.median(times):.2f} s (min {min(times):.2f} s), {size / 2**20:.1f} MiB"
        )
        if args.disk:
            run = Path(tmp) / "run"
            t0 = time.perf_counter()
            for (step, rank), trace in traces.items():
                folder = run / f"rank{rank:05d}"
                folder.mkdir(parents=True, exist_ok=True)
                write_shard(trace, folder / f"step{step:08d}.h5")
            print(f"wrote {len(traces)} shards in {time.perf_counter() - t0:.1f} s (not part of the report)")
            t0 = time.perf_counter()
            merged = tl.merge_ranks(run)
            t1 = time.perf_counter()
            merged.report(out)
            t2 = time.perf_counter()
            print(f"from disk: merge_ranks {t1 - t0:.2f} s + report {t2 - t1:.2f} s = {t2 - t0:.2f} s")


if __name__ == "__main__":
    main()
