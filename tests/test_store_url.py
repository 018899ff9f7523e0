"""Shards on object storage (issue 26 §1): ``tl.arm(URL)`` spools and uploads, readers take URLs, a URL is never
a local path. The store is a real S3-compatible server (moto's server mode on 127.0.0.1, tests/s3_helpers.py)."""

import importlib
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from merge_synth import coll, make_trace, write_run
from s3_helpers import s3_config, s3_objects, s3_store, unreachable_store
from torch import nn

import tl_dist as tl
from tl_dist.cli import main

arm_module = importlib.import_module("tl_dist.arm")  # tl_dist.arm the attribute is the function

pytest.importorskip("s3fs")

FIELDS = ("func", "label", "start_ns", "duration_ns", "module")


@pytest.fixture(autouse=True)
def _disarm_after(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a URL mistaken for a path would make a folder here
    monkeypatch.setenv("TL_DIST_SPOOL", str(tmp_path / "spool"))
    yield
    tl.disarm()
    assert not list(tmp_path.glob("s3*")) and not list(tmp_path.glob("file*"))


@pytest.fixture(scope="module")
def store():
    with s3_store("bkt") as endpoint:
        yield endpoint


def _window(step, *, fail=False):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with tl.capture(step=step) as cap:
        model(torch.randn(3, 4)).sum().backward()
        if fail:
            raise RuntimeError("boom in the model")
    return cap


def _columns(trace):
    return {name: list(trace.columns[name]) for name in FIELDS}


def test_arm_url_uploads_each_shard_and_readers_take_the_url(store, tmp_path):
    rank_dir = tl.arm("s3://bkt/run1")
    assert rank_dir == "s3://bkt/run1/rank00000"
    caps = [_window(3), _window(5)]
    assert tl.flush()
    assert tl.sink_stats().errors == {}
    urls = ["s3://bkt/run1/rank00000/step00000003.h5", "s3://bkt/run1/rank00000/step00000005.h5"]
    # Exactly the two shards: no temporary objects left beside them, nothing else written.
    assert s3_objects("bkt/run1") == urls
    assert [c.trace.metadata["shard"] for c in caps] == urls
    # Uploaded shards leave the spool.
    assert [p for p in (tmp_path / "spool").rglob("*") if p.is_file()] == []
    for cap, url in zip(caps, urls):
        loaded = tl.load(url)
        assert _columns(loaded) == _columns(cap.trace)
        assert loaded.metadata["run_id"] == "run1"  # the run folder's name, as for a local out_dir
    g = tl.merge_ranks("s3://bkt/run1")
    assert (g.steps, g.ranks, g.findings) == ([3, 5], [0], [])


def test_unreachable_store_keeps_the_shard_and_names_it(tmp_path, caplog):
    with unreachable_store():
        tl.arm("s3://bkt/run2")
        with caplog.at_level(logging.WARNING, logger="tl_dist"):
            cap = _window(4)
            assert tl.flush()
    spooled = tmp_path / "spool"
    kept = [p for p in spooled.rglob("*.h5")]
    assert len(kept) == 1 and kept[0].name == "step00000004.h5" and kept[0].parent.name == "rank00000"
    error = tl.sink_stats().last_error["shards"]
    assert "s3://bkt/run2/rank00000/step00000004.h5" in error and str(kept[0]) in error
    assert str(kept[0]) in caplog.text
    assert _columns(tl.load(kept[0])) == _columns(cap.trace)  # nothing lost


def test_postmortem_upload_is_bounded_and_keeps_the_shard(tmp_path, monkeypatch):
    # A store that accepts connections and never answers: the upload would wait for the read timeout.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    monkeypatch.setattr(arm_module, "SIGNAL_FLUSH_S", 1.0)
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "config_kwargs": {"read_timeout": 4}}
    try:
        with s3_config(options):
            tl.arm("s3://bkt/run3")
            started = time.perf_counter()
            with pytest.warns(UserWarning, match="could not write post-mortem shard") as warned:
                with pytest.raises(RuntimeError, match="boom in the model"):
                    _window(6, fail=True)
            took = time.perf_counter() - started
    finally:
        silent.close()
    assert took < 4.0  # the 1 s bound, not the store's 4 s read timeout
    kept = list((tmp_path / "spool").rglob("step00000006.h5"))
    assert len(kept) == 1 and str(kept[0]) in str(warned[0].message)
    loaded = tl.load(kept[0])
    assert loaded.metadata["complete"] is False and loaded.metadata["end_reason"] == "exception"


def test_file_url_goes_through_fsspec_not_a_folder_named_file(tmp_path):
    target = tmp_path / "out" / "run4"
    rank_dir = tl.arm(f"file://{target}")
    assert rank_dir == f"file://{target}/rank00000"
    cap = _window(2)
    assert tl.flush() and tl.sink_stats().errors == {}
    # Put under a hidden name, then renamed: only the shard is left.
    assert sorted(os.listdir(target / "rank00000")) == ["step00000002.h5"]
    assert _columns(tl.load(target / "rank00000" / "step00000002.h5")) == _columns(cap.trace)
    assert tl.merge_ranks(f"file://{target}").steps == [2]


