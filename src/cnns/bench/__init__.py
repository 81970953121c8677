"""Benchmarks: training/inference throughput against the plain PyTorch loop, and the input pipeline alone."""
