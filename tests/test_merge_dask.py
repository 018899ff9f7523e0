"""The merge on Dask (issue 26 §2): shards read on a real ``distributed.LocalCluster`` of 2 worker processes give
the local merge's findings, clocks, stragglers, collectives and breakdown, field by field."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from merge_synth import coll, make_trace, write_run

import tl_dist as tl
from tl_dist.cli import main
from tl_dist.merge.dask_engine import DaskEngine, DaskSource, resolve_engine

distributed = pytest.importorskip("distributed")

BASE = 1_000_000_000_000
SHIFT = {"node0": 0, "node1": 3_000_000}  # node1's clock runs 3 ms ahead


def _script(rank, step, host, *, numel=4, last_state="completed", skip=()):
    """Three world all_reduces and an all_gather on ranks (0, 1); arrivals jittered per (rank, k) so each rank
    is now and then the last; all complete together (on the true clock)."""
    out = []
    for k in range(4):
        true_issue = BASE + step * 10**9 + k * 1_000_000 + ((rank * 7919 + k * 104729) % 40_000)
        true_done = BASE + step * 10**9 + k * 1_000_000 + 200_000
        func, group = ("all_gather", (0, 1)) if k == 3 else ("all_reduce", (0, 1, 2, 3))
        if rank not in group or k in skip:
            continue
        state = last_state if k == 2 else "completed"
        size = numel if k == 1 else 4
        out.append(
            coll(
                func,
                numel=size,
                group=group,
                issue=true_issue + SHIFT[host],
                complete=true_done + SHIFT[host] if state == "completed" else None,
                state=state,
                compute_ns=1000 + rank * 10,
                source=f"train.py:{10 + k}",  # one line per collective: what aligns records across ranks
            )
        )
    return out


def _run(root):
    """4 ranks on 2 hosts, 4 steps: step 0 healthy, step 1 rank 3's second all_reduce of another size, step 2
    rank 2 absent and rank 1's window ended early (its third all_reduce never completed), step 3 rank 3 skips
    the second all_reduce (the aligner compares records by their interned (func, module, source) keys)."""
    traces = []
    for step in range(4):
        for rank in range(4):
            host = "node0" if rank < 2 else "node1"
            if step == 2 and rank == 2:
                continue
            numel = 6 if (step == 1 and rank == 3) else 4
            last = "started" if (step == 2 and rank == 1) else "completed"
            trace = make_trace(
                rank,
                _script(
                    rank,
                    step,
                    host,
                    numel=numel,
                    last_state=last,
                    skip=(1,) if (step, rank) == (3, 3) else (),
                ),
                world_size=4,
                step=step,
                host=host,
                complete=not (step == 2 and rank == 1),
            )
            traces.append(trace)
    write_run(root, traces)


@pytest.fixture(scope="module")
def client():
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        yield c


def _same(a, b):
    assert a.findings == b.findings
    assert a.steps == b.steps and a.ranks == b.ranks and a.incomplete == b.incomplete
    for name in ("clocks", "collectives"):
        assert getattr(a, name).equals(getattr(b, name)), name
    assert a.stragglers().equals(b.stragglers())
    assert a.time_breakdown().equals(b.time_breakdown())
    assert a.summary() == b.summary()


@pytest.mark.slow
def test_dask_merge_equals_local_field_by_field(tmp_path, client):
    _run(tmp_path)
    local = tl.merge_ranks(tmp_path, strict=False)
    # What the run holds (so the comparison compares something): a size mismatch, an absent and an incomplete
    # rank, and clocks estimated across the two hosts.
    kinds = sorted({f.kind for f in local.findings})
    assert {"size_mismatch", "missing_rank", "incomplete_shard", "not_completed", "missing"} <= set(kinds)
    assert set(local.clocks.method) >= {"same-host", "estimated"}
    on_dask = tl.merge_ranks(tmp_path, strict=False, engine=client)
    _same(on_dask, local)
    # The views that read the shards again after the merge.
    assert [j.verdict for j in on_dask.joined] == [j.verdict for j in local.joined]
    assert on_dask.to_pandas().equals(local.to_pandas())
    # A scheduler address, and a part of the run.
    part = tl.merge_ranks(tmp_path, engine=client.scheduler.address, steps=[0, 1])
    _same(part, tl.merge_ranks(tmp_path, steps=[0, 1]))


@pytest.mark.slow
def test_dask_merge_reports_unreadable_shards_as_local(tmp_path, client):
    _run(tmp_path)
    bad = tmp_path / "rank00001" / "step00000000.h5"
    bad.write_bytes(bad.read_bytes()[:300])  # truncated
    with pytest.raises(tl.MergeError) as local_error:
        tl.merge_ranks(tmp_path, steps=[0])
    with pytest.raises(tl.MergeError) as dask_error:
        tl.merge_ranks(tmp_path, steps=[0], engine=client)
    assert str(dask_error.value) == str(local_error.value) and str(bad) in str(dask_error.value)
    _same(tl.merge_ranks(tmp_path, strict=False, engine=client), tl.merge_ranks(tmp_path, strict=False))


@pytest.mark.slow
def test_cli_scheduler_and_workers_print_the_local_result(tmp_path, client, capsys):
    _run(tmp_path)
    assert main(["merge", str(tmp_path), "--lenient", "--quiet"]) == 1
    local = capsys.readouterr().out
    assert (
        main(["merge", str(tmp_path), "--lenient", "--quiet", "--scheduler", client.scheduler.address]) == 1
    )
    assert capsys.readouterr().out == local
    assert main(["merge", str(tmp_path), "--lenient", "--quiet", "--workers", "1"]) == 1
    assert capsys.readouterr().out == local
    assert main(["merge", str(tmp_path), "--workers", "1", "--scheduler", "tcp://x:1"]) == 2
    assert "--scheduler and --workers exclude each other" in capsys.readouterr().err


def test_engine_is_checked():
    assert resolve_engine("local") is None
    assert resolve_engine("dask") == DaskEngine()
    assert resolve_engine("tcp://10.0.0.5:8786") == DaskEngine(scheduler="tcp://10.0.0.5:8786")
    for bad in ("spark", 3, None):
        with pytest.raises(ValueError, match="engine must be 'local', 'dask'"):
            tl.merge_ranks("runs/none", engine=bad)
    with pytest.raises(ValueError, match="workers must be a positive int"):
        DaskEngine(workers=0)


def test_dask_without_distributed_names_the_extra(tmp_path):
    _run(tmp_path)
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["distributed"] = None
        import tl_dist as tl
        try:
            tl.merge_ranks({str(tmp_path)!r}, engine="dask")
        except tl.TlDistError as exc:
            print("ERR", exc)
        """
    )
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "ERR engine='dask' needs dask[distributed]: pip install 'tl_dist[scale]'" in out.stdout, out.stderr


