"""largebatch.data (being built)."""
