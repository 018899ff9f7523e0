"""Clock alignment and wait blame on hand-written shards (written with the real writer), with exact expectations.

Shards made by ``merge_synth.make_trace`` name a host (and its boot id); ranks given the same host share a clock.
"""

import random

import numpy as np
import pandas as pd
import pytest
from merge_synth import coll, make_trace, write_run

from tl_dist.merge import merge_ranks
from tl_dist.merge.clocks import clock_key, dependency, estimate_clocks
from tl_dist.merge.match import Entry, Joined
from tl_dist.merge.members import Members

A, B, C = "train.py:10", "train.py:11", "train.py:12"
T = 10**12


def _run(tmp_path, scripts, hosts=None, **kw):
    hosts = hosts or ["node0"] * len(scripts)
    traces = [make_trace(r, s, world_size=len(scripts), host=hosts[r]) for r, s in enumerate(scripts)]
    write_run(tmp_path, traces)
    return merge_ranks(tmp_path, **kw)


def test_offset_is_the_midpoint_of_the_causality_bounds(tmp_path):
    # Rank 1 is on another host whose clock runs SHIFT ahead. True times of six all_reduces (us after base):
    #   k  rank 0 in  rank 1 in  release   rank 0 sees done  rank 1 sees done   async
    #   0     0        300       310             310              310
    #   1   200          0       220             220              220            yes (awaited at once)
    #   2    50          0        90              90              120            (rank 1 saw it 30 us late)
    #   3     0        100       115             120              115
    #   4     0          0        25              25               25
    #   5     0       1000      1012            1012             1012
    #   6     0         25        35              35               35
    # offset(1) - SHIFT <= min_k(rank 1 done - rank 0 in)  = min(310, 20, 70, 115, 25, 1012, 35) = 20   (k=1)
    # offset(1) - SHIFT >= max_k(rank 1 in - rank 0 done)  = max(-10, -220, -90, -20, -25, -12, -10) = -10
    # -> offset SHIFT + 5 us, uncertainty 15 us.
    shift = 3_000_000_000
    rows = [
        (0, 300, 310, 310, False),
        (200, 0, 220, 220, True),
        (50, 0, 90, 120, False),
        (0, 100, 120, 115, False),
        (0, 0, 25, 25, False),
        (0, 1000, 1012, 1012, False),
        (0, 25, 35, 35, False),
    ]
    s0, s1 = [], []
    for k, (a0, a1, d0, d1, is_async) in enumerate(rows):
        base = T + k * 10_000_000
        us = 1_000
        s0.append(coll(source=A, issue=base + a0 * us, complete=base + d0 * us, is_async=is_async))
        s1.append(
            coll(source=A, issue=base + a1 * us + shift, complete=base + d1 * us + shift, is_async=is_async)
        )
    g = _run(tmp_path, [s0, s1], hosts=["node0", "node1"])
    assert g.findings == []
    assert g.offsets == {(0, 0): 0, (0, 1): shift + 5_000}
    clocks = g.clocks.set_index("rank")
    assert clocks.loc[1, "uncertainty_ns"] == 15_000 and clocks.loc[1, "method"] == "estimated"
    assert clocks.loc[1, "collectives"] == 7 and clocks.loc[0, "method"] == "same-host"
    assert g.clock_solutions[0].violation_ns == 0
    # Aligned, rank 1 arrives 5 us earlier than true. Waits beyond the 15 us uncertainty blame the last arriver:
    # rank 1 kept rank 0 waiting 295 + 95 + 995 + 20 us (k=0, 3, 5, 6), rank 0 kept rank 1 205 + 55 (k=1, 2);
    # k=4's 5 us is within the uncertainty.
    strag = g.stragglers().set_index("rank")
    assert strag.loc[1, "caused_wait_ns"] == 1_405_000 and strag.loc[1, "last_count"] == 4
    assert strag.loc[0, "caused_wait_ns"] == 260_000 and strag.loc[0, "last_count"] == 2
    assert strag.loc[1, "uncertain_wait_ns"] == 5_000 and strag.loc[0, "uncertain_wait_ns"] == 0


def test_same_host_offsets_are_zero_by_construction(tmp_path):
    # The issue's DDP case: one host, rank 1 observes its async bucket's completion 2.875 ms late, and issued
    # it 90 us before rank 0. One clock: offset 0 whatever the completions say; rank 1 waited 90 us for rank 0.
    s0 = [coll(source=A, issue=T + 90_000, complete=T + 200_000, is_async=True)]
    s1 = [coll(source=A, issue=T, complete=T + 3_075_000, is_async=True)]
    g = _run(tmp_path, [s0, s1])
    assert g.offsets == {(0, 0): 0, (0, 1): 0}
    assert list(g.clocks.method) == ["same-host", "same-host"]
    assert list(g.clocks.uncertainty_ns) == [0, 0]
    assert list(g.clocks.collectives) == [0, 0]  # nothing estimated
    strag = g.stragglers().set_index("rank")
    assert strag.loc[0, "caused_wait_ns"] == 90_000 and strag.loc[1, "caused_wait_ns"] == 0
    assert strag.loc[1, "wait_ns"] == 90_000 and strag.loc[1, "uncertain_wait_ns"] == 0


