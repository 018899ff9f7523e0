"""Merge verdicts, clock offsets and stragglers on hand-written per-rank traces written as real shards.

Each case writes exactly what the ranks would have recorded, so the expected finding is known exactly; the
multi-process versions of these faults are in test_merge_dist.py.
"""

import pytest
from merge_synth import coll, make_trace, write_run

import tl_dist as tl
from tl_dist.merge import merge_ranks

A, B, C = "train.py:10", "train.py:11", "train.py:12"


# What post-mortem shards say about how their window ended (as tl.arm writes them).
TIMEOUT = {"end_reason": "exception", "error": "RuntimeError: Timed out waiting 3000ms for send operation"}
KILLED = {"end_reason": "SIGTERM", "stack_at": "/job/train.py:42 in time.sleep"}


def _merge(tmp_path, scripts, **kw):
    ended = kw.pop("ended", {})  # rank -> how its (incomplete) shard ended
    traces = [
        make_trace(r, s, world_size=len(scripts), complete=r not in ended, metadata=ended.get(r))
        for r, s in enumerate(scripts)
    ]
    write_run(tmp_path, traces)
    return merge_ranks(tmp_path, **kw)


def _only(g):
    assert len(g.findings) == 1, [str(f) for f in g.findings]
    return g.findings[0]


def test_clean_run_every_kind_has_no_findings(tmp_path):
    script = [
        coll("all_reduce", source=A),
        coll("all_gather", source=B),
        coll("reduce_scatter", source=C),
        coll("broadcast", source="t.py:1"),
        coll("barrier", numel=0, source="t.py:2"),
        coll("all_to_all", source="t.py:3"),
    ]
    g = _merge(tmp_path, [script, script])
    assert g.findings == []
    frame = g.collectives
    assert list(frame.func) == [
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "barrier",
        "all_to_all",
    ]
    assert set(frame.verdict) == {"matched"}
    assert list(frame.seq) == [1, 2, 3, 4, 5, 6]
    assert g.ranks == [0, 1] and g.world_size == 2
    # Strings are interned across ranks: one object per distinct label, and the join key is integer ids.
    e0, e1 = g.joined[0].entries[0], g.joined[0].entries[1]
    assert e0.label == "all_reduce_1" and e0.label is e1.label and e0.source is e1.source
    assert e0.key == e1.key and all(isinstance(k, int) for k in e0.key)


def test_size_mismatch_names_rank_and_op(tmp_path):
    s0 = [coll(source=A), coll(source=B, numel=4)]
    s1 = [coll(source=A), coll(source=B, numel=8)]
    f = _only(_merge(tmp_path, [s0, s1]))
    assert (f.kind, f.seq, f.group) == ("size_mismatch", 2, (0, 1))
    assert f.where[1]["label"] == "all_reduce_2" and f.where[1]["source"] == B


def test_all_gather_output_must_be_input_times_group(tmp_path):
    s0 = [coll("all_gather", source=A)]
    s1 = [coll("all_gather", source=A, out_numel=4)]  # 4 in -> 8 out expected on 2 ranks
    f = _only(_merge(tmp_path, [s0, s1]))
    assert f.kind == "size_mismatch" and f.ranks == (1,) and "x 2" in f.message


def _sizes(tmp_path, func, per_rank):
    """Merge one ``func`` whose (in_numel, out_numel) per rank is ``per_rank``; its findings as tuples."""
    n = len(per_rank)
    scripts = [[coll(func, in_numel=i, out_numel=o, source=A, group=tuple(range(n)))] for i, o in per_rank]
    g = _merge(tmp_path, scripts)
    return [(f.kind, f.ranks, f.message.split(": ", 1)[1]) for f in g.findings]


def test_all_reduce_input_must_equal_output(tmp_path):
    # Equal on both ranks, so only the in == out rule can see it (broadcast and reduce share it).
    assert _sizes(tmp_path / "a", "all_reduce", [(4, 8), (4, 8)]) == [
        ("size_mismatch", (0, 1), "input != output (in, out) on ranks {0: (4, 8), 1: (4, 8)}")
    ]
    assert _sizes(tmp_path / "b", "broadcast", [(4, 4), (4, 6), (4, 4)]) == [
        ("size_mismatch", (1,), "input != output (in, out) on ranks {1: (4, 6)}")
    ]


def test_reduce_scatter_input_must_be_output_times_group(tmp_path):
    # 3 ranks: rank 2's input (7) is not 3 x its output (2); the vote blames it alone.
    assert _sizes(tmp_path / "a", "reduce_scatter", [(6, 2), (6, 2), (7, 2)]) == [
        ("size_mismatch", (2,), "input != output x 3 on ranks {2: 7}")
    ]
    # a larger input than output is not enough: 9 is not 2 x 4
    assert _sizes(tmp_path / "b", "reduce_scatter", [(9, 4), (9, 4)])[0][2] == (
        "input != output x 2 on ranks {0: 9, 1: 9}"
    )
    assert _sizes(tmp_path / "c", "reduce_scatter", [(4, 2), (8, 4)])[0][2] == (
        "outputs differ across ranks: {0: 2, 1: 4}"
    )
    assert _sizes(tmp_path / "d", "reduce_scatter", [(6, 2)] * 3) == []


