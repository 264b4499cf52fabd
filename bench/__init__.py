"""Benchmarks: `python -m bench` (the performance suite), `python -m bench.accuracy`, `python -m bench.speculative`."""
