"""diloco."""