def test_same_host_needs_the_same_boot(tmp_path):
    # Same host name, another boot (a reboot, or two containers named alike): not one clock.
    s0 = [
        coll(source=A, issue=T, complete=T + 50_000),
        coll(source=B, issue=T + 10**7, complete=T + 10**7 + 50_000),
    ]
    traces = [
        make_trace(0, s0, host="node0"),
        make_trace(1, s0, host="node0", metadata={"boot_id": "another-boot"}),
    ]
    write_run(tmp_path, traces)
    g = merge_ranks(tmp_path)
    assert list(g.clocks.method) == ["same-host", "estimated"]
    assert g.clocks.uncertainty_ns[1] == 50_000  # both in together, both done 50 us later: +- 50 us


def test_a_constant_lateness_across_hosts_is_not_blamed(tmp_path):
    # Rank 1 (other host) always arrives 2 ms after rank 0: indistinguishable from its clock being 2 ms behind,
    # so the wait is within the uncertainty and blames nobody.
    s0, s1 = [], []
    for k in range(5):
        base = T + k * 10_000_000
        s0.append(coll(source=A, issue=base, complete=base + 2_010_000))
        s1.append(coll(source=A, issue=base + 2_000_000, complete=base + 2_010_000))
    g = _run(tmp_path, [s0, s1], hosts=["node0", "node1"])
    # offset in [-10 us, 2.01 ms]: midpoint 1 ms, half-width 1.01 ms; aligned skew 1 ms < 1.01 ms.
    assert g.offsets[(0, 1)] == 1_000_000 and g.clocks.uncertainty_ns[1] == 1_010_000
    strag = g.stragglers().set_index("rank")
    assert strag.caused_wait_ns.sum() == 0 and strag.wait_ns.sum() == 0
    assert strag.loc[0, "uncertain_wait_ns"] == 5 * 1_000_000
    assert list(g.collectives.last_rank) == [-1] * 5
    assert "stragglers: none beyond the clock uncertainty" in g.summary()


def test_ranks_on_one_clock_compare_exactly_whatever_its_offset(tmp_path):
    # Ranks 1 and 2 share host node1, whose offset to rank 0's host is known only to +- 1 ms. Between themselves
    # there is no doubt: rank 2 arriving 300 us after rank 1 in their own group is a 300 us wait.
    s0, s1, s2 = [], [], []
    for k in range(3):
        base = T + k * 10_000_000
        s0.append(coll(source=A, group=(0, 1, 2), issue=base, complete=base + 1_000_000))
        s1.append(coll(source=A, group=(0, 1, 2), issue=base + 1_000_000, complete=base + 1_000_000))
        s2.append(coll(source=A, group=(0, 1, 2), issue=base + 1_000_000, complete=base + 1_000_000))
        s1.append(coll(source=B, group=(1, 2), issue=base + 5_000_000, complete=base + 5_310_000))
        s2.append(coll(source=B, group=(1, 2), issue=base + 5_300_000, complete=base + 5_310_000))
    g = _run(tmp_path, [s0, s1, s2], hosts=["node0", "node1", "node1"])
    assert list(g.clocks.uncertainty_ns) == [0, 500_000, 500_000]
    strag = g.stragglers().set_index("rank")
    assert strag.loc[2, "caused_wait_ns"] == 3 * 300_000 and strag.loc[1, "wait_ns"] == 3 * 300_000
    assert strag.loc[0, "caused_wait_ns"] == 0 and strag.loc[0, "uncertain_wait_ns"] == 3 * 500_000


def test_straggler_named_first_and_waits_reflect_sleep(tmp_path):
    sleep = 200_000_000
    s0, s1 = [], []
    for k in range(4):
        base = T + k * 1_000_000_000
        done = base + sleep + 100_000
        s0.append(coll(source=A, issue=base, complete=done))  # rank 0 waits for rank 1
        s1.append(coll(source=A, issue=base + sleep, complete=done))
    g = _run(tmp_path, [s0, s1])
    strag = g.stragglers()
    assert list(strag["rank"]) == [1, 0]
    assert strag.loc[0, "caused_wait_ns"] == 4 * sleep and strag.loc[0, "last_count"] == 4
    assert strag.loc[1, "wait_ns"] == 4 * sleep and strag.loc[0, "wait_ns"] == 0
    assert set(g.collectives.skew_ns) == {sleep}
    tb = g.time_breakdown().set_index("rank")
    assert tb.loc[0, "wait_ns"] == 4 * sleep and tb.loc[0, "comm_ns"] > tb.loc[1, "comm_ns"]


