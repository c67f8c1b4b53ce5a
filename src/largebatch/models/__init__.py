"""largebatch.models (being built)."""
