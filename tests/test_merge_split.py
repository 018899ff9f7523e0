"""The merged result as a folder of one file per step (issue 26 §2): ``g.save(FOLDER, split="step")``,
``merge_ranks(out=FOLDER)`` (on Dask: written on the workers) and a lazy ``tl.load_merged(FOLDER)``, compared
field by field with the in-memory merge of the same shards (tests/merge_synth.py: 4 ranks on 2 hosts, 4 steps,
findings in three of them)."""

import json
import shutil

import pytest
from merge_synth import assert_same_merge, four_step_run

import tl_dist as tl
from tl_dist.cli import main


@pytest.fixture
def run(tmp_path):
    four_step_run(tmp_path / "run")
    return tmp_path / "run"


def _same_everywhere(back, g):
    """Everything a merge answers, the lazy folder's equal to the merge's, the views that read tables too."""
    assert_same_merge(back, g)
    assert back.keys() == g.keys() and back.world_size == g.world_size
    assert back.clock_solutions == g.clock_solutions and back.offsets == g.offsets
    assert back.shard_errors == g.shard_errors and back.written == g.written
    assert all(back.metadata(*k) == g.metadata(*k) for k in g.keys())
    for step in g.steps:
        assert back.to_pandas(step=step).equals(g.to_pandas(step=step)), step
    assert [(j.step, j.verdict, sorted(j.entries)) for j in back.joined] == [
        (j.step, j.verdict, sorted(j.entries)) for j in g.joined
    ]
    assert back.timings == g.timings
    assert repr(back) == repr(g)


def test_per_step_folder_equals_the_merge_field_by_field(run, tmp_path):
    g = tl.merge_ranks(run, strict=False)
    # What the run holds, so the comparison compares something.
    assert {"size_mismatch", "missing_rank", "incomplete_shard", "not_completed", "missing"} <= {
        f.kind for f in g.findings
    }
    assert set(g.clocks.method) >= {"same-host", "estimated"}
    out = tmp_path / "merged"
    assert g.save(out, split="step") == str(out)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["index.json", *(f"step{s:08d}.h5" for s in g.steps)]
    index = json.loads((out / "index.json").read_text())
    assert index["encoding-type"] == "tl_dist.merged-steps" and len(index["steps"]) == 4
    back = tl.load_merged(out)
    _same_everywhere(back, g)
    # Perfetto reads every step's file, one (step, rank) at a time.
    a, b = back.to_perfetto(str(tmp_path / "a.json")), g.to_perfetto(str(tmp_path / "b.json"))
    assert json.loads(open(a).read()) == json.loads(open(b).read())
    # The same folder written by the merge itself (out=), and parts of it: steps= from the index, ranks=
    # re-merged from the step files (their collectives judged on those ranks alone, as merge_ranks does).
    g2 = tl.merge_ranks(run, strict=False, out=tmp_path / "merged2")
    _same_everywhere(tl.load_merged(tmp_path / "merged2"), g2)
    assert_same_merge(tl.load_merged(out, steps=[1, 3]), tl.merge_ranks(run, strict=False, steps=[1, 3]))
    assert_same_merge(tl.load_merged(out, ranks=[0, 1]), tl.merge_ranks(run, strict=False, ranks=[0, 1]))
    # Each step's file is a merged file of its own.
    assert_same_merge(tl.load_merged(out / "step00000002.h5"), tl.merge_ranks(run, strict=False, steps=[2]))
    # merged.h5 (one file) still works as before.
    assert_same_merge(tl.load_merged(g.save(tmp_path / "one.h5")), g)


def test_load_reads_only_the_index_and_the_step_a_query_needs(run, tmp_path):
    g = tl.merge_ranks(run, strict=False)
    out = tmp_path / "merged"
    g.save(out, split="step")
    for step in (0, 2, 3):  # only index.json and step 1's file remain
        (out / f"step{step:08d}.h5").unlink()
    back = tl.load_merged(out)
    # The merge's results come from the index alone.
    assert back.findings == g.findings
    for name in ("clocks", "collectives"):
        assert getattr(back, name).equals(getattr(g, name)), name
    assert back.stragglers().equals(g.stragglers()) and back.time_breakdown().equals(g.time_breakdown())
    assert back.summary() == g.summary()
    # Step 1's tables from its file.
    assert back.to_pandas(step=1).equals(g.to_pandas(step=1))
    assert back.rank(3, step=1).columns == g.rank(3, step=1).columns
    assert [j.verdict for j in back.joined_step(1)] == [j.verdict for j in g.joined_step(1)]
    # A query of a step whose file is gone names it.
    with pytest.raises(tl.ShardFormatError, match=r"step00000002\.h5: no such merged-trace file"):
        back.to_pandas(step=2)
    with pytest.raises(
        tl.SelectionError, match=r"step: 7 is not a step of this merge; steps: \[0, 1, 2, 3\]"
    ):
        back.to_pandas(step=7)


