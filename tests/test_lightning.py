"""TelemetryCallback with a real Trainer: ddp_spawn / ddp / ModelParallelStrategy (FSDP2) on 2 CPU processes
(gloo), and single-process fits for manual optimization, resume, non-finite values and post-mortems.

Expected telemetry is recomputed from the shards with ``tl.telemetry.summarize`` and the definitions written out
here (docs/lightning.md), never with the callback's own code.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pandas as pd
import pytest
import torch
from external import have
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning_models import (
    ADDRESSES,
    N_PARAMS,
    ManualRegressor,
    Regressor,
    TwoOptimizerRegressor,
    loader,
    params,
    trainer_kwargs,
)
from sink_helpers import StepSink
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

import tl_dist as tl
from tl_dist.arm import armed
from tl_dist.integrations.lightning import NonFiniteError, TelemetryCallback
from tl_dist.step_facts import straggler

HERE = Path(__file__).resolve().parent
PEAK = 1e12  # FLOP/s per device given to the callback, for tl/mfu
STATS = tl.CaptureOptions(stats=True)


def shard_steps(shard_dir: Path) -> dict[str, list[int]]:
    """{"rank00000": [0, 3, 6], ...} of the shards in a run folder."""
    out: dict[str, list[int]] = {}
    for p in sorted(shard_dir.glob("rank*/step*.h5")):
        out.setdefault(p.parent.name, []).append(int(p.stem[4:]))
    return out


def summaries(shard_dir: Path, step: int, world: int) -> list:
    return [
        tl.telemetry.summarize(tl.load(shard_dir / f"rank{r:05d}" / f"step{step:08d}.h5"), peak_flops=PEAK)
        for r in range(world)
    ]


def expected_metrics(ts: list, late: tuple[int, int] | None = None) -> dict[str, float]:
    """The step metrics of docs/lightning.md, written out from the per-rank summaries and the step's straggler
    (``late``: step_facts.straggler of the merged shards' stragglers)."""
    world = len(ts)
    flops = sum(t.total_flops for t in ts)
    fps = flops / (max(t.wall_ns for t in ts) / 1e9)
    m = {"tl/step_flops": flops, "tl/flops_per_sec": fps, "tl/mfu": fps / (world * PEAK)}
    for phase in ("forward", "backward", "optimizer"):
        m[f"tl/{phase}_ms"] = sum(t.op_ns[phase] for t in ts) / world / 1e6
    m["tl/comm_ms"] = sum(t.comm_ns for t in ts) / world / 1e6
    for r, t in enumerate(ts):
        m[f"tl/rank{r}/step_ms"] = t.wall_ns / 1e6
        m[f"tl/rank{r}/compute_ms"] = t.compute_ns / 1e6
        m[f"tl/rank{r}/comm_ms"] = t.comm_ns / 1e6
    m["tl/straggler_rank"] = late[0] if late is not None else -1
    m["tl/straggler_wait_ms"] = late[1] / 1e6 if late is not None else 0.0
    m["tl/nonfinite_ranks"] = 0
    shallow = [a for a in ADDRESSES if a.count(".") <= 1]  # depth <= 2
    mean_ms = {
        a: sum(row.duration_ns for t in ts for row in t.modules if row.module == a) / world / 1e6
        for a in shallow
    }
    for a in sorted((a for a in shallow if mean_ms[a] > 0), key=lambda a: -mean_ms[a])[:5]:
        m[f"tl/module/{a}/ms"] = mean_ms[a]
    for a in ADDRESSES:
        for of in ("out", "grad"):
            values = [row.norm for t in ts for row in t.norms if (row.module, row.of) == (a, of)]
            if values:
                m[f"tl/norm/{a}/{of}"] = max(values)
    return m


def logged_rows(metrics_csv: Path) -> dict[int, dict[str, float]]:
    """Per step, the tl/ metrics that row holds (empty cells dropped)."""
    frame = pd.read_csv(metrics_csv)
    rows: dict[int, dict[str, float]] = {}
    for _, row in frame.iterrows():
        values = {k: float(v) for k, v in row.items() if k.startswith("tl/") and not pd.isna(v)}
        rows.setdefault(int(row["step"]), {}).update(values)
    return rows


def module_calls(trace, address: str) -> list[tuple[int, int]]:
    """(first_op, end_op) of each call of the module at ``address``."""
    table = trace.module_table
    return [(f, e) for a, f, e in zip(table["address"], table["first_op"], table["end_op"]) if a == address]


def optimizer_updates(trace) -> list[int]:
    """Indices of the optimizer phase's compute ops (the SGD updates)."""
    cols = trace.columns
    return [i for i in range(len(trace)) if cols["phase"][i] == "optimizer" and cols["kind"][i] == "compute"]


# -- ddp_spawn, 2 ranks: one instrumented fit and one plain fit from the same seed ----------------------------
@pytest.fixture(scope="module")
def spawn_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("spawn")
    telemetry = TelemetryCallback(3, options=STATS, peak_flops=PEAK)
    runs = {"callback": telemetry}  # this (launching) process's callback; the fit ran in spawned copies
    for name, callbacks in (("traced", [telemetry]), ("plain", [])):
        torch.manual_seed(0)
        model = Regressor()
        trainer = pl.Trainer(
            **trainer_kwargs(
                str(root / name),
                devices=2,
                strategy="ddp_spawn",
                max_steps=7,
                callbacks=callbacks,
                logger=CSVLogger(str(root / name), name="run") if callbacks else False,
            )
        )
        trainer.fit(model, loader())
        runs[name] = params(model)
    torch.manual_seed(0)
    runs["init"] = params(Regressor())
    return root / "traced" / "run" / "version_0", runs


@pytest.mark.slow
@pytest.mark.needs("dot", optional=True)
def test_ddp_spawn_writes_shards_at_the_chosen_steps_and_merges(spawn_run):
    log_dir, runs = spawn_run
    shard_dir = log_dir / "tl_dist"
    # every_n_steps=3 over global steps 0..6, on both ranks alike
    assert shard_steps(shard_dir) == {"rank00000": [0, 3, 6], "rank00001": [0, 3, 6]}
    # The launching process's callback says so too (the workers handed their state back), once.
    telemetry = runs["callback"]
    assert (telemetry.shard_dir, telemetry.captured_steps) == (shard_dir, [0, 3, 6])
    assert not telemetry._handoff.exists()
    merged = tl.load_merged(shard_dir / "merged.h5")
    assert merged.steps == [0, 3, 6] and merged.ranks == [0, 1]
    assert merged.findings == []
    events = json.loads((shard_dir / "timeline.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert "cluster_s6r1_rank" in (shard_dir / "graph.dot").read_text()  # the last step, both ranks
    if have("dot"):  # laid out by a detached dot
        deadline = time.monotonic() + 120
        while not (shard_dir / "graph.svg").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (shard_dir / "graph.svg").read_text().lstrip().startswith("<?xml")
    end = logged_rows(log_dir / "metrics.csv")[7]
    assert end["tl/findings"] == 0
    caused = tl.merge_ranks(shard_dir).stragglers().groupby("rank")["caused_wait_ns"].sum()
    assert end["tl/top_straggler"] == caused.idxmax()


@pytest.mark.slow
def test_ddp_spawn_logs_what_the_shards_say(spawn_run):
    log_dir, _ = spawn_run
    rows = logged_rows(log_dir / "metrics.csv")
    strag = tl.merge_ranks(log_dir / "tl_dist").stragglers()
    for step in (0, 3, 6):
        late = straggler(strag[strag.step == step].to_dict("records"))
        want = expected_metrics(summaries(log_dir / "tl_dist", step, 2), late)
        got = rows[step]
        assert sorted(got) == sorted(want), step
        for name, value in want.items():
            assert got[name] == pytest.approx(value, rel=1e-12, abs=0), (step, name)
        # 5 of the 6 timed modules with ops at depth <= 2 (poison runs none); net.0.0 is deeper
        assert len([k for k in got if k.startswith("tl/module/")]) == 5
        assert "tl/module/net.0.0/ms" not in got and "tl/norm/net.0.0/out" in got


@pytest.mark.slow
def test_ddp_spawn_phases_under_automatic_optimization(spawn_run):
    log_dir, _ = spawn_run
    for r in (0, 1):
        trace = tl.load(log_dir / "tl_dist" / f"rank{r:05d}" / "step00000003.h5")
        cols = trace.columns
        by_func: dict[str, set[str]] = {}
        for func, phase in zip(cols["func"], cols["phase"]):
            by_func.setdefault(func, set()).add(phase)
        # training_step runs inside optimizer.step(closure), yet its ops are forward and backward
        assert by_func["addmm"] == {"forward"} and by_func["tanh"] == {"forward"}
        assert by_func["mm"] == {"backward"} and by_func["tanh_backward"] == {"backward"}
        assert by_func["all_reduce"] == {"backward"}  # DDP's gradient buckets
        updates = optimizer_updates(trace)
        assert [cols["func"][i] for i in updates] == ["add_"] * N_PARAMS  # SGD: one add_ per parameter
        assert all(not cols["module_stack"][i] for i in updates)
        assert min(updates) > max(i for i, f in enumerate(cols["func"]) if f == "all_reduce")


@pytest.mark.slow
def test_ddp_spawn_leaves_the_training_unchanged(spawn_run):
    _, runs = spawn_run
    assert runs["traced"].keys() == runs["plain"].keys() == runs["init"].keys()
    for name, value in runs["traced"].items():
        assert torch.equal(value, runs["plain"][name]), name
        assert not torch.equal(value, runs["init"][name]), name  # rank 0's trained weights came back


# -- strategies that re-execute sys.argv: a standalone script in a subprocess ---------------------------------
def run_job(tmp_path: Path, *args: str) -> Path:
    out = tmp_path / "job"
    proc = subprocess.run(
        [sys.executable, str(HERE / "lightning_job.py"), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert json.loads((out / "result.json").read_text()) == {
        "params_equal": True,
        "trained": True,
        "world_size": 2,
    }
    return out / "tl"


@pytest.mark.slow
def test_ddp_script_with_gradient_accumulation(tmp_path):
    shard_dir = run_job(
        tmp_path, "--strategy", "ddp", "--accumulate", "2", "--max-steps", "3", "--every", "2"
    )
    assert shard_steps(shard_dir) == {"rank00000": [0, 2], "rank00001": [0, 2]}
    assert tl.load_merged(shard_dir / "merged.h5").findings == []
    for r in (0, 1):
        trace = tl.load(shard_dir / f"rank{r:05d}" / "step00000002.h5")
        cols = trace.columns
        # One window holds both micro-batches: two calls of the LightningModule (DDP calls it)
        (_, first_end), (second_start, second_end) = module_calls(trace, "")
        reduces = [i for i, f in enumerate(cols["func"]) if f == "all_reduce"]
        # DDP's bucket all-reduces run only in the second micro-batch's backward (the first runs under no_sync)
        assert reduces and min(reduces) > second_end
        assert cols["phase"][reduces[0]] == "backward"
        # one optimizer step: one add_ per parameter, after the second micro-batch's all-reduces
        updates = optimizer_updates(trace)
        assert len(updates) == N_PARAMS and min(updates) > max(reduces)
        assert updates == list(range(updates[0], updates[0] + N_PARAMS))


@pytest.mark.slow
def test_fsdp2_model_parallel_strategy(tmp_path):
    # Lightning's FSDPStrategy refuses accelerator="cpu"; ModelParallelStrategy (FSDP2) runs on CPU/gloo.
    shard_dir = run_job(tmp_path, "--strategy", "fsdp2", "--max-steps", "3", "--every", "2")
    assert shard_steps(shard_dir) == {"rank00000": [0, 2], "rank00001": [0, 2]}
    merged = tl.load_merged(shard_dir / "merged.h5")
    assert merged.findings == []
    for r in (0, 1):
        trace = tl.load(shard_dir / f"rank{r:05d}" / "step00000002.h5")
        kinds = {(c.func, trace[c.op].phase) for c in trace.collectives}
        # parameters all-gathered for the forward, gradients reduce-scattered in the backward
        assert ("all_gather", "forward") in kinds and ("reduce_scatter", "backward") in kinds
        assert len(optimizer_updates(trace)) == N_PARAMS
        assert {a for a in trace.module_table["address"]} >= {"net", "net.0", "net.0.0", "net.4"}


# -- non-finite values across ranks -----------------------------------------------------------------------------
@pytest.mark.slow
def test_nan_on_one_rank_stops_every_rank_at_that_step(tmp_path, capfd):
    torch.manual_seed(0)
    model = Regressor(nan_at=(2, 1))  # rank 1's poison takes the log of negative inputs at global step 2
    cb = TelemetryCallback(1, out_dir=tmp_path / "tl", options=STATS, on_nonfinite="stop")
    trainer = pl.Trainer(
        **trainer_kwargs(str(tmp_path), devices=2, strategy="ddp_spawn", max_steps=6, callbacks=[cb])
    )
    trainer.fit(model, loader())
    # Both ranks stopped after step 2 (a rank going on alone would hang).
    assert shard_steps(tmp_path / "tl") == {"rank00000": [0, 1, 2], "rank00001": [0, 1, 2]}
    err = capfd.readouterr().err
    # Rank 0's gradients hold NaN too (DDP's all-reduce brought rank 1's), but the NaN arose on rank 1.
    assert (
        "non-finite value at step 2 on rank(s) [0, 1]; first on rank 1: op log_1 (log) in module 'poison'"
        in err
    )


# -- single process ------------------------------------------------------------------------------------------
def fit(tmp_path: Path, model, callbacks, ckpt_path=None, **kwargs) -> pl.Trainer:
    trainer = pl.Trainer(**trainer_kwargs(str(tmp_path), devices=1, callbacks=callbacks, **kwargs))
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return trainer


def test_manual_optimization_one_window_per_optimizer_step(tmp_path):
    fit(tmp_path, ManualRegressor(), [TelemetryCallback(1, out_dir=tmp_path / "tl")], max_steps=3)
    # global_step counts optimizer steps: 3 steps of 2 batches each, every one captured
    assert shard_steps(tmp_path / "tl") == {"rank00000": [0, 1, 2]}
    for step in (0, 1, 2):
        trace = tl.load(tmp_path / "tl" / "rank00000" / f"step{step:08d}.h5")
        (_, first_end), (second_start, _) = module_calls(trace, "net")
        cols = trace.columns
        backward = [i for i, p in enumerate(cols["phase"]) if p == "backward"]
        # manual_backward of each batch is backward, between the two forwards and after the second
        assert any(first_end <= i < second_start for i in backward) and max(backward) > second_start
        updates = optimizer_updates(trace)
        assert len(updates) == N_PARAMS and min(updates) > max(backward)


def test_two_optimizer_steps_per_batch_capture_the_batches_holding_a_multiple(tmp_path):
    cb = TelemetryCallback(3, out_dir=tmp_path / "tl")
    fit(tmp_path, TwoOptimizerRegressor(), [cb], max_steps=10)
    # Batches start at global steps 0, 2, 4, 6, 8 and each runs two optimizer steps: the multiples of 3 (0, 3,
    # 6, 9) run in the batches starting at 0, 2, 6 and 8 (windows are named by their first step).
    assert cb.captured_steps == [0, 2, 6, 8]
    assert shard_steps(tmp_path / "tl") == {"rank00000": [0, 2, 6, 8]}
    trace = tl.load(tmp_path / "tl" / "rank00000" / "step00000002.h5")
    assert len(optimizer_updates(trace)) == N_PARAMS  # both optimizers' updates: steps 2 and 3


def test_resume_continues_in_the_run_folder_without_overwriting(tmp_path):
    ckpts = tmp_path / "ckpt"
    first = TelemetryCallback(2)
    every3 = ModelCheckpoint(dirpath=ckpts, every_n_train_steps=3, save_top_k=-1)
    fit(
        tmp_path,
        Regressor(),
        [first, every3],
        max_steps=6,
        enable_checkpointing=True,
        logger=CSVLogger(str(tmp_path), name="run"),
    )
    shard_dir = tmp_path / "run" / "version_0" / "tl_dist"
    assert shard_steps(shard_dir) == {"rank00000": [0, 2, 4]}
    before = {p.name: p.read_bytes() for p in (shard_dir / "rank00000").glob("*.h5")}

    # Resume from global step 3: steps 4 and 6 are captured again; the first run's step 4 is set aside.
    second = TelemetryCallback(2)
    trainer = fit(
        tmp_path,
        Regressor(),
        [second],
        ckpt_path=str(ckpts / "epoch=0-step=3.ckpt"),
        max_steps=8,
        logger=CSVLogger(str(tmp_path), name="run"),
    )
    assert trainer.log_dir.endswith("version_1") and not (Path(trainer.log_dir) / "tl_dist").exists()
    assert second.shard_dir == shard_dir and second.captured_steps == [0, 2, 4, 6]
    assert shard_steps(shard_dir) == {"rank00000": [0, 2, 4, 6]}
    for name in ("step00000000.h5", "step00000002.h5"):
        assert (shard_dir / "rank00000" / name).read_bytes() == before[name]
    (aside,) = (shard_dir / "superseded").glob("*/rank00000/step00000004.h5")
    assert aside.read_bytes() == before["step00000004.h5"]
    assert tl.load_merged(shard_dir / "merged.h5").steps == [0, 2, 4, 6]


def test_nonfinite_raise_names_op_module_and_source(tmp_path):
    cb = TelemetryCallback(1, out_dir=tmp_path / "tl", options=STATS, on_nonfinite="raise")
    with pytest.raises(NonFiniteError) as info:
        fit(tmp_path, Regressor(nan_at=(1, 0)), [cb], max_steps=10)
    line = next(
        n
        for n, text in enumerate((HERE / "lightning_models.py").read_text().splitlines(), 1)
        if "torch.log" in text
    )
    assert str(info.value) == (
        "tl_dist: non-finite value at step 1 on rank(s) [0]; first on rank 0: op log_1 (log) in module 'poison' "
        f"at {HERE / 'lightning_models.py'}:{line}, forward phase"
    )
    assert shard_steps(tmp_path / "tl") == {"rank00000": [0, 1]}  # step 1's shard is written, then the error


class Exploding(Regressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == 1:
            raise RuntimeError("boom in training_step")
        return loss


def test_exception_in_the_step_leaves_a_post_mortem_and_nothing_behind(tmp_path):
    with pytest.raises(RuntimeError, match="boom in training_step") as info:
        fit(tmp_path, Exploding(), [TelemetryCallback(1, out_dir=tmp_path / "tl")], max_steps=4)
    assert len(info.value.tl_trace) > 0  # the partial trace travels with the error
    shard = tl.load(tmp_path / "tl" / "rank00000" / "step00000001.h5")
    assert not shard.metadata["complete"]
    assert "boom in training_step" in shard.metadata["error"]
    assert "mse_loss" in shard.columns["func"]
    assert armed() is None
    assert not nn_module._global_forward_hooks and not nn_module._global_forward_pre_hooks
    assert not optim_module._global_optimizer_pre_hooks and not optim_module._global_optimizer_post_hooks


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, "every_n_steps must be a positive int"),
        ({"every_n_steps": True}, "every_n_steps must be a positive int"),
        ({"out_dir": 3}, "out_dir must be a str or os.PathLike"),
        ({"options": {"stats": True}}, "options must be a tl.CaptureOptions"),
        ({"sinks": [object()]}, r"sinks\[0\] \(object\) is not a sink"),
        ({"log": 1}, "log must be a bool"),
        ({"merge_on_end": "yes"}, "merge_on_end must be a bool"),
        ({"on_nonfinite": "ignore"}, "on_nonfinite must be one of"),
        ({"peak_flops": -1.0}, "peak_flops must be a positive number"),
        ({"peak_flops": math.nan}, "peak_flops must be a positive number"),
        ({"peak_flops": math.inf}, "peak_flops must be a positive number"),
    ],
)
def test_bad_arguments_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TelemetryCallback(**kwargs)


def test_capture_root_names_modules_inside_a_wrapper():
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    inner = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    with tl.capture(root=inner) as cap:
        Wrapper(inner)(torch.randn(2, 3))
    assert [op.module for op in cap.trace if op.func == "addmm"] == ["0"]
    with tl.capture() as cap:
        Wrapper(inner)(torch.randn(2, 3))
    assert [op.module for op in cap.trace if op.func == "addmm"] == ["inner.0"]
    with pytest.raises(ValueError, match="root must be a torch.nn.Module"):
        tl.capture(root="inner")


def test_a_users_arm_survives_a_fit_with_the_callback(tmp_path):
    user_sink = StepSink()
    tl.arm(tmp_path / "user", sinks=[user_sink])
    try:
        state = armed()
        before = signal.getsignal(signal.SIGTERM)
        cb = TelemetryCallback(1, out_dir=tmp_path / "tl")
        fit(tmp_path, Regressor(), [cb], max_steps=2)
        assert armed() is state and signal.getsignal(signal.SIGTERM) is before
        with tl.capture(step=7):  # the user's own window still goes to the user's folder and sink
            torch.ones(2).add(1)
        assert tl.flush()
        assert shard_steps(tmp_path / "user") == {"rank00000": [7]}
        assert shard_steps(tmp_path / "tl") == {"rank00000": [0, 1]}
        assert [s for s, _ in user_sink.windows] == [7] and tl.sink_stats().delivered == 1
    finally:
        tl.disarm()


def test_a_windows_summary_is_computed_once_for_the_logs_and_the_sinks(tmp_path, summarize_calls):
    sink = StepSink()
    cb = TelemetryCallback(1, out_dir=tmp_path / "tl", sinks=[sink], peak_flops=1e12, merge_on_end=False)
    fit(tmp_path, Regressor(), [cb], max_steps=3, logger=CSVLogger(str(tmp_path), name="run"))
    assert len(summarize_calls) == 3  # one per window: the callback's logs and the sinks share it
    assert [s for s, _ in sink.windows] == [0, 1, 2]
    logged = pd.read_csv(tmp_path / "run" / "version_0" / "metrics.csv").set_index("step")
    for step, telemetry in sink.windows:
        assert telemetry.peak_flops == 1e12  # the callback's summary (the worker's own has no peak)
        assert logged.loc[step, "tl/mfu"] == pytest.approx(telemetry.mfu)


def test_the_end_of_fit_merge_logs_its_findings_line_through_logging(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.callbacks.tl_dist"):
        fit(tmp_path, Regressor(), [TelemetryCallback(1, out_dir=tmp_path / "tl")], max_steps=2)
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning.pytorch.callbacks.tl_dist"]
    assert lines[0] == "tl_dist: merged steps [0, 1] of 1 rank(s): 0 finding(s)"
    assert lines[-1].startswith(
        f"tl_dist: wrote {tmp_path / 'tl' / 'merged.h5'}, {tmp_path / 'tl' / 'timeline.json'}"
    )
    assert tl.load_merged(tmp_path / "tl" / "merged.h5").steps == [0, 1]
