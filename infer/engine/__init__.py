"""The decoding engine: a token-budget scheduler and one decode step for many videos over a paged KV cache.

Nothing here imports the slow reference decoders (`infer.oracles`) or serving; `core.CaptionEngine` is the entry point.
"""
