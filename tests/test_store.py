"""HDF5 shards: write_shard / tl.load round trips, the on-disk layout, and the errors for bad files."""

import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from external import have
from torch import nn
from torch.utils._pytree import tree_flatten

import tl_dist as tl
from tl_dist.schema import COLLECTIVE_FIELDS, MODULE_CALL_FIELDS, OP_FIELDS, SCHEMA_VERSION
from tl_dist.store import LazyTensors, ShardOptions, write_shard
from tl_dist.views.draw import graph_source


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        y = self.pool(torch.relu(self.bn(self.conv(x))))
        return self.fc(y.flatten(1))


class MultiOut(nn.Module):
    """Ops with several outputs (max_pool2d_with_indices, split, topk, LSTM) and a module returning a dict."""

    def __init__(self):
        super().__init__()
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.lstm = nn.LSTM(3, 6, batch_first=True)

    def forward(self, x):
        pooled, idx = self.pool(x)
        a, b = torch.split(pooled.flatten(2), 8, dim=2)
        vals, where = torch.topk(a.sum(1), 1, dim=1)
        seq, (h, c) = self.lstm(pooled.flatten(2).transpose(1, 2))
        return {"vals": vals, "where": where, "idx": idx, "h": h, "b": b, "scale": 2}


def assert_same_trace(mem, disk):
    for f in OP_FIELDS:
        assert disk.columns[f.name] == mem.columns[f.name], f.name
    for f in MODULE_CALL_FIELDS:
        assert disk.module_table[f.name] == mem.module_table[f.name], f.name
    for f in COLLECTIVE_FIELDS:
        assert disk.collective_table[f.name] == mem.collective_table[f.name], f.name
    assert disk.output_of == mem.output_of
    assert disk.failed_op == mem.failed_op
    for name in ("saved", "grads"):
        mem_t, disk_t = getattr(mem, name, {}) or {}, getattr(disk, name, {}) or {}
        assert sorted(disk_t) == sorted(mem_t), name
        for op, outs in mem_t.items():
            loaded = disk_t[op]
            assert len(loaded) == len(outs)
            for a, b in zip(outs, loaded):
                assert (a is None) == (b is None)
                if a is not None:
                    assert b.dtype == a.dtype and b.shape == a.shape
                    assert torch.equal(a.detach(), b), f"{name} of op {op}"
    for call_mem, call_disk in zip(mem.module_calls(), disk.module_calls()):
        leaves_mem, spec_mem = tree_flatten(call_mem.out)
        leaves_disk, spec_disk = tree_flatten(call_disk.out)
        assert spec_mem == spec_disk, call_mem
        for a, b in zip(leaves_mem, leaves_disk):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a.detach(), b)
            else:
                assert a == b


def test_round_trip_cnn_training_step(tmp_path):
    model = SmallCNN().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 3, 8, 8)
    with tl.capture(save=True, save_grads=True, stats=True) as cap:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
    mem = cap.trace
    assert {"forward", "backward", "optimizer"} <= set(mem.columns["phase"])
    path = write_shard(mem, tmp_path / "s.h5")
    disk = tl.load(path)
    assert len(disk) == len(mem) > 40
    assert_same_trace(mem, disk)
    # stats=True: value statistics of forward outputs and of their gradients, every row back from the shard
    assert set(mem.stats_table["of"]) == {"out", "grad"}
    assert {mem.columns["phase"][i] for i in mem.stats_table["op"]} == {"forward"}
    assert disk.stats_table == mem.stats_table
    assert disk.metadata["complete"] is True
    assert disk.metadata["clock_offset_ns"] == mem.metadata["clock_offset_ns"]
    # Queries work on the loaded trace as on the live one.
    sel = tl.func("relu") & tl.in_module("")
    assert [op.label for op in disk.select(sel)] == [op.label for op in mem.select(sel)]
    assert disk.to_pandas().equals(mem.to_pandas())
    assert torch.equal(disk["relu_1"].out, mem["relu_1"].out)


