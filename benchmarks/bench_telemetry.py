"""Telemetry capture cost: a training step in a ``tl.capture()`` window against its floor and what users pick
instead, an armed training loop against a plain one, and the cost of closing a window on the training thread.

Everything is measured in this process, interleaved, and printed as ratios to the plain run of the same round
(medians over rounds, and the min):

1. Step (forward + backward + SGD) of the ResNet-18-like model, the 4-layer transformer (torch's
   ``nn.TransformerEncoder``) and a GPT-2-style decoder of user-code modules (``models.GPT``), the modes in a
   carryover-balanced order in each round (``orders.py``: over 10 rounds each mode follows each other twice):
   ``plain``; ``floor`` (a pass-through TorchDispatchMode, without torch's per-op Dynamo wrapper as tl_dist's
   mode: the least any dispatcher-level tracer costs); ``window`` (``tl.capture()``:
   per-op timing, FLOPs, phases, modules; nothing saved); ``stats`` (``tl.capture(stats=True)``: the same plus
   each output's statistics); ``profiler`` (``torch.profiler`` with ``record_shapes=True, with_flops=True`` plus ``key_averages()``).
   Targets: window <= 1.05x of the floor, and below the profiler; stats <= 1.5x the window.
2. A training loop armed with the shard writer, ``every=50``, against the same loop unarmed, loops alternated:
   target <= 1.01x.
3. Closing a window of 1,000 ops on the training thread (trace build + hand-off to the sinks): <= 3 ms;
   ``tl.telemetry.summarize`` of it: <= 5 ms.
4. Steps after a window: a loop armed with the shard writer captures one transformer step with ``stats=True``
   every 11 steps; the 5 steps after each window against the 5 before it (the sink worker summarises and
   writes the shard meanwhile). Target: <= 1.05x. The A/A line compares steps 6-10 before a window with the 5
   before it (no window in between): the noise floor.
5. Per module call and per op: microseconds the window adds over the floor (no target, the gauge of the two
   costs a step pays): a chain of 1,000 modules each running one small op with grad, against the same 1,000
   ops in one module; the module chain's extra over the flat chain is the cost of the global module hooks
   (two Python hooks per call: the module-call table, the call site, the module's output ops).

``--processes N`` runs part 1 in N fresh processes, one after another, and reports their rounds pooled (and
each process's window / floor): on this machine one process's figures at 40 rounds move 1.5-2.5 points from
the next's, and pooling fresh processes averages over what each one's memory layout contributes as well as
over rounds.

``--cpu`` times part 1 in the training thread's CPU time (``time.thread_time``) with one torch thread, so every
op runs on that thread: on a loaded shared machine far steadier than wall time, and still what the window adds
(its cost is all on that thread). glibc's malloc runs with fixed trim and mmap thresholds (``benchmarks/heap.py``);
``--default-heap`` keeps its moving defaults.

Run: ``OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_telemetry.py [--rounds 7] [--part 1 2 3 4 5] [--cpu]
[--processes 1] [--default-heap]``
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import heap  # noqa: E402
from models import GPT, ResNet18, transformer  # noqa: E402
from orders import balanced_orders  # noqa: E402

import tl_dist as tl  # noqa: E402


class PassThrough(TorchDispatchMode):
    # Without torch's per-op torch._disable_dynamo wrapper, as tl_dist's own mode (~1 us an op less): the least
    # a dispatcher-level tracer costs.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        return func(*args, **(kwargs or {}))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()
    opt.step()


_clock = time.perf_counter  # part 1's clock: time.thread_time with --cpu


def _run(mode: str, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    t0 = _clock()
    if mode == "plain":
        _step(model, opt, x)
    elif mode == "floor":
        with PassThrough():
            _step(model, opt, x)
    elif mode == "window":
        with tl.capture():
            _step(model, opt, x)
    elif mode == "stats":
        with tl.capture(stats=True):
            _step(model, opt, x)
    elif mode == "profiler":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
            _step(model, opt, x)
        prof.key_averages()
    return _clock() - t0


MODES = ("plain", "floor", "window", "stats", "profiler")


StepTimes = dict[str, dict[str, list[float]]]  # workload -> mode -> one time per round


def _step_times(rounds: int) -> StepTimes:
    """Part 1's measurement: each workload's modes, ``rounds`` rounds in carryover-balanced orders."""
    torch.manual_seed(0)
    workloads = {
        "resnet18": (ResNet18().train(), torch.randn(2, 3, 224, 224)),
        "transformer": (transformer().train(), torch.randn(4, 128, 256)),
        "gpt": (GPT().train(), torch.randint(0, 1000, (4, 128))),
    }
    result: StepTimes = {}
    for name, (model, x) in workloads.items():
        runs = {}
        for mode in MODES:  # one copy per mode: momentum buffers and BN statistics evolve alike
            mod = copy.deepcopy(model)
            runs[mode] = (mod, torch.optim.SGD(mod.parameters(), lr=1e-3, momentum=0.9))
        for mode in MODES:  # warm-up: the first dispatch-mode and profiler uses are slow
            _run(mode, *runs[mode], x)
            _run(mode, *runs[mode], x)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        orders = balanced_orders(MODES)  # each mode after each other equally often (orders.py)
        for r in range(rounds):
            for mode in orders[r % len(orders)]:
                times[mode].append(_run(mode, *runs[mode], x))
        result[name] = times
    return result


def _step_times_in_processes(rounds: int, processes: int, worker_args: list[str]) -> StepTimes:
    """Part 1 in ``processes`` fresh processes, one after another (they would share the cores), their rounds
    pooled (one process's figures move 1.5-2.5 points from the next's on this machine, more than a change worth
    measuring). Prints each process's window / floor medians."""
    pooled: StepTimes = {}
    for k in range(processes):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [sys.executable, os.path.abspath(__file__), "--part", "1", "--rounds", str(rounds)]
            subprocess.run(
                [*cmd, *worker_args, "--times-out", out.name], check=True, stdout=subprocess.DEVNULL
            )
            with open(out.name) as written:
                times: StepTimes = json.load(written)
        medians = "  ".join(
            f"{name} {statistics.median(w / f for w, f in zip(t['window'], t['floor'])):.3f}x"
            for name, t in times.items()
        )
        print(f"  process {k + 1} of {processes}, window / floor: {medians}")
        for name, by_mode in times.items():
            for mode, values in by_mode.items():
                pooled.setdefault(name, {}).setdefault(mode, []).extend(values)
    return pooled


