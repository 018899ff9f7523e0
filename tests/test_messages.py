"""Messages a person meets: warnings for silent mistakes, and one name for "no module" in every view."""

import warnings

import pytest
import torch
from merge_synth import coll, make_trace, write_run
from torch import nn

import tl_dist as tl
from tl_dist.schema import OUTSIDE


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.act(x) * 2)


def test_module_called_several_times_warns_which_call_it_returns():
    with torch.no_grad():
        t = tl.trace(Twice(), torch.randn(3))
    with pytest.warns(
        UserWarning,
        match=r"trace.module\('act'\): the module was called 2 times; returning its "
        r"first call \(call=0\)\. Pass call=0..1 for another",
    ):
        first = t.module("act")
    assert first.call == 0 and first.ops[0].label == "tanh_1"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # naming the call, or a module called once: no warning
        assert t.module("act", call=1).ops[0].label == "tanh_2"
        assert t.module("").call == 0
    with pytest.raises(KeyError, match=r"module 'act' was called 2 time\(s\) in this trace; call=2 is none"):
        t.module("act", call=2)
    with pytest.raises(ValueError, match="call must be None or a non-negative int"):
        t.module("act", call=-1)


def test_load_of_a_run_directory_points_to_merge_ranks(tmp_path):
    write_run(tmp_path / "run", [make_trace(0, [coll()]), make_trace(1, [coll()])])
    shard = tmp_path / "run" / "rank00000" / "step00000000.h5"
    with pytest.raises(tl.ShardFormatError) as err:
        tl.load(tmp_path / "run")
    assert str(err.value) == (
        f"{tmp_path / 'run'} is a directory, not a shard: merge a run's shards with "
        f"tl.merge_ranks({str(tmp_path / 'run')!r}), or load one shard such as {str(shard)!r}"
    )


def test_one_name_for_no_module(tmp_path):
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with torch.no_grad(), tl.capture() as cap:
        (layer(x) * 2).sum()
    text = cap.trace.summary(top=10)
    modules = text.split("Per module")[1].split("Top")[0].splitlines()[3:]
    # The captured Linear is the root; mul and sum ran outside it.
    assert [ln.split("  ")[0].strip() for ln in modules if ln] == ["<root>", OUTSIDE]
    top = {ln.split()[1]: ln for ln in text.split("by time:")[1].splitlines()[3:] if ln.strip()}
    assert OUTSIDE in top["mul_1"] and OUTSIDE in top["sum_1"] and "<root>" in top["addmm_1"]
    # A merged summary's finding names the op's module the same way (the synthetic ops run outside modules).
    write_run(tmp_path, [make_trace(0, [coll(numel=4)]), make_trace(1, [coll(numel=8)])])
    merged = tl.merge_ranks(tmp_path).summary()
    assert f"all_reduce_1 seq 1 completed in {OUTSIDE} (train.py:all_reduce)" in merged
