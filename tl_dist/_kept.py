"""What a capture keeps of its ops, and the in-place write log that keeps it true: the saved outputs and
replay records (``save=``), the watch list that copies a kept tensor before an op overwrites its memory, and
the log of in-place writes that later readers of that memory take as their parent.

A part of :class:`tl_dist._recorder.Recorder` (its base class): the methods read and write the recorder's own
attributes (``saved``, ``replay_records``, ``_storage_refs``, ``_writes``, ...), which the compiled per-op path
(``_csrc/saved.c``, ``_csrc/writes.c``) reads under the same names.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ._common import TAG as _TAG
from ._common import RowView, byte_extent, storage_address, storage_key
from ._common import clone_strided as _clone_strided

Tensor = torch.Tensor
_STRIDED = torch.strided


class KeptValues:
    """The recorder's saving and write-log methods (see the module doc)."""

    __slots__ = ()  # the state is the recorder's (Recorder.__slots__ and its __dict__)

    def _save_op(
        self,
        index: int,
        row: tuple,
        outs: list,
        func: Any,
        args: tuple,
        kwargs: dict,
        tensors: list,
        srcs: list,
        pre_write: dict[int, Tensor] | None = None,
    ) -> None:
        """Keeps op ``index``'s outputs and replay record if the window saves it (``save=True`` or a selector
        its row matches). Called by ``on_op`` and by the compiled per-op path; ``pre_write`` is what
        ``_before_write`` returned for an in-place op."""
        if self.save_all or self.save_selector.match(RowView(row)):
            self._save(index, outs, func, args, kwargs, tensors, srcs, pre_write)

    def _save(
        self,
        index: int,
        outs: list,
        func: Any,
        args: tuple,
        kwargs: dict,
        tensors: list,
        srcs: list,
        pre_write: dict[int, Tensor] | None,
    ) -> None:
        keep = self.keep_graph
        watch = self.watch
        saved = self.saved[index] = [o if keep else o.detach() for o in outs]
        for pos, o in enumerate(outs):
            if not watch(o, (index, 0, pos)) and o.layout is not _STRIDED:
                # A sparse output has no one storage to watch for in-place writes: keep a copy of its value.
                saved[pos] = saved[pos].clone()
        # Replay info. The argument structure is kept as the dispatcher passed it (the tensors in it act as
        # slots, see fill_skeleton): building a copy per op would cost more than the op on small tensors.
        # Untracked tensors (parameters, inputs) are watched so that a later in-place write (an optimizer
        # step) first copies the value this op read.
        consts: list[Tensor | None] = [None] * len(tensors)
        for k, src in enumerate(srcs):
            if src is None:
                t = tensors[k]
                if pre_write is not None and k in pre_write:
                    consts[k] = pre_write[k]  # the value before this op wrote into it
                else:
                    consts[k] = t if keep else t.detach()
                watch(t, (index, 1, k))
        self.replay_records[index] = (func, args, kwargs, srcs, consts)

    def _before_write(
        self, written: list[Tensor], tensors: list, srcs: list | None
    ) -> dict[int, Tensor] | None:
        """Before an in-place op runs: copy saved tensors it would overwrite and, when saving, return the value
        of each untracked tensor it writes (a buffer's ``add_``) by argument slot: replay info is built after
        the op ran and must hold what the op read, not what it wrote."""
        if self._storage_refs:
            self._copy_before_write(written)
        if srcs is not None:
            ids = {id(t) for t in written}
            pre = {
                k: _clone_strided(t.detach())
                for k, t in enumerate(tensors)
                if srcs[k] is None and id(t) in ids
            }
            return pre or None
        return None

    def _note_writes(self, index: int, written: list[Tensor]) -> None:
        self._last_write = index
        for t in written:
            try:
                storage = t.untyped_storage()  # made once: storage_key(t) would make it again
            except NotImplementedError:
                continue  # sparse: no one storage (its saved outputs are copies, see _save)
            key = storage_address(storage)
            if key is None:
                continue
            lo, hi = byte_extent(t)
            if hi <= lo:
                continue
            self.writes_generation += 1
            owner = self._written_storage.get(key)
            if owner is None or owner() is not storage:
                self._written_storage[key] = weakref.ref(storage)
                self._writes[key] = [(index, lo, hi)]
            else:
                self._writes[key].append((index, lo, hi))

    def forget_writes(self, storages: set[int | None], ops: set[int]) -> None:
        """Drop the in-place writes of ops ``ops`` into the storages keyed ``storages``: a compiled region's
        collectives write into buffers of the region, which says nothing of the value read after it."""
        for key in storages:
            kept = [e for e in self._writes.get(key, ()) if e[0] not in ops]
            if kept:
                self._writes[key] = kept
            else:
                self._writes.pop(key, None)
                self._written_storage.pop(key, None)

    def _written_since(self, t: Tensor, since: int) -> int:
        """The latest op after op ``since`` that wrote in place into memory ``t`` covers; -1 if none."""
        key = storage_key(t)
        entries = self._writes.get(key)
        if not entries or entries[-1][0] <= since or self._written_storage[key]() is not t.untyped_storage():
            return -1
        lo, hi = byte_extent(t)
        for index, wlo, whi in reversed(entries):
            if index <= since:
                break
            if wlo < hi and lo < whi:
                return index
        return -1

    def _with_written_bases(self, written: list[Tensor], outs: list[Tensor]) -> list[Tensor]:
        """An in-place write into a view (``y[:, 0] = 0`` is ``fill_`` on a ``select`` of ``y``) changes the view's
        base too. The base becomes an extra output of the op, so later readers of ``y`` get this op as their
        parent and a saved copy of the value they read (not the pre-write value of ``y``'s producer)."""
        token = self.token
        extra: list[Tensor] = []
        for t in written:
            base = t._base
            if base is None or any(base is o for o in outs) or any(base is o for o in extra):
                continue
            tag = getattr(base, _TAG, None)
            if tag is not None and tag[0] == token:
                extra.append(base)
        return outs + extra if extra else outs

    def watch(self, t: Tensor, entry: tuple[int, int, int]) -> bool:
        """Copy what ``entry`` names before an in-place write into ``t``'s memory; False when ``t`` has none."""
        key = storage_key(t)
        if key is None:
            return False
        self._storage_refs.setdefault(key, []).append(entry)
        return True

    def _copy_before_write(self, written: list[Tensor]) -> None:
        """Copy saved tensors that share memory with tensors an in-place op is about to overwrite."""
        for t in written:
            entries = self._storage_refs.pop(storage_key(t), None)
            for index, what, pos in entries or ():
                if what == 0:
                    saved = self.saved[index]
                    saved[pos] = saved[pos].clone()
                elif what == 2:  # a stored gradient (tl_dist.training)
                    grads = self.training.grads[index]
                    grads[pos] = grads[pos].clone()
                else:
                    consts = self.replay_records[index][4]
                    consts[pos] = _clone_strided(consts[pos])
