"""Process groups, launchers and the parallel wrappers (replicas, BN spans, optimiser sharding)."""
