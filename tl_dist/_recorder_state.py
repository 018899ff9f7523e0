"""What the recorder's helpers read and write on the recorder that owns them.

The module tracker (``_modules``), the phase tracker (``_phases``), the training state (``training``) and the
dispatch modes (``_modes``) are
owned by a ``Recorder`` (``_recorder``), which imports them. They see their owner through these protocols, so
that none of them imports the recorder back (no import cycle, not even a type-only one).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ._source import SourceLocator


class ModuleState(Protocol):
    """The part of the module tracker the training state reads."""

    params: dict[int, str]  # id(parameter or buffer) -> its qualified name

    def live_modules(self) -> list[torch.nn.Module]: ...


class CommState(Protocol):
    """The part of the collective log the dispatch modes call."""

    def waited(self, args: tuple, t1: int) -> None: ...


class RecorderState(Protocol):
    """The recorder as its helpers see it: the rows so far, the phase, and the few calls they make back."""

    token: int  # this capture's tag on the tensors it made
    n_ops: int
    phase: str
    step_source: str | None  # where the running optimizer.step() was called
    rows: list[tuple]
    pending: tuple[tuple, list[torch.Tensor]] | None  # the last op's link (token, index, ...) and outputs
    node_ops: dict[int, int]  # autograd node sequence number -> the forward op that made the node
    # Sequence numbers of nodes tagged in their metadata (a superset: another thread's node may share one).
    tagged_nodes: set[int]
    seq_floor: int  # the autograd sequence counter when the window opened: lower numbers are not its ops'
    output_of: dict[int, list[str]]  # op index -> modules whose output it produced
    locate: SourceLocator | None
    compiled: bool  # the window records in C (_fastpath.available() when it opened)
    modules: ModuleState
    comm: CommState

    def on_op(self, func: Any, args: tuple, kwargs: dict, subclass: bool = False) -> Any: ...

    def watch(self, t: torch.Tensor, entry: tuple[int, int, int]) -> None: ...

    def module_output(self, address: str, leaves: list) -> tuple[tuple[int, ...], tuple[int, ...]]: ...
