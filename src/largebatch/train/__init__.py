"""largebatch.train (being built)."""
