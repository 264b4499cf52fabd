"""Benchmarks: `python -m bench` (the performance suite), `python -m bench.accuracy`, `python -m bench.speculative`,
`python -m bench.quantization` (int8 weights against float32: accuracy and speed)."""
