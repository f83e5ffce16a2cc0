"""The seam: the RolloutBackend interface and the typed messages that cross it."""
