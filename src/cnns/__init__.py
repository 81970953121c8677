"""cnns: train, validate and benchmark CNN image classifiers on CPUs and CUDA GPUs."""

__version__ = "0.1.0"
