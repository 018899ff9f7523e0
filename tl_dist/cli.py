"""The ``tl-dist`` command: merge a run's shards, print its summary, draw it, export it to Perfetto.

Example:
    $ tl-dist merge runs/job42 -o job42.h5     # exit code 1 when findings exist
    $ tl-dist summary job42.h5                 # a merged file or a run directory
    $ tl-dist summary runs/job42/rank00001/step00000100.h5   # one shard: that rank's trace
    $ tl-dist draw runs/job42 -o job42.svg --phase backward
    $ tl-dist export runs/job42 --perfetto job42.json --step 100 --rank 0-7
    $ tl-dist report runs/job42 -o job42.html
    $ tl-dist merge s3://bucket/job42 --scheduler tcp://10.0.0.5:8786   # shards read on a Dask cluster
    $ tl-dist merge s3://bucket/job42 --workers 2 -o s3://bucket/job42-merged --split step   # one file a step
    $ tl-dist summary s3://bucket/job42-merged   # reads the index only

Exit codes: 0 success, 1 findings exist (unless ``--no-fail``), 2 bad input (missing, unreadable or
unmergeable shards; a message names the file). Output cut short by a closed pipe (``| head``) is no error.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import ShardFormatError, TlDistError
from .merge import load_merged, merge_ranks
from .merge.dask_engine import DaskEngine
from .merge.split import is_split
from .pipeline import finish_run
from .schema import PHASES
from .store import file_kind, load, location
from .views.draw import DrawNote

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2


# Library messages name Python arguments; the command's user knows the flags.
_FLAGS = {"strict=False": "--lenient"}


def _open(
    path: str,
    *,
    strict: bool,
    progress: bool,
    steps: Any = None,
    ranks: Any = None,
    engine: Any = "local",
    out: str | None = None,
) -> Any:
    """A MergedTrace from a run directory, a merged ``.h5`` file or a per-step merged folder (only ``steps`` /
    ``ranks`` when given); a Trace from one shard. Each may be a URL (``s3://...``); ``engine`` and ``out``:
    ``merge_ranks``' for a run directory."""
    p = path if location.is_url(path) else Path(path)
    if location.is_dir(p):
        if is_split(p):
            return load_merged(p, steps=steps, ranks=ranks)
        return merge_ranks(
            p, strict=strict, progress=progress, steps=steps, ranks=ranks, engine=engine, out=out
        )
    if not location.exists(p):
        raise TlDistError(
            f"{path}: no such file or directory (expected a run directory, a merged .h5 or a shard)"
        )
    if isinstance(p, str):  # one file at a URL: a local copy, kept while the command runs
        with location.reading(p, keep=True) as local:
            return _open(str(local), strict=strict, progress=progress, steps=steps, ranks=ranks)
    try:
        merged = file_kind(p) == "merged"
    except ShardFormatError as exc:
        raise TlDistError(str(exc)) from exc
    if merged:
        return load_merged(p, steps=steps, ranks=ranks)
    if steps is not None or ranks is not None:
        raise TlDistError(
            f"{path}: --step / --rank select part of a run directory or a merged .h5; this is one shard "
            "(one rank's step)"
        )
    return load(p)


def _is_run_dir(path: str) -> bool:
    """Whether ``path`` is a folder of shards (merged by ``merge_ranks``), not a per-step merged folder."""
    p = path if location.is_url(path) else Path(path)
    return location.is_dir(p) and not is_split(p)


def _int_list(text: str) -> list[int]:
    """``--step`` / ``--rank`` values: ``3``, ``0-7`` or a comma list of those (``0-3,8``)."""
    out: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last) if dash else int(first)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected N, A-B or a comma list of them, got {text!r}"
            ) from None
        if lo < 0 or hi < lo:
            raise argparse.ArgumentTypeError(f"expected non-negative N or A-B with A <= B, got {part!r}")
        out.extend(range(lo, hi + 1))
    return out


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def _engine(args: argparse.Namespace) -> Any:
    """``merge_ranks``' ``engine`` from ``--scheduler`` / ``--workers``."""
    if args.scheduler is None and args.workers is None:
        return "local"
    if args.scheduler is not None and args.workers is not None:
        raise ValueError("--scheduler and --workers exclude each other (the cluster has its own workers)")
    return DaskEngine(scheduler=args.scheduler, workers=args.workers)


