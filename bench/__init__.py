"""Benchmarks of hivetrain kernels; run from the repository root, e.g. ``python -m bench.codec``."""