def test_a_receiver_waits_for_a_late_sender_and_never_the_other_way(tmp_path):
    # Pipeline stages: step 0, stage 0 (rank 0) sends its activations 200 ms after stage 1 posted the receive;
    # step 1, stage 0 sends at once and stage 1 posts its receive 50 ms later (the send is buffered: nobody
    # waits for a receiver).
    late, slow = 200_000_000, 50_000_000
    s0 = [
        coll("send", peer=1, issue=T + late, complete=T + late + 10_000),
        coll("send", peer=1, issue=T + 10**9, complete=T + 10**9 + 10_000),
    ]
    s1 = [
        coll("recv", peer=0, issue=T, complete=T + late + 20_000),
        coll("recv", peer=0, issue=T + 10**9 + slow, complete=T + 10**9 + slow + 10_000),
    ]
    traces = [make_trace(r, [s[k]], step=k) for k in (0, 1) for r, s in enumerate((s0, s1))]
    write_run(tmp_path, traces)
    g = merge_ranks(tmp_path)
    assert g.findings == []
    strag = g.stragglers().set_index(["step", "rank"])
    assert strag.loc[(0, 0), "caused_wait_ns"] == late and strag.loc[(0, 1), "wait_ns"] == late
    assert strag.loc[(0, 0), "last_count"] == 1 and strag.loc[(0, 0), "wait_ns"] == 0
    assert (strag.loc[(1, 0), "wait_ns"], strag.loc[(1, 1), "caused_wait_ns"]) == (0, 0)
    assert strag.loc[(1, 1), "last_count"] == 0
    tb = g.time_breakdown().set_index(["step", "rank"])
    assert tb.loc[(0, 1), "wait_ns"] == late and tb.loc[(1, 0), "wait_ns"] == 0


def test_overlapping_async_waits_count_once(tmp_path):
    # DDP-style: rank 1 issues three async bucket all-reduces 100 ms after rank 0, all in flight together.
    # Rank 0 waited 100 ms of wall time, not 3 x 100 ms.
    late = 100_000_000
    done = T + late + 5_000_000
    s0 = [coll(source=src, issue=T + k, complete=done, is_async=True) for k, src in enumerate((A, B, C))]
    s1 = [
        coll(source=src, issue=T + late + k, complete=done, is_async=True) for k, src in enumerate((A, B, C))
    ]
    g = _run(tmp_path, [s0, s1])
    strag = g.stragglers().set_index("rank")
    # wait intervals [T + k, T + late + k] for k = 0, 1, 2: their union is late + 2 ns (summed: 3 x late)
    assert strag.loc[0, "wait_ns"] == late + 2 and strag.loc[1, "caused_wait_ns"] == late + 2
    assert strag.loc[1, "last_count"] == 3 and strag.loc[1, "wait_ns"] == 0
    tb = g.time_breakdown().set_index("rank")
    assert tb.loc[0, "wait_ns"] == late + 2


def test_offsets_chain_through_pairwise_groups(tmp_path):
    # Ranks 0-1, 1-2 and 2-3 (four hosts) share collectives, 0 and 3 never do: rank 3's offset comes through the
    # chain. Each pair issues together and completes 50 us later: +- 50 us per link, adding up along the chain.
    shifts = [0, 7_000_000, -3_000_000, 11_000_000]
    scripts: list[list] = [[] for _ in range(4)]
    for k in range(5):
        for a in range(3):
            done = T + (k * 3 + a + 1) * 1_000_000
            for r in (a, a + 1):
                scripts[r].append(
                    coll(
                        source=A, group=(a, a + 1), issue=done - 50_000 + shifts[r], complete=done + shifts[r]
                    )
                )
    g = _run(tmp_path, scripts, hosts=[f"node{r}" for r in range(4)])
    assert g.findings == []
    assert g.offsets == {(0, r): s for r, s in enumerate(shifts)}
    assert list(g.clocks.uncertainty_ns) == [0, 50_000, 100_000, 150_000]
    assert list(g.clocks.reference) == [0, 0, 0, 0]


def test_contradictory_bounds_are_widened_and_reported(tmp_path):
    # Rank 1's clock stepped between two collectives: k=0 says offset(1) <= 10 us, k=1 says >= 30 us. The least
    # widening of both bounds that makes them agree is 10 us each: offset 20 us, +- 10 us.
    s0 = [coll(source=A, issue=T, complete=T + 10_000), coll(source=B, issue=T + 10**7, complete=T + 10**7)]
    s1 = [
        coll(source=A, issue=T, complete=T + 10_000),
        coll(source=B, issue=T + 10**7 + 30_000, complete=T + 10**7 + 30_000),
    ]
    g = _run(tmp_path, [s0, s1], hosts=["node0", "node1"])
    assert g.clock_solutions[0].violation_ns == 10_000
    assert g.offsets[(0, 1)] == 20_000 and g.clocks.uncertainty_ns[1] == 10_000
    assert "contradicted causality by 0.010 ms" in g.summary()


def test_offsets_are_per_step(tmp_path):
    # Between two captured windows the other host's clock drifted by 40 us: each step gets its own offset.
    traces = []
    for step, drift in ((10, 0), (20, 40_000)):
        s0, s1 = [], []
        for k, (a0, a1) in enumerate([(0, 100_000), (100_000, 0)]):
            base = T + step * 10**9 + k * 10**7
            done = base + 110_000
            s0.append(coll(source=A, issue=base + a0, complete=done))
            s1.append(coll(source=A, issue=base + a1 + drift, complete=done + drift))
        traces += [make_trace(0, s0, step=step), make_trace(1, s1, step=step, host="node1")]
    write_run(tmp_path, traces)
    g = merge_ranks(tmp_path)
    # bounds per step: <= min(done - in_0) = 10 us; >= max(in_1 - done) = -10 us: offset drift +- 10 us
    assert g.offsets == {(10, 0): 0, (10, 1): 0, (20, 0): 0, (20, 1): 40_000}
    assert list(g.clocks.uncertainty_ns) == [0, 10_000, 0, 10_000]


