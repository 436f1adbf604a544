"""Benchmarks of the shipped ops on the current device: ``dsa-indexer bench`` (or ``scripts/gpu-bench``).

A suite is a module ``suite_<name>.py`` with ``run(ceilings) -> list[record]``; GPU suites time the
Triton kernels against the torch reference on the shapes of DESIGN.md §12 and check their results
first. On a machine without CUDA the ``cpu`` suite times the references on small shapes. Variant sweeps
and kernel timelines are development tools and live outside the package, under ``benchmarks/``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import torch

from . import harness

GPU_SUITES = ("quant_cache", "seq_candidates", "logits", "topk", "step", "sparse_logits")
MULTI_GPU_SUITES = ("distributed",)
# Run only when named (``scripts/gpu-bench train``): the training loss takes minutes, not seconds.
OPT_IN_GPU_SUITES = ("train",)
CPU_SUITES = ("cpu",)
PEER_LIBRARIES = ("deep_gemm", "flashinfer", "vllm", "sgl_kernel")


def default_suites() -> tuple[str, ...]:
    if not torch.cuda.is_available():
        return CPU_SUITES
    return GPU_SUITES + (MULTI_GPU_SUITES if torch.cuda.device_count() >= 2 else ())


def installed_peers() -> list[str]:
    import importlib.util

    return [name for name in PEER_LIBRARIES if importlib.util.find_spec(name) is not None]


def all_suites() -> tuple[str, ...]:
    return GPU_SUITES + MULTI_GPU_SUITES + OPT_IN_GPU_SUITES + CPU_SUITES


def describe_suites() -> list[tuple[str, str, str]]:
    """``(name, where it runs, first line of its docstring)`` of every suite (each module is imported)."""
    where = {**dict.fromkeys(GPU_SUITES, "GPU"), **dict.fromkeys(MULTI_GPU_SUITES, "GPU (NCCL with 2+)"),
             **dict.fromkeys(OPT_IN_GPU_SUITES, "GPU, only when named"), **dict.fromkeys(CPU_SUITES, "CPU")}
    rows = []
    for name in all_suites():
        module = importlib.import_module(f"{__name__}.suite_{name}")
        if not callable(getattr(module, "run", None)):
            raise TypeError(f"suite {name} has no run(ceilings)")
        rows.append((name, where[name], (module.__doc__ or "").strip().splitlines()[0]))
    return rows


def run_suites(
    suites: tuple[str, ...], folder: Path, progress: Callable[[str], None] | None = None
) -> tuple[dict[str, float], list[dict]]:
    """Measure the ceilings, run ``suites`` and write their results to ``folder`` (each suite's file rewritten
    as its records arrive)."""
    known = all_suites()
    unknown = [s for s in suites if s not in known]
    if unknown:
        raise ValueError(f"suites must be among {known}, got {unknown}")
    needs_gpu = [s for s in suites if s in GPU_SUITES + MULTI_GPU_SUITES + OPT_IN_GPU_SUITES]
    if needs_gpu and not torch.cuda.is_available():
        raise ValueError(f"suites {needs_gpu} need a CUDA device; on this machine run the 'cpu' suite")
    if needs_gpu:
        ceilings = harness.measure_ceilings()
    else:
        from .suite_cpu import measure_ceilings

        ceilings = measure_ceilings()
    rows: list[dict] = []
    for name in suites:
        if progress is not None:
            progress(name)
        # A suite returns its records or yields them one by one; the files are rewritten as each arrives, so a
        # run cut short (a time limit, a crash) keeps what it measured.
        suite_rows: list[dict] = []
        for row in importlib.import_module(f"{__name__}.suite_{name}").run(ceilings):
            suite_rows.append(row)
            harness.write_results(name, suite_rows, ceilings, folder)
        if not suite_rows:
            harness.write_results(name, suite_rows, ceilings, folder)
        rows.extend(suite_rows)
    return ceilings, rows


def require_matplotlib() -> None:
    """Raise ``ValueError`` now when ``plot`` could not run (before a suite spends minutes)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'dsa-indexer[bench]'")


def plot(rows: list[dict], path: Path, environment: dict[str, str] | None = None) -> None:
    """A PNG bar chart of each measurement as a percentage of its floor (needs matplotlib); the title names
    ``environment`` (a results file's ``"environment"``; default: this machine now)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['op']} " + ",".join(f"{k}={v}" for k, v in r["shape"].items()) for r in rows]
    values = [r["pct_of_floor"] or 0.0 for r in rows]
    figure, axis = plt.subplots(figsize=(10, 0.28 * len(rows) + 1.5))
    axis.barh(range(len(rows)), values, color=["tab:green" if v >= 70 else "tab:orange" for v in values])
    axis.set_yticks(range(len(rows)), labels, fontsize=7)
    axis.invert_yaxis()
    axis.axvline(100, color="black", linewidth=0.8)
    axis.set_xlabel("% of the floor (bandwidth or FP8 tensor-core bound, measured ceilings)")
    env = environment or harness.environment()
    axis.set_title(f"dsa-indexer on {env['gpu']}\ntorch {env['torch']}, triton {env['triton']}, {env['date']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
