"""Launch helpers for multi-process tests: N real ranks on gloo / 127.0.0.1, results back through files.

Example (in a test module; the rank function must be importable, i.e. defined at module level):

    from dist_helpers import run_ranks

    def _body(rank, world_size, out_dir):
        t = torch.ones(2) * rank
        dist.all_reduce(t)
        return {"sum": t.tolist()}

    @pytest.mark.slow
    def test_sum(tmp_path):
        results = run_ranks(_body, world_size=2, tmp_path=tmp_path)
        assert results[0]["sum"] == [1.0, 1.0]

Each rank runs in a fresh process (spawn), joins a process group through a TCPStore the parent owns (so no
port race), runs ``fn(rank, world_size, out_dir, *args)``, and writes what ``fn`` returns with ``torch.save``
to ``tmp_path/rank{r}.pt`` (plain data: dicts, lists, tuples, str, numbers, tensors -- read back with
``weights_only=True``). A rank that raises writes its traceback; a hang is killed after ``timeout``. Either
fails the test with every rank's traceback; once a rank failed, the others get 10 s before they are killed
(they are usually stuck in a collective with it).
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

__all__ = ["run_ranks"]


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    args: tuple,
    timeout: float,
) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    torch.set_num_threads(1)  # ranks share the machine's few cores
    import torch.distributed as dist

    out = Path(out_dir)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world_size + 1, is_master=False, timeout=timedelta(seconds=timeout)
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        result = fn(rank, world_size, out, *args)
        if dist.is_initialized():
            # Tear down together: a rank that destroys its gloo group while a peer still has work in flight
            # makes the peer's gloo thread throw, and the peer dies with SIGABRT ("terminate called ...").
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=10))
            except RuntimeError:
                pass  # a peer died or failed on purpose (the fault tests): nobody to wait for
        tmp = out / f"rank{rank}.pt.tmp"
        torch.save(result, tmp)
        os.replace(tmp, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    *,
    world_size: int,
    tmp_path: Path,
    args: tuple = (),
    timeout: float = 180.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, out_dir, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    Args:
        fn: module-level function (spawned processes import it by name).
        world_size: number of ranks (processes).
        tmp_path: directory for results and for ``fn``'s own files (``out_dir``).
        args: extra picklable arguments for ``fn``.
        timeout: seconds before hung ranks are killed and the test fails.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        AssertionError: a rank raised (its traceback is in the message), died, or hung past ``timeout``.
    """
    if not callable(fn):
        raise ValueError(f"fn must be a callable, got {fn!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    import torch.distributed as dist

    out = Path(tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    # The parent owns the rendezvous store on a port the OS picked: no free-port race between test runs.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size + 1,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, store.port, str(out), tuple(args), timeout),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failed_first = None
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if failed_first is None:
            failed_first = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
            if failed_first is not None:
                # The others are likely stuck in a collective with the dead rank: don't wait for gloo's timeout.
                deadline = min(deadline, time.monotonic() + 10.0)
        time.sleep(0.05)
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for rank in hung:
        procs[rank].kill()
        procs[rank].join(10)
    del store

    problems = []
    for rank, p in enumerate(procs):
        err = out / f"rank{rank}.err"
        if err.exists():
            problems.append(f"--- rank {rank} raised:\n{err.read_text()}")
        elif rank in hung and failed_first is not None:
            problems.append(
                f"--- rank {rank} was still running 10 s after rank {failed_first} failed; killed"
            )
        elif rank in hung:
            problems.append(f"--- rank {rank} hung for more than {timeout:.0f} s and was killed")
        elif p.exitcode != 0:
            problems.append(f"--- rank {rank} exited with code {p.exitcode}")
        elif not (out / f"rank{rank}.pt").exists():
            problems.append(f"--- rank {rank} wrote no result")
    if problems:
        raise AssertionError(f"{len(problems)} of {world_size} ranks failed:\n" + "\n".join(problems))
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]


def collective_rows(trace) -> list[dict]:
    """Plain data (picklable back to the test process) for each collective of ``trace``: its collective-table
    fields, plus its op row's label/aten/kind/func/phase/inplace and the funcs of its readers and theirs."""
    from tl_dist.schema import COLLECTIVE_FIELDS

    out = []
    for c in trace.collectives:
        op = trace[c.op]
        row = {f.name: getattr(c, f.name) for f in COLLECTIVE_FIELDS}
        row["group_ranks"] = tuple(row["group_ranks"])
        row.update(
            label=c.label, aten=op.aten, kind=op.kind, row_func=op.func, phase=op.phase, inplace=op.inplace
        )
        row["children"] = tuple(trace[i].func for i in c.children)
        row["grandchildren"] = tuple(trace[j].func for i in c.children for j in trace[i].children)
        out.append(row)
    return out
