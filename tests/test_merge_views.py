"""Views of a merged trace on hand-written shards: tables, summary, Perfetto JSON, drawing, save/load."""

import json

import pytest
from external import have
from merge_synth import coll, make_trace, write_run

import tl_dist as tl

A, B = "train.py:10", "train.py:11"
SHIFT = 2_000_000_000  # rank 1 runs on another host whose clock is 2 s ahead


@pytest.fixture
def merged(tmp_path):
    # True times, per all_reduce k (T = its base): who arrives when, and the instant both complete.
    #   k=0: rank 0 at T, rank 1 at T+3 ms (last); done T+3.010 ms
    #   k=1: rank 1 at T, rank 0 at T+1 ms (last); done T+1.030 ms
    #   k=2: as k=0
    # Causality bounds on offset(1) - offset(0) - SHIFT: <= min(done - rank 0's arrival) = 30 us (k=1);
    # >= max(rank 1's arrival - done) = -10 us (k=0, 2). Midpoint SHIFT + 10 us, half-width 20 us.
    s0, s1 = [], []
    arrivals = [(0, 3_000_000, 3_010_000), (1_000_000, 0, 1_030_000), (0, 3_000_000, 3_010_000)]
    for k, (a0, a1, done) in enumerate(arrivals):
        base = 10**12 + (k + 1) * 10_000_000
        s0.append(coll(source=A, issue=base + a0, complete=base + done))
        s1.append(coll(source=A, issue=base + a1 + SHIFT, complete=base + done + SHIFT))
    s0.append(coll(source=B, numel=4))
    s1.append(coll(source=B, numel=8))
    write_run(tmp_path / "run", [make_trace(0, s0), make_trace(1, s1, t0=10**12 + SHIFT, host="node1")])
    return tl.merge_ranks(tmp_path / "run")


OFFSET = SHIFT + 10_000


def test_tables(merged):
    g = merged
    assert g.offsets == {(0, 0): 0, (0, 1): OFFSET}
    clocks = g.clocks
    assert list(clocks.columns) == [
        "step",
        "rank",
        "host",
        "offset_ns",
        "uncertainty_ns",
        "method",
        "collectives",
        "reference",
    ]
    assert clocks.values.tolist() == [
        [0, 0, "node0", 0, 0, "same-host", 3, 0],
        [0, 1, "node1", OFFSET, 20_000, "estimated", 3, 0],
    ]
    ops = g.to_pandas()
    assert len(ops) == len(g.rank(0)) + len(g.rank(1)) == 16
    assert list(ops.columns[:3]) == ["step", "rank", "aligned_start_ns"]
    assert (ops.aligned_start_ns == ops.start_ns - ops["rank"].map({0: 0, 1: OFFSET})).all()
    coll_frame = g.collectives
    assert list(coll_frame.verdict) == ["matched"] * 3 + ["size_mismatch"]
    # Aligned arrivals: rank 1's are 10 us earlier than true; k=0: 3 ms - 10 us, k=1: 1 ms + 10 us.
    assert list(coll_frame.skew_ns[:3]) == [2_990_000, 1_010_000, 2_990_000]
    assert list(coll_frame.last_rank[:3]) == [1, 0, 1]
    assert list(coll_frame.uncertainty_ns[:3]) == [20_000] * 3
    assert list(coll_frame.bytes) == [16, 16, 16, 32]


def test_summary_names_finding_and_straggler(merged):
    text = merged.summary()
    assert "size_mismatch" in text and "train.py:11" in text
    assert "step 0: rank 1 2000.010 +- 0.020 vs rank 0 (3)" in text  # the clock offset, ms
    # 2 x 2.99 ms caused; 1.01 ms. The straggler (step_facts.straggler): the most caused, rank 1.
    assert (
        "step 0: straggler rank 1, the others waited 5.980 ms; rank 1 5.980 (1.010), rank 0 1.010 (5.980)"
        in text
    )