def test_round_trip_multi_output_ops_and_structured_module_output(tmp_path):
    model = MultiOut()
    x = torch.randn(2, 3, 8, 8)
    mem = tl.trace(model, x)
    assert len(mem["max_pool2d_with_indices_1"].out) == 2
    disk = tl.load(write_shard(mem, tmp_path / "m.h5"))
    assert_same_trace(mem, disk)
    pooled, idx = disk["max_pool2d_with_indices_1"].out
    assert idx.dtype == torch.int64 and torch.equal(pooled, mem["max_pool2d_with_indices_1"].out[0])
    out = disk.output
    assert set(out) == {"vals", "where", "idx", "h", "b", "scale"} and out["scale"] == 2
    assert torch.equal(out["h"], mem.output["h"].detach())
    # One dataset per output of a multi-output op, under a group named by the op's label.
    with h5py.File(tmp_path / "m.h5") as f:
        group = f["saved/max_pool2d_with_indices_1"]
        assert isinstance(group, h5py.Group) and sorted(group) == ["0", "1"]
        assert group["1"].dtype == np.int64 and group["1"].shape == (2, 3, 4, 4)


def test_dtypes_numpy_lacks_and_scalars_round_trip(tmp_path):
    class M(nn.Module):
        def forward(self, x):
            y = x.to(torch.bfloat16) * 2
            return y.float().sum(), (x > 0), x.to(torch.complex64), x.new_zeros(0, 4)

    mem = tl.trace(M(), torch.randn(3, 4))
    disk = tl.load(write_shard(mem, tmp_path / "d.h5"))
    assert_same_trace(mem, disk)
    dtypes = {t.dtype for outs in disk.saved.values() for t in outs}
    assert {torch.bfloat16, torch.bool, torch.complex64, torch.float32} <= dtypes
    with h5py.File(tmp_path / "d.h5") as f:
        scalar = f["saved/sum_1"]
        assert scalar.shape == () and scalar.chunks is None and scalar.compression is None
        empty = f["saved/new_zeros_1"]
        assert empty.shape == (0, 4) and empty.chunks is None and empty.compression is None
        # An empty table is its group alone; non-empty columns are chunked and compressed.
        assert f["collectives"].attrs["n-rows"] == 0 and len(f["collectives"]) == 0
        assert f["ops/index"].compression == "gzip" and f["ops/index"].chunks is not None


def test_layout_is_plain_hdf5_without_pickle(tmp_path):
    mem = tl.trace(SmallCNN(), torch.randn(1, 3, 8, 8))
    path = write_shard(mem, tmp_path / "p.h5")
    with h5py.File(path) as f:
        assert f.attrs["encoding-type"] == "tl_dist.shard"
        assert f.attrs["schema_version"] == SCHEMA_VERSION
        assert list(f["ops"].attrs["column-order"]) == [fl.name for fl in OP_FIELDS]
        # Strings: int32 codes into the shard's one vlen UTF-8 string table, read with .asstr().
        strings = f["strings"].asstr()[()]
        assert f["ops"].attrs["strings"] == "/strings" and f["ops/label"].dtype == np.int32
        assert [strings[c] for c in f["ops/label"][()]] == mem.columns["label"]
        assert [strings[c] for c in f["modules/address"][()]] == mem.module_table["address"]
        assert len(set(strings)) == len(strings)  # each distinct string once, whatever table uses it
        # Ragged ints: values + offsets.
        parents = f["ops/parents"]
        off = parents["offsets"][()]
        assert tuple(parents["values"][off[5] : off[6]]) == mem.columns["parents"][5]
        kinds = set()

        def visit(name, node):
            if isinstance(node, h5py.Dataset):
                kinds.add(node.dtype.kind if h5py.check_string_dtype(node.dtype) is None else "str")
            elif not name.startswith("saved/"):  # multi-output groups under /saved carry no attributes
                assert "encoding-type" in node.attrs, name

        f.visititems(visit)
        # Only numbers, bools and strings: nothing that could hold a pickled object.
        assert kinds <= {"i", "u", "f", "b", "c", "str"} and "O" not in kinds


@pytest.mark.needs("h5dump")
def test_h5dump_reads_shard(tmp_path):
    mem = tl.trace(SmallCNN(), torch.randn(1, 3, 8, 8))
    path = write_shard(mem, tmp_path / "h.h5")
    header = subprocess.run(["h5dump", "-H", str(path)], capture_output=True, text=True, timeout=60)
    assert header.returncode == 0, header.stderr
    assert 'GROUP "ops"' in header.stdout and 'GROUP "saved"' in header.stdout
    data = subprocess.run(["h5dump", "-d", "/strings", str(path)], capture_output=True, text=True, timeout=60)
    assert data.returncode == 0 and '"convolution_1"' in data.stdout


