"""largebatch.optim (being built)."""
