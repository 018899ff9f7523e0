"""DDP's gradient-bucket all-reduces and FSDP2's all-gather / reduce-scatter as collective ops, on 2 gloo ranks."""

import pytest
import torch
import torch.distributed as dist
from dist_helpers import collective_rows, run_ranks
from torch import nn

import tl_dist as tl


def _mlp():
    torch.manual_seed(0)
    # 64x64 weights: 4160 float32 per layer (16.6 kB) -> each layer its own bucket at bucket_cap_mb=0.01.
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


def _ddp(rank, world_size, out_dir):
    model = nn.parallel.DistributedDataParallel(_mlp(), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hooks_before = (dict(model._forward_hooks), model._comm_hooks if hasattr(model, "_comm_hooks") else None)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    # DDP's first iteration runs with one bucket and rebuilds the buckets at the start of the second.
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    user_buf = torch.ones(5)

    def user_hook(grad):
        dist.all_reduce(user_buf)  # a user's own all-reduce in backward: not a DDP bucket

    with tl.capture() as cap:
        out = model(x)
        out.register_hook(user_hook)
        out.sum().backward()
        opt.step()
    buckets = [b.buffer().numel() for b in model.reducer._get_zeros_like_grad_buckets()]
    hooks_after = (dict(model._forward_hooks), model._comm_hooks if hasattr(model, "_comm_hooks") else None)
    weight_sum = sum(p.detach().sum().item() for p in model.parameters())
    return {
        "rows": collective_rows(cap.trace),
        "buckets": buckets,
        "hooks_unchanged": repr(hooks_before) == repr(hooks_after),
        "weight_sum": weight_sum,
    }


@pytest.mark.slow
def test_ddp_bucket_all_reduces(tmp_path):
    results = run_ranks(_ddp, world_size=2, tmp_path=tmp_path)
    for res in results:
        user, *rows = res["rows"]  # the output's gradient (and so the user's hook) comes first in backward
        assert len(res["buckets"]) == 3, res["buckets"]  # one bucket per layer (see _mlp)
        assert (user["in_numel"], user["bucket"], user["phase"]) == (5, -1, "backward")
        assert [r["func"] for r in rows] == ["all_reduce"] * 3
        assert [r["bucket"] for r in rows] == [0, 1, 2]
        # Bucket i's all-reduce carries bucket i's flat buffer: 64*64 + 64 = 4160 elements each.
        assert [r["in_numel"] for r in rows] == res["buckets"] == [4160] * 3
        assert all(r["bytes"] == 4160 * 4 and r["group_ranks"] == (0, 1) for r in rows)
        assert all(r["phase"] == "backward" and r["is_async"] and r["state"] == "completed" for r in rows), [
            (r["phase"], r["is_async"], r["state"]) for r in rows
        ]
        # DDP copies the reduced bucket back into the parameters' grads: a view of the bucket per parameter
        # (weight, bias), each copied into its .grad. Nobody reads the user's buffer inside the window.
        assert [(r["children"], r["grandchildren"]) for r in rows] == [
            (("as_strided", "as_strided"), ("copy_", "copy_"))
        ] * 3
        assert user["children"] == ()
        assert res["hooks_unchanged"]
    assert [r["seq"] for r in results[0]["rows"]] == [r["seq"] for r in results[1]["rows"]]
    seqs = [r["seq"] for r in results[0]["rows"]]
    assert seqs == list(range(seqs[0], seqs[0] + 4))
    # Replicas stayed in sync through the captured step: the all-reduced gradients are the same bits everywhere
    assert results[0]["weight_sum"] == results[1]["weight_sum"]


def _fsdp(rank, world_size, out_dir):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    with tl.capture() as cap:
        model(x).sum().backward()
        opt.step()  # on the sharded DTensor parameters: no collective
    trace = cap.trace
    copy_ins = [op.index for op in trace if op.func == "all_gather_copy_in"]
    gathers = [c for c in trace.collectives if c.func == "all_gather"]
    return {
        "rows": collective_rows(trace),
        "gather_parents": [trace[c.op].parents for c in gathers],
        "copy_ins": copy_ins,
    }


@pytest.mark.slow
def test_fsdp2_all_gather_and_reduce_scatter(tmp_path):
    results = run_ranks(_fsdp, world_size=2, tmp_path=tmp_path)
    for res in results:
        rows = res["rows"]
        fwd = [r for r in rows if r["phase"] == "forward"]
        bwd = [r for r in rows if r["phase"] == "backward"]
        # Forward: one all-gather per FSDP group with parameters (model[0], model[2]); the root owns none.
        # Each gathers this rank's shard of weight+bias (16*16 + 16 = 272, 136 per rank) into 272 elements.
        assert [r["func"] for r in fwd] == ["all_gather", "all_gather"], [
            (r["func"], r["phase"]) for r in rows
        ]
        assert all((r["in_numel"], r["out_numel"]) == (136, 272) for r in fwd)
        # Backward: both groups are re-gathered (resharded after forward), then one reduce-scatter of
        # gradients per group: 272 -> this rank's 136.
        assert [r["func"] for r in bwd].count("all_gather") == 2
        assert all((r["in_numel"], r["out_numel"]) == (136, 272) for r in bwd if r["func"] == "all_gather")
        rs = [r for r in bwd if r["func"] == "reduce_scatter"]
        assert len(rs) == 2 and all((r["in_numel"], r["out_numel"]) == (272, 136) for r in rs)
        assert [r["reduce_op"] for r in rs] == [
            "avg",
            "avg",
        ]  # FSDP2 averages gradients (gloo: no premul_sum)
        assert all(r["group_ranks"] == (0, 1) and r["state"] == "completed" for r in rows), [
            (r["func"], r["phase"], r["state"], r["is_async"]) for r in rows
        ]
        # FSDP's copy-in feeds each all-gather; its split-copy reads (a view of) the gathered buffer.
        assert all(p and set(p) & set(res["copy_ins"]) for p in res["gather_parents"])
        gathers = [r for r in rows if r["func"] == "all_gather"]
        assert all(r["children"] == ("view",) for r in gathers), [r["children"] for r in gathers]
        assert all("split_with_sizes_copy" in r["grandchildren"] for r in gathers)
        # The reduce-scatter's output is read too: copied into the sharded gradient, one view per parameter.
        assert [(r["children"], r["grandchildren"]) for r in rs] == [
            (("copy_",), ("as_strided", "as_strided"))
        ] * 2
    keys = [[(r["func"], r["seq"]) for r in res["rows"]] for res in results]
    assert keys[0] == keys[1]
    seqs = [s for _, s in keys[0]]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
