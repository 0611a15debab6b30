"""Benchmarks and measurements (run as `python -m bench.<name>`); they import the product, never the tests."""