@pytest.mark.slow
def test_worker_killed_mid_merge_is_retried_with_the_same_result(tmp_path, client):
    from tl_dist.merge.build import build
    from tl_dist.merge.sources import ShardSource, find_shards

    _run(tmp_path)
    local = tl.merge_ranks(tmp_path, strict=False)
    source = ShardSource(find_shards(tmp_path))
    keys = sorted(source.refs)
    remote = DaskSource(source, client, keys)
    distributed.wait(list(remote._pending.values()))
    # Every shard is read and held on a worker; kill the worker holding most of them before the client takes
    # any: their results are lost, and the scheduler must read those shards again on the other worker.
    holders = client.who_has(list(remote._pending.values()))
    counts = {}
    for workers in holders.values():
        for w in workers:
            counts[w] = counts.get(w, 0) + 1
    victim = max(counts, key=counts.get)
    pid = client.run(os.getpid, workers=[victim])[victim]
    os.kill(pid, signal.SIGKILL)
    got = build(remote, keys, world_size=4, strict=False, expected=list(range(4)), written=_written(source))
    remote.close()
    assert counts[victim] > 0
    _same(got, local)


def _written(source):
    out = {}
    for step, rank in sorted(source.refs):
        out.setdefault(rank, []).append(step)
    return out


@pytest.mark.slow
def test_dask_merge_of_a_run_on_s3(tmp_path):
    import fsspec
    from s3_helpers import s3_store

    pytest.importorskip("s3fs")
    _run(tmp_path / "run")
    local = tl.merge_ranks(tmp_path / "run", strict=False)
    with s3_store("bkt"):
        fsspec.filesystem("s3").put(str(tmp_path / "run") + "/", "bkt/run/", recursive=True)
        # A LocalCluster the merge starts (its workers read the store with the same configuration).
        got = tl.merge_ranks("s3://bkt/run", strict=False, engine=DaskEngine(workers=2))
    _same(got, local)
