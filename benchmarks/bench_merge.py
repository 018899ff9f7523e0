"""Merge benchmark on synthetic shards written with the store's writer (no model runs).

Each rank has OPS ops of which COLLS are all_reduces over all ranks (matched, with small per-rank clock offsets
and arrival jitter). Reports:

- merge time for 8, 16, 32 and 64 ranks, and time per op (flat per-op time = linear in total ops);
- peak Python memory of the merge for shards without and with saved tensors (lazy reading: no growth).

Goal (issue 5): 64 ranks x 5,000 ops with 500 collectives merge in <= 5 s.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_merge.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch

import tl_dist as tl
from tl_dist.schema import COLLECTIVE_FIELDS, MODULE_CALL_FIELDS, OP_FIELDS
from tl_dist.store import write_shard
from tl_dist.trace import Trace

OPS, COLLS = 5_000, 500
_DEFAULTS = {"int": 0, "float": 0.0, "bool": False, "str": "", "ints": (), "strs": (), "shapes": ()}


def synthetic_trace(rank: int, world: int, *, saved_mb: float = 0.0) -> Trace:
    """OPS ops; every (OPS // COLLS)-th is an all_reduce of the world group."""
    every = OPS // COLLS
    offset = rank * 1_000_003  # per-rank clock offset, ns
    cols = {f.name: [_DEFAULTS[f.kind]] * OPS for f in OP_FIELDS}
    cols["index"] = list(range(OPS))
    funcs = ["all_reduce" if i % every == every - 1 else ("mm" if i % 3 else "relu") for i in range(OPS)]
    counts: dict[str, int] = {}
    labels = []
    for f in funcs:
        counts[f] = counts.get(f, 0) + 1
        labels.append(f"{f}_{counts[f]}")
    cols.update(label=labels, func=funcs, module_call=[-1] * OPS, phase=["forward"] * OPS)
    cols["kind"] = ["collective" if f == "all_reduce" else "compute" for f in funcs]
    cols["aten"] = [f"aten.{f}.default" for f in funcs]
    cols["module"] = [f"layers.{(i // 50) % 20}" for i in range(OPS)]
    cols["source"] = [f"model.py:{10 + i % every}" for i in range(OPS)]
    cols["start_ns"] = [10**18 + i * 10_000 + offset for i in range(OPS)]
    cols["duration_ns"] = [8_000] * OPS
    cols["parents"] = [(i - 1,) if i else () for i in range(OPS)]
    cols["out_shapes"] = [(torch.Size([64, 64]),)] * OPS
    cols["dtype"] = ["float32"] * OPS
    ct = {f.name: [] for f in COLLECTIVE_FIELDS}
    group = tuple(range(world))
    for seq, op in enumerate(i for i in range(OPS) if funcs[i] == "all_reduce"):
        jitter = (rank * 7919 + seq * 104729) % 50_000  # arrival skew up to 50 us
        issue = cols["start_ns"][op] + jitter
        complete = 10**18 + op * 10_000 + 60_000 + offset  # same true instant on every rank
        row = {f.name: _DEFAULTS[f.kind] for f in COLLECTIVE_FIELDS}
        row.update(op=op, func="all_reduce", group_ranks=group, group_name="0", group_desc="default_pg")
        row.update(seq=seq + 1, reduce_op="sum", root=-1, peer=-1, in_numel=4096, out_numel=4096)
        row.update(dtype="float32", bytes=16384, issue_ns=issue, complete_ns=complete, state="completed")
        row.update(bucket=-1)
        for k in ct:
            ct[k].append(row[k])
    mods = {f.name: [] for f in MODULE_CALL_FIELDS}
    saved = {}
    if saved_mb:
        n = max(1, int(saved_mb * 2**20 / (64 * 64 * 4)))
        saved = {i: [torch.randn(64, 64)] for i in range(n)}
    meta = {"rank": rank, "world_size": world, "step": 1}
    return Trace(cols, mods, collective_table=ct, saved=saved, metadata=meta)


def write_run(root: Path, world: int, *, saved_mb: float = 0.0) -> Path:
    for r in range(world):
        folder = root / f"rank{r:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        write_shard(synthetic_trace(r, world, saved_mb=saved_mb), folder / "step00000001.h5")
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tl_bench_merge_"))
    t = time.perf_counter()
    runs = {w: write_run(tmp / f"w{w}", w) for w in args.ranks}
    print(
        f"wrote synthetic shards for {args.ranks} ranks in {time.perf_counter() - t:.1f} s ({OPS} ops, {COLLS} colls per rank)"
    )
    tl.merge_ranks(runs[args.ranks[0]])  # warm-up: imports, first h5py use
    print(f"{'ranks':>6} {'median s':>9} {'min s':>7} {'us/op':>7}  findings  offset[1] (ns)")
    results = {}
    for w in args.ranks:
        times = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            g = tl.merge_ranks(runs[w])
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        results[w] = med
        print(
            f"{w:>6} {med:>9.2f} {min(times):>7.2f} {med / (w * OPS) * 1e6:>7.2f}  {len(g.findings):>8}  {g.offsets[1]}"
        )
    ws = sorted(results)
    print(
        f"per-op time ratio {ws[-1]} vs {ws[0]} ranks: {results[ws[-1]] / ws[-1] / (results[ws[0]] / ws[0]):.2f} (1.0 = linear)"
    )
    if 64 in results:
        print(f"64 ranks: {results[64]:.2f} s (goal <= 5 s): {'OK' if results[64] <= 5 else 'MISSED'}")

    # Lazy tensors: peak Python memory of a merge must not grow with what the shards saved.
    w = 8
    heavy = write_run(tmp / "heavy", w, saved_mb=16.0)
    peaks = {}
    for name, root in (
        ("no saved tensors", runs.get(w) or write_run(tmp / "light", w)),
        ("16 MB saved/rank", heavy),
    ):
        tracemalloc.start()
        tl.merge_ranks(root)
        peaks[name] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    light, big = peaks.values()
    print(
        f"peak merge memory, {w} ranks: {light / 2**20:.1f} MiB without / {big / 2**20:.1f} MiB with 16 MB saved "
        f"per rank (ratio {big / light:.2f}; 1.0 = lazy)"
    )


if __name__ == "__main__":
    main()