def _synthetic_run(root: Path) -> None:
    s0 = [coll(numel=4, issue=100), coll("all_gather", numel=2, issue=50)]
    s1 = [coll(numel=4, issue=100), coll("all_gather", numel=3, issue=50)]  # a size mismatch
    write_run(root, [make_trace(0, s0), make_trace(1, s1, host="node1")])


def test_merge_load_and_cli_read_urls_as_paths(store, tmp_path, capsys):
    import fsspec

    local = tmp_path / "local"
    _synthetic_run(local)
    fs = fsspec.filesystem("s3")
    fs.put(str(local) + "/", "bkt/run5/", recursive=True)
    url = "s3://bkt/run5"
    here, there = tl.merge_ranks(local), tl.merge_ranks(url)
    assert [f.kind for f in there.findings] == ["size_mismatch"]
    assert there.findings == here.findings
    assert there.collectives.equals(here.collectives) and there.clocks.equals(here.clocks)
    shard = f"{url}/rank00001/step00000000.h5"
    assert _columns(tl.load(shard)) == _columns(tl.load(local / "rank00001" / "step00000000.h5"))
    assert tl.merge_ranks([shard], strict=False).findings[0].kind == "missing_rank"
    # A merged file at a URL.
    here.save(tmp_path / "merged.h5")
    fs.put(str(tmp_path / "merged.h5"), "bkt/merged.h5")
    assert tl.load_merged("s3://bkt/merged.h5").findings == here.findings
    # The command line: run directory, one shard, a merged file, the report.
    capsys.readouterr()
    assert main(["merge", url, "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "size_mismatch" in out and "2/2 ranks" in out
    assert main(["summary", shard, "--quiet"]) == 0
    assert main(["summary", "s3://bkt/merged.h5", "--quiet", "--no-fail"]) == 0
    assert main(["report", url, "--quiet", "--no-fail", "-o", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "r.html").stat().st_size > 0
    assert main(["summary", "s3://bkt/nothing-here", "--quiet"]) == 2
    assert "s3://bkt/nothing-here: no such file or directory" in capsys.readouterr().err


def test_missing_shard_url_is_named(store):
    with pytest.raises(tl.MergeError, match="s3://bkt/none/rank00000/step00000000.h5 does not exist"):
        tl.merge_ranks(["s3://bkt/none/rank00000/step00000000.h5"])
    with pytest.raises(tl.ShardFormatError, match="s3://bkt/none/rank00000/step00000001.h5: no such shard"):
        tl.load("s3://bkt/none/rank00000/step00000001.h5")


def test_url_without_fsspec_names_the_extra(tmp_path):
    # A Python where fsspec cannot be imported (as in a base install): a URL is refused, never made a folder.
    code = textwrap.dedent(
        """
        import sys
        sys.modules["fsspec"] = None
        import tl_dist as tl
        for call in (lambda: tl.arm("s3://bucket/run"), lambda: tl.merge_ranks("s3://bucket/run"),
                     lambda: tl.load("s3://bucket/run/rank00000/step00000000.h5")):
            try:
                call()
            except tl.TlDistError as exc:
                print("ERR", exc)
        """
    )
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("ERR")]
    assert len(lines) == 3, out.stdout + out.stderr
    assert all("pip install 'tl_dist[scale]'" in line for line in lines)
    assert sorted(os.listdir(tmp_path)) == []  # no 's3:' folder


def _ddp_to_s3(rank, world_size, out_dir, url):
    import torch.distributed as dist

    rank_dir = tl.arm(url)
    with tl.capture(step=1):
        t = torch.ones(4) * (rank + 1)
        dist.all_reduce(t)
    assert tl.disarm()
    return {"rank_dir": rank_dir, "sum": t.tolist(), "errors": dict(tl.sink_stats().errors)}


@pytest.mark.slow
def test_two_gloo_ranks_write_to_s3_and_merge_from_it(store, tmp_path):
    from dist_helpers import run_ranks

    results = run_ranks(_ddp_to_s3, world_size=2, tmp_path=tmp_path / "ranks", args=("s3://bkt/ddp",))
    assert [r["rank_dir"] for r in results] == ["s3://bkt/ddp/rank00000", "s3://bkt/ddp/rank00001"]
    assert results[0]["sum"] == [3.0] * 4 and all(r["errors"] == {} for r in results)
    assert s3_objects("bkt/ddp") == [
        "s3://bkt/ddp/rank00000/step00000001.h5",
        "s3://bkt/ddp/rank00001/step00000001.h5",
    ]
    g = tl.merge_ranks("s3://bkt/ddp")
    assert (g.ranks, g.steps, g.findings) == ([0, 1], [1], [])
    assert list(g.collectives.verdict) == ["matched"] and list(g.collectives.func) == ["all_reduce"]


def test_exists_sees_an_object_another_client_wrote_after_a_listing(store):
    # What OtelSink(stragglers=True) relies on while it waits for the other ranks' shards: s3fs would answer
    # from its cached listing of the folder that the object is missing.
    import fsspec

    from tl_dist.store import location

    mine = fsspec.filesystem("s3")
    mine.pipe("bkt/seen/rank00001/step00000000.h5", b"x")
    mine.ls("bkt/seen/rank00001")  # cached: step00000000.h5 only
    url = "s3://bkt/seen/rank00001/step00000001.h5"
    assert not location.exists(url)
    fsspec.filesystem("s3", skip_instance_cache=True).pipe(url, b"y")  # another rank's client
    assert location.exists(url)
