"""A 2-rank gloo DDP job exporting over real OTLP/HTTP to a receiver in the test process: per-rank resources,
one trace per step shared by both ranks, collectives matched by seq."""

import collections
import os

import pytest
import torch
from dist_helpers import run_ranks
from otlp_receiver import OtlpReceiver, attributes
from torch import nn

STEPS = 2


def _rank_body(rank, world_size, out_dir, endpoint):
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    os.environ["OTEL_METRIC_EXPORT_INTERVAL"] = "600000"  # one metrics export: the final one, at disarm

    import tl_dist as tl
    from tl_dist.exporters.otel import OtelSink

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tl.arm(out_dir / "job7", sinks=[OtelSink()])
    for step in range(STEPS):
        with tl.capture(step=step):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    assert tl.disarm()
    return {"stats": tl.sink_stats().errors}


@pytest.mark.slow
def test_two_ranks_over_otlp_http(tmp_path):
    with OtlpReceiver() as rx:
        results = run_ranks(_rank_body, world_size=2, tmp_path=tmp_path, args=(rx.endpoint,))
        spans, metrics = rx.spans(), rx.metrics()
    assert [r["stats"] for r in results] == [{}, {}]

    # Resources: one identity per rank, chosen without talking to the other rank (the shard folder's name).
    by_instance = collections.defaultdict(list)
    for resource, span in spans:
        by_instance[resource["service.instance.id"]].append((resource, span))
    assert set(by_instance) == {"job7/rank0", "job7/rank1"}
    for rank in (0, 1):
        resource = by_instance[f"job7/rank{rank}"][0][0]
        assert resource["tl.rank"] == rank and resource["tl.local_rank"] == rank
        assert (resource["tl.world_size"], resource["tl.run_id"], resource["service.name"]) == (
            2,
            "job7",
            "tl_dist",
        )
        assert resource["host.name"]
    assert {r["service.instance.id"] for r, _ in metrics} == {"job7/rank0", "job7/rank1"}

    # Step spans: both ranks' step k share one trace id; different steps differ.
    steps = collections.defaultdict(dict)
    for resource, span in spans:
        if span.name == "tl.step":
            steps[attributes(span.attributes)["tl.step"]][resource["tl.rank"]] = span.trace_id
    assert sorted(steps) == list(range(STEPS))
    assert all(len(set(ranks.values())) == 1 and set(ranks) == {0, 1} for ranks in steps.values())
    assert len({next(iter(r.values())) for r in steps.values()}) == STEPS

    # DDP's bucket all-reduce: one per step and rank, in that step's trace, with the same seq on both ranks.
    reduces = collections.defaultdict(dict)
    for resource, span in spans:
        if span.name == "all_reduce":
            a = attributes(span.attributes)
            reduces[span.trace_id][resource["tl.rank"]] = (a["tl.collective.seq"], a["tl.collective.bytes"])
            assert a["tl.collective.state"] == "completed" and a["tl.collective.group_ranks"] == [0, 1]
    assert set(reduces) == {next(iter(r.values())) for r in steps.values()}
    # 8*8 + 8 + 8*2 + 2 = 90 float32 parameters in one bucket: 360 bytes
    assert all(r[0] == r[1] and r[0][1] == 360 for r in reduces.values()), reduces

    # Metrics per rank: two steps recorded, 720 bytes all-reduced.
    for rank in (0, 1):
        mine = {m.name: m for r, m in metrics if r["tl.rank"] == rank}
        (step_point,) = mine["tl.step.duration"].histogram.data_points
        assert step_point.count == STEPS
        assert attributes(step_point.attributes) == {"tl.rank": rank}
        moved = {
            attributes(p.attributes)["tl.collective.kind"]: p.as_int
            for p in mine["tl.collective.bytes"].sum.data_points
        }
        # (DDP's second forward also broadcasts its rebuilt bucket layout from rank 0: a few bytes.)
        assert moved["all_reduce"] == 2 * 360
