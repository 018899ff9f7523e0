"""Builders of per-rank traces with hand-written collectives, for merge tests that need exact control
(clock shifts, known sleeps). Shards are written with the store's real writer."""

from __future__ import annotations

from pathlib import Path

from tl_dist.schema import COLLECTIVE_FIELDS, EMPTY_VALUE, OP_FIELDS, empty_columns
from tl_dist.store import write_shard
from tl_dist.trace import Trace

NUMEL = {"all_reduce": (1, 1), "all_gather": (1, 2), "reduce_scatter": (2, 1)}


def coll(
    func="all_reduce",
    *,
    numel=4,
    dtype="float32",
    source=None,
    module="",
    issue=0,
    complete=None,
    state="completed",
    group=(0, 1),
    peer=-1,
    is_async=False,
    out_numel=None,
    in_numel=None,
    compute_ns=0,
    root=-1,
    group_name=None,
):
    """One collective of a rank's script: issued at ``issue`` ns after the previous op ended (``compute_ns``
    of compute before it), completed at ``complete`` (absolute, rank clock) or right after issue. ``in_numel`` /
    ``out_numel`` override the element counts the kind's rule gives ``numel`` (NUMEL)."""
    return dict(
        func=func,
        numel=numel,
        dtype=dtype,
        source=source or f"train.py:{func}",
        module=module,
        issue=issue,
        complete=complete,
        state=state,
        group=tuple(group),
        peer=peer,
        is_async=is_async,
        out_numel=out_numel,
        in_numel=in_numel,
        compute_ns=compute_ns,
        root=root,
        group_name=group_name,
    )


def make_trace(
    rank, script, *, world_size=2, step=0, t0=1_000_000_000_000, complete=True, host="node0", metadata=None
):
    """A trace whose ops are, per script entry: one compute op (``compute_ns`` long) then the collective.

    Collective ``issue``/``complete`` in each entry are absolute ns on this rank's clock when given; the
    sequence number of each group counts from 1 in script order. ``host`` names the clock (host and boot id,
    as an armed capture records them): ranks given the same one share a clock. ``metadata`` adds to the shard's.
    """
    rows = []
    ct = empty_columns(COLLECTIVE_FIELDS)
    seqs: dict[tuple, int] = {}
    counts: dict[str, int] = {}
    t = t0
    for c in script:
        for func, kind, dur, src in (
            ("mm", "compute", c["compute_ns"] or 1000, "model.py:5"),
            (c["func"], "collective", None, c["source"]),
        ):
            counts[func] = counts.get(func, 0) + 1
            row = {f.name: EMPTY_VALUE[f.kind] for f in OP_FIELDS}
            row.update(index=len(rows), label=f"{func}_{counts[func]}", func=func, kind=kind, source=src)
            row.update(module=c["module"], module_call=-1, phase="forward", dtype=c["dtype"])
            if kind == "collective":
                start = c["issue"] or t
                end = c["complete"] if c["complete"] is not None else start + 50_000
                row.update(start_ns=start, duration_ns=max(end - start, 0), aten=f"c10d.{func}_.default")
                t = end
                group = c["group"]
                # unique, as c10d: "0" for the default group
                name = c["group_name"] or ("0" if len(group) == world_size else "-".join(map(str, group)))
                seqs[(name, group)] = seqs.get((name, group), 0) + 1
                i_mul, o_mul = NUMEL.get(func, (1, 1))
                out_numel = c["out_numel"] if c["out_numel"] is not None else c["numel"] * o_mul
                in_numel = c["in_numel"] if c["in_numel"] is not None else c["numel"] * i_mul
                values = dict(
                    op=len(rows),
                    func=func,
                    group_ranks=group,
                    group_name=name,
                    group_desc="default_pg",
                    seq=seqs[(name, group)] if func not in ("send", "recv") else -1,
                    reduce_op="sum" if func in ("all_reduce", "reduce_scatter") else "",
                    root=c["root"],
                    peer=c["peer"],
                    in_numel=in_numel,
                    out_numel=out_numel,
                    dtype=c["dtype"],
                    bytes=in_numel * 4,
                    is_async=c["is_async"],
                    issue_ns=start,
                    complete_ns=end if c["state"] == "completed" else -1,
                    state=c["state"],
                    bucket=-1,
                    backend="gloo",
                )
                full = {f.name: EMPTY_VALUE[f.kind] for f in COLLECTIVE_FIELDS}
                full.update(values)
                for k in ct:
                    ct[k].append(full[k])
            else:
                row.update(start_ns=t, duration_ns=dur, aten="aten.mm.default", flops=100)
                t += dur
            rows.append(row)
    columns = {f.name: [r[f.name] for r in rows] for f in OP_FIELDS}
    mods = {"address": [], "type": [], "call": [], "parent": [], "depth": [], "first_op": [], "end_op": []}
    mods.update(out_ops=[], out_pos=[])
    meta = {"rank": rank, "world_size": world_size, "step": step, "complete": complete}
    meta.update({"host": host, "boot_id": f"boot-of-{host}"})
    meta.update(metadata or {})
    return Trace(columns, mods, collective_table=ct, metadata=meta)


