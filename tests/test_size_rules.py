"""Property tests of the merge's collective size rules: random group sizes, element counts and roots.

For each kind, sizes that follow the kind's contract (written here from what torch.distributed moves, not from
tl_dist's code) give no finding; changing one member's input or output count gives exactly one size_mismatch,
blaming that member when a majority exists (3+ ranks). The per-kind examples with exact messages are in
test_merge_match.py; these cover the space between them.
"""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from merge_synth import coll, make_trace

from tl_dist.merge.build import build
from tl_dist.merge.sources import TraceSource

# Pure computation (no I/O, no processes): many examples are cheap; no deadline on a shared 2-core machine.
EXAMPLES = settings(max_examples=150, deadline=None)

SAME = ("all_reduce", "broadcast", "reduce")  # every member moves the same buffer in place: in == out == k
KINDS = (*SAME, "all_gather", "gather", "reduce_scatter", "scatter", "all_to_all")


@st.composite
def healthy(draw):
    """(kind, per-rank (in_numel, out_numel), root) for a collective that moved what its contract says."""
    kind = draw(st.sampled_from(KINDS))
    n = draw(st.integers(2, 8))
    k = draw(st.integers(1, 64))
    root = draw(st.integers(0, n - 1))
    if kind in SAME:
        sizes = [(k, k)] * n
    elif kind == "all_gather":  # each gives k, each gets everyone's k
        sizes = [(k, k * n)] * n
    elif kind == "gather":  # each gives k, the root gets n x k, the others get nothing
        sizes = [(k, k * n if r == root else 0) for r in range(n)]
    elif kind == "reduce_scatter":  # each gives n chunks of k, gets its reduced chunk
        sizes = [(k * n, k)] * n
    elif kind == "scatter":  # the root gives n chunks of k, each gets one
        sizes = [(k * n if r == root else 0, k) for r in range(n)]
    else:  # all_to_all with split sizes: what is sent in all is what is received in all
        sends = draw(st.lists(st.integers(0, 64), min_size=n, max_size=n))
        receives = draw(st.permutations(sends))
        sizes = list(zip(sends, receives))
    return kind, sizes, root


def _findings(kind, sizes):
    n = len(sizes)
    traces = {
        (0, r): make_trace(r, [coll(kind, in_numel=i, out_numel=o, group=tuple(range(n)))], world_size=n)
        for r, (i, o) in enumerate(sizes)
    }
    g = build(TraceSource(traces), sorted(traces), world_size=n, strict=True)
    return [(f.kind, f.ranks) for f in g.findings]


@EXAMPLES
@given(healthy())
def test_sizes_that_follow_the_contract_give_no_finding(case):
    kind, sizes, _ = case
    assert _findings(kind, sizes) == []


@EXAMPLES
@given(healthy(), st.data())
def test_one_member_off_gives_one_size_mismatch_blaming_it(case, data):
    kind, sizes, root = case
    n = len(sizes)
    rank = data.draw(st.integers(0, n - 1), label="rank")
    i, o = sizes[rank]
    delta = data.draw(st.integers(1, 16), label="delta")
    if kind in SAME:
        # in != out on one rank, or both changed together (another buffer size than its peers)
        side = data.draw(st.sampled_from(("in", "out", "both")), label="side")
        new = (i + delta if side != "out" else i, o + delta if side != "in" else o)
    else:
        side = data.draw(st.sampled_from(("in", "out")), label="side")
        new = (i + delta, o) if side == "in" else (i, o + delta)
        # A non-root passing the root's n x k to a gather (output) or scatter (input) looks like a root; torch
        # rejects a gather_list / scatter_list on non-roots, so that case cannot be recorded.
        assume(not (kind == "gather" and rank != root and new[1] == sizes[root][1]))
        assume(not (kind == "scatter" and rank != root and new[0] == sizes[root][0]))
    sizes = [new if r == rank else s for r, s in enumerate(sizes)]
    found = _findings(kind, sizes)
    assert [f for f, _ in found] == ["size_mismatch"], (kind, sizes)
    if n >= 3 and kind != "all_to_all":  # a majority to outvote it (all_to_all splits differ by design)
        assert found[0][1] == (rank,), (kind, sizes)
