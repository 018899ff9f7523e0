"""The ``tl-dist`` command: merge a run's shards, print its summary, draw it, export it to Perfetto.

Example:
    $ tl-dist merge runs/job42 -o job42.h5     # exit code 1 when findings exist
    $ tl-dist summary job42.h5                 # a merged file, a run directory or one shard
    $ tl-dist draw runs/job42 -o job42.svg
    $ tl-dist export runs/job42 --perfetto job42.json --step 100 --rank 0-7

Exit codes: 0 success, 1 findings exist (unless ``--no-fail``), 2 bad input (missing, unreadable or
unmergeable shards; a message names the file).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import TlDistError

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2


def _open(path: str, *, strict: bool, progress: bool, steps: Any = None, ranks: Any = None) -> Any:
    """A MergedTrace from a run directory, a merged ``.h5`` file, or a single shard (only ``steps`` / ``ranks``
    when given)."""
    from .merge import load_merged, merge_ranks

    p = Path(path)
    if p.is_dir():
        return merge_ranks(p, strict=strict, progress=progress, steps=steps, ranks=ranks)
    if not p.exists():
        raise TlDistError(f"{path}: no such file or directory (expected a run directory or a merged .h5)")
    import h5py

    try:
        with h5py.File(p, "r") as f:
            merged = f.attrs.get("encoding-type") == "tl_dist.merged"
    except OSError as exc:
        raise TlDistError(f"{path}: not a readable HDF5 file: {exc}") from exc
    if merged:
        return load_merged(p, steps=steps, ranks=ranks)
    # One shard: the other ranks of its world are reported as missing_rank findings rather than refused.
    return merge_ranks([p], strict=False, progress=progress, steps=steps, ranks=ranks)


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tl-dist",
        description="Merge tl_dist shards across ranks and inspect the global trace.",
        epilog="Exit codes: 0 ok, 1 findings exist (see --no-fail), 2 bad input.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("path", help="run directory (DIR/rank*/step*.h5), merged .h5 file, or one shard")
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

    p = sub.add_parser("merge", help="merge a run's shards, print the findings, optionally save the result")
    common(p)
    p.add_argument("-o", "--output", help="write the merged trace here (.h5; reopen with tl.load_merged)")
    p = sub.add_parser("summary", help="print the merged summary: findings, stragglers, time per rank")
    common(p)
    p = sub.add_parser("draw", help="draw the global graph with Graphviz")
    common(p)
    p.add_argument("-o", "--output", required=True, help="image file; the format follows its extension")
    p.add_argument("--depth", type=int, default=1, help="collapse module calls deeper than this (default 1)")
    p = sub.add_parser("export", help="export the merged trace")
    common(p)
    p.add_argument("--perfetto", required=True, help="Chrome/Perfetto trace JSON file to write")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tl-dist`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    progress = not args.quiet and sys.stderr.isatty()
    try:
        g = _open(args.path, strict=not args.lenient, progress=progress, steps=args.step, ranks=args.rank)
        if args.command == "merge":
            print(repr(g))
            for f in g.findings:
                print(f"  {'' if f.primary else '(consequence) '}{f}")
            if args.output:
                print(f"wrote {g.save(args.output)}")
        elif args.command == "summary":
            print(g.summary())
        elif args.command == "draw":
            fmt = os.path.splitext(args.output)[1].lstrip(".") or "svg"
            print(f"wrote {g.draw(args.output, format=fmt, depth=args.depth)}")
        elif args.command == "export":
            print(f"wrote {g.to_perfetto(args.perfetto)}")
    except (TlDistError, ValueError) as exc:
        print(f"tl-dist: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if g.findings and not args.no_fail:
        print(
            f"tl-dist: {len(g.findings)} finding(s); exit code {EXIT_FINDINGS} (--no-fail to ignore)",
            file=sys.stderr,
        )
        return EXIT_FINDINGS
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