def test_corrupt_step_file_or_index_is_named(run, tmp_path):
    out = tmp_path / "merged"
    tl.merge_ranks(run, strict=False, out=out)
    bad = out / "step00000001.h5"
    bad.write_bytes(b"not hdf5 at all")
    back = tl.load_merged(out)  # the index is fine
    with pytest.raises(tl.ShardFormatError, match=rf"{bad}: not a readable HDF5 file"):
        back.rank(0, step=1)
    with pytest.raises(tl.ShardFormatError, match=rf"{bad}"):
        back.to_pandas()
    assert len(back.to_pandas(step=0)) == len(tl.merge_ranks(run, strict=False).to_pandas(step=0))
    index = out / "index.json"
    index.write_text(index.read_text()[:500])
    with pytest.raises(tl.ShardFormatError, match=rf"{index}: corrupt index"):
        tl.load_merged(out)
    with pytest.raises(tl.ShardFormatError, match=r"no index.json: not a merged folder.*tl.merge_ranks"):
        tl.load_merged(run)
    fresh = tmp_path / "fresh"
    tl.merge_ranks(run, strict=False).save(fresh, split="step")
    with pytest.raises(tl.SelectionError, match=r"no step \[9\] in it; it has steps \[0, 1, 2, 3\]"):
        tl.load_merged(fresh, steps=[9])


def test_split_arguments_are_checked(run, tmp_path):
    g = tl.merge_ranks(run, strict=False, steps=[0])
    with pytest.raises(ValueError, match=r"split must be None \(one file\) or one of \['step'\], got 'rank'"):
        g.save(tmp_path / "x", split="rank")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file; split='step' writes a folder"):
        g.save(tmp_path / "file", split="step")
    with pytest.raises(ValueError, match="out must be a folder path or URL, got int"):
        tl.merge_ranks(run, out=3)


def test_cli_split_step_writes_the_folder_and_reads_it_back(run, tmp_path, capsys):
    out = tmp_path / "merged"
    assert main(["merge", str(run), "--lenient", "--quiet", "-o", str(out), "--split", "step"]) == 1
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and (out / "index.json").exists()
    assert main(["summary", str(run), "--lenient", "--quiet", "--no-fail"]) == 0
    from_run = capsys.readouterr().out
    shutil.rmtree(run)  # the folder alone answers
    assert main(["summary", str(out), "--quiet", "--no-fail"]) == 0
    assert capsys.readouterr().out == from_run
    # A merged folder re-saved per step; --split without -o is an error.
    assert (
        main(["merge", str(out), "--quiet", "--no-fail", "-o", str(tmp_path / "m2"), "--split", "step"]) == 0
    )
    assert (tmp_path / "m2" / "step00000003.h5").exists()
    assert main(["merge", str(out), "--quiet", "--split", "step"]) == 2
    assert "--split step writes a folder: give it with -o FOLDER" in capsys.readouterr().err


def test_per_step_folder_at_a_file_url(run, tmp_path):
    """A URL goes through fsspec (the spool and upload of tl_dist.store.location), never a local folder."""
    pytest.importorskip("fsspec")
    g = tl.merge_ranks(run, strict=False)
    url = f"file://{tmp_path}/at-url"
    assert g.save(url, split="step") == url
    for step in (0, 3):
        (tmp_path / "at-url" / f"step{step:08d}.h5").unlink()
    back = tl.load_merged(url)
    assert back.findings == g.findings and back.collectives.equals(g.collectives)
    assert back.to_pandas(step=2).equals(g.to_pandas(step=2))
    with pytest.raises(tl.ShardFormatError, match=rf"{url}/step00000003\.h5"):
        back.to_pandas(step=3)
