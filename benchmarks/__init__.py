"""GPU benchmarks: ``scripts/gpu-bench [suite ...]`` runs the suites and writes ``benchmarks/results/``."""
