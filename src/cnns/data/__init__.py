"""Datasets and host-side batch pipelines: CIFAR binary files, the built-in dataset, augmentation."""
