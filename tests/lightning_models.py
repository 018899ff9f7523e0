"""Small LightningModules for the Lightning tests (module level, so ``ddp_spawn`` workers can import them).

``Regressor``: ``net = [Linear(8, 16) -> Tanh] -> ReLU -> Linear(16, 16) -> ReLU -> Linear(16, 1)`` behind a
``poison`` module that takes the log of its input (NaN for the negative inputs) on one chosen rank at one chosen
step; plain SGD (lr 0.1, no foreach: one ``add_`` per parameter), MSE loss. 6 parameters (net.0.0, net.2, net.4
weights and biases); module addresses poison, net, net.0, net.0.0, net.0.1, net.1, net.2, net.3, net.4.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn

N_PARAMS = 6
ADDRESSES = ("poison", "net", "net.0", "net.0.0", "net.0.1", "net.1", "net.2", "net.3", "net.4")


class Poison(nn.Module):
    """Identity, or ``log`` of the input (NaN where it is negative) while ``active``."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x) if self.active else x


class Regressor(pl.LightningModule):
    def __init__(self, nan_at: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.poison = Poison()
        self.net = nn.Sequential(
            nn.Sequential(nn.Linear(8, 16), nn.Tanh()),
            nn.ReLU(),
            nn.Linear(16, 16),
            nn.ReLU(),
            nn.Linear(16, 1),
        )
        self.nan_at = nan_at  # (global_step, rank) where the poison acts

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.poison.active = self.nan_at == (self.trainer.global_step, self.global_rank)
        return nn.functional.mse_loss(self.net(self.poison(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, foreach=False)


class ManualRegressor(Regressor):
    """Manual optimization: gradients of two batches accumulated by hand, then one step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()


class TwoOptimizerRegressor(Regressor):
    """Manual optimization with two optimizers stepped in every batch (as a GAN's generator and
    discriminator): global_step advances by 2 per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        for opt in self.optimizers():
            opt.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self.net(x), y))
            opt.step()

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        head, body = list(self.net[4].parameters()), list(self.net[:4].parameters())
        return torch.optim.SGD(head, lr=0.1), torch.optim.SGD(body, lr=0.1)


class ShardedRegressor(Regressor):
    """FSDP2 under Lightning's ModelParallelStrategy: each Linear and the whole module fully sharded."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[2], self.net[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


def dataset(n: int = 64) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(123)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


def loader(batch_size: int = 4, n: int = 64) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset(n), batch_size=batch_size)


class ReleaseProcessGroup(pl.Callback):
    """Destroys the process group at the end of a ``ddp_spawn`` worker's fit.

    Lightning leaves the group up after fit; gloo's worker threads still joinable when the spawned interpreter
    exits abort it ("terminate called without an active exception", pytorch/pytorch#190489), which fails the
    launching fit with a SIGABRT about one run in many. Lightning calls ``teardown`` after ``on_fit_end``, where
    the telemetry callback finishes its collectives.
    """

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def trainer_kwargs(root: str, **overrides: object) -> dict:
    """Quiet CPU Trainer settings shared by the tests; ``ddp_spawn`` fits get a ``ReleaseProcessGroup``."""
    kwargs = dict(
        accelerator="cpu",
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        log_every_n_steps=1,
    )
    kwargs.update(overrides)
    if kwargs.get("strategy") == "ddp_spawn":
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), ReleaseProcessGroup()]
    return kwargs


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of the parameters."""
    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out
