"""The package's layering (docs/capture.md, "How the parts depend on each other"), read from the source with
``ast``: the data at the bottom imports only the vocabulary, no import cycle even counting ``TYPE_CHECKING``
imports, and no in-package import hidden inside a function."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import tl_dist.store

ROOT = Path(__file__).resolve().parents[1]
# Top-level adapter folders, installed as tl_dist.<name> (pyproject package-dir).
TREES = {
    "tl_dist": ROOT / "tl_dist",
    "tl_dist.integrations": ROOT / "integrations",
    "tl_dist.exporters": ROOT / "exporters",
}


def _modules() -> dict[str, Path]:
    found = {}
    for base, root in TREES.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("").parts
            rel = rel[:-1] if rel[-1] == "__init__" else rel
            found[".".join((base, *rel))] = path
    return found


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, bool]]:
    """(in-package module imported, whether the import sits inside a function) for each import of ``name``,
    ``TYPE_CHECKING`` ones included."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    late = {
        sub.lineno
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for sub in ast.walk(fn)
        if isinstance(sub, (ast.Import, ast.ImportFrom))
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                out.append((target, node.lineno in late))
    return out


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_trace_data_imports_only_the_vocabulary():
    imported = {m for m, _ in _imports("tl_dist.trace")}
    assert imported <= {"tl_dist.schema", "tl_dist.selectors", "tl_dist.errors", "tl_dist._common"}, imported


def test_no_import_cycle():
    # The recorder's helpers (module stack, phases, training state) see it through _recorder_state's protocols.
    graph = {name: {m for m, _ in _imports(name)} for name in MODULES}
    assert _cycles(graph) == []


def test_trace_methods_are_there_whichever_module_is_imported_first():
    # The facade (tl_dist.api) attaches them; importing tl_dist.trace alone imports the package first.
    code = (
        "from tl_dist.trace import Trace\nfrom tl_dist.merge.graph import MergedTrace\n"
        "missing = [n for n in ('to_pandas', 'draw', 'save', 'report', 'replay', 'fork', 'validate',"
        " 'summary', 'to_perfetto', 'collectives_frame') if not hasattr(Trace, n)]\n"
        "missing += [n for n in ('collectives', 'clocks', 'to_pandas', 'summary', 'draw', 'to_perfetto',"
        " 'report', 'save') if not hasattr(MergedTrace, n)]\nassert not missing, missing\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("name", ["tl_dist.training", "tl_dist.merge.views"])
def test_moved_names_keep_their_old_import_path(name):
    module = __import__(name, fromlist=["_"])
    if name == "tl_dist.training":
        from tl_dist.trace import first_nonfinite, op_stats

        assert (module.first_nonfinite, module.op_stats) == (first_nonfinite, op_stats)
    else:
        from tl_dist.merge.steps import collective_row

        assert module.collective_row is collective_row


def test_no_in_package_import_inside_a_function():
    # Late imports hid the cycles; only optional third-party packages (plotly, tqdm, ...) may be imported late.
    late = sorted(f"{name} -> {m}" for name in MODULES for m, inside in _imports(name) if inside)
    assert late == []


def _store_leaks(name: str) -> list[str]:
    """Imports of ``name`` that reach past the store's public API: h5py itself, or a module of tl_dist.store."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    leaks = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            leaks += [a.name for a in node.names if a.name.split(".")[0] == "h5py"]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] == "h5py" and not node.level:
                leaks.append(node.module)
    # A module of the store is public when the store's __all__ names it (``location``: paths and URLs).
    public = {f"tl_dist.store.{n}" for n in tl_dist.store.__all__}
    leaks += [m for m, _ in _imports(name) if m.startswith("tl_dist.store.") and m not in public]
    return leaks


def test_only_the_store_touches_hdf5_and_others_use_its_public_names():
    outside = [n for n in MODULES if n != "tl_dist.store" and not n.startswith("tl_dist.store.")]
    assert {n: _store_leaks(n) for n in outside if _store_leaks(n)} == {}


def _python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter from the repository root (so the top-level folders are importable
    by their own names, as in any checkout)."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("folder", "right"), [("exporters", "tl_dist.exporters"), ("integrations", "tl_dist.integrations")]
)
def test_an_adapter_folder_is_one_module_and_names_its_import(folder, right):
    # From a checkout the folder is importable by its own name; that would be a second module object.
    run = _python(f"import {folder}")
    assert run.returncode != 0 and "ImportError" in run.stderr and f"import it as {right}" in run.stderr
    assert _python(f"import {right}").returncode == 0


# Blocking a package in sys.modules makes importing it raise ImportError, as on an install without the extra.
_WITHOUT = "import sys\nfor name in {names!r}:\n    sys.modules[name] = None\n"


@pytest.mark.parametrize(
    ("module", "blocked", "adapter", "extra"),
    [
        ("tl_dist.exporters.otel", ["opentelemetry"], "tl_dist.exporters.otel", "otel"),
        ("tl_dist.exporters.otel_spans", ["opentelemetry"], "tl_dist.exporters.otel", "otel"),
        ("tl_dist.exporters.otel_export", ["opentelemetry"], "tl_dist.exporters.otel", "otel"),
        ("tl_dist.integrations.lightning", ["lightning"], "tl_dist.integrations.lightning", "lightning"),
    ],
)
def test_an_adapter_without_its_extra_says_what_to_install(module, blocked, adapter, extra):
    run = _python(_WITHOUT.format(names=blocked) + f"import {module}")
    assert run.returncode != 0
    assert f"ImportError: {adapter} needs the tl_dist[{extra}] extra" in run.stderr
    assert f"pip install 'tl_dist[{extra}]'" in run.stderr


def test_the_base_install_traces_arms_and_merges_without_the_adapter_extras(tmp_path):
    code = _WITHOUT.format(names=["lightning", "opentelemetry", "plotly"]) + (
        "import torch, tl_dist as tl\n"
        f"out = {str(tmp_path)!r}\n"
        "tl.arm(out)\n"
        "with tl.capture(step=0):\n"
        "    torch.nn.Linear(3, 2)(torch.randn(4, 3)).sum().backward()\n"
        "tl.disarm()\n"
        "g = tl.merge_ranks(out)\n"
        "print(len(g.rank(0)), g.world_size)\n"
    )
    run = _python(code)
    assert run.returncode == 0, run.stderr
    # Rank 0's window was written and merged as a world of one.
    assert run.stdout.split()[1] == "1" and int(run.stdout.split()[0]) > 0
