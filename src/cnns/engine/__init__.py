"""The training step, the training loop, evaluation, and the feed that moves batches to the device."""
