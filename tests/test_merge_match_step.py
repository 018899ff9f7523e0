"""``match_step`` on hand-built collective records: which group a record joins, the order of the joined
collectives, and point-to-point channels with unequal sides.

The records are built here field by field (no shards), so each test states exactly what every rank issued;
the expected joins and verdicts are written out by hand from the rules in ``tl_dist/merge/match.py``'s
docstring, not computed by the code under test.
"""

from __future__ import annotations

from tl_dist.merge.match import Entry, match_step

_IDS: dict[str, int] = {}


def _id(text):
    return _IDS.setdefault(text, len(_IDS))


def _entry(
    rank, op, func="all_reduce", *, group, name, seq, peer=-1, numel=8, state="completed", source="t.py:1"
):
    # key = (func, module, source) ids as the aligner compares them: the same for the same call site everywhere.
    return Entry(
        rank=rank,
        row=op,
        op=op,
        func=func,
        group=group,
        group_name=name,
        seq=seq,
        peer=peer,
        root=-1,
        in_numel=numel,
        out_numel=numel,
        dtype="torch.float32",
        nbytes=4 * numel,
        is_async=False,
        issue_ns=1000 * op,
        complete_ns=1000 * op + 500,
        state=state,
        label=f"{func}_{op}",
        module="block",
        source=source,
        in_module=True,
        key=(_id(func), _id("block"), _id(source)),
    )


def _match(entries, *, incomplete=(), absent=(), last_op=None, ended=None):
    return match_step(
        3,
        entries,
        incomplete=set(incomplete),
        absent=set(absent),
        last_op=last_op if last_op is not None else {r: {"op": 99, "label": "mm_99"} for r in entries},
        ended=ended,
    )


def test_groups_with_the_same_members_are_told_apart_by_name():
    # Two process groups over the same ranks (e.g. a second group for gradients), issued interleaved; the
    # member tuple is one shared object, as the shard reader gives it.
    members = (0, 1)
    per_rank = {
        r: [
            _entry(r, 0, group=members, name="1", seq=0),
            _entry(r, 1, group=members, name="0", seq=0),
            _entry(r, 2, group=members, name="1", seq=1),
        ]
        for r in (0, 1)
    }
    joined, findings = _match(per_rank)
    assert findings == []
    # Sorted by members, then name: group "0" (one collective), then group "1" (two, in sequence order).
    assert [(j.group_name, j.seq, {r: e.op for r, e in j.entries.items()}) for j in joined] == [
        ("0", 0, {0: 1, 1: 1}),
        ("1", 0, {0: 0, 1: 0}),
        ("1", 1, {0: 2, 1: 2}),
    ]
    assert all(j.step == 3 and j.verdict == "matched" and j.absent == () for j in joined)


def test_groups_join_in_order_of_their_members_not_of_their_names():
    world, pair = (0, 1, 2), (0, 1)
    per_rank = {r: [_entry(r, 0, group=world, name="0", seq=0)] for r in world}
    for r in pair:
        per_rank[r].append(_entry(r, 1, group=pair, name="1", seq=0))
    joined, findings = _match(per_rank)
    assert findings == []
    assert [(j.group, j.group_name) for j in joined] == [(pair, "1"), (world, "0")]


def test_unnamed_groups_are_told_apart_by_members():
    # torch builds without ProcessGroup.group_name record "" for every group: the members must separate them.
    world, pair = (0, 1, 2), (0, 1)
    name = ""
    per_rank = {r: [_entry(r, 0, group=world, name=name, seq=0)] for r in world}
    for r in pair:
        per_rank[r].append(_entry(r, 1, group=pair, name=name, seq=0, numel=4))
        per_rank[r].append(_entry(r, 2, group=world, name=name, seq=1))
    per_rank[2].append(_entry(2, 2, group=world, name=name, seq=1))
    joined, findings = _match(per_rank)
    assert findings == []
    assert [(j.group, j.seq, sorted(j.entries)) for j in joined] == [
        ((0, 1), 0, [0, 1]),
        ((0, 1, 2), 0, [0, 1, 2]),
        ((0, 1, 2), 1, [0, 1, 2]),
    ]


