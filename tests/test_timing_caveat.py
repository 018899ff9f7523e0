"""``trace.summary()`` says when its CPU timings may be inflated: ``OMP_WAIT_POLICY`` not ``PASSIVE`` and more
torch threads than cores (OpenMP threads spin while waiting), as recorded at capture time."""

import os

import pytest
import torch

import tl_dist as tl

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@pytest.fixture
def threads():
    """Set torch's intra-op threads for one test, restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _header(monkeypatch, tmp_path=None):
    torch.manual_seed(0)
    trace = tl.trace(torch.nn.Linear(3, 2), torch.randn(4, 3))
    lines = trace.summary().splitlines()
    if tmp_path is not None:  # a loaded shard says the same: the setting is the capture's, not the reader's
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        assert tl.load(trace.save(tmp_path / "t.h5")).summary().splitlines()[:2] == lines[:2]
    return lines


@pytest.mark.parametrize("policy", [None, "active"])
def test_header_warns_when_threads_spin_on_too_few_cores(monkeypatch, threads, tmp_path, policy):
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    threads(CORES + 2)
    lines = _header(monkeypatch, tmp_path)
    assert lines[0].startswith("tl_dist trace: 2 ops, 1 module calls, ")
    setting = "is unset" if policy is None else "is active"
    assert lines[1] == (
        f"NB: timings may be inflated: OMP_WAIT_POLICY {setting} (not PASSIVE) with {CORES + 2} torch threads "
        f"on {CORES} cores; OpenMP threads spin while waiting and slow ops down on a busy machine: set "
        "OMP_WAIT_POLICY=PASSIVE before starting Python (make does), or fewer threads (torch.set_num_threads)"
    )


@pytest.mark.parametrize(("policy", "extra"), [("PASSIVE", 2), ("passive", 2), (None, 0), ("ACTIVE", 0)])
def test_header_is_quiet_when_passive_or_threads_fit_the_cores(monkeypatch, threads, policy, extra):
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    threads(CORES + extra)
    lines = _header(monkeypatch)
    assert not any(line.startswith("NB:") for line in lines)
    # the header, the window's step facts line, then the blank line before the module table
    assert lines[1].startswith("window ") and lines[2] == ""


def test_merged_summary_names_the_ranks_whose_timings_may_be_inflated(tmp_path):
    from merge_synth import coll, make_trace, write_run

    spinning = {"torch_threads": 8, "cpu_cores": 2, "omp_wait_policy": ""}
    quiet = {"torch_threads": 2, "cpu_cores": 2, "omp_wait_policy": ""}
    traces = [
        make_trace(r, [coll(source="train.py:10")], metadata=quiet if r == 0 else spinning) for r in (0, 1)
    ]
    write_run(tmp_path, traces)
    lines = tl.merge_ranks(tmp_path).summary().splitlines()
    assert lines[1] == (
        "rank(s) [1]: NB: timings may be inflated: OMP_WAIT_POLICY is unset (not PASSIVE) with 8 torch threads on "
        "2 cores; OpenMP threads spin while waiting and slow ops down on a busy machine: set "
        "OMP_WAIT_POLICY=PASSIVE before starting Python (make does), or fewer threads (torch.set_num_threads)"
    )
    assert sum("NB:" in line for line in lines) == 1
