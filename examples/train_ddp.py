"""A 2-rank DDP training job, armed with tl_dist, then merged: the multi-GPU workflow on CPU/gloo.

Run (what ``make demo`` does):

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --out runs/ddp-demo

Every rank trains a small MLP with DistributedDataParallel for a few steps and captures every other step into
``runs/ddp-demo/rank{R}/step{S}.h5``. Rank 1 is made a little slower (``--straggle-ms``) so the straggler
report has something to say. After training, rank 0 merges the shards and prints the summary and stragglers,
and writes the global graph of the last captured step (SVG) and a Perfetto trace (open it in
https://ui.perfetto.dev).
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
        try:
            print(f"\nwrote {g.draw(str(out / 'merged.svg'), step=g.steps[-1])}")
        except tl.MissingToolError as exc:
            print(f"\nskipped merged.svg: {exc}")
        print(f"wrote {g.to_perfetto(out / 'merged.perfetto.json')} (open in https://ui.perfetto.dev)")
        print(f"wrote {g.save(out / 'merged.h5')} (tl.load_merged / tl-dist summary)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
