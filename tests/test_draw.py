"""Drawing a trace: which ops get nodes, module clusters and collapsing (backward and optimizer ops included),
input / parameter / output nodes, the phase filter, the automatic depth, and the options' errors."""

import re
import xml.etree.ElementTree as ET

import pytest
import torch
from test_views import Net
from torch import nn

import tl_dist as tl
from tl_dist.views.draw import DrawNote, graph_source
from tl_dist.views.graph import plan_graph

needs_dot = pytest.mark.needs("dot")
SVG = "{http://www.w3.org/2000/svg}"


def svg_groups(path):
    """Titles of the node, cluster and edge groups of a Graphviz SVG."""
    root = ET.parse(path).getroot()
    assert root.tag == SVG + "svg"
    groups = {"node": [], "cluster": [], "edge": []}
    for g in root.iter(SVG + "g"):
        cls = g.get("class")
        if cls in groups:
            groups[cls].append(g.find(SVG + "title").text.replace("&#45;", "-"))
    return groups


@pytest.fixture
def net_trace():
    torch.manual_seed(0)
    with torch.no_grad():
        return tl.trace(Net().eval(), torch.randn(2, 3, 4, 4))


def _named(trace, plan):
    """Plan node names with op nodes spelled by their op's label (``op7`` -> ``add_1``)."""
    return lambda name: trace.columns["label"][int(name[2:])] if re.fullmatch(r"op\d+", name) else name


def _edges(trace, plan):
    name = _named(trace, plan)
    return {(name(a), name(b)) for a, b in plan.edges}


def _row(trace, address):
    return trace.module(address).row


# -- one forward pass -----------------------------------------------------------------------------------------
def test_forward_nodes_edges_and_clusters(net_trace, tmp_path):
    t = net_trace
    plan = plan_graph(t)
    # Net's 12 ops: empty_1 (BatchNorm's allocation), view_1 (Flatten) and t_1 (the Linear's weight.t()) are
    # bookkeeping; the other 9 are nodes, with one parameter node per module owning parameters, the input, and
    # the output.
    p = {a: f"p{_row(t, a)}" for a in ("stem", "block.conv1", "block.bn", "block.conv2", "head.1")}
    ops = ["convolution_1", "relu_1", "convolution_2", "native_batch_norm_1", "relu_2", "convolution_3"]
    ops += ["add_1", "relu_3", "addmm_1"]
    name = _named(t, plan)
    assert sorted(name(n) for n in plan.nodes) == sorted(ops + list(p.values()) + ["in_2x3x4x4", "out0"])
    assert _edges(t, plan) == {
        ("in_2x3x4x4", "convolution_1"),
        (p["stem"], "convolution_1"),
        ("convolution_1", "relu_1"),
        ("relu_1", "convolution_2"),
        (p["block.conv1"], "convolution_2"),
        ("convolution_2", "native_batch_norm_1"),
        (p["block.bn"], "native_batch_norm_1"),
        ("native_batch_norm_1", "relu_2"),
        ("relu_2", "convolution_3"),
        (p["block.conv2"], "convolution_3"),
        ("convolution_3", "add_1"),
        ("relu_1", "add_1"),  # the residual
        ("add_1", "relu_3"),
        ("relu_3", "addmm_1"),  # through Flatten's view
        (p["head.1"], "addmm_1"),  # the bias, and the weight through t()
        ("addmm_1", "out0"),
    }
    texts = {name(n): node.text for n, node in plan.nodes.items()}
    assert texts["in_2x3x4x4"] == "input\n2x3x4x4" and texts["out0"] == "output\n2x5"
    assert texts[p["block.bn"]] == "weight 8\nbias 8\nrunning_mean 8\nrunning_var 8"
    assert texts[p["head.1"]] == "weight 5x128\nbias 5"
    # Nodes sit in the cluster of their module call; parameters in their owner's; inputs/outputs at top level.
    clusters = {name(n): node.cluster for n, node in plan.nodes.items()}
    assert clusters["native_batch_norm_1"] == clusters[p["block.bn"]] == _row(t, "block.bn")
    assert clusters["relu_1"] == _row(t, "") and clusters["in_2x3x4x4"] == clusters["out0"] == -1
    assert set(plan.clusters) == {_row(t, a) for a in ("", "stem", "block", "block.conv1", "block.bn")} | {
        _row(t, a) for a in ("block.conv2", "head", "head.1")
    }  # head.0 (Flatten) ran only a view: no node, no cluster


