"""Merge benchmark on synthetic shards written with the store's real writer (no model runs).

Each rank has OPS ops of which COLLS are all_reduces over all ranks (matched). Ranks sit 8 to a host (host name
and boot id recorded as ``tl.arm`` records them); each host's clock has its own offset, and arrivals are
jittered so that every rank is now and then the last to arrive. Every merge runs in a fresh process, so its peak
resident memory (``ru_maxrss``, the whole process: Python, torch, the merge) is its own. Reports, per case: merge
time, microseconds per op, peak RSS, findings (0 expected) and the clock estimate against the true offsets
(worst error, worst reported uncertainty; the error must not exceed the uncertainty).

Goals (issue 12): 1,024 ranks x 5,000 ops x 500 collectives, one step, in <= 30 s and <= 4 GB peak RSS;
64 ranks x 20 steps linear in total ops (same us/op as 64 ranks x 1 step).

``--engine dask`` (issue 26) merges each case on a ``distributed.LocalCluster`` of ``--workers`` processes
instead (``--engine both``: local, then Dask): merge wall time without the cluster's start, the peak RSS of the
client process (which also hosts the LocalCluster's scheduler) and of each worker, and each worker's CPU. The
client must not grow with the ranks beyond the collective records (docs/merge.md, "On Dask"). ``--split`` also
writes the per-step folder (``merge_ranks(out=)``; on Dask each step's file on a worker) and loads its index.

Shards are written once per run (``--dir`` keeps them): per step, rank 0's with the store's writer, the others as
copies of it with their op starts, collective times and metadata overwritten (4,096 ranks in about a minute).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_merge.py [--ranks 64 256 1024] [--steps20 64]
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_merge.py --engine both --ranks 1024 4096 \
        --steps20 --dir /tmp/bench_runs [--split]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch

from tl_dist.schema import COLLECTIVE_FIELDS, MODULE_CALL_FIELDS, OP_FIELDS
from tl_dist.store import write_shard
from tl_dist.trace import Trace

OPS, COLLS = 5_000, 500
RANKS_PER_HOST = 8
_DEFAULTS = {"int": 0, "float": 0.0, "bool": False, "str": "", "ints": (), "strs": (), "shapes": ()}


def host_shift(host: int) -> int:
    """True clock offset of a host against host 0, ns (up to ~+-50 ms)."""
    return 0 if host == 0 else ((host * 7_919_993) % 100_000_000) - 50_000_000


class Template:
    """The columns every rank shares (funcs, labels, modules...); per-rank times are filled in per shard."""

    def __init__(self) -> None:
        every = OPS // COLLS
        self.funcs = [
            "all_reduce" if i % every == every - 1 else ("mm" if i % 3 else "relu") for i in range(OPS)
        ]
        counts: dict[str, int] = {}
        self.labels = []
        for f in self.funcs:
            counts[f] = counts.get(f, 0) + 1
            self.labels.append(f"{f}_{counts[f]}")
        self.kinds = ["collective" if f == "all_reduce" else "compute" for f in self.funcs]
        self.atens = [f"aten.{f}.default" for f in self.funcs]
        self.modules = [f"layers.{(i // 50) % 20}" for i in range(OPS)]
        self.sources = [f"model.py:{10 + i % every}" for i in range(OPS)]
        self.parents = [(i - 1,) if i else () for i in range(OPS)]
        self.coll_ops = [i for i in range(OPS) if self.funcs[i] == "all_reduce"]


def arrival_jitter(world: int) -> np.ndarray:
    """(world, COLLS) arrival jitter, ns: up to 50 us, a different rank last at each collective."""
    r = np.arange(world, dtype=np.int64)[:, None]
    k = np.arange(COLLS, dtype=np.int64)[None, :]
    return (r * 7_919 + k * 104_729 + (r * k) % 977 * 31) % 50_000


def synthetic_trace(tpl: Template, rank: int, world: int, step: int, jitter: np.ndarray) -> Trace:
    """One rank's window: ops 10 us apart; all_reduce k issued with a per-(rank, k) jitter of up to 50 us and
    completed 5 us after the last rank issued it, observed at once; times on the rank's host clock."""
    shift = host_shift(rank // RANKS_PER_HOST)
    t0 = 10**18 + step * 10**11
    cols = {f.name: [_DEFAULTS[f.kind]] * OPS for f in OP_FIELDS}
    cols.update(index=list(range(OPS)), label=tpl.labels, func=tpl.funcs, kind=tpl.kinds, aten=tpl.atens)
    cols.update(module=tpl.modules, source=tpl.sources, parents=tpl.parents, module_call=[-1] * OPS)
    cols.update(phase=["forward"] * OPS, dtype=["float32"] * OPS, duration_ns=[8_000] * OPS)
    cols["out_shapes"] = [(torch.Size([64, 64]),)] * OPS
    cols["start_ns"] = (t0 + shift + np.arange(OPS, dtype=np.int64) * 10_000).tolist()
    ops = np.asarray(tpl.coll_ops, dtype=np.int64)
    issue = t0 + ops * 10_000 + jitter[rank]
    complete = t0 + ops * 10_000 + jitter.max(axis=0) + 5_000
    n = COLLS
    ct = {f.name: [_DEFAULTS[f.kind]] * n for f in COLLECTIVE_FIELDS}
    ct.update(op=tpl.coll_ops, func=["all_reduce"] * n, group_ranks=[tuple(range(world))] * n)
    ct.update(group_name=["0"] * n, group_desc=["default_pg"] * n, seq=list(range(1, n + 1)))
    ct.update(reduce_op=["sum"] * n, root=[-1] * n, peer=[-1] * n, in_numel=[4096] * n, out_numel=[4096] * n)
    ct.update(dtype=["float32"] * n, bytes=[16384] * n, state=["completed"] * n, bucket=[-1] * n)
    ct.update(
        issue_ns=(issue + shift).tolist(), complete_ns=(complete + shift).tolist(), backend=["gloo"] * n
    )
    mods = {f.name: [] for f in MODULE_CALL_FIELDS}
    host = rank // RANKS_PER_HOST
    meta = {
        "rank": rank,
        "world_size": world,
        "step": step,
        "host": f"node{host:04d}",
        "boot_id": f"boot-{host}",
    }
    return Trace(cols, mods, collective_table=ct, metadata=meta)


def _rank_fields(rank: int, world: int, step: int, jitter: np.ndarray) -> dict:
    """What differs between ranks' shards of one step: op starts, collective issue/complete times (on the rank's
    host clock) and the metadata naming the rank and its host; ``synthetic_trace`` builds the same values."""
    shift = host_shift(rank // RANKS_PER_HOST)
    t0 = 10**18 + step * 10**11
    every = OPS // COLLS
    ops = np.arange(every - 1, OPS, every, dtype=np.int64)  # Template.coll_ops
    host = rank // RANKS_PER_HOST
    return {
        "start_ns": t0 + shift + np.arange(OPS, dtype=np.int64) * 10_000,
        "issue_ns": t0 + ops * 10_000 + jitter[rank] + shift,
        "complete_ns": t0 + ops * 10_000 + jitter.max(axis=0) + 5_000 + shift,
        "meta": {"rank": rank, "host": f"node{host:04d}", "boot_id": f"boot-{host}"},
    }


def _patch_shard(template: Path, path: Path, fields: dict) -> None:
    """``path`` as a copy of ``template`` (a shard of the same world and step written by the store's writer) with
    the per-rank datasets and metadata attributes overwritten in place: ~100x faster than encoding 5,000 ops and
    a world-sized group per collective again (4,096 ranks: 3.3 MB of group_ranks per shard)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.copyfile(template, tmp)
    with h5py.File(tmp, "r+") as f:
        f["ops/start_ns"][...] = fields["start_ns"]
        f["collectives/issue_ns"][...] = fields["issue_ns"]
        f["collectives/complete_ns"][...] = fields["complete_ns"]
        meta = json.loads(f.attrs["metadata"])
        meta.update(fields["meta"])
        f.attrs["metadata"] = json.dumps(meta)
        for key, value in fields["meta"].items():  # the plain copies `h5dump -A` shows
            f.attrs[key] = value
    os.replace(tmp, path)


def _write_ranks(root: Path, world: int, steps: int, ranks: list[int]) -> None:
    jitter = arrival_jitter(world)
    for s in range(steps):
        template = root / f".template-step{s:08d}.h5"
        for r in ranks:
            folder = root / f"rank{r:05d}"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"step{s:08d}.h5"
            if not path.exists():
                _patch_shard(template, path, _rank_fields(r, world, s, jitter))


def write_run(root: Path, world: int, steps: int) -> Path:
    """Write (or complete) the run's shards (not measured): per step, rank 0's shard with the store's writer as
    a template, then every rank's as a patched copy of it, in 2 processes at most (the machine is shared)."""
    root.mkdir(parents=True, exist_ok=True)
    tpl, jitter = Template(), arrival_jitter(world)
    for s in range(steps):
        template = root / f".template-step{s:08d}.h5"
        if not template.exists():
            write_shard(synthetic_trace(tpl, 0, world, s, jitter), template)
    workers = max(1, min(os.cpu_count() or 1, 2))
    chunks = [list(range(world))[k::workers] for k in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.starmap(_write_ranks, [(root, world, steps, c) for c in chunks if c])
    for s in range(steps):
        (root / f".template-step{s:08d}.h5").unlink()
    return root


_CHILD = """
import json, resource, sys, time
import tl_dist as tl
from bench_merge import host_shift, RANKS_PER_HOST, peak_rss
workers = int(sys.argv[2])
if workers:
    import distributed
    cluster = distributed.LocalCluster(
        n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0"
    )
    client = distributed.Client(cluster)
    client.wait_for_workers(workers)
    # Workers import tl_dist (torch) once, on their first task: a start-up cost, not the merge's.
    t = time.perf_counter()
    client.run(__import__, "tl_dist.merge.dask_engine")
    warm_s = time.perf_counter() - t
    engine, idle_rss = client, peak_rss()
    worker_cpu0 = client.run(time.process_time)
else:
    engine, idle_rss, warm_s = "local", 0, 0.0
t, cpu = time.perf_counter(), time.process_time()
out = sys.argv[3] or None  # --split: also write the per-step folder (on the workers with Dask)
g = tl.merge_ranks(sys.argv[1], engine=engine, out=out)
elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
split = {}
if out:
    import os
    files = {f: os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)}
    t = time.perf_counter()
    back = tl.load_merged(out)  # the index only
    split = {"index_bytes": files["index.json"], "out_bytes": sum(files.values()),
             "load_s": time.perf_counter() - t, "same": back.findings == g.findings}
rss = client.run(peak_rss) if workers else {}
cpu_now = client.run(time.process_time) if workers else {}
worker_rss = [rss[w] for w in sorted(rss)]
worker_cpu = [cpu_now[w] - worker_cpu0[w] for w in sorted(rss)]  # the merge's CPU on each worker
clocks = g.clocks
est = clocks[clocks.method == "estimated"]
errors = [abs(int(r.offset_ns) - host_shift(int(r.rank) // RANKS_PER_HOST)) for r in est.itertuples()]
print(json.dumps({
    "seconds": elapsed,
    "cpu": cpu,
    "peak_rss": peak_rss(),
    "idle_rss": idle_rss,
    "warm_s": warm_s,
    "worker_rss": worker_rss,
    "worker_cpu": worker_cpu,
    "findings": len(g.findings),
    "ops": int(g.time_breakdown().ops.sum()),
    "max_error_ns": max(errors, default=0),
    "max_uncertainty_ns": int(est.uncertainty_ns.max()) if len(est) else 0,
    "within": all(e <= int(u) for e, u in zip(errors, est.uncertainty_ns)),
    "same_host": int((clocks.method == "same-host").sum()),
    **split,
}))
"""


def peak_rss() -> int:
    """This process's peak resident memory, bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def merge_in_child(run: Path, workers: int = 0, out: Path | None = None) -> dict:
    """Merge ``run`` in a fresh process: locally, or (``workers``) on a LocalCluster of that many processes;
    with ``out``, also write the per-step folder there (``merge_ranks(out=)``) and load it back."""
    here = Path(__file__).resolve().parent
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(run), str(workers), str(out or "")],
        capture_output=True,
        text=True,
        cwd=here,
        # The tl_dist beside this file first (a snapshot of the tree, when one is benchmarked while it is edited).
        env={
            "OMP_WAIT_POLICY": "PASSIVE",
            "PYTHONPATH": f"{here}{os.pathsep}{here.parent}",
            "PATH": "/usr/bin:/bin",
        },
    )
    if proc.returncode:
        raise RuntimeError(f"merge of {run} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024], help="one-step cases")
    parser.add_argument("--steps20", type=int, nargs="*", default=[64], help="ranks of the 20-step cases")
    parser.add_argument("--rounds", type=int, default=1, help="merges per case (median reported)")
    parser.add_argument(
        "--dir", help="keep the synthetic runs here and reuse them next time (default: temporary)"
    )
    parser.add_argument("--engine", choices=["local", "dask", "both"], default="local", help="merge engine")
    parser.add_argument("--workers", type=int, default=2, help="Dask worker processes (--engine dask/both)")
    parser.add_argument(
        "--split",
        action="store_true",
        help="merge with out=: also write the per-step folder (merge s includes it), then load its index",
    )
    args = parser.parse_args()
    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tl_bench_merge_"))
    print(f"{OPS} ops and {COLLS} all_reduces per rank and step, {RANKS_PER_HOST} ranks per host")
    print(
        f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (merge time is wall clock)"
    )
    print(
        f"{'ranks':>6} {'steps':>5} {'engine':>7} {'write s':>8} {'merge s':>8} {'cpu s':>6} {'us/op':>6} "
        f"{'cpu us/op':>9} {'peak RSS':>9} {'findings':>8} {'clock err / unc (us)':>21}  workers' peak RSS/CPU s"
    )
    engines = {"local": [0], "dask": [args.workers], "both": [0, args.workers]}[args.engine]
    cases = [(w, 1) for w in args.ranks] + [(w, 20) for w in args.steps20]
    per_op = {}
    try:
        for world, steps in cases:
            run = tmp / f"w{world}s{steps}"
            t = time.perf_counter()
            write_run(run, world, steps)
            written = time.perf_counter() - t
            for workers in engines:
                out = tmp / f"w{world}s{steps}-merged" if args.split else None
                results = []
                for _ in range(args.rounds):
                    results.append(merge_in_child(run, workers, out))
                    if out is not None:
                        shutil.rmtree(out)
                res = sorted(results, key=lambda r: r["seconds"])[len(results) // 2]
                us = res["seconds"] / res["ops"] * 1e6
                cpu_us = res["cpu"] / res["ops"] * 1e6
                if not workers:
                    per_op[(world, steps)] = (us, cpu_us)
                clock = f"{res['max_error_ns'] / 1e3:.1f} / {res['max_uncertainty_ns'] / 1e3:.1f}" + (
                    "" if res["within"] else " ERROR > UNC"
                )
                engine = f"dask{workers}" if workers else "local"
                on_workers = " ".join(
                    f"{b / 2**30:.2f}GB/{c:.0f}s" for b, c in zip(res["worker_rss"], res["worker_cpu"])
                )
                if workers:
                    on_workers += f" (client idle {res['idle_rss'] / 2**30:.2f}GB; workers' import {res['warm_s']:.1f} s)"
                print(
                    f"{world:>6} {steps:>5} {engine:>7} {written:>8.1f} {res['seconds']:>8.2f} "
                    f"{res['cpu']:>6.1f} {us:>6.2f} {cpu_us:>9.2f} {res['peak_rss'] / 2**30:>7.2f}GB "
                    f"{res['findings']:>8} {clock:>21}  {on_workers}"
                )
                if "index_bytes" in res:
                    print(
                        f"{'':>22} per-step folder: {res['out_bytes'] / 2**30:.2f} GB, index.json "
                        f"{res['index_bytes'] / 2**20:.2f} MB, loaded in {res['load_s']:.2f} s"
                        + ("" if res["same"] else "  FINDINGS DIFFER")
                    )
            if not args.dir:
                shutil.rmtree(run)
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    if (1024, 1) in per_op:
        print("goal 1,024 ranks x 1 step: <= 30 s and <= 4 GB peak RSS (see the row above)")
    for world in args.steps20:
        if (world, 1) in per_op and (world, 20) in per_op:
            wall = per_op[(world, 20)][0] / per_op[(world, 1)][0]
            cpu = per_op[(world, 20)][1] / per_op[(world, 1)][1]
            print(
                f"{world} ranks: us/op with 20 steps / with 1 step = {wall:.2f} wall, {cpu:.2f} cpu "
                "(1.0 = linear in total ops)"
            )


if __name__ == "__main__":
    main()
