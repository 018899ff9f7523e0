"""Step facts (tl_dist.step_facts): the window's time facts, the straggler rule and busbw, hand-computed."""

import numpy as np
import pytest

from tl_dist.step_facts import bus_bandwidth, local_facts, straggler

_I = np.int64


def _facts(kinds, starts, durations, spans=((), (), ()), window=(None, None), hung=None):
    return local_facts(
        np.array(kinds, dtype=bool),
        np.array(starts, dtype=_I),
        np.array(durations, dtype=_I),
        tuple(np.array(a, dtype=_I) for a in spans),
        window,
        None if hung is None else np.array(hung, dtype=_I),
    )


def test_window_idle_compute_and_communication():
    # ops: compute [1000, 1100), blocking collective [1200, 1500), async collective op [1500, 1510) in flight
    # [1500, 2500), compute [1600, 1700), async [2000, 3000) overlapping the first one, compute [3000, 3050).
    f = _facts(
        [False, True, True, False, True, False],
        [1000, 1200, 1500, 1600, 2000, 3000],
        [100, 300, 10, 100, 5, 50],
        spans=([2, 4], [1500, 2000], [2500, 3000]),
        window=(400, 4000),
    )
    # window 4000 - 400; idle 1000 - 400 before, 4000 - 3050 after; compute 100 + 100 + 50;
    # communication [1200, 1500) + [1500, 2500) u [2000, 3000) = 300 + 1500.
    assert f == {
        "window_ns": 3600,
        "idle_before_ns": 600,
        "idle_after_ns": 950,
        "compute_ns": 250,
        "comm_ns": 1800,
    }


def test_unions_touching_nested_and_empty_intervals():
    # [0, 10) [10, 20) touch -> 20; [5, 6) inside -> 0; [30, 30) empty -> 0; [25, 40) -> 15.
    f = _facts([True] * 5, [0, 10, 5, 30, 25], [10, 10, 1, 0, 15])
    assert f["comm_ns"] == 35
    # No recorded window: first op start to last op end, no idle.
    assert (f["window_ns"], f["idle_before_ns"], f["idle_after_ns"]) == (40, 0, 0)


def test_a_hung_collective_counts_until_the_window_end():
    # compute [100, 200); a collective issued at 300 never completed; the window ended at 10_000.
    f = _facts([False, True], [100, 300], [100, 5], window=(0, 10_000), hung=[300])
    assert (f["comm_ns"], f["window_ns"], f["idle_after_ns"]) == (10_000 - 300, 10_000, 10_000 - 305)
    # Only the end recorded (a post-mortem of an old shard): the window starts at the first op, 100.
    f = _facts([False, True], [100, 300], [100, 5], window=(None, 10_000), hung=[300])
    assert (f["comm_ns"], f["window_ns"], f["idle_before_ns"]) == (10_000 - 300, 10_000 - 100, 0)


def test_a_window_without_ops_is_all_idle():
    assert _facts([], [], [], window=(5, 105)) == {
        "window_ns": 100,
        "idle_before_ns": 100,
        "idle_after_ns": 0,
        "compute_ns": 0,
        "comm_ns": 0,
    }


def test_the_straggler_is_the_rank_waited_for_longest_lowest_on_ties():
    rows = [
        {"rank": 0, "caused_wait_ns": 5},
        {"rank": 2, "caused_wait_ns": 9},
        {"rank": 1, "caused_wait_ns": 9},
    ]
    assert straggler(rows) == (1, 9)
    assert straggler([{"rank": 0, "caused_wait_ns": 0}]) is None
    assert straggler([]) is None


@pytest.mark.parametrize(
    "func, n, factor",
    [("all_reduce", 4, 1.5), ("all_gather", 4, 0.75), ("reduce_scatter", 2, 0.5), ("broadcast", 8, 1.0)],
)
def test_busbw_is_size_over_time_times_the_nccl_tests_factor(func, n, factor):
    # 4000 bytes in 2 us: 2 GB/s algbw
    assert bus_bandwidth(func, n, 4000, 2000) == pytest.approx(2e9 * factor)
    assert bus_bandwidth(func, n, 4000, 0) == 0.0


def test_the_lightning_straggler_is_the_merge_rule_on_gathered_arrivals():
    from tl_dist.integrations._step_metrics import MAX_ARRIVALS, rank_arrivals, step_straggler
    from tl_dist.telemetry import StepTelemetry

    def row(arrivals):
        t = StepTelemetry(*([None] * 20), arrivals=arrivals)
        return rank_arrivals(t, {"host": "h", "boot_id": "b"})  # one host and boot: one clock

    world = (0, 1)
    # all_reduce seq 1: rank 0 arrives at 100, rank 1 at 400 (both done at 500): rank 0 waits 300 for rank 1.
    # seq 2: rank 1 at 600, rank 0 at 650: rank 1 waits 50 for rank 0. Straggler: rank 1, 300 ns.
    rows = [
        row(((world, 1, 100, 500, ""), (world, 2, 650, 700, ""))),
        row(((world, 1, 400, 500, ""), (world, 2, 600, 700, ""))),
    ]
    assert len(rows[0]) == 2 + 5 * MAX_ARRIVALS
    assert step_straggler(0, rows) == (1, 300)
    # Nobody waited (simultaneous arrivals), or nothing joined (one rank only): no straggler.
    assert step_straggler(0, [row(((world, 1, 100, 500, ""),)), row(((world, 1, 100, 500, ""),))]) is None
    assert step_straggler(0, [row(((world, 1, 100, 500, ""),))]) is None
    # Pipeline stages: rank 1 posted its receive at 200, rank 0 sent at 700: rank 1 waited 500 for rank 0,
    # as the merge counts it. A receive posted after its send waited for nobody.
    pair = (0, 1)
    late_send = [row(((pair, 1, 700, 710, "send"),)), row(((pair, 1, 200, 720, "recv"),))]
    assert step_straggler(0, late_send) == (0, 500)
    late_recv = [row(((pair, 1, 100, 110, "send"),)), row(((pair, 1, 600, 610, "recv"),))]
    assert step_straggler(0, late_recv) is None