def test_perfetto_json(merged, tmp_path):
    path = merged.to_perfetto(tmp_path / "t.json")
    data = json.loads(open(path).read())
    events = data["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}
    slices = [e for e in events if e["ph"] == "X" and e["cat"] in ("compute", "collective")]
    assert len(slices) == 16
    flows = [e for e in events if e["ph"] in "stf" and e.get("cat") == "collective"]
    assert len(flows) == 8  # 4 collectives x 2 ranks
    by_id = {}
    for e in flows:
        by_id.setdefault(e["id"], []).append(e)
    for chain in by_id.values():
        assert sorted(e["ph"] for e in chain) == ["f", "s"] and {e["pid"] for e in chain} == {0, 1}
        # every flow point lies inside a slice of its rank, so the UI binds it
        for e in chain:
            assert any(s["pid"] == e["pid"] and s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in slices)
    # aligned time: the first collective's slices overlap on both ranks despite the 2 s clock shift
    ar = [s for s in slices if s["name"] == "all_reduce_1"]
    assert abs(ar[0]["ts"] - ar[1]["ts"]) < 5_000  # us
    # Aligned arrivals (fixture): at k=0 and k=2 rank 0 waits 3 ms - 10 us for rank 1, at k=1 rank 1 waits
    # 1 ms + 10 us for rank 0; each within the waiting rank's collective slice (3.010 / 1.030 ms long).
    waits = [(e["pid"], e["name"], e["dur"]) for e in events if e.get("cat") == "wait"]
    assert waits == [(0, "wait for rank 1", 2990.0)] * 2 + [(1, "wait for rank 0", 1010.0)]


@pytest.mark.needs("dot", optional=True)
def test_draw_joins_ranks(merged, tmp_path):
    from tl_dist.merge.draw import merged_source

    src = merged_source(merged)
    assert "cluster_s0r0_rank" in src and "cluster_s0r1_rank" in src
    assert src.count("dir=none") == 4 and src.count("#c62828") == 1  # one red edge: the size mismatch
    if have("dot"):
        import xml.etree.ElementTree as ET

        out = merged.draw(str(tmp_path / "g.svg"))
        root = ET.parse(out).getroot()  # well-formed SVG, as dot laid it out
        ns = "{http://www.w3.org/2000/svg}"
        assert root.tag == f"{ns}svg"
        groups = {g.get("class"): [] for g in root.iter(f"{ns}g")}
        for g in root.iter(f"{ns}g"):
            groups[g.get("class")].append(g.findtext(f"{ns}title"))
        # both ranks' clusters, each with its label
        assert {"cluster_s0r0_rank", "cluster_s0r1_rank"} <= set(groups["cluster"])
        texts = {t.text for t in root.iter(f"{ns}text")}
        assert {"rank 0 step 0", "rank 1 step 0"} <= texts
        red = [p for p in root.iter(f"{ns}path") if p.get("stroke") == "#c62828"]
        assert len(red) == 1  # one red edge: the size mismatch


def test_save_and_load_merged(merged, tmp_path):
    path = merged.save(tmp_path / "m.h5")
    back = tl.load_merged(path)
    assert back.offsets == merged.offsets
    assert [(f.kind, f.seq, f.ranks) for f in back.findings] == [
        (f.kind, f.seq, f.ranks) for f in merged.findings
    ]
    assert back.rank(1).columns == merged.rank(1).columns
    assert back.collectives.equals(merged.collectives)
    with pytest.raises(tl.ShardFormatError, match="not a merged trace"):
        tl.load_merged(next((tmp_path / "run" / "rank00000").glob("*.h5")))


def test_draw_filters_ranks_and_steps(merged):
    from tl_dist.merge.draw import merged_source

    one = merged_source(merged, rank=1)
    assert "cluster_s0r1_rank" in one and "cluster_s0r0_rank" not in one
    assert "dir=none" not in one  # no other rank to join a collective to
    assert merged_source(merged, rank=[0, 1], step=0) == merged_source(merged)
    with pytest.raises(ValueError, match=r"rank=5: no shard for rank \[5\]; the run has \[0, 1\]"):
        merged_source(merged, rank=5)
    with pytest.raises(ValueError, match=r"step must be None, an int or a list of ints; got '0'"):
        merged_source(merged, step="0")
    with pytest.raises(ValueError, match="phase must be None"):
        merged_source(merged, phase="fwd")
