"""Decode speed-up of the parallel engine over the monolithic decoder, on real videos.

    report = measure_speedup(model, samples, cfg.infer)

For each sample the engine decodes first (free running); the monolithic decoder
then decodes the same video forced to the same number of events and the same
caption lengths (infer.engine.sampling.DecodeControl), so both generate the same token
count and the ratio of their wall times is the speed-up a user would see on
these videos. Used by the driver's caption stage for its summary line;
bench/decode.py is the controlled benchmark.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from infer.engine.core import CaptionEngine
from infer.engine.sampling import DecodeControl
from infer.oracles.ablation import caption_engine
from pipeline.config import InferConfig


def measure_speedup(model, samples: list, cfg: InferConfig) -> dict[str, Any]:
    """Side-by-side wall times (ms) and the speed-up (monolithic / parallel) over `samples`."""
    parallel = CaptionEngine(model, dataclasses.replace(cfg, decoder="parallel", temperature=0.0))
    mono = caption_engine(model, dataclasses.replace(cfg, decoder="monolithic", temperature=0.0))
    parallel.decode(samples[0])  # warm-up (kernels, allocator)
    totals = {"parallel_ms": 0.0, "monolithic_ms": 0.0, "parallel_steps": 0, "monolithic_steps": 0, "tokens": 0}
    for sample in samples:
        t0 = time.perf_counter()
        fast = parallel.decode(sample)
        t1 = time.perf_counter()
        control = DecodeControl(num_events=fast.num_events, lengths=[max(1, len(t)) for t in fast.tokens])
        slow = mono.decode(sample, control)
        t2 = time.perf_counter()
        totals["parallel_ms"] += 1000 * (t1 - t0)
        totals["monolithic_ms"] += 1000 * (t2 - t1)
        totals["parallel_steps"] += fast.steps
        totals["monolithic_steps"] += slow.steps
        totals["tokens"] += fast.num_tokens
    totals["videos"] = len(samples)
    totals["speedup"] = totals["monolithic_ms"] / max(totals["parallel_ms"], 1e-9)
    return totals
