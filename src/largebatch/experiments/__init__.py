"""largebatch.experiments (being built)."""