# -- against an independent reference -------------------------------------------------------------------------
ALL = ("all_reduce", "all_gather", "barrier")


def _random_run(seed):
    """Random collectives over random groups of 3-5 ranks on 2-5 clocks, physically consistent true times."""
    rng = random.Random(seed)
    n = rng.randint(3, 5)
    host_of = [0] + [rng.randint(0, n - 1) for _ in range(n - 1)]
    shift = {h: rng.randint(-(10**9), 10**9) if h else 0 for h in set(host_of)}
    scripts: list[list] = [[] for _ in range(n)]
    records = []  # (kind, members, root, {rank: (issue, complete)}) on the ranks' clocks
    for k in range(14):
        kind = rng.choice(ALL + ("broadcast", "reduce", "send"))
        members = sorted(rng.sample(range(n), 2 if kind == "send" else rng.randint(2, n)))
        if k < 2:
            kind, members = "all_reduce", list(range(n))  # everyone linked at least once
        base = T + k * 10_000_000
        arrive = {r: base + rng.randint(0, 2_000_000) for r in members}
        root = rng.choice(members)
        if kind == "send":
            sources, sinks = [root], [r for r in members if r != root]
        elif kind == "broadcast":
            sources, sinks = [root], [r for r in members if r != root]
        elif kind == "reduce":
            sources, sinks = members, [root]
        else:
            sources, sinks = members, members
        release = max(arrive[s] for s in sources) + rng.randint(5_000, 50_000)
        times = {}
        for r in members:
            late = rng.choice([0, 0, rng.randint(0, 300_000)])  # now and then seen late (async wait)
            done = max(release, arrive[r]) + late if r in sinks else arrive[r] + rng.randint(1_000, 9_000)
            times[r] = (arrive[r] + shift[host_of[r]], done + shift[host_of[r]])
        records.append((kind, members, root, sources, sinks, times))
        for r in members:
            issue, complete = times[r]
            if kind == "send":
                func, peer = ("send", sinks[0]) if r == root else ("recv", root)
                scripts[r].append(coll(func, group=tuple(members), peer=peer, issue=issue, complete=complete))
            else:
                out = 4 * len(members) if kind == "all_gather" else None
                scripts[r].append(
                    coll(kind, group=tuple(members), root=root, issue=issue, complete=complete, out_numel=out)
                )
    return n, host_of, shift, scripts, records


