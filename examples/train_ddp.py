"""A 2-rank DDP training job, armed with tl_dist, then merged: the multi-GPU workflow on CPU/gloo.

Run (what ``make demo`` does):

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --out runs/ddp-demo

Every rank trains a small MLP with DistributedDataParallel for a few steps and captures every other step into
``runs/ddp-demo/rank{R}/step{S}.h5``. Rank 1 is made a little slower (``--straggle-ms``) so the straggler
report has something to say. After training, rank 0 merges the shards, prints the summary and stragglers, and
writes into the run folder the global graph of the last captured step (``merged.svg``), a Perfetto trace
(``merged.perfetto.json``, open it in https://ui.perfetto.dev), the merged trace (``merged.h5``) and the HTML
report (``report.html``, one self-contained page); it ends by listing where each output is.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import tl_dist as tl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/ddp-demo", help="run folder (cleared first)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2, help="capture every N-th step")
    parser.add_argument("--straggle-ms", type=float, default=30.0, help="extra time rank 1 spends per step")
    args = parser.parse_args()

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    if rank == 0 and out.exists():
        shutil.rmtree(out)
    dist.barrier()

    tl.arm(out, every=args.every)  # once per rank, after init_process_group
    torch.manual_seed(0)
    model = DDP(
        nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4)),
        bucket_cap_mb=0.05,  # several gradient buckets: several all_reduces per backward
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank))
    target = torch.randn(64, 4, generator=torch.Generator().manual_seed(100 + rank))

    for step in range(1, args.steps + 1):
        captured = tl.should_capture(step)
        with tl.capture(step=step) if captured else contextlib.nullcontext():
            if rank == 1:
                time.sleep(args.straggle_ms / 1e3)  # a slow data loader on rank 1
            loss = nn.functional.mse_loss(model(data), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}" + (" (captured)" if captured else ""))

    tl.disarm()
    dist.barrier()  # every shard is written before rank 0 merges
    if rank == 0:
        g = tl.merge_ranks(out)
        print()
        print(g.summary())
        print()
        print("stragglers:")
        print(g.stragglers().to_string(index=False))
        outputs = {"shards": f"{out}/rank*/step*.h5 (steps {g.steps})"}
        # Graphviz's dot and plotly (the report extra) are optional: without them the demo says how to get them.
        for name, what, write in (
            ("merged.svg", f"graph of step {g.steps[-1]}", lambda p: g.draw(str(p), step=g.steps[-1])),
            ("merged.perfetto.json", "timeline, open in https://ui.perfetto.dev", g.to_perfetto),
            ("merged.h5", "merged trace, tl.load_merged / tl-dist summary", g.save),
            ("report.html", "HTML report, open in a browser", g.report),
        ):
            try:
                outputs[what] = write(out / name)
            except tl.MissingToolError as exc:
                outputs[what] = f"skipped: {exc}"
        print("\noutputs:")
        for what, where in outputs.items():
            print(f"  {what}: {where}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
