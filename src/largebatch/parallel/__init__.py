"""largebatch.parallel (being built)."""
