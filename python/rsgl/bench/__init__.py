"""Benchmarks runnable as `rsgl bench NAME ...` or `python -m rsgl.bench NAME ...`."""
