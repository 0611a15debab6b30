"""Parity with the published release's own inference: `python -m infer.parity DIR`."""
