"""A zoo of small models built from plain torch.nn, each with hand-computed selector expectations.

Every entry builds ``(model, args, kwargs)`` for ``tl.trace(model, args, kwargs=kwargs)``; models are in eval
mode or otherwise deterministic so a traced forward and a plain forward agree exactly. ``selections`` lists
``(selector, expected)`` pairs; ``expected`` is either the exact list of labels the selector picks or a count.
Sizes are tiny: the whole zoo runs in seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import tl_dist as tl

# Ops whose output is memory nothing wrote yet (autograd's new_empty_strided in backward): the same bytes may
# hold zeros in two runs and not in a third, so tests that compare values between runs skip them.
UNINITIALIZED_FUNCS = frozenset(
    {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}
)

# --------------------------------------------------------------------------------------------------- models


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + x)


class ResCNN(nn.Module):
    """Stem conv + two residual blocks with BatchNorm + pooled linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(ResBlock(8), ResBlock(8))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        x = self.pool(self.blocks(x)).flatten(1)
        return self.fc(x)


class TorchEncoder(nn.Module):
    """nn.TransformerEncoderLayer (dropout 0) followed by a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))


class HandAttention(nn.Module):
    """Single-head attention written by hand: projections, einsum scores, softmax, einsum mix, layernorm."""

    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.scale = d**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = torch.einsum("bqd,bkd->bqk", q, k) * self.scale
        attn = scores.softmax(dim=-1)
        mixed = torch.einsum("bqk,bkd->bqd", attn, v)
        return self.norm(x + mixed)


class LSTMNet(nn.Module):
    """nn.LSTM over a sequence; returns the last step through a linear and the LSTM's (h, c) state."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 10, batch_first=True)
        self.fc = nn.Linear(10, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        out, (h, c) = self.lstm(x)
        return self.fc(out[:, -1]), (h, c)


class LoopRNN(nn.Module):
    """A Python-loop Elman RNN: the same two linears are called once per time step."""

    def __init__(self, steps: int = 4) -> None:
        super().__init__()
        self.steps = steps
        self.inp = nn.Linear(5, 7)
        self.rec = nn.Linear(7, 7, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 7)
        for t in range(self.steps):
            h = torch.tanh(self.inp(x[:, t]) + self.rec(h))
        return h


class DataBranch(nn.Module):
    """Takes a different submodule depending on the data (sum of the input)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Linear(4, 4)
        self.neg = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return torch.relu(self.pos(x))
        return self.neg(x)


class InPlace(nn.Module):
    """add_, relu_, mul_ and item assignment (fill_ / copy_ into views) on intermediates."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        # add_ before relu_: relu's backward reads its output, which must not be overwritten afterwards
        y.add_(1.0)
        y.relu_()
        z = y * 2
        z[:, 0] = -1.0
        z[1] = y[0]
        z.mul_(0.5)
        return z + y


class Twice(nn.Module):
    """One linear called twice; its output feeds its second call."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(5, 5)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(self.act(self.shared(x)))


class Buffers(nn.Module):
    """Reads a constant buffer and updates a step counter buffer in place, as running statistics do."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 6))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        return self.fc(x * self.scale)


class TupleDictIO(nn.Module):
    """Positional tuple input, keyword tensor and dict inputs; returns a dict holding a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(
        self,
        pair: tuple[torch.Tensor, torch.Tensor],
        other: torch.Tensor,
        *,
        scale: torch.Tensor,
        extra: dict,
    ) -> dict[str, Any]:
        left, right = pair
        s = self.a(left) * scale
        d = self.b(right + other) - extra["shift"]
        return {"sum": s + d, "parts": (s, d)}


class ClampSTE(torch.autograd.Function):
    """Clamp to [-1, 1] forward; straight-through gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-1.0, 1.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class CustomFn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ClampSTE.apply(self.fc(x) * 3.0).sum(-1)


class EmbedLN(nn.Module):
    """Token embedding + layernorm + linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 20)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.emb(tokens)))


class ChunkCat(nn.Module):
    """Split features in three chunks, a different linear per chunk, concatenate."""

    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList([nn.Linear(3, 2) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = x.chunk(3, dim=1)
        return torch.cat([f(p) for f, p in zip(self.branches, parts)], dim=1)


class SeqConv1d(nn.Module):
    """Conv1d + GELU + max-pool stack over a sequence, then a mean over time."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(4, 8, 3, padding=1), nn.GELU(), nn.MaxPool1d(2), nn.Conv1d(8, 8, 3), nn.GELU()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).mean(-1)


class MHA(nn.Module):
    """nn.MultiheadAttention returning (output, averaged weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attn(x, x, x, need_weights=True)


class TinyUNet(nn.Module):
    """Down conv, up transposed conv, skip connection by concatenation, ModuleDict heads."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(4, 2, 2, stride=2)
        self.heads = nn.ModuleDict({"seg": nn.Conv2d(4, 3, 1), "aux": nn.Conv2d(4, 1, 1)})

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        skip = torch.cat([x, self.up(torch.relu(self.down(x)))], dim=1)
        return {name: head(skip) for name, head in self.heads.items()}


# ---------------------------------------------------------------------------------------------------- entries


@dataclass
class Entry:
    """One zoo model: how to build it and inputs, and what selectors must pick from its trace."""

    name: str
    build: Callable[[], tuple[nn.Module, tuple, dict]]
    # (selector, expected labels or expected count), checked against the grad-enabled and no_grad traces.
    selections: Callable[[], list[tuple[tl.Selector, list[str] | int]]] = lambda: []
    # Selections that differ between grad-enabled and no_grad traces (fast paths, fused kernels).
    selections_no_grad: Callable[[], list[tuple[tl.Selector, list[str] | int]]] | None = None


def _eval(model: nn.Module) -> nn.Module:
    return model.eval()


def _rescnn() -> list:
    return [
        # torch.relu after the stem + ReLU(inplace) twice per block x 2 blocks = 1 + 4
        (tl.func("relu"), 5),
        (tl.func("relu") & tl.in_module("blocks"), 4),
        (tl.func("relu") & ~tl.in_module("blocks"), ["relu_1"]),
        (tl.func("convolution"), 5),  # stem + 2 per block
        (tl.func("convolution") & tl.in_module("blocks.1"), ["convolution_4", "convolution_5"]),
        (tl.module("blocks.0"), ["relu__2"]),  # the block's second (final) relu call
        (tl.module("blocks.0.relu"), ["relu__1", "relu__2"]),  # one ReLU module, called twice
        (tl.module("blocks"), ["relu__4"]),
        (tl.module("fc"), ["addmm_1"]),
        (tl.func("native_batch_norm"), 4),
        (tl.label("convolution_1") | tl.label("addmm_1"), ["convolution_1", "addmm_1"]),
        (tl.where(lambda op: op.func == "add" and op.module == "blocks.1"), ["add_2"]),
    ]


def _encoder() -> list:
    # Autograd path: in_proj is one packed mm (+ bias add); out_proj, linear1, linear2 and head are addmm.
    return [
        (tl.func("addmm"), 4),
        (tl.func("addmm") & tl.in_module("layer"), 3),
        (tl.func("mm") & tl.in_module("layer.self_attn"), ["mm_1"]),
        (tl.func("_scaled_dot_product_flash_attention_for_cpu"), 1),
        (tl.func("native_layer_norm"), ["native_layer_norm_1", "native_layer_norm_2"]),
        (tl.module("layer.norm2"), ["native_layer_norm_2"]),
        (tl.module("layer"), ["native_layer_norm_2"]),
        (tl.func("relu"), ["relu_1"]),  # the feed-forward activation (functional relu, inside "layer")
    ]


def _encoder_no_grad() -> list:
    # Inference fast path: the whole encoder layer is one fused op; its submodules are never called.
    return [
        (tl.in_module("layer"), ["_transformer_encoder_layer_fwd_1"]),
        (tl.module("layer"), ["_transformer_encoder_layer_fwd_1"]),
        (tl.in_module("layer.self_attn"), 0),
        (tl.func("addmm"), ["addmm_1"]),
    ]


def _hand_attention() -> list:
    return [
        (tl.func("addmm"), 3),  # q, k, v projections
        (tl.in_module("q") | tl.in_module("k") | tl.in_module("v"), 12),  # view, t, addmm, view each
        (tl.module("q"), ["view_2"]),
        (tl.func("bmm"), ["bmm_1", "bmm_2"]),  # the two einsums
        (tl.func("_softmax"), ["_softmax_1"]),
        (tl.where(lambda op: op.func == "mul" and op.module == ""), ["mul_1"]),  # * scale
        (tl.module("norm"), ["native_layer_norm_1"]),
        (tl.module(""), ["native_layer_norm_1"]),
    ]


def _lstm() -> list:
    return [
        (tl.func("mkldnn_rnn_layer"), 1),  # one layer, one direction
        (tl.func("zeros") & tl.in_module("lstm"), 2),  # h0, c0
        # output (out, (h, c)): out is transposed back to batch-first, h and c stacked over layers
        (tl.module("lstm"), ["stack_1", "stack_2", "transpose_2"]),
        (tl.module("fc"), ["addmm_1"]),
        (tl.in_module("fc"), ["t_1", "addmm_1"]),
    ]


def _loop_rnn() -> list:
    steps = ["1", "2", "3", "4"]
    return [
        (tl.module("inp"), [f"addmm_{i}" for i in steps]),  # one call per time step
        (tl.module("rec"), [f"mm_{i}" for i in steps]),  # no bias: mm, not addmm
        (tl.func("tanh"), 4),
        ((tl.func("addmm") | tl.func("mm")) & ~tl.in_module("inp"), [f"mm_{i}" for i in steps]),
        (tl.module(""), ["tanh_4"]),
        (tl.func("select"), 4),  # x[:, t]
    ]


def _branch_pos() -> list:
    return [
        (tl.in_module("neg"), 0),
        (tl.in_module("pos"), ["t_1", "addmm_1"]),
        (tl.func("relu"), ["relu_1"]),
        (tl.module(""), ["relu_1"]),
        (tl.func("sum") | tl.func("gt"), ["sum_1", "gt_1"]),  # the branch condition
    ]


def _branch_neg() -> list:
    return [
        (tl.in_module("pos"), 0),
        (tl.module("neg"), ["sigmoid_1"]),
        (tl.module("neg.0"), ["addmm_1"]),
        (tl.func("relu"), 0),
    ]


def _inplace() -> list:
    return [
        (tl.func("relu"), ["relu__1"]),
        (tl.where(lambda op: op.inplace), ["add__1", "relu__1", "fill__1", "copy__1", "mul__1"]),
        (tl.func("mul"), ["mul_1", "mul__1"]),
        (tl.func("add") & ~tl.where(lambda op: op.inplace), ["add_1"]),
        # y[0] (read) then z[1] (written): the right-hand side is evaluated first
        (tl.func("select"), ["select_1", "select_2", "select_3"]),
        (tl.module("fc"), ["addmm_1"]),
        (tl.module(""), ["add_1"]),
    ]


def _twice() -> list:
    return [
        (tl.module("shared"), ["addmm_1", "addmm_2"]),
        (tl.module("shared") & ~tl.module(""), ["addmm_1"]),
        (tl.in_module("act"), ["gelu_1"]),
        (tl.func("t"), 2),  # the weight is transposed once per call
    ]


def _buffers() -> list:
    return [
        (tl.where(lambda op: "steps" in op.params), ["add__1"]),
        (tl.where(lambda op: "scale" in op.params), ["mul_1"]),
        (tl.where(lambda op: "fc.weight" in op.params), ["t_1"]),
        (tl.module("fc"), ["addmm_1"]),
    ]


def _tuple_dict() -> list:
    return [
        # output {"sum": s + d, "parts": (s, d)}: leaves in pytree order sum, s, d; selection in op order
        (tl.module(""), ["mul_1", "sub_1", "add_2"]),
        (tl.in_module("b"), ["t_2", "addmm_2"]),
        (tl.func("add"), ["add_1", "add_2"]),
        (tl.func("mul") | tl.func("sub"), ["mul_1", "sub_1"]),
    ]


def _custom_fn() -> list:
    return [
        (tl.func("clamp"), ["clamp_1"]),  # ClampSTE.forward's body is recorded like any other op
        (tl.where(lambda op: op.module == ""), ["mul_1", "clamp_1", "sum_1"]),
        (tl.module(""), ["sum_1"]),
    ]


def _embed_ln() -> list:
    return [
        (tl.module("emb"), ["embedding_1"]),
        (tl.where(lambda op: op.params == ("emb.weight",)), ["embedding_1"]),
        (tl.module("norm"), ["native_layer_norm_1"]),
        (tl.in_module("out"), 4),  # 3-D input: view, t, addmm, view
        (tl.module("out"), ["view_2"]),
    ]


def _chunk_cat() -> list:
    return [
        (tl.func("split"), ["split_1"]),  # chunk
        (tl.in_module("branches"), 6),
        (tl.module("branches.1"), ["addmm_2"]),
        (tl.in_module("branches.2") & tl.func("addmm"), ["addmm_3"]),
        (tl.module(""), ["cat_1"]),
    ]


def _seq_conv() -> list:
    return [
        (tl.func("gelu"), ["gelu_1", "gelu_2"]),
        (tl.in_module("net.2"), 4),  # max_pool1d = unsqueeze, 2-D pool, squeeze of values and of indices
        (tl.module("net.2"), ["squeeze_1"]),
        (tl.module("net"), ["gelu_2"]),
        (tl.module(""), ["mean_1"]),
    ]


def _mha() -> list:
    return [
        (tl.func("bmm"), 2),  # scores and mix
        (tl.func("_softmax"), ["_softmax_1"]),
        (tl.module("attn"), ["mean_1", "transpose_8"]),  # head-averaged weights, output
    ]


def _mha_no_grad() -> list:
    return [(tl.module("attn"), ["_native_multi_head_attention_1"]), (tl.func("bmm"), 0)]


def _unet() -> list:
    return [
        (tl.func("convolution"), 4),  # down, transposed up, two heads
        (tl.module("up"), ["convolution_2"]),
        (tl.module("heads.seg"), ["convolution_3"]),
        (tl.in_module("heads"), ["convolution_3", "convolution_4"]),
        (tl.module(""), ["convolution_3", "convolution_4"]),
        (tl.func("cat"), ["cat_1"]),
    ]


def _tuple_dict_inputs() -> tuple[nn.Module, tuple, dict]:
    pair = (torch.randn(2, 4), torch.randn(2, 4))
    kwargs = {"scale": torch.randn(3), "extra": {"shift": torch.randn(3)}}
    return TupleDictIO(), (pair, torch.randn(2, 4)), kwargs


ZOO: list[Entry] = [
    Entry("rescnn", lambda: (_eval(ResCNN()), (torch.randn(2, 3, 8, 8),), {}), _rescnn),
    Entry(
        "torch_encoder",
        lambda: (_eval(TorchEncoder()), (torch.randn(2, 5, 16),), {}),
        _encoder,
        selections_no_grad=_encoder_no_grad,
    ),
    Entry("hand_attention", lambda: (HandAttention(), (torch.randn(2, 5, 12),), {}), _hand_attention),
    Entry("lstm", lambda: (LSTMNet(), (torch.randn(2, 4, 6),), {}), _lstm),
    Entry("loop_rnn", lambda: (LoopRNN(), (torch.randn(3, 4, 5),), {}), _loop_rnn),
    Entry("branch_pos", lambda: (DataBranch(), (torch.ones(2, 4),), {}), _branch_pos),
    Entry("branch_neg", lambda: (DataBranch(), (-torch.ones(2, 4),), {}), _branch_neg),
    Entry("inplace", lambda: (InPlace(), (torch.randn(3, 6),), {}), _inplace),
    Entry("twice", lambda: (Twice(), (torch.randn(2, 5),), {}), _twice),
    Entry("buffers", lambda: (Buffers(), (torch.randn(2, 6),), {}), _buffers),
    Entry("tuple_dict_io", _tuple_dict_inputs, _tuple_dict),
    Entry("custom_function", lambda: (CustomFn(), (torch.randn(3, 4),), {}), _custom_fn),
    Entry("embed_layernorm", lambda: (EmbedLN(), (torch.randint(0, 20, (2, 5)),), {}), _embed_ln),
    Entry("chunk_cat", lambda: (ChunkCat(), (torch.randn(2, 9),), {}), _chunk_cat),
    Entry("seq_conv1d", lambda: (SeqConv1d(), (torch.randn(2, 4, 10),), {}), _seq_conv),
    Entry(
        "multihead_attention",
        lambda: (_eval(MHA()), (torch.randn(2, 5, 8),), {}),
        _mha,
        selections_no_grad=_mha_no_grad,
    ),
    Entry("tiny_unet", lambda: (TinyUNet(), (torch.randn(1, 2, 8, 8),), {}), _unet),
]
