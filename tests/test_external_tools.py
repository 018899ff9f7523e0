"""Tests that use an external program (Graphviz's dot, h5dump, chromium) skip, or check what they can, without it."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = ("dot", "h5dump", "chromium", "prometheus")
# Tests marked needs(..., optional=True): they must pass without the tools (DOT text checked, no picture).
OPTIONAL = {
    "test_cli.py::test_export_draw_and_errors",
    "test_lightning.py::test_ddp_spawn_writes_shards_at_the_chosen_steps_and_merges",
    "test_cli.py::test_summary_and_draw_of_one_shard_show_that_shards_trace",
    "test_merge_dist.py::test_clean_run_every_kind_ddp_fsdp2",
    "test_merge_dist.py::test_train_ddp_example_under_torchrun",
    "test_merge_views.py::test_draw_joins_ranks",
    "test_store.py::test_loaded_trace_summary_and_draw_match_live",
    "test_views.py::test_summary_and_draw_of_a_loaded_shard_read_no_tensor",
}


def _path_without(tmp_path: Path, hidden: tuple[str, ...]) -> str:
    """A one-folder PATH with every program of the current PATH except ``hidden`` (symlinks)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            link = bin_dir / name
            if name not in hidden and not link.exists() and not link.is_symlink():
                link.symlink_to(os.path.join(folder, name))
    return str(bin_dir)


@pytest.mark.slow
def test_tool_tests_skip_rather_than_fail_without_the_tools(tmp_path):
    report = tmp_path / "report.xml"
    env = dict(os.environ, PATH=_path_without(tmp_path, HIDDEN))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--needing", ",".join(HIDDEN)]
    cmd += [f"--junitxml={report}", str(ROOT / "tests")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed, skipped = set(), {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}.py::{case.get('name')}"
        assert case.find("failure") is None and case.find("error") is None, name
        skip = case.find("skipped")
        if skip is None:
            passed.add(name)
        else:
            skipped[name] = skip.get("message", "")
    assert passed == OPTIONAL
    # The other tool tests (renders, h5dump reads) skip, each saying which program is missing.
    assert len(skipped) >= 6
    assert all(any(f"`{tool}` not on PATH" in msg for tool in HIDDEN) for msg in skipped.values()), skipped
    assert any("h5dump" in msg for msg in skipped.values())