def test_all_to_all_totals_must_agree_splits_may_be_uneven(tmp_path):
    # all_to_all_single with split sizes: rank 0 sends 3 + 1 and receives 3 + 2, rank 1 sends 2 + 4 ...
    assert _sizes(tmp_path / "a", "all_to_all", [(4, 5), (6, 5)]) == []
    assert _sizes(tmp_path / "b", "all_to_all", [(4, 4), (4, 6)]) == [
        ("size_mismatch", (1,), "total input 8 != total output 10")
    ]


def test_scatter_outputs_equal_and_root_input_is_output_times_group(tmp_path):
    # The root (rank 0) hands 4 elements to each of 3 ranks; the others pass no input.
    assert _sizes(tmp_path / "a", "scatter", [(12, 4), (0, 4), (0, 4)]) == []
    assert _sizes(tmp_path / "b", "scatter", [(12, 4), (0, 4), (0, 6)]) == [
        ("size_mismatch", (2,), "outputs differ across ranks: {0: 4, 1: 4, 2: 6}")
    ]
    assert _sizes(tmp_path / "c", "scatter", [(10, 4), (0, 4), (0, 4)]) == [
        ("size_mismatch", (0,), "input != output x 3 on ranks {0: 10}")
    ]


def test_gather_inputs_equal_and_root_output_is_input_times_group(tmp_path):
    assert _sizes(tmp_path / "a", "gather", [(4, 0), (4, 12), (4, 0)]) == []
    assert _sizes(tmp_path / "b", "gather", [(4, 0), (4, 10), (4, 0)]) == [
        ("size_mismatch", (1,), "output != input x 3 on ranks {1: 10}")
    ]
    assert _sizes(tmp_path / "c", "gather", [(4, 0), (4, 12), (5, 0)])[0][2] == (
        "inputs differ across ranks: {0: 4, 1: 4, 2: 5}"
    )


def test_broadcast_payloads_must_agree(tmp_path):
    assert _sizes(tmp_path / "a", "broadcast", [(4, 4), (4, 4), (4, 4)]) == []
    assert _sizes(tmp_path / "b", "broadcast", [(4, 4), (6, 6), (4, 4)]) == [
        ("size_mismatch", (1,), "sizes differ across ranks: {0: 4, 1: 6, 2: 4}")
    ]


def test_dtype_mismatch(tmp_path):
    s0 = [coll(source=A), coll(source=B)]
    s1 = [coll(source=A), coll(source=B, dtype="bfloat16")]
    f = _only(_merge(tmp_path, [s0, s1]))
    assert (f.kind, f.seq) == ("dtype_mismatch", 2)
    assert {f.where[0]["label"], f.where[1]["label"]} == {"all_reduce_2"}


def test_different_collective_at_same_point_is_type_mismatch(tmp_path):
    s0 = [coll(source=A), coll("all_reduce", source=B), coll(source=C)]
    s1 = [coll(source=A), coll("broadcast", source="other.py:3"), coll(source=C)]
    f = _only(_merge(tmp_path, [s0, s1]))
    assert (f.kind, f.seq) == ("type_mismatch", 2)
    assert f.where[0]["func"] == "all_reduce" and f.where[1]["func"] == "broadcast"


def test_skipped_collective_is_missing_at_the_skipped_op(tmp_path):
    # Rank 1 skips B: its C gets sequence number 2, yet the finding is about B, not a size clash at seq 2.
    s0 = [coll(source=A), coll(source=B, numel=16), coll(source=C)]
    s1 = [coll(source=A), coll(source=C)]
    g = _merge(tmp_path, [s0, s1])
    f, shifted = g.findings
    assert (f.kind, f.seq, f.ranks, f.primary) == ("missing", 2, (1,), True)
    assert f.where[0]["source"] == B and f.where[1]["absent"] is True
    assert f.where[1]["last_source"] == C
    # C then paired rank 0's call number 3 with rank 1's number 2: the skip's consequence, and no timing.
    assert (shifted.kind, shifted.ranks, shifted.primary) == ("shifted", (1,), False)
    assert "(3 on rank 0, 2 on rank 1)" in shifted.message and shifted.where[1]["source"] == C
    assert list(g.collectives["verdict"]) == ["matched", "missing", "shifted"]


def test_a_skip_shifts_the_groups_later_steps_which_are_its_consequences(tmp_path):
    steps = [
        ([coll(source=A), coll(source=B)], [coll(source=A)]),  # step 0: rank 1 skips B
        (
            [coll(source=A), coll(source=B)],
            [coll(source=A), coll(source=B)],
        ),  # step 1: numbers shifted by one
    ]
    traces = [
        make_trace(r, script, step=k) for k, scripts in enumerate(steps) for r, script in enumerate(scripts)
    ]
    # make_trace numbers each step from 1: continue rank 0's count (3, 4) and rank 1's (2, 3) across steps
    for t in traces[2:]:
        t.collective_table["seq"] = [
            s + (2 if t.metadata["rank"] == 0 else 1) for s in t.collective_table["seq"]
        ]
    write_run(tmp_path, traces)
    g = merge_ranks(tmp_path)
    assert [(f.kind, f.step, f.primary) for f in g.findings] == [("missing", 0, True), ("shifted", 1, False)]
    assert g.stragglers()[lambda d: d.step == 1].empty  # mispaired calls' arrival times compare nothing
    # Without the cause in view (the skip happened before the first captured step), the shift is primary.
    write_run(tmp_path / "later", traces[2:])
    (only,) = merge_ranks(tmp_path / "later").findings
    assert (only.kind, only.step, only.primary) == ("shifted", 1, True)


