"""peers."""