def test_lazy_and_no_tensor_loading(tmp_path):
    mem = tl.trace(SmallCNN(), torch.randn(1, 3, 8, 8))
    path = write_shard(mem, tmp_path / "l.h5")
    lazy = tl.load(path)
    assert isinstance(lazy.saved, LazyTensors) and lazy.saved._cache == {}
    assert len(lazy.saved) == len(mem.saved) and 0 in lazy.saved
    assert lazy.saved._cache == {}  # len/in read nothing
    first = lazy["convolution_1"].out
    assert torch.equal(first, mem["convolution_1"].out) and list(lazy.saved._cache) == [0]
    everything = lazy.saved.load_all()
    assert len(everything) == len(mem.saved)
    bare = tl.load(path, tensors=False)
    assert len(bare.saved) == 0 and bare["convolution_1"].out is None
    assert bare.columns == lazy.columns
    # Lazy reads after the file went away name the file.
    again = tl.load(path)
    path.rename(path.with_suffix(".moved"))
    with pytest.raises(tl.ShardFormatError, match=r"l\.h5"):
        _ = again["relu_1"].out


def test_failed_write_leaves_no_file(tmp_path):
    mem = tl.trace(SmallCNN(), torch.randn(1, 3, 8, 8))
    mem.saved[0] = ["not a tensor"]
    with pytest.raises(AttributeError):
        write_shard(mem, tmp_path / "bad.h5")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="folder"):
        write_shard(mem, tmp_path / "missing" / "x.h5")
    with pytest.raises(ValueError, match="rows_per_chunk"):
        ShardOptions(rows_per_chunk=0)
    with pytest.raises(ValueError, match="compression"):
        ShardOptions(compression="lzf")


@pytest.fixture
def good_shard(tmp_path):
    return write_shard(tl.trace(SmallCNN(), torch.randn(1, 3, 8, 8)), tmp_path / "good.h5")


def test_text_file_is_rejected(tmp_path):
    path = tmp_path / "notes.h5"
    path.write_text("just some text\n")
    with pytest.raises(tl.ShardFormatError, match=r"notes\.h5.*not a readable HDF5"):
        tl.load(path)


