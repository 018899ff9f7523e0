import os

import pytest
import torch
from external import PACKAGES, have, missing_reason
from hypothesis import Phase, settings
from torch import nn

import tl_dist as tl

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# `make mutation` (--hypothesis-profile=mutation): the same examples on every run, so scores are stable, and no
# shrinking -- a mutant is killed by its first failing example; shrinking it would only cost time.
settings.register_profile(
    "mutation", derandomize=True, database=None, phases=[Phase.explicit, Phase.generate]
)


def pytest_addoption(parser):
    parser.addoption(
        "--needing",
        default="",
        help="run only the tests marked needs(TOOL) for one of these comma-separated tools",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "needs(*tools, optional=False): the test uses these external programs (tests/external.py); "
        "skipped when one is missing unless optional=True (then it checks what it can without them)",
    )


def _needed(item) -> tuple[list[str], bool]:
    tools, optional = [], True
    for mark in item.iter_markers("needs"):
        unknown = [t for t in mark.args if t not in PACKAGES]
        if unknown:
            raise pytest.UsageError(f"{item.nodeid}: needs() names unknown tools {unknown}")
        tools += mark.args
        optional = optional and mark.kwargs.get("optional", False)
    return tools, optional


def pytest_collection_modifyitems(config, items):
    wanted = {t for t in config.getoption("--needing").split(",") if t}
    if not wanted:
        return
    keep = [item for item in items if wanted & set(_needed(item)[0])]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


def pytest_runtest_setup(item):
    tools, optional = _needed(item)
    if optional:
        return
    for tool in tools:
        if not have(tool):
            pytest.skip(missing_reason(tool))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def step_trace():
    """One training step (forward, backward, SGD) of a small MLP, captured: the drawing and Perfetto tests'."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    with tl.capture() as cap:
        model(x).sum().backward()
        opt.step()
    return cap.trace


@pytest.fixture
def summarize_calls(monkeypatch):
    """The traces ``tl_dist.telemetry.summarize`` ran on, counted by a wrapper that calls the real one -- under
    every name the package (and the Lightning callback, on older layouts) binds it to."""
    import importlib
    import sys

    from tl_dist import telemetry

    real = telemetry.summarize
    calls = []

    def counting(trace, *args, **kwargs):
        calls.append(trace)
        return real(trace, *args, **kwargs)

    for name in ("tl_dist.telemetry", "tl_dist.sinks", "tl_dist.arm", "tl_dist.integrations.lightning"):
        module = sys.modules.get(name) or importlib.import_module(name)
        monkeypatch.setattr(module, "summarize", counting, raising=False)
    return calls
