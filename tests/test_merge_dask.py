"""The merge on Dask (issue 26 §2): shards read on a real ``distributed.LocalCluster`` of 2 worker processes give
the local merge's findings, clocks, stragglers, collectives and breakdown, field by field."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from merge_synth import assert_same_merge, four_step_run

import tl_dist as tl
from tl_dist.cli import main
from tl_dist.merge.dask_engine import DaskEngine, DaskSource, resolve_engine

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def client():
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        yield c


@pytest.mark.slow
def test_dask_merge_equals_local_field_by_field(tmp_path, client):
    four_step_run(tmp_path)
    local = tl.merge_ranks(tmp_path, strict=False)
    # What the run holds (so the comparison compares something): a size mismatch, an absent and an incomplete
    # rank, and clocks estimated across the two hosts.
    kinds = sorted({f.kind for f in local.findings})
    assert {"size_mismatch", "missing_rank", "incomplete_shard", "not_completed", "missing"} <= set(kinds)
    assert set(local.clocks.method) >= {"same-host", "estimated"}
    on_dask = tl.merge_ranks(tmp_path, strict=False, engine=client)
    assert_same_merge(on_dask, local)
    # The views that read the shards again after the merge.
    assert [j.verdict for j in on_dask.joined] == [j.verdict for j in local.joined]
    assert on_dask.to_pandas().equals(local.to_pandas())
    # A scheduler address, and a part of the run.
    part = tl.merge_ranks(tmp_path, engine=client.scheduler.address, steps=[0, 1])
    assert_same_merge(part, tl.merge_ranks(tmp_path, steps=[0, 1]))


@pytest.mark.slow
def test_dask_merge_reports_unreadable_shards_as_local(tmp_path, client):
    four_step_run(tmp_path)
    bad = tmp_path / "rank00001" / "step00000000.h5"
    bad.write_bytes(bad.read_bytes()[:300])  # truncated
    with pytest.raises(tl.MergeError) as local_error:
        tl.merge_ranks(tmp_path, steps=[0])
    with pytest.raises(tl.MergeError) as dask_error:
        tl.merge_ranks(tmp_path, steps=[0], engine=client)
    assert str(dask_error.value) == str(local_error.value) and str(bad) in str(dask_error.value)
    assert_same_merge(
        tl.merge_ranks(tmp_path, strict=False, engine=client), tl.merge_ranks(tmp_path, strict=False)
    )


@pytest.mark.slow
def test_cli_scheduler_and_workers_print_the_local_result(tmp_path, client, capsys):
    four_step_run(tmp_path)
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
    four_step_run(tmp_path)
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

    four_step_run(tmp_path)
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
    assert_same_merge(got, local)


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
    four_step_run(tmp_path / "run")
    local = tl.merge_ranks(tmp_path / "run", strict=False)
    with s3_store("bkt"):
        fsspec.filesystem("s3").put(str(tmp_path / "run") + "/", "bkt/run/", recursive=True)
        # A LocalCluster the merge starts (its workers read the store with the same configuration).
        got = tl.merge_ranks(
            "s3://bkt/run", strict=False, engine=DaskEngine(workers=2), out="s3://bkt/merged"
        )
        # The per-step folder the workers wrote on the store, read back lazily: with step 2's object alone
        # beside the index, the merge's results and step 2's tables are there.
        fs = fsspec.filesystem("s3")
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("bkt/merged")) == [
            "index.json",
            *(f"step{s:08d}.h5" for s in range(4)),
        ]
        for step in (0, 1, 3):
            fs.rm(f"bkt/merged/step{step:08d}.h5")
        back = tl.load_merged("s3://bkt/merged")
        assert_same_merge(back, local)
        assert back.to_pandas(step=2).equals(local.to_pandas(step=2))
    assert_same_merge(got, local)


@pytest.mark.slow
def test_dask_merge_writes_each_step_file_on_a_worker(tmp_path, client):
    four_step_run(tmp_path / "run")
    local = tl.merge_ranks(tmp_path / "run", strict=False)
    out = tmp_path / "merged"
    # The scheduler's record of the tasks run: each step's file is one task on a worker process (the client
    # holds no op table of the run).
    with distributed.get_task_stream(client) as stream:
        got = tl.merge_ranks(tmp_path / "run", strict=False, engine=client, out=out)
    writes = [t for t in stream.data if str(t["key"]).startswith("tl_dist-write-step-")]
    assert sorted(int(str(t["key"]).split("-")[3]) for t in writes) == [0, 1, 2, 3]
    assert {t["worker"] for t in writes} <= set(client.scheduler_info()["workers"])
    assert_same_merge(got, local)
    back = tl.load_merged(out)
    assert_same_merge(back, local)
    for step in local.steps:
        assert back.to_pandas(step=step).equals(local.to_pandas(step=step)), step