def test_swapped_order_is_one_order_finding(tmp_path):
    s0 = [coll(source=A), coll(source=B), coll(source=C)]
    s1 = [coll(source=B), coll(source=A), coll(source=C)]
    f = _only(_merge(tmp_path, [s0, s1]))
    assert f.kind == "order"
    assert {r: w["seq"] for r, w in f.where.items()} in ({0: 1, 1: 2}, {0: 2, 1: 1})


def test_member_with_incomplete_shard_that_never_reached_it_is_not_completed(tmp_path):
    # Rank 0's broadcast completed (a root's send can finish into the socket buffer); rank 1 died before it,
    # its shard written at the crash (incomplete). The hang signature, although nobody is stuck.
    s0 = [coll(source=A), coll("broadcast", source=B)]
    s1 = [coll(source=A)]
    crashed = {1: {"end_reason": "exception", "error": "RuntimeError: boom"}}
    g = _merge(tmp_path / "a", [s0, s1], ended=crashed)
    assert [(f.kind, f.seq, f.ranks) for f in g.findings] == [
        ("incomplete_shard", -1, (1,)),
        ("not_completed", 2, (1,)),
    ]
    assert g.findings[1].message.endswith(
        ": never reached by rank(s) [1] (incomplete shard); incomplete shards: rank 1 exception (RuntimeError: boom)"
    )
    # With rank 1's shard complete, it finished the window without it: it skipped the broadcast.
    f = _only(_merge(tmp_path / "b", [s0, s1]))
    assert (f.kind, f.seq, f.ranks) == ("missing", 2, (1,))
    # Incomplete, but it went on to a later collective: it skipped this one (missing), it did not die here.
    s0 = [coll(source=A), coll("broadcast", source=B), coll(source=C)]
    s1 = [coll(source=A), coll(source=C)]
    g = _merge(tmp_path / "c", [s0, s1], ended=crashed)
    assert [(f.kind, f.seq, f.ranks) for f in g.findings] == [
        ("incomplete_shard", -1, (1,)),
        ("missing", 2, (1,)),
        ("shifted", 2, (1,)),  # C then paired rank 0's third call with rank 1's second
    ]


def test_missing_shard_strict_raises_and_lenient_reports(tmp_path):
    script = [coll(source=A, group=(0, 1, 2))]
    traces = [make_trace(r, script, world_size=3) for r in range(3)]
    write_run(tmp_path, traces)
    (tmp_path / "rank00002" / "step00000000.h5").unlink()
    with pytest.raises(tl.MergeError, match=r"rank\(s\) \[2\].*strict=False"):
        merge_ranks(tmp_path)
    g = merge_ranks(tmp_path, strict=False)
    f = _only(g)
    assert (f.kind, f.ranks) == ("missing_rank", (2,))
    assert g.collectives.absent[0] == (2,) and g.collectives.verdict[0] == "matched"


def test_corrupt_shard_lenient_is_a_finding(tmp_path):
    script = [coll(source=A)]
    write_run(tmp_path, [make_trace(r, script) for r in range(2)])
    (tmp_path / "rank00001" / "step00000000.h5").write_bytes(b"not hdf5 at all")
    with pytest.raises(tl.MergeError, match="rank00001"):
        merge_ranks(tmp_path)
    f = _only(merge_ranks(tmp_path, strict=False))
    assert f.kind == "unreadable_shard" and f.ranks == (1,) and "rank00001" in f.message


def test_p2p_pairs_by_src_dst_and_order(tmp_path):
    s0 = [coll("send", peer=1, source=A, group=(0, 1)), coll("send", peer=1, source=A, numel=2)]
    s1 = [coll("recv", peer=0, source=B), coll("recv", peer=0, source=B, numel=3)]
    f = _only(_merge(tmp_path, [s0, s1]))
    assert f.kind == "size_mismatch" and "send and recv" in f.message
    assert [j.verdict for j in merge_ranks(tmp_path).joined] == ["matched", "size_mismatch"]


def test_subgroups_on_four_ranks(tmp_path):
    even = [coll(source=A, group=(0, 2))]
    odd = [coll(source=A, group=(1, 3)), coll(source=B, group=(1, 3))]
    odd_skip = [coll(source=A, group=(1, 3))]
    g = _merge(tmp_path, [even, odd, even, odd_skip])
    f = _only(g)
    assert (f.kind, f.group, f.ranks) == ("missing", (1, 3), (3,))
    assert sorted(set(g.collectives.group)) == [(0, 2), (1, 3)]


