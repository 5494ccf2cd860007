"""Small real models and data used by the demo, the tests and the benchmarks."""
