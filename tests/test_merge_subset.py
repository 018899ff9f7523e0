"""Merging part of a run: a list of shard paths that leaves ranks out (said as such, not as dead ranks), and
the one error type for a step or rank the run has no shard for, wherever it is asked for."""

import pytest
from merge_synth import coll, make_trace, write_run

import tl_dist as tl
from tl_dist.merge import merge_ranks

A = "train.py:10"


def test_a_list_of_shard_paths_says_where_the_left_out_ranks_shards_are(tmp_path):
    # A 2-rank run, steps 10 and 20; merging rank 1's shards alone leaves rank 0 out: it did not die.
    traces = [make_trace(r, [coll(source=A)], step=s) for s in (10, 20) for r in range(2)]
    write_run(tmp_path / "run", traces)
    run = tmp_path / "run"
    mine = [run / "rank00001" / "step00000010.h5", run / "rank00001" / "step00000020.h5"]
    theirs = {s: str(run / "rank00000" / f"step{s:08d}.h5") for s in (10, 20)}
    g = merge_ranks(mine, strict=False)
    missing = [f for f in g.findings if f.kind == "missing_rank"]
    assert [(f.step, f.ranks) for f in missing] == [(10, (0,)), (20, (0,))]
    for f in missing:
        assert f.message == (
            f"no shard for rank 0 of 2: not among the 2 shard path(s) given, but beside them: {theirs[f.step]} "
            f"(merge the run directory {run} to include them)"
        )
        assert f.where == {
            0: {"absent": True, "last_step": 10 if f.step == 20 else None, "shard": theirs[f.step]}
        }
    g.save(tmp_path / "m.h5")  # a reopened merge says the same
    assert [f.message for f in tl.load_merged(tmp_path / "m.h5").findings] == [f.message for f in g.findings]
    with pytest.raises(
        tl.MergeError, match=r"at step 10 \(world size 2\): not among the 2 shard path\(s\) given"
    ):
        merge_ranks(mine)
    # Rank 0's shards gone from the run directory too: then it may have died, or its shards are elsewhere.
    for s in (10, 20):
        (run / "rank00000" / f"step{s:08d}.h5").unlink()
    f = merge_ranks(mine[:1], strict=False).findings[0]
    assert f.message == (
        f"no shard for rank 0 of 2 among the 1 shard path(s) given, nor in their run directory {run} (no earlier "
        "shard of it was found): it died or hung before its window ended, without a post-mortem (SIGKILL, a C++ "
        "abort), or its shards are elsewhere"
    )


def test_a_step_or_rank_the_run_lacks_is_one_error_type_everywhere(tmp_path):
    # 2 ranks, steps 10 and 20, merged and saved.
    write_run(tmp_path / "run", [make_trace(r, [coll(source=A)], step=s) for s in (10, 20) for r in range(2)])
    g = merge_ranks(tmp_path / "run")
    g.save(tmp_path / "m.h5")
    asks = {
        "merge steps=": lambda: merge_ranks(tmp_path / "run", steps=[99]),
        "merge ranks=": lambda: merge_ranks(tmp_path / "run", ranks=[0, 7]),
        "load_merged steps=": lambda: tl.load_merged(tmp_path / "m.h5", steps=[99]),
        "draw step=": lambda: g.draw(str(tmp_path / "g.svg"), step=99),
        "draw rank=": lambda: g.draw(str(tmp_path / "g.svg"), rank=5),
        "g.rank step=": lambda: g.rank(0, step=99),
    }
    messages = {}
    for what, ask in asks.items():
        with pytest.raises(tl.SelectionError) as info:
            ask()
        # caught as either of the types these calls raised before
        assert isinstance(info.value, tl.MergeError) and isinstance(info.value, ValueError), what
        messages[what] = str(info.value)
    assert messages == {
        "merge steps=": "no shards for steps=[99], ranks=all: the shards have steps [10, 20] and ranks [0, 1]",
        "merge ranks=": "ranks: [7] outside the world of 2 ranks",
        "load_merged steps=": f"{tmp_path / 'm.h5'}: no ranks' tables for steps=[99], ranks=None",
        "draw step=": "step=99: no shard for step [99]; the run has [10, 20]",
        "draw rank=": "rank=5: no shard for rank [5]; the run has [0, 1]",
        "g.rank step=": "no readable shard for rank 0 at step 99; ranks: [0, 1]",
    }
    with pytest.raises(ValueError, match=r"step must be None, an int or a list of ints; got '0'") as info:
        g.draw(str(tmp_path / "g.svg"), step="0")  # a wrong type stays a plain ValueError naming the argument
    assert not isinstance(info.value, tl.TlDistError)