def test_skip_then_hang_reports_the_skip_as_primary(tmp_path):
    # What a real run leaves: rank 0 then waits forever in C (issued), rank 1 went on and its shard is complete.
    s0 = [coll(source=A), coll(source=B), coll(source=C, state="issued")]
    s1 = [coll(source=A), coll(source=C)]
    g = _merge(tmp_path, [s0, s1], ended={0: TIMEOUT})
    kinds = [(f.kind, f.seq, f.ranks, f.primary) for f in g.findings]
    assert kinds == [
        ("incomplete_shard", -1, (0,), True),
        ("missing", 2, (1,), True),
        ("not_completed", 2, (0,), False),
    ]
    # C is rank 0's third collective and rank 1's second: the consequence names each rank's own number.
    assert g.findings[2].message.startswith(
        "all_reduce seq 3 on rank 0, 2 on rank 1 of group [0, 1] at all_reduce_3"
    )


def test_hang_is_not_completed_with_where_each_rank_was(tmp_path):
    # Rank 0 timed out waiting in B; rank 1 never got there: it was sleeping when SIGTERM wrote its shard.
    s0 = [coll(source=A), coll(source=B, state="issued")]
    s1 = [coll(source=A)]
    g = _merge(tmp_path, [s0, s1], ended={0: TIMEOUT, 1: KILLED})
    assert [(f.kind, f.ranks) for f in g.findings] == [
        ("incomplete_shard", (0,)),
        ("incomplete_shard", (1,)),
        ("not_completed", (1,)),
    ]
    shard0, shard1, hang = g.findings
    assert shard0.message == (
        "rank 0's window ended early: exception (RuntimeError: Timed out waiting 3000ms for send operation)"
    )
    assert shard1.message == "rank 1's window ended early: SIGTERM; it was at /job/train.py:42 in time.sleep"
    assert shard1.where[1]["last_label"] == "all_reduce_1"
    assert hang.seq == 2 and hang.message == (
        "all_reduce seq 2 of group [0, 1] at all_reduce_2 in (outside modules) (train.py:11): issued but never completed on "
        "rank(s) [0]; never reached by rank(s) [1] (incomplete shard); rank 1 never reached all_reduce_2: it was "
        "at /job/train.py:42 in time.sleep; incomplete shards: rank 0 exception (RuntimeError: Timed out waiting "
        "3000ms for send operation), rank 1 SIGTERM"
    )
    assert hang.where[0]["state"] == "issued" and hang.where[0]["end_reason"] == "exception"
    assert hang.where[1]["absent"] and hang.where[1]["last_label"] == "all_reduce_1"
    assert hang.where[1]["stack_at"] == "/job/train.py:42 in time.sleep"
    assert g.incomplete == {(0, 0), (0, 1)}
    text = g.summary()
    assert "rank 1 never reached all_reduce_2: it was at /job/train.py:42 in time.sleep" in text


def test_collective_not_seen_complete_in_windows_that_closed_is_no_hang(tmp_path):
    # Both windows closed normally although B's completion was never observed (a functional collective whose
    # result the window never read): they went past it, nobody hung in it.
    s0 = [coll(source=A), coll(source=B, state="issued", is_async=True)]
    s1 = [coll(source=A), coll(source=B, state="issued", is_async=True)]
    g = _merge(tmp_path, [s0, s1])
    assert g.findings == [] and list(g.collectives.verdict) == ["matched", "matched"]


def test_hang_with_every_rank_inside_blames_the_stuck(tmp_path):
    s0 = [coll(source=A), coll(source=B, state="issued")]
    s1 = [coll(source=A), coll(source=B)]
    g = _merge(tmp_path, [s0, s1], ended={0: TIMEOUT})
    assert [(f.kind, f.ranks) for f in g.findings] == [("incomplete_shard", (0,)), ("not_completed", (0,))]
    assert "never completed on rank(s) [0]" in g.findings[1].message


def test_disagreement_is_the_cause_when_the_collective_then_failed(tmp_path):
    # Both ranks issued something at seq 2 and neither completed: the different kinds are the finding.
    s0 = [coll(source=A), coll("all_reduce", source=B, state="issued")]
    s1 = [coll(source=A), coll("broadcast", source=B, state="issued")]
    g = _merge(tmp_path, [s0, s1], ended={0: TIMEOUT, 1: TIMEOUT})
    assert [(f.kind, f.seq) for f in g.findings] == [
        ("incomplete_shard", -1),
        ("incomplete_shard", -1),
        ("type_mismatch", 2),
    ]
    assert "never completed on rank(s) [0, 1]" in str(g.findings[2])


def test_findings_tell_the_root_module_from_no_module(tmp_path):
    # Both ranks' all_reduce has module address '': rank 0's ran inside the root module's call (its module
    # stack is ['']), rank 1's at top level (an empty stack), so they are "<root>" and "(outside modules)".
    traces = [make_trace(0, [coll(source=A, numel=4)]), make_trace(1, [coll(source=A, numel=8)])]
    traces[0].columns["module_stack"][1] = ("",)  # op 1: the all_reduce (op 0 is the mm before it)
    write_run(tmp_path, traces)
    f = _only(merge_ranks(tmp_path))
    assert f.kind == "size_mismatch" and f.message.startswith(
        "all_reduce seq 1 of group [0, 1] at all_reduce_1 in <root> (train.py:10)"
    )
    assert (f.where[0]["module"], f.where[1]["module"]) == ("<root>", "(outside modules)")


