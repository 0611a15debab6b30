"""Slow, obviously correct decoders: the test oracles and the benchmark baselines (never imported by the engine).

`decoders` (full recompute, branch-sequential, parallel copy, monolithic), `front` (the front half of decoding one
video, both model families: their engine programs driven by HF forwards), `release_loop` (the release's own decoding
loop), `ablation` (the ablation models' decoders), `speedup` (the engine against the monolithic decoder).
"""
