"""A standalone Lightning job for the tests of strategies that re-execute ``sys.argv`` (``ddp``,
``ModelParallelStrategy``), so they never run inside pytest: 2 CPU processes on gloo.

    python tests/lightning_job.py --strategy ddp --out DIR [--accumulate 2] [--max-steps 3] [--every 2]

Fits a ``Regressor`` with ``TelemetryCallback(out_dir=DIR/tl)``, then the same model from the same seed without
it, and rank 0 writes ``DIR/result.json``: whether the parameters after both fits are equal, and differ
from the initial ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning_models import Regressor, ShardedRegressor, loader, params, trainer_kwargs  # noqa: E402

from tl_dist.integrations.lightning import TelemetryCallback  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "fsdp2"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--every", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)

    def strategy():
        if args.strategy == "ddp":
            return "ddp"
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)

    model_class = Regressor if args.strategy == "ddp" else ShardedRegressor
    torch.manual_seed(0)
    init = params(Regressor())
    results = []
    for callbacks in ([TelemetryCallback(args.every, out_dir=out / "tl")], []):
        torch.manual_seed(0)
        model = model_class()
        trainer = pl.Trainer(
            **trainer_kwargs(
                str(out),
                devices=2,
                strategy=strategy(),
                max_steps=args.max_steps,
                accumulate_grad_batches=args.accumulate,
                callbacks=callbacks,
            )
        )
        trainer.fit(model, loader())
        results.append(params(model))
    if trainer.is_global_zero:
        equal = all(torch.equal(results[0][k], results[1][k]) for k in results[0])
        trained = all(not torch.equal(results[0][k], init[k]) for k in results[0])
        result = {"params_equal": equal, "trained": trained, "world_size": trainer.world_size}
        (out / "result.json").write_text(json.dumps(result))
    # Lightning leaves the process group up after fit; gloo's worker threads still joinable at interpreter exit
    # abort the process ("terminate called without an active exception", pytorch/pytorch#190489).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
