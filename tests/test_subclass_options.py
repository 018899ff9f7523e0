"""Every capture option on models whose tensors are wrapper subclasses, on 2 real gloo ranks: tensor parallel
(DTensor activations, parameters and gradients) and FSDP2 (DTensor parameters whose unsharded copies are
freed after use). tl_dist's own reductions and copies read a DTensor's local shard (a DTensor reduction would
issue collectives); they crashed the process (SIGSEGV) or the model's forward before."""

from __future__ import annotations

import warnings

import pytest
import torch
from dist_helpers import run_ranks
from torch import nn

import tl_dist as tl

pytestmark = pytest.mark.slow


def _tp_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _tp(rank, world_size, out_dir):
    model = _tp_model()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))  # the same on both ranks (TP)
    # Plain references: this rank's local output of the column-parallel layer, and the weight gradients.
    local_out = []
    handle = model[0].register_forward_hook(lambda m, a, out: local_out.append(out.detach().clone()))
    model(x).pow(2).sum().backward()
    handle.remove()
    want_grad = model[0].weight.grad.to_local().clone()
    model.zero_grad()

    with tl.capture(stats=True, save=True, save_grads=True) as cap:
        model(x).pow(2).sum().backward()
    t = cap.trace
    produced = t.module("0").out
    addmm = next(op for op in t if op.func == "addmm")
    stats = addmm.stats["out"]
    got_grad = t.param_grads["0.weight"]
    validation = t.validate()
    path = t.save(out_dir / f"tp{rank}.h5")
    loaded = tl.load(path)
    return {
        "local_out": local_out[0],
        "module_out_type": type(produced).__name__,
        "module_out": produced.to_local() if hasattr(produced, "to_local") else produced,
        "addmm_is_dtensor": type(addmm.out).__name__,
        "addmm_local": addmm.out.to_local(),
        "stats_mean": stats["mean"],
        "stats_max": stats["max"],
        "grad_type": type(got_grad).__name__,
        "grad_local": got_grad.to_local(),
        "want_grad": want_grad,
        "validate_ok": validation.passed,
        "validated": validation.checked,
        "loaded_addmm": loaded[addmm.label].out,
    }


def test_tensor_parallel_with_stats_save_and_save_grads(tmp_path):
    for rank, res in enumerate(run_ranks(_tp, world_size=2, tmp_path=tmp_path)):
        local = res["local_out"]
        assert local.shape == (8, 32)  # this rank's half of the 64 columns
        assert res["addmm_is_dtensor"] == "DTensor" and torch.equal(res["addmm_local"], local)
        # (what the module's forward returned, before ColwiseParallel's own hook turned it into a local tensor)
        assert res["module_out_type"] == "DTensor" and torch.equal(res["module_out"], local)
        # Statistics of the shard this rank holds, by plain torch.
        assert res["stats_mean"] == pytest.approx(local.double().mean().item(), rel=1e-6)
        assert res["stats_max"] == local.max().item()
        assert res["grad_type"] == "DTensor" and torch.equal(res["grad_local"], res["want_grad"])
        assert res["validate_ok"] and res["validated"] > 5, rank
        # A rank's shard holds its local part of a DTensor.
        assert torch.equal(res["loaded_addmm"], local)


def _fsdp(rank, world_size, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    ref = torch.relu(x @ model[0].weight.full_tensor().T + model[0].bias.full_tensor())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tl.capture(save=True, save_grads=True, stats=True) as cap:
            model(x).pow(2).mean().backward()
    t = cap.trace
    relu = next(op for op in t if op.func == "relu")
    freed = [str(w.message) for w in caught if "freed before the window ended" in str(w.message)]
    weight_view = next(op for op in t if op.func == "t" and op.phase == "forward")
    return {"relu": relu.out, "ref": ref, "freed": freed, "view_out": weight_view.out}


def test_fsdp2_with_every_option_drops_what_fsdp_freed_and_keeps_the_rest(tmp_path):
    for res in run_ranks(_fsdp, world_size=2, tmp_path=tmp_path):
        assert torch.allclose(res["relu"], res["ref"], atol=1e-6)
        # The transposed view of an unsharded weight read memory FSDP freed after the layer: not kept, said so.
        assert res["view_out"] is None
        assert len(res["freed"]) == 1 and "t_1" in res["freed"][0], res["freed"]


def _tp_late(rank, world_size, out_dir):
    import time

    model = _tp_model()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    model(x).sum().backward()  # warm up outside the window
    torch.distributed.barrier()  # both ranks start the window together
    with tl.capture() as cap:
        if rank == 1:
            time.sleep(0.2)
        out = model(x).view(
            -1
        )  # a view of the AsyncCollectiveTensor RowwiseParallel returns: it does not wait
        out.pow(2).sum().backward()
    ct = cap.trace.collective_table
    first = ct["func"].index("all_reduce")
    return {"issue": ct["issue_ns"][first], "complete": ct["complete_ns"][first]}


def test_tensor_parallel_collective_completes_after_the_late_rank_issued_it(tmp_path):
    on_time, late = run_ranks(_tp_late, world_size=2, tmp_path=tmp_path)
    # Rank 0 issued the forward all-reduce ~0.2 s before rank 1 did: it cannot have completed before that
    # (one host, one clock; 5 ms for the clocks' reading order). Its view is not where it waited.
    assert late["issue"] - on_time["issue"] > 0.1e9  # the sleep, less what a loaded machine lets rank 0 lag
    assert on_time["complete"] >= late["issue"] - 5_000_000, (on_time, late)