def _reference(n, host_of, records):
    """Plain-Python reference: pairwise bounds o_a - o_b <= min(complete on a - issue on b), closed with
    Floyd-Warshall over the clocks; offset = interval midpoint against clock 0, uncertainty = half-width."""
    inf = float("inf")
    clocks = sorted(set(host_of))
    bound = {(a, b): (0 if a == b else inf) for a in clocks for b in clocks}
    for _, _, _, sources, sinks, times in records:
        for r in sinks:
            for s in sources:
                a, b = host_of[r], host_of[s]
                if a != b:
                    bound[(a, b)] = min(bound[(a, b)], times[r][1] - times[s][0])
    for m in clocks:
        for a in clocks:
            for b in clocks:
                bound[(a, b)] = min(bound[(a, b)], bound[(a, m)] + bound[(m, b)])
    out = {}
    for r in range(n):
        up, down = bound[(host_of[r], 0)], bound[(0, host_of[r])]  # o_r - o_0 <= up, o_0 - o_r <= down
        if host_of[r] == 0:
            out[r] = (0, 0, "same-host")
        elif up == inf or down == inf:
            out[r] = (0, None, "none")
        else:
            out[r] = ((up - down) // 2, (up + down + 1) // 2, "estimated")
    return out


@pytest.mark.parametrize("seed", range(8))
def test_offsets_match_an_independent_reference(tmp_path, seed):
    n, host_of, shift, scripts, records = _random_run(seed)
    traces = [make_trace(r, scripts[r], world_size=n, host=f"node{host_of[r]}") for r in range(n)]
    write_run(tmp_path, traces)
    g = merge_ranks(tmp_path)
    assert g.findings == []
    expected = _reference(n, host_of, records)
    clocks = g.clocks.set_index("rank")
    for r in range(n):
        offset, unc, method = expected[r]
        got_unc = clocks.loc[r, "uncertainty_ns"]
        got = (g.offsets[(0, r)], None if pd.isna(got_unc) else int(got_unc), clocks.loc[r, "method"])
        assert got == (offset, unc, method), (seed, r)
        if method == "estimated":  # the true offset lies within the reported interval
            assert abs(shift[host_of[r]] - offset) <= unc


def test_docs_worked_example(tmp_path):
    # docs/merge.md, "Worked example": the same numbers, in us on each rank's clock.
    table = [(1000, 1310, 5300, 5310, False), (2200, 2220, 6000, 6220, False), (3000, 3110, 7100, 7400, True)]
    us = 1_000
    s0 = [coll(source=A, issue=T + a * us, complete=T + b * us, is_async=late) for a, b, _, _, late in table]
    s1 = [coll(source=A, issue=T + c * us, complete=T + d * us, is_async=late) for _, _, c, d, late in table]
    g = _run(tmp_path, [s0, s1], hosts=["node0", "node1"])
    assert g.offsets[(0, 1)] == 4_005 * us and g.clocks.uncertainty_ns[1] == 15 * us
    waits = [t["waits"] for t in g.timings]
    assert waits == [{0: 295 * us, 1: 0}, {0: 0, 1: 205 * us}, {0: 95 * us, 1: 0}]
    assert list(g.collectives.last_rank) == [1, 0, 1]


# -- which clock a shard is on --------------------------------------------------------------------------------
def test_clock_key_is_host_and_boot_else_the_rank_alone():
    # docstring: (host, boot id) when the shard records a boot id, else a clock of its own.
    assert clock_key(3, {"host": "node0", "boot_id": "b1"}) == ("host", "node0", "b1")
    assert clock_key(3, {"host": "node9", "boot_id": "b1"}) == ("host", "node9", "b1")  # the host name counts
    assert clock_key(3, {"boot_id": "b1"}) == ("host", "", "b1")  # no host name: "" (a boot id alone)
    assert clock_key(3, {"host": None, "boot_id": "b1"}) == ("host", "", "b1")
    # No boot id (not Linux, an older writer): its own clock, whatever the host.
    assert clock_key(3, {"host": "node0"}) == ("rank", 3)
    assert clock_key(4, {"host": "node0", "boot_id": ""}) == ("rank", 4)
    assert clock_key(5, {"host": "node0", "boot_id": None}) == ("rank", 5)
    assert clock_key(6, {}) == ("rank", 6)


def _two_together(tmp_path, metas):
    """Two ranks issuing two all_reduces together, both seen done 50 us later; ``metas``: per rank, metadata
    to set (None values are removed from the shard's)."""
    s0 = [
        coll(source=A, issue=T, complete=T + 50_000),
        coll(source=B, issue=T + 10**7, complete=T + 10**7 + 50_000),
    ]
    traces = []
    for r, meta in enumerate(metas):
        trace = make_trace(r, s0, host="node0")
        for k, v in meta.items():
            if v is None:
                del trace.metadata[k]
            else:
                trace.metadata[k] = v
        traces.append(trace)
    write_run(tmp_path, traces)
    return merge_ranks(tmp_path)


def test_shards_without_a_boot_id_are_clocks_of_their_own(tmp_path):
    # Both shards name host node0 but neither records a boot id (an older writer): nothing says they read one
    # clock, so rank 1 is estimated against rank 0: both in together, both done 50 us later -> 0 +- 50 us.
    g = _two_together(tmp_path / "a", [{"boot_id": None}, {"boot_id": None}])
    assert list(g.clocks.method) == ["same-host", "estimated"]
    assert list(g.clocks.uncertainty_ns) == [0, 50_000] and list(g.clocks.reference) == [0, 0]
    # One boot id named by two hosts (containers with their own names): the pair differs, so two clocks.
    g = _two_together(tmp_path / "b", [{"boot_id": "b1", "host": "c0"}, {"boot_id": "b1", "host": "c1"}])
    assert list(g.clocks.method) == ["same-host", "estimated"]
    # The same host and boot: one clock, offset 0 by construction.
    g = _two_together(tmp_path / "c", [{"boot_id": "b1", "host": "c0"}, {"boot_id": "b1", "host": "c0"}])
    assert list(g.clocks.method) == ["same-host", "same-host"] and list(g.clocks.uncertainty_ns) == [0, 0]


# -- the module's functions on hand-built joined collectives ---------------------------------------------------
def _entry(rank, func="all_reduce", issue=0, complete=10, *, root=-1, peer=-1, state="completed"):
    return Entry(
        rank, 0, 0, func, (0, 1), "0", 1, peer, root, 4, 4, "float32", 16, False, issue, complete, state,
        f"{func}_1", "", A, False, (0, 0, 0),
    )  # fmt: skip


def _joined(*entries, verdict="matched", p2p=False):
    ranks = tuple(e.rank for e in entries)
    return Joined(0, ranks, "0", {e.rank: e for e in entries}, ranks, (), p2p=p2p, verdict=verdict)


def _all(r0, r1, *, a=0, b=1):
    """An all_reduce of ranks a and b: (issue, complete) of each."""
    return _joined(_entry(a, issue=r0[0], complete=r0[1]), _entry(b, issue=r1[0], complete=r1[1]))


def test_dependency_of_each_kind_of_collective():
    for func in ("all_reduce", "all_gather", "reduce_scatter", "barrier"):
        assert dependency(_joined(_entry(0, func), _entry(1, func))) == ("all", -1, -1)
    for func in ("broadcast", "scatter"):  # the others depend on the root
        assert dependency(_joined(_entry(0, func, root=1), _entry(1, func, root=1))) == ("from", 1, -1)
    for func in ("reduce", "gather"):  # the root depends on the others
        assert dependency(_joined(_entry(0, func, root=0), _entry(1, func, root=0))) == ("to", 0, -1)
    for send, recv in (("send", "recv"), ("isend", "irecv")):  # the receiver on the sender
        j = _joined(_entry(1, send, peer=0), _entry(0, recv, peer=1), p2p=True)
        assert dependency(j) == ("p2p", 1, 0)
    # Bounds nothing: not matched, one member, all_to_all, roots disagreeing or not a member, p2p not 1 to 1.
    assert dependency(_joined(_entry(0), _entry(1), verdict="size_mismatch")) is None
    assert dependency(_joined(_entry(0), _entry(1), verdict="order")) is None
    assert dependency(_joined(_entry(0))) is None
    assert dependency(_joined(_entry(0, "all_to_all"), _entry(1, "all_to_all"))) is None
    assert dependency(_joined(_entry(0, "broadcast", root=0), _entry(1, "broadcast", root=1))) is None
    assert dependency(_joined(_entry(0, "broadcast", root=5), _entry(1, "broadcast", root=5))) is None
    assert dependency(_joined(_entry(0, "send", peer=1), _entry(1, "send", peer=0), p2p=True)) is None
    three = _joined(_entry(0, "send", peer=1), _entry(1, "recv", peer=0), _entry(2, "recv", peer=0), p2p=True)
    assert dependency(three) is None


def test_estimate_clocks_and_rank_arrays_by_hand():
    # Ranks 0, 2, 3 on clocks of their own (no rank 1). Times in ns on each rank's clock:
    #   all_reduce (0, 2): rank 0 in at 0, done 10; rank 2 in at 1e17 + 1, done 1e17 + 11
    #     o2 - o0 <= 1e17 + 11 - 0,  o2 - o0 >= 1e17 + 1 - 10: midpoint 1e17 + 1, half-width ceil(20 / 2) = 10
    #   broadcast from 0 to 3: rank 3 done at 20 -> o3 - o0 <= 20 - 0, and no lower bound: no estimate.
    big = 10**17
    joined = [
        _all((0, 10), (big + 1, big + 11), b=2),
        _joined(_entry(0, "broadcast", 0, 5, root=0), _entry(3, "broadcast", 7, 20, root=0)),
    ]
    clock_of = {0: ("rank", 0), 2: ("rank", 2), 3: ("rank", 3)}
    sol = estimate_clocks(joined, clock_of)
    assert sol.offsets == {0: 0, 2: big + 1, 3: 0}
    assert sol.uncertainty == {0: 0, 2: 10, 3: None}
    assert sol.method == {0: "same-host", 2: "estimated", 3: "none"}
    assert sol.reference == {0: 0, 2: 0, 3: 0} and sol.collectives == {0: 2, 2: 1, 3: 1}
    assert sol.violation_ns == 0
    assert estimate_clocks(joined, clock_of, Members.of(joined)) == sol  # members given or built: the same
    # Per rank index < size; rank 1 (no shard) and rank 4 (beyond): clock -1, offset 0, uncertainty -1, ref -1.
    # Clocks are numbered by their lowest rank: 0, 1, 2 for ranks 0, 2, 3. Offsets are exact int64.
    clock, offset, unc, ref = sol.rank_arrays(5)
    assert [a.dtype for a in (clock, offset, unc, ref)] == [np.int64] * 4
    assert clock.tolist() == [0, -1, 1, 2, -1]
    assert offset.tolist() == [0, 0, big + 1, 0, 0]
    assert unc.tolist() == [0, -1, 10, -1, -1]  # -1: not estimated (rank 3) or no rank
    assert ref.tolist() == [0, -1, 0, 0, -1]
    small = sol.rank_arrays(3)  # ranks >= size are left out
    assert [a.tolist() for a in small] == [[0, -1, 1], [0, 0, big + 1], [0, -1, 10], [0, -1, 0]]
    empty = estimate_clocks([], {})
    assert (empty.offsets, empty.method, empty.collectives, empty.violation_ns) == ({}, {}, {}, 0)
    assert [a.tolist() for a in empty.rank_arrays(0)] == [[], [], [], []]


def test_unknown_times_bound_nothing():
    # Ranks 0 and 1 on clocks of their own. A: both in at 0, done at 10: o1 - o0 in [-10, 10].
    a = _all((0, 10), (0, 10))
    clock_of = {0: ("rank", 0), 1: ("rank", 1)}
    # B: rank 1's issue time is unknown (-1): only rank 0's issue bounds, o1 - o0 <= 5 - 0. Interval [-10, 5]:
    # midpoint floor(-5 / 2) = -3, half-width ceil(15 / 2) = 8.
    sol = estimate_clocks([a, _all((0, 3), (-1, 5))], clock_of)
    assert (sol.offsets[1], sol.uncertainty[1], sol.method[1]) == (-3, 8, "estimated")
    # C: rank 1 was seen completed without a completion time (-1): only rank 0's completion bounds,
    # o0 - o1 <= 20 - 15, so o1 - o0 >= -5. Interval [-5, 10]: midpoint 2, half-width 8.
    sol = estimate_clocks([a, _all((0, 20), (15, -1))], clock_of)
    assert (sol.offsets[1], sol.uncertainty[1], sol.violation_ns) == (2, 8, 0)
    # A collective with no known completion, or no known issue, links nothing: rank 1 stays its own reference.
    for times in (((0, -1), (0, -1)), ((-1, 10), (-1, 10))):
        sol = estimate_clocks([_all(*times)], clock_of)
        assert sol.reference == {0: 0, 1: 1} and sol.collectives == {0: 0, 1: 0}
        assert sol.offsets == {0: 0, 1: 0} and sol.uncertainty == {0: 0, 1: 0}


def _stepped(v):
    """Two clocks whose bounds contradict by 2 v: A (all in at 0, done at 10) says o1 - o0 in [-10, 10]; B
    (rank 0 in and done at 100, rank 1 in and done at 110 + 2 v) says o1 - o0 = 10 + 2 v."""
    joined = [_all((0, 10), (0, 10)), _all((100, 100), (110 + 2 * v, 110 + 2 * v))]
    return estimate_clocks(joined, {0: ("rank", 0), 1: ("rank", 1)})


def test_contradictions_are_widened_by_the_least_whole_ns():
    # Upper bound 10, lower 10 + 2 v: widening both by v makes them meet at 10 + v; that v is the violation and
    # the whole uncertainty.
    # 1_000 and 4_000 are widenings the doubling search itself tries (1 us x 2**k): found at once, none less works.
    for v in (1, 2, 1_000, 1_500, 4_000, 10**9 + 7):
        sol = _stepped(v)
        got = (sol.violation_ns, sol.offsets[1], sol.uncertainty[1], sol.method[1])
        assert got == (v, 10 + v, v, "estimated"), v
        assert [type(x) for x in got[:3]] == [int, int, int]  # whole ns


def test_a_contradiction_is_found_and_reported_whichever_way_it_is_reached():
    # Rank 1 broadcasts to rank 0 (o1 - o0 >= 0 - 50: a lower bound only); ranks 1 and 2 contradict each other
    # by 2 x 10 ns (as in _stepped). From rank 0 nothing is reachable forwards, the contradiction only backwards:
    # still widened by 10 and reported, and ranks 1 and 2 stay one-sided against rank 0: no estimate.
    v = 10
    joined = [
        _joined(_entry(0, "broadcast", 0, 50, root=1), _entry(1, "broadcast", 0, 5, root=1)),
        _all((0, 10), (0, 10), a=1, b=2),
        _all((100, 100), (110 + 2 * v, 110 + 2 * v), a=1, b=2),
    ]
    sol = estimate_clocks(joined, {r: ("rank", r) for r in range(3)})
    assert sol.violation_ns == v and sol.reference == {0: 0, 1: 0, 2: 0}
    assert sol.method == {0: "same-host", 1: "none", 2: "none"}
    assert sol.uncertainty == {0: 0, 1: None, 2: None}


def test_a_contradiction_beyond_the_widening_limit_leaves_the_clock_unestimated():
    # Widening is tried up to 2**50 ns (~13 days; doubling from 1 us: the last try is 1e3 * 2**40 ns). A clock
    # stepped by 3e15 ns (~35 days) needs 1.5e15: beyond it, so rank 1 gets no estimate.
    sol = _stepped(1_500_000_000_000_000)
    assert sol.offsets == {0: 0, 1: 0} and sol.uncertainty == {0: 0, 1: None}
    assert sol.method == {0: "same-host", 1: "none"}
    # Still reported: contradicted by more than the last widening tried, and nothing estimated.
    assert sol.unresolved and sol.violation_ns == 1_000 * 2**40
    assert not _stepped(10**9 + 7).unresolved


# -- through the merge -----------------------------------------------------------------------------------------
def test_a_clock_bounded_on_one_side_gets_no_estimate(tmp_path):
    # Three hosts. Rank 0 broadcasts to rank 1 only: rank 1's completion bounds o1 - o0 from above, nothing
    # bounds it from below -> method none, offset 0, uncertainty NA. Ranks 0 and 2 all_reduce: both in
    # together, done 50 us later -> rank 2 at its shift +- 50 us.
    s1, s2 = 7 * 10**9, -3 * 10**9
    b, d = T, T + 10**7
    scripts = [
        [
            coll("broadcast", source=A, group=(0, 1), root=0, issue=b, complete=b + 10_000),
            coll(source=B, group=(0, 2), issue=d, complete=d + 50_000),
        ],
        [coll("broadcast", source=A, group=(0, 1), root=0, issue=b + 5_000 + s1, complete=b + 30_000 + s1)],
        [coll(source=B, group=(0, 2), issue=d + s2, complete=d + 50_000 + s2)],
    ]
    g = _run(tmp_path, scripts, hosts=["node0", "node1", "node2"])
    clocks = g.clocks.set_index("rank")
    assert list(clocks.method) == ["same-host", "none", "estimated"]
    assert g.offsets == {(0, 0): 0, (0, 1): 0, (0, 2): s2}
    assert pd.isna(clocks.loc[1, "uncertainty_ns"]) and clocks.loc[2, "uncertainty_ns"] == 50_000
    assert list(clocks.reference) == [0, 0, 0] and list(clocks.collectives) == [2, 1, 1]
    # Rank 1's times cannot be compared with rank 0's: nobody is blamed for the broadcast, whose uncertainty is
    # unknown (-1).
    bc = g.collectives.set_index("func").loc["broadcast"]
    assert bc.last_rank == -1 and bc.uncertainty_ns == -1
    assert g.timings[0]["waits"] == {0: 0, 1: 0}


def test_ranks_linked_by_no_collective_are_their_own_reference(tmp_path):
    # Five hosts. Ranks 0 and 2 share all_reduces, ranks 3 and 4 share others, rank 1 shares none. Each set is
    # measured against its lowest rank: references 0, 1, 0, 3, 3. In each pair both are in together and done
    # 50 us later: the second rank at its shift from the first +- 50 us.
    shifts = [0, 5 * 10**9, 2 * 10**9, -4 * 10**9, 9 * 10**9]
    scripts: list[list] = [[] for _ in range(5)]
    for k in range(3):
        for pair in ((0, 2), (3, 4)):
            base = T + (2 * k + pair[0]) * 10**7
            for r in pair:
                scripts[r].append(
                    coll(source=A, group=pair, issue=base + shifts[r], complete=base + 50_000 + shifts[r])
                )
    g = _run(tmp_path, scripts, hosts=[f"node{r}" for r in range(5)])
    clocks = g.clocks.set_index("rank")
    assert list(clocks.reference) == [0, 1, 0, 3, 3]
    assert list(clocks.collectives) == [3, 0, 3, 3, 3]
    assert clocks.loc[2, "method"] == "estimated" and clocks.loc[4, "method"] == "estimated"
    assert list(clocks.uncertainty_ns) == [0, 0, 50_000, 0, 50_000]
    assert g.offsets == {(0, 0): 0, (0, 1): 0, (0, 2): shifts[2], (0, 3): 0, (0, 4): shifts[4] - shifts[3]}
    # The summary says which clocks are not aligned with the others (not "offsets 0 by construction").
    assert "step 0: no collective links the clock of rank(s) 1, 3 to the others" in g.summary()


def test_real_epoch_times_are_exact_to_the_ns(tmp_path):
    # The docs' worked example at today's wall-clock times (~1.7e18 ns, near int64's 2**61 "unreachable"
    # threshold; float64 steps there are 256 ns): the same offset and waits, to the ns.
    t0 = 1_700_000_000_123_456_789
    table = [(1000, 1310, 5300, 5310, False), (2200, 2220, 6000, 6220, False), (3000, 3110, 7100, 7400, True)]
    us = 1_000
    s0 = [coll(source=A, issue=t0 + a * us, complete=t0 + b * us, is_async=x) for a, b, _, _, x in table]
    s1 = [coll(source=A, issue=t0 + c * us, complete=t0 + d * us, is_async=x) for _, _, c, d, x in table]
    traces = [make_trace(r, s, t0=t0 - 10**6, host=f"node{r}") for r, s in enumerate((s0, s1))]
    write_run(tmp_path, traces)
    g = merge_ranks(tmp_path)
    assert g.offsets[(0, 1)] == 4_005 * us and g.clocks.uncertainty_ns[1] == 15 * us
    assert [t["waits"] for t in g.timings] == [{0: 295 * us, 1: 0}, {0: 0, 1: 205 * us}, {0: 95 * us, 1: 0}]
    assert list(g.collectives.skew_ns) == [295 * us, 205 * us, 95 * us]


def test_hung_window_counts_the_time_blocked_in_the_collective(tmp_path):
    # Rank 0 is blocked in B until its window ends 10 s after T (gloo's timeout; an incomplete shard). Ops:
    # mm [T, T+1000], A [T+1000, T+51000], mm [T+51000, T+52000], B issued at T+52000 and never completed.
    from tl_dist.merge.timing import trace_breakdown

    end = T + 10 * 10**9
    s0 = [coll(source=A), coll(source=B, state="issued")]
    hung = make_trace(0, s0, t0=T, complete=False, metadata={"window_end_ns": end})
    done = make_trace(1, [coll(source=A)], t0=T)
    write_run(tmp_path, [hung, done])
    tb = merge_ranks(tmp_path).time_breakdown().set_index("rank")
    expected = {"compute_ns": 2000, "comm_ns": 50_000 + (end - T - 52_000), "window_ns": end - T}
    assert {k: int(tb.loc[0, k]) for k in expected} == expected
    assert {k: trace_breakdown(0, 0, hung)[k] for k in expected} == expected
    # A complete shard ends with its last op: nothing is added.
    assert {k: int(tb.loc[1, k]) for k in expected} == {
        "compute_ns": 1000,
        "comm_ns": 50_000,
        "window_ns": 51_000,
    }
