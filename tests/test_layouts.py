"""Tensors that are not one dense strided block: sparse (GNNs), nested (nn.TransformerEncoder's fast path with a
padding mask), meta (tracing a model without its memory). Each must trace exactly, keep what it saved, and say
what a shard cannot hold."""

import warnings

import pytest
import torch
from torch import nn

import tl_dist as tl


def _adjacency() -> torch.Tensor:
    indices = torch.tensor([[0, 1, 2, 2], [1, 0, 2, 0]])
    return torch.sparse_coo_tensor(
        indices, torch.tensor([1.0, 2.0, 3.0, 4.0]), (3, 3), check_invariants=True
    ).coalesce()


class GraphConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, adj, x):
        scaled = adj * 2  # a sparse op output, then written in place: the saved value must be the op's own
        scaled.mul_(3)
        scaled._values().add_(1)  # in place into its values' memory
        return torch.sparse.mm(scaled, self.lin(x)).relu()


def test_sparse_ops_trace_exactly_and_keep_each_ops_own_value(tmp_path):
    torch.manual_seed(0)
    model, adj, x = GraphConv(), _adjacency(), torch.randn(3, 4)
    want = model(adj, x)
    trace = tl.trace(model, (adj, x))
    assert torch.equal(trace.output, want)
    assert [op.func for op in trace][:5] == ["mul", "mul_", "_values", "detach", "add_"]
    first_mul = next(op for op in trace if op.func == "mul")
    assert first_mul.out_shapes == ((3, 3),)
    assert first_mul.out.layout is torch.sparse_coo
    # adj * 2 by hand, not the later in-place * 3
    assert torch.equal(first_mul.out.to_dense(), adj.to_dense() * 2)
    assert torch.equal(trace["mul__1"].out.to_dense(), adj.to_dense() * 6)
    assert torch.equal(trace["add__1"].out, adj._values() * 6 + 1)
    # a shard holds dense tensors only: the sparse ones are named and load as None, the rest load
    with pytest.warns(
        RuntimeWarning, match=r"2 saved tensor\(s\) not written, sparse, nested or meta.*mul_1"
    ):
        trace.save(tmp_path / "gcn.h5")
    loaded = tl.load(tmp_path / "gcn.h5")
    assert loaded[first_mul.index].out is None
    assert torch.equal(loaded[len(loaded) - 1].out, want)


def test_sparse_training_step_with_statistics():
    torch.manual_seed(0)
    model, adj, x = GraphConv(), _adjacency(), torch.randn(3, 4)
    with tl.capture(stats=True) as cap:
        model(adj, x).sum().backward()
    trace = cap.trace
    assert {"forward", "backward"} <= set(trace.columns["phase"])
    relu = next(op for op in trace if op.func == "relu")
    want = model(adj, x)
    assert relu.stats["out"]["max"] == pytest.approx(want.max().item())
    assert all(not op.stats for op in trace if op.func == "mul")  # sparse: no statistics, no error


def test_nested_fast_path_of_transformer_encoder_traces_exactly(tmp_path):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])  # rows of 5 and 3 tokens
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
        want = encoder(x, src_key_padding_mask=mask)
        trace = tl.trace(encoder, (x,), kwargs={"src_key_padding_mask": mask})
    assert torch.equal(trace.output, want)
    fused = [op for op in trace if op.func == "_transformer_encoder_layer_fwd"]
    assert len(fused) == 2  # the fast path ran: one fused op per layer
    assert [op.out_shapes for op in fused] == [((2, -1, 16),)] * 2  # -1: the ragged sequence dimension
    assert fused[0].in_shapes[:3] == ((2, -1, 16), (48, 16), (48,))
    assert fused[0].module == "layers.0" and fused[1].module == "layers.1"
    with pytest.warns(RuntimeWarning, match=r"saved tensor\(s\) not written, sparse, nested or meta"):
        trace.save(tmp_path / "nested.h5")
    loaded = tl.load(tmp_path / "nested.h5")
    assert loaded[fused[0].index].out is None
    assert torch.equal(loaded[len(loaded) - 1].out, want)  # to_padded_tensor's dense output


def test_meta_tensors_trace_shapes_and_flops_without_memory():
    model = nn.Sequential(nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 10)).to("meta")
    x = torch.empty(8, 1000, device="meta")
    with tl.capture(stats=True) as cap:
        model(x).sum().backward()
    trace = cap.trace
    addmm = [op for op in trace if op.func == "addmm" and op.phase == "forward"]
    assert [op.flops for op in addmm] == [2 * 8 * 1000 * 1000, 2 * 8 * 1000 * 10]
    assert addmm[0].device == "meta" and addmm[0].out_shapes == ((8, 1000),)
    assert trace.stats_table["op"] == []  # no values to summarise


def test_jagged_nested_tensors_record_plain_int_shapes_and_save(tmp_path):
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, nt):
            return self.lin(nt).relu()

    torch.manual_seed(0)
    rows = [torch.randn(3, 4), torch.randn(5, 4)]
    nt = torch.nested.nested_tensor(rows, layout=torch.jagged)
    model = Head()
    trace = tl.trace(model, nt)
    for got, row in zip(trace.output.unbind(), rows):  # each sequence by plain torch
        assert torch.equal(got, torch.relu(row @ model.lin.weight.T + model.lin.bias))
    shapes = {op.func: op.out_shapes for op in trace if op.func in ("linear", "relu")}
    assert shapes == {"linear": ((2, -1, 3),), "relu": ((2, -1, 3),)}  # ints only: the ragged one is -1
    assert all(type(s) is int for op in trace for shape in op.out_shapes + op.in_shapes for s in shape)
    with pytest.warns(RuntimeWarning, match="sparse, nested or meta"):
        trace.save(tmp_path / "jagged.h5")
    assert (
        tl.load(tmp_path / "jagged.h5").to_pandas()["out_shapes"].tolist()
        == trace.to_pandas()["out_shapes"].tolist()
    )