def test_missing_rank_names_the_last_step_it_wrote(tmp_path):
    # Rank 1 wrote steps 10 and 20, then died by SIGKILL inside step 30: no shard, no post-mortem.
    traces = [make_trace(r, [coll(source=A)], step=s) for s in (10, 20, 30) for r in range(2)]
    write_run(tmp_path, [t for t in traces if (t.metadata["rank"], t.metadata["step"]) != (1, 30)])
    g = merge_ranks(tmp_path, strict=False)
    f = _only(g)
    assert (f.kind, f.step, f.ranks) == ("missing_rank", 30, (1,))
    assert f.message.startswith("no shard for rank 1 of 2 (its last shard is step 20)")
    assert f.where == {1: {"absent": True, "last_step": 20}}


def test_steps_and_ranks_select_part_of_a_run(tmp_path):
    # 4 ranks, steps 10, 20, 30; at step 20 rank 2 skips B. Ranks not chosen are neither missing nor blamed.
    traces = []
    for step in (10, 20, 30):
        for r in range(4):
            script = [coll(source=A, group=(0, 1, 2, 3)), coll(source=B, group=(0, 1, 2, 3))]
            if step == 20 and r == 2:
                script = script[:1]
            traces.append(make_trace(r, script, world_size=4, step=step))
    write_run(tmp_path, traces)
    g = merge_ranks(tmp_path, steps=[20, 30], ranks=[0, 2])
    assert (g.steps, g.ranks, g.world_size) == ([20, 30], [0, 2], 4)
    f = _only(g)
    assert (f.kind, f.step, f.ranks, f.seq) == ("missing", 20, (2,), 2)
    assert list(g.collectives.ranks) == [(0, 2), (0,), (0, 2), (0, 2)]
    assert set(g.time_breakdown()["rank"]) == {0, 2}
    assert merge_ranks(tmp_path, steps=range(10, 11)).steps == [10]
    with pytest.raises(ValueError, match="steps must be None or a collection"):
        merge_ranks(tmp_path, steps=20)
    with pytest.raises(ValueError, match="ranks must hold non-negative ints"):
        merge_ranks(tmp_path, ranks=[-1])
    with pytest.raises(ValueError, match=r"ranks: \[7\] outside the world of 4 ranks"):
        merge_ranks(tmp_path, ranks=[0, 7])
    with pytest.raises(tl.MergeError, match=r"no shards for steps=\[99\], ranks=all: the shards have steps"):
        merge_ranks(tmp_path, steps=[99])


def test_bad_arguments(tmp_path):
    with pytest.raises(tl.MergeError, match="holds no shards"):
        merge_ranks(tmp_path)
    with pytest.raises(ValueError, match="strict"):
        merge_ranks(tmp_path, strict="yes")
    with pytest.raises(ValueError, match="world_size"):
        merge_ranks(tmp_path, world_size=0)
    write_run(tmp_path, [make_trace(r, [coll(source=A)]) for r in range(2)])
    with pytest.raises(tl.MergeError, match="world_size=4 but the shards say"):
        merge_ranks(tmp_path, world_size=4)
    with pytest.raises(tl.MergeError, match="does not exist"):
        merge_ranks([tmp_path / "rank00000" / "step00000009.h5"])


def test_progress_bar_and_multiple_steps(tmp_path, capsys):
    traces = [make_trace(r, [coll(source=A)], step=s) for s in (10, 20) for r in range(2)]
    write_run(tmp_path, traces)
    g = merge_ranks(tmp_path, progress=True)
    assert "reading shards" in capsys.readouterr().err
    assert g.steps == [10, 20] and g.findings == []
    assert list(g.collectives.step) == [10, 20]
    with pytest.raises(ValueError, match=r"steps \[10, 20\]; pass step="):
        g.rank(0)
    assert g.rank(1, step=20).metadata["step"] == 20


def test_traces_in_memory_merge_as_their_shards(tmp_path):
    # The in-memory reader (TraceSource, for tests and benchmarks) against the shard reader on the same traces:
    # a size mismatch, a root-module collective, async collectives and rank 1 cut short on another host.
    from tl_dist.merge.build import build
    from tl_dist.merge.sources import TraceSource

    s0 = [coll(source=A, is_async=True), coll(source=B, numel=4), coll(source=C, module="blocks.1")]
    s1 = [coll(source=A, is_async=True), coll(source=B, numel=8)]
    traces = [
        make_trace(0, s0),
        make_trace(1, s1, host="node1", t0=2_000_000_000_000, complete=False, metadata=KILLED),
    ]
    traces[0].columns["module_stack"][3] = ("",)  # rank 0's second collective: inside the root module
    write_run(tmp_path, traces)
    disk = merge_ranks(tmp_path)
    memory = build(TraceSource({(0, t.rank): t for t in traces}), [(0, 0), (0, 1)], world_size=2, strict=True)
    assert [str(f) for f in memory.findings] == [str(f) for f in disk.findings]
    assert [f.where for f in memory.findings] == [f.where for f in disk.findings]
    assert memory.collectives.equals(disk.collectives) and memory.clocks.equals(disk.clocks)
    assert memory.stragglers().equals(disk.stragglers())
    assert memory.time_breakdown().equals(disk.time_breakdown())
    assert [j.entries for j in memory.joined] == [j.entries for j in disk.joined]
    assert len(memory.findings) == 3  # rank 1's shard, the size mismatch, the collective rank 1 never reached