def _param_nodes(trace, plan):
    """Per parameter node: the full names of the parameters it lists (its cluster's address prefixed back)."""
    table = trace.module_table
    out = {}
    for key, node in plan.nodes.items():
        if node.kind == "params":
            prefix = (
                table["address"][node.cluster] + "."
                if node.cluster >= 0 and table["address"][node.cluster]
                else ""
            )
            out[key] = {prefix + line.split(" ")[0] for line in node.text.split("\n")}
    return out


def test_parameters_of_modules_never_called_stay_apart_per_layer():
    # MultiheadAttention reads its out_proj's weight and bias in functional code: out_proj never runs as a
    # module. Each layer's pair is its own node in its self_attn's cluster, feeding only that layer's op.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)  # training mode: no fused fast path
    t = tl.trace(model, torch.randn(2, 3, 8))
    plan = plan_graph(t, depth=None)
    nodes = _param_nodes(t, plan)
    # Every parameter in exactly one node (12 per layer: in_proj 2, out_proj 2, linear1/2 4, norm1/2 4).
    listed = [name for names in nodes.values() for name in names]
    assert sorted(listed) == sorted(n for n, _ in model.named_parameters()) and len(listed) == 24
    for k in (0, 1):
        names = {f"layers.{k}.self_attn.out_proj.weight", f"layers.{k}.self_attn.out_proj.bias"}
        (key,) = [key for key, got in nodes.items() if got == names]
        assert plan.nodes[key].text == "out_proj.weight 8x8\nout_proj.bias 8"
        assert plan.nodes[key].cluster == _row(t, f"layers.{k}.self_attn")
        (reader,) = [b for a, b in plan.edges if a == key]  # the output projection's linear op
        assert plan.nodes[reader].cluster == _row(t, f"layers.{k}.self_attn")
        # addmm(bias, x, t(weight)): the weight reaches it through its t() view
        assert t.columns["func"][int(reader[2:])] == "addmm"


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10)
        self.head.weight = self.emb.weight  # one tensor, two modules

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_a_tied_parameter_is_one_node_feeding_both_readers():
    torch.manual_seed(0)
    with torch.no_grad():
        t = tl.trace(_Tied(), torch.tensor([[1, 2, 3]]))
    plan = plan_graph(t, depth=None)
    nodes = _param_nodes(t, plan)
    # The tensor is named by its first owner (emb.weight); head.bias is head's own node.
    assert sorted(nodes.values(), key=sorted) == [{"emb.weight"}, {"head.bias"}]
    (tied,) = [key for key, names in nodes.items() if names == {"emb.weight"}]
    readers = sorted(t.columns["func"][int(b[2:])] for a, b in plan.edges if a == tied)
    assert readers == ["addmm", "embedding"]  # head reads it through a t() view


@needs_dot
def test_forward_svg_has_the_plan_nodes_and_clusters(net_trace, tmp_path):
    path = tmp_path / "graph.out"  # any name: written as given, no extension added
    assert net_trace.draw(str(path)) == str(path)
    assert [p.name for p in tmp_path.iterdir()] == ["graph.out"]
    plan = plan_graph(net_trace)
    groups = svg_groups(path)
    assert sorted(groups["node"]) == sorted(plan.nodes)
    assert set(groups["cluster"]) == {f"cluster_m{r}" for r in plan.clusters}
    assert set(groups["edge"]) == {f"{a}->{b}" for a, b in plan.edges}
    text = path.read_text()
    assert "block.bn (BatchNorm2d)" in text and "convolution_1" in text and "2x8x4x4" in text
    assert "empty_1" not in text


def test_show_all_draws_every_op_and_its_edges(net_trace):
    t = net_trace
    plan = plan_graph(t, show_all=True)
    ops = {n for n, node in plan.nodes.items() if node.kind == "op"}
    assert ops == {f"op{i}" for i in range(len(t))}
    edges = _edges(t, plan)
    assert {("relu_3", "view_1"), ("view_1", "addmm_1"), ("t_1", "addmm_1")} <= edges
    assert ("relu_3", "addmm_1") not in edges
    # empty_1 reads nothing and nothing reads it (batch norm's unused save buffer): a lone node, only here.
    assert not any("empty_1" in e for e in edges)


