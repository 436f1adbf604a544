"""The table of ``docs/benchmarks.md`` from the committed suite results (``benchmarks/results/<suite>.json``).

    python benchmarks/summary.py            # print the table
    python benchmarks/summary.py --write    # replace the table between the markers of docs/benchmarks.md

One row per timed record of the shipped path (records of non-default launch variants are left out); each row
names the GPU and the date of the run that measured it. ``scripts/gpu-bench`` runs ``--write`` after the suites.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- table: python benchmarks/summary.py --write -->", "<!-- end of table -->"
# Suites in the order the docs present them (the order of scripts/gpu-bench).
SUITES = ("quant_cache", "seq_candidates", "logits", "topk", "step", "sparse_logits", "distributed", "train")


def _shipped(record: dict) -> bool:
    return record.get("default", True) is not False


def _cell(value) -> str:
    return "" if value is None else str(value)


def render() -> str:
    lines = [
        "| suite | op | shape | µs | % of floor | TFLOP/s | TB/s | torch µs | GPU, date |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for suite in SUITES:
        path = RESULTS / f"{suite}.json"
        if not path.exists():
            continue
        for record in filter(_shipped, json.loads(path.read_text())["records"]):
            shape = ", ".join(f"{key}={value}" for key, value in record["shape"].items())
            torch_us = record["baselines"].get("torch")
            lines.append(
                f"| {suite} | `{record['op']}` | {shape} | {record['us']} | {_cell(record['pct_of_floor'])} | "
                f"{_cell(record['tflops'])} | {_cell(record['tbs'])} | {_cell(torch_us)} | "
                f"{record['gpu']}, {record['date']} |"
            )
    return "\n".join(lines) + "\n"


def write() -> None:
    text = DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{render()}{END}{tail}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    elif sys.argv[1:]:
        sys.exit("usage: python benchmarks/summary.py [--write]")
    else:
        sys.stdout.write(render())