# -- alignment, swaps, culprits, size-rule edges and hang details (hand-derived expectations) ---------------
D, X, Y, Z = "train.py:13", "train.py:20", "train.py:21", "train.py:22"


def _kinds(g):
    return [(f.kind, f.seq, f.ranks) for f in g.findings]


def test_added_and_skipped_collectives_are_aligned_at_the_right_place(tmp_path):
    # 3 ranks; rank 0 (the reference) issues A, C. Rank 1 adds three B between them, rank 2 one B. The extras
    # join by (where, n-th occurrence in the gap): the first B of ranks 1 and 2 is one collective (seq 2 on
    # both), rank 1's second and third B are two more (seqs 3 and 4), each lacking ranks 0 and 2. C's seq is
    # the lowest among ranks: rank 0's 2.
    g3 = (0, 1, 2)
    s0 = [coll(source=A, group=g3), coll(source=C, group=g3)]
    s1 = [coll(source=A, group=g3)] + [coll(source=B, group=g3)] * 3 + [coll(source=C, group=g3)]
    s2 = [coll(source=A, group=g3), coll(source=B, group=g3), coll(source=C, group=g3)]
    g = _merge(tmp_path / "a", [s0, s1, s2])
    # C then pairs calls of different numbers (gloo and NCCL pair by count): the extras' consequence.
    assert _kinds(g) == [
        ("missing", 2, (0,)),
        ("shifted", 2, (0, 2)),
        ("missing", 3, (0, 2)),
        ("missing", 4, (0, 2)),
    ]
    assert [f.primary for f in g.findings] == [True, False, True, True]
    assert list(g.collectives.ranks) == [g3, (1, 2), (1,), (1,), g3]
    assert list(g.collectives.seq) == [1, 2, 3, 4, 2]
    # Rank 1 issues Y, Z where rank 0 issued X: Y pairs with X by position (same kind and sizes: matched), and
    # Z is an extra rank 0 lacks, joined after that pair, before D.
    s0 = [coll(source=A), coll(source=X), coll(source=D)]
    s1 = [coll(source=A), coll(source=Y), coll(source=Z), coll(source=D)]
    g = _merge(tmp_path / "b", [s0, s1])
    assert _kinds(g) == [("missing", 3, (0,)), ("shifted", 3, (0,))]
    assert list(g.collectives.ranks) == [(0, 1), (0, 1), (1,), (0, 1)]
    assert list(g.collectives.seq) == [1, 2, 3, 3]
    # Rank 1 skips B; the two collectives after it (C, then a broadcast at D) still pair with rank 0's.
    s0 = [coll(source=A), coll(source=B), coll(source=C), coll("broadcast", source=D)]
    s1 = [coll(source=A), coll(source=C), coll("broadcast", source=D)]
    g = _merge(tmp_path / "c", [s0, s1])
    assert _kinds(g) == [("missing", 2, (1,)), ("shifted", 2, (1,))]
    assert g.findings[0].message.endswith("(train.py:11): not issued by rank(s) [1]")
    assert list(g.collectives.verdict) == ["matched", "missing", "shifted", "shifted"]
    assert list(g.collectives.func) == ["all_reduce", "all_reduce", "all_reduce", "broadcast"]


def test_aligner_does_not_junk_a_collective_repeated_hundreds_of_times(tmp_path):
    # 201 collectives: 100 x A, one B, 100 x A; rank 1 skips B. difflib's "autojunk" heuristic would drop A
    # (over 1% of rank 1's 200 keys) and pair by position, blaming the last A (seq 201). B (seq 101) it is.
    s0 = [coll(source=A)] * 100 + [coll(source=B)] + [coll(source=A)] * 100
    s1 = [coll(source=A)] * 200
    g = _merge(tmp_path, [s0, s1])
    assert _kinds(g) == [("missing", 101, (1,)), ("shifted", 101, (1,))]
    assert g.findings[0].where[0]["source"] == B


def test_swaps_fold_within_three_collectives_only(tmp_path):
    # Rank 1 issues X three collectives late (seq 4, rank 0's is seq 2): one order finding, blamed on rank 1
    # (a 1-1 vote on seq: the lowest rank's side wins). Rank 0's X is op 3 (mm, A, mm, X), rank 1's op 7.
    s0 = [coll(source=A), coll(source=X), coll(source=B), coll(source=C)]
    s1 = [coll(source=A), coll(source=B), coll(source=C), coll(source=X)]
    f = _only(_merge(tmp_path / "a", [s0, s1]))
    assert (f.kind, f.seq, f.ranks) == ("order", 2, (1,))
    assert f.message == (
        "all_reduce seq 2 of group [0, 1] at all_reduce_2 in (outside modules) (train.py:20): "
        "issued at different positions (sequence numbers {0: 2, 1: 4})"
    )
    assert (f.where[0]["op"], f.where[1]["op"]) == (3, 7)
    # Four apart is beyond the window: rank 1 lacks rank 0's first X, rank 0 lacks rank 1's last.
    s0 = [coll(source=X), coll(source=A), coll(source=B), coll(source=C)]
    s1 = [coll(source=A), coll(source=B), coll(source=C), coll(source=X)]
    g = _merge(tmp_path / "b", [s0, s1])
    # A, B and C in between paired calls one number apart: the first X's consequence
    assert _kinds(g) == [("missing", 1, (1,)), ("shifted", 1, (1,)), ("missing", 4, (0,))]
    assert [f.primary for f in g.findings] == [True, False, True]
    # Rank 1 skips the first of two X: not an order problem with the X both issued later.
    s0 = [coll(source=X), coll(source=A), coll(source=X)]
    s1 = [coll(source=A), coll(source=X)]
    assert _kinds(_merge(tmp_path / "c", [s0, s1])) == [("missing", 1, (1,)), ("shifted", 1, (1,))]
    # Rank 1 skips X and later issues Y, which rank 0 never does: two different collectives, not a swap.
    s0 = [coll(source=A), coll(source=X), coll(source=B)]
    s1 = [coll(source=A), coll(source=B), coll(source=Y)]
    assert _kinds(_merge(tmp_path / "d", [s0, s1])) == [
        ("missing", 2, (1,)),
        ("shifted", 2, (1,)),
        ("missing", 3, (0,)),
    ]


