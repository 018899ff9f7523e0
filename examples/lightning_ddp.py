"""A Lightning DDP job with tl_dist's TelemetryCallback: 2 CPU processes (gloo), every 10th step captured.

Run (what ``make demo`` does):

    python examples/lightning_ddp.py --out runs/lightning-demo

A small transformer classifier trains on synthetic sequences with ``strategy="ddp"`` (Lightning starts the
second process by re-running this script). Every 10th optimizer step is recorded on both ranks -- the real
step, with forward, backward and optimizer phases, module times, DDP's gradient all-reduces and activation /
gradient norms -- and its telemetry goes to ``metrics.csv`` (``tl/...`` columns, docs/lightning.md). Rank 1
sleeps a little in each step, so the straggler metrics have something to show. At the end rank 0 merges the
ranks and writes ``merged.h5``, ``timeline.json`` (open it in https://ui.perfetto.dev) and ``graph.svg``.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch import nn  # noqa: E402

import tl_dist as tl  # noqa: E402
from tl_dist.integrations.lightning import TelemetryCallback  # noqa: E402

VOCAB, LENGTH = 64, 32


class SequenceClassifier(pl.LightningModule):
    """Token embedding -> 2-layer transformer encoder -> mean pool -> linear head."""

    def __init__(self, straggle_ms: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        layer = nn.TransformerEncoderLayer(64, nhead=4, dim_feedforward=128, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 2)
        self.straggle_ms = straggle_ms

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1:
            time.sleep(self.straggle_ms / 1e3)  # a slow input pipeline on rank 1
        tokens, labels = batch
        loss = nn.functional.cross_entropy(self(tokens), labels)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def synthetic_data(n: int = 512) -> torch.utils.data.TensorDataset:
    """Sequences labelled by whether token 0 appears more often than token 1."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    labels = ((tokens == 0).sum(1) > (tokens == 1).sum(1)).long()
    return torch.utils.data.TensorDataset(tokens, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/lightning-demo", help="run folder (cleared first)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="capture every N-th optimizer step")
    parser.add_argument("--straggle-ms", type=float, default=20.0, help="extra time rank 1 spends per step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    if os.environ.get("LOCAL_RANK") is None and out.exists():  # the launching process, before the fit
        shutil.rmtree(out)

    torch.manual_seed(0)
    telemetry = TelemetryCallback(every_n_steps=args.every, options=tl.CaptureOptions(stats=True))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=args.steps,
        logger=CSVLogger(str(out), name="logs"),
        callbacks=[telemetry],
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    loader = torch.utils.data.DataLoader(synthetic_data(), batch_size=16, shuffle=True)
    trainer.fit(SequenceClassifier(args.straggle_ms), loader)

    if trainer.is_global_zero:
        metrics = Path(trainer.logger.log_dir) / "metrics.csv"  # not trainer.log_dir: a collective
        with metrics.open() as f:
            rows = [r for r in csv.DictReader(f) if r.get("tl/step_flops")]
        last = rows[-1]
        print(f"\nstep {last['step']} (rank 0 writes the metrics of every rank):")
        for name in ("tl/forward_ms", "tl/backward_ms", "tl/optimizer_ms", "tl/comm_ms", "tl/straggler_rank"):
            print(f"  {name:<18} {float(last[name]):10.3f}")
        print(f"\nmetrics:       {metrics}")
        print(f"shards:        {telemetry.shard_dir}/rank*/step*.h5 (steps {telemetry.captured_steps})")
        for name in ("merged.h5", "timeline.json", "graph.svg"):
            path = telemetry.shard_dir / name
            pending = name == "graph.svg" and (telemetry.shard_dir / "graph.dot").exists()
            note = (
                ""
                if path.exists()
                else " (dot is laying it out in the background)"
                if pending
                else " (not written)"
            )
            print(f"{name + ':':<15}{path}{note}")
    # Lightning leaves the process group up after fit; gloo's threads still running at interpreter exit
    # abort the process (pytorch/pytorch#190489).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