def part_step(times: StepTimes) -> None:
    print("1. training step, ratio to the plain step of the same round (median, min)")
    for name, by_mode in times.items():
        ratio = {m: [t / p for t, p in zip(by_mode[m], by_mode["plain"])] for m in MODES}
        over_floor = [w / f for w, f in zip(by_mode["window"], by_mode["floor"])]
        stats_over = [s / w for s, w in zip(by_mode["stats"], by_mode["window"])]
        plain_ms = statistics.median(by_mode["plain"]) * 1e3
        cells = "  ".join(
            f"{m} {statistics.median(ratio[m]):.3f}x (min {min(ratio[m]):.3f})" for m in MODES[1:]
        )
        below_profiler = statistics.median(ratio["window"]) < statistics.median(ratio["profiler"])
        verdict = "ok" if statistics.median(over_floor) <= 1.05 and below_profiler else "MISSED"
        print(f"  {name}: plain {plain_ms:.1f} ms | {cells}")
        print(
            f"  {name}: window / floor median {statistics.median(over_floor):.3f}x "
            f"(min {min(over_floor):.3f}, {len(over_floor)} rounds); target <= 1.05x of the floor and below "
            f"the profiler: {verdict}"
        )
        med = statistics.median(stats_over)
        print(
            f"  {name}: stats / window median {med:.3f}x (min {min(stats_over):.3f}); target <= 1.5x: "
            f"{'ok' if med <= 1.5 else 'MISSED'}"
        )


def part_loop(rounds: int, steps: int) -> None:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).train()
    x = torch.randn(4, 64, 128)
    out = tempfile.mkdtemp(prefix="tl_bench_")

    def loop(armed: bool) -> float:
        mod = copy.deepcopy(model)
        opt = torch.optim.SGD(mod.parameters(), lr=1e-3)
        if armed:
            tl.arm(out, every=50)
        t0 = time.perf_counter()
        for s in range(steps):
            if armed and tl.should_capture(s):
                with tl.capture(step=s):
                    _step(mod, opt, x)
            else:
                _step(mod, opt, x)
        elapsed = time.perf_counter() - t0
        if armed:
            tl.disarm()  # flushing is after the loop: it is not the loop's time
        return elapsed

    loop(True)  # warm-up
    ratios = []
    for r in range(rounds):
        if r % 2:
            armed, plain = loop(True), loop(False)
        else:
            plain, armed = loop(False), loop(True)
        ratios.append(armed / plain)
    med = statistics.median(ratios)
    print(
        f"2. {steps}-step loop armed with the shard writer, every=50, vs unarmed: median {med:.3f}x "
        f"(min {min(ratios):.3f}, {rounds} rounds); target <= 1.01x: {'ok' if med <= 1.01 else 'MISSED'}"
    )


