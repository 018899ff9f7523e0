"""The end of a run, framework-free: merge its shards, write ``merged.h5`` and ``timeline.json``, lay the last
step's graph out in the background, and report the findings to a logger.

The Lightning callback runs it at the end of ``fit``; ``tl-dist merge`` runs it on what it opened.

Example:
    >>> from tl_dist.pipeline import finish_run
    >>> out = finish_run("runs/job42", merged="runs/job42/merged.h5", timeline="runs/job42/timeline.json",
    ...                  graph=True)
    >>> out.merged.findings, out.written
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from .errors import MissingToolError
from .merge import MergedTrace, merge_ranks
from .merge.draw import merged_source
from .step_facts import straggler
from .store import shard_path
from .views.draw import GRAPHVIZ_HINT

__all__ = [
    "MAX_DRAWN_NODES",
    "RunOutputs",
    "draw_last_step",
    "findings_table",
    "finish_run",
    "step_straggler",
]

log = logging.getLogger("tl_dist")
MAX_DRAWN_NODES = 5_000
"""graph.svg is not laid out past this many nodes (dot would run for hours; it takes a minute or two for a few
thousand); graph.dot is written."""


@dataclass
class RunOutputs:
    """What :func:`finish_run` made: the merged trace and the files written (a note for the background ones)."""

    merged: MergedTrace
    written: list[str] = field(default_factory=list)


def finish_run(
    run: str | os.PathLike | MergedTrace,
    *,
    merged: str | os.PathLike | None = None,
    timeline: str | os.PathLike | None = None,
    graph: bool = False,
    clusters: Iterable[str] = (),
    logger: logging.Logger | None = log,
) -> RunOutputs:
    """Merge a run (a run folder, or a MergedTrace already opened) and write what is asked for.

    Args:
        run: the run folder (``DIR/rank*/step*.h5``, merged with :func:`tl_dist.merge_ranks`), or a merged trace.
        merged: write the merged trace here (``.h5``; reopen with ``tl.load_merged``).
        timeline: write the Perfetto/Chrome timeline JSON here.
        graph: write ``graph.dot`` of the last captured step into the run folder and lay ``graph.svg`` out
            from it in a detached ``dot`` (:func:`draw_last_step`); needs ``run`` to be the folder.
        clusters: module addresses drawn as clusters (the modules below them collapsed into one node each),
            e.g. a LightningModule's children; none: depth 1.
        logger: where the merge's line, the findings table and the files written go (findings at WARNING, the
            rest at INFO); None: nowhere (the caller reports them).

    Returns:
        :class:`RunOutputs`. A missing Graphviz is logged (``graph.dot`` still written), not raised; a failed
        merge or write raises (``tl.TlDistError``).
    """
    if not isinstance(run, (str, os.PathLike, MergedTrace)):
        raise ValueError(
            f"run must be a run folder (str or os.PathLike) or a MergedTrace, got {type(run).__name__}"
        )
    folder = None if isinstance(run, MergedTrace) else Path(run)
    if graph and folder is None:
        raise ValueError("graph=True draws the last step from the run's shards: pass run as the run folder")
    g = run if isinstance(run, MergedTrace) else merge_ranks(run)
    outputs = RunOutputs(g)
    if merged is not None:
        outputs.written.append(str(g.save(merged)))
    if timeline is not None:
        outputs.written.append(str(g.to_perfetto(str(timeline))))
    if graph:
        try:
            outputs.written.append(draw_last_step(g, folder, clusters, logger=logger))
        except MissingToolError as exc:
            if logger is not None:
                logger.info("tl_dist: skipped graph.svg: %s", exc)
    if logger is not None:
        logger.info(
            "tl_dist: merged steps %s of %d rank(s): %d finding(s)", g.steps, g.world_size, len(g.findings)
        )
        if g.findings:
            logger.warning("tl_dist: findings of the merge:\n%s", findings_table(g.findings))
        if outputs.written:
            logger.info("tl_dist: wrote %s", ", ".join(outputs.written))
    return outputs


def draw_last_step(
    g: MergedTrace, out: Path, clusters: Iterable[str] = (), *, logger: logging.Logger | None = log
) -> str:
    """``graph.dot``, and ``graph.svg`` laid out from it by a detached ``dot``: the ranks of the last captured
    step, ``clusters`` as clusters, everything below them collapsed into one node each.

    Every backward and optimizer op is a node of its own, so a real model's step has thousands of nodes and
    dot can take minutes: it runs in its own process, which outlives the caller, and ``graph.svg`` appears
    when it is done (written under a temporary name, then renamed). Past :data:`MAX_DRAWN_NODES` it is not
    started. Raises ``tl.MissingToolError`` (after writing ``graph.dot``) without Graphviz.
    """
    out = Path(out)
    clusters = set(clusters)
    last = g.steps[-1]
    shards = [shard_path(out, r, last) for r in g.ranks if shard_path(out, r, last).exists()]
    step_graph = g if len(g.steps) == 1 else merge_ranks(shards)
    table = step_graph.rank(g.ranks[0]).module_table
    depths = [d for a, d in zip(table["address"], table["depth"]) if a in clusters]
    source = merged_source(step_graph, depth=min(depths) if depths else 1)
    dot_file = out / "graph.dot"
    dot_file.write_text(source)
    dot = shutil.which("dot")
    if dot is None:
        raise MissingToolError(
            f"Graphviz's `dot` is not on PATH; wrote {dot_file} only. Install Graphviz ({GRAPHVIZ_HINT}), then "
            f"`dot -Tsvg {dot_file} -o {out / 'graph.svg'}`"
        )
    nodes = source.count(" [label=")
    if nodes > MAX_DRAWN_NODES:
        if logger is not None:
            logger.info(
                "tl_dist: %s has %d nodes, too many to lay out in the background; not drawn", dot_file, nodes
            )
        return str(dot_file)
    svg = out / "graph.svg"
    subprocess.Popen(  # noqa: S603 - fixed argv, no shell input from outside
        ["sh", "-c", '"$0" -Tsvg "$1" -o "$2.tmp" && mv "$2.tmp" "$2"', dot, str(dot_file), str(svg)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not killed with the training's process group
    )
    return f"{svg} (laid out in the background)"


def findings_table(findings: Iterable[Any]) -> str:
    """The findings as a text table: step, kind, ranks, message (one row each)."""
    frame = pd.DataFrame(
        [(f.step, f.kind, ",".join(map(str, f.ranks)), f.message) for f in findings],
        columns=["step", "kind", "ranks", "message"],
    )
    return frame.to_string(index=False)


def step_straggler(shards: Sequence[str | os.PathLike], step: int) -> tuple[int, int] | None:
    """The straggler of one captured step from every rank's shard of it: :func:`tl_dist.step_facts.straggler`
    of the merge's own ``stragglers()`` over that step alone -- clocks are aligned per step, so it is what
    ``tl.merge_ranks`` of the whole run says for the step. ``(rank, wait_ns)``, or None when nobody waited
    beyond the clock uncertainty. ``OtelSink(stragglers=True)`` runs it on one rank as the steps come.

    Raises:
        MergeError: a shard is missing or unreadable.

    Example:
        >>> step_straggler([shard_path("runs/job42", r, 100) for r in range(8)], 100)
        (3, 30000000)
    """
    frame = merge_ranks(list(shards), steps=[step]).stragglers()
    return straggler(frame[frame.step == step].to_dict("records"))
