"""The ``dsa-indexer`` command: ``demo`` (the main job), ``train-demo``, ``bench`` and ``info``."""

from __future__ import annotations

import argparse
import json
import platform
import sys

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class _OneLineErrorParser(argparse.ArgumentParser):
    """Bad flags end in one line on stderr and exit status 2, never a traceback."""

    def error(self, message: str):
        self.exit(2, f"dsa-indexer: error: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(prog="dsa-indexer", description="DeepSeek Sparse Attention lightning indexer")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineErrorParser)
    demo = commands.add_parser("demo", help="simulated serving run, checked against exact and fp32 oracles")
    demo.add_argument("--config", choices=("v32", "v41"), default="v32", help="DeepSeek-V3.2 or V4.1 indexer")
    demo.add_argument("--fmt", choices=("fp8", "mxfp4"), default=None, help="cache format (default: the config's)")
    demo.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    demo.add_argument("--requests", type=_positive, default=4)
    demo.add_argument("--prompt-len", type=_positive, default=1024, help="longest prompt, in tokens")
    demo.add_argument("--decode-steps", type=_positive, default=6)
    demo.add_argument("--next-n", type=_positive, default=2, help="tokens per decode step (1 + speculative)")
    demo.add_argument("--topk", type=_positive, default=128, help="keys selected per token")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--dcp", type=_positive, default=1, metavar="N",
                      help="also run with decode context parallelism over N processes and compare")
    demo.add_argument("--json", metavar="PATH",
                      help="write the numbers as JSON ('-': standard output, and the tables go to standard error)")
    train = commands.add_parser("train-demo", help="warm up a random indexer against a small causal attention "
                                "with the KL loss; plots loss and top-k recall")
    train.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    train.add_argument("--steps", type=_positive, default=120)
    train.add_argument("--sequences", type=_positive, default=4, help="sequences per packed batch")
    train.add_argument("--seq-len", type=_positive, default=128, help="tokens per sequence")
    train.add_argument("--topk", type=_positive, default=16, help="k of the recall")
    train.add_argument("--lr", type=_positive_float, default=2e-2, help="Adam learning rate")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--plot", default="dsa-indexer-train-demo.png", metavar="PNG", help="where to draw the curves")
    train.add_argument("--json", metavar="PATH", help="write the curves as JSON")
    bench = commands.add_parser("bench", help="time every op on this device against its floor and torch")
    bench.add_argument("--suite", action="append", dest="suites", metavar="NAME",
                       help="quant_cache, seq_candidates, logits, topk, step, sparse_logits (GPU), distributed (ranks "
                            "simulated on 1 GPU, NCCL with 2+), train (GPU, only when named) or cpu; repeatable "
                            "(default: all for the device but train)")
    bench.add_argument("--out", default="dsa-indexer-bench", metavar="DIR", help="folder for <suite>.json and .md")
    bench.add_argument("--plot", metavar="PNG", help="also draw each result as a percentage of its floor")
    bench.add_argument("--list", action="store_true", help="list the suites and exit")
    commands.add_parser("info", help="versions, devices and available backends")
    return parser