def test_depth_collapses_deeper_calls(net_trace):
    t = net_trace
    plan = plan_graph(t, depth=0)
    name = _named(t, plan)
    block, head, stem = (f"m{_row(t, a)}" for a in ("block", "head", "stem"))
    assert sorted(name(n) for n in plan.nodes) == sorted([block, head, stem, "relu_1", "in_2x3x4x4", "out0"])
    assert _edges(t, plan) == {
        ("in_2x3x4x4", stem),
        (stem, "relu_1"),
        ("relu_1", block),
        (block, head),
        (head, "out0"),
    }
    assert plan.clusters == [_row(t, "")]
    # block: conv1, empty, batch_norm, relu, conv2, add, relu; 512 + 2x9x... FLOPs as the ops' own sum.
    flops = sum(op.flops for op in t.module("block").ops)
    text = plan.nodes[block].text.splitlines()
    assert text[0] == "block (Block)" and text[1] == "7 ops, 2x8x4x4"
    assert text[2].endswith(tl.views.summary.format_count(flops, "FLOP"))


def test_source_of_a_long_chain_of_blocks():
    # 400 blocks of (Linear, ReLU): 1200 ops, 1201 module calls. Timing lives in benchmarks/bench_trace.py.
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(400)])
    with torch.no_grad():
        t = tl.trace(model, torch.randn(1, 4), save=None)
    assert len(t) == 1200  # t, addmm, relu per block
    source = graph_source(t, depth=None, show_all=True)
    assert len(re.findall(r"^\s+op\d+ \[label=", source, flags=re.M)) == len(t)
    assert len(re.findall(r"subgraph cluster_m\d+", source)) == len(t.module_table["address"])
    blocks = graph_source(t, depth=0)
    # depth 0: the root cluster holds 400 block nodes chained by 399 edges (each block feeds the next).
    assert len(re.findall(r"^\s+m\d+ \[label=", blocks, flags=re.M)) == 400
    assert len(re.findall(r"^\s+m\d+ -> m\d+$", blocks, flags=re.M)) == 399
    assert re.search(r"\bop\d+", blocks) is None  # every op folded into its block


def test_automatic_depth_past_300_nodes_says_what_it_chose():
    def chain(n):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(n)])
        with torch.no_grad():
            return tl.trace(model, torch.randn(1, 4), save=None)

    # Every op: addmm, relu and a parameter node per block, plus input and output: 3 n + 2 nodes.
    small = chain(60)  # 182 nodes: drawn whole, no note
    assert len(plan_graph(small).nodes) == 182
    assert graph_source(small) == graph_source(small, depth=None)
    big = chain(150)  # 452 nodes; depth 1 (Linear and ReLU collapsed) 302; depth 0 (blocks) 152
    assert [len(plan_graph(big, depth=d).nodes) for d in (None, 1, 0)] == [452, 302, 152]
    note = (
        "depth=0 chosen automatically: 152 nodes (every op would be 452 nodes, over 300); pass depth=None to "
        "draw every op or depth=N to choose"
    )
    source = graph_source(big)
    assert f'label="{note}" labelloc=t' in source
    assert source.replace(f' label="{note}" labelloc=t', "") == graph_source(big, depth=0)
    with pytest.warns(DrawNote, match=r"trace.draw: depth=0 chosen automatically: 152 nodes"):
        try:
            big.draw("/dev/null", format="dot")
        except tl.MissingToolError:
            pass


# -- a training step ------------------------------------------------------------------------------------------
def test_backward_and_optimizer_ops_collapse_with_their_module(step_trace):
    t = step_trace
    plan = plan_graph(t, depth=0)
    name = _named(t, plan)
    m0, m1, m2 = (f"m{_row(t, a)}" for a in ("0", "1", "2"))
    assert sorted(name(n) for n in plan.nodes) == sorted(
        [m0, m1, m2, "sum_1", "ones_like_1", "in_5x4", "out0"]
    )
    # Linear 0: forward t, addmm; backward (grad_fn of addmm and t) t, mm, t, sum, view, t, and the detach of
    # each gradient AccumulateGrad keeps; optimizer add_ of weight and bias.
    assert plan.nodes[m0].text.splitlines()[1] == "12 ops (2 fwd, 8 bwd, 2 opt), 5x3"
    assert plan.nodes[m1].text.splitlines()[1] == "4 ops (2 fwd, 2 bwd), 5x3"  # relu, detach; its backward
    assert plan.nodes[m2].text.splitlines()[1] == "14 ops (2 fwd, 10 bwd, 2 opt), 5x2"
    assert _edges(t, plan) == {
        ("in_5x4", m0),
        (m0, m1),
        (m1, m0),
        (m1, m2),
        (m2, m1),
        (m2, "sum_1"),
        ("sum_1", "ones_like_1"),
        ("ones_like_1", m2),  # the gradient seed flows back into the last Linear
        (m2, "out0"),
    }
    source = graph_source(t, depth=0)
    # Forward and backward between the same calls: one edge with arrows both ways.
    assert f"  {m0} -> {m1} [dir=both]" in source and f"{m1} -> {m0}" not in source
    assert (
        "orange border: backward op, purple border: optimizer op" not in source
    )  # no op node of those phases
    assert "orange border: backward op, purple border: optimizer op" in graph_source(t, depth=None)


