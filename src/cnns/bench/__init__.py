"""Benchmarks: training/inference throughput against the plain PyTorch loop, and the input pipeline alone."""

import logging

# torch.utils.benchmark (the timers here) imports torch.utils.cpp_extension, which warns on stderr at import where it
# finds a CUDA_HOME but no CUDA runtime ("No CUDA runtime is found, using CUDA_HOME=..."): nothing here compiles C++,
# and a command's stderr holds its own lines only.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