def test_collectives_join_in_sequence_order_and_unknown_sequence_numbers_go_last_in_op_order():
    # Records reach match_step in table order, which need not be sequence order; -1 is "no sequence number"
    # (a torch without the getter): those follow the numbered ones, in the order the ops ran.
    g = (0, 1)
    order = [(0, -1), (1, 1), (2, 0), (3, -1)]  # (op, seq)
    per_rank = {
        r: [_entry(r, op, group=g, name="0", seq=seq, source=f"t.py:{op}") for op, seq in order] for r in g
    }
    per_rank[1].reverse()  # the other rank's table lists them the other way round: same joins
    joined, findings = _match(per_rank)
    assert findings == []
    assert [(j.entries[0].op, j.entries[1].op, j.seq) for j in joined] == [
        (2, 2, 0),
        (1, 1, 1),
        (0, 0, -1),
        (3, 3, -1),
    ]


def test_p2p_channels_are_ordered_by_group_then_src_dst_then_name():
    big, small = (0, 1, 2), (0, 2)
    per_rank = {
        # Rank 1's sends on two groups over the same members (names "c" then "b"), both to rank 0.
        1: [
            _entry(1, 0, "send", group=big, name="c", seq=0, peer=0),
            _entry(1, 1, "send", group=big, name="b", seq=0, peer=0),
        ],
        0: [
            _entry(0, 0, "recv", group=big, name="c", seq=0, peer=1),
            _entry(0, 1, "recv", group=big, name="b", seq=0, peer=1),
            _entry(0, 2, "isend", group=small, name="a", seq=0, peer=2),
        ],
        2: [_entry(2, 0, "irecv", group=small, name="a", seq=0, peer=0)],
    }
    joined, findings = _match(per_rank)
    assert findings == []
    assert [(j.group, j.group_name, j.expected, j.p2p, j.step, j.absent) for j in joined] == [
        (big, "b", (1, 0), True, 3, ()),
        (big, "c", (1, 0), True, 3, ()),
        (small, "a", (0, 2), True, 3, ()),
    ]
    assert [(j.entries[j.expected[0]].op, j.entries[j.expected[1]].op) for j in joined] == [
        (1, 1),
        (0, 0),
        (2, 0),
    ]


def test_p2p_with_unequal_sides_a_hung_peer_and_an_absent_one():
    # World of 3, rank 0 has no shard. Rank 1 sent rank 2 two messages; rank 2 (hung: incomplete shard)
    # received one and never posted the recv for rank 1's irecv from it.
    g = (0, 1, 2)
    per_rank = {
        1: [
            _entry(1, 0, "recv", group=g, name="0", seq=0, peer=0),  # from the absent rank: not judged
            _entry(1, 1, "send", group=g, name="0", seq=1, peer=2),
            _entry(1, 2, "send", group=g, name="0", seq=2, peer=2, state="started"),
            _entry(1, 3, "irecv", group=g, name="0", seq=3, peer=2, state="scheduled", source=""),
        ],
        2: [
            _entry(2, 0, "recv", group=g, name="0", seq=0, peer=1),
            # A recv from any source has no known sender (peer -1): it cannot be paired, so it is not judged.
            _entry(2, 1, "recv_any_source", group=g, name="0", seq=1, peer=-1, state="started"),
        ],
    }
    last_op = {1: {"op": 3, "label": "irecv_3"}, 2: {"op": 7, "label": "add_7"}}
    ended = {2: {"end_reason": "hang", "stack_at": "train.py:40"}}
    joined, findings = _match(per_rank, incomplete={2}, absent={0}, last_op=last_op, ended=ended)

    assert [(j.expected, sorted(j.entries), j.verdict) for j in joined] == [
        ((1, 2), [1, 2], "matched"),
        ((1, 2), [1], "not_completed"),
        ((2, 1), [1], "not_completed"),
    ]
    assert [(f.kind, f.step, f.group, f.seq, f.ranks, f.primary) for f in findings] == [
        ("not_completed", 3, g, 2, (2,), True),
        ("not_completed", 3, g, 3, (2,), True),
    ]
    first, second = findings
    assert first.message == (
        # rank 1's window closed normally, so it went past its send (a completion it did not see is no hang);
        # the hung rank 2 never reached it
        "p2p send/recv seq 2 of group [0, 1, 2] at send_2 in block (t.py:1): never reached by rank(s) [2] "
        "(incomplete shard); rank 2 never reached send_2: it was at train.py:40; incomplete shards: rank 2 hang"
    )
    assert first.where[2] == {
        "absent": True,
        "last_op": 7,
        "last_label": "add_7",
        "end_reason": "hang",
        "stack_at": "train.py:40",
    }
    assert second.message == (
        "p2p send/recv seq 3 of group [0, 1, 2] at irecv_3 in block (no source): never reached by rank(s) [2] "
        "(incomplete shard); rank 2 never reached irecv_3: it was at train.py:40; incomplete shards: rank 2 hang"
    )