def test_phase_filter_and_backward_ops_in_their_forward_ops_cluster(step_trace):
    t = step_trace
    full = plan_graph(t)
    home = {
        t.columns["label"][int(n[2:])]: node.cluster for n, node in full.nodes.items() if node.kind == "op"
    }
    assert home["mm_3"] == home["addmm_1"] == home["add__1"] == _row(t, "0")  # grad of weight 0, its update
    assert home["threshold_backward_1"] == home["relu_1"] == _row(t, "1")
    forward = plan_graph(t, phases=frozenset({"forward"}))
    labels = {t.columns["label"][int(n[2:])] for n, node in forward.nodes.items() if node.kind == "op"}
    assert labels == {"addmm_1", "relu_1", "addmm_2", "sum_1"}  # the seed gradient (ones_like) is backward
    optimizer = plan_graph(t, phases=frozenset({"optimizer"}))
    p0, p2 = f"p{_row(t, '0')}", f"p{_row(t, '2')}"
    assert _edges(t, optimizer) == {
        (p0, "add__1"),
        (p0, "add__2"),
        (p2, "add__3"),
        (p2, "add__4"),
    }  # the gradients came from backward ops, which are not drawn
    assert graph_source(t, phase="optimizer") == graph_source(t, phase=["optimizer"])


# -- options ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [-1, 1.5, True, "2", "all"])
def test_rejects_bad_depth(net_trace, tmp_path, depth):
    with pytest.raises(ValueError, match="depth must be 'auto', None .* or a non-negative int"):
        net_trace.draw(tmp_path / "g.svg", depth=depth)
    assert not (tmp_path / "g.svg").exists()


@pytest.mark.parametrize("phase", ["fwd", ["forward", "bwd"], [], 3])
def test_rejects_bad_phase(net_trace, tmp_path, phase):
    with pytest.raises(
        ValueError, match=r"phase must be None, one of \('forward', 'backward', 'optimizer', 'recompute'\)"
    ):
        net_trace.draw(tmp_path / "g.svg", phase=phase)


def test_rejects_bad_show_all_and_format(net_trace, tmp_path):
    with pytest.raises(ValueError, match="show_all must be a bool, got 1"):
        net_trace.draw(tmp_path / "g.svg", show_all=1)
    with pytest.raises(ValueError, match=r"format must be a Graphviz output format.*'svgg'"):
        net_trace.draw(tmp_path / "g.svg", format="svgg")


def test_without_dot_says_to_install_graphviz(net_trace, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no `dot` to find
    with pytest.raises(tl.TlDistError, match="Install Graphviz"):
        net_trace.draw(tmp_path / "g.svg")
    assert not (tmp_path / "g.svg").exists()


@needs_dot
def test_other_formats(net_trace, tmp_path):
    png = net_trace.draw(tmp_path / "g.png", format="png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    source = open(net_trace.draw(tmp_path / "g.dot", format="dot", depth=1)).read()
    assert source.startswith("digraph trace {") and "cluster_m0" in source


@needs_dot
def test_capture_window_ops_outside_modules_at_top_level(tmp_path):
    layer = nn.Linear(4, 3)
    with torch.no_grad(), tl.capture() as cap:
        (layer(torch.randn(2, 4)) * 2).sum()
    t = cap.trace
    groups = svg_groups(t.draw(tmp_path / "w.svg"))
    assert [t.columns["func"][i] for i in range(len(t)) if t[i].module_call < 0] == ["randn", "mul", "sum"]
    # randn, mul and sum outside the Linear; its t() is bookkeeping; its parameters and output have nodes.
    ops = {f"op{t[label].index}" for label in ("randn_1", "addmm_1", "mul_1", "sum_1")}
    assert set(groups["node"]) == ops | {"p0", "out0"}
    assert groups["cluster"] == ["cluster_m0"]
    plan = plan_graph(t)
    assert {n for n, node in plan.nodes.items() if node.cluster == 0} == {f"op{t['addmm_1'].index}", "p0"}