def write_run(root: Path, traces, *, complete=None):
    """Write traces as ``root/rank{R}/step{S}.h5`` shards; returns the paths."""
    paths = []
    for trace in traces:
        rank, step = trace.metadata["rank"], trace.metadata["step"]
        folder = Path(root) / f"rank{rank:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        ok = trace.metadata["complete"] if complete is None else complete
        paths.append(write_shard(trace, folder / f"step{step:08d}.h5", complete=ok))
    return paths


# -- a 4-rank, 4-step run on two hosts with findings in three steps (tests of the Dask merge and of per-step
# merged folders) ----------------------------------------------------------------------------------------------
BASE = 1_000_000_000_000
SHIFT = {"node0": 0, "node1": 3_000_000}  # node1's clock runs 3 ms ahead


def _script(rank, step, host, *, numel=4, last_state="completed", skip=()):
    """Three world all_reduces and an all_gather on ranks (0, 1); arrivals jittered per (rank, k) so each rank
    is now and then the last; all complete together (on the true clock)."""
    out = []
    for k in range(4):
        true_issue = BASE + step * 10**9 + k * 1_000_000 + ((rank * 7919 + k * 104729) % 40_000)
        true_done = BASE + step * 10**9 + k * 1_000_000 + 200_000
        func, group = ("all_gather", (0, 1)) if k == 3 else ("all_reduce", (0, 1, 2, 3))
        if rank not in group or k in skip:
            continue
        state = last_state if k == 2 else "completed"
        size = numel if k == 1 else 4
        out.append(
            coll(
                func,
                numel=size,
                group=group,
                issue=true_issue + SHIFT[host],
                complete=true_done + SHIFT[host] if state == "completed" else None,
                state=state,
                compute_ns=1000 + rank * 10,
                source=f"train.py:{10 + k}",  # one line per collective: what aligns records across ranks
            )
        )
    return out


def four_step_run(root):
    """4 ranks on 2 hosts, 4 steps: step 0 healthy, step 1 rank 3's second all_reduce of another size, step 2
    rank 2 absent and rank 1's window ended early (its third all_reduce never completed), step 3 rank 3 skips
    the second all_reduce (the aligner compares records by their interned (func, module, source) keys)."""
    traces = []
    for step in range(4):
        for rank in range(4):
            host = "node0" if rank < 2 else "node1"
            if step == 2 and rank == 2:
                continue
            numel = 6 if (step == 1 and rank == 3) else 4
            last = "started" if (step == 2 and rank == 1) else "completed"
            trace = make_trace(
                rank,
                _script(
                    rank,
                    step,
                    host,
                    numel=numel,
                    last_state=last,
                    skip=(1,) if (step, rank) == (3, 3) else (),
                ),
                world_size=4,
                step=step,
                host=host,
                complete=not (step == 2 and rank == 1),
            )
            traces.append(trace)
    write_run(root, traces)


def assert_same_merge(a, b):
    """Two merges of one run agree field by field: findings, steps, ranks, clocks, collectives, stragglers,
    time breakdown and summary."""
    assert a.findings == b.findings
    assert a.steps == b.steps and a.ranks == b.ranks and a.incomplete == b.incomplete
    for name in ("clocks", "collectives"):
        assert getattr(a, name).equals(getattr(b, name)), name
    assert a.stragglers().equals(b.stragglers())
    assert a.time_breakdown().equals(b.time_breakdown())
    assert a.summary() == b.summary()
