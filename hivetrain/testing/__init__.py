"""Harness code shared by tests, benchmarks and the chaos runner: launching real local swarms and reading results."""
