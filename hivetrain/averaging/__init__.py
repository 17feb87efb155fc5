"""averaging."""
