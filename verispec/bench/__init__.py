"""Benchmarking: evaluation prompt sets, the harness that times methods against plain decoding."""
