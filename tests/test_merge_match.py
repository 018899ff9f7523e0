"""Merge verdicts, clock offsets and stragglers on hand-written per-rank traces written as real shards.

Each case writes exactly what the ranks would have recorded, so the expected finding is known exactly; the
multi-process versions of these faults are in test_merge_dist.py.
"""

import pytest
from merge_synth import coll, make_trace, write_run

import tl_dist as tl
from tl_dist.merge import merge_ranks

A, B, C = "train.py:10", "train.py:11", "train.py:12"


def _merge(tmp_path, scripts, **kw):
    complete = kw.pop("complete", {})
    t0s = kw.pop("t0", {})
    traces = [
        make_trace(r, s, world_size=len(scripts), complete=complete.get(r, True), t0=t0s.get(r, 10**12))
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
    f = _only(_merge(tmp_path, [s0, s1]))
    assert (f.kind, f.seq, f.ranks) == ("missing", 2, (1,))
    assert f.where[0]["source"] == B and f.where[1]["absent"] is True
    assert f.where[1]["last_source"] == C


def test_skip_then_hang_reports_the_skip_as_primary(tmp_path):
    # What a real run leaves: rank 0 then waits forever in C (issued), rank 1 went on and its shard is complete.
    s0 = [coll(source=A), coll(source=B), coll(source=C, state="issued")]
    s1 = [coll(source=A), coll(source=C)]
    g = _merge(tmp_path, [s0, s1], complete={0: False})
    kinds = [(f.kind, f.seq, f.primary) for f in g.findings]
    assert kinds == [("missing", 2, True), ("not_completed", 2, False)]


def test_swapped_order_is_one_order_finding(tmp_path):
    s0 = [coll(source=A), coll(source=B), coll(source=C)]
    s1 = [coll(source=B), coll(source=A), coll(source=C)]
    f = _only(_merge(tmp_path, [s0, s1]))
    assert f.kind == "order"
    assert {r: w["seq"] for r, w in f.where.items()} in ({0: 1, 1: 2}, {0: 2, 1: 1})


def test_hang_is_not_completed_with_where_each_rank_was(tmp_path):
    # Rank 0 waits in B; rank 1 never got there (its shard was written at the kill, incomplete).
    s0 = [coll(source=A), coll(source=B, state="issued")]
    s1 = [coll(source=A)]
    f = _only(_merge(tmp_path, [s0, s1], complete={0: False, 1: False}))
    assert (f.kind, f.seq, f.ranks) == ("not_completed", 2, (1,))
    assert f.where[0]["state"] == "issued" and f.where[1]["absent"]
    assert f.where[1]["last_label"] == "all_reduce_1"


def test_member_with_incomplete_shard_that_never_reached_it_is_not_completed(tmp_path):
    # Rank 0's broadcast completed (a root's send can finish into the socket buffer); rank 1 died before it,
    # its shard written at the crash (incomplete). The hang signature, although nobody is stuck.
    s0 = [coll(source=A), coll("broadcast", source=B)]
    s1 = [coll(source=A)]
    f = _only(_merge(tmp_path / "a", [s0, s1], complete={1: False}))
    assert (f.kind, f.seq, f.ranks) == ("not_completed", 2, (1,))
    assert f.message.endswith(": never reached by rank(s) [1] (incomplete shard)")
    # With rank 1's shard complete, it finished the window without it: it skipped the broadcast.
    f = _only(_merge(tmp_path / "b", [s0, s1]))
    assert (f.kind, f.seq, f.ranks) == ("missing", 2, (1,))
    # Incomplete, but it went on to a later collective: it skipped this one (missing), it did not die here.
    s0 = [coll(source=A), coll("broadcast", source=B), coll(source=C)]
    s1 = [coll(source=A), coll(source=C)]
    f = _only(_merge(tmp_path / "c", [s0, s1], complete={1: False}))
    assert (f.kind, f.seq, f.ranks) == ("missing", 2, (1,))


def test_hang_with_every_rank_inside_blames_the_stuck(tmp_path):
    s0 = [coll(source=A), coll(source=B, state="issued")]
    s1 = [coll(source=A), coll(source=B)]
    f = _only(_merge(tmp_path, [s0, s1], complete={0: False}))
    assert (f.kind, f.ranks) == ("not_completed", (0,)) and "never completed on rank(s) [0]" in f.message


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


def test_clock_offset_recovered_within_a_millisecond(tmp_path):
    # Rank 1's clock runs 5 s + 123_456 ns ahead; completions jitter by up to 40 us.
    shift = 5_000_123_456
    jitter = [0, 40_000, -30_000, 10_000, 25_000, -5_000]
    s0, s1 = [], []
    for k, j in enumerate(jitter):
        done = 10**12 + (k + 1) * 10_000_000
        s0.append(coll(source=A, issue=done - 1_000_000, complete=done))
        s1.append(coll(source=A, issue=done - 2_000_000 + shift, complete=done + shift + j))
    g = _merge(tmp_path, [s0, s1])
    assert g.findings == []
    assert abs(g.offsets[1] - shift) < 1_000_000
    assert g.offsets[0] == 0
    aligned = g.to_pandas()
    first = aligned[aligned.func == "all_reduce"].groupby("rank").aligned_start_ns.min()
    assert abs((first[0] - first[1]) - 1_000_000) < 1_000_000  # rank 1 issued 1 ms earlier on true time


def test_straggler_named_first_and_waits_reflect_sleep(tmp_path):
    sleep = 200_000_000
    s0, s1 = [], []
    for k in range(4):
        base = 10**12 + k * 1_000_000_000
        done = base + sleep + 100_000
        s0.append(coll(source=A, issue=base, complete=done))  # rank 0 waits for rank 1
        s1.append(coll(source=A, issue=base + sleep, complete=done))
    g = _merge(tmp_path, [s0, s1])
    strag = g.stragglers()
    assert list(strag["rank"]) == [1, 0]
    assert strag.loc[0, "caused_wait_ns"] == 4 * sleep and strag.loc[0, "last_count"] == 4
    assert strag.loc[1, "wait_ns"] == 4 * sleep and strag.loc[0, "wait_ns"] == 0
    assert set(g.collectives.skew_ns) == {sleep}
    tb = g.time_breakdown().set_index("rank")
    assert tb.loc[0, "wait_ns"] == 4 * sleep and tb.loc[0, "comm_ns"] > tb.loc[1, "comm_ns"]


def test_overlapping_async_waits_count_once(tmp_path):
    # DDP-style: rank 1 issues three async bucket all-reduces 100 ms after rank 0, all in flight together.
    # Rank 0 waited 100 ms of wall time, not 3 x 100 ms.
    late = 100_000_000
    base = 10**12
    done = base + late + 5_000_000
    s0 = [coll(source=src, issue=base + k, complete=done, is_async=True) for k, src in enumerate((A, B, C))]
    s1 = [
        coll(source=src, issue=base + late + k, complete=done, is_async=True)
        for k, src in enumerate((A, B, C))
    ]
    g = _merge(tmp_path, [s0, s1])
    strag = g.stragglers().set_index("rank")
    # wait intervals [base + k, base + late + k] for k = 0, 1, 2: their union is late + 2 ns (summed: 3 x late)
    assert strag.loc[0, "wait_ns"] == late + 2 and strag.loc[1, "caused_wait_ns"] == late + 2
    assert strag.loc[1, "last_count"] == 3 and strag.loc[1, "wait_ns"] == 0
    tb = g.time_breakdown().set_index("rank")
    assert tb.loc[0, "wait_ns"] == late + 2


def test_disagreement_is_the_cause_when_the_collective_then_failed(tmp_path):
    # Both ranks issued something at seq 2 and neither completed: the different kinds are the finding.
    s0 = [coll(source=A), coll("all_reduce", source=B, state="issued")]
    s1 = [coll(source=A), coll("broadcast", source=B, state="issued")]
    f = _only(_merge(tmp_path, [s0, s1], complete={0: False, 1: False}))
    assert (f.kind, f.seq) == ("type_mismatch", 2)
    assert "never completed on rank(s) [0, 1]" in str(f)


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


def test_offsets_chain_through_pairwise_groups(tmp_path):
    # Ranks 0-1, 1-2 and 2-3 share collectives, 0 and 3 never do: rank 3's offset comes through the chain.
    shifts = [0, 7_000_000, -3_000_000, 11_000_000]
    scripts: list[list] = [[] for _ in range(4)]
    for k in range(5):
        for a in range(3):
            done = 10**12 + (k * 3 + a + 1) * 1_000_000
            for r in (a, a + 1):
                scripts[r].append(
                    coll(
                        source=A, group=(a, a + 1), issue=done - 50_000 + shifts[r], complete=done + shifts[r]
                    )
                )
    g = _merge(tmp_path, scripts)
    assert g.findings == []
    assert g.offsets == {r: s for r, s in enumerate(shifts)}
