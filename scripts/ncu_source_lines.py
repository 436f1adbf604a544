"""Stall samples per source line of an ncu source-level profile, the heaviest first.

Export the profile's source page first (Triton kernels carry line info, so the lines are those of the ``.py``
files, each sample charged to the innermost inlined line):

    ncu --import-source yes --section SourceCounters -k regex:KERNEL -c 1 -o prof python3 case.py
    ncu -i prof.ncu-rep --page source --csv --print-source cuda,sass > prof.csv
    python3 scripts/ncu_source_lines.py prof.csv [TOP]

Prints, per line: samples, share of all samples, file:line, the source text, instructions executed and the three
largest stall reasons.
"""

from __future__ import annotations

import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def _count(text: str) -> int:
    try:
        return int(text)
    except ValueError:  # "-" on lines without samples
        return 0


def source_lines(path: str) -> list[tuple[str, int, str, dict[str, str]]]:
    """``(file, line, source, columns)`` of every source line of the exported CSV (SASS rows skipped)."""
    lines, header, current_file = [], None, ""
    with open(path, newline="") as handle:
        for row in csv.reader(handle):
            if not row:
                continue
            if row[0] == "File Path":
                current_file = row[1].rsplit("/", 1)[-1]
            elif row[0] == "Line No":
                header = row
            elif header is not None and len(row) == len(header) and row[0]:
                lines.append((current_file, int(row[0]), row[1], dict(zip(header, row))))
    return lines


def main(path: str, top: int = 40) -> None:
    lines = source_lines(path)
    if not lines:
        raise SystemExit(f"{path}: no source lines (was it exported with --page source --csv?)")
    stalls = [name for name in lines[0][3] if name.startswith("stall_") and "Not Issued" not in name]
    total = sum(_count(columns[SAMPLES]) for *_, columns in lines)
    print(f"total samples {total}")
    for file, line, source, columns in sorted(lines, key=lambda entry: -_count(entry[3][SAMPLES]))[:top]:
        samples = _count(columns[SAMPLES])
        reasons = sorted(((_count(columns[name]), name[len("stall_"):]) for name in stalls), reverse=True)[:3]
        print(f"{samples:6d} {100 * samples / max(total, 1):5.1f}% {file}:{line:<5} {source.strip()[:70]:70} "
              f"inst={columns['Instructions Executed']:>8}  "
              + " ".join(f"{name}={value}" for value, name in reasons if value))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
