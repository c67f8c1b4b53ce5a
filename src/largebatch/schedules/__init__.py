"""largebatch.schedules (being built)."""
