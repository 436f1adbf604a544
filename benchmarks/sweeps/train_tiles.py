"""Training-loss launch sweep: the fwd+bwd time of ``indexer_kl_triton`` over ``KlLossConfig`` tile choices at
one V3.2 shape (the ``train`` suite's inputs), each checked against the shipped config's result.

``python benchmarks/sweeps/train_tiles.py [OUT_DIR] [--t T] [--top K] [--grid NAME=V1,V2 ...]`` (CUDA). The grid
defaults to ``block_keys`` 32/64/128 x ``block_d_a`` 64/128 x ``num_warps`` 4/8 at the shipped ``tile_rows``;
``--grid tile_rows=64,128,256`` (any ``KlLossConfig`` field) replaces a dimension. Every record is printed and
appended to ``OUT_DIR/train_tiles.jsonl`` as it arrives (a run cut short keeps what it measured); a config that
fails to compile or to run is recorded with its error. Results go to ``benchmarks/devlog/train.md``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch

from dsa_indexer.bench import harness
from dsa_indexer.bench.suite_train import FLOP_PER_PAIR, SCALE, _attention_lse, _events_us, _inputs, _selection
from dsa_indexer.testing import calc_diff
from dsa_indexer.train import triton as kernels

DEFAULT_GRID = {"block_keys": [32, 64, 128], "block_d_a": [64, 128], "num_warps": [4, 8]}


def _parse(argv: list[str]) -> tuple[Path, int, int | None, dict[str, list[int]]]:
    out, t, top, grid = Path("."), 8192, None, dict(DEFAULT_GRID)
    fields = {f.name for f in dataclasses.fields(kernels.KlLossConfig)}
    args = iter(argv)
    for arg in args:
        if arg == "--t":
            t = int(next(args))
        elif arg == "--top":
            top = int(next(args))
        elif arg == "--grid":
            name, _, values = next(args).partition("=")
            if name not in fields:
                raise SystemExit(f"--grid: {name!r} is not a KlLossConfig field ({sorted(fields)})")
            grid[name] = [int(v) for v in values.split(",")]
        else:
            out = Path(arg)
    return out, t, top, grid


def main(argv: list[str]) -> None:
    out, t, top, grid = _parse(argv)
    out.mkdir(parents=True, exist_ok=True)
    sink = out / "train_tiles.jsonl"
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, weights, attn_q, attn_k = _inputs(t, gen)
    topk = None if top is None else _selection(t, top, gen)
    lse = _attention_lse(attn_q, attn_k, topk)
    pairs = t * (t + 1) // 2 if top is None else sum(min(top, p + 1) for p in range(t))
    bf16_tflops = harness.measure_ceilings()["bf16_tflops"]

    def call(config):
        return kernels.indexer_kl_triton(q, k, weights, attn_q, attn_k, lse, softmax_scale=SCALE, topk_indices=topk,
                                         config=config)

    shipped = kernels.KlLossConfig()
    expected = call(shipped)
    for values in itertools.product(*grid.values()):
        changes = dict(zip(grid, values))
        record = {"T": t, "k": top or "dense", **changes}
        try:
            config = dataclasses.replace(shipped, **changes)
            got = call(config)
            record["diff"] = max(calc_diff(x.float(), y.float()) for x, y in zip(got, expected))
            record["repeats"] = all(torch.equal(x, y) for x, y in zip(got, call(config)))
            del got
            us = _events_us(lambda config=config: call(config), budget_s=3.0, max_reps=5)
            record.update(us=round(us, 1), tflops=round(FLOP_PER_PAIR * pairs / us / 1e6, 1),
                          pct_of_floor=round(100 * FLOP_PER_PAIR * pairs / (bf16_tflops * 1e6) / us, 1),
                          shipped=config == shipped)
        except Exception as error:  # noqa: BLE001 - a config that does not compile or run is a result too
            record["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        torch.cuda.empty_cache()
        print(json.dumps(record), flush=True)
        with sink.open("a") as handle:
            handle.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
