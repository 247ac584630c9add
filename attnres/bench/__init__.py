"""Benchmarks: `attnres bench train` (step time, peak memory) and `attnres bench op` (bandwidth)."""
