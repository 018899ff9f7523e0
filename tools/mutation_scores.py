"""Per-module mutation scores from mutmut's recorded results; ``make mutation`` prints them after the runs.

Killed = the tests failed (or timed out) on the mutant. The score is killed / mutants of the module; mutants no
test reaches count as surviving. Survivors are listed by name: ``mutmut show NAME`` prints the change.

Example:
    .venv/bin/python tools/mutation_scores.py            # table, then every survivor
    .venv/bin/python tools/mutation_scores.py --target 85  # exit 1 when a module scores below 85 %
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

KILLED = {"killed", "timeout", "segfault"}  # the mutant was noticed
NAME = re.compile(r"^\s*(?P<name>(?P<module>[\w.]+?)\.x[ǁ_]\S+): (?P<status>.+)$")


def results() -> dict[str, dict[str, str]]:
    """module -> {mutant name -> status} from ``mutmut results --all true``."""
    mutmut = Path(sys.executable).with_name("mutmut")
    out = subprocess.run(
        [str(mutmut), "results", "--all", "true"], capture_output=True, text=True, check=True
    )
    by_module: dict[str, dict[str, str]] = defaultdict(dict)
    for line in out.stdout.splitlines():
        m = NAME.match(line)
        if m:
            by_module[m["module"]][m["name"]] = m["status"].strip()
    return by_module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=None, help="minimum killed percentage per module")
    args = parser.parse_args()
    by_module = results()
    if not by_module:
        print("no mutmut results: run `make mutation` first")
        return 1
    low, unrun = [], []
    print(f"{'module':<24}{'killed':>8}{'total':>7}{'score':>8}  not run")
    for module, statuses in sorted(by_module.items()):
        checked = {n: s for n, s in statuses.items() if s != "not checked"}
        killed = sum(s in KILLED for s in checked.values())
        if not checked:  # mutmut forgets every result when [tool.mutmut]'s test selection changes
            unrun.append(module)
            print(f"{module:<24}{'-':>8}{'-':>7}{'-':>8}  {len(statuses)}")
            continue
        score = 100 * killed / len(checked)
        if args.target is not None and score < args.target:
            low.append(module)
        print(f"{module:<24}{killed:>8}{len(checked):>7}{score:>7.1f}%  {len(statuses) - len(checked)}")
    print("\nsurvivors (mutmut show NAME):")
    for statuses in by_module.values():
        for name, status in sorted(statuses.items()):
            if status not in KILLED and status != "not checked":
                print(f"  {name}: {status}")
    if unrun:
        print(f"\nnot run: {', '.join(unrun)}")
    if low:
        print(f"\nbelow {args.target:.0f} %: {', '.join(low)}")
    return 1 if low or (unrun and args.target is not None) else 0


if __name__ == "__main__":
    sys.exit(main())
