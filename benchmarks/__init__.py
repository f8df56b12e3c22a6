"""Benchmarks of fusedattn against its anchors; run from the repository root as
modules (``python -m benchmarks.bench_attention``), with fusedattn installed or on
PYTHONPATH. Results and the current result page: benchmarks/results/."""
