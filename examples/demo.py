"""tl_dist demo: trace a small CNN, print its summary, draw its graph, export its op table, query it.

Run with ``make demo`` (or ``.venv/bin/python examples/demo.py [--out DIR]``). Writes ``out/demo/graph.svg``,
``out/demo/graph_blocks.svg`` (module calls below depth 1 collapsed) and ``out/demo/ops.csv``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

import tl_dist as tl

OUT = Path(__file__).resolve().parent.parent / "out" / "demo"


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + x)


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.block = ResidualBlock(16)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.block(self.stem(x))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"output folder (default {OUT})")
    out = parser.parse_args().out
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(4, 3, 32, 32)

    with torch.no_grad():
        trace = tl.trace(model, x)
    print(f"{trace!r}\n")
    print(trace.summary(top=5))

    out.mkdir(parents=True, exist_ok=True)
    csv = out / "ops.csv"
    trace.to_pandas().to_csv(csv, index=False)
    try:
        graph = trace.draw(out / "graph.svg")
        blocks = trace.draw(out / "graph_blocks.svg", depth=1)
        print(f"\nwrote {graph}, {blocks} and {csv}\n")
    except tl.MissingToolError as exc:
        print(f"\nwrote {csv}; skipped the pictures: {exc}\n")

    relu = trace["relu_2"]
    print(f'trace["relu_2"]: {relu!r}; .out.shape = {tuple(relu.out.shape)}, parents = {relu.parents}')
    expected = torch.relu(model.block.bn1(model.block.conv1(model.stem(x))))
    print(f"  equals recomputing block.conv1 -> bn1 -> relu: {torch.equal(relu.out, expected)}")
    in_block = trace.select(tl.func("relu") & tl.in_module("block"))
    print(f'relu ops inside "block": {[op.label for op in in_block]}')
    big = trace.select(tl.where(lambda op: op.flops > 1e6))
    print(f"ops over 1 MFLOP: {[(op.label, op.module, op.flops) for op in big]}")
    logits = trace.module("classifier").out
    print(
        f"classifier output {tuple(logits.shape)} equals the model's output: {torch.equal(logits, trace.output)}"
    )


if __name__ == "__main__":
    main()
