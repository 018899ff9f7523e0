"""``OtelSink(stragglers=True)``: the straggler gauges of a plain torchrun-style job (no Lightning callback).

A real 2-rank gloo DDP job, rank 1 sleeping 100 ms inside each window before its forward (the data-loader
straggler). Rank 0's sink merges each captured step once both shards are in the run folder and sets
``tl.step.straggler_rank`` / ``tl.step.straggler_wait`` on a real Prometheus endpoint; they must say exactly what
``tl.merge_ranks`` of the same shards says (``g.stragglers()`` through ``step_facts.straggler``). A last step
that rank 1 does not capture is reported as unknown, not guessed.
"""

import time
import urllib.request

import pytest
import torch
from dist_helpers import run_ranks
from otel_helpers import prometheus_samples as _samples

import tl_dist as tl
from tl_dist.step_facts import straggler

pytest.importorskip("opentelemetry.sdk")

SLEEP_S = 0.1  # well above the scheduling noise of ranks sharing 2 busy cores (30 ms flipped now and then)
STEPS = 3  # captured by both ranks; step STEPS by rank 0 only


def _job(rank, world_size, out, root, rank1_skips_last=True):
    import torch.distributed as dist
    from torch import nn

    from tl_dist.exporters.otel import OtelSink, start_prometheus

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Not armed yet: the first dispatch-mode use is slow (on one rank more); DDP rebuilds its buckets at step 2.
    for _ in range(2):
        with tl.capture():
            model(torch.randn(4, 8)).sum().backward()
    prom = start_prometheus(port=0)
    sink = OtelSink(meter_provider=prom, spans=None, stragglers=True, merge_wait_s=5.0)
    tl.arm(root or out / "run", sinks=[sink])
    for step in range(STEPS + 1):
        opt.zero_grad()
        dist.barrier()
        if step == STEPS and rank == 1 and rank1_skips_last:  # its shard of this step never comes
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            continue
        with tl.capture(step=step):
            if rank == 1:
                time.sleep(SLEEP_S)
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    assert tl.flush()
    started = time.monotonic()
    assert sink.wait_stragglers(timeout=60)
    waited = time.monotonic() - started
    scrape = urllib.request.urlopen(prom.url, timeout=10).read().decode()
    found = {
        s: (list(r.late) if r.late else None, list(r.missing), r.error)
        for s, r in sink.step_stragglers.items()
    }
    assert tl.disarm()
    prom.shutdown()
    return {"found": found, "scrape": scrape, "waited": waited, "errors": tl.sink_stats().errors}


@pytest.fixture(params=["folder", "s3"])
def run_root(request, tmp_path, monkeypatch):
    """Where the ranks write their shards: a local folder, or an S3 bucket (moto's server on 127.0.0.1)."""
    if request.param == "folder":
        yield None, tmp_path / "run"
        return
    from s3_helpers import s3_store

    monkeypatch.setenv("TL_DIST_SPOOL", str(tmp_path / "spool"))
    with s3_store("bkt"):
        yield "s3://bkt/run", "s3://bkt/run"


@pytest.mark.slow
def test_rank_zero_sets_the_straggler_gauges_from_the_merge(tmp_path, run_root):
    root, where = run_root
    results = run_ranks(_job, world_size=2, tmp_path=tmp_path, timeout=120, args=(root,))
    assert [r["errors"] for r in results] == [{}, {}]
    g = tl.merge_ranks(where, steps=range(STEPS))  # step STEPS has rank 0's shard only
    strag = g.stragglers()
    ref = {s: straggler(strag[strag.step == s].to_dict("records")) for s in range(STEPS)}
    for s in range(STEPS):  # the planted straggler, as the merge sees it
        assert ref[s][0] == 1 and ref[s][1] > 0.5 * SLEEP_S * 1e9, ref

    # Rank 0 merged every step: exactly what the whole run's merge says; the last one rank 1 never wrote.
    found = results[0]["found"]
    assert {s: found[s] for s in range(STEPS)} == {s: (list(ref[s]), [], "") for s in range(STEPS)}
    assert found[STEPS] == (None, [1], "")
    assert results[1]["found"] == {}  # the other rank merges nothing

    # The gauges on rank 0's Prometheus endpoint: the last step merged (rank 1 and its wait, to the ns the
    # SDK keeps); the step without rank 1's shard counted as unknown, the gauges left as they were.
    text = results[0]["scrape"]
    ((labels, rank),) = _samples(text, "tl_step_straggler_rank")
    ((_, wait),) = _samples(text, "tl_step_straggler_wait_seconds")
    assert labels["tl_rank"] == "0"
    assert (rank, wait) == (ref[STEPS - 1][0], ref[STEPS - 1][1] * 1e-9)
    assert [v for _, v in _samples(text, "tl_step_straggler_unknown_total")] == [1.0]
    # Rank 1 sets no gauge (it cannot know whom rank 0 waited for).
    assert _samples(results[1]["scrape"], "tl_step_straggler_rank") == []


@pytest.mark.slow
def test_a_shard_another_job_left_in_the_run_folder_is_not_merged(tmp_path):
    """A run folder reused by a second job still holds the first job's shards. Rank 0 waits for this job's
    shard of each step (the first job's has another job_nonce) and merges that one; the step this job's rank 1
    never writes is unknown, although the first job's shard of it is there."""
    root = str(tmp_path / "run")
    first = run_ranks(_job, world_size=2, tmp_path=tmp_path / "first", timeout=120, args=(root, False))
    assert first[0]["found"][STEPS][1:] == ([], "")  # the first job: both ranks wrote step STEPS
    second = run_ranks(_job, world_size=2, tmp_path=tmp_path / "second", timeout=120, args=(root, True))
    assert [r["errors"] for r in second] == [{}, {}]
    found = second[0]["found"]
    assert found[STEPS] == (None, [1], "")
    g = tl.merge_ranks(
        root, steps=range(STEPS)
    )  # the folder now holds the second job's shards of these steps
    strag = g.stragglers()
    assert {s: found[s] for s in range(STEPS)} == {
        s: (list(straggler(strag[strag.step == s].to_dict("records"))), [], "") for s in range(STEPS)
    }
    # The merge of the whole folder says which shard is the first job's: rank 1's of step STEPS, no other.
    foreign = [f for f in tl.merge_ranks(root).findings if f.kind == "foreign_shard"]
    assert [(f.step, f.ranks) for f in foreign] == [(STEPS, (1,))]
    nonces = {r: tl.load(f"{root}/rank{r:05d}/step{STEPS:08d}.h5").metadata["job_nonce"] for r in (0, 1)}
    assert nonces[0] != nonces[1] and foreign[0].where == {
        1: {"job_nonce": nonces[1], "start_time_ns": foreign[0].where[1]["start_time_ns"]}
    }
