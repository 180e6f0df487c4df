"""Benchmarks: each module's measuring functions return numbers; only ``main`` prints."""