def test_truncated_file_is_rejected(good_shard, tmp_path):
    data = good_shard.read_bytes()
    for cut in (len(data) // 2, 1024, len(data) - 100):
        path = tmp_path / f"cut{cut}.h5"
        path.write_bytes(data[:cut])
        with pytest.raises(tl.ShardFormatError, match=f"cut{cut}"):
            trace = tl.load(path)
            trace.saved.load_all()


def test_corrupt_bytes_are_rejected(good_shard, tmp_path):
    data = bytearray(good_shard.read_bytes())
    data[0:8] = b"\0" * 8  # the HDF5 signature
    path = tmp_path / "nosig.h5"
    path.write_bytes(bytes(data))
    with pytest.raises(tl.ShardFormatError, match="nosig"):
        tl.load(path)


def test_foreign_hdf5_is_rejected(tmp_path):
    path = tmp_path / "foreign.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(10))
    with pytest.raises(tl.ShardFormatError, match=r"foreign\.h5.*another layout"):
        tl.load(path)


def test_newer_schema_is_rejected(good_shard):
    with h5py.File(good_shard, "r+") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(tl.ShardFormatError, match=rf"good\.h5.*version {SCHEMA_VERSION + 1}.*upgrade"):
        tl.load(good_shard)


def test_missing_column_is_rejected(good_shard):
    with h5py.File(good_shard, "r+") as f:
        del f["ops/flops"]
    with pytest.raises(tl.ShardFormatError, match=r"good\.h5.*flops"):
        tl.load(good_shard)


def test_missing_file_and_bad_arguments(tmp_path):
    with pytest.raises(tl.ShardFormatError, match="nope.h5"):
        tl.load(tmp_path / "nope.h5")
    with pytest.raises(ValueError, match="path"):
        tl.load(3)
    with pytest.raises(ValueError, match="tensors"):
        tl.load(tmp_path / "nope.h5", tensors="yes")
    with pytest.raises(ValueError, match=r"path must be a str or os.PathLike file name, got 5 \(int\)"):
        tl.trace(torch.nn.ReLU(), torch.ones(2)).save(5)


@pytest.mark.needs("dot", optional=True)
def test_loaded_trace_summary_and_draw_match_live(tmp_path):
    mem = tl.trace(SmallCNN(), torch.randn(1, 3, 8, 8))
    disk = tl.load(write_shard(mem, tmp_path / "v.h5"))
    assert disk.summary() == mem.summary()
    source = graph_source(disk)
    assert source == graph_source(mem)
    assert "convolution_1" in source and "relu_1" in source
    if have("dot"):
        text = open(disk.draw(str(tmp_path / "graph.svg"))).read()
        assert "<svg" in text and "convolution_1" in text and "relu_1" in text


GOLDEN_V1 = Path(__file__).parent / "data" / "shards" / "v1" / "linear_relu.h5"


def test_golden_v1_shard_still_loads():
    """A shard written by schema version 1, kept forever: readers must keep loading it.

    Written from nn.Sequential(nn.Linear(3, 2), nn.ReLU()) with weight [[1, -1, .5], [0, 2, -1]], bias
    [.5, -.5], on x = [[1, 2, 3], [-1, 0, 1]] (tl.trace(..., source=False)). Fields added to the schema since
    read as "unknown" (listed in metadata["filled_columns"]); any other layout change must bump
    SCHEMA_VERSION and teach the reader the old layout -- do not regenerate the file.
    """
    trace = tl.load(GOLDEN_V1)
    with h5py.File(GOLDEN_V1) as f:
        newer = [
            f"{table}/{fl.name}"
            for table, fields in (("ops", OP_FIELDS), ("modules", MODULE_CALL_FIELDS))
            for fl in fields
            if fl.name not in list(f[table].attrs["column-order"])
        ]
    assert trace.metadata.get("filled_columns", []) == newer
    assert (trace.rank, trace.world_size, trace.step) == (0, 1, 0)
    assert trace.metadata["complete"] is True
    assert [op.label for op in trace][:3] == ["t_1", "addmm_1", "relu_1"]
    addmm = trace["addmm_1"]
    assert addmm.module == "0" and addmm.params == ("0.bias",) and addmm.parents == (0,)
    assert trace["t_1"].params == ("0.weight",)
    assert addmm.flops == 2 * 2 * 3 * 2  # 2 rows x (3 in -> 2 out) multiply-adds
    assert addmm.out_shapes == ((2, 2),) and addmm.dtype == "float32"
    # rows: [1-2+1.5+.5, 0+4-3-.5] = [1, .5]; [-1+0+.5+.5, 0+0-1-.5] = [0, -1.5]
    assert torch.equal(addmm.out, torch.tensor([[1.0, 0.5], [0.0, -1.5]]))
    assert torch.equal(trace["relu_1"].out, torch.tensor([[1.0, 0.5], [0.0, 0.0]]))
    assert trace.module_table["address"] == ["", "0", "1"]
    assert torch.equal(trace.module("1").out, torch.tensor([[1.0, 0.5], [0.0, 0.0]]))
    assert trace["relu_1"].parents == (addmm.index,)


def test_field_newer_than_the_shard_reads_as_unknown(good_shard):
    with h5py.File(good_shard, "r+") as f:
        del f["ops/flops"]
        order = [name for name in f["ops"].attrs["column-order"] if name != "flops"]
        f["ops"].attrs["column-order"] = np.array(order, dtype=object)
    trace = tl.load(good_shard)
    assert trace.metadata["filled_columns"] == ["ops/flops"]
    assert set(trace.columns["flops"]) == {-1} and len(trace.columns["flops"]) == len(trace)


def test_what_a_file_is_and_its_metadata_without_reading_tables(tmp_path):
    from tl_dist.store import file_kind, read_metadata

    trace = tl.trace(nn.Linear(3, 2), torch.randn(4, 3))
    trace.metadata.update(rank=1, world_size=2, step=7)
    tl.shard_path(tmp_path, 1, 7).parent.mkdir()
    shard = trace.save(tl.shard_path(tmp_path, 1, 7))
    assert file_kind(shard) == "shard"
    meta = read_metadata(shard)
    assert (meta["rank"], meta["world_size"], meta["step"]) == (1, 2, 7)
    merged = tl.merge_ranks([shard], strict=False).save(tmp_path / "merged.h5")
    assert file_kind(merged) == "merged"
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f.create_dataset("x", data=np.arange(3))
    assert file_kind(foreign) == "other"
    text = tmp_path / "notes.txt"
    text.write_text("not hdf5")
    with pytest.raises(tl.ShardFormatError, match=r"notes\.txt: not a readable HDF5 file"):
        file_kind(text)
    with pytest.raises(tl.ShardFormatError, match=r"foreign\.h5: no readable shard metadata"):
        read_metadata(foreign)


_WRITER_WITH_OWN_PYTREE_TYPE = """
import sys, torch, tl_dist as tl
from torch.utils import _pytree

class Out:  # a model output type registered with torch's pytree, as transformers' ModelOutput
    def __init__(self, logits, hidden):
        self.logits, self.hidden = logits, hidden

_pytree.register_pytree_node(
    Out, lambda o: ([o.logits, o.hidden], None), lambda leaves, _: Out(*leaves),
    serialized_type_name="writer_only.Out",
)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
    def forward(self, x):
        h = self.fc(x)
        return Out(h.relu(), h)

torch.manual_seed(0)
x = torch.randn(4, 3)
trace = tl.trace(Net(), x)
trace.save(sys.argv[1])
torch.save({"logits": trace.output.logits, "hidden": trace.output.hidden}, sys.argv[2])
"""


def test_a_shard_whose_output_type_this_process_lacks_loads_with_its_values(tmp_path):
    # A shard is read where the model's code is not imported (tl.merge_ranks, the CLI): an output type the
    # writer registered with torch's pytree cannot be rebuilt here, but its values must still load.
    import sys

    path, ref = tmp_path / "own_type.h5", tmp_path / "ref.pt"
    subprocess.run(
        [sys.executable, "-c", _WRITER_WITH_OWN_PYTREE_TYPE, str(path), str(ref)], check=True, timeout=120
    )
    want = torch.load(ref)
    with pytest.warns(
        RuntimeWarning,
        match=r"^module outputs of type writer_only\.Out \(registered .*\) read as tuples of their",
    ):
        trace = tl.load(path)
    assert isinstance(trace.output, tuple) and len(trace.output) == 2
    assert torch.equal(trace.output[0], want["logits"]) and torch.equal(trace.output[1], want["hidden"])
    root = trace.module("")
    assert isinstance(root.out, tuple)
    assert torch.equal(root.out[0], want["logits"]) and torch.equal(root.out[1], want["hidden"])
    assert torch.equal(trace.module("fc").out, want["hidden"])  # plain tensors are unaffected
    # merge reads the same shard through the same code
    run = tmp_path / "run" / "rank00000"
    run.mkdir(parents=True)
    path.rename(run / "step00000000.h5")
    with pytest.warns(RuntimeWarning, match="writer_only.Out"):
        frame = tl.merge_ranks(tmp_path / "run").to_pandas()
    assert list(frame["label"]) == list(trace.to_pandas()["label"])
    # the command line says it in one line of its own, without Python's file:line and source echo
    cli = subprocess.run(
        [sys.executable, "-m", "tl_dist.cli", "merge", str(tmp_path / "run"), "-o", str(tmp_path / "merged")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    lines = cli.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tl-dist: warning: "), cli.stderr
    assert (
        "module outputs of type writer_only.Out (registered" in lines[0] and "warnings.warn" not in lines[0]
    )


def test_the_traces_output_is_stored_once_as_its_ops_saved_output(tmp_path):
    import h5py

    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.ReLU()), torch.randn(50, 8)
    want = model(x)
    for save in (True, None):
        path = tl.trace(model, x, save=save).save(tmp_path / f"out_{save}.h5")
        with h5py.File(path) as f:
            assert "tree_tensors" not in f  # the output is relu_1's: no copy of its own (metadata only: none)
            assert ("relu_1" in f["saved"]) is (save is True)
        loaded = tl.load(path)
        assert not loaded.saved._cache  # nothing read yet: the output's reference resolves on use
        if save:
            assert torch.equal(loaded.output, want)
        else:
            assert loaded.output is None  # not saved, so not in the shard
    # A leaf no op produced (the input passed through) is still stored with the output.
    passthrough = tl.trace(lambda_module := _PassThrough(), x).save(tmp_path / "pass.h5")
    out = tl.load(passthrough).output
    assert torch.equal(out[0], x) and torch.equal(out[1], lambda_module(x)[1])


class _PassThrough(torch.nn.Module):
    def forward(self, x):
        return x, x.sum()


def test_a_meta_models_trace_saves_its_shapes(tmp_path):
    model = torch.nn.Linear(4, 2, device="meta")
    x = torch.empty(3, 4, device="meta")
    for save in (True, None):
        trace = tl.trace(model, x, save=save)
        if save:
            with pytest.warns(RuntimeWarning, match=r"meta_True\.h5: 2 saved tensor\(s\) not written.*meta"):
                path = trace.save(tmp_path / f"meta_{save}.h5")
        else:
            path = trace.save(tmp_path / f"meta_{save}.h5")
        loaded = tl.load(path)
        assert [op.out_shapes for op in loaded] == [((4, 2),), ((3, 2),)]
        assert loaded["addmm_1"].out is None and loaded.output is None
