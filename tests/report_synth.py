"""A synthetic data-parallel run for report tests and benchmarks: every rank trains the same stack of Linear +
ReLU layers; backward ops link to their forward ops (``fwd_op``), each group of layers' gradients is all-reduced
(blocking, completing when the last rank arrives + a transfer time), and optimizer ``add_`` ops update each
parameter. One rank is slower (the straggler); ``nan_at`` plants a NaN in one rank's statistics."""

from __future__ import annotations

import random

from tl_dist.merge.build import build
from tl_dist.merge.sources import TraceSource
from tl_dist.schema import COLLECTIVE_FIELDS, EMPTY_VALUE, OP_FIELDS, STAT_FIELDS, empty_columns
from tl_dist.trace import Trace

T0 = 1_700_000_000_000_000_000


class _Builder:
    def __init__(self, rank: int, world_size: int, step: int, t: int) -> None:
        self.rank, self.world_size, self.step, self.t = rank, world_size, step, t
        self.rows: list[dict] = []
        self.counts: dict[str, int] = {}
        self.ct = empty_columns(COLLECTIVE_FIELDS)
        self.stats = empty_columns(STAT_FIELDS)

    def op(
        self, func, kind, phase, dur, *, call=-1, module="", parents=(), params=(), fwd=-1, flops=0, nbytes=0
    ):
        self.counts[func] = self.counts.get(func, 0) + 1
        row = {f.name: EMPTY_VALUE[f.kind] for f in OP_FIELDS}
        row.update(
            index=len(self.rows), label=f"{func}_{self.counts[func]}", func=func, aten=f"aten.{func}.default"
        )
        row.update(
            kind=kind, phase=phase, fwd_op=fwd, module=module, module_call=call, parents=tuple(parents)
        )
        row.update(params=tuple(params), flops=flops, out_bytes=nbytes, start_ns=self.t, duration_ns=dur)
        row.update(source="train.py:42", dtype="float32", device="cpu", out_shapes=((64, 256),))
        self.rows.append(row)
        self.t += dur + 2_000
        return row["index"]

    def trace(self, module_table: dict) -> Trace:
        columns = {f.name: [r[f.name] for r in self.rows] for f in OP_FIELDS}
        meta = {"rank": self.rank, "world_size": self.world_size, "step": self.step, "complete": True}
        # 8 ranks a host, as an armed capture records them: ranks of one host and boot share a clock.
        host = f"node{self.rank // 8}"
        meta.update(host=host, boot_id=f"boot-of-{host}", torch_version="2.13.0+cpu")
        return Trace(columns, module_table, collective_table=self.ct, metadata=meta, stats_table=self.stats)