def test_a_real_window_sleeping_before_its_first_op():
    import time

    import torch

    import tl_dist as tl
    from tl_dist.step_facts import window_facts
    from tl_dist.telemetry import summarize
    from tl_dist.views.summary import format_ns

    model, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    model(x)  # the first dispatch-mode use is slow: warm up outside the window
    with tl.capture() as cap:
        time.sleep(0.02)  # the data loader
        model(x)
    meta, cols = cap.trace.metadata, cap.trace.columns
    f = window_facts(cap.trace)
    assert f["window_ns"] == meta["window_end_ns"] - meta["window_start_ns"]
    assert f["idle_before_ns"] == min(cols["start_ns"]) - meta["window_start_ns"] >= 20_000_000
    t = summarize(cap.trace)
    assert (t.wall_ns, t.idle_before_ns, t.idle_after_ns) == (
        f["window_ns"],
        f["idle_before_ns"],
        f["idle_after_ns"],
    )
    assert f"window {format_ns(f['window_ns'])} (enter -> leave): idle {format_ns(f['idle_before_ns'])}" in (
        cap.trace.summary()
    )


def _blocking_wait(rank, world_size, out_dir):
    import time

    import torch
    import torch.distributed as dist

    import tl_dist as tl
    from tl_dist.step_facts import window_facts

    tl.arm(out_dir / "run")
    x = torch.ones(4)
    dist.all_reduce(x)  # warm the connection up outside the window
    with tl.capture(step=0) as cap:
        if rank == 1:
            time.sleep(0.3)  # rank 0 waits for it inside a blocking all_reduce
        dist.all_reduce(x)  # blocking: the op enqueues, dist.all_reduce then waits in Python
    tl.disarm()
    t = cap.trace
    row = t.collective_table
    return {
        "comm_ns": window_facts(t)["comm_ns"],
        "op_ns": t[row["op"][0]].duration_ns,
        "issue_to_complete": row["complete_ns"][0] - row["issue_ns"][0],
    }


@pytest.mark.slow
def test_a_blocking_collectives_wait_after_its_op_is_communication(tmp_path):
    from dist_helpers import run_ranks

    import tl_dist as tl

    waiting, late = run_ranks(_blocking_wait, world_size=2, tmp_path=tmp_path)
    # Rank 0 was inside dist.all_reduce for the 0.3 s rank 1 slept, though its op returned at once.
    assert waiting["op_ns"] < 0.1e9 and waiting["issue_to_complete"] > 0.25e9
    assert waiting["comm_ns"] >= waiting["issue_to_complete"]
    assert late["comm_ns"] < 0.1e9
    # The merge (shards read back) says the same.
    tb = tl.merge_ranks(tmp_path / "run").time_breakdown().set_index("rank")
    assert tb.loc[0, "comm_ns"] == waiting["comm_ns"] and tb.loc[1, "comm_ns"] == late["comm_ns"]


def test_the_nonfinite_origin_is_the_lowest_rank_where_it_arose():
    from tl_dist.step_facts import nonfinite_origin

    assert nonfinite_origin({0: "collective", 3: "compute", 2: "collective", 5: "compute"}) == 3
    assert nonfinite_origin({4: "collective", 1: "collective"}) == 1  # all received: the lowest
    assert nonfinite_origin({}) is None


def _late_send(rank, world_size, out_dir):
    import time

    import torch
    import torch.distributed as dist

    import tl_dist as tl
    from tl_dist.integrations._step_metrics import rank_arrivals
    from tl_dist.telemetry import summarize

    tl.arm(out_dir / "run")
    x = torch.ones(4)
    rows = []
    for step, late in ((0, 0), (1, 1)):  # step 0: the sender is late; step 1: the receiver
        dist.barrier()
        with tl.capture(step=step) as cap:
            if rank == late:
                time.sleep(0.2)
            if rank == 0:
                dist.isend(x, dst=1).wait()  # buffered: a send waits for no receiver
            else:
                dist.recv(x, src=0)
        rows.append(rank_arrivals(summarize(cap.trace), cap.trace.metadata))
    tl.disarm()
    return {"rows": rows}


@pytest.mark.slow
def test_a_late_pipeline_send_is_the_same_straggler_for_the_merge_and_lightning(tmp_path):
    from dist_helpers import run_ranks

    import tl_dist as tl
    from tl_dist.integrations._step_metrics import step_straggler

    ranks = run_ranks(_late_send, world_size=2, tmp_path=tmp_path)
    frame = tl.merge_ranks(tmp_path / "run").stragglers()
    merged = [straggler(frame[frame.step == s].to_dict("records")) for s in (0, 1)]
    assert merged[0] is not None and merged[0][0] == 0 and merged[0][1] > 0.15e9  # the receiver waited ~0.2 s
    assert merged[1] is None  # the late receiver kept nobody waiting
    # The Lightning path, on the gathered rows: the same
    assert [step_straggler(s, [r["rows"][s] for r in ranks]) for s in (0, 1)] == merged
