"""largebatch.memory (being built)."""