def test_disagreements_blame_the_minority_and_say_what_each_rank_did(tmp_path):
    g3 = (0, 1, 2)
    s = [coll(source=A, group=g3), coll(source=B, group=g3)]
    odd = [coll(source=A, group=g3), coll("broadcast", source=B, group=g3)]
    f = _only(_merge(tmp_path / "a", [s, s, odd]))
    assert (f.kind, f.ranks) == ("type_mismatch", (2,))
    assert f.message.endswith(
        ": different collectives: rank 0 all_reduce, rank 1 all_reduce, rank 2 broadcast"
    )
    odd = [coll(source=A, group=g3), coll(source=B, group=g3, dtype="bfloat16")]
    f = _only(_merge(tmp_path / "b", [s, odd, s]))
    assert (f.kind, f.ranks) == ("dtype_mismatch", (1,))
    assert f.message.endswith(": different dtypes: rank 0 float32, rank 1 bfloat16, rank 2 float32")
    # p2p: 2 sent, 3 expected; a 1-1 vote, so the receiver (the higher rank) is blamed.
    s0 = [coll("send", peer=1, source=A, numel=2)]
    s1 = [coll("recv", peer=0, source=B, numel=3)]
    f = _only(_merge(tmp_path / "c", [s0, s1]))
    assert (f.kind, f.ranks) == ("size_mismatch", (1,))
    assert f.message == (
        "p2p send/recv seq -1 of group [0, 1] at send_1 in (outside modules) (train.py:10): "
        "send and recv sizes differ: rank 0 2, rank 1 3"
    )


def test_size_rule_edges(tmp_path):
    # Every rank sends 4 and receives 6: each agrees with the others, yet 8 != 12 in total -- all are blamed.
    assert _sizes(tmp_path / "a", "all_to_all", [(4, 6), (4, 6)]) == [
        ("size_mismatch", (0, 1), "total input 8 != total output 12")
    ]
    # A barrier moves no data: whatever sizes it records are not compared.
    assert _sizes(tmp_path / "b", "barrier", [(0, 0), (1, 1)]) == []
    # An all_gather of 1 element on 2 ranks must output 2: an output of 1 is a real (non-zero) output.
    assert _sizes(tmp_path / "c", "all_gather", [(1, 1), (1, 1)]) == [
        ("size_mismatch", (0, 1), "output != input x 2 on ranks {0: 1, 1: 1}")
    ]
    # A side of 0 (reduce's non-root output, broadcast's non-root input) is not held to in == out ...
    assert _sizes(tmp_path / "d", "reduce", [(4, 4), (4, 0)]) == []
    assert _sizes(tmp_path / "e", "broadcast", [(4, 4), (0, 4)]) == []
    # ... but an output of 1 is.
    assert _sizes(tmp_path / "f", "all_reduce", [(4, 1), (4, 1)]) == [
        ("size_mismatch", (0, 1), "input != output (in, out) on ranks {0: (4, 1), 1: (4, 1)}")
    ]
    # A group of one rank still has the kind's rule.
    assert _sizes(tmp_path / "g", "all_reduce", [(4, 8)]) == [
        ("size_mismatch", (0,), "input != output (in, out) on ranks {0: (4, 8)}")
    ]