class Chain(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = torch.tanh(self.fc(x))
        return x


def part_close(rounds: int) -> None:
    model = Chain(333)  # t, addmm, tanh per block: 999 ops, and module calls
    x = torch.randn(2, 8)
    out = tempfile.mkdtemp(prefix="tl_bench_")
    tl.arm(out)
    closes, summaries, n_ops = [], [], 0
    for r in range(rounds + 1):
        cap = tl.capture(step=r)
        cap.__enter__()
        with torch.no_grad():
            model(x)
        t0 = time.perf_counter()
        cap.__exit__(None, None, None)
        close_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        tl.telemetry.summarize(cap.trace)
        summary_s = time.perf_counter() - t0
        n_ops = len(cap.trace)
        tl.flush()  # the shard writer works between windows, not during the next close
        if r:  # the first one warms caches
            closes.append(close_s * 1e3)
            summaries.append(summary_s * 1e3)
    tl.disarm()
    c, s = statistics.median(closes), statistics.median(summaries)
    print(
        f"3. window of {n_ops} ops: close on the training thread median {c:.2f} ms (min {min(closes):.2f}); "
        f"target <= 3 ms: {'ok' if c <= 3 else 'MISSED'}"
    )
    print(
        f"   summarize median {s:.2f} ms (min {min(summaries):.2f}); target <= 5 ms: {'ok' if s <= 5 else 'MISSED'}"
    )


def part_after(rounds: int) -> None:
    torch.manual_seed(0)
    model, x = transformer().train(), torch.randn(4, 128, 256)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    out = tempfile.mkdtemp(prefix="tl_bench_")
    tl.arm(out, options=tl.CaptureOptions(stats=True))
    period = 11  # steps 0-4: A/A reference, 5-9: before, 10: the window, then 0-4 of the next period: after
    times: list[float] = []
    for s in range(period * (rounds + 1) + 5):
        t0 = time.perf_counter()
        if s % period == period - 1:
            with tl.capture(step=s):
                _step(model, opt, x)
        else:
            _step(model, opt, x)
        times.append(time.perf_counter() - t0)
    stats = tl.sink_stats()
    tl.disarm()
    after, control = [], []
    for w in range(period * 2 - 1, len(times) - 5, period):  # the first period warms up
        before = statistics.median(times[w - 5 : w])
        after.append(statistics.median(times[w + 1 : w + 6]) / before)
        control.append(before / statistics.median(times[w - 10 : w - 5]))
    med = statistics.median(after)
    print(
        f"4. 5 steps after a stats=True window vs the 5 before ({len(after)} windows, shard writer busy "
        f"{stats.busy_s / max(1, stats.delivered) * 1e3:.0f} ms per window): median {med:.3f}x "
        f"(min {min(after):.3f}); A/A (5 before vs the 5 before those) {statistics.median(control):.3f}x; "
        f"target <= 1.05x: {'ok' if med <= 1.05 else 'MISSED'}"
    )


class _OneOp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0


class _ModuleChain(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_OneOp() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _FlatChain(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = x * 1.0
        return x


def part_modules(rounds: int) -> None:
    n = 1000
    x = torch.randn(2, requires_grad=True)
    models = {"modules": _ModuleChain(n), "flat": _FlatChain(n)}

    def timed(mode: str, model: torch.nn.Module) -> float:
        with PassThrough() if mode == "floor" else tl.capture():
            t0 = time.perf_counter()
            model(x)
            return time.perf_counter() - t0

    for name in models:  # warm-up
        timed("floor", models[name])
        timed("window", models[name])
    added: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds * 3):
        for name, model in models.items():
            added[name].append((timed("window", model) - timed("floor", model)) / n * 1e6)
    per_op = statistics.median(added["flat"])
    per_call = statistics.median(added["modules"]) - per_op
    print(
        f"5. the window over the floor: {per_op:.1f} us per op, {per_call:.1f} us more per module call "
        f"(chains of {n}, median of {rounds * 3} rounds)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=150, help="steps per loop in part 2")
    parser.add_argument("--part", type=int, nargs="*", default=[1, 2, 3, 4, 5])
    parser.add_argument("--cpu", action="store_true", help="part 1 in thread CPU time, one torch thread")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="part 1 in this many fresh processes, one after another, their rounds pooled",
    )
    parser.add_argument("--times-out", help=argparse.SUPPRESS)  # a --processes worker's part 1 times (JSON)
    parser.add_argument(
        "--default-heap",
        action="store_true",
        help="keep glibc's moving malloc thresholds (benchmarks/heap.py)",
    )
    args = parser.parse_args()
    print(f"heap: {heap.set_policy(sys.argv)}")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if 1 in args.part and args.processes > 1:
        worker_args = [
            flag for flag, on in (("--cpu", args.cpu), ("--default-heap", args.default_heap)) if on
        ]
        print(f"part 1 in {args.processes} processes of {args.rounds} rounds, pooled")
        part_step(_step_times_in_processes(args.rounds, args.processes, worker_args))
    elif 1 in args.part:
        global _clock
        if args.cpu:
            _clock = time.thread_time
            torch.set_num_threads(1)
            print("part 1 in the training thread's CPU time, 1 torch thread")
        times = _step_times(args.rounds)
        if args.times_out:  # a worker of --processes: the parent reports
            with open(args.times_out, "w") as out:
                json.dump(times, out)
            return
        part_step(times)
        _clock = time.perf_counter
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if 2 in args.part:
        part_loop(max(3, args.rounds // 2), args.steps)
    if 3 in args.part:
        part_close(args.rounds * 3)
    if 4 in args.part:
        part_after(args.rounds)
    if 5 in args.part:
        part_modules(args.rounds)


if __name__ == "__main__":
    main()
