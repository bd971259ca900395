"""Benchmarks: `microbench` (the `hpcdl bench` command) and `train_throughput`."""