def test_members_that_lack_a_collective_get_the_right_verdict(tmp_path):
    # Rank 1 crashed before its first collective (no collective at all in its shard): it never reached A.
    # Its shard says no end_reason, only the error: how it ended is "unknown".
    crashed = {1: {"error": "RuntimeError: boom"}}
    g = _merge(tmp_path / "a", [[coll(source=A)], []], ended=crashed)
    assert _kinds(g) == [("incomplete_shard", -1, (1,)), ("not_completed", 1, (1,))]
    assert g.findings[0].message == "rank 1's window ended early: unknown (RuntimeError: boom)"
    assert g.findings[1].message.endswith(
        ": never reached by rank(s) [1] (incomplete shard); incomplete shards: "
        "rank 1 unknown (RuntimeError: boom)"
    )
    # The reference rank (0) issued nothing, its shard complete: it skipped A.
    assert _kinds(_merge(tmp_path / "b", [[], [coll(source=A)]])) == [("missing", 1, (0,))]
    # Rank 2 skipped B, on which ranks 0 and 1 disagree in size: the skip is the finding, not the sizes.
    g3 = (0, 1, 2)
    s0 = [coll(source=A, group=g3), coll(source=B, group=g3, numel=4)]
    s1 = [coll(source=A, group=g3), coll(source=B, group=g3, numel=8)]
    assert _kinds(_merge(tmp_path / "c", [s0, s1, s0[:1]])) == [("missing", 2, (2,))]
    # Rank 0 hangs in B, rank 1 completed it, rank 2 (complete shard) skipped it: the skip kept rank 0 waiting.
    s0 = [coll(source=A, group=g3), coll(source=B, group=g3, state="issued")]
    s1 = [coll(source=A, group=g3), coll(source=B, group=g3)]
    g = _merge(tmp_path / "d", [s0, s1, s1[:1]], ended={0: TIMEOUT})
    assert _kinds(g) == [("incomplete_shard", -1, (0,)), ("not_completed", 2, (2,))]
    assert ": issued but never completed on rank(s) [0]; not issued by rank(s) [2]; incomplete shards: " in (
        g.findings[1].message
    )
    # Both issued different collectives and neither completed: the mismatch's detail, then who is stuck.
    s0 = [coll(source=A), coll("all_reduce", source=B, state="issued")]
    s1 = [coll(source=A), coll("broadcast", source=B, state="issued")]
    g = _merge(tmp_path / "e", [s0, s1], ended={0: TIMEOUT, 1: TIMEOUT})
    assert (
        g.findings[2]
        .message.split(": ", 1)[1]
        .startswith(
            "different collectives: rank 0 all_reduce, rank 1 broadcast; never completed on rank(s) [0, 1]; "
        )
    )


def test_long_error_is_cut_to_its_first_line_of_at_most_120_characters(tmp_path):
    # A 120-character first line is kept whole; 121 characters are cut to 117 and "..."; later lines dropped.
    line120 = "RuntimeError: " + "x" * 106
    line121 = "RuntimeError: " + "y" * 107
    ended = {0: {"end_reason": "exception", "error": line120 + "\nmore"}}
    ended[1] = {"end_reason": "exception", "error": line121 + "\n" + "z" * 130}
    g = _merge(tmp_path, [[coll(source=A)], [coll(source=A)]], ended=ended)
    assert [f.message for f in g.findings] == [
        f"rank 0's window ended early: exception ({line120})",
        f"rank 1's window ended early: exception ({line121[:117]}...)",
    ]


def test_a_rank_gone_after_its_post_mortem_is_that_failures_consequence(tmp_path):
    # Step 0: rank 1's optimizer raised (an incomplete shard, written at the error). Step 1: rank 1 never came;
    # rank 0 timed out in its all-reduce.
    boom = {"end_reason": "exception", "error": "RuntimeError: planted optimizer failure"}
    traces = [
        make_trace(0, [coll(source=A)], step=0),
        make_trace(1, [coll(source=A)], step=0, complete=False, metadata=boom),
        make_trace(0, [coll(source=B, state="issued")], step=1, complete=False, metadata=TIMEOUT),
    ]
    write_run(tmp_path, traces)
    g = merge_ranks(tmp_path, strict=False)
    assert [(f.kind, f.step, f.ranks, f.primary) for f in g.findings] == [
        ("incomplete_shard", 0, (1,), True),
        ("missing_rank", 1, (1,), False),
        ("incomplete_shard", 1, (0,), True),
        ("not_completed", 1, (0,), False),
    ]
    gone = g.findings[1].message
    assert gone.startswith(
        "no shard for rank 1: its last shard, step 0, is a post-mortem (rank 1's window ended"
    )
    assert "planted optimizer failure" in gone and "without a post-mortem" not in gone


def test_a_finding_in_a_subgroup_over_every_rank_names_the_process_group(tmp_path):
    # A second group with the default group's members (dist.new_group([0, 1])): the members alone are ambiguous.
    s0 = [coll(source=A), coll(source=B, group_name="1")]
    s1 = [coll(source=A), coll(source=B, group_name="1", dtype="float64")]
    f = _only(_merge(tmp_path / "twins", [s0, s1]))
    assert f.kind == "dtype_mismatch" and "of group [0, 1] (process group '1') at" in f.message
    f = _only(
        _merge(
            tmp_path / "one",
            [[coll(source=B, group_name="1")], [coll(source=B, group_name="1", dtype="float64")]],
        )
    )
    assert "of group [0, 1] at" in f.message  # one group with those members: no name needed


def test_a_ranks_last_op_is_its_last_real_op_named_by_its_own_module():
    import torch

    from tl_dist.merge.sources import Interner, trace_rank

    class Net(torch.nn.Module):
        def forward(self, x):
            return x * 2  # an op of the root module itself

    with tl.capture() as cap, torch.profiler.record_function("step"):  # markers outside every module
        Net()(torch.ones(2))
    assert cap.trace.columns["func"][-1] == "_record_function_exit"
    last = trace_rank(cap.trace, Interner(), (0, 0)).last_op
    assert (last["label"], last["module"]) == ("mul_1", "<root>")
