"""Run benchmark suites: ``python -m benchmarks.run [suite ...]`` (default: every suite).

A suite is a module ``benchmarks/bench_<name>.py`` with ``run(ceilings) -> list[record]``. Results go to
``benchmarks/results/<name>.json`` and ``.md`` (and to ``$OUT`` when set, for the device tool).
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path

from benchmarks import harness


def main(names: list[str]) -> int:
    available = sorted(p.stem.removeprefix("bench_") for p in Path(__file__).parent.glob("bench_*.py"))
    names = names or available
    unknown = [n for n in names if n not in available]
    if unknown:
        print(f"unknown suites {unknown}; available: {available}", file=sys.stderr)
        return 2
    ceilings = harness.measure_ceilings()
    print("ceilings:", {k: round(v, 2) for k, v in ceilings.items()})
    all_rows = []
    for name in names:
        rows = importlib.import_module(f"benchmarks.bench_{name}").run(ceilings)
        path = harness.write_results(name, rows, ceilings)
        if os.environ.get("OUT"):
            shutil.copy(path, os.environ["OUT"])
            shutil.copy(path.with_suffix(".md"), os.environ["OUT"])
        all_rows.extend(rows)
    harness.print_table(all_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