def synthetic_run(
    world_size: int = 64, steps: int = 20, layers: int = 16, *, straggler: int = 3, nan_at=None
):
    """A merged run of ``world_size`` ranks x ``steps`` steps, built in memory (``merge.build.build``).

    Returns ``(MergedTrace, {(step, rank): Trace})``. ``nan_at=(step, rank)`` records a NaN in the gradient
    statistics of that rank's first ReLU at that step."""
    rng = random.Random(0)
    mods = {"address": [""], "type": ["Net"], "call": [0], "parent": [-1], "depth": [0], "first_op": [0]}
    mods.update(end_op=[0], out_ops=[()], out_pos=[()], source=["train.py:40"])
    for k in range(layers):
        for key, value in zip(mods, (f"layers.{k}", "Linear", 0, 0, 1, 0, 0, (), (), "train.py:40")):
            mods[key].append(value)
    traces = {}
    per_bucket = 4
    for step in range(steps):
        builders = [
            _Builder(r, world_size, step, T0 + step * 10**9 + rng.randrange(50_000))
            for r in range(world_size)
        ]
        slow = [3.0 if r == straggler else 1.0 + 0.1 * rng.random() for r in range(world_size)]
        fwd_ops: list[list[tuple[int, int, int]]] = [[] for _ in range(world_size)]
        for r, b in enumerate(builders):
            prev = ()
            for k in range(layers):
                call, addr = k + 1, f"layers.{k}"
                w = b.op("t", "view", "forward", 800, call=call, module=addr, params=(f"{addr}.weight",))
                a = b.op(
                    "addmm",
                    "compute",
                    "forward",
                    int(40_000 * slow[r]),
                    call=call,
                    module=addr,
                    parents=(*prev, w),
                    params=(f"{addr}.bias",),
                    flops=2 * 64 * 256 * 256,
                    nbytes=65536,
                )
                u = b.op(
                    "relu",
                    "compute",
                    "forward",
                    int(6_000 * slow[r]),
                    call=call,
                    module=addr,
                    parents=(a,),
                    nbytes=65536,
                )
                fwd_ops[r].append((w, a, u))
                prev = (u,)
                for of, norm in (("out", 10.0 + k + 0.01 * step), ("grad", 0.5 / (k + 1))):
                    nan = int(nan_at == (step, r) and k == 0 and of == "grad")
                    for name, value in zip(
                        b.stats, (u, of, len(b.rows), 0.1, 1.0, -1.0, 1.0, norm, 0.5, nan, 0)
                    ):
                        b.stats[name].append(value)
            b.op("mse_loss", "compute", "forward", 5_000, parents=prev, nbytes=4)
        # Backward, layer by layer from the last; gradients of each group of layers all-reduced together.
        grads: list[dict[int, int]] = [{} for _ in range(world_size)]
        seq = 0
        for k in reversed(range(layers)):
            for r, b in enumerate(builders):
                w, a, u = fwd_ops[r][k]
                addr = f"layers.{k}"
                tb = b.op(
                    "threshold_backward", "compute", "backward", int(7_000 * slow[r]), parents=(u,), fwd=u
                )
                b.op(
                    "mm",
                    "compute",
                    "backward",
                    int(40_000 * slow[r]),
                    parents=(tb, w),
                    fwd=a,
                    flops=2 * 64 * 256 * 256,
                )
                gw = b.op(
                    "mm",
                    "compute",
                    "backward",
                    int(40_000 * slow[r]),
                    parents=(tb,),
                    fwd=a,
                    flops=2 * 64 * 256 * 256,
                )
                gb = b.op("sum", "compute", "backward", 4_000, parents=(tb,), fwd=a)
                grads[r][k] = gw
                grads[r][-k - 1] = gb
            if k % per_bucket == 0:
                seq += 1
                arrivals = [b.t for b in builders]
                done = max(arrivals) + 300_000
                for r, b in enumerate(builders):
                    start = b.t
                    op = b.op("all_reduce", "collective", "backward", done - start, parents=(grads[r][k],))
                    values = dict(
                        op=op,
                        func="all_reduce",
                        group_ranks=tuple(range(world_size)),
                        group_name="0",
                        group_desc="default_pg",
                        seq=seq,
                        reduce_op="sum",
                        root=-1,
                        peer=-1,
                        in_numel=65536 * per_bucket,
                        out_numel=65536 * per_bucket,
                        dtype="float32",
                        bytes=262144 * per_bucket,
                        is_async=False,
                        issue_ns=start,
                        complete_ns=done,
                        state="completed",
                        bucket=seq - 1,
                        backend="gloo",
                    )
                    for name in b.ct:
                        b.ct[name].append(
                            values.get(
                                name, EMPTY_VALUE[next(f.kind for f in COLLECTIVE_FIELDS if f.name == name)]
                            )
                        )
        for r, b in enumerate(builders):
            for k in range(layers):
                addr = f"layers.{k}"
                b.op(
                    "add_", "compute", "optimizer", 3_000, parents=(grads[r][k],), params=(f"{addr}.weight",)
                )
                b.op(
                    "add_",
                    "compute",
                    "optimizer",
                    1_000,
                    parents=(grads[r][-k - 1],),
                    params=(f"{addr}.bias",),
                )
            table = {key: list(v) for key, v in mods.items()}
            table["end_op"] = [3 * layers] + [3 * (k + 1) for k in range(layers)]
            table["first_op"] = [0] + [3 * k for k in range(layers)]
            table["out_ops"] = [(3 * layers - 1,)] + [(3 * k + 2,) for k in range(layers)]
            table["out_pos"] = [(0,)] * (layers + 1)
            traces[(step, r)] = b.trace(table)
    g = build(TraceSource(traces), sorted(traces), world_size=world_size, strict=True)
    return g, traces
