"""The demo's pictures as a user gets them from ``make demo``: node counts within bounds, no lone nodes, and the
merged 2-rank DDP step narrow enough for a screen."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_draw import svg_groups

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")


def _width_px(svg: Path) -> float:
    # Graphviz writes the size in points; its PNGs are 96 dpi: px = pt * 96 / 72.
    head = svg.read_text()[:2000]
    return float(re.search(r'<svg width="([\d.]+)pt"', head).group(1)) * 96 / 72


def _lone_nodes(groups) -> set[str]:
    linked = {end for edge in groups["edge"] for end in edge.split("->")}
    return set(groups["node"]) - linked


@pytest.mark.slow
@pytest.mark.needs("dot")
def test_demo_cnn_graphs(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    full = svg_groups(tmp_path / "graph.svg")
    # 17 ops of SmallCNN in eval: 12 draw (convs, batch norms, relus, add, pool, addmm), the views and the
    # batch norms' empty buffers do not; plus 6 parameter nodes, the input and the output: 20.
    assert 16 <= len(full["node"]) <= 26, full["node"]
    assert _lone_nodes(full) == set()
    assert {"in_4x3x32x32", "out0"} <= set(full["node"])
    blocks = svg_groups(tmp_path / "graph_blocks.svg")
    assert 8 <= len(blocks["node"]) < len(full["node"]) and _lone_nodes(blocks) == set()
    assert _width_px(tmp_path / "graph.svg") < 1600 and _width_px(tmp_path / "graph_blocks.svg") < 1600


@pytest.mark.slow
@pytest.mark.needs("dot")
def test_demo_merged_ddp_step_fits_4000_px(tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "examples" / "train_ddp.py"), "--out", str(out), "--steps", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    svg = out / "merged.svg"
    groups = svg_groups(svg)
    # Per rank: 3 Linear + 2 ReLU forward ops, the loss, ~27 backward and 6 optimizer ops, 2 all_reduces,
    # 3 parameter nodes, 2 inputs, 1 output (~44); two ranks, joined by 2 all_reduce edges.
    assert 60 <= len(groups["node"]) <= 120, len(groups["node"])
    assert _lone_nodes(groups) == set()
    assert {c for c in groups["cluster"] if c.endswith("_rank")} == {"cluster_s2r0_rank", "cluster_s2r1_rank"}
    assert _width_px(svg) <= 4000
