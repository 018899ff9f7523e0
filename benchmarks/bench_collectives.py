"""Cost of recording collectives (issue 4): a loop of small gloo all-reduces, plain against captured.

Ranks (gloo, 127.0.0.1; 2 by default) each run rounds of ``plain, captured, captured(empty), plain``: the loop is
``n`` blocking ``all_reduce`` calls of a 16-float tensor followed by one ``mul`` reading the result (so a
captured collective costs its row, group lookup, sequence number, completion callback and the reader's edge).
Each captured time is divided by the faster of the two plain times around it; median and min over rounds.
"captured(empty)" captures a loop of ``mul`` only, as a floor for the dispatch mode itself.
Also printed: microseconds added per collective, and the same with async_op=True (callback path).

Run: ``.venv/bin/python benchmarks/bench_collectives.py [--rounds 7] [--n 200] [--world 2]``. With 2 ranks on a
busy shared machine the loop runs at the pace of the slower rank and the numbers are noisy; ``--world 1``
measures the recording cost alone.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import tl_dist as tl  # noqa: E402


def _loop(n: int, *, async_op: bool, comm: bool = True) -> None:
    t = torch.ones(16)
    for _ in range(n):
        if comm:
            work = dist.all_reduce(t, async_op=async_op)
            if async_op:
                work.wait()
        t = t * 0.5


def _timed(fn) -> float:  # noqa: ANN001
    dist.barrier()  # both ranks start together: a collective loop runs at the pace of the slower rank
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _captured(n: int, async_op: bool, comm: bool = True) -> None:
    with tl.capture():
        _loop(n, async_op=async_op, comm=comm)


def _worker(rank: int, world_size: int, port: int, rounds: int, n: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    for async_op in (False, True):
        plain_loop = functools.partial(_loop, n, async_op=async_op)
        plain_muls = functools.partial(_loop, n, async_op=async_op, comm=False)
        captured = functools.partial(_captured, n, async_op)
        captured_muls = functools.partial(_captured, n, async_op, comm=False)
        for _ in range(2):  # warm-up: first dispatch-mode use, gloo connections
            _timed(plain_loop)
            _timed(captured)
        ratios, empties, plains, caps = [], [], [], []
        for _ in range(rounds):
            p1 = _timed(plain_loop)
            c = _timed(captured)
            e = _timed(captured_muls)
            pe = _timed(plain_muls)
            p2 = _timed(plain_loop)
            plain = min(p1, p2)
            ratios.append(c / plain)
            empties.append(e / pe)
            plains.append(plain)
            caps.append(c - e - (plain - pe))  # what the collectives' recording adds beyond the muls'
        if rank == 0:
            print(
                f"async_op={async_op!s:5}  n={n}  plain {statistics.median(plains) * 1e3:7.2f} ms  "
                f"captured/plain median {statistics.median(ratios):.3f} (min {min(ratios):.3f})  "
                f"mul-only captured/plain {statistics.median(empties):.3f}  "
                f"~{statistics.median(caps) / n * 1e6:.1f} us added per recorded collective",
                flush=True,
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--world", type=int, default=2, help="ranks; 1 isolates recording cost from pacing")
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"torch {torch.__version__}, {args.world} gloo ranks, 1 thread each, {args.rounds} rounds")
    mp.spawn(_worker, args=(args.world, port, args.rounds, args.n), nprocs=args.world)


if __name__ == "__main__":
    main()