def _run_demo(args, console: Console) -> int:
    from .demo import DemoOptions, run_demo, run_demo_dcp

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            console.print("dsa-indexer: error: --device cuda but no CUDA device is available", style="red")
            return 2
        if args.dcp > torch.cuda.device_count():
            console.print(f"dsa-indexer: error: --dcp {args.dcp} needs {args.dcp} GPUs", style="red")
            return 2
    options = DemoOptions(
        config=args.config, fmt=args.fmt, device=args.device, requests=args.requests, prompt_len=args.prompt_len,
        decode_steps=args.decode_steps, next_n=args.next_n, topk=args.topk, seed=args.seed, dcp=args.dcp,
    )
    columns = (TextColumn("[bold]serving"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    if args.device == "cuda":
        # Triton compiles each kernel variant on first use: one untimed pass keeps compilation out of the numbers.
        with console.status("compiling the Triton kernels (untimed warm-up run)"):
            run_demo(options)
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("steps", total=None)
        update = lambda done, total: progress.update(task, completed=done, total=total)  # noqa: E731
        result = run_demo_dcp(options, update) if args.dcp > 1 else run_demo(options, update)

    steps = Table(title=f"dsa-indexer demo — {args.config}, {result.fmt}, {args.device}")
    for name in ("step", "decode tok", "prefill tok", "padded", "rows = oracle", "recall vs fp32"):
        steps.add_column(name, justify="right")
    for s in result.steps:
        steps.add_row(
            str(s.step), str(s.decode_tokens), str(s.prefill_tokens), "yes" if s.padded else "",
            f"{s.rows_equal}/{s.rows_checked}" + (f" (+{s.rows_near_tie} tie)" if s.rows_near_tie else ""),
            f"{s.recall:.3f}",
        )
    console.print(steps)
    stages = Table(title="time per stage")
    stages.add_column("stage")
    stages.add_column("ms", justify="right")
    for name, seconds in sorted(result.stage_seconds.items(), key=lambda item: -item[1]):
        stages.add_row(name, f"{seconds * 1e3:.1f}")
    console.print(stages)
    ties = ""
    if result.agreement_within_ties != result.agreement:
        ties = f"(rows differing only at ties within kernel rounding: {result.agreement_within_ties - result.agreement:.2%})   "
    console.print(
        f"agreement with the exact oracle: [bold]{result.agreement:.2%}[/] {ties}  "
        f"recall vs fp32 indexer: [bold]{result.recall_vs_fp32:.3f}[/]   "
        f"tokens/s: [bold]{result.tokens_per_s:,.0f}[/]"
    )
    dcp_ok = True
    if result.dcp_rows:
        dcp_ok = result.dcp_rows_equal == result.dcp_rows
        console.print(
            f"DCP over {args.dcp} ranks: {result.dcp_rows_equal}/{result.dcp_rows} merged rows equal the single-process run"
        )
    if args.json == "-":
        json.dump(result.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif args.json:
        with open(args.json, "w") as handle:
            json.dump(result.to_json(), handle, indent=2)
    return 0 if result.agreement_within_ties == 1.0 and dcp_ok else 1


def _run_train_demo(args, console: Console) -> int:
    import importlib.util

    import torch

    from .train.demo import TrainDemoOptions, plot_train_demo, run_train_demo

    if importlib.util.find_spec("matplotlib") is None:
        console.print("dsa-indexer: error: train-demo draws its curves with matplotlib, which is not installed "
                      "(pip install matplotlib)", style="red")
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        console.print("dsa-indexer: error: --device cuda but no CUDA device is available", style="red")
        return 2
    options = TrainDemoOptions(device=args.device, steps=args.steps, sequences=args.sequences, seq_len=args.seq_len,
                               topk=args.topk, lr=args.lr, seed=args.seed)
    every = max(1, args.steps // 10)
    console.print(f"[bold]train-demo[/]: {args.sequences} × {args.seq_len} tokens per step, indexer "
                  f"{options.index_heads} heads × {options.index_dim}, attention {options.heads} heads, {args.device}")
    console.print(f"{'step':>6} {'loss':>10} {'top-' + str(args.topk) + ' recall':>16}")

    def report(step: int, loss: float, recall: float) -> None:
        if step % every == 0 or step == args.steps - 1:
            console.print(f"{step + 1:>6} {loss:>10.4f} {recall:>16.3f}")

    threads = torch.get_num_threads()
    if args.device == "cpu":
        # The demo's tensors are small: more intra-op threads spend more time synchronising than computing.
        torch.set_num_threads(1)
    try:
        result = run_train_demo(options, report)
    finally:
        torch.set_num_threads(threads)
    plot_train_demo(result, args.plot)
    console.print(f"recall {result.recalls[0]:.3f} → [bold]{result.recalls[-1]:.3f}[/], loss {result.losses[0]:.3f} → "
                  f"[bold]{result.losses[-1]:.3f}[/] in {result.seconds:.1f} s; curves written to {args.plot}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result.to_json(), handle, indent=2)
    return 0


def _run_bench(args, console: Console) -> int:
    from pathlib import Path

    from . import bench

    if args.list:
        table = Table(title="dsa-indexer bench suites")
        for column in ("suite", "runs on", "measures"):
            table.add_column(column)
        for name, where, summary in bench.describe_suites():
            table.add_row(name, where, escape(summary))
        console.print(table)
        return 0
    if args.plot:
        bench.require_matplotlib()
    suites = tuple(args.suites) if args.suites else bench.default_suites()
    env = bench.harness.environment()
    console.print(f"[bold]dsa-indexer bench[/] on {env['gpu']} — torch {env['torch']}, triton {env['triton']}, {env['date']}")
    peers = bench.installed_peers()
    console.print(f"peer libraries installed: {', '.join(peers) if peers else 'none'} (timed only through the torch baseline)")
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("measuring ceilings", total=len(suites))
        done = []

        def advance(name: str) -> None:
            if done:
                progress.advance(task)
            done.append(name)
            progress.update(task, description=f"suite {name}")

        ceilings, rows = bench.run_suites(suites, Path(args.out), progress=advance)
    flops_unit, flops_scale = _rate_unit([ceilings["fp8_tflops"]], "FLOP/s")
    bytes_unit, bytes_scale = _rate_unit([ceilings["copy_tbs"], ceilings["read_tbs"]], "B/s")
    console.print(
        f"ceilings measured now: copy {ceilings['copy_tbs'] * bytes_scale:.3g} {bytes_unit}, "
        f"read {ceilings['read_tbs'] * bytes_scale:.3g} {bytes_unit}, "
        f"matmul {ceilings['fp8_tflops'] * flops_scale:.3g} {flops_unit}"
    )
    table = Table(title="results (median; % of floor = floor time / measured time)")
    for name in ("op", "shape", "µs", "floor µs", "% floor", flops_unit, bytes_unit, "× torch"):
        table.add_column(name, justify="left" if name in ("op", "shape") else "right")
    for r in rows:
        torch_us = next(iter(r["baselines"].values()), None)
        table.add_row(
            r["op"], ",".join(f"{k}={v}" for k, v in r["shape"].items()), f"{r['us']:.1f}", f"{r['floor_us']:.1f}",
            f"{r['pct_of_floor']}", _rate(r["tflops"], flops_scale), _rate(r["tbs"], bytes_scale),
            f"{torch_us / r['us']:.1f}" if torch_us else "",
        )
    console.print(table)
    console.print(f"JSON and Markdown written to {args.out}/")
    if args.plot:
        bench.plot(rows, Path(args.plot))
        console.print(f"plot written to {args.plot}")
    return 0


def _rate_unit(ceilings: list[float], base: str) -> tuple[str, float]:
    """``(column title, factor from tera-units)``: tera on machines whose ceilings reach 1 T (GPUs), giga
    below (a CPU's TFLOP/s rounds to 0.0)."""
    return (f"T{base}", 1.0) if max(ceilings) >= 1.0 else (f"G{base}", 1e3)


def _rate(tera: float | None, scale: float) -> str:
    return "" if tera is None else f"{tera * scale:.3g}"


def _run_info(console: Console) -> int:
    import torch

    from . import __version__, backend

    table = Table(title="dsa-indexer info", show_header=False)
    table.add_row("dsa-indexer", __version__)
    table.add_row("python", platform.python_version())
    table.add_row("torch", torch.__version__)
    if backend.triton_available():
        import triton

        table.add_row("triton", triton.__version__)
    else:
        table.add_row("triton", escape("not installed (pip install 'dsa-indexer[triton]')"))
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            table.add_row(f"cuda:{index}", f"{torch.cuda.get_device_name(index)} (sm_{major}{minor})")
        triton_reason = "available" if backend.triton_available() else "Triton is not installed"
    else:
        table.add_row("cuda", "no CUDA device")
        triton_reason = "needs a CUDA device (or TRITON_INTERPRET=1 for tests)"
    table.add_row("backend: reference", "available (PyTorch, any device)")
    table.add_row("backend: triton", triton_reason)
    table.add_row("backend override", f"{backend.ENV_VAR}={backend.requested_backend('auto')}")
    console.print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # With --json - standard output carries only the JSON.
    console = Console(stderr=getattr(args, "json", None) == "-")
    try:
        if args.command == "demo":
            return _run_demo(args, console)
        if args.command == "bench":
            return _run_bench(args, console)
        if args.command == "train-demo":
            return _run_train_demo(args, console)
        return _run_info(console)
    except (ValueError, TypeError) as error:
        print(f"dsa-indexer: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