def _depth(text: str) -> int | str | None:
    if text in ("auto", "all"):
        return None if text == "all" else "auto"
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected auto, all or a non-negative int; got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tl-dist",
        description="Merge tl_dist shards across ranks and inspect the global trace.",
        epilog="Exit codes: 0 ok, 1 findings exist (see --no-fail), 2 bad input.",
    )
    parser.add_argument("--version", action="version", version=f"tl-dist {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "path",
            help="run directory (DIR/rank*/step*.h5), merged .h5 file or per-step folder, or one shard",
        )
        p.add_argument("--lenient", action="store_true", help="merge despite missing/unreadable shards")
        p.add_argument("--no-fail", action="store_true", help="exit 0 even when findings exist")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.add_argument(
            "--step",
            type=_int_list,
            action="extend",
            metavar="STEPS",
            help="only these steps: 100, 100-200, 1,5",
        )
        p.add_argument(
            "--rank", type=_int_list, action="extend", metavar="RANKS", help="only these ranks: 0-7,12"
        )
        p.add_argument(
            "--scheduler",
            metavar="ADDRESS",
            help="read the shards on this Dask cluster (tcp://HOST:PORT; needs tl_dist[scale])",
        )
        p.add_argument(
            "--workers",
            type=_positive,
            metavar="N",
            help="read the shards on a local Dask cluster of N worker processes (needs tl_dist[scale])",
        )

    p = sub.add_parser("merge", help="merge a run's shards, print the findings, optionally save the result")
    common(p)
    p.add_argument("-o", "--output", help="write the merged trace here (.h5; reopen with tl.load_merged)")
    p.add_argument(
        "--split",
        choices=["step"],
        help="with -o: write a folder of one file per step and an index, which tl.load_merged reads lazily "
        "(with --scheduler / --workers each step's file is written on the workers)",
    )
    p = sub.add_parser(
        "summary", help="print the summary: findings, stragglers, time per rank (one shard: its ops)"
    )
    common(p)
    p = sub.add_parser("draw", help="draw the graph with Graphviz")
    common(p)
    p.add_argument("-o", "--output", required=True, help="image file; the format follows its extension")
    p.add_argument(
        "--depth",
        type=_depth,
        default="auto",
        help="collapse module calls deeper than this; auto (default): when over ~300 nodes; all: every op",
    )
    p.add_argument("--phase", action="append", choices=PHASES, help="draw only this phase's ops (repeatable)")
    p.add_argument("--show-all", action="store_true", help="also draw views, detach, allocations, markers")
    p = sub.add_parser("report", help="write a self-contained HTML report (needs tl_dist[report])")
    common(p)
    p.add_argument("-o", "--output", required=True, help="the .html file to write")
    p = sub.add_parser("export", help="export the trace")
    common(p)
    p.add_argument("--perfetto", required=True, help="Chrome/Perfetto trace JSON file to write")
    return parser


def _version() -> str:
    from . import __version__

    return __version__


def _run(args: argparse.Namespace, target: Any, wrote: bool = False) -> None:
    """Carry out ``args.command`` on a MergedTrace or (one shard) a Trace; ``wrote``: the merge already wrote
    the per-step folder of ``merge --split``."""
    if args.command == "merge":
        # The end-of-run pipeline the Lightning callback runs too; the CLI reports on stdout itself.
        split = args.split is not None
        outputs = finish_run(target, merged=None if split else args.output or None, logger=None)
        if split and not wrote:  # a merged file or folder given: written here, not by the merge
            target.save(args.output, split=args.split)
        print(repr(target))
        for f in target.findings:
            print(f"  {'' if f.primary else '(consequence) '}{f}")
        for path in ([args.output] if split else []) + outputs.written:
            print(f"wrote {path}")
    elif args.command == "summary":
        print(target.summary())
    elif args.command == "draw":
        fmt = os.path.splitext(args.output)[1].lstrip(".") or "svg"
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always", DrawNote)
            path = target.draw(
                args.output, format=fmt, depth=args.depth, phase=args.phase, show_all=args.show_all
            )
        print(f"wrote {path}")
        for note in notes:
            print(f"tl-dist: note: {note.message}", file=sys.stderr)
    elif args.command == "report":
        print(f"wrote {target.report(args.output)}")
    elif args.command == "export":
        print(f"wrote {target.to_perfetto(args.perfetto)}")


def _show_warning(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
    # A command-line user gets one line per warning; Python's default adds tl_dist's file:line and source.
    print(f"tl-dist: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tl-dist`` console script; returns the exit code."""
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    progress = not args.quiet and sys.stderr.isatty()
    split = getattr(args, "split", None)
    out = args.output if split is not None else None
    try:
        if split is not None and not args.output:
            raise ValueError("--split step writes a folder: give it with -o FOLDER")
        target = _open(
            args.path,
            strict=not args.lenient,
            progress=progress,
            steps=args.step,
            ranks=args.rank,
            engine=_engine(args),
            out=out,
        )
        # Whether the merge wrote the folder (a run directory merged with out=; on Dask, on the workers).
        wrote = out is not None and _is_run_dir(args.path)
        if args.command == "merge" and not hasattr(target, "findings"):
            # One shard merged: the other ranks of its world are reported as missing_rank findings.
            target = merge_ranks([args.path], strict=False, progress=progress, out=out)
            wrote = out is not None
        _run(args, target, wrote)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped (`| head`): not an error. Point stdout at /dev/null so the interpreter's final
        # flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (TlDistError, ValueError) as exc:
        message = str(exc)
        for python, flag in _FLAGS.items():
            message = message.replace(python, flag)
        print(f"tl-dist: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    findings = getattr(target, "findings", ())
    if findings and not args.no_fail:
        print(
            f"tl-dist: {len(findings)} finding(s); exit code {EXIT_FINDINGS} (--no-fail to ignore)",
            file=sys.stderr,
        )
        return EXIT_FINDINGS
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
