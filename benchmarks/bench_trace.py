"""Trace overhead benchmark (issue 2, Performance): tl.trace against a plain forward, in one process.

Workloads (``benchmarks/models.py``; CPU, 2 threads, eval, no_grad): ResNet-18 layout 2x3x224x224, a 4-layer
TransformerEncoder d=256 h=4 ff=1024 on 4x128, an MLP 784-1024-1024-1024-10 on 64.

Method (DESIGN.md, "Benchmarks on a shared 2-core machine"):

1. After-trace check (target <= 1.02x): two fresh worker processes take turns timing the same plain forward;
   one of them then traces every model once and the turns go on. The change of the traced/control ratio is
   what a finished trace leaves behind, with the shared machine's load drift cancelled (see
   ``after_trace_check``).
2. Overhead: warm-up, then rounds of ``plain, trace(save=True), trace(save=None), plain`` per model; each
   traced time is divided by the faster of the two plain times around it. Median and min over rounds.
3. Microseconds per op on a chain of 5000 tiny adds, ``to_pandas()`` on the ResNet trace.

Every measurement is the fastest of 3 blocks, each repeating the call enough times to last ~30 ms, so
millisecond models are not timer noise and a neighbour's burst on the shared cores is mostly filtered out.
``OMP_WAIT_POLICY=PASSIVE`` is set before torch loads: spinning OpenMP workers distort shared-core timings.

glibc's malloc runs with fixed trim and mmap thresholds (``benchmarks/heap.py``: with its moving defaults,
whether freeing a trace's saved outputs returns the heap's top to the kernel depends on earlier frees, and the
next forward's page faults land on whichever function runs next); ``--default-heap`` keeps the defaults.

Run: ``.venv/bin/python benchmarks/bench_trace.py [--quick] [--profile] [--default-heap]``. If ``torchlens`` is importable it
is measured the same way (same calibrated repetitions, fastest of 3 blocks, plain forwards bracketing each
traced one, warm ``to_pandas``) in a subprocess, and shown beside ours; otherwise its column says "not
installed" (it is not a dependency of tl_dist). Every figure printed is measured in that run.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import heap  # noqa: E402
import models  # noqa: E402

import tl_dist as tl  # noqa: E402

# Targets of issue 2 (set from TorchLens 2.36.1 on these workloads, all activations saved: 5.4x, 8.6x, 15.7x).
TARGETS = {"resnet18": 1.3, "transformer": 1.5, "mlp": 2.5}
AFTER_TARGET = 1.02
BLOCKS = 3


def timed(fn: Callable[[], object], reps: int) -> float:
    """Seconds per call of ``fn``, over ``reps`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def best_of(fn: Callable[[], object], reps: int, blocks: int = BLOCKS) -> float:
    """The fastest of ``blocks`` measurements of ``reps`` calls: other processes on the shared cores only ever
    add time, so the minimum is the least disturbed estimate of one measurement."""
    return min(timed(fn, reps) for _ in range(blocks))


def calibrate(fn: Callable[[], object], *, target_s: float = 0.03) -> int:
    """How many calls of ``fn`` last about ``target_s`` (at least 1)."""
    fn()
    one = timed(fn, 3)
    return max(1, round(target_s / one))


def plain_fn(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad():
            return model(x)

    return run


def trace_fn(model: torch.nn.Module, x: torch.Tensor, save: object) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad():
            return tl.trace(model, x, save=save)

    return run


def plain_worker() -> None:
    """Subprocess side of the after-trace check. Answers ``plain NAME REPS`` with the seconds of one plain
    forward (best of 3 blocks), ``trace all|none`` by tracing every workload once with save=True|None; stops
    at ``quit``."""
    torch.set_num_threads(2)
    work = models.workloads()
    for model, x in work.values():
        timed(plain_fn(model, x), 3)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "plain":
            model, x = work[cmd[1]]
            print(best_of(plain_fn(model, x), int(cmd[2])), flush=True)
        elif cmd[0] == "trace":
            save = {"all": True, "none": None}[cmd[1]]
            for model, x in work.values():
                trace_fn(model, x, save)()
            gc.collect()
            print("done", flush=True)
        else:
            return


def after_trace_check(
    names: list[str], reps: dict[str, int], rounds: int, *, save: str = "all"
) -> dict[str, dict[str, float]]:
    """How much slower a plain forward is after one trace than before any trace, in the same process.

    A 2% effect drowns in the load drift of a shared machine between a "before" and an "after" phase, so two
    fresh worker processes run in lockstep: ``traced`` and ``control`` take turns (order alternating per
    round) measuring the same forward, and each round yields ``traced / control``. Then ``traced`` runs one
    trace of every model and the rounds repeat. ``after`` = median ratio after / median ratio before; drift
    hits both workers alike and cancels. ``control`` is the same statistic between the two halves of the
    before-phase (no trace in between): the noise floor.
    """
    cmd = [sys.executable, __file__, "--plain-worker"]
    workers = {
        role: subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for role in ("traced", "control")
    }

    def read(role: str) -> str:
        line = workers[role].stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker {role!r} exited (rc={workers[role].poll()})")
        return line.strip()

    def ask(role: str, line: str) -> str:
        workers[role].stdin.write(line + "\n")
        workers[role].stdin.flush()
        return read(role)

    def phase() -> dict[str, list[float]]:
        ratios: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names:
                order = ("traced", "control") if r % 2 == 0 else ("control", "traced")
                t = {role: float(ask(role, f"plain {name} {reps[name]}")) for role in order}
                ratios[name].append(t["traced"] / t["control"])
        return ratios

    try:
        for role in workers:
            read(role)  # "ready"
        before = phase()
        ask("traced", f"trace {save}")
        after = phase()
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.stdin.write("quit\n")
                proc.stdin.close()
                proc.wait(timeout=60)
    result = {}
    half = rounds // 2
    for name in names:
        b, a = before[name], after[name]
        result[name] = {
            "after": statistics.median(a) / statistics.median(b),
            "control": statistics.median(b[half:]) / statistics.median(b[:half]),
        }
    return result


def _python_calls(model: torch.nn.Module, x: torch.Tensor) -> Counter:
    """Every Python and C function call one plain forward makes, counted by (event, file, function)."""
    calls: Counter = Counter()

    def profiler(frame: object, event: str, arg: object) -> None:
        if event in ("call", "c_call"):
            code = frame.f_code
            calls[(event, code.co_filename, code.co_name, getattr(arg, "__qualname__", ""))] += 1

    with torch.no_grad():
        sys.setprofile(profiler)
        try:
            model(x)
        finally:
            sys.setprofile(None)
    return calls


def _process_state() -> dict[str, str]:
    """Process-wide state a tracer could leave behind, by name: dispatcher thread-locals, mode stacks, grad
    mode, profiler/tracer functions, the gc switch, and every global hook dict of ``torch.nn.Module`` (found by
    name, so hook kinds added by later torch versions are compared too)."""
    state = {
        "dispatch TLS include set": repr(torch._C._dispatch_tls_local_include_set()),
        "dispatch TLS exclude set": repr(torch._C._dispatch_tls_local_exclude_set()),
        "torch dispatch mode stack": str(torch._C._len_torch_dispatch_stack()),
        "torch function mode stack": str(torch._C._len_torch_function_stack()),
        "torch function enabled": str(torch._C._is_torch_function_mode_enabled()),
        "grad mode": str(torch.is_grad_enabled()),
        "sys.getprofile / gettrace": repr((sys.getprofile(), sys.gettrace())),
        "gc enabled": str(gc.isenabled()),
    }
    nn_module = torch.nn.modules.module
    for name, value in sorted(vars(nn_module).items()):
        if name.startswith("_global_") and isinstance(value, dict):
            state[f"nn.Module {name}"] = repr(list(value.values()))
    return state


def leftover_check(work: dict) -> tuple[dict[str, tuple[int, int, int]], dict[str, str], dict[str, tuple]]:
    """Deterministic complement of the timed after-trace check, run before any trace in this process: the
    calls a plain forward makes (sys.setprofile) and the process state (:func:`_process_state`), before and
    after one trace of every workload.

    Returns (name -> (calls before, calls after, distinct call sites whose count changed), the state compared,
    item -> (before, after) for every item of it that changed).
    """
    for model, x in work.values():
        plain_fn(model, x)()
    before = {name: _python_calls(model, x) for name, (model, x) in work.items()}
    state = _process_state()
    for model, x in work.values():
        trace_fn(model, x, True)()
    gc.collect()
    after = {name: _python_calls(model, x) for name, (model, x) in work.items()}
    now = _process_state()
    state_changes = {
        k: (state.get(k), now.get(k)) for k in state.keys() | now.keys() if state.get(k) != now.get(k)
    }
    result = {}
    for name in work:
        b, a = before[name], after[name]
        changed = sum(1 for key in set(a) | set(b) if a[key] != b[key])
        result[name] = (sum(b.values()), sum(a.values()), changed)
    return result, state, state_changes


def overhead(work: dict, reps: dict, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per-round ratios traced / plain for save=True and save=None, modes interleaved."""
    ratios: dict[str, dict[str, list[float]]] = {
        name: {
            "all": [],
            "none": [],
            "plain": [],
            "all_s": [],
            "none_s": [],
            "floor": [],
            "floor_refs": [],
            "floor_copy": [],
            "all_over_copy": [],
        }
        for name in work
    }
    for model, x in work.values():  # warm-up: first dispatch-mode use in a process is slow
        for save in (True, None):
            timed(trace_fn(model, x, save), 2)
    for _ in range(rounds):
        for name, (model, x) in work.items():
            n = reps[name]
            p0 = best_of(plain_fn(model, x), n)
            t_all = best_of(trace_fn(model, x, True), n)
            t_none = best_of(trace_fn(model, x, None), n)
            t_floor = best_of(passthrough_fn(model, x, keep=False), n)
            t_floor_refs = best_of(passthrough_fn(model, x, keep=True), n)
            t_floor_copy = best_of(passthrough_fn(model, x, keep=True, copy=True), n)
            p1 = best_of(plain_fn(model, x), n)
            plain = min(p0, p1)
            ratios[name]["plain"].append(plain)
            ratios[name]["all"].append(t_all / plain)
            ratios[name]["none"].append(t_none / plain)
            ratios[name]["floor"].append(t_floor / plain)
            ratios[name]["floor_refs"].append(t_floor_refs / plain)
            ratios[name]["floor_copy"].append(t_floor_copy / plain)
            ratios[name]["all_over_copy"].append(t_all / t_floor_copy)
            ratios[name]["all_s"].append(t_all)
            ratios[name]["none_s"].append(t_none)
    return ratios


class _Passthrough(TorchDispatchMode):
    """The floor of any dispatcher-level tracer: forwards each op; with ``keep``, also keeps every output alive
    (what saving all activations costs before any bookkeeping: the plain forward reuses that memory); with
    ``copy`` as well, copies a kept output before an in-place op overwrites its memory (``relu_`` on a saved
    BatchNorm output): what keeping every op's own value costs at the least, as ``tl.trace(save=True)`` must."""

    def __init__(self, keep: bool = False, copy: bool = False) -> None:
        super().__init__()
        self.outputs: list | None = [] if keep else None
        self.copy = copy
        self.by_storage: dict[int, list[int]] = {}  # storage address -> positions in outputs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        if self.copy:
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    if isinstance(value, torch.Tensor):
                        for k in self.by_storage.pop(value.untyped_storage().data_ptr(), ()):
                            self.outputs[k] = self.outputs[k].clone()
        out = func(*args, **kwargs)
        if self.outputs is not None:
            # Every tensor output is kept, a tuple's too (native_batch_norm returns its output in one): the
            # BatchNorm output that relu_ overwrites next must be copied first.
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    if self.copy:
                        self.by_storage.setdefault(o.untyped_storage().data_ptr(), []).append(
                            len(self.outputs)
                        )
                    self.outputs.append(o)
        return out


def passthrough_fn(
    model: torch.nn.Module, x: torch.Tensor, *, keep: bool, copy: bool = False
) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad(), _Passthrough(keep, copy) as mode:
            model(x)
        return mode.outputs

    return run


def per_op_us(n_ops: int, rounds: int) -> dict[str, float]:
    """Cost per op on a chain of ``n_ops`` adds of a 4-element tensor: traced minus plain, in microseconds."""
    x = torch.ones(4)

    def chain() -> torch.Tensor:
        y = x
        for _ in range(n_ops):
            y = y + 1
        return y

    def traced(save: object) -> Callable[[], object]:
        def run() -> object:
            with tl.capture(save=save) as cap:
                chain()
            return cap.trace

        return run

    def passthrough() -> object:
        # The floor: a TorchDispatchMode that only forwards each op (what any dispatcher-level tracer pays).
        with _Passthrough():
            return chain()

    assert len(traced(True)()) == n_ops  # one row per add, nothing else
    times: dict[str, list[float]] = {"plain": [], "floor": [], "all": [], "none": []}
    for _ in range(rounds):
        times["plain"].append(best_of(chain, 1))
        times["floor"].append(best_of(passthrough, 1))
        times["all"].append(best_of(traced(True), 1))
        times["none"].append(best_of(traced(None), 1))
    p = statistics.median(times["plain"])
    return {
        "plain_us": 1e6 * p / n_ops,
        **{f"{k}_us": 1e6 * (statistics.median(times[k]) - p) / n_ops for k in ("floor", "all", "none")},
    }


def to_pandas_s(trace: tl.Trace, rounds: int) -> float:
    trace.to_pandas()
    return statistics.median(best_of(trace.to_pandas, 1) for _ in range(rounds))


def draw_s(tmp: Path) -> tuple[int, int, float, float]:
    """A 330-block Linear/ReLU chain (990 ops, 991 module calls): seconds to build the DOT text, seconds for
    the whole ``draw`` (Graphviz layout included)."""
    from tl_dist.views.draw import graph_source

    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()) for _ in range(330)]
    )
    trace = trace_fn(model, torch.randn(1, 4), None)()
    source_s = best_of(lambda: graph_source(trace), 1, blocks=3)  # best of 3: one may catch a full GC pass
    start = time.perf_counter()
    trace.draw(tmp / "graph.svg")
    return len(trace), len(trace.module_table["address"]), source_s, time.perf_counter() - start


def op_counts(work: dict) -> dict[str, tuple[int, str]]:
    """name -> (ops in one traced forward, the three most frequent funcs)."""
    out = {}
    for name, (model, x) in work.items():
        trace = trace_fn(model, x, None)()
        common = Counter(op.func for op in trace).most_common(3)
        out[name] = (len(trace), ", ".join(f"{f} x{n}" for f, n in common))
    return out


def profile_one(model: torch.nn.Module, x: torch.Tensor, *, lines: int = 18) -> str:
    """cProfile of one traced forward (save=True), top functions by own time."""
    trace_fn(model, x, True)()
    prof = cProfile.Profile()
    prof.enable()
    trace_fn(model, x, True)()
    prof.disable()
    buf = __import__("io").StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(lines)
    return buf.getvalue()


def torchlens_worker(rounds: int) -> None:
    """Run in a subprocess: TorchLens's ratio to plain for each workload, interleaved; prints JSON."""
    import torchlens

    torch.set_num_threads(2)
    work = models.workloads()
    result = {}
    for name, (model, x) in work.items():
        reps = calibrate(plain_fn(model, x))

        def log(model: torch.nn.Module = model, x: torch.Tensor = x) -> object:
            with torch.no_grad():  # the same conditions as our traced forward
                return torchlens.log_forward_pass(model, x, layers_to_save="all", vis_opt="none")

        timed(log, 2)  # warm-up, as overhead() does for ours
        ratios = []
        for _ in range(rounds):  # as overhead(): same reps, fastest of BLOCKS, plain on both sides
            p0 = best_of(plain_fn(model, x), reps)
            t = best_of(log, reps)
            p1 = best_of(plain_fn(model, x), reps)
            ratios.append(t / min(p0, p1))
        result[name] = {"ratio": statistics.median(ratios), "min": min(ratios)}
        if name == "resnet18":  # as ours: warm median over the same number of rounds
            result[name]["to_pandas_s"] = to_pandas_s(log(), rounds=max(3, rounds // 2))
    print(json.dumps(result))


def run_torchlens(rounds: int) -> dict | None:
    if importlib.util.find_spec("torchlens") is None:
        return None
    cmd = [sys.executable, __file__, "--torchlens-worker", "--rounds", str(rounds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        print(f"torchlens run failed:\n{proc.stderr[-2000:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a minute or less)")
    parser.add_argument(
        "--profile", action="store_true", help="print a cProfile of one traced ResNet forward"
    )
    parser.add_argument(
        "--default-heap",
        action="store_true",
        help="keep glibc's moving malloc thresholds (benchmarks/heap.py)",
    )
    parser.add_argument("--rounds", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--torchlens-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    heap_policy = heap.set_policy(sys.argv)
    rounds = args.rounds or (3 if args.quick else 9)
    if args.torchlens_worker:
        torchlens_worker(rounds)
        return
    if args.plain_worker:
        plain_worker()
        return

    torch.set_num_threads(2)
    work = models.workloads()
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rounds} rounds, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, load average {load} on {os.cpu_count()} CPUs"
    )
    print(f"heap: {heap_policy}")
    reps = {name: calibrate(plain_fn(model, x)) for name, (model, x) in work.items()}

    leftovers, state, state_changes = leftover_check(work)
    after = after_trace_check(list(work), reps, rounds=2 * rounds)
    ratios = overhead(work, reps, rounds)
    counts = op_counts(work)
    micro = per_op_us(5000, rounds=max(3, rounds // 2))
    model, x = work["resnet18"]
    resnet_trace = trace_fn(model, x, True)()
    pandas_s = to_pandas_s(resnet_trace, rounds=max(3, rounds // 2))
    theirs = run_torchlens(rounds)
    with tempfile.TemporaryDirectory() as tmp:
        drawn = draw_s(Path(tmp)) if shutil.which("dot") else None

    print("\nTrace overhead: traced forward / plain forward (median over rounds, min in brackets)")
    header = (
        f"{'workload':<12}{'ops':>5}  {'plain':>9}  {'save=True':>15}  {'save=None':>15}  {'target':>7}  "
    )
    header += f"{'TorchLens, save all':>21}"
    print(header)
    print("-" * len(header))
    for name in work:
        med_all, min_all = statistics.median(ratios[name]["all"]), min(ratios[name]["all"])
        med_none, min_none = statistics.median(ratios[name]["none"]), min(ratios[name]["none"])
        ok = "ok" if med_all <= TARGETS[name] else "MISSED"
        line = (
            f"{name:<12}{counts[name][0]:>5}  {1e3 * statistics.median(ratios[name]['plain']):>6.2f} ms  "
            f"{med_all:>6.2f}x ({min_all:.2f}x)  {med_none:>6.2f}x ({min_none:.2f}x)  "
            f"<={TARGETS[name]:.1f}x {ok:<6}  "
        )
        if theirs:
            line += f"{theirs[name]['ratio']:>13.2f}x ({theirs[name]['min']:.2f}x)"
        else:
            line += f"{'not installed':>21}"
        print(line)
    print("Fastest traced / fastest plain over all rounds (the measurements least disturbed by other load):")
    for name in work:
        r = ratios[name]
        fastest = min(r["plain"])
        print(
            f"  {name:<12} save=True {min(r['all_s']) / fastest:.2f}x, save=None {min(r['none_s']) / fastest:.2f}x"
            f" (plain {1e3 * fastest:.2f} ms)"
        )
    print(
        "Design floors, same rounds: a pass-through TorchDispatchMode / the same keeping every output alive / "
        "and copying a kept output before an in-place op overwrites it"
    )
    for name in work:
        r = ratios[name]
        over = statistics.median(r["all_over_copy"])
        print(
            f"  {name:<12} {statistics.median(r['floor']):.2f}x / {statistics.median(r['floor_refs']):.2f}x / "
            f"{statistics.median(r['floor_copy']):.2f}x   (tl_dist: save=None {statistics.median(r['none']):.2f}x, "
            f"save=True {statistics.median(r['all']):.2f}x: {over:.2f}x of the last floor, target <= 1.05x: "
            f"{'ok' if over <= 1.05 else 'MISSED'})"
        )
    print("\nOps per forward (most frequent funcs):")
    for name, (n, common) in counts.items():
        print(f"  {name:<12}{n:>5}  {common}")
    print(
        "  NB: nn.TransformerEncoderLayer in eval + no_grad takes PyTorch's fused fast path: one "
        "_transformer_encoder_layer_fwd op per layer, so the trace sees 4 layer ops, not their insides."
    )

    print(
        f"\nPlain forward after one trace vs before any trace, same process, against a never-tracing twin "
        f"process (target <= {AFTER_TARGET:.2f}x):"
    )
    for name, r in after.items():
        if r["after"] <= AFTER_TARGET:
            ok = "ok"
        elif r["after"] - 1 <= abs(r["control"] - 1):
            ok = "above target but within the noise floor"
        else:
            ok = "MISSED"
        print(
            f"  {name:<12} after/before {r['after']:.3f}x {ok}  "
            f"(noise floor, same ratio with no trace between: {r['control']:.3f}x)"
        )
    print(
        "  Deterministic check: Python/C calls of one plain forward before and after a trace (sys.setprofile):"
    )
    for name, (n_before, n_after, changed) in leftovers.items():
        print(f"  {name:<12} {n_before} -> {n_after} calls, {changed} call sites changed")
    if state_changes:
        print(f"  Process state CHANGED by tracing ({len(state_changes)} of {len(state)} items compared):")
        for item, (was, now) in sorted(state_changes.items()):
            print(f"    {item}: {was} -> {now}")
    else:
        print(f"  Process state after tracing: the same {len(state)} items as before ({', '.join(state)}).")
    print(
        f"\nPer op, chain of 5000 adds of a 4-element tensor: plain {micro['plain_us']:.2f} us/op; "
        f"tracing adds {micro['all_us']:.1f} us/op (save=True), {micro['none_us']:.1f} us/op (save=None); "
        f"an empty pass-through TorchDispatchMode adds {micro['floor_us']:.1f} us/op"
    )
    line = f"to_pandas() on the ResNet trace ({len(resnet_trace)} ops): {1e3 * pandas_s:.1f} ms; TorchLens: "
    print(line + (f"{theirs['resnet18']['to_pandas_s']:.2f} s" if theirs else "not installed"))
    if drawn is not None:
        n_ops, n_calls, source_s, total_s = drawn
        print(
            f"draw() of a {n_ops}-op trace with {n_calls} module calls: DOT text {1e3 * source_s:.1f} ms, "
            f"with Graphviz layout to SVG {total_s:.2f} s"
        )
    if args.profile:
        print("\ncProfile of one traced ResNet forward (save=True):")
        print(profile_one(model, x))


if __name__ == "__main__":
    main()
