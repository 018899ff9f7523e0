"""Lightning fit with ``TelemetryCallback`` against the same fit without it: 2 processes (``ddp_spawn``, gloo),
a small transformer classifier, 200 optimizer steps.

Modes: ``plain`` (no callback) and ``every50`` (``TelemetryCallback(every_n_steps=50)``, defaults: metrics
logged, merge at the end), alternating which goes first, for ``--rounds`` rounds; then ``every1`` (every step
captured; reported, no target) against one more ``plain`` fit. Printed as ratios to ``plain`` of the same round
(median over rounds, and the min):

- ``fit``: wall time of ``trainer.fit`` in the launching process (process start-up, training, the callback's
  merge at the end).
- ``fit_no_merge``: ``fit`` less rank 0's end-of-fit merge (the callback's ``on_fit_end``, bracketed by two
  marks; its seconds are printed per round as ``merge``). Target for ``every50`` (issue 23): <= 1.03x.
- ``fit_cpu``: CPU seconds of the launching process and the rank processes over the fit (on a shared machine
  less disturbed by other load than wall time).
- ``loop``, ``loop_cpu``: rank 0's wall and CPU time from ``on_train_start`` to ``on_train_end`` (the training
  loop alone; CPU of all its threads, the shard writer's included).

The callback's ``graph.svg`` is laid out by a detached ``dot`` after the fit; the benchmark waits for it
before the next fit and prints how long it took (not counted in ``fit``).

Run: ``OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_lightning.py [--rounds 3] [--steps 200]``
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch import nn  # noqa: E402

from tl_dist.integrations.lightning import TelemetryCallback  # noqa: E402

VOCAB, LENGTH, WIDTH = 256, 64, 64


class TinyTransformer(pl.LightningModule):
    """Embedding -> 2 transformer encoder layers (width 64, 4 heads) -> mean pool -> linear; AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=4 * WIDTH, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, 8)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        logits = self.head(self.encoder(self.embed(tokens)).mean(dim=1))
        return nn.functional.cross_entropy(logits, labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class LoopTimer(pl.Callback):
    """Rank 0 writes the wall and CPU seconds (all its threads) from on_train_start to on_train_end to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.start = (0.0, 0.0)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = (time.perf_counter(), time.process_time())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            wall, cpu = time.perf_counter() - self.start[0], time.process_time() - self.start[1]
            Path(self.path).write_text(f"{wall} {cpu}")


class FitEndMark(pl.Callback):
    """Rank 0 appends the wall time of its ``on_fit_end`` to ``path``: one mark placed before the telemetry
    callback and one after it bracket the callback's end-of-fit merge."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(f"{time.perf_counter()}\n")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def data(steps: int, batch: int = 16) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    n = steps * batch * 2  # each of the 2 ranks sees `steps` batches
    tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    labels = torch.randint(0, 8, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, labels), batch_size=batch)


def fit(mode: str, steps: int, root: Path) -> dict[str, float]:
    """Seconds of one fit: ``fit`` (wall), ``fit_cpu`` (CPU of this process and the rank processes),
    ``loop`` and ``loop_cpu`` (rank 0's training loop), ``merge`` (rank 0's end-of-fit merge: the telemetry
    callback's ``on_fit_end``, 0 without it) and ``fit_no_merge`` (``fit`` less ``merge``)."""
    root.mkdir(parents=True, exist_ok=True)
    timer_file, marks = root / f"{mode}.loop", root / f"{mode}.marks"
    # Lightning runs on_fit_end in list order: the two marks bracket the callback's.
    callbacks: list[pl.Callback] = [LoopTimer(str(timer_file)), FitEndMark(str(marks))]
    if mode != "plain":
        callbacks.append(TelemetryCallback(50 if mode == "every50" else 1))
    callbacks.append(FitEndMark(str(marks)))
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=steps,
        logger=CSVLogger(str(root), name=mode),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=50,
    )
    loader = data(steps)
    t0, cpu0 = time.perf_counter(), time.process_time() + children_cpu()
    trainer.fit(TinyTransformer(), loader)
    wall, cpu = time.perf_counter() - t0, time.process_time() + children_cpu() - cpu0
    # graph.svg is laid out by a detached dot after the fit: wait for it, so it does not slow the next fit.
    for dot_file in root.glob(f"{mode}/*/tl_dist/graph.dot"):
        svg = dot_file.with_suffix(".svg")
        waited = time.perf_counter()
        while not svg.exists() and time.perf_counter() - waited < 900:
            time.sleep(0.5)
        print(f"  ({mode}: graph.svg laid out {time.perf_counter() - waited:.1f}s after the fit)", flush=True)
    loop, loop_cpu = map(float, timer_file.read_text().split())
    before, after = map(float, marks.read_text().split())
    merge = after - before
    return {
        "fit": wall,
        "fit_no_merge": wall - merge,
        "merge": merge,
        "fit_cpu": cpu,
        "loop": loop,
        "loop_cpu": loop_cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    kinds = ("fit", "fit_no_merge", "fit_cpu", "loop", "loop_cpu")
    ratios: dict[str, dict[str, list[float]]] = {m: {k: [] for k in kinds} for m in ("every50", "every1")}
    with tempfile.TemporaryDirectory() as tmp:
        fit("plain", 20, Path(tmp) / "warmup")  # first Lightning/dispatch use in the process is slow
        rounds = [("plain", "every50") if r % 2 == 0 else ("every50", "plain") for r in range(args.rounds)]
        for r, order in enumerate([*rounds, ("plain", "every1")]):
            times = {m: fit(m, args.steps, Path(tmp) / f"round{r}") for m in order}
            print(
                f"round {r}: "
                + "; ".join(
                    f"{m} " + " ".join(f"{k} {t[k]:.1f}s" for k in (*kinds, "merge"))
                    for m, t in times.items()
                )
            )
            mode = next(m for m in order if m != "plain")
            for k in kinds:
                ratios[mode][k].append(times[mode][k] / times["plain"][k])
    print(f"\n{args.steps} steps, 2 ranks (ddp_spawn), ratios to plain (median / min over rounds):")
    for mode, target in (("every50", "  (target <= 1.03x fit, the merge reported apart)"), ("every1", "")):
        cells = [
            f"{k} {statistics.median(ratios[mode][k]):.3f}x / {min(ratios[mode][k]):.3f}x" for k in kinds
        ]
        print(f"  {mode:<8} " + "   ".join(cells) + f"   ({len(ratios[mode]['fit'])} rounds){target}")


if __name__ == "__main__":
    main()
